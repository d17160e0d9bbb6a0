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

Without script the same form posts to ``/chat`` (the session's CSRF token in the
form): the turn goes through the same path unstreamed, and the page comes back
with the conversation so far, the reply rendered, and the conversation carried
in a hidden field of the next form (so it lasts as long as the page; the gateway
still keeps none).

An on-demand model that is not loaded is woken first: ``POST /chat/wake`` does
what a first request for it does (the gateway's ``touch`` and the reconciler's
``wait_ready``, here without waiting) and answers at once; the page then polls
``GET /chat/model-status`` every second, which reads the replica rows `llmgw ctl
replicas` prints and the model's status `llmgw ctl models` prints: waiting for
a node (with the reason), downloading (bytes and percent), starting, ready or
failed. Both answer only for a model the person may use; on a gateway without a
control plane every model is always loaded.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import orjson
from aiohttp import web

from llmgw.protocol.admin import ReplicaRow
from llmgw.server.control.reconciler import Reconciler
from llmgw.server.gateway.auth import person_principal
from llmgw.server.gateway.checks import BadInput, load_json
from llmgw.server.gateway.principal import Principal
from llmgw.server.gateway.proxy import Gateway
from llmgw.server.gateway.request import CHAT, ServedModel
from llmgw.server.pages.admin_format import percent, size
from llmgw.server.pages.markdown import render_markdown
from llmgw.server.pages.session import Visitor, current
from llmgw.server.pages.site import Site
from llmgw.store import Tree

# The page's own ceiling on a reply; a model's max_output lowers it further.
PAGE_MAX_TOKENS = 4096
MAX_MESSAGES = 200
MAX_RENDER_BYTES = 256 * 1024
FORM_FIELDS = ("model", "project", "system", "temperature", "message")  # a no-script turn's form


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


async def _posted(request: web.Request, what: str) -> dict[str, Any] | web.Response:
    """The JSON object the page's script posted (/chat/send, /chat/wake), or the 400 saying it sent
    something else: ``what`` names what it should have sent."""
    try:
        data = load_json(await request.read())
    except BadInput as exc:
        return _error(400, f"the page sent something this server cannot read ({exc.message}); reload it")
    if not isinstance(data, dict):
        return _error(400, f"the page sent something that is not {what}; reload it")
    return data


def _message_of(resp: web.Response) -> str:
    """The sentence of an error answer in OpenAI's shape (the gateway's and this page's own)."""
    try:
        return str(orjson.loads(resp.body or b"")["error"]["message"])  # type: ignore[arg-type]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return f"the gateway answered {resp.status}"


def read_history(raw: str) -> list[dict[str, Any]] | None:
    """The conversation a no-script form carries back: user and assistant turns, or None when it is
    not one (the person's own words, so nothing more is trusted from it than from an API client)."""
    if not raw:
        return []
    if len(raw) > MAX_RENDER_BYTES * 4:
        return None
    try:
        # surrogatepass: a lone surrogate becomes bytes that are not UTF-8, which load_json refuses.
        turns = load_json(raw.encode("utf-8", "surrogatepass"))
    except BadInput:
        return None
    if not isinstance(turns, list) or len(turns) >= MAX_MESSAGES:
        return None
    out: list[dict[str, Any]] = []
    for t in turns:
        if (
            not isinstance(t, dict)
            or t.get("role") not in ("user", "assistant")
            or not isinstance(t.get("content"), str)
        ):
            return None
        out.append({"role": t["role"], "content": t["content"]})
    return out


def whole_reply(resp: web.StreamResponse) -> tuple[str, int | None] | str:
    """An unstreamed chat completion's text and completion tokens, or the sentence saying why there is none."""
    if not isinstance(resp, web.Response) or resp.body is None:
        return "the gateway's answer could not be read; try again"
    try:
        data = orjson.loads(resp.body)  # type: ignore[arg-type]
    except orjson.JSONDecodeError:
        return f"the model's engine answered {resp.status} with something other than JSON"
    if resp.status >= 400 or not isinstance(data, dict) or "choices" not in data:
        return _message_of(resp)
    try:
        text = data["choices"][0]["message"]["content"] or ""
    except (KeyError, IndexError, TypeError):
        return "the model's answer held no message"
    usage = data.get("usage") or {}
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return str(text), tokens if isinstance(tokens, int) else None


def _latency(s: float) -> str:
    if s < 1:
        return f"{round(s * 1000)} ms"
    if s < 60:
        return f"{s:.1f} s"
    return f"{int(s // 60)}m {round(s % 60)}s"


def figure_words(f: dict[str, Any] | None) -> str:
    """Under a reply: its tokens, tokens per second and total time (as chat.js writes them)."""
    if not f:
        return ""
    parts = []
    if f.get("tokens") is not None:
        parts.append(f"{f['tokens']} tokens")
    if f.get("tps") is not None:
        parts.append(f"{f['tps']:.1f} tokens/s")
    if f.get("total") is not None:
        parts.append(f"total {_latency(f['total'])}")
    return " · ".join(parts)


# -- an on-demand model's loading, from the replica rows -------------------------------------------

READY = "ready"
WAITING = "waiting for a node"
DOWNLOADING = "downloading"
STARTING = "starting"
FAILED = "failed"
ALWAYS_LOADED = "models on this gateway are always loaded"


@dataclass(frozen=True)
class Loading:
    """Where an on-demand model is on its way to serving, as /chat/model-status answers it."""

    model: str
    state: str  # READY, WAITING, DOWNLOADING, STARTING or FAILED
    bytes_done: int | None = None
    bytes_total: int | None = None
    percent: float | None = None
    reason: str | None = None

    @property
    def message(self) -> str:
        """The page's status line."""
        name = self.model
        if self.state == READY:
            return f"{name} is loaded."
        if self.state == DOWNLOADING:
            done = size(self.bytes_done)
            if self.bytes_total:
                return f"Downloading {name}'s weights: {done} of {size(self.bytes_total)} ({percent(self.percent)})"
            return f"Downloading {name}'s weights: {done} so far"
        if self.state == STARTING:
            return f"Starting the engine for {name}…"
        if self.state == FAILED:
            return f"{name} could not be started: {self.reason}"
        return f"Waiting for a node to run {name}: {self.reason}"

    def body(self) -> dict[str, Any]:
        return {**asdict(self), "message": self.message}


def loading_state(name: str, rows: list[ReplicaRow], status: dict[str, Any], admin: bool) -> Loading:
    """The model's state from its replica rows (`llmgw ctl replicas`) and its status (`llmgw ctl models`).

    The placement refusal and a failure's words name nodes, memory and engine output: shown as they
    are to administrators, and to anyone else as a sentence naming the command that shows them, as
    the gateway's own answer to an API client does."""
    if any(r.state == "ready" and r.endpoint is not None for r in rows):
        return Loading(name, READY)
    live = [r for r in rows if r.state in ("starting", "loading", "ready")]
    if live:
        fetching = [s.fetch for r in live for s in r.shards or () if s.fetch is not None]
        if fetching:
            done = sum(f.bytes_done or 0 for f in fetching)
            totals = [f.bytes_total or 0 for f in fetching]
            total = sum(totals) if all(totals) else None  # unknown while any length is
            pct = round(min(100.0, 100.0 * done / total), 1) if total else None
            return Loading(name, DOWNLOADING, done, total, pct)
        return Loading(name, STARTING)
    backoff = status.get("backoff")
    if backoff:
        when = f"the next try is in {backoff['retry_in_s']:.0f} s"
        why = backoff.get("last_failure") if admin else None
        reason = (
            f"{why}; {when}"
            if why
            else f"its engine did not start; {when}, and an operator can see why with llmgw ctl replicas {name}"
        )
        return Loading(name, FAILED, reason=reason)
    problem = status.get("problem")
    if problem:
        reason = (
            problem
            if admin
            else f"no node can take it now; an operator can see why with llmgw ctl explain-placement {name}"
        )
        return Loading(name, WAITING, reason=reason)
    if not status.get("target"):
        failed = next((r for r in rows if r.state == "failed"), None)
        if failed is not None:
            why = failed.reason if admin else None
            reason = why or f"its engine did not start; an operator can see why with llmgw ctl replicas {name}"
            return Loading(name, FAILED, reason=reason)
        return Loading(name, WAITING, reason="it is not loaded; sending a message loads it")
    return Loading(name, WAITING, reason="the control plane is choosing a node for it")


class ChatPage:
    def __init__(self, site: Site, gateway: Gateway) -> None:
        self.site = site
        self.gateway = gateway

    def add_routes(self) -> None:
        self.site.menu.add("Chat", "/chat")
        self.site.route("GET", "/chat", "session", self.page)
        self.site.route("POST", "/chat", "session", self.send_form)
        self.site.route("POST", "/chat/send", "session", self.send)
        self.site.route("POST", "/chat/render", "session", self.render)
        self.site.route("POST", "/chat/wake", "session", self.wake)
        self.site.route("GET", "/chat/model-status", "session", self.model_status)

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
        return await self._page(request, {}, [], "", 200)

    def _turn(self, data: dict[str, Any], stream: bool) -> dict[str, Any] | web.Response:
        """The chat completion a turn asks for (the page's model, conversation, system prompt and
        temperature), or the 400 saying what was wrong with it."""
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
        if temperature != temperature:  # NaN compares unequal to itself
            temperature = 0.7
        temperature = min(2.0, max(0.0, temperature))  # held to 0-2 whatever the page sends
        # The page's ceiling, lowered to the model's max_output (the gateway refuses more than that).
        served = self.gateway.models.get(model)
        max_tokens = PAGE_MAX_TOKENS
        if served is not None and served.max_output is not None:
            max_tokens = min(max_tokens, served.max_output)
        body: dict[str, Any] = {
            "model": model,
            "messages": turns,
            "temperature": temperature,
            "max_tokens": max_tokens,
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    async def send(self, request: web.Request) -> web.StreamResponse:
        visitor = current(request)
        assert visitor is not None
        data = await _posted(request, "a turn")
        if isinstance(data, web.Response):
            return data
        body = self._turn(data, stream=True)
        if isinstance(body, web.Response):
            return body
        principal = await self._principal(visitor, data.get("project"))
        if isinstance(principal, web.Response):
            return principal
        return await self.gateway.serve_as(request, CHAT, principal, orjson.dumps(body))

    async def send_form(self, request: web.Request) -> web.StreamResponse:
        """A turn posted as a plain form (no script): answered whole, with the page around it."""
        visitor = current(request)
        assert visitor is not None
        form = await request.post()
        said = {k: str(form.get(k, "")) for k in FORM_FIELDS}
        history = read_history(str(form.get("history", "")))
        asked = said["message"].strip()
        if history is None:
            return await self._page(
                request, said, [], "The conversation sent with the form could not be read; start a new one.", 400
            )
        if not asked:
            return await self._page(request, said, history, "Write a message first.", 400)
        conversation = [*history, {"role": "user", "content": asked}]
        data = {**said, "messages": conversation}
        body = self._turn(data, stream=False)
        if isinstance(body, web.Response):
            return await self._page(request, said, history, _message_of(body), body.status)
        principal = await self._principal(visitor, said["project"])
        if isinstance(principal, web.Response):
            return await self._page(request, said, history, _message_of(principal), principal.status)
        t0 = time.monotonic()
        resp = await self.gateway.serve_as(request, CHAT, principal, orjson.dumps(body))
        total = time.monotonic() - t0
        reply = whole_reply(resp)
        if isinstance(reply, str):
            return await self._page(request, said, history, reply, 502 if resp.status < 400 else resp.status)
        text, tokens = reply
        figures = {"tokens": tokens, "total": total, "tps": tokens / total if tokens and total > 0 else None}
        conversation.append({"role": "assistant", "content": text, "figures": figures})
        return await self._page(request, {**said, "message": ""}, conversation, "", 200)

    async def _page(
        self,
        request: web.Request,
        said: dict[str, str],
        conversation: list[dict[str, Any]],
        problem: str,
        status: int,
    ) -> web.StreamResponse:
        visitor = current(request)
        assert visitor is not None
        tree = await self.site.store.tenancy_snapshot()
        return self.site.render.page(
            request,
            "chat.html",
            status,
            models=self.models(),
            choices=spend_choices(tree, visitor.user.id),
            max_tokens=PAGE_MAX_TOKENS,
            said={k: said.get(k, "") for k in FORM_FIELDS},
            problem=problem,
            turns=[
                {**t, "html": render_markdown(t["content"]) if t["role"] == "assistant" else ""} for t in conversation
            ],
            history=orjson.dumps([{"role": t["role"], "content": t["content"]} for t in conversation]).decode(),
            figures=figure_words,
        )

    async def _principal(self, visitor: Visitor, project: object) -> Principal | web.Response:
        """The person spending against one of their projects (by id), or on their own (empty)."""
        tree = await self.site.store.tenancy_snapshot()
        project_id = str(project) if project else None
        if project_id is not None:
            proj = tree.projects.get(project_id)
            if proj is None or not tree.reaches(visitor.user.id, proj):
                return _error(403, "you do not belong to that project (any more); choose another")
        return person_principal(
            visitor.user.id,
            project_id,
            tree,
            self.site.config.auth.default_rpm,
            self.site.config.auth.default_tpm,
        )

    async def _usable(self, visitor: Visitor, model: object, project: object) -> ServedModel | web.Response:
        """A model the page offers (a name or an alias) that the person may use where they spend."""
        if not isinstance(model, str) or not model:
            return _error(400, "choose a model")
        served = self.gateway.models.get(model)
        if served is None or served.name not in {m["name"] for m in self.models()}:
            return _error(404, f"no model named {model} is served here; choose one from the list")
        principal = await self._principal(visitor, project)
        if isinstance(principal, web.Response):
            return principal
        allowed = principal.models
        if allowed is not None and served.name not in allowed:
            may = f"you may use: {', '.join(sorted(allowed))}" if allowed else "you may use no models"
            return _error(403, f"you may not use {served.name} here; {may}")
        return served

    def _reconciler(self, served: ServedModel) -> Reconciler | None:
        """The control plane that loads ``served`` on demand; None when it is always loaded."""
        demand = self.gateway.demand
        return demand if served.managed and isinstance(demand, Reconciler) else None

    def _loading(self, served: ServedModel, visitor: Visitor) -> Loading:
        rec = self._reconciler(served)
        if rec is None:
            return Loading(served.name, READY, reason=ALWAYS_LOADED)
        # The rows the admin API answers /api/v1/replicas with, in the wire's shape.
        rows = [ReplicaRow.model_validate(r) for r in rec.replica_rows(served.name)]
        return loading_state(served.name, rows, rec.model_status(served.name), visitor.user.admin)

    async def wake(self, request: web.Request) -> web.StreamResponse:
        """Ask the control plane for the model, as a first request does, and answer at once."""
        visitor = current(request)
        assert visitor is not None
        data = await _posted(request, "a model")
        if isinstance(data, web.Response):
            return data
        served = await self._usable(visitor, data.get("model"), data.get("project"))
        if isinstance(served, web.Response):
            return served
        rec = self._reconciler(served)
        if rec is not None:
            # What the gateway does for a request that finds no endpoint (proxy.Gateway._forward):
            # the request counts as demand, and waiting for it asks the reconciler for a replica
            # now. The page does not wait here: it polls /chat/model-status.
            rec.touch(served.name)
            await rec.wait_ready(served.name, timeout=0)
        return web.json_response(self._loading(served, visitor).body())

    async def model_status(self, request: web.Request) -> web.StreamResponse:
        visitor = current(request)
        assert visitor is not None
        served = await self._usable(visitor, request.query.get("model"), request.query.get("project"))
        if isinstance(served, web.Response):
            return served
        return web.json_response(self._loading(served, visitor).body())

    async def render(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        if len(raw) > MAX_RENDER_BYTES:
            return _error(413, "that reply is too long to render; it stays as text")
        try:
            data = load_json(raw)
        except BadInput as exc:
            return _error(400, f"the page sent something this server cannot read ({exc.message})")
        text = data.get("text") if isinstance(data, dict) else None
        if not isinstance(text, str):
            return _error(400, "nothing to render")
        return web.json_response({"html": render_markdown(text)})
