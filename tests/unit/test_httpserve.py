"""llmgw.httpserve: what every listener answers below its handlers, its Server header, its drain."""

from __future__ import annotations

import asyncio
import logging

import orjson
import pytest
from aiohttp import WSMsgType, web

from llmgw.httpserve import SERVER, Runner, begin_drain, drain
from llmgw.server.gateway.errors import error_body
from llmgw.testing.rawhttp import exchange_async as exchange
from llmgw.testing.rawhttp import parse_response as split
from llmgw.testing.waiting import async_until

KEY = "llmgw-SECRETsecretSECRETsecretSECRETsecret12"

# Requests aiohttp's parser refuses, and the code each is answered with.
BAD = {
    "huge header": (b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n", "header_too_large"),
    "huge key header": (
        b"GET / HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() + b"a" * 9000 + b"\r\n\r\n",
        "header_too_large",
    ),
    "huge request line": (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", "header_too_large"),
    "too many headers": (
        b"GET / HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(200)) + b"\r\n",
        "too_many_headers",
    ),
    "bad request line": (b"GARBAGE\r\n\r\n", "bad_request_line"),
    "bad method": (b"G@T / HTTP/1.1\r\nHost: x\r\n\r\n", "bad_request_line"),
    "NUL after a key": (
        b"GET / HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() + b"\x00zz\r\n\r\n",
        "bad_header",
    ),
    "control byte after a key": (
        b"GET / HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() + b"\x01\r\n\r\n",
        "bad_header",
    ),
    "TLS on a plain port": (b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03", "https_on_http_port"),
}


class Listener:
    """One Runner on a free port with a handler that fails, one that is slow, one that answers."""

    def __init__(self, error_body_for=None) -> None:
        self.release = asyncio.Event()
        self.slow_started = asyncio.Event()
        self.reading = asyncio.Event()
        app = web.Application()
        app.router.add_get("/", self.ok)
        app.router.add_get("/slow", self.slow)
        app.router.add_get("/boom/{secret}", self.boom)
        app.router.add_get("/ws", self.ws)
        app.router.add_post("/read", self.read)
        self.runner = Runner(app, error_body, error_body_for, shutdown_timeout=5)

    async def ok(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def slow(self, request: web.Request) -> web.Response:
        self.slow_started.set()
        await self.release.wait()
        return web.Response(text="slow")

    async def boom(self, request: web.Request) -> web.Response:
        raise RuntimeError("a bug")

    async def read(self, request: web.Request) -> web.Response:
        self.reading.set()
        return web.Response(body=await request.read())

    async def ws(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        async for msg in ws:
            await ws.send_str(msg.data)
        return ws

    async def __aenter__(self) -> Listener:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release.set()
        await drain([self.runner])


@pytest.mark.parametrize("name", list(BAD))
async def test_a_request_the_parser_refuses_is_answered_in_the_error_shape_and_logged_as_one_line_without_its_bytes(
    name, caplog
):
    data, code = BAD[name]
    caplog.set_level(logging.DEBUG)
    async with Listener() as lis:
        status, headers, body = split(await exchange(lis.port, data))
    assert status == 400
    assert headers["content-type"].startswith("application/json")
    assert headers["server"] == SERVER
    assert headers["connection"] == "close"
    err = orjson.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == code and err["type"] == "invalid_request_error"
    # Nothing the client sent comes back or goes to the log.
    assert KEY not in err["message"] and "aaaa" not in err["message"]
    ours = [r for r in caplog.records if r.name == "llmgw.http"]
    assert len(ours) == 1 and ours[0].exc_info is None
    for r in caplog.records:
        text = r.getMessage()
        assert KEY not in text and "SECRET" not in text and "aaaa" not in text
        assert r.exc_info is None, f"{r.name} logged a traceback"


async def test_a_scanners_first_bytes_are_logged_only_when_debugging(caplog):
    caplog.set_level(logging.INFO)
    async with Listener() as lis:
        status, _, _ = split(await exchange(lis.port, BAD["TLS on a plain port"][0]))
    assert status == 400
    assert not [r for r in caplog.records if r.name.startswith(("llmgw", "aiohttp"))]


async def test_a_handler_that_raises_is_a_500_in_the_error_shape_logged_with_its_route_not_its_path(caplog):
    caplog.set_level(logging.INFO)
    async with Listener() as lis:
        status, headers, body = split(
            await exchange(lis.port, b"GET /boom/claim-token-123 HTTP/1.1\r\nHost: x\r\n\r\n")
        )
    assert status == 500 and headers["server"] == SERVER
    assert orjson.loads(body)["error"]["code"] == "internal_error"
    (rec,) = [r for r in caplog.records if r.name == "llmgw.http"]
    assert "/boom/{secret}" in rec.getMessage() and "claim-token-123" not in rec.getMessage()
    assert rec.exc_info is not None  # a bug: its traceback is worth having


async def test_no_response_names_python_or_aiohttp_in_its_server_header():
    async with Listener() as lis:
        for path in (b"/", b"/nowhere"):
            _, headers, _ = split(
                await exchange(lis.port, b"GET " + path + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            )
            assert headers["server"] == SERVER, (path, headers)
            assert "aiohttp" not in str(headers).lower() and "python" not in str(headers).lower()


async def test_while_draining_a_response_says_connection_close_so_no_client_reuses_the_connection():
    async with Listener() as lis:
        # A keep-alive request that is running when the drain begins.
        reader, writer = await asyncio.open_connection("127.0.0.1", lis.port)
        writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        await asyncio.wait_for(lis.slow_started.wait(), 5)
        stopping = asyncio.create_task(drain([lis.runner]))
        await async_until(lambda: lis.runner.draining, what="the drain to begin", interval=0)
        lis.release.set()
        raw = await asyncio.wait_for(reader.read(), 5)
        await stopping
        writer.close()
    status, headers, body = split(raw)
    assert status == 200 and body == b"slow"
    assert headers["connection"] == "close"


async def test_before_the_drain_keep_alive_is_left_as_the_client_asked():
    async with Listener() as lis:
        reader, writer = await asyncio.open_connection("127.0.0.1", lis.port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        writer.close()
    assert b"connection: close" not in head.lower()


async def test_a_websocket_opened_while_draining_keeps_its_upgrade():
    import aiohttp

    async with Listener() as lis:
        begin_drain([lis.runner])
        async with aiohttp.ClientSession() as s, s.ws_connect(f"http://127.0.0.1:{lis.port}/ws") as ws:
            await ws.send_str("hello")
            msg = await ws.receive(timeout=5)
            assert msg.type == WSMsgType.TEXT and msg.data == "hello"


@pytest.mark.parametrize(
    "data,code",
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\nGARBAGE", "data_after_close"),
        (b"GET / HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n", "duplicate_header"),
        (b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "invalid_http"),
        (b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 1" + b"\x00" + b"2\r\n\r\n", "invalid_http"),
    ],
)
async def test_other_malformed_requests_are_refused_with_a_code_and_nothing_they_sent(data, code, caplog):
    caplog.set_level(logging.DEBUG)
    async with Listener() as lis:
        raw = await exchange(lis.port, data)
    status, headers, body = split(raw)
    assert status == 400 and headers["server"] == SERVER
    err = orjson.loads(body)["error"]
    assert err["code"] == code and "GARBAGE" not in err["message"] and "zz" not in err["message"]
    assert not [r for r in caplog.records if r.exc_info]


async def test_a_body_that_does_not_decode_is_a_400_not_a_500_with_a_traceback(caplog):
    caplog.set_level(logging.DEBUG)
    async with Listener() as lis:
        raw = await exchange(
            lis.port,
            b"POST /read HTTP/1.1\r\nHost: x\r\nContent-Encoding: gzip\r\nContent-Length: 12\r\n\r\nnot-gzip-at!",
        )
    status, headers, body = split(raw)
    assert status == 400 and headers["server"] == SERVER
    assert orjson.loads(body)["error"]["code"] == "bad_body"
    assert not [r for r in caplog.records if r.exc_info]


async def test_a_deflate_body_that_stops_short_after_its_handler_began_is_a_400_not_a_wait_forever(caplog):
    # aiohttp finds the short stream when the body ends and queues its refusal behind the running
    # request, which would wait for the rest of its body until the client gave up.
    caplog.set_level(logging.DEBUG)
    async with Listener() as lis:
        reader, writer = await asyncio.open_connection("127.0.0.1", lis.port)
        try:
            writer.write(b"POST /read HTTP/1.1\r\nHost: x\r\nContent-Encoding: deflate\r\nContent-Length: 3\r\n\r\n")
            await writer.drain()
            await async_until(lis.reading.is_set, 5, "the handler to start reading its body")
            writer.write(b"x\x9cK")  # a zlib header and one byte of a stream that never ends
            await writer.drain()
            raw = await asyncio.wait_for(reader.read(), 5)
        finally:
            writer.close()
    status, headers, body = split(raw)
    assert status == 400 and headers["connection"] == "close"
    assert orjson.loads(body)["error"]["code"] == "bad_body"
    assert not [r for r in caplog.records if r.exc_info]


async def test_a_deflate_body_that_stops_short_in_one_packet_is_a_400_too():
    async with Listener() as lis:
        raw = await exchange(
            lis.port, b"POST /read HTTP/1.1\r\nHost: x\r\nContent-Encoding: deflate\r\nContent-Length: 3\r\n\r\nx\x9cK"
        )
    status, _, body = split(raw)
    assert status == 400 and orjson.loads(body)["error"]["code"] == "bad_body"


async def test_an_encoding_without_a_decoder_here_is_a_415_that_names_the_ones_read():
    async with Listener() as lis:
        raw = await exchange(
            lis.port, b"POST /read HTTP/1.1\r\nHost: x\r\nContent-Encoding: br\r\nContent-Length: 2\r\n\r\n{}"
        )
    status, _, body = split(raw)
    err = orjson.loads(body)["error"]
    assert status == 415 and err["code"] == "unsupported_encoding" and "gzip or deflate" in err["message"]
    assert "install" not in err["message"]  # aiohttp's advice is for the operator, not the client


async def test_a_listener_with_two_apis_answers_a_failure_in_the_shape_of_the_one_called():
    def shape(request):
        if request.path.startswith("/read"):
            return lambda status, message, code: orjson.dumps({"type": "error", "error": {"message": message}})
        return error_body

    async with Listener(shape) as lis:
        broken = b"POST /read HTTP/1.1\r\nHost: x\r\nContent-Encoding: gzip\r\nContent-Length: 5\r\n\r\nnope!"
        status, _, body = split(await exchange(lis.port, broken))
        assert status == 400 and orjson.loads(body)["type"] == "error"
        status, _, body = split(await exchange(lis.port, b"GET /boom/x HTTP/1.1\r\nHost: x\r\n\r\n"))
        assert status == 500 and orjson.loads(body)["error"]["code"] == "internal_error"
        # Refused by the parser before any request exists (a deflate body sent with its headers
        # that stops short): shaped by the path the bytes asked for.
        short = b"POST /read HTTP/1.1\r\nHost: x\r\nContent-Encoding: deflate\r\nContent-Length: 3\r\n\r\nx\x9cK"
        status, _, body = split(await exchange(lis.port, short))
        assert status == 400 and orjson.loads(body)["type"] == "error"
        status, _, body = split(await exchange(lis.port, short.replace(b"/read", b"/other")))
        assert status == 400 and orjson.loads(body)["error"]["code"] == "bad_body"
