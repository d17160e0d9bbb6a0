"""Waking an on-demand model from the chat page in real headless Chromium, against a real `llmgw server`
control plane and a real agent (mutual TLS) that installs llama.cpp from a local release server, fetches
the tiny model and runs it in a real llama-server: the person sends a message to a model with scaling
min 0 before any node has joined, and the status line shows it waiting for a node, its weights
downloading (bytes and percent; the file server holds the second half until the page has shown it),
the engine starting, and then the reply streams. The page fits 390 px; screenshots go to
LLMGW_SCREENSHOTS (or the test's directory)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from browsing import NARROW, PASSWORD, cli, fits, shot_dir, sign_in
from harness import Gateway, free_port, kill_engines, release_files, start_agent, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # an agent installs llama.cpp and serves a replica

TAG = "b9999"
MODEL_PATH = "/models/tiny.gguf"

# Every text the status line shows, in order (the page's own script is not changed for the test).
WATCH_STATUS = """() => {
  window.llmgwSeen = [];
  const el = document.getElementById("status");
  new MutationObserver(() => {
    const t = el.textContent;
    if (t && window.llmgwSeen[window.llmgwSeen.length - 1] !== t) window.llmgwSeen.push(t);
  }).observe(el, { childList: true, characterData: true, subtree: true });
}"""


def _gated_files(files: dict[str, bytes], gated: str, gate: threading.Event) -> tuple[str, callable]:
    """A plain HTTP file server whose ``gated`` file sends its first half, then the rest once ``gate`` is set:
    the download is under way, deterministically, for as long as the test needs to see it."""

    class H(BaseHTTPRequestHandler):
        def _head(self) -> bytes | None:
            body = files.get(self.path)
            self.send_response(404 if body is None else 200)
            if body is not None:
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            return body

        def do_GET(self):
            body = self._head()
            if body is None:
                return
            if self.path != gated:
                self.wfile.write(body)
                return
            half = len(body) // 2
            self.wfile.write(body[:half])
            self.wfile.flush()
            gate.wait(120)
            self.wfile.write(body[half:])

        def do_HEAD(self):
            self._head()

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{srv.server_address[1]}", srv.shutdown


def test_a_person_wakes_an_on_demand_model_from_the_chat_page_sees_it_load_and_gets_the_reply_in_chromium(
    browser, llama_server_bin, tiny_model, tmp_path
):
    pki = tmp_path / "pki"
    cli("ctl", "cert", "init-ca", "--dir", str(pki))
    cli("ctl", "cert", "issue-server", "127.0.0.1", "localhost", "--dir", str(pki))
    cli("ctl", "cert", "issue-client", "node-a", "--dir", str(pki))
    gate = threading.Event()
    files, stop_files = _gated_files(
        {**release_files(llama_server_bin, TAG), MODEL_PATH: tiny_model.read_bytes()}, MODEL_PATH, gate
    )
    agent_port = free_port()
    gw = Gateway(
        tmp_path,
        models=[
            {
                "name": "tiny",
                "description": "the tiny test model, on demand",
                "source": files + MODEL_PATH,
                "scaling": {"min": 0, "max": 1, "idle_timeout": "10m"},
                "max_output": 32,  # short replies: the second turn carries the first within the context
                "profiles": [{"engine": "llamacpp", "args": ["--ctx-size", "2048"], "startup_timeout": "180s"}],
            }
        ],
        agent_listen=f"127.0.0.1:{agent_port}",
        agent_tls={"ca": str(pki / "ca.pem"), "cert": str(pki / "server.pem"), "key": str(pki / "server-key.pem")},
        control={"enabled": True, "unreachable_after": "3s", "lost_after": "10s", "interval": "500ms"},
        engines={"llamacpp": TAG, "release_url": files},
    )
    procs = [gw]

    def replicas() -> list[dict]:
        try:
            return httpx.get(gw.admin + "/api/v1/replicas", headers=gw.admin_auth, timeout=10).json()["replicas"]
        except (httpx.HTTPError, ValueError, KeyError):
            return []

    try:
        gw.wait_up(ready=False)
        cli("users", "create", "ann@example.com", "--password", PASSWORD, "--config", str(gw.config))
        shots = shot_dir(tmp_path)
        page = browser.new_context(viewport=NARROW).new_page()
        sign_in(page, gw.url, "ann@example.com")
        page.goto(gw.url + "/chat")
        assert "(not loaded)" in page.inner_text("#model option[value=tiny]")
        page.wait_for_selector("#model-note:has-text('the first message loads it')")
        page.evaluate(WATCH_STATUS)

        # No node has joined yet: the message waits, and the status line says for what.
        page.fill("#message", "Say hello.")
        page.click("#send")
        page.wait_for_selector("#status:has-text('Waiting for a node to run tiny')", timeout=30_000)
        assert page.inner_text("#send") == "Stop"
        assert not replicas()

        # A node joins, installs llama.cpp and fetches the weights; the file server holds the second half.
        agent = start_agent(tmp_path, "node-a", agent_port, pki, supervisor={"health_interval": "2s"})
        procs.append(agent)
        wait_until(
            lambda: page.locator('#status:has-text("Downloading tiny\'s weights")').count(),
            180,
            "the status line to show the download",
            procs,
        )
        text = page.inner_text("#status")
        assert " of " in text and "%" in text, text
        assert page.is_visible("#loading-bar")
        assert fits(page)
        page.screenshot(path=str(shots / "chat-wake-downloading.png"), full_page=True)
        gate.set()

        # The engine starts, and the reply streams once it serves.
        wait_until(
            lambda: page.locator(".turn.assistant .figures:has-text('tokens')").count(),
            180,
            "the reply to stream",
            procs,
            detail=lambda: f"status line: {page.inner_text('#status')!r}; replicas: {replicas()}",
        )
        reply = page.inner_text(".turn.assistant .reply")
        assert reply.strip()
        assert page.inner_text("#send") == "Send" and page.inner_text("#status") == ""
        assert not page.is_visible("#loading-bar")
        seen = page.evaluate("window.llmgwSeen")
        assert any(s.startswith("Waiting for a node to run tiny") for s in seen), seen
        assert any(s.startswith("Downloading tiny's weights: ") and "%" in s for s in seen), seen
        # The agent learns the engine is ready within 50 ms of it (supervisor health checks
        # back off from there), so the starting state may pass between two of the page's polls;
        # when it is shown, it comes after the download.
        if "Starting the engine for tiny…" in seen:
            assert seen.index("Starting the engine for tiny…") > next(
                i for i, s in enumerate(seen) if s.startswith("Downloading")
            ), seen
        page.wait_for_selector("#model-note:has-text('This model is loaded')")
        assert page.inner_text("#model option[value=tiny]") == "tiny"  # no longer "(not loaded)"
        ready = [r for r in replicas() if r["state"] == "ready"]
        assert ready and ready[0]["model"] == "tiny"
        assert fits(page)
        page.screenshot(path=str(shots / "chat-wake-reply.png"), full_page=True)

        # The next message goes straight to the loaded model.
        page.fill("#message", "Again.")
        page.click("#send")
        page.wait_for_selector(".turn.assistant:nth-child(4) .figures:has-text('total')", timeout=60_000)
        second = page.inner_text(".turn.assistant:nth-child(4) .figures")
        assert "tokens" in second, (second, page.inner_text("#status"))
        assert not any(s.startswith("Waiting") for s in page.evaluate("window.llmgwSeen")[len(seen) :])
    finally:
        gate.set()
        engine_pids = [s["pid"] for r in replicas() for s in r.get("shards") or () if s.get("pid")]
        for p in reversed(procs):
            if p.alive():
                p.stop()
        kill_engines(engine_pids)
        stop_files()
