"""The account page in real headless Chromium (Debian's chromium, driven by Playwright) against a real
`llmgw server` process and a real llama-server: a key made on /profile answers through the openai SDK and is
then listed as used; "Connect your editor" for Continue, and its `curl … | sh` line run for real, whose file
holds a key that works too; the page fits 390 px; screenshots go to LLMGW_SCREENSHOTS (or the test's
directory)."""

from __future__ import annotations

import os
import shutil
import subprocess

import openai
import pytest
import yaml
from browsing import NARROW, PASSWORD, fits, shot_dir, sign_in
from harness import Gateway, llmgw_cmd, require

from llmgw.testing.waiting import until

pytestmark = [pytest.mark.e2e]


def _replies(url: str, key: str) -> bool:
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Say hello."}], max_tokens=8
    )
    return reply.usage is not None and reply.usage.completion_tokens > 0


def test_a_key_made_on_the_account_page_in_chromium_answers_through_the_openai_sdk(browser, engines, tmp_path):
    curl = shutil.which("curl")
    if curl is None:
        require("curl", "curl is not installed; the editor setup line is `curl … | sh`")
    (engine,) = engines("tiny")
    gw = Gateway(tmp_path, [{"name": "tiny", "endpoints": [{"url": engine.url, "engine": "llamacpp"}]}])
    try:
        gw.wait_up()
        r = subprocess.run(
            llmgw_cmd("users", "create", "erin@example.com", "--password", PASSWORD, "--config", str(gw.config)),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0, r.stdout + r.stderr
        shots = shot_dir(tmp_path)
        page = browser.new_page(viewport=NARROW)
        sign_in(page, gw.url, "erin@example.com", "/profile")
        assert page.get_attribute("nav a[href='/profile']", "aria-current") == "page"
        assert fits(page)

        # A key, shown once on the page that made it, answering through the SDK.
        page.fill("#create-key input[name=name]", "laptop")
        page.click("#create-key button[type=submit]")
        key = page.inner_text("#new-key").strip()
        assert key.startswith("llmgw-")
        assert fits(page)
        page.screenshot(path=str(shots / "profile-new-key.png"), full_page=True)
        until(lambda: _replies(gw.url, key), 30, "the new key to answer", [gw], ignore=(openai.AuthenticationError,))

        # Listed by its prefix, used, and never shown again.
        def used() -> bool:
            page.goto(gw.url + "/profile")
            return page.inner_text("tr:has-text('laptop') td:nth-child(5)").strip() != "never"

        until(used, 30, "the key to be listed as used", [gw])
        assert key not in page.content() and key[:14] in page.content()
        assert page.inner_text("#use-requests").strip() != "0"
        assert fits(page)
        page.screenshot(path=str(shots / "profile.png"), full_page=True)

        # Connect your editor: Continue, with the setup line run as a person would run it.
        page.select_option("#connect-editor select[name=tool]", "continue")
        page.click("#connect-editor button[type=submit]")
        command = page.inner_text("#editor-command").strip()
        editor_key = page.inner_text("#editor-key").strip()
        assert f"export LLMGW_API_KEY='{editor_key}'" in command and "/setup/continue?model=tiny" in command
        assert fits(page)
        page.screenshot(path=str(shots / "profile-editor.png"), full_page=True)
        home = tmp_path / "home"
        home.mkdir()
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home)}
        run = subprocess.run(["sh", "-c", command], env=env, capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr
        (model,) = yaml.safe_load((home / ".continue/assistants/llmgw.yaml").read_text())["models"]
        assert model["apiBase"] == gw.url + "/v1" and model["model"] == "tiny"
        until(
            lambda: _replies(model["apiBase"].removesuffix("/v1"), model["apiKey"]),
            30,
            "the editor's key to answer",
            [gw],
            ignore=(openai.AuthenticationError,),
        )
    finally:
        gw.stop()
