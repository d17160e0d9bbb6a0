"""The request path: read, authenticate, resolve the model, choose an endpoint, proxy, record.

Nothing here waits on the database. The body is parsed once; it is re-encoded
only when something in it has to change (the upstream model name, an output
limit, or asking the engine for usage on a stream). Streams are passed through
as the engine wrote them, event by event; only the usage event is decoded, and
the rest are touched only as bytes (the model name the client asked for put in,
output tokens counted for a stream that ends before its usage event).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any, Protocol

import aiohttp
import orjson
from aiohttp import web

from llmgw.config.server import ModelConfig, ServerConfig
from llmgw.errors import LlmgwError
from llmgw.server.gateway import messages_api
from llmgw.server.gateway.admission import (
    Admission,
    AdmissionRejected,
    Ticket,
    effective_band,
    pool_capacity,
    pool_saturation,
)
from llmgw.server.gateway.agent_apis import AgentApis
from llmgw.server.gateway.auth import ANONYMOUS, AuthError, KeyCache, Principal
from llmgw.server.gateway.checks import BadInput, load_json
from llmgw.server.gateway.choices import USAGE_PER_SEQUENCE, choices_output, recounts
from llmgw.server.gateway.conversations import THREAD_HEADER
from llmgw.server.gateway.endpoints import Endpoint, EndpointSet
from llmgw.server.gateway.errors import error_body, error_response, limit_response, refuse_input, speaks_anthropic
from llmgw.server.gateway.limits import Accountant, Accounting, LimitError, Pricing, Reservation
from llmgw.server.gateway.request import (
    CHAT,
    COMPLETIONS,
    EMBEDDINGS,
    OUTPUT_CLAMPED_HEADER,
    Call,
    Refusal,
    Route,
    ServedModel,
    prompt_estimate,
    read_request,
)
from llmgw.server.gateway.routing import RouterCollector
from llmgw.server.gateway.usage import UsageRecorder
from llmgw.server.metrics import GatewayMetrics
from llmgw.store import UsageRow

log = logging.getLogger("llmgw.gateway")

_perf = time.perf_counter

# A request may ask for a lower admission band than its key's, never a higher one.
BAND_HEADER = "X-Llmgw-Band"

# Upstream answers that say "this endpoint cannot take it now" rather than
# "this request is wrong": worth another endpoint, and counted by the breaker.
_RETRYABLE_STATUS = frozenset({502, 503, 504})

# Headers of an engine's reply that describe the connection, not the content.
_HOP_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "transfer-encoding",
        "content-length",
        "content-encoding",
        "server",
        "date",
        "proxy-authenticate",
        "upgrade",
        "trailer",
        "te",
    }
)


class Demand(Protocol):
    """The control plane's side of a request for a model it runs."""

    def touch(self, model: str) -> None: ...

    async def wait_ready(self, model: str) -> str | None: ...


class _EventStream(web.StreamResponse):
    """A stream whose headers leave with its first event, as web.Response's do.

    One write instead of two for every short stream (a measured 0.1 ms per request).
    The attribute is aiohttp's own (3.11+); were it ever dropped, headers would simply
    go out separately again.
    """

    _send_headers_immediately = False


# What a client reads about an engine that failed: its request, never the engine's address
# (operators find that in the log and in `llmgw ctl`).
_UNREACHABLE = "the model's engine could not be reached"


def _log_engine_error(ep: Endpoint, served: ServedModel, what: str) -> None:
    log.warning("engine %s (%s): %s", ep.url, served.name, what)


class _FirstByteWatch:
    """Cuts a request whose engine sends nothing (not even headers) for timeouts.first_byte
    while answering no health check either: a frozen engine (SIGSTOP, a hung driver) holds
    requests until timeouts.generation otherwise.

    An engine that answers its probes is alive and only slow (a long prompt, a long reply
    that is not streamed, whose headers come at the end): it is never cut by this. The
    check runs on a timer, not a task, so the request path pays one timer handle.
    """

    __slots__ = ("deadline", "ep", "fired", "handle", "limit")

    def __init__(self, ep: Endpoint, limit: float) -> None:
        self.ep = ep
        self.limit = limit
        self.deadline: asyncio.Timeout | None = None
        self.handle: asyncio.TimerHandle | None = None
        self.fired = False

    def arm(self, deadline: asyncio.Timeout) -> None:
        self.deadline = deadline
        self.handle = asyncio.get_running_loop().call_later(self.limit, self._check)

    def _check(self) -> None:
        loop = asyncio.get_running_loop()
        # alive_at is on the monotonic clock, like the loop's.
        if self.ep.alive_at >= time.monotonic() - self.limit:
            # It answered a probe sent within the last `limit` seconds: look again later.
            self.handle = loop.call_later(min(self.limit, 1.0), self._check)
            return
        self.fired = True
        self.handle = None
        assert self.deadline is not None
        self.deadline.reschedule(loop.time())

    def disarm(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None


class _StreamCut(LlmgwError):
    """The engine's stream broke after the client had already received bytes."""


class _Translated(LlmgwError):
    """A translated stream ended normally (it leaves the pass-through loop by this)."""


# Set on a request whose usage is recorded, so a cancellation after it records nothing more.
_RECORDED = web.RequestKey("llmgw.recorded", bool)

# Output tokens in stream events the engine has not counted for us (a stream cut before its usage
# event): one per event carrying generated text, as (field with a string, the same empty) pairs.
# llama.cpp, vLLM and SGLang send one event per token by default, in compact JSON; the spaced
# form ("key": "value") is for other OpenAI-compatible servers, chosen by a stream's first event.
# A quote followed by ":" (or ": ") and a quote never occurs inside a JSON string (quotes there
# are escaped), so only real fields match; "content" also matches "reasoning_content". An empty
# string is no token (the role-only first event); null is not matched.
_OUTPUT_FIELDS_SEEN = {
    ("chat", False): ((b'content":"', b'content":""'), (b'arguments":"', b'arguments":""')),
    ("chat", True): ((b'content": "', b'content": ""'), (b'arguments": "', b'arguments": ""')),
    ("completions", False): ((b'text":"', b'text":""'),),
    ("completions", True): ((b'text": "', b'text": ""'),),
}


class Gateway:
    def __init__(
        self,
        config: ServerConfig,
        keys: KeyCache | None,
        endpoints: EndpointSet,
        usage: UsageRecorder | None,
        metrics: GatewayMetrics,
    ) -> None:
        self.config = config
        self.keys = keys if config.auth.enabled else None
        self.endpoints = endpoints
        self.usage = usage
        self.metrics = metrics
        self.max_body = config.router.max_body_bytes
        self.retries = config.router.retries
        self.models: dict[str, ServedModel] = {}
        self.demand: Demand | None = None
        r = config.router
        self.router = endpoints.router
        self.router.configure(r.routing, r.session_load_factor, r.prefix_block_chars, r.prefix_cache_blocks)
        try:
            metrics.registry.register(RouterCollector(self.router))
        except ValueError:
            pass  # already registered (a second Gateway on the same metrics)
        self.set_models(config.models)
        # Limits apply to keys; without auth there is nobody to hold to them.
        self.accountant: Accounting | None = (
            Accountant(Pricing.from_config(config.auth)) if config.auth.enabled else None
        )
        a = config.admission
        self.admission: Admission | None = None
        if a.enabled:
            self.admission = Admission(
                a,
                lambda m: pool_saturation(endpoints, m, a.healthy_waiting, a.kv_ceiling),
                capacity=lambda m: pool_capacity(endpoints, m, a.healthy_waiting),
            )
            metrics.watch_admission(self.admission, lambda: list(endpoints.by_model))
        self._admission_task: asyncio.Task | None = None
        t = config.timeouts
        self._timeout = aiohttp.ClientTimeout(total=t.generation, sock_connect=t.connect)
        self._first_byte = t.first_byte
        self._session: aiohttp.ClientSession | None = None
        # The agents' routes (Responses, Messages, threads); the server gives them its conversations.
        self.agents = AgentApis(self, None)

    def set_models(self, models: Sequence[ModelConfig]) -> None:
        """The models served: server.yaml's, or the control plane's catalog after each change."""
        table: dict[str, ServedModel] = {}
        for m in models:
            served = ServedModel(m.name, tuple(m.aliases), m.description, m.max_output, m.managed, m.served_context)
            for name in (m.name, *m.aliases):
                table[name] = served
        self._model_configs = list(models)
        self.models = table
        self.router.set_model_strategies({m.name: m.routing for m in models})
        self._models_body, self._model_bodies = self._render_models()
        entries = [orjson.loads(b) for b in self._model_bodies.values()]
        self._anthropic_models = messages_api.models_page(entries)
        self._anthropic_model_bodies = {
            e["id"]: orjson.dumps(orjson.loads(messages_api.models_page([e]))["data"][0]) for e in entries
        }

    @property
    def model_configs(self) -> list[ModelConfig]:
        """The models served, as configured (the pages list them)."""
        return list(getattr(self, "_model_configs", ()))

    def _render_models(self) -> tuple[bytes, dict[str, bytes]]:
        """GET /v1/models's body, and GET /v1/models/{id}'s for each name: rendered once per change."""
        data = []
        for m in self._model_configs:
            for name in (m.name, *m.aliases):
                entry: dict[str, Any] = {"id": name, "object": "model", "created": 0, "owned_by": "llmgw"}
                if name != m.name:
                    entry["alias_of"] = m.name
                if m.description is not None:
                    entry["description"] = m.description
                if m.max_output is not None:
                    entry["max_output"] = m.max_output
                if (context := m.served_context) is not None:
                    # What a client should size its prompt and max_tokens to (agents read it).
                    entry["context_length"] = context
                data.append(entry)
        return orjson.dumps({"object": "list", "data": data}), {e["id"]: orjson.dumps(e) for e in data}

    async def start(self) -> None:
        # No per-host limit: the engines queue for themselves and report it.
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, enable_cleanup_closed=True)
        self._session = aiohttp.ClientSession(
            connector=connector, timeout=self._timeout, auto_decompress=False, skip_auto_headers=("User-Agent",)
        )
        if self.admission is not None:
            # Waiters move when fresh engine numbers arrive, not only when a request ends.
            self._admission_task = asyncio.create_task(
                self.admission.run(self.config.router.scrape_interval), name="admission"
            )

    async def stop(self) -> None:
        if self._admission_task is not None:
            self._admission_task.cancel()
            await asyncio.gather(self._admission_task, return_exceptions=True)
            self._admission_task = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    def add_routes(self, app: web.Application) -> None:
        chat = self._handler(CHAT)
        agents = self.agents

        async def chat_or_thread(request: web.Request) -> web.StreamResponse:
            # A conversation the gateway keeps goes by way of its store; any other, straight on.
            if THREAD_HEADER in request.headers:
                return await agents.chat_thread(request)
            return await chat(request)

        app.router.add_post("/v1/chat/completions", chat_or_thread)
        agents.add_routes(app)
        app.router.add_post("/v1/completions", self._handler(COMPLETIONS))
        app.router.add_post("/v1/embeddings", self._handler(EMBEDDINGS))
        app.router.add_get("/v1/models", self.list_models)
        # A name may hold slashes (Qwen/Qwen2.5-7B-Instruct), as the SDKs send it unescaped.
        app.router.add_get("/v1/models/{model:.+}", self.get_model)

    # -- small handlers ---------------------------------------------------

    async def _authenticate(self, request: web.Request) -> Principal:
        if self.keys is None:
            return ANONYMOUS
        header = request.headers.get("Authorization")
        if header is None and (key := request.headers.get("x-api-key")) is not None:
            # Anthropic's SDKs (and Claude Code with ANTHROPIC_API_KEY) send the key this way.
            header = f"Bearer {key}"
        return await self.keys.authenticate_current(header)

    async def list_models(self, request: web.Request) -> web.StreamResponse:
        anthropic = speaks_anthropic(request)
        try:
            await self._authenticate(request)
        except AuthError as exc:
            return error_response(401, exc.message, exc.code, anthropic=anthropic)
        if anthropic:
            # Anthropic's SDKs list models at the same path, in their own shape.
            return web.Response(body=self._anthropic_models, content_type="application/json")
        return web.Response(body=self._models_body, content_type="application/json")

    async def get_model(self, request: web.Request) -> web.StreamResponse:
        """One model by name or alias (the SDKs' models.retrieve), in the listing's form."""
        anthropic = speaks_anthropic(request)
        try:
            await self._authenticate(request)
        except AuthError as exc:
            return error_response(401, exc.message, exc.code, anthropic=anthropic)
        name = request.match_info["model"]
        body = (self._anthropic_model_bodies if anthropic else self._model_bodies).get(name)
        if body is None:
            return error_response(
                404,
                f"The model '{name}' does not exist; GET /v1/models lists the models you can use",
                "model_not_found",
                "model",
                anthropic=anthropic,
            )
        return web.Response(body=body, content_type="application/json")

    # -- the proxy ----------------------------------------------------------

    def _handler(self, route: Route):
        async def handle(request: web.Request) -> web.StreamResponse:
            return await self._proxy(request, route)

        return handle

    def _refuse(
        self, route: Route, model: str, status: int, message: str, code: str | None, param: str | None = None
    ) -> web.Response:
        self.metrics.count_request(model, route.name, status)
        return error_response(status, message, code, param, anthropic=route.anthropic)

    def refuse_bad_input(self, request: web.Request, route: Route, exc: BadInput) -> web.Response:
        """Input no route can take (checks.py): counted as the route's other refusals are, and
        answered and logged as everywhere else (errors.refuse_input)."""
        self.metrics.count_request("", route.name, exc.status)
        return refuse_input(request, exc, anthropic=route.anthropic)

    async def _proxy(self, request: web.Request, route: Route) -> web.StreamResponse:
        t0 = _perf()
        got = await self.read_body(request, route)
        if isinstance(got, web.Response):
            return got
        return await self._serve(request, route, got[0], got[1], t0)

    async def serve_as(
        self, request: web.Request, route: Route, principal: Principal, raw: bytes
    ) -> web.StreamResponse:
        """A request the pages make on a signed-in person's behalf (the chat page): the same path as a
        key's from here on (limits, admission, routing, usage), with the principal the page built."""
        return await self._serve(request, route, principal, raw, _perf())

    async def read_body(self, request: web.Request, route: Route) -> tuple[Principal, bytes] | web.Response:
        """Who sent a request and its bytes, or the refusal (no key, too large) in the route's shape."""
        try:
            principal = await self._authenticate(request)
        except AuthError as exc:
            return self._refuse(route, "", 401, exc.message, exc.code)
        if request.content_length is not None and request.content_length > self.max_body:
            return self._too_large(route)
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return self._too_large(route)
        return principal, raw

    async def _serve(
        self, request: web.Request, route: Route, principal: Principal, raw: bytes, t0: float
    ) -> web.StreamResponse:
        try:
            body = load_json(raw)
        except BadInput as exc:
            return self.refuse_bad_input(request, route, exc)
        return await self.serve_body(request, route, principal, body, raw, t0)

    async def serve_body(
        self,
        request: web.Request,
        route: Route,
        principal: Principal,
        body: object,
        raw: bytes,
        t0: float,
        reply: Any = None,
        prompt_estimate: int | None = None,
    ) -> web.StreamResponse:
        """A parsed request down the whole path. ``reply`` (agent_apis.py) writes a translated
        route's answer and hears the reply's messages; ``raw`` is what the limits estimate from."""
        call = read_request(route, body, self.models, prompt_estimate)
        if isinstance(call, Refusal):
            return self._refuse(route, call.model, call.status, call.message, call.code, call.param)
        call.principal = principal
        call.raw = raw
        call.t0 = t0
        if reply is not None:
            call.reply = reply
            call.changed = True
        served = call.served
        # Read once. A reservation implies the accountant and a ticket the admission; the
        # `is not None` tests on them below only tell the type checker so (an identity compare each).
        accountant, admission = self.accountant, self.admission
        res: Reservation | None = None
        if accountant is not None and (principal.pools or principal.models is not None):
            estimate = _estimate(raw, call.out_limit, served, call.outputs, call.prompt_ids, call.min_out)
            try:
                res = call.res = await accountant.admit(principal, served.name, *estimate)
            except LimitError as exc:
                self.metrics.count_request(served.name, route.name, exc.status)
                return limit_response(exc, anthropic=route.anthropic)
        ticket: Ticket | None = None
        try:
            if admission is not None:
                # A client may yield (a batch job asking for low); the key's band is the ceiling.
                band = effective_band(principal.band, request.headers.get(BAND_HEADER))
                ticket = admission.try_admit(served.name, band, principal.tenant)
                if ticket is None:
                    try:
                        ticket = await admission.wait(served.name, band, principal.tenant)
                    except AdmissionRejected as exc:
                        self.metrics.count_request(served.name, route.name, exc.status)
                        return error_response(
                            exc.status, exc.message, exc.code, headers=exc.headers(), anthropic=route.anthropic
                        )
            resp = await self._forward(request, call)
            if not resp.prepared:
                if res is not None and accountant is not None:
                    resp.headers.update(accountant.headers(principal))
                _reply_headers(call, resp)
            return resp
        finally:
            if ticket is not None and admission is not None:
                admission.release(ticket)
            if res is not None and accountant is not None and not res.done:
                # It never reached an engine: the request and its tokens are given back.
                accountant.cancel(res)

    async def count_call(self, principal: Principal) -> dict[str, str]:
        """Count one request that calls no model (a note, an MCP call, a kept conversation read or
        deleted) against the key's limits: one request on every rate pool, no tokens, refused while a
        budget is spent (Accountant.check with model None). Raises LimitError; returns the
        x-ratelimit-* headers to answer with."""
        accountant = self.accountant
        if accountant is None or not principal.pools:
            return {}
        res = await accountant.admit(principal, None, 0)
        accountant.settle(res, 0, 0)  # counted: nothing was held, nothing to give back
        return accountant.headers(principal)

    def _too_large(self, route: Route) -> web.Response:
        return self._refuse(
            route,
            "",
            413,
            f"the request body is larger than the {self.max_body} bytes this gateway accepts (router.max_body_bytes)",
            "request_too_large",
        )

    async def _forward(self, request: web.Request, call: Call) -> web.StreamResponse:
        assert self._session is not None
        route, served, body = call.route, call.served, call.body
        tried: tuple[Endpoint, ...] = ()
        upstream_time = 0.0
        last_error = "no endpoint of this model is ready"
        last_status = 503
        attempts = 1 + self.retries
        demand = self.demand if served.managed else None
        if demand is not None:
            demand.touch(served.name)
        blocks = self.router.blocks_for(served.name, route.kind, body)
        for attempt in range(attempts):
            ep = self.endpoints.choose(served.name, tried, blocks)
            if ep is None and not tried and demand is not None:
                # An on-demand model loads now: the client waits for it rather than
                # getting an error it would have to retry.
                problem = await demand.wait_ready(served.name)
                if problem is not None:
                    return self._finish_error(call, None, upstream_time, 503, problem, "model_not_ready")
                ep = self.endpoints.choose(served.name, tried, blocks)
            if ep is None and tried:
                # Every endpoint has been tried once; one that is still in (its breaker
                # closed) may have failed only on a stale pooled connection.
                ep = self.endpoints.choose(served.name, (), blocks)
            if ep is None:
                break
            if attempt:
                self.metrics.retries.labels(served.name).inc()
            tried += (ep,)
            upstream_model = ep.upstream_model or served.name
            if body.get("model") != upstream_model:
                body["model"] = upstream_model
                call.changed = True
            payload = orjson.dumps(body) if call.changed else call.raw
            ep.inflight += 1
            t_up = _perf()
            try:
                watch = _FirstByteWatch(ep, self._first_byte)
                try:
                    async with asyncio.timeout(None) as deadline:
                        watch.arm(deadline)
                        upstream = await self._session.post(
                            ep.url + route.path, data=payload, headers=ep.post_headers
                        )  # with the engine's key
                except aiohttp.ConnectionTimeoutError as exc:
                    # Could not even connect: another endpoint may well answer.
                    upstream_time += _perf() - t_up
                    ep.record_failure("connect timed out")
                    _log_engine_error(ep, served, f"connect timed out: {exc}")
                    last_error, last_status = _UNREACHABLE, 502
                    continue
                except TimeoutError:
                    upstream_time += _perf() - t_up
                    if watch.fired:
                        # Frozen, not slow: it answered no health check either. Nothing has
                        # reached the client, so another replica may take the request.
                        ep.record_failure(f"sent nothing for {self._first_byte:g}s and answered no health check")
                        log.warning(
                            "%s (%s) sent nothing for %gs and answered no health check; trying another replica",
                            ep.url,
                            served.name,
                            self._first_byte,
                        )
                        last_error = f"the engine sent nothing within {self._first_byte:g}s (timeouts.first_byte)"
                        last_status = 504
                        continue
                    ep.record_failure("timed out")
                    # The engine may simply be slow; trying another one would double the wait.
                    return self._finish_error(
                        call,
                        ep,
                        upstream_time,
                        504,
                        f"the engine did not answer within {self.config.timeouts.generation:g}s (timeouts.generation)",
                        "upstream_timeout",
                    )
                except aiohttp.ClientError as exc:
                    upstream_time += _perf() - t_up
                    ep.record_failure(str(exc) or type(exc).__name__)
                    _log_engine_error(ep, served, str(exc) or type(exc).__name__)
                    last_error, last_status = _UNREACHABLE, 502
                    continue
                finally:
                    watch.disarm()
                if upstream.status in _RETRYABLE_STATUS and attempt + 1 < attempts:
                    detail = (await upstream.read())[:200]
                    upstream.release()
                    upstream_time += _perf() - t_up
                    ep.record_failure(f"answered {upstream.status}")
                    _log_engine_error(ep, served, f"answered {upstream.status}: {detail.decode(errors='replace')}")
                    last_error, last_status = f"the model's engine answered {upstream.status}", 502
                    continue
                if call.stream and upstream.status == 200 and upstream.content_type == "text/event-stream":
                    return await self._stream(request, call, ep, upstream, t_up, upstream_time)
                return await self._whole(call, ep, upstream, t_up, upstream_time)
            except asyncio.CancelledError:
                # The client went away; aiohttp cancels the handler, which drops the
                # engine request too, so the engine stops working for nobody. A stream
                # already recorded what had passed through.
                if not request.get(_RECORDED):
                    # Nothing reached the client, but the engine read the prompt: that much is
                    # charged, so leaving early is no way round a tokens-per-minute limit.
                    self.metrics.count_request(served.name, route.name, 499)
                    self._record(call, ep, _call_prompt(call), 0, _perf() - call.t0, None, 499)
                raise
            finally:
                ep.inflight -= 1
                ep.trial_inflight = False
        if not tried:
            status, message, code = (
                503,
                f"no endpoint of model '{served.name}' is ready; try again shortly",
                "no_healthy_endpoint",
            )
        else:
            status, message, code = last_status, last_error, "upstream_unavailable"
        return self._finish_error(call, tried[-1] if tried else None, upstream_time, status, message, code)

    def _finish_error(
        self, call: Call, ep: Endpoint | None, upstream_time: float, status: int, message: str, code: str
    ) -> web.Response:
        resp = error_response(status, message, code, anthropic=call.route.anthropic)
        elapsed = _perf() - call.t0
        resp.headers["Server-Timing"] = _timing(elapsed - upstream_time, upstream_time)
        self.metrics.count_request(call.served.name, call.route.name, status)
        if ep is not None:
            # It reached an engine, so it is usage: an operator wants to see failures per key.
            self._record(call, ep, 0, 0, elapsed, None, status)
        return resp

    async def _whole(
        self, call: Call, ep: Endpoint, upstream: aiohttp.ClientResponse, t_up: float, upstream_before: float
    ) -> web.StreamResponse:
        served = call.served
        try:
            data = await upstream.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            upstream.release()
            ep.record_failure(str(exc) or type(exc).__name__)
            upstream_time = upstream_before + _perf() - t_up
            status = 504 if isinstance(exc, asyncio.TimeoutError) else 502
            _log_engine_error(ep, served, f"reply broke off: {exc or type(exc).__name__}")
            return self._finish_error(
                call, ep, upstream_time, status, "the model's engine broke off its reply", "upstream_error"
            )
        t_done = _perf()
        upstream.release()
        status = upstream.status
        if status in _RETRYABLE_STATUS:
            ep.record_failure(f"answered {status}")
        else:
            ep.record_success()
        prompt = completion = 0
        reply = call.reply
        translated: bytes | None = None
        if status == 200 and upstream.content_type == "application/json":
            try:
                obj = orjson.loads(data)
            except orjson.JSONDecodeError:
                obj = None
            if isinstance(obj, dict):
                usage = obj.get("usage")
                if isinstance(usage, dict):
                    prompt, completion = _tokens(usage)
                if recounts(ep.engine, call.outputs):
                    # Its engine may have counted one choice of several (llama.cpp): each is charged.
                    completion = max(completion, choices_output(obj, call.out_limit))
                    if call.prompts > 1:
                        prompt = max(prompt, _call_prompt(call))
                engine_name = obj.get("model")
                if reply is not None:
                    translated = reply.whole(obj)
                elif engine_name is not None and engine_name != call.asked:
                    # The client sees the name it asked for (an alias, say), not the engine's:
                    # the field's bytes replaced where they are plainly the top-level value (a
                    # large embeddings answer is not re-encoded), else the answer re-encoded.
                    field = _model_field(data)
                    if (
                        field
                        and isinstance(engine_name, str)
                        and field[field.index(b'"', 8) + 1 : -1] == engine_name.encode()
                    ):
                        data = data.replace(field, b'"model":' + orjson.dumps(call.asked), 1)
                    else:
                        obj["model"] = call.asked
                        data = orjson.dumps(obj)
        if translated is not None:
            data = translated
            headers = {"Content-Type": reply.content_type}
        elif reply is not None and status != 200:
            # The engine refused it (a prompt too long, say): its reason in this API's shape.
            if status < 500:
                data = reply.error(status, _engine_message(data, status))
            else:
                _log_engine_error(ep, served, f"answered {status}: {data[:500].decode(errors='replace')}")
                data = reply.error(status, f"the model's engine failed (it answered {status}); try again")
            headers = {"Content-Type": "application/json"}
        elif reply is not None:
            _log_engine_error(ep, served, f"answered 200 with {upstream.content_type}, not a chat completion")
            status = 502
            data = reply.error(status, "the model's engine answered something that is not a chat completion")
            headers = {"Content-Type": "application/json"}
        elif status >= 500:
            # An engine's own failure text may name its host, paths or devices: the operator
            # reads it in the log; the client reads what happened to its request.
            _log_engine_error(ep, served, f"answered {status}: {data[:500].decode(errors='replace')}")
            data = error_body(status, f"the model's engine failed (it answered {status}); try again", "upstream_error")
            headers = {"Content-Type": "application/json"}
        else:
            headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_HEADERS}
        resp = web.Response(status=status, body=data, headers=headers)
        upstream_time = upstream_before + t_done - t_up
        elapsed = _perf() - call.t0
        resp.headers["Server-Timing"] = _timing(elapsed - upstream_time, upstream_time)
        self.metrics.overhead.observe(elapsed - upstream_time)
        self.metrics.count_request(served.name, call.route.name, status)
        self.metrics.observe_latency(served.name, elapsed)
        self.metrics.count_tokens(served.name, prompt, completion)
        self._record(call, ep, prompt, completion, elapsed, None, status)
        return resp

    async def _stream(
        self,
        request: web.Request,
        call: Call,
        ep: Endpoint,
        upstream: aiohttp.ClientResponse,
        t_up: float,
        upstream_before: float,
    ) -> web.StreamResponse:
        t_headers = _perf()
        served, t0 = call.served, call.t0
        resp = _EventStream(status=200)
        resp.content_type = "text/event-stream"
        resp.headers["Cache-Control"] = "no-cache"
        # Tells nginx not to buffer: a buffered stream arrives in one burst at the end.
        resp.headers["X-Accel-Buffering"] = "no"
        if call.res is not None and self.accountant is not None:
            # A stream's headers leave before its tokens are known: they show the pools
            # with this request's estimate charged.
            resp.headers.update(self.accountant.headers(call.principal))
        _reply_headers(call, resp)
        upstream_time = upstream_before + t_headers - t_up
        own = _perf() - t0 - upstream_time
        resp.headers["Server-Timing"] = _timing(own, upstream_time)
        prompt = completion = 0
        counted = False  # the engine's usage event arrived
        seen = 0  # else: output tokens counted in the events that passed (_OUTPUT_FIELDS_SEEN)
        # Several sequences from an engine whose usage may count one of them (choices.py): the events
        # are counted all the way, and its usage events summed where it sends one per sequence.
        recount = recounts(ep.engine, call.outputs)
        sums = recount and ep.engine in USAGE_PER_SEQUENCE
        patterns: tuple[tuple[bytes, bytes], ...] | None = None
        # The name the client asked for goes into every event's "model", by a bytes replacement of
        # the upstream's value (learned from the first event that has one): no event is decoded.
        new_model = b'"model":' + orjson.dumps(call.asked)
        old_model: bytes | None = None
        rename = True
        ttft: float | None = None
        status = 200
        cancelled: asyncio.CancelledError | None = None
        try:
            await resp.prepare(request)
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            upstream.close()
            ep.record_success()
            self._record(call, ep, 0, 0, _perf() - t0, None, 499)
            self.metrics.count_request(served.name, call.route.name, 499)
            return resp
        pending = b""
        strip_usage = not call.client_wants_usage
        reply = call.reply
        usage_seen: dict | None = None
        try:
            try:
                if reply is not None:
                    # A translated route: every event is decoded and written in the client's API.
                    await resp.write(reply.start())
                    async for chunk in upstream.content.iter_any():
                        data = pending + chunk if pending else chunk
                        cut = data.rfind(b"\n\n")
                        if cut < 0:
                            pending = data
                            continue
                        cut += 2
                        out, pending = data[:cut], data[cut:]
                        if recount or not counted:
                            if patterns is None:
                                patterns = _OUTPUT_FIELDS_SEEN[call.route.kind, b'": "' in out]
                            seen += _count_output(out, patterns)
                        translated, usages = _translate_events(out, reply)
                        for usage in usages:
                            usage_seen = usage
                            prompt, completion = _add_usage(usage, prompt, completion, sums and counted)
                            counted = True
                        if translated:
                            if ttft is None:
                                ttft = _perf() - t0
                            await resp.write(translated)
                    await resp.write_eof(reply.end(usage_seen))
                    ep.record_success()
                    raise _Translated
                async for chunk in upstream.content.iter_any():
                    data = pending + chunk if pending else chunk
                    cut = data.rfind(b"\n\n")
                    if cut < 0:
                        pending = data
                        continue
                    cut += 2
                    out, pending = data[:cut], data[cut:]
                    fresh = False  # this run of events carried a usage object
                    if _has_usage(out):
                        out, usages = _take_usage(out, strip=strip_usage)
                        for usage in usages:
                            prompt, completion = _add_usage(usage, prompt, completion, sums and counted)
                            counted = fresh = True
                        if not out:
                            continue
                    if recount or not (fresh or counted):
                        if patterns is None:
                            patterns = _OUTPUT_FIELDS_SEEN[call.route.kind, b'": "' in out]
                        seen += _count_output(out, patterns)
                    if rename:
                        if old_model is None:
                            old_model = _model_field(out)
                            if old_model is not None and old_model in (new_model, b""):
                                rename = False  # already the asked name, or a value not safe to touch
                        if rename and old_model is not None:
                            out = out.replace(old_model, new_model)
                    if ttft is None:
                        ttft = _perf() - t0
                    if not pending and upstream.content.at_eof():
                        # The last event: send it with the end of the body, in one write.
                        await resp.write_eof(out)
                        break
                    await resp.write(out)
                else:
                    if pending:
                        if rename and old_model is not None:
                            pending = pending.replace(old_model, new_model)
                        await resp.write(pending)
            except (TimeoutError, aiohttp.ClientError) as exc:
                if isinstance(exc, aiohttp.ClientConnectionResetError):
                    raise
                # The engine went away mid-stream. The client already has bytes, so no
                # retry is possible; it sees the stream end early.
                ep.record_failure(f"stream broke off: {exc or type(exc).__name__}")
                status = 502
                raise _StreamCut from exc
            await resp.write_eof()  # no-op when the last event already ended the body
            ep.record_success()
        except _Translated:
            pass
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            # The client left: drop the engine request with it so it stops generating.
            status = 499
            ep.record_success()
        except _StreamCut:
            log.warning("stream from %s (%s) broke off after the first byte", ep.url, served.name)
            tail = reply.fail("the model's engine broke off its reply") if reply is not None else None
            if tail is not None:
                # The client's API has a way to say so: its failure event, then the end.
                try:
                    await resp.write_eof(tail)
                except (ConnectionResetError, aiohttp.ClientConnectionResetError):
                    pass
            elif request.transport is not None:
                request.transport.close()
        except asyncio.CancelledError as exc:
            # The client left and aiohttp cancelled the handler: record what passed (below, without
            # awaiting anything), then let the cancellation go on.
            status = 499
            ep.record_success()
            cancelled = exc
        finally:
            upstream.close()
        if not counted:
            # Cut before the engine's usage event: charge the output that passed (none, when
            # nothing reached the client yet), and the prompt as estimated at admission, which
            # the engine read either way (its own prompt count comes only with its usage event).
            prompt, completion = _call_prompt(call), seen
        elif recount:
            # Every sequence that passed is charged, whatever the engine's usage counted.
            completion = max(completion, seen)
            if call.prompts > 1:
                prompt = max(prompt, _call_prompt(call))
        elapsed = _perf() - t0
        self.metrics.overhead.observe(own)
        self.metrics.count_request(served.name, call.route.name, status)
        self.metrics.observe_latency(served.name, elapsed)
        if ttft is not None:
            self.metrics.observe_ttft(served.name, ttft)
        self.metrics.count_tokens(served.name, prompt, completion)
        self._record(call, ep, prompt, completion, elapsed, ttft, status)
        if cancelled is not None:
            request[_RECORDED] = True
            raise cancelled
        return resp

    def _record(
        self, call: Call, ep: Endpoint, prompt: int, completion: int, elapsed: float, ttft: float | None, status: int
    ) -> None:
        res = call.res
        cost = 0
        if res is not None and self.accountant is not None:
            # Priced by the model that served it; tokens settled to what the engine counted.
            cost = self.accountant.settle(res, prompt, completion)
        elif self.accountant is not None:
            # Nothing to settle (a principal with no limit anywhere), but its use is still priced:
            # the Usage and Organization pages and budgets set later count it.
            cost = self.accountant.pricing.cost_micros(call.served.name, prompt, completion)
        if self.usage is None:
            return
        principal = call.principal
        self.usage.record(
            UsageRow(
                key_id=principal.key_id,
                project=principal.project,
                model=call.asked,
                served_model=call.served.name,
                endpoint=ep.url,
                prompt_tokens=prompt,
                completion_tokens=completion,
                latency_ms=elapsed * 1000.0,
                ttft_ms=None if ttft is None else ttft * 1000.0,
                status=status,
                stream=call.stream,
                user_id=principal.user_id,
                project_id=principal.project_id,
                team_id=principal.team_id,
                org_id=principal.org_id,
                cost_micros=cost,
            )
        )


# Output tokens assumed for a request that sets no limit on a model with no max_output.
_DEFAULT_OUTPUT = 256


def _estimate(
    raw: bytes,
    out_limit: int | None,
    served: ServedModel,
    outputs: int = 1,
    prompt_ids: int = 0,
    min_out: int = 0,
) -> tuple[int, int]:
    """(prompt, completion) tokens a request may use, before the engine says: the prompt
    estimate (at least the token ids it gives as such) plus the output limit as read_request
    read it (else the model's max_output, else _DEFAULT_OUTPUT; at least ``min_out``) for each
    of the ``outputs`` sequences it asks for. Settled to the real count at the end."""
    out = out_limit if out_limit is not None else (served.max_output or _DEFAULT_OUTPUT)
    return max(prompt_estimate(raw), prompt_ids), max(out, min_out) * outputs


def _call_prompt(call: Call) -> int:
    """A request's prompt tokens as estimated at admission: what it is charged when the engine never says."""
    return max(prompt_estimate(call.raw), call.prompt_ids)


def _timing(own: float, upstream: float) -> str:
    return f"gateway;dur={own * 1000:.3f}, upstream;dur={upstream * 1000:.3f}"


def _tokens(usage: dict) -> tuple[int, int]:
    prompt = usage.get("prompt_tokens") or 0
    completion = usage.get("completion_tokens") or 0
    return (prompt if isinstance(prompt, int) else 0, completion if isinstance(completion, int) else 0)


def _count_output(block: bytes, patterns: tuple[tuple[bytes, bytes], ...]) -> int:
    """Output tokens in a run of events: those carrying generated text (see _OUTPUT_FIELDS_SEEN)."""
    n = 0
    for field, empty in patterns:
        c = block.count(field)
        if c:
            n += c - block.count(empty)
    return n


def _has_usage(block: bytes) -> bool:
    """Whether a run of events may hold a usage object; "usage":null (OpenAI and the fake engine
    send it on every event when usage is asked for) is no usage, and is not decoded."""
    return b'"usage":{' in block or b'"usage": {' in block


def _model_field(block: bytes) -> bytes | None:
    """The bytes of the first `"model":"..."` field in a run of events: None when there is none,
    b"" when its value holds an escape (left alone rather than matched wrongly)."""
    i = block.find(b'"model":')
    if i < 0:
        return None
    j = i + 8
    while block[j : j + 1] == b" ":
        j += 1
    if block[j : j + 1] != b'"':
        return b""
    k = block.find(b'"', j + 1)
    if k < 0:
        return b""
    field = block[i : k + 1]
    return b"" if b"\\" in field else field


def _add_usage(usage: dict, prompt: int, completion: int, add: bool) -> tuple[int, int]:
    """(prompt, completion) after a usage event: its own numbers (each event of most engines counts
    the whole request so far), or with ``add`` the output added to what earlier events counted (an
    engine that sends one event per sequence, each counting its own; they share one prompt)."""
    p, c = _tokens(usage)
    if add:
        return max(prompt, p), completion + c
    return p, c


def _take_usage(block: bytes, strip: bool) -> tuple[bytes, list[dict]]:
    """Find the usage objects in a run of complete SSE events, in order; drop the usage-only
    events when asked.

    Only events that carry a usage object are decoded; the rest are passed on
    byte for byte.
    """
    usages: list[dict] = []
    kept: list[bytes] = []
    dropped = False
    for event in block.split(b"\n\n"):
        if not event:
            continue
        if _has_usage(event) and event.startswith(b"data:"):
            try:
                obj = orjson.loads(event[5:])
            except orjson.JSONDecodeError:
                obj = None
            if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
                usages.append(obj["usage"])
                if strip and not obj.get("choices"):
                    dropped = True
                    continue
        kept.append(event)
    if not dropped:
        return block, usages
    return b"".join(e + b"\n\n" for e in kept), usages


def _translate_events(block: bytes, reply: Any) -> tuple[bytes, list[dict]]:
    """A run of complete SSE events from the engine, written by a translated route's reply;
    with the usage objects they carry, in order."""
    out: list[bytes] = []
    usages: list[dict] = []
    for event in block.split(b"\n\n"):
        if not event.startswith(b"data:"):
            continue
        payload = event[5:].strip()
        if payload == b"[DONE]":
            continue
        try:
            chunk = orjson.loads(payload)
        except orjson.JSONDecodeError:
            continue
        if not isinstance(chunk, dict):
            continue
        if isinstance(chunk.get("usage"), dict):
            usages.append(chunk["usage"])
        out.append(reply.event(chunk))
    return b"".join(out), usages


def _engine_message(data: bytes, status: int) -> str:
    """What an engine said when it refused a request (OpenAI's error shape, or llama.cpp's)."""
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        obj = None
    if isinstance(obj, dict):
        err = obj.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
        if isinstance(err, str):
            return err
        if isinstance(obj.get("message"), str):
            return obj["message"]
    return f"the model's engine refused the request (it answered {status})"


def _reply_headers(call: Call, resp: web.StreamResponse) -> None:
    """The headers a request's own handling adds: a lowered max_tokens, a translated route's own."""
    if call.clamped is not None:
        resp.headers[OUTPUT_CLAMPED_HEADER] = f"{call.clamped[0]}->{call.clamped[1]}"
    if call.reply is not None:
        resp.headers.update(call.reply.headers)
