"""No request reaches a 500: whatever a client sends to any route of the client listener, the
gateway answers it with something other than a server error, and a refusal comes in the shape
of the API that was called, with one line in the log and never a traceback.

The property test drives random bodies (the right shape with fields changed, any JSON, bytes
that are not JSON, deep nesting, whole numbers past 64 bits, NUL and control characters),
random path parameters and queries at every route the client listener has (read from its
router, so a route added later is covered without a change here), with a valid key of a project
that keeps conversations and notes. The gateway is the real Server on its real listeners, in a
thread of its own, in front of a fake engine; the examples are derandomized so a run in CI sees
the same ones.

The named tests below it hold the cases that were 500s, each once.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote_from_bytes, urlencode

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw.config import parse_server_config
from llmgw.files import write_secret_file
from llmgw.server.app import Server
from llmgw.server.gateway import agent_apis, proxy
from llmgw.testing.fake_engine import FakeEngine
from llmgw.testing.ports import free_port
from llmgw.testing.waiting import until

PROJECT = "Acme/platform/agents"

# -- the gateway, running in a thread of its own ---------------------------------------------


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@dataclass
class Running:
    url: str
    key: str
    server: Server
    log: _Records
    routes: list[tuple[str, str]] = field(default_factory=list)

    def since(self, n: int) -> list[logging.LogRecord]:
        return self.log.records[n:]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory) -> Iterator[Running]:
    tmp = tmp_path_factory.mktemp("no-server-errors")
    box: dict[str, Any] = {}
    started = threading.Event()

    mirror_token = tmp / "mirror.token"
    write_secret_file(mirror_token, "mirror-secret")

    async def main() -> None:
        engine = await FakeEngine(model="m", tokens=4).start()
        cfg = parse_server_config(
            {
                "listen": f"127.0.0.1:{free_port()}",
                "admin_listen": f"127.0.0.1:{free_port()}",
                "metrics_listen": None,
                # Every page mounted, as in test_route_guards: the control plane's and the mirror's.
                "control": {"enabled": True},
                "agent_listen": f"127.0.0.1:{free_port()}",
                "agent_tls": None,
                "mirror": {"api": f"http://127.0.0.1:{free_port()}", "token_file": str(mirror_token)},
                "auth": {"store": str(tmp / "gw.db")},
                "data_dir": str(tmp),
                "models": [{"name": "m", "max_output": 64, "endpoints": [{"url": engine.url, "engine": "llamacpp"}]}],
            }
        )
        server = Server(cfg)
        await server.start()
        try:
            store = server.store
            await store.add_org("Acme")
            await store.add_team("platform", "Acme")
            await store.add_project("agents", "Acme/platform")
            await store.set_retention(PROJECT, "threads", 24)
            await store.set_retention(PROJECT, "memory", 24)
            key = (await store.issue_key("agent", project=PROJECT)).secret
            await server.keys.load()
            box.update(
                server=server,
                key=key,
                url=f"http://127.0.0.1:{cfg.listen.port}",
                loop=asyncio.get_running_loop(),
                stop=asyncio.Event(),
            )
            started.set()
            await box["stop"].wait()
        finally:
            await server.stop()
            await engine.stop()

    def run() -> None:
        try:
            asyncio.run(main())
        except BaseException as exc:  # seen by the test instead of dying with the thread
            box["error"] = exc
            started.set()

    log = _Records()
    llmgw_log = logging.getLogger("llmgw")
    level = llmgw_log.level
    llmgw_log.setLevel(logging.INFO)
    llmgw_log.addHandler(log)
    thread = threading.Thread(target=run, name="gateway", daemon=True)
    thread.start()
    try:
        until(started.is_set, 60, "the gateway to start")
        if "error" in box:
            raise box["error"]
        gw = Running(box["url"], box["key"], box["server"], log)
        app = gw.server.apps["listen"]
        # As tests/unit/test_route_guards.py enumerates them: a HEAD beside each GET runs the GET.
        gw.routes = sorted(
            {(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD" and r.resource}
        )
        yield gw
    finally:
        if "loop" in box:
            box["loop"].call_soon_threadsafe(box["stop"].set)
        thread.join(30)
        llmgw_log.removeHandler(log)
        llmgw_log.setLevel(level)


def _mcp_session(gw: Running) -> str:
    r = httpx.post(
        gw.url + "/v1/mcp",
        json={
            "jsonrpc": "2.0",
            "id": 0,
            "method": "initialize",
            "params": {
                "protocolVersion": "2025-06-18",
                "capabilities": {},
                "clientInfo": {"name": "t", "version": "1"},
            },
        },
        headers={"Authorization": f"Bearer {gw.key}", "Accept": "application/json, text/event-stream"},
    )
    assert r.status_code == 200, r.text
    return r.headers["Mcp-Session-Id"]


# -- what a client may send -----------------------------------------------------------------

# Whole numbers at and past the edges of 64 bits, beside ordinary ones.
EDGES = [2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1, 10**30, -(10**30), 10**400]
INTS = st.one_of(st.integers(-1000, 1000), st.integers(), st.sampled_from(EDGES))
FLOATS = st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([1e300, -1e300, 1.8e19, 0.5]))
ODD_TEXT = ["", "\x00", "a\x00b", "\x1b[2J", "\x7f", "\u2028", "\ud800", "thr_\x00", "resp_\x00x", "note_\x00", "m"]
TEXT = st.one_of(st.text(max_size=12), st.sampled_from(ODD_TEXT))
FIELDS = [
    "model",
    "messages",
    "prompt",
    "input",
    "max_tokens",
    "max_completion_tokens",
    "n_predict",
    "max_output_tokens",
    "n",
    "seed",
    "top_k",
    "top_p",
    "temperature",
    "stream",
    "stream_options",
    "tools",
    "tool_choice",
    "previous_response_id",
    "store",
    "instructions",
    "system",
    "stop_sequences",
    "content",
    "role",
    "text",
    "title",
    "jsonrpc",
    "id",
    "method",
    "params",
    "name",
    "arguments",
    "note_id",
    "encoding_format",
]
KEYS = st.one_of(st.sampled_from(FIELDS), st.text(max_size=6))
SCALARS = st.one_of(st.none(), st.booleans(), INTS, FLOATS, TEXT)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(KEYS, inner, max_size=4)),
    max_leaves=12,
)

HI = [{"role": "user", "content": "hi"}]
# A body of the right shape for each route that takes one; a route not named here starts from {}.
TEMPLATES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": "m", "messages": HI, "max_tokens": 4},
    "/v1/completions": {"model": "m", "prompt": "hi", "max_tokens": 4},
    "/v1/embeddings": {"model": "m", "input": "hi"},
    "/v1/responses": {"model": "m", "input": "hi", "max_output_tokens": 4},
    "/v1/messages": {"model": "m", "max_tokens": 4, "messages": HI},
    "/v1/messages/count_tokens": {"model": "m", "messages": HI},
    "/v1/memory": {"text": "a note", "title": "t"},
    "/v1/memory/{note}": {"text": "a note"},
    "/v1/mcp": {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {"name": "memory_list", "arguments": {"limit": 2}},
    },
}


@st.composite
def json_bodies(draw, template: dict[str, Any]) -> bytes:
    """JSON text as a client may write it: whole numbers of any size (stdlib json writes them
    all), NaN too, which is not JSON."""
    kind = draw(st.sampled_from(["changed", "changed", "nested", "any"]))
    if kind == "any":
        value: Any = draw(VALUES)
    else:
        value = json.loads(json.dumps(template))
        for k, v in draw(st.lists(st.tuples(KEYS, VALUES), max_size=3)):
            if kind == "nested" and isinstance(value.get("messages"), list):
                value["messages"] = [{**HI[0], k: v}]
            elif kind == "nested" and isinstance(value.get("params"), dict):
                value["params"]["arguments"] = {k: v}
            else:
                value[k] = v
    return json.dumps(value).encode()


@st.composite
def bodies(draw, template: dict[str, Any]) -> tuple[bytes, dict[str, str]]:
    """(body, headers that describe it)."""
    kind = draw(st.sampled_from(["json"] * 6 + ["bytes", "deep", "gzip", "broken-gzip", "deflate", "form"]))
    headers = {"Content-Type": "application/json"}
    if kind == "bytes":
        return draw(st.binary(max_size=40)), headers
    if kind == "deep":
        depth = draw(st.sampled_from([100, 1000, 1025, 5000]))
        return b"[" * depth + b"]" * depth, headers
    body = draw(json_bodies(template))
    if kind == "gzip":
        return gzip.compress(body), {**headers, "Content-Encoding": "gzip"}
    if kind == "broken-gzip":
        packed = gzip.compress(body)
        return packed[: draw(st.integers(0, len(packed) - 1))] + b"garbage", {**headers, "Content-Encoding": "gzip"}
    if kind == "deflate":
        return draw(st.binary(min_size=1, max_size=20)), {**headers, "Content-Encoding": "deflate"}
    if kind == "form":
        return body, {"Content-Type": "application/x-www-form-urlencoded"}
    return body, headers


PARAMS = st.one_of(
    st.text(min_size=1, max_size=70).map(lambda t: t.encode("utf-8", "surrogatepass")),
    st.binary(min_size=1, max_size=20),
    st.sampled_from([b"\x00", b"thr_\x00", b"note_\x00x", b"m", b"x" * 65, b"..", b"\xff"]),
)
# Header values a client library sends (HTTP forbids NUL, CR and LF in them, and spaces at either end).
HEADER_TEXT = st.text(
    st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"), max_size=70
).map(lambda t: t.strip(" "))


def _path(canonical: str, params: list[bytes]) -> str:
    out, rest = "", canonical
    for p in params:
        head, brace, tail = rest.partition("{")
        if not brace:
            break
        out += head + quote_from_bytes(p, safe="")
        rest = tail.partition("}")[2]
    return out + rest


def _shaped(path: str, status: int, body: bytes) -> str | None:
    """Why an error answer on an API route is not in its API's shape; None when it is."""
    if not path.startswith("/v1/") or status < 400:
        return None
    try:
        obj = json.loads(body)
    except ValueError:
        return "not JSON"
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        ok = obj.get("type") == "error" and isinstance(obj.get("error", {}).get("message"), str)
        return None if ok else "not Anthropic's shape"
    err = obj.get("error") if isinstance(obj, dict) else None
    # OpenAI's {"error": {"message"...}}; MCP's JSON-RPC errors carry one too ({"code", "message"}).
    return None if isinstance(err, dict) and isinstance(err.get("message"), str) else "not OpenAI's shape"


def _faults(records: list[logging.LogRecord]) -> list[str]:
    return [f"{r.levelname} {r.name}: {r.getMessage()}" for r in records if r.exc_info or r.levelno >= logging.ERROR]


@settings(
    max_examples=500,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_no_request_to_any_client_route_gets_a_server_error_or_leaves_a_traceback(gateway, data):
    # Most examples go to the API (/v1/...): the pages refuse a request without a session first.
    api = [r for r in gateway.routes if r[1].startswith("/v1/")]
    pages = [r for r in gateway.routes if not r[1].startswith("/v1/")]
    method, canonical = data.draw(
        st.sampled_from(api) if data.draw(st.integers(0, 4), label="api") else st.sampled_from(pages), label="route"
    )
    if data.draw(st.integers(0, 9), label="a path no route has") == 0:
        canonical = "/v1/" + quote_from_bytes(data.draw(PARAMS), safe="")
    params = data.draw(st.lists(PARAMS, min_size=canonical.count("{"), max_size=canonical.count("{")), label="params")
    path = _path(canonical, params)
    query = data.draw(st.dictionaries(st.sampled_from(["q", "limit", "offset", "model", "project"]), TEXT, max_size=2))
    template = TEMPLATES.get(canonical, {})
    body, headers = data.draw(bodies(template), label="body")
    headers = {**headers, "Authorization": f"Bearer {gateway.key}"}
    if canonical == "/v1/mcp":
        # A session of its own: an example may end the one it was given (DELETE).
        headers.update({"Mcp-Session-Id": _mcp_session(gateway), "Accept": "application/json, text/event-stream"})
    if data.draw(st.integers(0, 3), label="thread header") == 0:
        thread = data.draw(st.one_of(st.just("new"), HEADER_TEXT))
        headers["x-llmgw-thread"] = thread.encode("latin-1")  # type: ignore[assignment]
    if data.draw(st.booleans(), label="anthropic-version"):
        headers["anthropic-version"] = "2023-06-01"
    url = gateway.url + path + ("?" + urlencode(query, encoding="utf-8", errors="surrogatepass") if query else "")
    seen = len(gateway.log.records)
    r = httpx.request(method, url, content=body, headers=headers, timeout=30, follow_redirects=False)
    assert r.status_code < 500, (method, path, body[:200], r.status_code, r.text[:300])
    assert _shaped(path, r.status_code, r.content) is None, (method, path, r.status_code, r.text[:300])
    assert not _faults(gateway.since(seen)), _faults(gateway.since(seen))


def test_the_property_test_reaches_every_route_of_the_client_listener(gateway):
    # The table of guards lists the same routes: none is left out of the drive above.
    from test_route_guards import GUARDS

    assert set(gateway.routes) == {(m, p) for (listener, m, p) in GUARDS if listener == "listen"}


# -- the cases that were 500s -----------------------------------------------------------------


def _post(gw: Running, path: str, content: bytes, **headers: str) -> httpx.Response:
    return httpx.post(
        gw.url + path,
        content=content,
        headers={"Authorization": f"Bearer {gw.key}", "Content-Type": "application/json", **headers},
    )


def _anthropic_error(r: httpx.Response) -> str:
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    return body["error"]["message"]


def test_max_tokens_past_64_bits_on_messages_is_a_400_in_anthropics_shape_naming_the_field(gateway):
    r = _post(
        gateway,
        "/v1/messages",
        b'{"model":"m","max_tokens":18446744073709551616,"messages":[{"role":"user","content":"hi"}]}',
    )
    assert r.status_code == 400
    message = _anthropic_error(r)
    assert message.startswith("'max_tokens' is 18446744073709551616, a number past the 64 bits")
    assert "9223372036854775807" in message


@pytest.mark.parametrize("field", ["n", "seed", "top_k", "max_tokens"])
def test_a_whole_number_past_64_bits_anywhere_in_a_chat_body_is_a_400_naming_it(gateway, field):
    body = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"%s":-99999999999999999999}' % field.encode()
    r = _post(gateway, "/v1/chat/completions", body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "number_too_large" and err["param"] == field
    assert err["message"].startswith(f"'{field}' is -99999999999999999999")


def test_a_nul_in_previous_response_id_is_a_400_naming_the_field(gateway):
    r = _post(
        gateway,
        "/v1/responses",
        json.dumps({"model": "m", "input": "hi", "previous_response_id": "resp_\x00"}).encode(),
    )
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "invalid_id" and err["param"] == "previous_response_id"
    assert "cannot contain control characters" in err["message"] and "the id this gateway gave" in err["message"]


@pytest.mark.parametrize("method", ["GET", "DELETE"])
def test_a_thread_id_with_a_nul_in_the_path_is_a_400(gateway, method):
    r = httpx.request(
        method, gateway.url + "/v1/threads/thr_abc%00", headers={"Authorization": f"Bearer {gateway.key}"}
    )
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "invalid_id" and "A thread id cannot contain control characters" in err["message"]


def test_a_note_id_with_a_control_character_is_a_400_over_http_and_a_tool_error_over_mcp(gateway):
    auth = {"Authorization": f"Bearer {gateway.key}"}
    r = httpx.get(gateway.url + "/v1/memory/note_%1B", headers=auth)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_id"
    call = {
        "jsonrpc": "2.0",
        "id": 7,
        "method": "tools/call",
        "params": {"name": "memory_read", "arguments": {"note_id": "note_\x00"}},
    }
    r = httpx.post(
        gateway.url + "/v1/mcp",
        json=call,
        headers={**auth, "Mcp-Session-Id": _mcp_session(gateway), "Accept": "application/json, text/event-stream"},
    )
    assert r.status_code == 200
    result = r.json()["result"]
    assert result["isError"] is True and "cannot contain control characters" in result["content"][0]["text"]


def test_a_broken_gzip_body_on_messages_is_a_400_in_anthropics_shape(gateway):
    packed = gzip.compress(b'{"model":"m","max_tokens":4,"messages":[{"role":"user","content":"hi"}]}')
    r = _post(gateway, "/v1/messages", packed[:12] + b"not the rest", **{"Content-Encoding": "gzip"})
    assert r.status_code == 400
    assert "compression are broken" in _anthropic_error(r)
    # The same body whole is read, decompressed, as any other.
    assert _post(gateway, "/v1/messages", packed, **{"Content-Encoding": "gzip"}).status_code == 200


def test_a_broken_gzip_body_elsewhere_is_a_400_in_openais_shape(gateway):
    r = _post(gateway, "/v1/chat/completions", b"not-gzip-at-all", **{"Content-Encoding": "gzip"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_body"


def test_an_encoding_the_server_cannot_read_is_a_415_that_says_so(gateway):
    r = _post(gateway, "/v1/chat/completions", b"{}", **{"Content-Encoding": "br"})
    assert r.status_code == 415
    err = r.json()["error"]
    assert err["code"] == "unsupported_encoding" and "gzip or deflate" in err["message"]


@pytest.mark.parametrize(
    ("method", "path", "body", "headers"),
    [
        ("POST", "/v1/messages", b'{"model":"m","max_tokens":18446744073709551616,"messages":[]}', {}),
        ("POST", "/v1/responses", b'{"model":"m","input":"hi","previous_response_id":"resp_\\u0000"}', {}),
        ("GET", "/v1/threads/thr_%00", b"", {}),
        ("POST", "/v1/messages", b"not-gzip-at-all", {"Content-Encoding": "gzip"}),
    ],
    ids=["max-tokens-past-64-bits", "nul-in-previous-response-id", "nul-in-thread-path", "broken-gzip"],
)
def test_each_refusal_is_one_line_in_the_log_naming_the_route_without_a_traceback(gateway, method, path, body, headers):
    seen = len(gateway.log.records)
    r = httpx.request(
        method,
        gateway.url + path,
        content=body,
        headers={"Authorization": f"Bearer {gateway.key}", "Content-Type": "application/json", **headers},
    )
    assert r.status_code == 400
    lines = until(
        lambda: [x for x in gateway.since(seen) if "refused a request" in x.getMessage()], 5, "the refusal's log line"
    )
    assert len(lines) == 1, [x.getMessage() for x in lines]
    line = lines[0].getMessage()
    route = path if "%" not in path else "/v1/threads/{thread}"
    assert f"{method} {route}" in line and "\n" not in line and lines[0].exc_info is None
    assert gateway.key not in line and not _faults(gateway.since(seen))


# -- and a bug, which none of the above may find ----------------------------------------------


def test_a_bug_on_the_messages_route_is_a_500_in_anthropics_shape_that_names_nothing_inside(gateway, monkeypatch):
    def broken(body: object) -> object:
        raise RuntimeError("engine at 10.0.0.7 under /srv/llmgw/secret")

    monkeypatch.setattr(agent_apis.messages_api, "translate_request", broken)
    seen = len(gateway.log.records)
    r = _post(gateway, "/v1/messages", b'{"model":"m","max_tokens":4,"messages":[{"role":"user","content":"hi"}]}')
    assert r.status_code == 500
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "api_error"
    assert "10.0.0.7" not in r.text and "secret" not in r.text and "Traceback" not in r.text
    # The operator gets the traceback: this one is a bug.
    failed = until(lambda: [x for x in gateway.since(seen) if x.exc_info], 5, "the bug's traceback in the log")
    assert "POST /v1/messages" in failed[0].getMessage()


def test_a_bug_on_an_openai_route_is_a_500_in_openais_shape_that_names_nothing_inside(gateway, monkeypatch):
    def broken(*args: object) -> object:
        raise RuntimeError("engine at 10.0.0.7 under /srv/llmgw/secret")

    monkeypatch.setattr(proxy, "read_request", broken)
    r = _post(gateway, "/v1/chat/completions", b'{"model":"m","messages":[{"role":"user","content":"hi"}]}')
    assert r.status_code == 500
    assert r.json()["error"]["code"] == "internal_error"
    assert "10.0.0.7" not in r.text and "secret" not in r.text
