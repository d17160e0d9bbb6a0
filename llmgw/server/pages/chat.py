"""The chat page (/chat): try a model as the signed-in person, through the same path as an API key.

The page posts each turn to ``/chat/send`` (JSON, with the session's CSRF token
in ``X-CSRF-Token``); the server builds the person's principal for the project
they spend against (or on their own), holds the temperature to 0-2, asks for a
stream with usage, and hands it to the gateway (limits, admission, routing,
usage recorded as ``session:<user id>``). The reply streams back as the engine
sends it; Stop aborts the fetch, the gateway sees the client gone and closes the
engine's connection, so the engine stops too. When a reply ends the page asks
``/chat/render`` for it as HTML: markdown rendered here with raw HTML dropped and
unsafe links emptied (:mod:`llmgw.server.pages.markdown`). The conversation is
kept in the browser's storage; the gateway keeps none.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson
from aiohttp import web

from llmgw.server.gateway.auth import person_principal
from llmgw.server.gateway.proxy import Gateway
from llmgw.server.gateway.request import CHAT
from llmgw.server.pages.markdown import render_markdown
from llmgw.server.pages.session import current
from llmgw.server.pages.site import Site
from llmgw.store import Tree

# The page's own ceiling on a reply; a model's max_output lowers it further.
PAGE_MAX_TOKENS = 4096
MAX_MESSAGES = 200
MAX_RENDER_BYTES = 256 * 1024


@dataclass(frozen=True)
class Choice:
    """What a turn may spend against: a project (by id, with its path) or the person's own (id "")."""

    id: str
    label: str


def spend_choices(tree: Tree, user_id: str) -> list[Choice]:
    """The projects the person reaches, then their own (personal) use."""
    mine = [p for p in tree.projects.values() if tree.reaches(user_id, p)]
    return [Choice(p.id, p.path) for p in sorted(mine, key=lambda p: p.path)] + [Choice("", "personal")]


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


class ChatPage:
    def __init__(self, site: Site, gateway: Gateway) -> None:
        self.site = site
        self.gateway = gateway

    def add_routes(self) -> None:
        self.site.menu.add("Chat", "/chat")
        self.site.route("GET", "/chat", "session", self.page)
        self.site.route("POST", "/chat/send", "session", self.send)
        self.site.route("POST", "/chat/render", "session", self.render)

    def models(self, tree: Tree | None = None) -> list[dict[str, object]]:
        """Every model once, under its catalog name; on-demand ones marked; those scaled to nothing left out."""
        out = []
        for m in self.gateway.model_configs:
            scaling = getattr(m, "scaling", None)
            if scaling is not None and getattr(scaling, "max", 1) == 0:
                continue
            on_demand = bool(m.managed and scaling is not None and scaling.min == 0)
            out.append({"name": m.name, "on_demand": on_demand, "description": m.description or ""})
        return out

    async def page(self, request: web.Request) -> web.StreamResponse:
        visitor = current(request)
        assert visitor is not None
        tree = await self.site.store.tenancy_snapshot()
        return self.site.render.page(
            request,
            "chat.html",
            models=self.models(),
            choices=spend_choices(tree, visitor.user.id),
            max_tokens=PAGE_MAX_TOKENS,
        )

    async def send(self, request: web.Request) -> web.StreamResponse:
        visitor = current(request)
        assert visitor is not None
        try:
            data = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            return _error(400, "the page sent something that is not JSON; reload it")
        if not isinstance(data, dict):
            return _error(400, "the page sent something that is not a turn; reload it")
        model = data.get("model")
        messages = data.get("messages")
        if not isinstance(model, str) or not model:
            return _error(400, "choose a model")
        if not isinstance(messages, list) or not messages or len(messages) > MAX_MESSAGES:
            return _error(400, f"a conversation holds 1 to {MAX_MESSAGES} messages; start a new one")
        turns: list[dict[str, str]] = []
        system = data.get("system")
        if isinstance(system, str) and system.strip():
            turns.append({"role": "system", "content": system})
        for m in messages:
            if (
                not isinstance(m, dict)
                or m.get("role") not in ("user", "assistant")
                or not isinstance(m.get("content"), str)
            ):
                return _error(400, "a message is a role (user or assistant) and its text")
            turns.append({"role": m["role"], "content": m["content"]})
        try:
            temperature = float(data.get("temperature", 0.7))
        except (TypeError, ValueError):
            temperature = 0.7
        temperature = min(2.0, max(0.0, temperature))  # held to 0-2 whatever the page sends
        tree = await self.site.store.tenancy_snapshot()
        project = data.get("project") or None
        if project is not None:
            proj = tree.projects.get(str(project))
            if proj is None or not tree.reaches(visitor.user.id, proj):
                return _error(403, "you do not belong to that project (any more); choose another")
        principal = person_principal(
            visitor.user.id,
            project,
            tree,
            self.site.config.auth.default_rpm,
            self.site.config.auth.default_tpm,
        )
        body = {
            "model": model,
            "messages": turns,
            "temperature": temperature,
            "max_tokens": PAGE_MAX_TOKENS,  # the gateway lowers it to the model's max_output
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        return await self.gateway.serve_as(request, CHAT, principal, orjson.dumps(body))

    async def render(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        if len(raw) > MAX_RENDER_BYTES:
            return _error(413, "that reply is too long to render; it stays as text")
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return _error(400, "the page sent something that is not JSON")
        text = data.get("text") if isinstance(data, dict) else None
        if not isinstance(text, str):
            return _error(400, "nothing to render")
        return web.json_response({"html": render_markdown(text)})
