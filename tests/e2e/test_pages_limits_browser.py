"""The administrator's Quotas and Usage pages in real headless Chromium (Debian's chromium, driven by
Playwright) against a real `llmgw server` process and a real llama-server: an administrator made with
`llmgw users create` and `llmgw users promote` opens a project's row in place (htmx), sets its rpm to 1,
and the key's next requests through the gateway are held to it; the Usage page shows them. Each page at
390 px fits without sideways scrolling; a screenshot of each goes to LLMGW_SCREENSHOTS (or the test's
directory)."""

from __future__ import annotations

import httpx
import pytest
from browsing import ADMIN, NARROW, PASSWORD, WIDE, cli, fits, shot_dir, sign_in
from harness import Gateway

from llmgw.testing.waiting import until

pytestmark = [pytest.mark.e2e]


def test_an_administrator_sets_a_projects_rpm_in_chromium_and_the_next_request_is_refused(browser, engines, tmp_path):
    (engine,) = engines("tiny")
    gw = Gateway(tmp_path, [{"name": "tiny", "endpoints": [{"url": engine.url, "engine": "llamacpp"}]}])
    try:
        gw.wait_up()
        cli("users", "create", ADMIN, "--password", PASSWORD, "--name", "Root", config=gw.config)
        cli("users", "promote", ADMIN, config=gw.config)
        cli("org", "add", "org", "Acme", config=gw.config)
        cli("org", "add", "team", "platform", "--in", "Acme", config=gw.config)
        cli("org", "add", "project", "gateway", "--in", "Acme/platform", config=gw.config)
        cli("keys", "limits", "--scope", "team", "--id", "Acme/platform", "--tpm", "100000", config=gw.config)
        secret = gw.keys("create", "ci", "--project", "Acme/platform/gateway").stdout.strip().splitlines()[-1]
        key = {"Authorization": f"Bearer {secret}"}
        until(
            lambda: httpx.get(gw.url + "/v1/models", headers=key).status_code == 200,
            10,
            "the server to accept the key",
            [gw],
        )

        def ask() -> httpx.Response:
            body = {"model": "tiny", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8}
            return httpx.post(gw.url + "/v1/chat/completions", json=body, headers=key, timeout=60)

        assert ask().status_code == 200
        shots = shot_dir(tmp_path)
        page = browser.new_page(viewport=WIDE)
        sign_in(page, gw.url, ADMIN, "/admin/quotas")
        assert page.get_attribute("nav a[href='/admin/quotas']", "aria-current") == "page"
        assert "rate and token limits are unaffected" in page.inner_text("main")  # nothing is priced here
        project = page.locator("tbody.q-level", has_text="gateway").first
        assert "↑ 100,000" in project.inner_text()  # the team's limit, inherited
        page.screenshot(path=str(shots / "quotas-wide.png"), full_page=True)

        # The edit link swaps only the row in (htmx): the page is not reloaded.
        page.evaluate("window.llmgwMark = 1")
        project.get_by_role("link", name="edit").click()
        form = page.locator("form.q-form")
        form.wait_for()
        assert page.evaluate("window.llmgwMark") == 1
        assert form.locator("input[name=tpm]").get_attribute("placeholder") == "↑ 100,000 from team platform"
        form.locator("input[name=rpm]").fill("1")
        page.screenshot(path=str(shots / "quotas-edit.png"), full_page=True)
        form.get_by_role("button", name="Save").click()
        page.wait_for_selector("text=Saved the limits of project Acme/platform/gateway")
        assert page.locator("form.q-form").count() == 0
        rpm_cell = page.locator("tbody.q-level", has_text="gateway").first.locator("td.num").first
        assert rpm_cell.inner_text().strip() == "1"
        assert ADMIN in page.inner_text("table.q-changes")

        # The very next requests are held to it: one a minute.
        assert ask().status_code == 200
        refused = ask()
        assert refused.status_code == 429, refused.text

        # Usage: the requests that reached the engine, by project, in the last hour.
        def shown() -> bool:
            page.goto(gw.url + "/admin/usage?window=1h&by=project")
            rows = page.locator("table.u-table tbody tr", has_text="gateway")
            return rows.count() == 1 and rows.inner_text().split()[1] == "2"

        until(shown, 20, "the usage page to show the project's two requests", [gw])
        assert page.locator(".u-chart svg rect").count() == 12  # an hour in five-minute buckets, gaps filled
        page.screenshot(path=str(shots / "usage-wide.png"), full_page=True)

        page.set_viewport_size(NARROW)
        for path, name in (
            ("/admin/usage?window=1h&by=person", "usage"),
            ("/admin/quotas", "quotas"),
        ):
            page.goto(gw.url + path)
            assert fits(page), path
            page.screenshot(path=str(shots / f"{name}.png"), full_page=True)
        page.locator("tbody.q-level", has_text="gateway").first.get_by_role("link", name="edit").click()
        page.locator("form.q-form").wait_for()
        assert fits(page)
        page.screenshot(path=str(shots / "quotas-edit-narrow.png"), full_page=True)
        # Without script, the same link opens the same form.
        plain = browser.new_page(viewport=NARROW, java_script_enabled=False)
        plain.context.add_cookies(page.context.cookies())
        plain.goto(gw.url + "/admin/quotas")
        plain.locator("tbody.q-level", has_text="gateway").first.get_by_role("link", name="edit").click()
        plain.locator("form.q-form input[name=rpm]").wait_for()
        assert plain.locator("form.q-form input[name=rpm]").input_value() == "1"
    finally:
        gw.stop()
