"""`llmgw server` as a process, sent what a careless or hostile client sends over a raw socket.

Every refusal comes back in OpenAI's error shape, the log has one line for it and
never a traceback or a key, no response names Python or aiohttp, and a request
running when SIGTERM arrives is answered with `Connection: close`.
"""

from __future__ import annotations

import signal
import socket
import sys
import threading

import httpx
import orjson
import pytest
from harness import Gateway, Proc, free_port, wait_http, wait_until

from llmgw.testing.rawhttp import exchange
from llmgw.testing.rawhttp import parse_response as split

pytestmark = pytest.mark.e2e


def fake_engine(tmp_path, ttft_ms: int) -> tuple[Proc, str]:
    port = free_port()
    engine = Proc(
        [
            sys.executable,
            "-m",
            "llmgw.testing.fake_engine",
            "--port",
            str(port),
            "--model",
            "fake",
            "--ttft-ms",
            str(ttft_ms),
            "--tokens",
            "3",
        ],
        tmp_path / "fake-engine.log",
    )
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", engine.proc, 30, engine.log)
    return engine, url


def test_bad_requests_on_every_listener_get_the_error_shape_and_leave_no_traceback_or_key_in_the_log(tmp_path):
    engine, url = fake_engine(tmp_path, ttft_ms=0)
    ports = {"metrics_listen": free_port(), "agent_listen": free_port()}
    # Every listener llmgw server has: the agents' too (plaintext here, the parser comes before TLS matters).
    gw = Gateway(
        tmp_path,
        models=[{"name": "fake", "endpoints": [{"url": url, "engine": "llamacpp"}]}],
        metrics_listen=f"127.0.0.1:{ports['metrics_listen']}",
        agent_listen=f"127.0.0.1:{ports['agent_listen']}",
        agent_tls=None,
        control={"enabled": True},
    ).wait_up()
    try:
        _refusals(gw, {"listen": gw.port, "admin_listen": gw.admin_port, **ports})
    finally:
        try:
            assert gw.stop() == 0, gw.text()
        finally:
            engine.kill()  # also when the stop fails: no engine outlives the test


def _refusals(gw: Gateway, ports: dict[str, int]) -> None:
    key = gw.create_key("victim")
    auth = f"Authorization: Bearer {key}".encode()
    client = ports["listen"]
    cases = [
        (client, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + auth + b"a" * 9000 + b"\r\n\r\n", 400, "header_too_large"),
        (
            client,
            b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(300)) + b"\r\n",
            400,
            "too_many_headers",
        ),
        (client, b"GET not-a-path HTTP/1.1\r\nHost: x\r\n\r\n", 400, "bad_request_line"),
        (client, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + auth + b"\x00\r\n\r\n", 400, "bad_header"),
        (
            client,
            b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
            + key[:20].encode()
            + b"\xc3\xa9\xff\r\nConnection: close\r\n\r\n",
            401,
            "invalid_api_key",
        ),
        (
            client,
            (
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\n"
                b"Content-Length: 2\r\nConnection: close\r\n\r\n{}"
            ),
            401,
            "invalid_api_key",
        ),
    ]
    # The same NUL after a key on the other listeners, refused before any of their routes.
    cases += [
        (ports[n], b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + auth + b"\x00\r\n\r\n", 400, "bad_header")
        for n in ("admin_listen", "metrics_listen", "agent_listen")
    ]
    for port, data, status, code in cases:
        raw = exchange(port, data)
        got, headers, body = split(raw)
        assert got == status, raw[:300]
        err = orjson.loads(body)["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == code
        assert key not in err["message"]
        assert headers["server"] == "llmgw", headers
    # A request that is fine says the same about its server.
    r = httpx.get(gw.url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200 and r.headers["server"] == "llmgw"

    refusals = 7  # one line for each request the parser refused (the 401s are ordinary answers)
    wait_until(lambda: gw.text().count("refused a request from") >= refusals, 10, "the refusals to be logged", [gw])
    log = gw.text()
    assert "Traceback" not in log
    assert key not in log and key[14:] not in log  # the visible prefix (14 characters) may be named, never the rest
    assert "aiohttp.server" not in log


def _slow_request(port: int, stream: bool, out: dict, name: str) -> None:
    body = orjson.dumps({"model": "fake", "stream": stream, "messages": [{"role": "user", "content": "hi"}]})
    # A keep-alive request: HTTP/1.1 and no Connection header.
    out[name] = exchange(
        port,
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body) + body,
        timeout=30,
    )


def test_requests_running_when_sigterm_arrives_are_answered_with_connection_close(tmp_path):
    engine, url = fake_engine(tmp_path, ttft_ms=4000)
    gw = Gateway(
        tmp_path, models=[{"name": "fake", "endpoints": [{"url": url, "engine": "llamacpp"}]}], auth={"enabled": False}
    ).wait_up()
    try:
        out: dict[str, bytes] = {}
        threads = [
            threading.Thread(target=_slow_request, args=(gw.port, stream, out, name))
            for name, stream in (("plain", False), ("stream", True))
        ]
        for t in threads:
            t.start()
        wait_until(
            lambda: "requests_processing 2" in httpx.get(url + "/metrics").text,
            20,
            "both requests to reach the engine",
            [gw, engine],
        )
        gw.proc.send_signal(signal.SIGTERM)

        def refused() -> bool:
            try:
                socket.create_connection(("127.0.0.1", gw.port), timeout=1).close()
            except ConnectionRefusedError:
                return True
            return False

        # The listener stops accepting while both requests are still running...
        wait_until(refused, 10, "the listener to stop accepting", [gw])
        assert all(t.is_alive() for t in threads), "the engine answered before the drain could be seen"
        for t in threads:
            t.join(30)
        # ...and each is answered in full, saying the connection goes with it.
        for name in ("plain", "stream"):
            status, headers, _ = split(out[name])
            assert status == 200, out[name][:300]
            assert headers["connection"] == "close", (name, headers)
            assert headers["server"] == "llmgw"
        assert b"[DONE]" in out["stream"]
        assert gw.proc.wait(30) == 0, gw.text()
    finally:
        gw.stop()
        engine.kill()


def test_input_no_route_can_take_is_refused_in_the_apis_shape_with_one_log_line_and_no_traceback(tmp_path):
    """The requests that were 500s with a traceback (max_tokens 2**64 on /v1/messages, a NUL in
    previous_response_id, GET /v1/threads/<id>%00) and a broken gzip body on /v1/messages (once in
    OpenAI's shape), sent to a real `llmgw server` with a key of a project that keeps conversations."""
    import asyncio
    import gzip

    from llmgw.store import Store

    engine, url = fake_engine(tmp_path, ttft_ms=0)
    gw = Gateway(tmp_path, models=[{"name": "fake", "endpoints": [{"url": url, "engine": "llamacpp"}]}]).wait_up()
    try:

        async def tenancy() -> None:
            s = await Store.open(gw.store)
            try:
                await s.add_org("Acme")
                await s.add_team("platform", "Acme")
                await s.add_project("agents", "Acme/platform")
            finally:
                await s.close()

        asyncio.run(tenancy())
        r = gw.keys("threads", "--project", "Acme/platform/agents", "--retain-hours", "24")
        assert r.returncode == 0, r.stderr
        r = gw.keys("create", "--name", "agent", "--project", "Acme/platform/agents")
        assert r.returncode == 0, r.stderr
        key = r.stdout.strip().splitlines()[-1]
        auth = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        wait_until(
            lambda: httpx.get(gw.url + "/v1/threads/thr_none", headers=auth).status_code == 404,
            10,
            "the server to accept the key and keep its project's conversations",
            [gw],
        )
        hi = b'"messages":[{"role":"user","content":"hi"}]'
        cases = [
            ("POST", "/v1/messages", b'{"model":"fake","max_tokens":18446744073709551616,' + hi + b"}", {}, True),
            (
                "POST",
                "/v1/responses",
                b'{"model":"fake","input":"hi","previous_response_id":"resp_\\u0000"}',
                {},
                False,
            ),
            ("GET", "/v1/threads/thr_x%00", b"", {}, False),
            ("POST", "/v1/messages", gzip.compress(b"{}")[:12] + b"broken", {"Content-Encoding": "gzip"}, True),
        ]
        for method, path, body, headers, anthropic in cases:
            r = httpx.request(method, gw.url + path, content=body, headers={**auth, **headers})
            assert r.status_code == 400, (path, r.status_code, r.text)
            if anthropic:
                assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error", r.text
            else:
                assert r.json()["error"]["code"] in ("invalid_id", "number_too_large"), r.text
        wait_until(
            lambda: gw.text().count("refused a request from 127.0.0.1 to ") >= len(cases),
            10,
            "a log line for each refusal",
            [gw],
        )
        log = gw.text()
        assert log.count("refused a request from 127.0.0.1 to ") == len(cases), log
        for route in ("POST /v1/messages", "POST /v1/responses", "GET /v1/threads/{thread}"):
            assert f"to {route}: " in log
        assert "Traceback" not in log and key[14:] not in log
    finally:
        try:
            assert gw.stop() == 0, gw.text()
        finally:
            engine.kill()
