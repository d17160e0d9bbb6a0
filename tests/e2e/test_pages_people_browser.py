"""People (/admin/users) in real headless Chromium against a real `llmgw server`: with script, each action
is sent by htmx and only the People part of the page is swapped — no reload, the projects that were open
stay open, and a refusal is shown in place; without script the same forms work as plain posts."""

from __future__ import annotations

import pytest
from browsing import ADMIN, NARROW, PASSWORD, cli, fits, shot_dir, sign_in
from harness import Gateway, wait_until

pytestmark = [pytest.mark.e2e]

# Polled from here: the page's CSP forbids the eval behind a string wait_for_function.
BOTH_OPEN = "document.querySelectorAll('details.admin-project[open]').length === 2"


def _people(gw: Gateway) -> None:
    """An organization with one team, two projects, one person in each."""
    cli("users", "create", ADMIN, "--password", PASSWORD, config=gw.config)
    cli("users", "promote", ADMIN, config=gw.config)
    cli("org", "add", "org", "Acme", config=gw.config)
    cli("org", "add", "team", "platform", "--in", "Acme", config=gw.config)
    for project, person in (("gateway", "gail@example.com"), ("fleet", "fred@example.com")):
        cli("org", "add", "project", project, "--in", "Acme/platform", config=gw.config)
        cli("users", "create", person, "--password", PASSWORD, config=gw.config)
        cli("users", "join", person, "--project", f"Acme/platform/{project}", config=gw.config)


def test_people_actions_swap_in_place_keeping_open_projects_open_and_show_a_refusal_there(browser, tmp_path):
    gw = Gateway(tmp_path, [])
    try:
        gw.wait_up(ready=False)
        _people(gw)
        page = browser.new_page(viewport=NARROW)
        sign_in(page, gw.url, ADMIN, "/admin/users")
        page.evaluate("window.notReloaded = true")
        for project in ("gateway", "fleet"):
            page.click(f"details.admin-project > summary:has-text('{project}')")
        gateway = page.locator("details.admin-project:has(> summary:has-text('gateway'))")
        assert "gail@example.com" in gateway.inner_text()

        # Take Gail out of gateway: htmx posts it, the answer's People part replaces this one.
        with page.expect_response(lambda r: r.request.headers.get("hx-request") == "true"):
            gateway.locator("button[aria-label='Take gail@example.com out']").click()
        page.wait_for_selector("p.done:has-text('Took them out of Acme/platform/gateway')")
        assert page.evaluate("window.notReloaded === true")  # swapped, not loaded again
        # Reopened once htmx settles the swap, a moment after the new part is in.
        wait_until(lambda: page.evaluate(BOTH_OPEN), 10, "both projects to be open again")
        assert "gail@example.com" not in gateway.inner_text()
        assert "fred@example.com" in page.inner_text("details.admin-project:has(> summary:has-text('fleet'))")

        # Removing an organization that is not empty: the store's refusal, in place.
        acme = page.locator("li[id^=org-]").first
        acme.locator("summary[aria-label='More for Acme']").click()
        acme.locator("button:has-text('Remove Acme')").first.click()
        page.wait_for_selector("p.problem")
        assert page.evaluate("window.notReloaded === true")
        wait_until(lambda: page.evaluate(BOTH_OPEN), 10, "both projects to be open again after the refusal")
        assert "Acme" in page.inner_text("p.problem")
        assert fits(page)
        page.screenshot(path=str(shot_dir(tmp_path) / "admin-people-in-place.png"), full_page=True)

        # Without script the same form is a plain post answered by a redirect back to the page.
        plain = browser.new_context(viewport=NARROW, java_script_enabled=False).new_page()
        sign_in(plain, gw.url, ADMIN, "/admin/users")
        plain.click("details.admin-project > summary:has-text('fleet')")
        plain.locator("button[aria-label='Take fred@example.com out']").click()
        plain.wait_for_selector("p.done:has-text('Took them out of Acme/platform/fleet')")
        assert "/admin/users" in plain.url
    finally:
        gw.stop()
