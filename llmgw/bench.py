"""The load behind `llmgw ctl bench`: concurrency ramped against an OpenAI-compatible endpoint
until a latency target breaks, and what the last level that held could carry.

At each level of concurrency C, C clients send streaming chat completions back to back
until the level's requests are done (``requests_per_step``, at least two each). Each
request's time to first token (TTFT: from sending to the first token) and time per output
token (TPOT: the time from the first token to the last over the tokens after the first)
are measured; a level holds when the p99 of both is within the target and no request
failed. The ramp stops at the first level that does not hold. The capacity is the last
level that held, with its throughput and latencies (not the peak's: peak throughput
arrives long after latency has become unusable); 0 when not even one request at a time
met the target, which is an answer, not a failure. A run whose first level fails with
errors and nothing held measured nothing, and says why instead (``BenchError``).

Prompts come from a small built-in set of varied lengths, from a one-line question to a
few thousand characters of text to summarise; each request's starts with its own tag, so
no two share a prefix an engine could have cached, unless ``same_prompt`` asks for the
cached case on purpose. While a level runs, the engine's own queue and KV-cache use are
read from its /metrics when it publishes them (``LoadReader``): the most seen at the last
level that held is what admission may treat as healthy for the model.

A root module: it knows no engine and no wire format beyond the OpenAI API; the command
line gives it the engines' metric names and the Prometheus parser.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import secrets
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

import httpx
import orjson

from llmgw.errors import LlmgwError

DEFAULT_TTFT_P99 = 2.0  # seconds: a person waits this long for the first word at worst
DEFAULT_TPOT_P99 = 0.1  # seconds per token: ten tokens a second, faster than anyone reads
DEFAULT_STEPS = (1, 2, 4, 8, 16, 32, 64, 128)
DEFAULT_REQUESTS_PER_STEP = 32
DEFAULT_MAX_TOKENS = 128
DEFAULT_TIMEOUT = 120.0  # seconds one request may take
SAMPLE_EVERY_S = 0.25  # how often the engine's /metrics is read while a level runs


class BenchError(LlmgwError):
    """A benchmark that cannot run as asked, or measured nothing; the message says why."""


@dataclass(frozen=True, slots=True)
class SLO:
    """The latency target, in seconds: the p99 of time to first token and of time per output token."""

    ttft_p99: float = DEFAULT_TTFT_P99
    tpot_p99: float = DEFAULT_TPOT_P99


def normalize_target(url: str) -> str:
    """The endpoint's base URL: no trailing slash, no trailing /v1 (requests add /v1/...)."""
    u = url.strip().rstrip("/")
    if not u.startswith(("http://", "https://")) or len(u.split("://", 1)[1]) == 0:
        raise BenchError(f"--target should be an http:// or https:// URL, such as a replica's endpoint; not {url!r}")
    if u.endswith("/v1"):
        u = u[: -len("/v1")]
    return u


def parse_steps(text: str) -> tuple[int, ...]:
    """'1,2,4,8' as concurrency levels: whole numbers above 0, rising."""
    try:
        steps = tuple(int(s) for s in text.replace(" ", "").split(",") if s)
    except ValueError:
        raise BenchError(f"--steps should be concurrency levels such as 1,2,4,8, not {text!r}") from None
    if not steps or any(s < 1 for s in steps) or any(b <= a for a, b in itertools.pairwise(steps)):
        raise BenchError(f"--steps should be rising whole numbers from 1 up, such as 1,2,4,8; not {text!r}")
    return steps


@dataclass(frozen=True, slots=True)
class BenchConfig:
    model: str
    target: str  # base URL, as normalize_target leaves it
    slo: SLO = field(default_factory=SLO)
    steps: tuple[int, ...] = DEFAULT_STEPS
    requests_per_step: int = DEFAULT_REQUESTS_PER_STEP
    max_tokens: int = DEFAULT_MAX_TOKENS
    same_prompt: bool = False
    key: str | None = None  # sent as Authorization: Bearer (a replica's engine key, or an API key)
    timeout: float = DEFAULT_TIMEOUT

    def __post_init__(self) -> None:
        if not self.model:
            raise BenchError("name the model to benchmark")
        if not (self.slo.ttft_p99 > 0 and self.slo.tpot_p99 > 0):
            raise BenchError("--ttft-p99 and --tpot-p99 should be longer than 0 seconds")
        if not self.steps or any(s < 1 for s in self.steps):
            raise BenchError("--steps should be whole numbers from 1 up")
        if self.requests_per_step < 1:
            raise BenchError("--requests-per-step should be 1 or more")
        if self.max_tokens < 2:
            raise BenchError("--max-tokens should be 2 or more: time per token needs two tokens")
        if self.timeout <= 0:
            raise BenchError("--timeout should be longer than 0 seconds")

    def requests_at(self, concurrency: int) -> int:
        """Requests sent at a level: requests_per_step, and at least two per client."""
        return max(self.requests_per_step, 2 * concurrency)


# -- prompts -------------------------------------------------------------------------------

_PASSAGE = (
    "The cooperative ran its first bakery out of a rented church kitchen for three winters before "
    "it could afford an oven of its own. Members took shifts: the early shift mixed and shaped the "
    "dough at four, the late shift baked and packed the orders for the cafés by seven. Nobody was "
    "paid for the first year; the money went into flour, a second-hand mixer and a van that started "
    "on the third try. In the second year the cafés asked for pastries as well as bread, and the "
    "members argued for a month about whether that was a distraction or the thing that would keep "
    "them alive. They tried it for a season. Pastries sold at twice the margin of bread but took "
    "three times the labour, and by spring the early shift was starting at two. "
)
_CODE = """def merge_intervals(intervals):
    intervals.sort()
    merged = []
    for start, end in intervals:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def free_slots(busy, day_start, day_end, length):
    slots = []
    cursor = day_start
    for start, end in merge_intervals(busy):
        if start - cursor >= length:
            slots.append((cursor, start))
        cursor = max(cursor, end)
    if day_end - cursor >= length:
        slots.append((cursor, day_end))
    return slots
"""
_LOG = (
    "2026-03-02T11:04:12Z worker-3 INFO  accepted job 8812 (resize, 412 images)\n"
    "2026-03-02T11:04:19Z worker-3 WARN  image 17 of 8812 has no EXIF orientation; assuming upright\n"
    "2026-03-02T11:05:02Z worker-3 ERROR write /data/out/8812/0231.webp: no space left on device\n"
    "2026-03-02T11:05:02Z worker-3 INFO  retrying job 8812 in 30s (attempt 2 of 5)\n"
    "2026-03-02T11:05:33Z worker-1 INFO  accepted job 8812 (resize, 412 images)\n"
    "2026-03-02T11:06:40Z worker-1 ERROR write /data/out/8812/0229.webp: no space left on device\n"
    "2026-03-02T11:06:41Z cleaner  INFO  removed 0 files older than 7d from /data/out\n"
)

PROMPTS: tuple[str, ...] = (
    "What is the difference between a process and a thread? Answer in two sentences.",
    "Suggest three names for a small neighbourhood bakery run as a cooperative.",
    "Translate into French: The meeting has been moved to Thursday afternoon; please bring last "
    "quarter's figures and the draft budget.",
    "Write a short, friendly email telling a customer that their order will arrive two days late, "
    "offering free delivery on their next order, and apologising without making excuses.",
    "Review this Python code. Point out any bug, say what the functions do, and suggest one "
    "improvement to the way free slots are found:\n\n" + _CODE,
    "Here are the last lines of a service's log. What went wrong, what will happen next if nobody "
    "acts, and what should the on-call engineer check first?\n\n" + _LOG,
    "Summarise the following account in five bullet points, then say in one sentence what the "
    "members should decide next:\n\n" + _PASSAGE * 3,
    "Explain to a new colleague how a hash map handles two keys that land in the same bucket, "
    "with a small example, and say when a tree would be the better choice.",
    "Read this text and list every decision the members made, with the reason given for each; "
    "then write a title for it:\n\n" + _PASSAGE * 6,
    "Give a packing list for a three-day hiking trip in the mountains in early autumn, grouped "
    "into clothing, food, shelter and safety.",
)


def prompt_for(i: int, run: str, *, same: bool) -> str:
    """The i-th request's prompt: cycling through the set, each with its own leading tag so no
    two requests share a cached prefix; with ``same``, one prompt for all (the cached case)."""
    if same:
        return PROMPTS[4]
    return f"[{run}-{i}] " + PROMPTS[i % len(PROMPTS)]


# -- measuring one request --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Sample:
    """One request: its latencies in seconds, its output tokens, or why it failed."""

    ttft: float | None = None
    tpot: float | None = None  # None: fewer than two tokens
    tokens: int = 0
    error: str | None = None


def _error_words(status: int, body: bytes) -> str:
    try:
        message = orjson.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode("utf-8", "replace").strip()[:200]
    return f"answered {status}: {message}" if message else f"answered {status}"


async def _lines(r: httpx.Response) -> AsyncIterator[bytes]:
    """The stream's lines as each arrives. (httpx's own line reader holds a chunk's last line
    back until the next chunk comes, which would add a token's time to every first token.)"""
    pending = b""
    async for chunk in r.aiter_bytes():
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r")
    if pending:
        yield pending


async def measure_one(client: httpx.AsyncClient, cfg: BenchConfig, prompt: str) -> Sample:
    """Send one streaming chat completion and time its tokens as they arrive."""
    body = {
        "model": cfg.model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": cfg.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"Authorization": f"Bearer {cfg.key}"} if cfg.key else {}
    first: float | None = None
    last = 0.0
    chunks = 0
    counted: int | None = None  # completion_tokens of the usage chunk
    t0 = time.perf_counter()
    try:
        async with client.stream(
            "POST", cfg.target + "/v1/chat/completions", content=orjson.dumps(body), headers=headers
        ) as r:
            if r.status_code != 200:
                return Sample(error=_error_words(r.status_code, (await r.aread())[:2000]))
            async for line in _lines(r):
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                try:
                    obj = orjson.loads(data)
                except orjson.JSONDecodeError:
                    continue
                if not isinstance(obj, dict):
                    continue
                if isinstance(obj.get("error"), dict):
                    return Sample(error=f"the stream ended in an error: {obj['error'].get('message')}")
                usage = obj.get("usage")
                if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                    counted = usage["completion_tokens"]
                for choice in obj.get("choices") or ():
                    delta = choice.get("delta") if isinstance(choice, dict) else None
                    if isinstance(delta, dict) and (delta.get("content") or delta.get("reasoning_content")):
                        last = time.perf_counter()
                        if first is None:
                            first = last
                        chunks += 1
    except httpx.TimeoutException:
        return Sample(error=f"no answer within {cfg.timeout:g}s")
    except httpx.HTTPError as exc:
        return Sample(error=f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
    if first is None:
        return Sample(error="the reply held no token")
    tokens = counted if counted else chunks
    tpot = (last - first) / (tokens - 1) if tokens > 1 else None
    return Sample(ttft=first - t0, tpot=tpot, tokens=tokens)


# -- the engine's own load --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LoadNames:
    """The series of an engine's /metrics that hold its queue and its KV-cache use."""

    waiting: tuple[str, ...]
    kv_usage: tuple[str, ...]


Parse = Callable[[str, set[str]], dict[str, float]]


class LoadReader:
    """Reads an engine's queue and KV-cache use from its /metrics while a level runs.

    ``engines`` maps an engine to its series; the engine is the one given, or found from the
    series the first scrape holds. An endpoint that publishes none of them (the gateway, an
    ``openai`` server) is read once and then left alone."""

    def __init__(
        self,
        url: str,
        engines: Mapping[str, LoadNames],
        parse: Parse,
        *,
        engine: str | None = None,
        key: str | None = None,
    ) -> None:
        if engine is not None and engine not in engines:
            raise BenchError(f"--engine should be one of {', '.join(sorted(engines))}, not {engine!r}")
        self.url = url
        self.engines = dict(engines)
        self.parse = parse
        self.engine = engine
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.gone: str | None = None  # why it stopped reading

    async def read(self, client: httpx.AsyncClient) -> tuple[float | None, float | None]:
        """(requests waiting in the engine, KV-cache use from 0 to 1); None for what is not known."""
        if self.gone is not None:
            return None, None
        try:
            r = await client.get(self.url, headers=self.headers, timeout=5.0)
        except httpx.HTTPError as exc:
            self.gone = f"{self.url}: {type(exc).__name__}"
            return None, None
        if r.status_code != 200:
            self.gone = f"{self.url} answered {r.status_code}"
            return None, None
        if self.engine is None:
            self.engine = next(
                (e for e, n in self.engines.items() if any(s in r.text for s in (*n.waiting, *n.kv_usage))), None
            )
            if self.engine is None:
                self.gone = f"{self.url} publishes no engine's queue or cache series"
                return None, None
        names = self.engines[self.engine]
        values = self.parse(r.text, {*names.waiting, *names.kv_usage})
        waiting = next((values[n] for n in names.waiting if n in values), None)
        kv = next((values[n] for n in names.kv_usage if n in values), None)
        if kv is not None and kv > 1.0:  # some engines publish percent
            kv /= 100.0
        return waiting, kv


# -- a level, and the ramp --------------------------------------------------------------------


def p99(values: list[float]) -> float | None:
    """The nearest-rank 99th percentile: below 100 values, the largest."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def latency_words(seconds: float | None) -> str:
    """120 ms, 2.5 s."""
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"


@dataclass(frozen=True, slots=True)
class Level:
    concurrency: int
    requests: int
    failed: int
    ttft_p99: float | None
    tpot_p99: float | None
    tokens_per_s: float
    seconds: float
    waiting_max: float | None  # the engine's own queue, the most seen; None: not published
    kv_max: float | None
    held: bool
    why: str | None = None  # why it did not hold
    first_error: str | None = None


def judge(samples: list[Sample], slo: SLO) -> tuple[bool, str | None]:
    """Whether a level held, and why not."""
    failed = [s for s in samples if s.error is not None]
    if failed:
        return False, f"{len(failed)} of {len(samples)} requests failed ({failed[0].error})"
    ttft = p99([s.ttft for s in samples if s.ttft is not None])
    tpot = p99([s.tpot for s in samples if s.tpot is not None])
    if ttft is not None and ttft > slo.ttft_p99:
        return False, f"TTFT p99 {latency_words(ttft)} is over the target {latency_words(slo.ttft_p99)}"
    if tpot is not None and tpot > slo.tpot_p99:
        return False, f"TPOT p99 {latency_words(tpot)} is over the target {latency_words(slo.tpot_p99)}"
    return True, None


class Observer(Protocol):
    """What a display is told while the ramp runs."""

    def level_started(self, concurrency: int, requests: int) -> None: ...

    def request_done(self, concurrency: int, done: int, requests: int) -> None: ...

    def level_done(self, level: Level) -> None: ...


class _Quiet:
    def level_started(self, concurrency: int, requests: int) -> None:
        pass

    def request_done(self, concurrency: int, done: int, requests: int) -> None:
        pass

    def level_done(self, level: Level) -> None:
        pass


async def run_level(
    client: httpx.AsyncClient,
    cfg: BenchConfig,
    concurrency: int,
    *,
    run: str,
    first_index: int = 0,
    observer: Observer | None = None,
    load: LoadReader | None = None,
) -> Level:
    """One level: ``concurrency`` clients sending back to back until its requests are done."""
    obs = observer or _Quiet()
    n = cfg.requests_at(concurrency)
    samples: list[Sample] = []
    issued = 0
    seen_waiting: list[float] = []
    seen_kv: list[float] = []

    async def client_loop() -> None:
        nonlocal issued
        while issued < n:
            i = first_index + issued
            issued += 1
            samples.append(await measure_one(client, cfg, prompt_for(i, run, same=cfg.same_prompt)))
            obs.request_done(concurrency, len(samples), n)

    async def sampling(reader: LoadReader) -> None:
        while True:
            await asyncio.sleep(SAMPLE_EVERY_S)  # not at once: the level's requests are only just sent
            waiting, kv = await reader.read(client)
            if waiting is not None:
                seen_waiting.append(waiting)
            if kv is not None:
                seen_kv.append(kv)
            if reader.gone is not None:
                return

    obs.level_started(concurrency, n)
    sampler = asyncio.create_task(sampling(load)) if load is not None else None
    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    finally:
        if sampler is not None:
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
    seconds = time.perf_counter() - t0
    held, why = judge(samples, cfg.slo)
    ok = [s for s in samples if s.error is None]
    level = Level(
        concurrency=concurrency,
        requests=len(samples),
        failed=len(samples) - len(ok),
        ttft_p99=p99([s.ttft for s in ok if s.ttft is not None]),
        tpot_p99=p99([s.tpot for s in ok if s.tpot is not None]),
        tokens_per_s=sum(s.tokens for s in ok) / seconds if seconds > 0 else 0.0,
        seconds=seconds,
        waiting_max=max(seen_waiting) if seen_waiting else None,
        kv_max=max(seen_kv) if seen_kv else None,
        held=held,
        why=why,
        first_error=next((s.error for s in samples if s.error is not None), None),
    )
    obs.level_done(level)
    return level


@dataclass(frozen=True, slots=True)
class BenchResult:
    model: str
    target: str
    slo: SLO
    levels: tuple[Level, ...]
    ran_at: datetime  # when the run started

    @property
    def held(self) -> Level | None:
        """The last level that held before the first that did not."""
        last = None
        for level in self.levels:
            if not level.held:
                break
            last = level
        return last

    @property
    def concurrency(self) -> int:
        """The capacity: the most requests at once that met the target; 0 when none did."""
        held = self.held
        return held.concurrency if held is not None else 0

    @property
    def weight(self) -> int | None:
        """The `weight` to put in the profile: its concurrency at the target (None: nothing held)."""
        return self.concurrency or None

    @property
    def broke(self) -> Level | None:
        return next((level for level in self.levels if not level.held), None)

    @property
    def suggested_waiting(self) -> int | None:
        held = self.held
        return None if held is None or held.waiting_max is None else math.ceil(held.waiting_max)

    @property
    def suggested_kv(self) -> float | None:
        held = self.held
        return None if held is None or held.kv_max is None else min(1.0, math.ceil(held.kv_max * 100) / 100)

    def to_json(self) -> dict[str, Any]:
        held = self.held
        return {
            "model": self.model,
            "target": self.target,
            "slo": {"ttft_p99": self.slo.ttft_p99, "tpot_p99": self.slo.tpot_p99},
            "ran_at": self.ran_at.isoformat(),
            "levels": [
                {
                    "concurrency": lv.concurrency,
                    "requests": lv.requests,
                    "failed": lv.failed,
                    "ttft_p99": lv.ttft_p99,
                    "tpot_p99": lv.tpot_p99,
                    "tokens_per_s": round(lv.tokens_per_s, 2),
                    "seconds": round(lv.seconds, 3),
                    "waiting_max": lv.waiting_max,
                    "kv_max": lv.kv_max,
                    "held": lv.held,
                    "why": lv.why,
                }
                for lv in self.levels
            ],
            "max_concurrency_at_slo": self.concurrency,
            "throughput_tok_per_sec": round(held.tokens_per_s, 2) if held else 0.0,
            "ttft_p99": held.ttft_p99 if held else None,
            "tpot_p99": held.tpot_p99 if held else None,
            "suggested_target_waiting": self.suggested_waiting,
            "suggested_kv_ceiling": self.suggested_kv,
            "weight": self.weight,
        }


async def run_bench(
    cfg: BenchConfig,
    *,
    observer: Observer | None = None,
    load: LoadReader | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> BenchResult:
    """Ramp through ``cfg.steps`` until a level does not hold, after one request that is not
    counted. Raises BenchError when nothing was measured: that request, or the first level,
    failed (a wrong key, a wrong model, nothing there)."""
    ran_at = datetime.now(UTC)
    run = secrets.token_hex(3)
    limits = httpx.Limits(max_connections=max(cfg.steps) + 2, max_keepalive_connections=max(cfg.steps) + 2)
    timeout = httpx.Timeout(cfg.timeout, connect=min(cfg.timeout, 10.0))
    levels: list[Level] = []
    sent = 0
    # trust_env off: an endpoint of the fleet is reached directly, never through a proxy.
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False, transport=transport) as client:
        # One request first, not counted: it opens a connection and wakes the engine (neither is
        # what a level measures), and a wrong key, model or address is said before any ramp.
        warm = await measure_one(client, cfg, prompt_for(0, run + "-warm", same=cfg.same_prompt))
        if warm.error is not None:
            raise BenchError(f"the first request to {cfg.target} failed, so nothing was measured: {warm.error}")
        for c in cfg.steps:
            level = await run_level(client, cfg, c, run=run, first_index=sent, observer=observer, load=load)
            sent += level.requests
            levels.append(level)
            if not level.held:
                break
    result = BenchResult(cfg.model, cfg.target, cfg.slo, tuple(levels), ran_at)
    first = levels[0]
    if result.held is None and first.failed:
        raise BenchError(
            f"{first.failed} of {first.requests} requests to {cfg.target} failed at concurrency "
            f"{first.concurrency}, so nothing was measured; the first: {first.first_error}"
        )
    return result
