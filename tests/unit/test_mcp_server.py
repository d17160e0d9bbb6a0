"""llmgw.server.gateway.mcp: the MCP server on the streamable HTTP transport, driven by the
official `mcp` SDK's client (what MCP clients really send and expect) and by raw HTTP (what
a client must be refused)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import mcp
import pytest
from aiohttp import web
from mcp import ClientSession
from mcp.client import session as client_session
from mcp.client import streamable_http

from llmgw.server.gateway.limits import LimitError
from llmgw.server.gateway.mcp import LIMITED, PROTOCOL_VERSIONS, McpServer, Tool, ToolError
from llmgw.testing.mcp_client import client_streams
from llmgw.testing.mcp_client import official_client as shared_official_client
from llmgw.testing.waiting import async_until
from llmgw.webguard import bearer_token

# The SDK's names moved between releases (pyproject admits mcp>=1.9); these follow them.
try:
    from mcp.shared.exceptions import MCPError
except ImportError:
    from mcp.shared.exceptions import McpError as MCPError
# What ClientSession.initialize offers: mcp 1's LATEST_PROTOCOL_VERSION; mcp 2's is the stateless
# revision, which initialize never offers, so its session module names the handshake's newest.
CLIENT_OFFERS = getattr(client_session, "LATEST_HANDSHAKE_VERSION", None) or mcp.types.LATEST_PROTOCOL_VERSION

ACCEPT = "application/json, text/event-stream"


async def _add(caller: Any, args: dict[str, Any]) -> dict[str, Any]:
    return {"sum": args["a"] + args["b"], "by": caller}


async def _echo(caller: Any, args: dict[str, Any]) -> str:
    return args["text"]


async def _fail(caller: Any, args: dict[str, Any]) -> Any:
    raise ToolError("the notes store is offline; try again later")


async def _crash(caller: Any, args: dict[str, Any]) -> Any:
    raise RuntimeError("secret path /var/lib/llmgw/notes.db is locked")


TOOLS = [
    Tool(
        "add",
        "Add two integers.",
        {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]},
        _add,
        read_only=True,
    ),
    Tool(
        "echo",
        "Say the text back.",
        {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
        _echo,
    ),
    Tool("fail", "Always fails, as a tool does.", {"type": "object", "properties": {}}, _fail),
    Tool("crash", "Always fails, as a bug does.", {"type": "object", "properties": {}}, _crash),
]


def toy_server(**kwargs: Any) -> McpServer:
    return McpServer("llmgw-test", "9.9", TOOLS, instructions="Toy tools for the tests.", **kwargs)


@dataclass
class Served:
    url: str
    # (method, status, session id the response issued) of every request, in order.
    seen: list[tuple[str, int, str | None]] = field(default_factory=list)

    def issued(self) -> list[str]:
        return [sid for _, _, sid in self.seen if sid]


@asynccontextmanager
async def serving(server: McpServer, admit: Any = None) -> AsyncIterator[Served]:
    """The server at /mcp of a real listener; the bearer token is both the caller and the owner."""
    served = Served("")

    async def route(request: web.Request) -> web.StreamResponse:
        token = bearer_token(request)
        if token is None:
            return web.Response(status=401)
        resp = await server.handle(request, f"caller-{token}", token, admit)
        served.seen.append((request.method, resp.status, resp.headers.get("Mcp-Session-Id")))
        return resp

    app = web.Application()
    app.router.add_route("*", "/mcp", route)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    served.url = f"http://127.0.0.1:{port}/mcp"
    try:
        yield served
    finally:
        await runner.cleanup()


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    async with serving(toy_server()) as s:
        yield s


@asynccontextmanager
async def official_client(url: str, token: str = "alice") -> AsyncIterator[ClientSession]:
    async with shared_official_client(url, token) as session:
        yield session


def dump(model: Any) -> dict[str, Any]:
    """The wire spelling (camelCase) of one of the SDK's models, whatever its attribute names."""
    return model.model_dump(by_alias=True, exclude_none=True, mode="json")


@asynccontextmanager
async def raw(url: str, token: str = "alice") -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(
        base_url=url.removesuffix("/mcp"), headers={"Authorization": f"Bearer {token}", "Accept": ACCEPT}, timeout=30
    ) as c:
        yield c


async def initialize(c: httpx.AsyncClient, version: str = "2025-06-18") -> str:
    r = await c.post("/mcp", json=rpc("initialize", protocolVersion=version, capabilities={}, clientInfo={"name": "t"}))
    assert r.status_code == 200, r.text
    return r.headers["Mcp-Session-Id"]


def rpc(method: str, id_: int | str | None = 1, **params: Any) -> dict[str, Any]:
    m: dict[str, Any] = {"jsonrpc": "2.0", "method": method, "params": params}
    if id_ is not None:
        m["id"] = id_
    return m


# The official client


async def test_the_official_client_gets_the_version_it_offers_and_reads_who_the_server_is(served):
    assert CLIENT_OFFERS in PROTOCOL_VERSIONS
    async with client_streams(served.url, "alice") as (read, write), ClientSession(read, write) as session:
        info = dump(await session.initialize())
    assert info["protocolVersion"] == CLIENT_OFFERS
    assert info["serverInfo"] == {"name": "llmgw-test", "version": "9.9"}
    assert info["instructions"] == "Toy tools for the tests."
    assert info["capabilities"]["tools"] == {"listChanged": False}


async def test_tools_are_listed_with_their_schemas_and_read_only_annotations(served):
    async with official_client(served.url) as session:
        listed = {t["name"]: t for t in (dump(t) for t in (await session.list_tools()).tools)}
    assert list(listed) == ["add", "echo", "fail", "crash"]
    assert listed["add"]["inputSchema"] == TOOLS[0].input_schema
    assert listed["add"]["description"] == "Add two integers."
    assert listed["add"]["annotations"] == {"readOnlyHint": True, "destructiveHint": False}
    assert listed["echo"]["annotations"] == {"readOnlyHint": False, "destructiveHint": True}


async def test_a_dict_result_arrives_as_structured_content_and_as_json_text_with_the_caller_passed(served):
    async with official_client(served.url, token="alice") as session:
        result = dump(await session.call_tool("add", {"a": 2, "b": 3}))
    assert result["isError"] is False
    assert result["structuredContent"] == {"sum": 5, "by": "caller-alice"}
    assert result["content"] == [{"type": "text", "text": '{"sum":5,"by":"caller-alice"}'}]


async def test_a_string_result_arrives_as_its_text_without_structured_content(served):
    async with official_client(served.url) as session:
        result = dump(await session.call_tool("echo", {"text": 'héllo "there"'}))
    assert result["isError"] is False
    assert result["content"] == [{"type": "text", "text": 'héllo "there"'}]
    assert "structuredContent" not in result


async def test_a_tool_error_is_a_result_the_model_reads_not_a_protocol_error(served):
    async with official_client(served.url) as session:
        result = dump(await session.call_tool("fail", {}))
    assert result["isError"] is True
    assert result["content"] == [{"type": "text", "text": "the notes store is offline; try again later"}]


async def test_a_missing_argument_is_a_result_naming_the_argument_and_its_type(served):
    async with official_client(served.url) as session:
        result = dump(await session.call_tool("add", {"a": 2}))
    assert result["isError"] is True
    text = result["content"][0]["text"]
    assert "'b'" in text and "integer" in text, text


async def test_an_argument_of_the_wrong_type_is_a_result_saying_what_was_expected(served):
    async with official_client(served.url) as session:
        wrong = dump(await session.call_tool("add", {"a": 2, "b": "3"}))
        boolean = dump(await session.call_tool("add", {"a": 2, "b": True}))
        integral = dump(await session.call_tool("add", {"a": 2, "b": 3.0}))
    assert wrong["isError"] is True
    assert "'b' must be integer, not string" in wrong["content"][0]["text"]
    # JSON has no ints among its booleans, whatever Python thinks.
    assert boolean["isError"] is True
    assert "not boolean" in boolean["content"][0]["text"]
    # 3.0 is an integer to JSON Schema, and the tool gets the int it declared.
    assert integral["structuredContent"]["sum"] == 5
    assert integral["content"][0]["text"] == '{"sum":5,"by":"caller-alice"}'


async def test_an_unknown_tool_is_a_protocol_error_naming_it(served):
    async with official_client(served.url) as session:
        with pytest.raises(MCPError) as caught:
            await session.call_tool("nope", {})
    assert caught.value.error.code == -32602
    assert "nope" in caught.value.error.message


async def test_a_crashing_tool_is_an_internal_error_that_leaks_nothing_but_is_logged(served, caplog):
    caplog.set_level(logging.ERROR, logger="llmgw.gateway.mcp")
    async with official_client(served.url) as session:
        with pytest.raises(MCPError) as caught:
            await session.call_tool("crash", {})
    assert (caught.value.error.code, caught.value.error.message) == (-32603, "internal error")
    assert caught.value.error.data is None
    [record] = [r for r in caplog.records if r.name == "llmgw.gateway.mcp"]
    assert record.exc_info is not None and "notes.db is locked" in str(record.exc_info[1])


async def test_the_client_ends_its_session_with_delete_when_it_closes(served):
    async with official_client(served.url) as session:
        await session.send_ping()
    [sid] = served.issued()
    assert ("DELETE", 200, None) in served.seen
    async with raw(served.url) as c:
        r = await c.post("/mcp", json=rpc("ping"), headers={"Mcp-Session-Id": sid})
    assert r.status_code == 404


async def test_the_clients_get_for_a_server_stream_is_refused_405_and_the_session_goes_on(served):
    async with official_client(served.url) as session:
        # The client opens the stream in the background once initialized.
        await async_until(lambda: any(m == "GET" for m, _, _ in served.seen), what="the client's GET")
        await session.send_ping()
        result = dump(await session.call_tool("echo", {"text": "still here"}))
    assert {status for method, status, _ in served.seen if method == "GET"} == {405}
    assert result["content"][0]["text"] == "still here"


async def test_a_client_probing_for_the_stateless_protocol_falls_back_to_initialize(served):
    client_cls = getattr(mcp, "Client", None)
    if client_cls is None:
        pytest.skip("this mcp has no Client with mode='auto' (it probes server/discover first)")
    async with (
        streamable_http.httpx2.AsyncClient(headers={"Authorization": "Bearer alice"}) as http,
        client_cls(streamable_http.streamable_http_client(served.url, http_client=http), mode="auto") as client,
    ):
        result = dump(await client.call_tool("echo", {"text": "hi"}))
    assert result["content"] == [{"type": "text", "text": "hi"}]
    # The probe was refused before any session existed; initialize then made one.
    assert served.seen[0][:2] == ("POST", 400)
    assert len(served.issued()) == 1


# Raw HTTP: what a client is refused, and the corners the official client does not reach


async def test_a_request_without_a_session_is_refused_400_with_a_json_rpc_error(served):
    async with raw(served.url) as c:
        r = await c.post("/mcp", json=rpc("tools/list"))
    assert r.status_code == 400
    assert r.headers["Content-Type"].startswith("application/json")
    assert r.json()["error"]["code"] == -32600
    assert "Mcp-Session-Id" in r.json()["error"]["message"]


async def test_a_session_presented_by_another_owner_is_answered_as_unknown(served):
    async with raw(served.url, "alice") as alice, raw(served.url, "mallory") as mallory:
        sid = await initialize(alice)
        stolen = await mallory.post("/mcp", json=rpc("tools/list"), headers={"Mcp-Session-Id": sid})
        unknown = await mallory.post("/mcp", json=rpc("tools/list"), headers={"Mcp-Session-Id": "x" * 43})
        stolen_delete = await mallory.delete("/mcp", headers={"Mcp-Session-Id": sid})
        own = await alice.post("/mcp", json=rpc("tools/list"), headers={"Mcp-Session-Id": sid})
    assert (stolen.status_code, stolen.json()) == (unknown.status_code, unknown.json())
    assert stolen.status_code == 404
    assert stolen_delete.status_code == 404
    assert own.status_code == 200 and len(own.json()["result"]["tools"]) == 4


async def test_a_request_from_a_page_on_another_origin_is_refused_and_from_its_own_allowed(served):
    async with raw(served.url) as c:
        host = c.base_url.netloc.decode()
        other = await c.post(
            "/mcp", json=rpc("initialize", protocolVersion="2025-06-18"), headers={"Origin": "http://evil.example"}
        )
        port = await c.post(
            "/mcp", json=rpc("initialize", protocolVersion="2025-06-18"), headers={"Origin": "http://127.0.0.1:1"}
        )
        bogus = await c.post(
            "/mcp", json=rpc("initialize", protocolVersion="2025-06-18"), headers={"Origin": "http://[::1"}
        )
        null = await c.get("/mcp", headers={"Origin": "null"})
        own = await c.post(
            "/mcp", json=rpc("initialize", protocolVersion="2025-06-18"), headers={"Origin": f"http://{host}"}
        )
    assert [r.status_code for r in (other, port, bogus, null)] == [403, 403, 403, 403]
    assert own.status_code == 200 and own.headers["Mcp-Session-Id"]


async def test_get_is_405_with_the_methods_allowed(served):
    async with raw(served.url) as c:
        sid = await initialize(c)
        r = await c.get("/mcp", headers={"Mcp-Session-Id": sid, "Accept": "text/event-stream"})
    assert r.status_code == 405
    assert r.headers["Allow"] == "POST, DELETE"


async def test_malformed_json_is_a_parse_error(served):
    async with raw(served.url) as c:
        sid = await initialize(c)
        r = await c.post(
            "/mcp",
            content=b'{"jsonrpc": "2.0", "id": 1,',
            headers={"Mcp-Session-Id": sid, "Content-Type": "application/json"},
        )
    assert r.status_code == 400
    body = r.json()
    assert body["id"] is None and body["error"]["code"] == -32700
    assert body["error"]["message"].startswith("the request body is not valid JSON: unexpected end of data")


async def test_a_whole_number_past_64_bits_is_a_parse_error_naming_where_it_is(served):
    async with raw(served.url) as c:
        sid = await initialize(c)
        r = await c.post(
            "/mcp",
            content=b'{"jsonrpc": "2.0", "id": 18446744073709551616, "method": "tools/list"}',
            headers={"Mcp-Session-Id": sid, "Content-Type": "application/json"},
        )
    assert r.status_code == 400
    body = r.json()
    assert body["error"]["code"] == -32700 and body["error"]["message"].startswith("'id' is 18446744073709551616")


@pytest.mark.parametrize(
    "message",
    [
        {"id": 1, "method": "ping"},  # no jsonrpc
        {"jsonrpc": "1.0", "id": 1, "method": "ping"},
        {"jsonrpc": "2.0", "id": None, "method": "ping"},  # MCP ids are never null
        {"jsonrpc": "2.0", "id": True, "method": "ping"},
        {"jsonrpc": "2.0", "id": 1, "method": 7},
        {"jsonrpc": "2.0", "id": 1},  # neither a request nor a response
        "ping",
    ],
)
async def test_what_is_not_a_json_rpc_message_is_an_invalid_request(served, message):
    async with raw(served.url) as c:
        sid = await initialize(c)
        r = await c.post("/mcp", json=message, headers={"Mcp-Session-Id": sid})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == -32600


async def test_an_unknown_method_is_method_not_found_with_its_id(served):
    async with raw(served.url) as c:
        sid = await initialize(c)
        r = await c.post("/mcp", json=rpc("resources/list", id_="req-7"), headers={"Mcp-Session-Id": sid})
    # 200: the session is fine; a 404 would tell the client its session is gone.
    assert r.status_code == 200
    assert r.json()["id"] == "req-7"
    assert r.json()["error"]["code"] == -32601


async def test_a_batch_is_answered_in_order_for_its_requests_only(served):
    batch = [
        rpc("ping", id_=1),
        rpc("notifications/progress", id_=None, progressToken=1, progress=1),
        rpc("tools/call", id_=2, name="add", arguments={"a": 1, "b": 1}),
        {"jsonrpc": "2.0", "id": 99, "result": {}},  # a response: nothing to answer
        {"jsonrpc": "2.0"},
        rpc("initialize", id_=3, protocolVersion="2025-03-26"),
    ]
    async with raw(served.url) as c:
        sid = await initialize(c, "2025-03-26")
        r = await c.post("/mcp", json=batch, headers={"Mcp-Session-Id": sid})
        only_notifications = await c.post(
            "/mcp", json=[rpc("notifications/initialized", id_=None)], headers={"Mcp-Session-Id": sid}
        )
        empty = await c.post("/mcp", json=[], headers={"Mcp-Session-Id": sid})
    assert r.status_code == 200
    replies = r.json()
    assert [m["id"] for m in replies] == [1, 2, None, 3]
    assert replies[0]["result"] == {}
    assert replies[1]["result"]["structuredContent"] == {"sum": 2, "by": "caller-alice"}
    assert replies[2]["error"]["code"] == -32600
    assert replies[3]["error"]["code"] == -32600  # initialize is never batched
    assert (only_notifications.status_code, only_notifications.content) == (202, b"")
    assert empty.status_code == 400


async def test_a_notification_or_a_response_is_accepted_with_202_and_no_body(served):
    async with raw(served.url) as c:
        sid = await initialize(c)
        note = await c.post("/mcp", json=rpc("notifications/initialized", id_=None), headers={"Mcp-Session-Id": sid})
        answer = await c.post("/mcp", json={"jsonrpc": "2.0", "id": 5, "result": {}}, headers={"Mcp-Session-Id": sid})
    assert (note.status_code, note.content) == (202, b"")
    assert (answer.status_code, answer.content) == (202, b"")


@pytest.mark.parametrize(("offered", "answered"), [(v, v) for v in PROTOCOL_VERSIONS] + [("2099-01-01", "2025-11-25")])
async def test_initialize_answers_the_offered_version_when_served_else_the_newest(served, offered, answered):
    async with raw(served.url) as c:
        r = await c.post("/mcp", json=rpc("initialize", protocolVersion=offered, capabilities={}))
    assert r.json()["result"]["protocolVersion"] == answered


async def test_initialize_without_a_protocol_version_is_invalid_params_and_makes_no_session(served):
    async with raw(served.url) as c:
        r = await c.post("/mcp", json=rpc("initialize", capabilities={}))
    assert r.json()["error"]["code"] == -32602
    assert "Mcp-Session-Id" not in r.headers


async def test_a_protocol_version_header_the_server_does_not_speak_is_refused_400(served):
    async with raw(served.url) as c:
        sid = await initialize(c)
        bad = await c.post(
            "/mcp", json=rpc("ping"), headers={"Mcp-Session-Id": sid, "MCP-Protocol-Version": "2026-07-28"}
        )
        good = await c.post(
            "/mcp", json=rpc("ping"), headers={"Mcp-Session-Id": sid, "MCP-Protocol-Version": "2025-06-18"}
        )
    assert bad.status_code == 400
    assert bad.json()["error"]["code"] == -32022
    assert bad.json()["error"]["data"] == {"supported": list(PROTOCOL_VERSIONS), "requested": "2026-07-28"}
    assert good.status_code == 200


async def test_a_body_over_one_mebibyte_is_refused_413_with_or_without_a_length(served):
    big = b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"pad":"' + b"x" * (1024 * 1024) + b'"}}'

    async def chunked():
        for i in range(0, len(big), 100_000):
            yield big[i : i + 100_000]

    async with raw(served.url) as c:
        sid = await initialize(c)
        headers = {"Mcp-Session-Id": sid, "Content-Type": "application/json"}
        sized = await c.post("/mcp", content=big, headers=headers)
        streamed = await c.post("/mcp", content=chunked(), headers=headers)
    assert sized.status_code == 413
    assert streamed.status_code == 413


async def test_a_body_that_is_not_json_by_its_type_or_a_client_that_takes_no_json_is_refused(served):
    async with raw(served.url) as c:
        sid = await initialize(c)
        text = await c.post("/mcp", content=b"{}", headers={"Mcp-Session-Id": sid, "Content-Type": "text/plain"})
        sse_only = await c.post(
            "/mcp", json=rpc("ping"), headers={"Mcp-Session-Id": sid, "Accept": "text/event-stream"}
        )
    assert text.status_code == 415
    assert sse_only.status_code == 406


async def test_delete_ends_the_session_and_an_unknown_one_is_404(served):
    async with raw(served.url) as c:
        sid = await initialize(c)
        ended = await c.delete("/mcp", headers={"Mcp-Session-Id": sid})
        after = await c.post("/mcp", json=rpc("ping"), headers={"Mcp-Session-Id": sid})
        again = await c.delete("/mcp", headers={"Mcp-Session-Id": sid})
        none = await c.delete("/mcp")
    assert ended.status_code == 200
    assert after.status_code == 404
    assert again.status_code == 404
    assert none.status_code == 400


async def test_an_owner_at_its_bound_loses_its_own_least_recently_used_session_first():
    async with serving(toy_server(sessions_per_owner=2)) as s, raw(s.url) as c:
        first = await initialize(c)
        second = await initialize(c)
        # Using the first makes the second the least recently used.
        assert (await c.post("/mcp", json=rpc("ping"), headers={"Mcp-Session-Id": first})).status_code == 200
        await initialize(c)
        kept = await c.post("/mcp", json=rpc("ping"), headers={"Mcp-Session-Id": first})
        dropped = await c.post("/mcp", json=rpc("ping"), headers={"Mcp-Session-Id": second})
    assert kept.status_code == 200
    assert dropped.status_code == 404


async def test_one_owner_opening_many_sessions_never_ends_another_owners_session():
    async with serving(toy_server(sessions_per_owner=3)) as s, raw(s.url, "bob") as bob, raw(s.url) as alice:
        bobs = await initialize(bob)
        for _ in range(50):
            await initialize(alice)
        still = await bob.post("/mcp", json=rpc("ping"), headers={"Mcp-Session-Id": bobs})
    assert still.status_code == 200


async def test_a_full_session_table_refuses_a_new_session_503_and_ends_none():
    async with serving(toy_server(max_sessions=2)) as s, raw(s.url, "bob") as bob, raw(s.url) as alice:
        bobs = await initialize(bob)
        await initialize(alice)
        r = await alice.post("/mcp", json=rpc("initialize", protocolVersion="2025-06-18", capabilities={}))
        still = await bob.post("/mcp", json=rpc("ping"), headers={"Mcp-Session-Id": bobs})
    assert r.status_code == 503
    assert "Mcp-Session-Id" not in r.headers
    assert "most MCP sessions (2)" in r.json()["error"]["message"]
    assert r.headers["Retry-After"] == "60"
    assert still.status_code == 200


class Limit:
    """An admit callable as the gateway's: admits `room` calls, then refuses as the accountant does."""

    def __init__(self, room: int) -> None:
        self.room = room
        self.counted = 0

    async def __call__(self) -> dict[str, str]:
        self.counted += 1
        if self.counted > self.room:
            raise LimitError(
                429,
                "the request rate of key k is at its limit of 2 a minute; retry in 60 s",
                "rate_limited",
                59.5,
                {"x-ratelimit-limit-requests": "2", "x-ratelimit-remaining-requests": "0", "retry-after": "60"},
            )
        return {"x-ratelimit-limit-requests": "2", "x-ratelimit-remaining-requests": str(self.room - self.counted)}


@asynccontextmanager
async def limited(room: int) -> AsyncIterator[tuple[Served, Limit]]:
    limit = Limit(room)
    async with serving(toy_server(), limit) as s:
        yield s, limit


async def test_each_call_of_a_batch_counts_and_the_calls_past_the_limit_are_refused_in_order():
    async with limited(3) as (s, limit), raw(s.url) as c:
        sid = await initialize(c)  # the first call
        batch = [rpc("tools/call", i, name="echo", arguments={"text": str(i)}) for i in range(5)]
        r = await c.post("/mcp", json=batch, headers={"Mcp-Session-Id": sid})
    replies = r.json()
    assert r.status_code == 200
    assert limit.counted == 6
    assert [("result" in m) for m in replies] == [True, True, False, False, False]
    refused = replies[2]["error"]
    assert refused["code"] == LIMITED
    assert "at its limit of 2 a minute" in refused["message"]
    assert refused["data"] == {"status": 429, "code": "rate_limited", "retry_after": 60}
    assert r.headers["Retry-After"] == "60"
    assert r.headers["x-ratelimit-remaining-requests"] == "0"


async def test_a_single_call_refused_by_the_limits_is_a_429_with_retry_after_and_runs_nothing():
    async with limited(1) as (s, _), raw(s.url) as c:
        sid = await initialize(c)
        r = await c.post("/mcp", json=rpc("tools/call", 7, name="crash", arguments={}), headers={"Mcp-Session-Id": sid})
    assert r.status_code == 429
    assert r.json()["id"] == 7 and r.json()["error"]["code"] == LIMITED
    assert r.headers["Retry-After"] == "60"


async def test_initialize_refused_by_the_limits_makes_no_session():
    async with limited(0) as (s, _), raw(s.url) as c:
        r = await c.post("/mcp", json=rpc("initialize", protocolVersion="2025-06-18", capabilities={}))
    assert r.status_code == 429
    assert "Mcp-Session-Id" not in r.headers


async def test_a_post_of_notifications_only_and_a_delete_count_one_call_each():
    async with limited(10) as (s, limit), raw(s.url) as c:
        sid = await initialize(c)
        await c.post("/mcp", json=rpc("notifications/initialized", None), headers={"Mcp-Session-Id": sid})
        await c.delete("/mcp", headers={"Mcp-Session-Id": sid})
    assert limit.counted == 3


async def test_an_idle_session_expires_and_a_used_one_does_not():
    now = [0.0]
    async with serving(toy_server(session_idle_s=60, clock=lambda: now[0])) as s, raw(s.url) as c:
        idle = await initialize(c)
        busy = await initialize(c)
        for _ in range(3):
            now[0] += 40
            assert (await c.post("/mcp", json=rpc("ping"), headers={"Mcp-Session-Id": busy})).status_code == 200
        expired = await c.post("/mcp", json=rpc("ping"), headers={"Mcp-Session-Id": idle})
    assert expired.status_code == 404


def test_tools_with_one_name_or_a_schema_that_is_no_object_are_refused_at_construction():
    with pytest.raises(ValueError, match="two tools are named 'add'"):
        McpServer("x", "1", [TOOLS[0], TOOLS[0]])
    with pytest.raises(ValueError, match="type object"):
        McpServer("x", "1", [Tool("t", "d", {"type": "string"}, _echo)])
