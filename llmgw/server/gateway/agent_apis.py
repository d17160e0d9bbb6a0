"""The routes coding agents speak besides chat completions: the Responses API, Anthropic's
Messages API (with count_tokens), and conversations kept by the gateway (x-llmgw-thread on
any of them, and /v1/threads/{id}).

Each is translated to chat completions (responses_api.py, messages_api.py) and goes down the
gateway's one path from there: the key's limits, admission, routing and usage, with errors in
the route's own API's shape. A Reply here writes the engine's answer back in that API and hands
the finished turn to the conversation store.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
from aiohttp import web

from llmgw.server.gateway import messages_api, responses_api
from llmgw.server.gateway.auth import AuthError
from llmgw.server.gateway.checks import BadInput, load_json
from llmgw.server.gateway.conversations import (
    NEW_THREAD,
    THREAD_HEADER,
    Conversations,
    NotKept,
    Scope,
    new_thread_id,
)
from llmgw.server.gateway.errors import error_body, error_response, limit_response
from llmgw.server.gateway.limits import LimitError, Reservation
from llmgw.server.gateway.memory import Memory
from llmgw.server.gateway.principal import Principal
from llmgw.server.gateway.request import CHAT, MESSAGES, RESPONSES, Route, prompt_estimate

if TYPE_CHECKING:
    from llmgw.server.gateway.proxy import Gateway

log = logging.getLogger("llmgw.gateway.agents")

_perf = time.perf_counter

OnTurn = Callable[[list[dict]], None]

# Said in a reply whose token count is the gateway's estimate because no engine could count it.
TOKENS_ESTIMATED_HEADER = "X-Llmgw-Tokens-Estimated"


class _Reply:
    """How a translated route writes the engine's answer; see proxy.Gateway.serve_body."""

    content_type = "application/json"

    def __init__(self, on_turn: OnTurn | None) -> None:
        self.headers: dict[str, str] = {}
        self._on_turn = on_turn

    def _turn(self, messages: list[dict]) -> None:
        if self._on_turn is not None:
            self._on_turn(messages)
            self._on_turn = None  # one turn per reply, whichever way it ended


class _TranslatedReply(_Reply):
    """A reply in another API: the engine's stream rewritten event by event by that API's
    translation (a ResponseStream or a MessageStream: start, feed, finish, fail)."""

    def __init__(self, on_turn: OnTurn | None, new_stream: Callable[[], Any]) -> None:
        super().__init__(on_turn)
        self._new_stream = new_stream  # the translation's stream for this request, made at start
        self._stream: Any = None

    def _kept(self) -> bool:
        """Whether the stream that ended holds a turn to keep."""
        return True

    def start(self) -> bytes:
        self._stream = self._new_stream()
        return self._stream.start()

    def event(self, chunk: dict) -> bytes:
        return self._stream.feed(chunk)

    def end(self, usage: dict | None) -> bytes:
        out = self._stream.finish(usage)
        if self._kept():
            self._turn(self._stream.reply_messages())
        return out

    def fail(self, message: str) -> bytes | None:
        return self._stream.fail(message)


class ResponsesReply(_TranslatedReply):
    def __init__(self, req: responses_api.ResponsesRequest, on_turn: OnTurn | None) -> None:
        super().__init__(on_turn, lambda: responses_api.ResponseStream(req))
        self.req = req

    def whole(self, completion: dict) -> bytes:
        obj, messages = responses_api.render_response(self.req, completion)
        self._turn(messages)
        return orjson.dumps(obj)

    def error(self, status: int, message: str) -> bytes:
        return error_body(status, message, "upstream_error" if status >= 500 else "invalid_request")

    def _kept(self) -> bool:
        return self._stream.response().get("status") != "failed"  # an engine's error event: no turn


class MessagesReply(_TranslatedReply):
    def __init__(self, req: messages_api.MessagesRequest, on_turn: OnTurn | None) -> None:
        super().__init__(on_turn, lambda: messages_api.MessageStream(req))
        self.req = req

    def whole(self, completion: dict) -> bytes:
        try:
            obj, messages = messages_api.render_message(self.req, completion)
        except messages_api.EngineReplyError as exc:
            log.warning("an engine's chat completion could not be read as a message: %s", exc)
            return messages_api.error_body(502, "the model's engine answered without a message; try again")
        self._turn(messages)
        return orjson.dumps(obj)

    def error(self, status: int, message: str) -> bytes:
        return messages_api.error_body(status, message)


class ChatThreadReply(_Reply):
    """Chat completions in a kept conversation: the answer passes as the engine wrote it (its
    model name made the one asked), read on the way to keep the assistant's turn."""

    def __init__(self, asked: str, wants_usage: bool, on_turn: OnTurn) -> None:
        super().__init__(on_turn)
        self.asked = asked
        self.wants_usage = wants_usage
        self._content: list[str] = []
        self._calls: dict[int, dict] = {}

    def whole(self, completion: dict) -> bytes:
        completion["model"] = self.asked
        choices = completion.get("choices")
        message = choices[0].get("message") if isinstance(choices, list) and choices else None
        if isinstance(message, dict):
            kept: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
            if message.get("tool_calls"):
                kept["tool_calls"] = message["tool_calls"]
            self._turn([kept])
        return orjson.dumps(completion)

    def error(self, status: int, message: str) -> bytes:
        return error_body(status, message, "upstream_error" if status >= 500 else "invalid_request")

    def start(self) -> bytes:
        return b""

    def event(self, chunk: dict) -> bytes:
        choices = chunk.get("choices")
        if not choices and isinstance(chunk.get("usage"), dict) and not self.wants_usage:
            return b""  # asked of the engine for the count, not by the client
        if "model" in chunk:
            chunk["model"] = self.asked
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            delta = choices[0].get("delta") or {}
            if isinstance(delta.get("content"), str):
                self._content.append(delta["content"])
            for tc in delta.get("tool_calls") or ():
                if not isinstance(tc, dict):
                    continue
                call = self._calls.setdefault(
                    tc.get("index", 0), {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
                )
                if tc.get("id"):
                    call["id"] = tc["id"]
                fn = tc.get("function") or {}
                if fn.get("name"):
                    call["function"]["name"] = fn["name"]
                if isinstance(fn.get("arguments"), str):
                    call["function"]["arguments"] += fn["arguments"]
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    def end(self, usage: dict | None) -> bytes:
        kept: dict[str, Any] = {"role": "assistant", "content": "".join(self._content) or None}
        if self._calls:
            kept["tool_calls"] = [self._calls[i] for i in sorted(self._calls)]
        self._turn([kept])
        return b"data: [DONE]\n\n"

    def fail(self, message: str) -> bytes | None:
        return None  # chat streams have no failure event: the connection is cut, as without a thread


class AgentApis:
    def __init__(self, gateway: Gateway, conversations: Conversations | None) -> None:
        self.gateway = gateway
        self.conversations = conversations
        self.memory = Memory(gateway, conversations)

    def keep(self, conversations: Conversations) -> None:
        """Where conversations and notes are kept (the server's store)."""
        self.conversations = self.memory.conversations = conversations

    def add_routes(self, app: web.Application) -> None:
        self.memory.add_routes(app)
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_post("/v1/messages", self.messages)
        app.router.add_post("/v1/messages/count_tokens", self.count_tokens)
        app.router.add_get("/v1/threads/{thread}", self.get_thread)
        app.router.add_delete("/v1/threads/{thread}", self.delete_thread)

    # -- shared steps -----------------------------------------------------------------

    async def _read(self, request: web.Request, route: Route) -> tuple[Principal, bytes, object] | web.Response:
        got = await self.gateway.read_body(request, route)
        if isinstance(got, web.Response):
            return got
        principal, raw = got
        try:
            body = load_json(raw)
        except BadInput as exc:
            return self.gateway.refuse_bad_input(request, route, exc)
        return principal, raw, body

    def _refuse(self, route: Route, status: int, message: str, code: str, param: str | None = None) -> web.Response:
        return self.gateway._refuse(route, "", status, message, code, param)

    def _scope(self, route: Route, principal: Principal, kind: str = "threads") -> Scope | web.Response:
        if self.conversations is None:
            return self._refuse(route, 400, "this gateway keeps no conversations", "conversations_off")
        scope = self.conversations.scope(principal, kind)  # type: ignore[arg-type]
        if isinstance(scope, NotKept):
            return self._refuse(route, 400, scope.message, scope.code)
        return scope

    async def _thread(
        self, request: web.Request, route: Route, principal: Principal
    ) -> tuple[Scope, str, list[dict]] | web.Response | None:
        """The conversation a request continues (x-llmgw-thread): its scope, id and history; None
        when the request names none."""
        asked = request.headers.get(THREAD_HEADER)
        if asked is None:
            return None
        asked = asked.strip()
        scope = self._scope(route, principal)
        if isinstance(scope, web.Response):
            return scope
        assert self.conversations is not None
        if asked.lower() == NEW_THREAD:
            return scope, new_thread_id(), []
        history = await self.conversations.history(scope, asked)
        if history is None:
            return self._refuse(
                route,
                404,
                f"there is no conversation {asked[:64]!r} here (it may have expired {scope.hours} hours after its "
                f"last turn); start one with '{THREAD_HEADER}: {NEW_THREAD}'",
                "thread_not_found",
            )
        return scope, asked, history

    async def _before_reads(
        self, route: Route, principal: Principal, model: object
    ) -> Reservation | web.Response | None:
        """A request that reads the store (its conversation's history) before its model call is
        admitted before that read, so a key at its limits reads nothing. The admission is given
        back (_after_reads) before serve_body admits the request for its model: it counts once."""
        acc = self.gateway.accountant
        if acc is None or not (principal.pools or principal.models is not None):
            return None
        served = self.gateway.models.get(model) if isinstance(model, str) else None
        try:
            # No tokens: the model's admission weighs the prompt once its history is in it.
            return await acc.admit(principal, served.name if served is not None else None, 0)
        except LimitError as exc:
            return limit_response(exc, anthropic=route.anthropic)

    async def _admitted_thread(
        self, request: web.Request, route: Route, principal: Principal, model: object
    ) -> tuple[Scope, str, list[dict]] | web.Response | None:
        """The thread a request continues (its header), read only once the key's limits admit it."""
        pre = await self._before_reads(route, principal, model) if THREAD_HEADER in request.headers else None
        if isinstance(pre, web.Response):
            return pre
        try:
            return await self._thread(request, route, principal)
        finally:
            self._after_reads(pre)

    async def _full(self, route: Route, scope: Scope, new_item: bool) -> web.Response | None:
        """A refusal when the turn this request would keep has no room in its project's quota."""
        assert self.conversations is not None
        full = await self.conversations.full(scope, new_item)
        if full is None:
            return None
        return self._refuse(route, full.status, str(full), full.code)

    def _after_reads(self, pre: Reservation | None) -> None:
        if pre is not None and self.gateway.accountant is not None:
            self.gateway.accountant.cancel(pre)

    def _thread_turn(self, scope: Scope, thread_id: str, turn: list[dict], model: str) -> OnTurn:
        conversations = self.conversations
        assert conversations is not None

        def on_turn(reply: list[dict]) -> None:
            conversations.remember(scope, thread_id, turn + reply, model)

        return on_turn

    # -- the Responses API -------------------------------------------------------------

    async def responses(self, request: web.Request) -> web.StreamResponse:
        t0 = _perf()
        route = RESPONSES
        got = await self._read(request, route)
        if isinstance(got, web.Response):
            return got
        principal, _, body = got
        req = responses_api.translate_request(body)
        if isinstance(req, responses_api.ResponsesRefusal):
            return self._refuse(route, req.status, req.message, req.code, req.param)
        reads = THREAD_HEADER in request.headers or req.previous_response_id is not None
        pre = await self._before_reads(route, principal, req.model) if reads else None
        if isinstance(pre, web.Response):
            return pre
        try:
            context = await self._response_context(request, route, principal, req)
        finally:
            self._after_reads(pre)
        if isinstance(context, web.Response):
            return context
        thread, scope = context
        # Asked to keep it (store true, or a thread): refused up front when there is no room. A
        # response kept by default (store left out) is answered anyway, and not kept.
        kept_in = thread[0] if thread is not None else scope if req.store is True else None
        if kept_in is not None:
            refused = await self._full(route, kept_in, True)
            if refused is not None:
                return refused
        turn = req.turn
        conversations = self.conversations

        def on_turn(reply: list[dict]) -> None:
            assert conversations is not None
            if scope is not None:
                conversations.remember_response(scope, req.response_id, req.previous_response_id, turn + reply)
            if thread is not None:
                conversations.remember(thread[0], thread[1], turn + reply, req.model)

        out = ResponsesReply(req, on_turn if (scope is not None or thread is not None) else None)
        if thread is not None:
            out.headers[THREAD_HEADER] = thread[1]
        raw = orjson.dumps(req.chat)
        return await self.gateway.serve_body(request, route, principal, req.chat, raw, t0, out, prompt_estimate(raw))

    async def _response_context(
        self, request: web.Request, route: Route, principal: Principal, req: responses_api.ResponsesRequest
    ) -> tuple[tuple[Scope, str, list[dict]] | None, Scope | None] | web.Response:
        """The conversation a Responses request continues and where its response is stored, its
        history (the thread's, then the previous responses') put into the request."""
        thread = await self._thread(request, route, principal)
        if isinstance(thread, web.Response):
            return thread
        # Stored responses: kept when the client asks (store true, the API's default when left
        # out) and the project keeps conversations; asked explicitly where it does not, refused.
        scope: Scope | None = None
        if req.previous_response_id is not None or req.store is True:
            got_scope = self._scope(route, principal)
            if isinstance(got_scope, web.Response):
                return got_scope
            scope = got_scope
        elif req.store is None and self.conversations is not None:
            quiet = self.conversations.scope(principal, "threads")
            scope = quiet if isinstance(quiet, Scope) else None
        history: list[dict] = []
        if req.previous_response_id is not None:
            assert scope is not None and self.conversations is not None
            found = await self.conversations.response_history(scope, req.previous_response_id)
            if found is None:
                return self._refuse(
                    route,
                    404,
                    f"there is no stored response {req.previous_response_id[:64]!r} here (stored responses are "
                    f"kept {scope.hours} hours); send the whole conversation as input instead",
                    "previous_response_not_found",
                    "previous_response_id",
                )
            history = found
        if thread is not None:
            history = thread[2] + history
        if history:
            responses_api.with_history(req, history)
        return thread, scope

    # -- Anthropic's Messages API -----------------------------------------------------

    async def messages(self, request: web.Request) -> web.StreamResponse:
        t0 = _perf()
        route = MESSAGES
        got = await self._read(request, route)
        if isinstance(got, web.Response):
            return got
        principal, _, body = got
        req = messages_api.translate_request(body)
        if isinstance(req, messages_api.MessagesRefusal):
            return self._refuse(route, req.status, req.message, "invalid_request")
        thread = await self._admitted_thread(request, route, principal, req.model)
        if isinstance(thread, web.Response):
            return thread
        out = MessagesReply(req, None)
        if thread is not None:
            refused = await self._full(route, thread[0], not thread[2])
            if refused is not None:
                return refused
            messages_api.with_history(req, thread[2])
            out = MessagesReply(req, self._thread_turn(thread[0], thread[1], req.turn, req.model))
            out.headers[THREAD_HEADER] = thread[1]
        raw = orjson.dumps(req.chat)
        return await self.gateway.serve_body(request, route, principal, req.chat, raw, t0, out, prompt_estimate(raw))

    async def count_tokens(self, request: web.Request) -> web.StreamResponse:
        """The prompt's tokens as the model's own engine counts them (its chat template and
        tokenizer), else the gateway's estimate, said in TOKENS_ESTIMATED_HEADER."""
        route = MESSAGES
        got = await self._read(request, route)
        if isinstance(got, web.Response):
            return got
        principal, _, body = got
        chat = messages_api.translate_count_tokens(body)
        if isinstance(chat, messages_api.MessagesRefusal):
            return self._refuse(route, chat.status, chat.message, "invalid_request")
        gw = self.gateway
        name = chat.get("model")
        served = gw.models.get(name) if isinstance(name, str) else None
        if served is None:
            return self._refuse(
                route,
                404,
                f"The model '{name}' does not exist; GET /v1/models lists the models you can use",
                "model_not_found",
            )
        if principal.models is not None and served.name not in principal.models:
            return self._refuse(route, 403, f"this key may not use the model '{name}'", "model_not_allowed")
        # One request to the key's limits, no tokens: counting generates nothing.
        try:
            headers = await gw.count_call(principal)
        except LimitError as exc:
            return limit_response(exc, anthropic=True)
        counted = await self._engine_count(served.name, chat)
        if counted is not None:
            return web.Response(
                body=messages_api.count_response(counted), content_type="application/json", headers=headers or None
            )
        return web.Response(
            body=messages_api.count_response(prompt_estimate(orjson.dumps(chat["messages"]))),
            content_type="application/json",
            headers={**headers, TOKENS_ESTIMATED_HEADER: "true"},
        )

    async def _engine_count(self, model: str, chat: dict) -> int | None:
        gw = self.gateway
        ep = gw.endpoints.choose(model, (), ())
        session = gw._session
        if ep is None or session is None:
            return None
        body = {**chat, "model": ep.upstream_model or model}
        timeout = aiohttp.ClientTimeout(total=10)
        try:
            if ep.engine == "llamacpp":
                # llama-server: the chat template applied, then its tokenizer.
                async with session.post(
                    ep.url + "/apply-template", json=body, headers=ep.post_headers, timeout=timeout
                ) as r:
                    if r.status != 200:
                        return None
                    prompt = (await r.json()).get("prompt")
                async with session.post(
                    ep.url + "/tokenize",
                    json={"content": prompt, "add_special": True},
                    headers=ep.post_headers,
                    timeout=timeout,
                ) as r:
                    if r.status != 200:
                        return None
                    tokens = (await r.json()).get("tokens")
                    return len(tokens) if isinstance(tokens, list) else None
            # vLLM and SGLang: /tokenize takes chat messages and answers their count.
            async with session.post(ep.url + "/tokenize", json=body, headers=ep.post_headers, timeout=timeout) as r:
                if r.status != 200:
                    return None
                count = (await r.json()).get("count")
                return count if isinstance(count, int) else None
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            log.info("engine %s could not count tokens (%s); answering an estimate", ep.url, exc)
            return None

    # -- chat completions in a kept conversation ----------------------------------------

    async def chat_thread(self, request: web.Request) -> web.StreamResponse:
        t0 = _perf()
        route = CHAT
        got = await self._read(request, route)
        if isinstance(got, web.Response):
            return got
        principal, _, body = got
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return self._refuse(route, 400, "'messages' should be a non-empty list of messages", "invalid_request")
        thread = await self._admitted_thread(request, route, principal, body.get("model"))
        if isinstance(thread, web.Response):
            return thread
        assert thread is not None  # this route is taken only with the header
        scope, thread_id, history = thread
        refused = await self._full(route, scope, not history)
        if refused is not None:
            return refused
        turn = list(body["messages"])
        body["messages"] = history + turn
        opts = body.get("stream_options")
        wants_usage = isinstance(opts, dict) and opts.get("include_usage") is True
        model = body.get("model")
        asked = model if isinstance(model, str) else ""
        out = ChatThreadReply(asked, wants_usage, self._thread_turn(scope, thread_id, turn, asked))
        out.headers[THREAD_HEADER] = thread_id
        raw = orjson.dumps(body)
        return await self.gateway.serve_body(request, route, principal, body, raw, t0, out)

    # -- /v1/threads/{id} -------------------------------------------------------------

    async def _thread_scope(self, request: web.Request) -> tuple[Scope, str, dict[str, str]] | web.Response:
        try:
            principal = await self.gateway._authenticate(request)
        except AuthError as exc:
            return error_response(401, exc.message, exc.code)
        scope = self._scope(CHAT, principal)
        if isinstance(scope, web.Response):
            return scope
        try:
            headers = await self.gateway.count_call(principal)
        except LimitError as exc:
            return limit_response(exc)
        return scope, request.match_info["thread"], headers

    def _no_thread(self, thread_id: str, headers: dict[str, str]) -> web.Response:
        return error_response(
            404, f"there is no conversation {thread_id[:64]!r} here", "thread_not_found", headers=headers or None
        )

    async def get_thread(self, request: web.Request) -> web.StreamResponse:
        got = await self._thread_scope(request)
        if isinstance(got, web.Response):
            return got
        scope, thread_id, headers = got
        assert self.conversations is not None
        messages = await self.conversations.history(scope, thread_id)
        if messages is None:
            return self._no_thread(thread_id, headers)
        return web.Response(
            body=orjson.dumps({"id": thread_id, "object": "thread", "messages": messages}),
            content_type="application/json",
            headers=headers or None,
        )

    async def delete_thread(self, request: web.Request) -> web.StreamResponse:
        got = await self._thread_scope(request)
        if isinstance(got, web.Response):
            return got
        scope, thread_id, headers = got
        assert self.conversations is not None
        if not await self.conversations.forget(scope, thread_id):
            return self._no_thread(thread_id, headers)
        return web.Response(
            body=orjson.dumps({"id": thread_id, "object": "thread.deleted", "deleted": True}),
            content_type="application/json",
            headers=headers or None,
        )
