"""The pages in real headless Chromium (Debian's chromium, driven by Playwright) against a real
`llmgw server` process and a real llama-server: sign up, approval with `llmgw users approve`, sign in,
a streamed chat reply with its figures, Stop mid-reply (the engine stops too), signing out; every page
at 390 px without sideways scrolling; a screenshot of each page written to LLMGW_SCREENSHOTS (or the
test's directory)."""

from __future__ import annotations

import json
import subprocess

import httpx
import pytest
from browsing import NARROW, PASSWORD, fits, shot_dir
from harness import Gateway, llmgw_cmd

from llmgw.protocol.prometheus import parse_prometheus
from llmgw.testing.waiting import until

pytestmark = [pytest.mark.e2e]


def _processing(engine_url: str) -> float:
    name = "llamacpp:requests_processing"
    return parse_prometheus(httpx.get(engine_url + "/metrics", timeout=5).text, {name})[name]


def test_a_person_signs_up_is_approved_signs_in_and_chats_with_a_real_model_in_chromium(browser, engines, tmp_path):
    # One slot of 16384 tokens: the second turn resends the first reply (up to the page's 4096) and streams
    # another, which takes this engine a few seconds: time to press Stop in the middle of it.
    (engine,) = engines("tiny", extra=("--ctx-size", "16384", "--parallel", "1"))
    gw = Gateway(
        tmp_path,
        [
            {
                "name": "tiny",
                "description": "the tiny test model",
                "endpoints": [{"url": engine.url, "engine": "llamacpp"}],
            }
        ],
        auth={"signup_open": True},
        landing={"contact": "ops@example.com"},
    )
    try:
        gw.wait_up()
        shots = shot_dir(tmp_path)
        page = browser.new_page(viewport=NARROW)

        page.goto(gw.url + "/")
        assert f"{gw.url}/v1" in page.content() and fits(page)
        page.screenshot(path=str(shots / "landing.png"), full_page=True)
        page.goto(gw.url + "/about")
        assert fits(page)
        page.screenshot(path=str(shots / "about.png"), full_page=True)

        # Sign up: pending until an administrator approves it.
        page.goto(gw.url + "/signup")
        assert fits(page)
        page.fill("input[name=email]", "dana@example.com")
        page.fill("input[name=password]", PASSWORD)
        page.fill("input[name=password2]", PASSWORD)
        page.screenshot(path=str(shots / "signup.png"), full_page=True)
        page.click("button[type=submit]")
        page.wait_for_selector("text=waits for approval")
        page.goto(gw.url + "/login")
        page.fill("input[name=email]", "dana@example.com")
        page.fill("input[name=password]", PASSWORD)
        page.click("button[type=submit]")
        page.wait_for_selector("text=approved")  # not yet
        r = subprocess.run(
            llmgw_cmd("users", "approve", "dana@example.com", "--config", str(gw.config)),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0, r.stdout + r.stderr

        page.goto(gw.url + "/login?next=/chat")
        assert fits(page)
        page.screenshot(path=str(shots / "login.png"), full_page=True)
        page.fill("input[name=email]", "dana@example.com")
        page.fill("input[name=password]", PASSWORD)
        page.click("button[type=submit]")
        page.wait_for_url(gw.url + "/chat")
        assert page.get_attribute("nav a[href='/chat']", "aria-current") == "page"

        # A streamed reply, with its figures under it.
        page.fill("#message", "Say something.")
        page.click("#send")
        page.wait_for_selector(".turn.assistant .figures:has-text('tokens/s')", timeout=60_000)
        figures = page.inner_text(".turn.assistant .figures")
        assert "tokens" in figures and "first token" in figures and "total" in figures, figures
        assert page.inner_text(".turn.assistant .reply").strip()
        assert fits(page)
        page.screenshot(path=str(shots / "chat.png"), full_page=True)

        # Stop mid-reply: the page keeps what arrived and the engine stops generating.
        page.fill("#message", "Write at length.")
        page.click("#send")
        until(
            lambda: page.inner_text("#send") == "Stop" and page.locator(".turn.assistant .reply").nth(1).inner_text(),
            30,
            "a reply streaming",
        )
        assert _processing(engine.url) == 1
        page.click("#send")
        second = page.locator(".turn.assistant").nth(1).locator(".figures")
        until(
            lambda: "stopped" in second.inner_text(),
            30,
            "the reply to show it was stopped",
            detail=lambda: page.inner_text("#log")[-600:] + " | status: " + page.inner_text("#status"),
        )
        until(lambda: _processing(engine.url) == 0, 30, "the engine to stop generating after Stop")

        # The conversation is kept across a reload.
        page.reload()
        page.wait_for_selector(".turn.assistant >> nth=1")
        assert page.locator(".turn.user").count() == 2

        # Maths in a reply is typeset by KaTeX as MathML, under the pages' CSP; prices stay prose.
        refused: list[str] = []
        page.on("console", lambda m: refused.append(m.text) if "Content Security Policy" in m.text else None)
        page.evaluate(
            """localStorage.setItem("llmgw-chat", JSON.stringify({turns: [{role: "user", content: "maths?"},
               {role: "assistant", content: "Euler: $e^{i\\\\pi}+1=0$, and it costs $5 and $10."}]}))"""
        )
        page.reload()
        page.wait_for_selector(".turn.assistant .reply .math math")
        assert "costs $5 and $10" in page.inner_text(".turn.assistant .reply")
        assert refused == []

        # Without script the same form posts the turn and the page comes back with the reply, whole.
        plain = browser.new_context(viewport=NARROW, java_script_enabled=False).new_page()
        plain.goto(gw.url + "/login?next=/chat")
        plain.fill("input[name=email]", "dana@example.com")
        plain.fill("input[name=password]", PASSWORD)
        plain.click("main button[type=submit]")
        plain.wait_for_url(gw.url + "/chat")
        plain.fill("#message", "Say something.")
        plain.click("#send")
        plain.wait_for_selector(".turn.assistant .figures:has-text('tokens/s')", timeout=60_000)
        assert plain.inner_text(".turn.assistant .reply").strip()
        # The next form carries the conversation on (the unit tests send it back; the tiny model's
        # replies run to its context, so a second turn here would only wait for a refusal).
        carried = json.loads(plain.get_attribute("input[name=history]", "value"))
        assert [t["role"] for t in carried] == ["user", "assistant"] and carried[0]["content"] == "Say something."
        assert fits(plain)
        plain.screenshot(path=str(shots / "chat-without-script.png"), full_page=True)

        # Signing out ends the session.
        page.click("nav form.signout button")
        page.wait_for_url(gw.url + "/login")
        page.goto(gw.url + "/chat")
        assert page.url.startswith(gw.url + "/login")
    finally:
        gw.stop()
