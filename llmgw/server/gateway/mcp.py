"""An MCP (Model Context Protocol) server on the streamable HTTP transport, on aiohttp.

One route takes every HTTP request of the transport; the gateway authenticates it and
calls :meth:`McpServer.handle` with who called. The server offers tools and nothing
else (no resources, prompts, sampling or server-initiated messages), so:

- a POST is answered with one ``application/json`` body (the spec lets a server answer
  a POST that way instead of opening an SSE stream), or 202 when it carried only
  notifications or responses;
- a GET, which asks for a stream of server-initiated messages, is answered 405;
- a DELETE ends the session.

``initialize`` issues a session id; every other request must present it, from the
same owner (the API key that authenticated the initialize). The handshake-era
protocol versions are served; the stateless 2026-07-28 revision (``server/discover``
and a per-request envelope, no initialize) is not, and its probe is told so in the
words its clients read (-32022 naming the versions served), so they fall back to
initialize.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import orjson
from aiohttp import web

from llmgw.errors import LlmgwError
from llmgw.server.gateway.checks import BadInput, load_json
from llmgw.server.gateway.limits import LimitError

log = logging.getLogger("llmgw.gateway.mcp")

# Newest first: an initialize offering one of these gets it back, any other gets the first
# (the client then decides whether it can speak that one, as the spec says).
PROTOCOL_VERSIONS = ("2025-11-25", "2025-06-18", "2025-03-26", "2024-11-05")
LATEST_PROTOCOL_VERSION = PROTOCOL_VERSIONS[0]

SESSION_HEADER = "Mcp-Session-Id"
VERSION_HEADER = "MCP-Protocol-Version"

MAX_BODY_BYTES = 1024 * 1024
MAX_SESSIONS = 100_000  # per process, all owners together: about 20 MB of sessions at most
SESSIONS_PER_OWNER = 100  # the default of server.yaml's agents.mcp_sessions_per_key
SESSION_IDLE_S = 3600.0

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
# The code MCP clients read as "not this version", with the versions served in its data.
UNSUPPORTED_PROTOCOL_VERSION = -32022
# A call the caller's limits refuse (JSON-RPC leaves -32000 to -32099 to servers); its data
# says which limit (the gateway's error code) and when to retry.
LIMITED = -32029

# Counts one call against the caller's limits: the rate-limit headers to answer with, or
# LimitError (429, or 403) when the limits refuse it.
Admit = Callable[[], Awaitable[dict[str, str]]]

_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    # bool is an int in Python but not in JSON; 3.0 is an integer in JSON Schema.
    "integer": lambda v: (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer()),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "null": lambda v: v is None,
}


@dataclass(frozen=True)
class Tool:
    """One tool: what the model reads about it, and the coroutine that runs it.

    ``call(caller, arguments)`` gets the ``caller`` given to :meth:`McpServer.handle`
    and the arguments already checked against ``input_schema``'s required names and
    basic types; it returns something JSON can carry (a dict becomes structured content
    too) or raises :class:`ToolError` for a failure the model should read.
    """

    name: str
    description: str
    input_schema: dict[str, Any]
    call: Callable[[Any, dict[str, Any]], Awaitable[Any]]
    read_only: bool = False


class ToolError(LlmgwError):
    """A tool's failure meant for the model: the call's result says isError with this message."""


@dataclass(slots=True)
class _Session:
    owner: str
    protocol_version: str
    last_used: float


class SessionsFull(LlmgwError):
    """The process holds MAX_SESSIONS sessions: a new one waits until some end or expire."""


class _Sessions:
    """Session ids in memory, expiring when idle and bounded per owner: an owner at its bound
    loses its own least recently used session to its new one, never another owner's. The whole
    table is bounded too (``limit``); when full, a new session is refused, not taken from
    someone else.

    Ordered by last use, so both the idle and the least recently used are at the front (of the
    whole table and of each owner's).
    """

    def __init__(self, limit: int, idle_s: float, clock: Callable[[], float], per_owner: int) -> None:
        self._limit = limit
        self._per_owner = per_owner
        self._idle_s = idle_s
        self._clock = clock
        self._by_id: OrderedDict[str, _Session] = OrderedDict()
        self._by_owner: dict[str, OrderedDict[str, None]] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def owned(self, owner: str) -> int:
        return len(self._by_owner.get(owner, ()))

    def _drop(self, sid: str) -> None:
        s = self._by_id.pop(sid)
        mine = self._by_owner[s.owner]
        del mine[sid]
        if not mine:
            del self._by_owner[s.owner]

    def _expire(self, now: float) -> None:
        while self._by_id:
            sid, s = next(iter(self._by_id.items()))
            if now - s.last_used <= self._idle_s:
                break
            self._drop(sid)

    def create(self, owner: str, protocol_version: str) -> str:
        now = self._clock()
        self._expire(now)
        mine = self._by_owner.get(owner)
        while mine and len(mine) >= self._per_owner:
            self._drop(next(iter(mine)))
            mine = self._by_owner.get(owner)
        if len(self._by_id) >= self._limit:
            raise SessionsFull(
                f"this gateway holds its most MCP sessions ({self._limit:,}); retry in a minute, when idle "
                "ones have expired, and end sessions you no longer use (DELETE)"
            )
        # 256 random bits, URL-safe: visible ASCII as the spec asks, and unguessable.
        sid = secrets.token_urlsafe(32)
        self._by_id[sid] = _Session(owner, protocol_version, now)
        self._by_owner.setdefault(owner, OrderedDict())[sid] = None
        return sid

    def get(self, sid: str, owner: str) -> _Session | None:
        """The live session, touched; None for an unknown, expired or another owner's one."""
        now = self._clock()
        self._expire(now)
        s = self._by_id.get(sid)
        if s is None or s.owner != owner:
            return None
        s.last_used = now
        self._by_id.move_to_end(sid)
        self._by_owner[owner].move_to_end(sid)
        return s

    def end(self, sid: str, owner: str) -> bool:
        if self.get(sid, owner) is None:
            return False
        self._drop(sid)
        return True


@dataclass(frozen=True, slots=True)
class _Message:
    """A JSON-RPC request (``id`` set) or notification (``notification`` true)."""

    id: str | int | None
    method: str
    params: Any
    notification: bool


def _error(id_: str | int | None, code: int, message: str, data: Any = None) -> dict[str, Any]:
    err: dict[str, Any] = {"code": code, "message": message}
    if data is not None:
        err["data"] = data
    return {"jsonrpc": "2.0", "id": id_, "error": err}


def _result(id_: str | int | None, result: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": id_, "result": result}


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json", headers=headers)


def _refusal(
    status: int, code: int, message: str, data: Any = None, headers: dict[str, str] | None = None
) -> web.Response:
    """An HTTP-level refusal; its body is a JSON-RPC error without an id, as the spec allows."""
    return _json(_error(None, code, message, data), status, headers)


def _valid_id(value: Any) -> bool:
    # MCP ids are strings or integers, never null (JSON-RPC allows null; MCP does not).
    return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))


def _parse(m: Any) -> _Message | dict[str, Any] | None:
    """A request or notification; None for a JSON-RPC response (to a request this server
    never sends, so there is nothing to match it to); an error reply for anything else."""
    if not isinstance(m, dict) or m.get("jsonrpc") != "2.0":
        id_ = m.get("id") if isinstance(m, dict) else None
        return _error(id_ if _valid_id(id_) else None, INVALID_REQUEST, "not a JSON-RPC 2.0 message")
    if "method" not in m:
        if _valid_id(m.get("id")) and ("result" in m or "error" in m):
            return None
        return _error(None, INVALID_REQUEST, "not a JSON-RPC request, notification or response")
    method = m["method"]
    if "id" in m:
        if not _valid_id(m["id"]):
            return _error(None, INVALID_REQUEST, "a request's id must be a string or an integer")
        if not isinstance(method, str):
            return _error(m["id"], INVALID_REQUEST, "method must be a string")
        return _Message(m["id"], method, m.get("params"), notification=False)
    if not isinstance(method, str):
        return _error(None, INVALID_REQUEST, "method must be a string")
    return _Message(None, method, m.get("params"), notification=True)


def _same_origin(origin: str, host: str) -> bool:
    """Whether a browser's ``Origin`` names the host:port the request was sent to.

    The Host's port defaults by the Origin's scheme, not this listener's: behind a TLS
    proxy the page is on https while the gateway itself speaks http.
    """
    if origin == "null":
        return False
    try:
        o = urlsplit(origin)
        h = urlsplit("//" + host)
        default = 443 if o.scheme == "https" else 80
        return (
            o.scheme in ("http", "https")
            and o.hostname is not None
            and o.hostname == h.hostname
            and (o.port or default) == (h.port or default)
        )
    except ValueError:
        # urlsplit refuses some spellings ("http://[::1", port 99999): a refusal, never a 500.
        return False


def _accepts_json(accept: str | None) -> bool:
    if not accept:
        return True
    ranges = {part.split(";", 1)[0].strip().lower() for part in accept.split(",")}
    return bool(ranges & {"application/json", "application/*", "*/*"})


async def _read_body(request: web.Request) -> bytes | None:
    """The body, or None when it is over MAX_BODY_BYTES (counted as it arrives: a chunked
    body has no Content-Length to refuse it by up front)."""
    if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
        return None
    chunks: list[bytes] = []
    size = 0
    while chunk := await request.content.read(64 * 1024):
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _argument_problem(schema: dict[str, Any], arguments: dict[str, Any]) -> str | None:
    """What is wrong with the arguments by the schema's ``required`` and properties' basic
    ``type``, in words the model can act on; None when nothing is. Integral floats given
    for an integer are made ints in ``arguments``, so a tool gets the type it declared."""
    props = schema.get("properties")
    props = props if isinstance(props, dict) else {}

    def expected(name: str) -> list[str]:
        spec = props.get(name)
        t = spec.get("type") if isinstance(spec, dict) else None
        names = [t] if isinstance(t, str) else t if isinstance(t, list) else []
        return [n for n in names if isinstance(n, str)]

    for name in schema.get("required") or ():
        if isinstance(name, str) and name not in arguments:
            want = expected(name)
            return f"missing required argument {name!r}" + (f" ({' or '.join(want)})" if want else "")
    for name, value in arguments.items():
        want = expected(name)
        known = [t for t in want if t in _JSON_TYPES]
        if not known:
            continue
        if not any(_JSON_TYPES[t](value) for t in known):
            return f"argument {name!r} must be {' or '.join(known)}, not {_json_type(value)}"
        if isinstance(value, float) and "integer" in known and "number" not in known:
            arguments[name] = int(value)
    return None


def _json_type(value: Any) -> str:
    for name in ("null", "boolean", "integer", "number", "string", "array", "object"):
        if _JSON_TYPES[name](value):
            return name
    return type(value).__name__


def _text_result(text: str, *, is_error: bool) -> dict[str, Any]:
    return {"content": [{"type": "text", "text": text}], "isError": is_error}


def refused_status(reply: dict[str, Any]) -> int:
    """The HTTP status of a refused call's reply: the limit's own (429, or 403)."""
    data = reply.get("error", {}).get("data") or {}
    status = data.get("status")
    return status if isinstance(status, int) else 429


class _Meter:
    """One HTTP request's calls counted against the caller's limits, and the headers its answer
    carries: x-ratelimit-* as after the last call counted, Retry-After when one was refused."""

    __slots__ = ("_admit", "headers", "refused", "retry_after")

    def __init__(self, admit: Admit | None) -> None:
        self._admit = admit
        self.headers: dict[str, str] = {}
        self.refused = 0
        self.retry_after: str | None = None

    async def count(self, id_: str | int | None) -> dict[str, Any] | None:
        """None when the call may go on; else the JSON-RPC error that answers it."""
        if self._admit is None:
            return None
        try:
            self.headers = await self._admit()
            return None
        except LimitError as exc:
            self.refused += 1
            self.headers = exc.headers
            self.retry_after = exc.headers.get("retry-after", self.retry_after)
            data: dict[str, Any] = {"status": exc.status, "code": exc.code}
            if exc.retry_after is not None:
                data["retry_after"] = max(1, math.ceil(exc.retry_after))
            return _error(id_, LIMITED, exc.message, data)

    def answer(self, resp: web.StreamResponse) -> web.StreamResponse:
        resp.headers.update(self.headers)
        if self.retry_after is not None:
            resp.headers["Retry-After"] = self.retry_after
        return resp


class McpServer:
    """The MCP endpoint of one set of tools; see the module's docstring."""

    def __init__(
        self,
        name: str,
        version: str,
        tools: Sequence[Tool],
        instructions: str | None = None,
        *,
        max_sessions: int = MAX_SESSIONS,
        sessions_per_owner: int = SESSIONS_PER_OWNER,
        session_idle_s: float = SESSION_IDLE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._info = {"name": name, "version": version}
        self._instructions = instructions
        self._tools: dict[str, Tool] = {}
        for t in tools:
            if t.name in self._tools:
                raise ValueError(f"two tools are named {t.name!r}")
            if t.input_schema.get("type") != "object":
                raise ValueError(f"tool {t.name!r}: input_schema must be a JSON Schema of type object")
            self._tools[t.name] = t
        # The same for every call, so built once.
        self._listing = [
            {
                "name": t.name,
                "description": t.description,
                "inputSchema": t.input_schema,
                # destructiveHint means something only when readOnlyHint is false; a tool that
                # writes is assumed to possibly overwrite, the spec's own default.
                "annotations": {"readOnlyHint": t.read_only, "destructiveHint": not t.read_only},
            }
            for t in tools
        ]
        self._sessions = _Sessions(max_sessions, session_idle_s, clock, sessions_per_owner)

    async def handle(
        self, request: web.Request, caller: Any, owner: str, admit: Admit | None = None
    ) -> web.StreamResponse:
        """Answer one HTTP request on the MCP route, already authenticated.

        ``caller`` is passed to the tools as it is; ``owner`` says who authenticated (the
        gateway passes the API key's id): a session is answered only to its owner, and to
        anyone else exactly as an unknown one. ``admit`` counts a call against the caller's
        limits: every JSON-RPC request is one call (each of a batch, initialize included),
        and so is an HTTP request that carries none (a GET, a DELETE, notifications alone).
        """
        origin = request.headers.get("Origin")
        # A page in a browser sends Origin; one on another site must not drive the tools
        # with the credentials the browser holds for this one. Programs send none.
        if origin is not None and not _same_origin(origin, request.host):
            return _refusal(403, INVALID_REQUEST, f"requests from web pages on {origin} are refused")
        meter = _Meter(admit)
        if request.method == "POST":
            return meter.answer(await self._post(request, caller, owner, meter))
        refused = await meter.count(None)
        if refused is not None:
            return meter.answer(_json(refused, refused_status(refused)))
        if request.method == "DELETE":
            return meter.answer(self._delete(request, owner))
        # No server-initiated stream: 405 is the spec's way of saying so.
        return meter.answer(
            _refusal(
                405,
                INVALID_REQUEST,
                "this server opens no event stream; POST messages",
                headers={"Allow": "POST, DELETE"},
            )
        )

    def _version_refusal(self, request: web.Request) -> web.Response | None:
        requested = request.headers.get(VERSION_HEADER)
        if requested is None or requested in PROTOCOL_VERSIONS:
            # Absent: the version the session negotiated stands (clients before 2025-06-18 send none).
            return None
        return _refusal(
            400,
            UNSUPPORTED_PROTOCOL_VERSION,
            f"unsupported {VERSION_HEADER} {requested!r}",
            {"supported": list(PROTOCOL_VERSIONS), "requested": requested},
        )

    def _session(self, request: web.Request, owner: str) -> _Session | web.Response:
        sid = request.headers.get(SESSION_HEADER)
        if not sid:
            return _refusal(400, INVALID_REQUEST, f"the {SESSION_HEADER} header is required; send initialize first")
        session = self._sessions.get(sid, owner)
        if session is None:
            # 404 tells the client to start a new session with initialize.
            return _refusal(404, INVALID_REQUEST, "session not found (ended or expired); initialize again")
        return session

    async def _post(self, request: web.Request, caller: Any, owner: str, meter: _Meter) -> web.Response:
        if request.content_type != "application/json":
            return _refusal(415, INVALID_REQUEST, f"the body must be application/json, not {request.content_type}")
        if not _accepts_json(request.headers.get("Accept")):
            return _refusal(406, INVALID_REQUEST, "the client must accept application/json")
        body = await _read_body(request)
        if body is None:
            return _refusal(413, INVALID_REQUEST, f"the body is over {MAX_BODY_BYTES} bytes")
        try:
            payload = load_json(body)
        except BadInput as exc:
            return _refusal(400, PARSE_ERROR, exc.message)

        batch = isinstance(payload, list)
        if batch and not payload:
            return _refusal(400, INVALID_REQUEST, "an empty batch")
        messages = [_parse(m) for m in payload] if batch else [_parse(payload)]
        if not batch:
            (m,) = messages
            if isinstance(m, dict):
                # Not a message at all: refused at the HTTP level as well as in JSON-RPC.
                return _json(m, 400)
            if isinstance(m, _Message) and not m.notification and m.method == "initialize":
                # The one request without a session: it makes one. A session id or version
                # header it carries is from an earlier session (a client starting over).
                limited = await meter.count(m.id)
                if limited is not None:
                    return _json(limited, refused_status(limited))
                return self._initialize(m, owner)

        refused = self._version_refusal(request)
        if refused is not None:
            return refused
        session = self._session(request, owner)
        if isinstance(session, web.Response):
            return session

        calls = [m for m in messages if isinstance(m, _Message) and not m.notification]
        if not calls:
            limited = await meter.count(None)
            if limited is not None:
                return _json(limited, refused_status(limited))
        replies: list[dict[str, Any]] = []
        # In order, one at a time: a batch that writes then reads sees its own write. Each call
        # is counted as it comes, so a batch larger than the key's rate runs its first calls only.
        for m in messages:
            if m is None:
                continue  # a response from the client: there is nothing to answer
            if isinstance(m, dict):
                reply: dict[str, Any] | None = m
            elif not m.notification and (limited := await meter.count(m.id)) is not None:
                reply = limited
            else:
                reply = await self._message(m, caller)
            if reply is not None:
                replies.append(reply)
        if not replies:
            return web.Response(status=202)
        # Every call refused by the limits: the HTTP status says so too, as chat's 429 does.
        status = 429 if calls and meter.refused == len(calls) else 200
        return _json(replies if batch else replies[0], status)

    def _initialize(self, m: _Message, owner: str) -> web.Response:
        params = m.params if isinstance(m.params, dict) else {}
        requested = params.get("protocolVersion")
        if not isinstance(requested, str):
            return _json(_error(m.id, INVALID_PARAMS, "initialize needs params.protocolVersion, a string"))
        version = requested if requested in PROTOCOL_VERSIONS else LATEST_PROTOCOL_VERSION
        result: dict[str, Any] = {
            "protocolVersion": version,
            "capabilities": {"tools": {"listChanged": False}},
            "serverInfo": self._info,
        }
        if self._instructions is not None:
            result["instructions"] = self._instructions
        try:
            sid = self._sessions.create(owner, version)
        except SessionsFull as exc:
            return _json(_error(m.id, INTERNAL_ERROR, str(exc)), 503, {"Retry-After": "60"})
        return _json(_result(m.id, result), headers={SESSION_HEADER: sid})

    async def _message(self, parsed: _Message, caller: Any) -> dict[str, Any] | None:
        if parsed.notification:
            # notifications/initialized, cancelled, roots changed…: nothing here acts on them,
            # and a notification is never answered.
            return None
        id_ = parsed.id
        method = parsed.method
        if parsed.params is not None and not isinstance(parsed.params, dict):
            return _error(id_, INVALID_PARAMS, "params must be an object")
        params: dict[str, Any] = parsed.params or {}
        if method == "ping":
            return _result(id_, {})
        if method == "tools/list":
            return _result(id_, {"tools": self._listing})
        if method == "tools/call":
            return await self._call(id_, params, caller)
        if method == "initialize":
            # Only reached in a batch: the spec has initialize sent alone.
            return _error(id_, INVALID_REQUEST, "initialize may not be sent in a batch; POST it alone")
        return _error(id_, METHOD_NOT_FOUND, f"method not found: {method}")

    async def _call(self, id_: str | int | None, params: dict[str, Any], caller: Any) -> dict[str, Any]:
        name = params.get("name")
        if not isinstance(name, str):
            return _error(id_, INVALID_PARAMS, "tools/call needs params.name, a string")
        tool = self._tools.get(name)
        if tool is None:
            return _error(id_, INVALID_PARAMS, f"unknown tool: {name}")
        arguments = params.get("arguments")
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            return _error(id_, INVALID_PARAMS, "params.arguments must be an object")
        arguments = dict(arguments)
        problem = _argument_problem(tool.input_schema, arguments)
        if problem is not None:
            # A result, not a protocol error: the model reads it and can call again correctly.
            return _result(id_, _text_result(f"invalid arguments for {name}: {problem}", is_error=True))
        try:
            out = await tool.call(caller, arguments)
            text = out if isinstance(out, str) else orjson.dumps(out).decode()
        except ToolError as exc:
            return _result(id_, _text_result(str(exc), is_error=True))
        except Exception:
            # The traceback is for the operator's log; the client learns only that it failed.
            log.exception("MCP tool %s failed", name)
            return _error(id_, INTERNAL_ERROR, "internal error")
        result = _text_result(text, is_error=False)
        if isinstance(out, dict):
            result["structuredContent"] = out
        return _result(id_, result)

    def _delete(self, request: web.Request, owner: str) -> web.Response:
        refused = self._version_refusal(request)
        if refused is not None:
            return refused
        sid = request.headers.get(SESSION_HEADER)
        if not sid:
            return _refusal(400, INVALID_REQUEST, f"the {SESSION_HEADER} header names the session to end")
        if not self._sessions.end(sid, owner):
            return _refusal(404, INVALID_REQUEST, "session not found (ended or expired)")
        return web.Response(status=200)
