"""A fast fake OpenAI-compatible inference engine for tests and benchmarks.

It speaks the routes a gateway relies on (chat completions plain and SSE,
legacy completions, embeddings, models, health, Prometheus metrics with
llama.cpp's or vLLM's names) with configurable latency and injectable
failures. Benchmarks use it to isolate the gateway, so the hot paths avoid
per-request work: SSE chunks are assembled from pre-encoded pieces and,
with no per-token delay, a whole stream goes out in one write.

In-process::

    async with FakeEngine(port=0, tokens=8, ttft_ms=20) as fe:
        client = openai.AsyncOpenAI(base_url=fe.base_url, api_key="x")
        fe.fail_next(2, status=503)

With ``api_key`` set, every route but /health wants ``Authorization: Bearer
<key>`` and answers 401 without it, as llama-server with --api-key does.

As a process (prints its URL on stdout once listening)::

    python -m llmgw.testing.fake_engine --port 8081 --tokens 64 --token-ms 5

Token accounting is deterministic: ``prompt_tokens`` comes from the input
text (see :func:`count_text_tokens`), ``completion_tokens`` is the
configured ``tokens`` unless the request's ``max_tokens`` /
``max_completion_tokens`` is smaller (then ``finish_reason`` is ``length``).
A request asking for ``n`` choices (of each prompt of a completions request)
gets them all, each that long. Its usage counts every one, as vLLM's does;
with ``usage="first"`` it counts as llama-server's does: a whole reply carries
the first choice's usage only, a stream one usage event per choice.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import math
import os
import struct
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import orjson
from aiohttp import web

from llmgw.runtime import run_until_stopped

FLAVOURS = ("llamacpp", "llamacpp-legacy", "vllm")
# How usage counts a request of several choices: all of them (vLLM, SGLang), or each its own (llama-server).
USAGE_MODES = ("all", "first")
FAULT_MODES = ("status", "close", "midstream", "hang", "stall")

# Completion text is built from these; each one counts as one token.
_WORDS = (
    " lorem",
    " ipsum",
    " dolor",
    " sit",
    " amet",
    " consectetur",
    " adipiscing",
    " elit",
    " sed",
    " do",
    " eiusmod",
    " tempor",
    " incididunt",
    " ut",
    " labore",
    " et",
)
# vLLM's time-to-first-token and end-to-end latency buckets (v1 engine).
_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
_E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)

_JSON = "application/json"
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
_DONE = b"data: [DONE]\n\n"


def count_text_tokens(text: str) -> int:
    """Deterministic stand-in for a tokenizer: one token per ~4 UTF-8 bytes."""
    return (len(text.encode()) + 3) // 4 if text else 0


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def chat_prompt_tokens(messages: Any) -> int:
    """Prompt tokens of a chat request: text tokens plus a fixed 4 per message
    (role and framing, like ChatML) plus 3 for the assistant header."""
    if not isinstance(messages, list):
        return 0
    n = 3
    for m in messages:
        if isinstance(m, dict):
            n += 4 + count_text_tokens(_content_text(m.get("content")))
    return n


def _inputs(value: Any) -> list[Any]:
    """Normalise a prompt/input (str, [str], [int], [[int]]) to a list of items."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        if value and all(isinstance(v, int) for v in value):
            return [value]
        return value
    return []


def _item_tokens(item: Any) -> int:
    if isinstance(item, str):
        return count_text_tokens(item)
    if isinstance(item, list):
        return len(item)  # already token ids
    return 0


def fake_embedding(item: Any, dim: int) -> list[float]:
    """A unit vector derived from a hash of the input: equal inputs, equal vectors."""
    seed = orjson.dumps(item)
    raw = b""
    counter = 0
    while len(raw) < 4 * dim:
        raw += hashlib.blake2b(seed + counter.to_bytes(4, "little"), digest_size=64).digest()
        counter += 1
    vals = [(x / 2147483648.0) for x in struct.unpack(f"<{dim}i", raw[: 4 * dim])]
    norm = math.sqrt(sum(v * v for v in vals)) or 1.0
    return [v / norm for v in vals]


@dataclass
class Fault:
    """One injected failure, consumed by one inference request."""

    mode: str = "status"  # status | close | midstream | hang | stall
    status: int = 500
    message: str = "injected failure"
    after_tokens: int = 1  # midstream, stall: tokens sent before the connection drops or the stream stalls


@dataclass
class RecordedRequest:
    method: str
    path: str
    headers: dict[str, str]
    body: Any


@dataclass
class _Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, v: float) -> None:
        self.n += 1
        self.total += v
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1


def _go_float(v: float) -> str:
    # prometheus_client's floatToGoString for the values we emit (finite, >= 0).
    s = repr(float(v))
    dot = s.find(".")
    if v > 0 and dot > 6 and "e" not in s:
        mantissa = f"{s[0]}.{s[1:dot]}{s[dot + 1 :]}".rstrip("0.")
        return f"{mantissa}e+{dot - 1:02d}"
    return s


def _g(v: float) -> str:
    # llama.cpp prints doubles with C++ ostream defaults (%g, 6 digits).
    return f"{v:g}"


class FakeEngine:
    """The fake engine; start with ``async with`` or :meth:`start`/:meth:`stop`.

    Settings are plain attributes and may be changed while it runs.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        model: str = "fake-model",
        ttft_ms: float = 0.0,
        token_ms: float = 0.0,
        tokens: int = 16,
        metrics: str = "llamacpp",
        slots: int | None = None,
        embedding_dim: int = 64,
        kv_capacity_tokens: int = 32768,
        record: bool = True,
        api_key: str | None = None,
        usage: str = "all",
    ) -> None:
        if metrics not in FLAVOURS:
            raise ValueError(f"metrics must be one of {FLAVOURS}, not {metrics!r}")
        if usage not in USAGE_MODES:
            raise ValueError(f"usage must be one of {USAGE_MODES}, not {usage!r}")
        self.usage = usage
        self.host = host
        self.port = port
        self.model = model
        self.ttft_ms = ttft_ms
        self.token_ms = token_ms
        self.tokens = tokens
        self.metrics_flavour = metrics
        self.embedding_dim = embedding_dim
        self.kv_capacity_tokens = kv_capacity_tokens
        self.record = record
        # Set before start: the check is only installed when there is a key, so a
        # benchmark without one pays nothing for it.
        self.api_key = api_key
        self.unauthorized = 0  # requests refused for a missing or wrong key
        # While True, /health and inference answer 503 "Loading model" (llama.cpp's startup).
        self.loading = False
        self.requests: list[RecordedRequest] = []

        self._slots = asyncio.Semaphore(slots) if slots else None
        self.n_slots = slots
        self._faults: deque[Fault] = deque()
        self._runner: web.AppRunner | None = None
        self._id_prefix = os.urandom(4).hex()
        self._id_counter = 0
        self._start_time = time.time()

        # Live gauges and counters behind /metrics.
        self.processing = 0
        self.waiting = 0
        self.peak_waiting = 0  # the longest its own queue ever was (admission tests read it)
        self.kv_tokens = 0
        self.requests_total = 0
        self.prompt_tokens_total = 0
        self.completion_tokens_total = 0
        # Every output token made, streams cut by either side included (completion_tokens_total
        # counts finished requests only): what a gateway should charge for.
        self.tokens_generated = 0
        self.prompt_seconds_total = 0.0
        self.predict_seconds_total = 0.0
        self.finished: dict[str, int] = {"stop": 0, "length": 0, "abort": 0}
        self._ttft_hist = _Histogram(_TTFT_BUCKETS)
        self._e2e_hist = _Histogram(_E2E_BUCKETS)

        # Pre-encoded per-token pieces for SSE: the delta of a chat chunk and
        # the text of a completion chunk.
        self._chat_deltas = [b'{"content":' + orjson.dumps(w) + b"}" for w in _WORDS]
        self._text_pieces = [orjson.dumps(w) for w in _WORDS]

    # ------------------------------------------------------------ lifecycle

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        """OpenAI SDK ``base_url``."""
        return self.url + "/v1"

    @property
    def in_flight(self) -> int:
        return self.processing + self.waiting

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[self._require_key] if self.api_key else [])
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/embeddings", self._embeddings)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        return app

    async def start(self) -> FakeEngine:
        self._runner = web.AppRunner(self.make_app(), access_log=None, handle_signals=False, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, backlog=1024)
        await site.start()
        # Port 0 asks the OS for a free port: read back the one we got.
        self.port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> FakeEngine:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ------------------------------------------------------------ control

    def fail_next(
        self,
        count: int = 1,
        status: int = 500,
        *,
        mode: str = "status",
        message: str | None = None,
        after_tokens: int = 1,
    ) -> None:
        """Make the next ``count`` inference requests fail.

        mode ``status``: answer ``status`` with an OpenAI-style error body;
        ``close``: drop the connection without answering; ``midstream``:
        send ``after_tokens`` tokens of a stream then drop the connection
        (non-streaming requests are dropped at once); ``hang``: never answer;
        ``stall``: send ``after_tokens`` tokens of a stream, then nothing more
        until the client leaves (an engine still generating when the client cuts).
        """
        if mode not in FAULT_MODES:
            raise ValueError(f"mode must be one of {FAULT_MODES}")
        fault = Fault(mode, status, message or f"injected failure ({status})", after_tokens)
        self._faults.extend(fault for _ in range(count))

    def clear_faults(self) -> None:
        self._faults.clear()

    def reset_stats(self) -> None:
        self.requests.clear()
        self.requests_total = self.prompt_tokens_total = self.completion_tokens_total = 0
        self.tokens_generated = 0
        self.prompt_seconds_total = self.predict_seconds_total = 0.0
        self.finished = {"stop": 0, "length": 0, "abort": 0}
        self._ttft_hist = _Histogram(_TTFT_BUCKETS)
        self._e2e_hist = _Histogram(_E2E_BUCKETS)

    # ------------------------------------------------------------ helpers

    @web.middleware
    async def _require_key(self, request: web.Request, handler) -> web.StreamResponse:
        # llama-server's rule: /health is open (a load balancer's probe), everything else wants the key.
        if request.path != "/health" and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            self.unauthorized += 1
            return self._error(401, "Invalid API Key")
        return await handler(request)

    def _new_id(self, prefix: str) -> str:
        self._id_counter += 1
        return f"{prefix}-{self._id_prefix}{self._id_counter:016x}"

    def _error(self, status: int, message: str, etype: str | None = None) -> web.Response:
        etype = etype or {
            400: "invalid_request_error",
            401: "authentication_error",
            404: "not_found_error",
            429: "rate_limit_error",
            501: "not_supported_error",
            503: "unavailable_error",
        }.get(status, "server_error")
        body: dict[str, object]
        if self.metrics_flavour == "vllm":
            body = {"object": "error", "message": message, "type": etype, "param": None, "code": status}
        else:
            body = {"error": {"code": status, "message": message, "type": etype}}
        return web.Response(status=status, body=orjson.dumps(body), content_type=_JSON)

    async def _read(self, request: web.Request) -> tuple[Any, web.Response | None]:
        raw = await request.read()
        try:
            body = orjson.loads(raw) if raw else {}
        except orjson.JSONDecodeError:
            return None, self._error(400, "request body is not valid JSON")
        if not isinstance(body, dict):
            return None, self._error(400, "request body must be a JSON object")
        if self.record:
            self.requests.append(RecordedRequest(request.method, request.path, dict(request.headers), body))
        return body, None

    async def _gate(self, request: web.Request, body: dict) -> tuple[Fault | None, web.StreamResponse | None]:
        """Loading state, model check and injected faults, before any work."""
        if self.loading:
            return None, self._error(503, "Loading model")
        if self.metrics_flavour == "vllm" and body.get("model") not in (None, self.model):
            return None, self._error(404, f"The model `{body.get('model')}` does not exist.")
        fault = self._faults.popleft() if self._faults else None
        if fault is None:
            return None, None
        if fault.mode == "status":
            return None, self._error(fault.status, fault.message)
        if fault.mode == "close" or (fault.mode in ("midstream", "stall") and not body.get("stream")):
            self._drop(request)
            return None, web.Response(status=500)  # never reaches the client
        return fault, None

    @staticmethod
    async def _hang(request: web.Request) -> web.Response:
        # aiohttp does not cancel handlers when the client leaves, so poll for
        # that instead of sleeping until shutdown.
        while request.transport is not None and not request.transport.is_closing():  # noqa: ASYNC110  (no event says the client left)
            await asyncio.sleep(0.05)
        return web.Response(status=500)  # the client is gone

    @staticmethod
    def _drop(request: web.Request) -> None:
        if request.transport is not None:
            request.transport.abort()

    def _n_completion(self, body: dict) -> tuple[int, str]:
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        n = max(0, int(self.tokens))
        if isinstance(limit, int) and 0 <= limit < n:
            return limit, "length"
        return n, "stop"

    async def _acquire(self) -> None:
        if self._slots is None:
            return
        self.waiting += 1
        self.peak_waiting = max(self.peak_waiting, self.waiting)
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1

    def _release(self) -> None:
        if self._slots is not None:
            self._slots.release()

    def _account(self, prompt: int, completion: int, finish: str, t0: float, t_first: float | None) -> None:
        now = time.perf_counter()
        self.requests_total += 1
        self.prompt_tokens_total += prompt
        self.completion_tokens_total += completion
        self.finished[finish] = self.finished.get(finish, 0) + 1
        first = t_first if t_first is not None else now
        self.prompt_seconds_total += first - t0
        self.predict_seconds_total += now - first
        self._ttft_hist.observe(first - t0)
        self._e2e_hist.observe(now - t0)

    def _text(self, n: int) -> str:
        return "".join(_WORDS[i % len(_WORDS)] for i in range(n))

    @staticmethod
    def _usage(prompt: int, completion: int) -> dict:
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    # ------------------------------------------------------------ generation

    async def _generate(
        self,
        request: web.Request,
        body: dict,
        prompt_tokens: int,
        kind: str,
        prompts: int = 1,
    ) -> web.StreamResponse:
        """Shared path of chat and legacy completions (kind ``chat``/``text``); ``prompts`` is how
        many a completions request sent (each gets its choices)."""
        fault, early = await self._gate(request, body)
        if early is not None:
            return early
        n, finish = self._n_completion(body)
        seqs = _choices(body) * prompts
        stream = bool(body.get("stream"))
        t0 = time.perf_counter()
        await self._acquire()
        self.processing += 1
        self.kv_tokens += prompt_tokens + n * seqs
        try:
            if fault is not None and fault.mode == "hang":
                return await self._hang(request)  # counted as processing, like a stuck engine
            if self.ttft_ms:
                await asyncio.sleep(self.ttft_ms / 1000)
            if stream:
                return await self._stream(request, body, prompt_tokens, n, finish, kind, fault, t0, seqs)
            if self.token_ms and n:
                await asyncio.sleep(self.token_ms * n / 1000)
            self.tokens_generated += n * seqs
            self._account(prompt_tokens, n * seqs, finish, t0, None)
            created = int(time.time())
            usage = self._usage(prompt_tokens, n if self.usage == "first" else n * seqs)
            if kind == "chat":
                payload = {
                    "id": self._new_id("chatcmpl"),
                    "object": "chat.completion",
                    "created": created,
                    "model": self.model,
                    "system_fingerprint": "fake",
                    "choices": [
                        {
                            "index": i,
                            "message": {"role": "assistant", "content": self._text(n)},
                            "logprobs": None,
                            "finish_reason": finish,
                        }
                        for i in range(seqs)
                    ],
                    "usage": usage,
                }
            else:
                payload = {
                    "id": self._new_id("cmpl"),
                    "object": "text_completion",
                    "created": created,
                    "model": self.model,
                    "system_fingerprint": "fake",
                    "choices": [
                        {"index": i, "text": self._text(n), "logprobs": None, "finish_reason": finish}
                        for i in range(seqs)
                    ],
                    "usage": usage,
                }
            return web.Response(body=orjson.dumps(payload), content_type=_JSON)
        finally:
            self.processing -= 1
            self.kv_tokens -= prompt_tokens + n * seqs
            self._release()

    async def _stream(
        self,
        request: web.Request,
        body: dict,
        prompt_tokens: int,
        n: int,
        finish: str,
        kind: str,
        fault: Fault | None,
        t0: float,
        seqs: int = 1,
    ) -> web.StreamResponse:
        opts = body.get("stream_options")
        include_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
        created = str(int(time.time())).encode()
        model = orjson.dumps(self.model)
        if kind == "chat":
            obj, pieces = b"chat.completion.chunk", self._chat_deltas
            rid = self._new_id("chatcmpl").encode()
        else:
            obj, pieces = b"text_completion", self._text_pieces
            rid = self._new_id("cmpl").encode()
        head = (
            b'data: {"id":"'
            + rid
            + b'","object":"'
            + obj
            + b'","created":'
            + created
            + b',"model":'
            + model
            + b',"system_fingerprint":"fake","choices":[{"index":'
        )
        # Each choice's events differ only in their index (interleaved, as an engine's batch makes them).
        heads = [head + str(k).encode() + b"," for k in range(seqs)]
        # OpenAI sends "usage": null on every chunk when include_usage is set.
        usage_null = b',"usage":null' if include_usage else b""
        tail = b',"logprobs":null,"finish_reason":null}]' + usage_null + b"}\n\n"

        def chunk(i: int) -> bytes:
            if kind == "chat":
                return b"".join(h + b'"delta":' + pieces[i % len(pieces)] + tail for h in heads)
            return b"".join(h + b'"text":' + pieces[i % len(pieces)] + tail for h in heads)

        ending = b'"logprobs":null,"finish_reason":"' + finish.encode() + b'"}]' + usage_null + b"}\n\n"
        if kind == "chat":
            first = b"".join(h + b'"delta":{"role":"assistant","content":""}' + tail for h in heads)
            last = b"".join(h + b'"delta":{},' + ending for h in heads)
        else:
            first = b""
            last = b"".join(h + b'"text":"",' + ending for h in heads)
        end = b""
        if include_usage:
            # llama-server sends one usage event per choice, each counting its own; vLLM one for all.
            counts = [n] * seqs if self.usage == "first" else [n * seqs]
            end = b"".join(
                b'data: {"id":"'
                + rid
                + b'","object":"'
                + obj
                + b'","created":'
                + created
                + b',"model":'
                + model
                + b',"system_fingerprint":"fake","choices":[],"usage":'
                + orjson.dumps(self._usage(prompt_tokens, c))
                + b"}\n\n"
                for c in counts
            )
        end += _DONE

        resp = web.StreamResponse(status=200, headers=_SSE_HEADERS)
        await resp.prepare(request)
        drop_at = fault.after_tokens if fault is not None and fault.mode in ("midstream", "stall") else None
        t_first: float | None = None
        try:
            if not self.token_ms and drop_at is None:
                # No pacing: one write for the whole stream.
                t_first = time.perf_counter()
                self.tokens_generated += n * seqs
                await resp.write(first + b"".join(chunk(i) for i in range(n)) + last + end)
            else:
                if first:
                    await resp.write(first)
                for i in range(n):
                    if drop_at is not None and i >= drop_at:
                        break
                    if i and self.token_ms:
                        await asyncio.sleep(self.token_ms / 1000)
                    self.tokens_generated += seqs
                    await resp.write(chunk(i))
                    if t_first is None:
                        t_first = time.perf_counter()
                if drop_at is not None:
                    self.finished["abort"] += 1
                    if fault is not None and fault.mode == "stall":
                        return await self._hang(request)
                    self._drop(request)
                    return resp
                await resp.write(last + end)
            await resp.write_eof()
        except ConnectionResetError:
            # The client went away mid-stream (aiohttp's ClientConnectionResetError).
            self.finished["abort"] += 1
            return resp
        except asyncio.CancelledError:
            self.finished["abort"] += 1
            raise
        self._account(prompt_tokens, n * seqs, finish, t0, t_first)
        return resp

    # ------------------------------------------------------------ routes

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body, err = await self._read(request)
        if err is not None:
            return err
        if not isinstance(body.get("messages"), list) or not body["messages"]:
            return self._error(400, "'messages' must be a non-empty array")
        call = _forced_tool_call(body)
        if call is not None:
            return await self._tool_call(request, body, call)
        return await self._generate(request, body, chat_prompt_tokens(body["messages"]), "chat")

    async def _tool_call(self, request: web.Request, body: dict, call: dict) -> web.StreamResponse:
        """A request that must call a tool (tool_choice required, or one named) gets one call to
        it, with arguments made from its schema: what a model constrained by grammar sends."""
        prompt = chat_prompt_tokens(body["messages"])
        completion = max(1, len(call["function"]["arguments"]) // 4)
        self._account(prompt, completion, "tool_calls", time.perf_counter(), None)
        usage = self._usage(prompt, completion)
        base = {"id": self._new_id("chatcmpl"), "created": int(time.time()), "model": self.model}
        if not body.get("stream"):
            message = {"role": "assistant", "content": None, "tool_calls": [call]}
            payload = {
                **base,
                "object": "chat.completion",
                "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}],
                "usage": usage,
            }
            return web.Response(body=orjson.dumps(payload), content_type=_JSON)
        fn = call["function"]
        args = fn["arguments"]
        deltas = [
            {"role": "assistant", "content": None},
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": call["id"],
                        "type": "function",
                        "function": {"name": fn["name"], "arguments": ""},
                    }
                ]
            },
            *(
                {"tool_calls": [{"index": 0, "function": {"arguments": args[i : i + 8]}}]}
                for i in range(0, len(args), 8)
            ),
        ]
        events = [
            {**base, "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": d, "finish_reason": None}]}
            for d in deltas
        ]
        events.append(
            {
                **base,
                "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}],
            }
        )
        opts = body.get("stream_options")
        if isinstance(opts, dict) and opts.get("include_usage"):
            events.append({**base, "object": "chat.completion.chunk", "choices": [], "usage": usage})
        resp = web.StreamResponse(status=200, headers=_SSE_HEADERS)
        await resp.prepare(request)
        await resp.write(b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events) + _DONE)
        await resp.write_eof()
        return resp

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body, err = await self._read(request)
        if err is not None:
            return err
        items = _inputs(body.get("prompt"))
        if not items:
            return self._error(400, "'prompt' must be a string or an array")
        return await self._generate(request, body, sum(_item_tokens(i) for i in items), "text", len(items))

    async def _embeddings(self, request: web.Request) -> web.StreamResponse:
        body, err = await self._read(request)
        if err is not None:
            return err
        items = _inputs(body.get("input"))
        if not items:
            return self._error(400, "'input' must be a string or an array")
        fault, early = await self._gate(request, body)
        if early is not None:
            return early
        use_b64 = body.get("encoding_format") == "base64"
        prompt = sum(_item_tokens(i) for i in items)
        t0 = time.perf_counter()
        await self._acquire()
        self.processing += 1
        try:
            if fault is not None and fault.mode == "hang":
                return await self._hang(request)
            if self.ttft_ms:
                await asyncio.sleep(self.ttft_ms / 1000)
            data = []
            for idx, item in enumerate(items):
                vec = fake_embedding(item, self.embedding_dim)
                emb: Any = base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode() if use_b64 else vec
                data.append({"object": "embedding", "index": idx, "embedding": emb})
            self._account(prompt, 0, "stop", t0, None)
            payload = {
                "object": "list",
                "data": data,
                "model": self.model,
                "usage": {"prompt_tokens": prompt, "total_tokens": prompt},
            }
            return web.Response(body=orjson.dumps(payload), content_type=_JSON)
        finally:
            self.processing -= 1
            self._release()

    async def _models(self, request: web.Request) -> web.Response:
        owner = "vllm" if self.metrics_flavour == "vllm" else "llamacpp"
        payload = {
            "object": "list",
            "data": [{"id": self.model, "object": "model", "created": int(self._start_time), "owned_by": owner}],
        }
        return web.Response(body=orjson.dumps(payload), content_type=_JSON)

    async def _health(self, request: web.Request) -> web.Response:
        if self.loading:
            return self._error(503, "Loading model")
        if self.metrics_flavour == "vllm":
            return web.Response(status=200)  # vLLM answers an empty 200
        return web.Response(body=b'{"status":"ok"}', content_type=_JSON)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            text=self.metrics_text(),
            content_type="text/plain",
            charset="utf-8",
            headers={"Process-Start-Time-Unix": str(int(self._start_time))} if self.metrics_flavour != "vllm" else None,
        )

    # ------------------------------------------------------------ metrics

    def kv_usage(self) -> float:
        return min(1.0, self.kv_tokens / self.kv_capacity_tokens) if self.kv_capacity_tokens else 0.0

    def metrics_text(self) -> str:
        if self.metrics_flavour == "vllm":
            return self._vllm_metrics()
        return self._llamacpp_metrics()

    def _llamacpp_metrics(self) -> str:
        # Same names, order and number format as llama-server (llama.cpp in
        # llama-cpp-python 0.3.36); see tests/fixtures/metrics/llamacpp.txt.
        prompt_tps = self.prompt_tokens_total / self.prompt_seconds_total if self.prompt_seconds_total else 0.0
        pred_tps = self.completion_tokens_total / self.predict_seconds_total if self.predict_seconds_total else 0.0
        counters = [
            (
                "prompt_tokens_total",
                "Number of prompt tokens processed, excluding cached tokens",
                self.prompt_tokens_total,
            ),
            ("prompt_tokens_cached_total", "Number of prompt tokens reused from the cache", 0),
            ("prompt_seconds_total", "Total time spent processing prompts", self.prompt_seconds_total),
            ("tokens_predicted_total", "Number of generation tokens processed", self.completion_tokens_total),
            ("tokens_predicted_seconds_total", "Total time spent generating tokens", self.predict_seconds_total),
            (
                "n_decode_total",
                "Total number of llama_decode() calls, excluding speculative decoding and multimodal decoding",
                self.completion_tokens_total,
            ),
            ("n_tokens_max", "Largest observed sequence length (prompt + generation)", 0),
            ("spec_decode_num_draft_tokens_total", "Speculative: Total draft tokens generated", 0),
            (
                "spec_decode_num_accepted_tokens_total",
                "Speculative: Total draft tokens accepted by the target model",
                0,
            ),
            ("spec_decode_num_drafts_total", "Speculative: Total speculative decoding verification steps", 0),
        ]
        gauges = [
            ("prompt_tokens_seconds", "Average prompt throughput in tokens/s", prompt_tps),
            ("predicted_tokens_seconds", "Average generation throughput in tokens/s", pred_tps),
            ("requests_processing", "Number of requests processing", self.processing),
            ("requests_deferred", "Number of requests deferred", self.waiting),
            (
                "n_busy_slots_per_decode",
                "Average number of busy slots per llama_decode() call",
                1 if self.processing else 0,
            ),
        ]
        if self.metrics_flavour == "llamacpp-legacy":
            # Older llama.cpp builds (2024 to mid 2025) also exported KV-cache gauges.
            gauges[2:2] = [
                ("kv_cache_usage_ratio", "KV-cache usage. 1 means 100 percent usage.", self.kv_usage()),
                ("kv_cache_tokens", "KV-cache tokens.", self.kv_tokens),
            ]
        out = []
        for kind, items in (("counter", counters), ("gauge", gauges)):
            for name, help_, value in items:
                out.append(
                    f"# HELP llamacpp:{name} {help_}\n# TYPE llamacpp:{name} {kind}\n"
                    f"llamacpp:{name} {_g(float(value))}\n"
                )
        return "".join(out)

    def _vllm_metrics(self) -> str:
        # prometheus_client (which vLLM uses) sorts labels by name: engine,
        # then finished_reason/le, then model_name; values print as Python floats.
        model = self.model.replace("\\", "\\\\").replace('"', '\\"')
        labels = f'engine="0",model_name="{model}"'
        out: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, str, float]]) -> None:
            out.append(f"# HELP vllm:{name} {help_}\n# TYPE vllm:{name} {kind}\n")
            for suffix, extra, value in samples:
                lab = f'engine="0",{extra},model_name="{model}"' if extra else labels
                out.append(f"vllm:{name}{suffix}{{{lab}}} {_go_float(value)}\n")

        def hist(name: str, help_: str, h: _Histogram) -> None:
            samples: list[tuple[str, str, float]] = [
                ("_bucket", f'le="{_go_float(b)}"', c) for b, c in zip(h.buckets, h.counts, strict=True)
            ]
            samples += [("_bucket", 'le="+Inf"', h.n), ("_count", "", h.n), ("_sum", "", h.total)]
            # (no *_created series: vLLM in multiprocess mode has none either)
            metric(name, "histogram", help_, samples)

        metric(
            "num_requests_running",
            "gauge",
            "Number of requests in model execution batches.",
            [("", "", self.processing)],
        )
        metric("num_requests_waiting", "gauge", "Number of requests waiting to be processed.", [("", "", self.waiting)])
        metric(
            "kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", [("", "", self.kv_usage())]
        )
        metric(
            "gpu_cache_usage_perc",
            "gauge",
            "GPU KV-cache usage. 1 means 100 percent usage.DEPRECATED: Use vllm:kv_cache_usage_perc instead.",
            [("", "", self.kv_usage())],
        )
        metric("num_preemptions_total", "counter", "Cumulative number of preemption from the engine.", [("", "", 0)])
        metric(
            "prompt_tokens_total",
            "counter",
            "Number of prefill tokens processed.",
            [("", "", self.prompt_tokens_total)],
        )
        metric(
            "generation_tokens_total",
            "counter",
            "Number of generation tokens processed.",
            [("", "", self.completion_tokens_total)],
        )
        metric(
            "request_success_total",
            "counter",
            "Count of successfully processed requests.",
            [("", f'finished_reason="{r}"', self.finished.get(r, 0)) for r in ("stop", "length", "abort")],
        )
        hist("time_to_first_token_seconds", "Histogram of time to first token in seconds.", self._ttft_hist)
        hist("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", self._e2e_hist)
        return "".join(out)


# ---------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m llmgw.testing.fake_engine", description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0 picks a free port (default)")
    ap.add_argument("--model", default="fake-model")
    ap.add_argument("--ttft-ms", type=float, default=0.0, help="delay before the first token")
    ap.add_argument("--token-ms", type=float, default=0.0, help="delay between tokens")
    ap.add_argument("--tokens", type=int, default=16, help="completion tokens per answer")
    ap.add_argument("--metrics", choices=FLAVOURS, default="llamacpp", help="metric names to export")
    ap.add_argument("--slots", type=int, default=0, help="concurrent requests before queueing (0: unlimited)")
    ap.add_argument("--embedding-dim", type=int, default=64)
    ap.add_argument("--api-key", default=None, help="require this bearer key on every route but /health")
    ap.add_argument(
        "--usage",
        choices=USAGE_MODES,
        default="all",
        help="what usage counts of several choices: all (vLLM) or each its own (llama-server)",
    )
    return ap


async def _serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    fe = FakeEngine(
        host=args.host,
        port=args.port,
        model=args.model,
        ttft_ms=args.ttft_ms,
        token_ms=args.token_ms,
        tokens=args.tokens,
        metrics=args.metrics,
        slots=args.slots or None,
        embedding_dim=args.embedding_dim,
        record=False,
        api_key=args.api_key,
        usage=args.usage,
    )
    async with fe:
        print(fe.url, flush=True)
        await stop.wait()


def _choices(body: dict) -> int:
    """The choices a request asks for of each prompt: n (llama.cpp's n_cmpl first), else one."""
    n = body.get("n_cmpl", body.get("n"))
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1


def _forced_tool_call(body: dict) -> dict | None:
    """The tool a request obliges the model to call, as a chat tool call, or None."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if not isinstance(tools, list) or not tools:
        return None
    named = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if choice != "required" and named is None:
        return None
    fns = [t.get("function") or {} for t in tools if isinstance(t, dict)]
    fn = next((f for f in fns if f.get("name") == named), None) if named else (fns[0] if fns else None)
    if fn is None:
        return None
    params = fn.get("parameters") or {}
    props = params.get("properties") or {}
    args = {k: _schema_value(props.get(k) or {}) for k in params.get("required") or []}
    return {
        "id": "call_" + hashlib.sha256(orjson.dumps(body.get("messages"))).hexdigest()[:24],
        "type": "function",
        "function": {"name": fn.get("name", ""), "arguments": orjson.dumps(args).decode()},
    }


def _schema_value(schema: dict) -> Any:
    if schema.get("enum"):
        return schema["enum"][0]
    return {"integer": 1, "number": 1.5, "boolean": True, "array": [], "object": {}}.get(
        schema.get("type", "string"), "fake"
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # uvloop when available: benchmarks want the engine out of the way.
    run_until_stopped(partial(_serve, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
