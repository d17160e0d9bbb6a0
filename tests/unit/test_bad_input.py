"""Bad input to a running Server, on every listener: refused in the error shape, never a 500, never a key in the log."""

from __future__ import annotations

import asyncio
import logging
import socket

import orjson
import pytest

from llmgw.config import parse_server_config
from llmgw.server.app import Server
from llmgw.server.gateway.auth import AuthError, KeyCache
from llmgw.testing.fake_engine import FakeEngine
from llmgw.testing.rawhttp import exchange_async as exchange
from llmgw.testing.rawhttp import parse_response as split
from llmgw.testing.waiting import async_until

# aiohttp hands the bytes of "é\xff" through as these surrogates.
NON_ASCII = "Bearer llmgw-abc\udcc3\udca9\udcff"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _NoKeys:
    async def keys_generation(self):
        return 1

    async def active_keys(self):
        return []

    async def revoked_key_hashes(self):
        return []


async def test_a_key_with_bytes_that_are_not_ascii_is_an_invalid_key_not_an_exception():
    cache = KeyCache(_NoKeys())
    await cache.load()
    for header in (NON_ASCII, "Bearer llmgw-caf\u00e9", "B\u00e9arer llmgw-x"):
        with pytest.raises(AuthError) as ei:
            cache.authenticate(header)
        assert ei.value.code == "invalid_api_key" and "not ASCII" in ei.value.message


@pytest.fixture
async def server(tmp_path):
    engine = await FakeEngine(model="m").start()
    cfg = parse_server_config(
        {
            "listen": f"127.0.0.1:{_port()}",
            "admin_listen": f"127.0.0.1:{_port()}",
            "metrics_listen": f"127.0.0.1:{_port()}",
            "agent_listen": f"127.0.0.1:{_port()}",
            "agent_tls": None,
            "control": {"enabled": True},
            "auth": {"store": str(tmp_path / "gw.db")},
            "data_dir": str(tmp_path),
            "models": [{"name": "m", "endpoints": [{"url": engine.url, "engine": "llamacpp"}]}],
        }
    )
    srv = Server(cfg)
    await srv.start()
    try:
        yield srv
    finally:
        await srv.stop()
        await engine.stop()


def _ports(srv: Server) -> dict[str, int]:
    c = srv.config
    return {
        "listen": c.listen.port,
        "admin_listen": c.admin_listen.port,
        "metrics_listen": c.metrics_listen.port,
        "agent_listen": c.agent_listen.port,
    }


async def test_a_non_ascii_authorization_is_a_401_in_openais_shape(server):
    port = server.config.listen.port
    for req, body in (
        (b"GET /v1/models HTTP/1.1\r\n", b""),
        (b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 2\r\n", b"{}"),
    ):
        raw = await exchange(
            port, req + b"Host: x\r\nAuthorization: Bearer llmgw-abc\xc3\xa9\xff\r\nConnection: close\r\n\r\n" + body
        )
        status, headers, body = split(raw)
        assert status == 401, raw
        assert orjson.loads(body)["error"]["code"] == "invalid_api_key"
        assert headers["server"] == "llmgw"


async def test_a_claim_link_that_is_not_ascii_is_not_found_without_an_error(server):
    raw = await exchange(
        server.config.listen.port,
        b"POST /claim/%C3%A9%C3%A9 HTTP/1.1\r\nHost: x\r\n"
        b"Accept: application/json\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
    )
    status, _, body = split(raw)
    assert status == 404 and orjson.loads(body)["error"]["message"] == "This claim link is not valid."


async def test_every_listener_refuses_a_nul_after_a_key_in_the_error_shape_without_logging_the_key(server, caplog):
    caplog.set_level(logging.DEBUG)
    key = "llmgw-TOPSECRETtopsecretTOPSECRETtopsecret"
    for name, port in _ports(server).items():
        raw = await exchange(
            port, b"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + key.encode() + b"\x00\r\n\r\n"
        )
        status, headers, body = split(raw)
        assert status == 400, (name, raw)
        assert headers["server"] == "llmgw"
        assert orjson.loads(body)["error"]["code"] == "bad_header", name
    assert not [r for r in caplog.records if r.exc_info]
    assert not [r for r in caplog.records if "TOPSECRET" in r.getMessage()]


async def test_no_listener_names_python_or_aiohttp_in_its_server_header(server):
    for name, port in _ports(server).items():
        for path in (b"/health", b"/metrics", b"/nothing-here"):
            raw = await exchange(port, b"GET " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            _, headers, _ = split(raw)
            assert headers.get("server") == "llmgw", (name, path, raw[:200])


async def test_a_request_running_when_the_server_stops_is_answered_with_connection_close(tmp_path):
    engine = await FakeEngine(model="m", ttft_ms=1500).start()
    cfg = parse_server_config(
        {
            "listen": f"127.0.0.1:{_port()}",
            "admin_listen": f"127.0.0.1:{_port()}",
            "metrics_listen": None,
            "auth": {"enabled": False, "store": str(tmp_path / "gw.db")},
            "data_dir": str(tmp_path),
            "models": [{"name": "m", "endpoints": [{"url": engine.url, "engine": "llamacpp"}]}],
        }
    )
    srv = Server(cfg)
    await srv.start()
    stopping = None
    try:
        body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        reader, writer = await asyncio.open_connection("127.0.0.1", cfg.listen.port)
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body) + body
        )
        await writer.drain()
        await async_until(lambda: engine.processing > 0, what="the engine to take the request")
        stopping = asyncio.create_task(srv.stop())
        raw = await asyncio.wait_for(reader.read(), 10)
        await stopping
        writer.close()
    finally:
        if stopping is None:
            await srv.stop()
        await engine.stop()
    status, headers, _ = split(raw)
    assert status == 200 and headers["connection"] == "close"


async def test_the_mirrors_listeners_refuse_bad_requests_in_their_own_shape_and_name_no_versions(tmp_path, caplog):
    from aiohttp import web

    from llmgw.config.types import parse_listen
    from llmgw.mirror.serve import start_listeners, weights_app

    caplog.set_level(logging.DEBUG)
    ports = {"weights": _port(), "api": _port()}
    running = await start_listeners(
        tmp_path,
        weights_app(tmp_path),
        parse_listen(f"127.0.0.1:{ports['weights']}"),
        web.Application(),
        parse_listen(f"127.0.0.1:{ports['api']}"),
        None,
        lambda line: None,
        "api",
    )
    try:
        for name, port in ports.items():
            raw = await exchange(
                port, b"GET /m/v/f HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer mirror-SECRET\x00\r\n\r\n"
            )
            status, headers, body = split(raw)
            assert status == 400 and headers["server"] == "llmgw", name
            err = orjson.loads(body)["error"]  # the mirror API's shape: a message, and here a code
            assert set(err) == {"message", "code"} and err["code"] == "bad_header", name
            _, headers, _ = split(await exchange(port, b"GET /m/v/f HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"))
            assert headers["server"] == "llmgw", name
    finally:
        await running.close()
    assert not [r for r in caplog.records if r.exc_info or "SECRET" in r.getMessage()]
