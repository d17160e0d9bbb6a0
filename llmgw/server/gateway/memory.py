"""Agent notes: what an agent keeps for itself across conversations, per project, over HTTP
(/v1/memory) and as MCP tools (/v1/mcp), so an agent that speaks MCP needs no code of its own.

Both are kept only for a project that turned notes on (`llmgw keys memory`), with the same
isolation as conversations: a note of another project reads exactly as one that does not exist.
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from llmgw import __version__
from llmgw.errors import LlmgwError
from llmgw.server.gateway.auth import AuthError
from llmgw.server.gateway.checks import INT_MAX, BadInput, check_id, load_json
from llmgw.server.gateway.conversations import NotKept, Scope
from llmgw.server.gateway.errors import error_response, limit_response
from llmgw.server.gateway.limits import LimitError
from llmgw.server.gateway.mcp import McpServer, Tool, ToolError
from llmgw.server.gateway.principal import Principal
from llmgw.store.agents import Quota
from llmgw.store.errors import QuotaFull, StoreError

if TYPE_CHECKING:
    from llmgw.server.gateway.conversations import Conversations
    from llmgw.server.gateway.proxy import Gateway

MAX_LIST = 200
MAX_BODY = 256 * 1024  # a note is at most 64 KiB of text; the rest is room for its JSON

_INSTRUCTIONS = (
    "Notes you keep for yourself across conversations, shared by everyone working in this project: "
    "search them before starting on something, and write down what a later conversation should know."
)


def _note(n: Any) -> dict[str, Any]:
    return {
        "id": n.id,
        "object": "memory.note",
        "title": n.title,
        "text": n.text,
        "created_at": _unix(n.created_at),
        "updated_at": _unix(n.updated_at),
    }


def _unix(at: datetime) -> int:
    return int(at.timestamp())


class _NoteRefused(LlmgwError):
    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


def _text_field(args: dict, name: str, required: bool, limit: int | None = None) -> str | None:
    v = args.get(name)
    if v is None:
        if required:
            raise _NoteRefused(400, f"'{name}' is required", "missing_field")
        return None
    if not isinstance(v, str):
        raise _NoteRefused(400, f"'{name}' should be a string", "invalid_request")
    return v


class Memory:
    def __init__(self, gateway: Gateway, conversations: Conversations | None) -> None:
        self.gateway = gateway
        self.conversations = conversations
        self.mcp = McpServer(
            "llmgw-memory",
            __version__,
            self._tools(),
            instructions=_INSTRUCTIONS,
            sessions_per_owner=gateway.config.agents.mcp_sessions_per_key,
        )

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/memory", self.create)
        app.router.add_get("/v1/memory", self.list_notes)
        app.router.add_get("/v1/memory/{note}", self.get)
        app.router.add_patch("/v1/memory/{note}", self.update)
        app.router.add_delete("/v1/memory/{note}", self.delete)
        for method in ("POST", "GET", "DELETE"):
            app.router.add_route(method, "/v1/mcp", self.mcp_route)

    # -- who may keep notes here --------------------------------------------------------

    async def _scope(self, request: web.Request) -> tuple[Principal, Scope]:
        try:
            principal = await self.gateway._authenticate(request)
        except AuthError as exc:
            raise _NoteRefused(401, exc.message, exc.code) from None
        return principal, self._scope_of(principal)

    def _scope_of(self, principal: Principal) -> Scope:
        if self.conversations is None:
            raise _NoteRefused(400, "this gateway keeps no agent notes", "memory_off")
        scope = self.conversations.scope(principal, "memory")
        if isinstance(scope, NotKept):
            raise _NoteRefused(400, scope.message, scope.code)
        return scope

    @property
    def _quota(self) -> Quota | None:
        return self.conversations.quota if self.conversations is not None else None

    @property
    def _store(self) -> Any:
        assert self.conversations is not None
        return self.conversations.store

    # -- the operations, shared by HTTP and MCP -------------------------------------------

    async def _create(self, scope: Scope, args: dict) -> dict:
        text = _text_field(args, "text", True)
        title = _text_field(args, "title", False)
        assert text is not None
        return _note(await self._store.create_note(scope.project_id, text, title, self._quota))

    async def _get(self, scope: Scope, note_id: str) -> dict:
        check_id("note", note_id, "note_id")
        n = await self._store.get_note(scope.project_id, note_id, scope.hours)
        if n is None:
            raise _NoteRefused(404, f"there is no note {note_id[:64]!r} here", "note_not_found")
        return _note(n)

    async def _list(self, scope: Scope, query: str | None, limit: int, offset: int) -> dict:
        if query is not None and query.strip():
            found = await self._store.search_notes(scope.project_id, query, scope.hours, limit=limit)
        else:
            found = await self._store.list_notes(scope.project_id, scope.hours, limit=limit, offset=offset)
        return {"object": "list", "data": [_note(n) for n in found]}

    async def _update(self, scope: Scope, note_id: str, args: dict) -> dict:
        text = _text_field(args, "text", False)
        title = _text_field(args, "title", False)
        if text is None and title is None:
            raise _NoteRefused(400, "give 'text', 'title' or both: what the note should now say", "missing_field")
        check_id("note", note_id, "note_id")
        if await self._store.get_note(scope.project_id, note_id, scope.hours) is None:
            raise _NoteRefused(404, f"there is no note {note_id[:64]!r} here", "note_not_found")
        n = await self._store.update_note(scope.project_id, note_id, text=text, title=title, quota=self._quota)
        if n is None:
            raise _NoteRefused(404, f"there is no note {note_id[:64]!r} here", "note_not_found")
        return _note(n)

    async def _delete(self, scope: Scope, note_id: str) -> dict:
        check_id("note", note_id, "note_id")
        if await self._store.get_note(scope.project_id, note_id, scope.hours) is None or not (
            await self._store.delete_note(scope.project_id, note_id)
        ):
            raise _NoteRefused(404, f"there is no note {note_id[:64]!r} here", "note_not_found")
        return {"id": note_id, "object": "memory.note.deleted", "deleted": True}

    # -- HTTP ---------------------------------------------------------------------------

    async def _answer(self, request: web.Request, op, status: int = 200) -> web.Response:
        headers: dict[str, str] = {}
        try:
            principal, scope = await self._scope(request)
            # Counted before the body is read or the store asked: a key at its limits costs neither.
            headers = await self.gateway.count_call(principal)
            result = await op(scope)
        except LimitError as exc:
            return limit_response(exc)
        except _NoteRefused as exc:
            return error_response(exc.status, exc.message, exc.code, headers=headers or None)
        except QuotaFull as exc:
            # The project's storage quota, named with what it keeps; nothing was written.
            return error_response(exc.status, str(exc), exc.code, headers=headers or None)
        except StoreError as exc:
            # The store's word on what it will not keep (a note too long, say).
            return error_response(400, str(exc), "invalid_request", headers=headers or None)
        return web.Response(
            status=status, body=orjson.dumps(result), content_type="application/json", headers=headers or None
        )

    async def _body(self, request: web.Request) -> dict:
        if request.content_length is not None and request.content_length > MAX_BODY:
            raise _NoteRefused(413, f"a note request is at most {MAX_BODY} bytes", "request_too_large")
        raw = await request.read()
        if len(raw) > MAX_BODY:
            raise _NoteRefused(413, f"a note request is at most {MAX_BODY} bytes", "request_too_large")
        body = load_json(raw)
        if not isinstance(body, dict):
            raise _NoteRefused(400, "the request body should be a JSON object", "invalid_request")
        return body

    async def create(self, request: web.Request) -> web.Response:
        async def op(scope: Scope) -> dict:
            return await self._create(scope, await self._body(request))

        return await self._answer(request, op, 201)

    async def get(self, request: web.Request) -> web.Response:
        return await self._answer(request, lambda scope: self._get(scope, request.match_info["note"]))

    async def list_notes(self, request: web.Request) -> web.Response:
        async def op(scope: Scope) -> dict:
            q = request.query
            limit, offset = _whole(q.get("limit"), "limit", 50), _whole(q.get("offset"), "offset", 0)
            return await self._list(scope, q.get("q"), min(limit, MAX_LIST), offset)

        return await self._answer(request, op)

    async def update(self, request: web.Request) -> web.Response:
        async def op(scope: Scope) -> dict:
            return await self._update(scope, request.match_info["note"], await self._body(request))

        return await self._answer(request, op)

    async def delete(self, request: web.Request) -> web.Response:
        return await self._answer(request, lambda scope: self._delete(scope, request.match_info["note"]))

    # -- MCP ----------------------------------------------------------------------------

    async def mcp_route(self, request: web.Request) -> web.StreamResponse:
        try:
            principal, _ = await self._scope(request)
        except _NoteRefused as exc:
            return error_response(exc.status, exc.message, exc.code)
        # A session belongs to the key that opened it; without keys, to the one shared pool. Each
        # call counts against the key's limits as one request (McpServer.handle).
        return await self.mcp.handle(
            request, principal, principal.key_id or "anonymous", lambda: self.gateway.count_call(principal)
        )

    def _tool(self, name: str, description: str, schema: dict, run, read_only: bool = False) -> Tool:
        async def call(principal: Principal, args: dict) -> Any:
            try:
                return await run(self._scope_of(principal), args)
            except (_NoteRefused, BadInput) as exc:
                raise ToolError(exc.message) from None
            except StoreError as exc:
                raise ToolError(str(exc)) from None

        return Tool(name, description, {"type": "object", **schema}, call, read_only)

    def _tools(self) -> list[Tool]:
        note_id = {"note_id": {"type": "string", "description": "The note's id (note_...), as search or list gave it."}}
        return [
            self._tool(
                "memory_search",
                "Search this project's notes by words (every word must appear, in the title or the text); "
                "newest best matches first.",
                {
                    "properties": {
                        "query": {"type": "string", "description": "Words to look for."},
                        "limit": {"type": "integer", "description": "At most this many notes (default 20)."},
                    },
                    "required": ["query"],
                },
                lambda s, a: self._list(s, a["query"], _bounded(a.get("limit"), 20), 0),
                read_only=True,
            ),
            self._tool(
                "memory_list",
                "List this project's notes, most recently written first.",
                {
                    "properties": {
                        "limit": {"type": "integer", "description": "At most this many (default 50)."},
                        "offset": {"type": "integer", "description": "Skip this many first (default 0)."},
                    }
                },
                lambda s, a: self._list(s, None, _bounded(a.get("limit"), 50), max(0, a.get("offset") or 0)),
                read_only=True,
            ),
            self._tool(
                "memory_read",
                "Read one note in full.",
                {"properties": note_id, "required": ["note_id"]},
                lambda s, a: self._get(s, a["note_id"]),
                read_only=True,
            ),
            self._tool(
                "memory_write",
                "Keep a new note for later conversations in this project.",
                {
                    "properties": {
                        "text": {"type": "string", "description": "What to remember (up to 64 KiB)."},
                        "title": {"type": "string", "description": "A short title (optional)."},
                    },
                    "required": ["text"],
                },
                self._create,
            ),
            self._tool(
                "memory_update",
                "Change a note's text or title.",
                {
                    "properties": {
                        **note_id,
                        "text": {"type": "string", "description": "The note's new text."},
                        "title": {"type": "string", "description": "The note's new title."},
                    },
                    "required": ["note_id"],
                },
                lambda s, a: self._update(s, a["note_id"], a),
            ),
            self._tool(
                "memory_delete",
                "Delete a note that is wrong or no longer needed.",
                {"properties": note_id, "required": ["note_id"]},
                lambda s, a: self._delete(s, a["note_id"]),
            ),
        ]


def _bounded(v: Any, default: int) -> int:
    return default if not isinstance(v, int) or v < 1 else min(v, MAX_LIST)


def _whole(text: str | None, name: str, default: int) -> int:
    if text is None:
        return default
    # isdigit alone takes "²" and other digits int() refuses; 19 digits may still pass 64 bits.
    if not (text.isascii() and text.isdigit() and len(text) <= 19 and int(text) <= INT_MAX):
        raise _NoteRefused(
            400, f"'{name}' should be a whole number from 0 to {INT_MAX}, not {text[:20]!r}", "invalid_request"
        )
    return int(text)
