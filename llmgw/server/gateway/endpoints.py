"""Engine endpoints: their load as each engine reports it, their health, and the breaker.

Load comes from two places: what the gateway itself has in flight to an endpoint
(exact, current) and what the engine publishes on its own /metrics (includes
traffic from elsewhere, but is up to one scrape interval old). The scraper
keeps the second current in the background, so choosing an endpoint never
waits on the network.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from llmgw.files import read_secret_file
from llmgw.protocol.prometheus import parse_prometheus
from llmgw.server.gateway.routing import PrefixLRU, Router, weighted

log = logging.getLogger("llmgw.gateway.endpoints")


@dataclass(frozen=True, slots=True)
class MetricNames:
    """Which series of an engine's /metrics mean waiting, running and KV-cache use."""

    waiting: tuple[str, ...]
    running: tuple[str, ...]
    kv_usage: tuple[str, ...]
    health_path: str = "/health"


# Each tuple lists the names an engine has used across versions, newest first;
# the first one present in a scrape wins.
ENGINE_METRICS: dict[str, MetricNames | None] = {
    "llamacpp": MetricNames(
        waiting=("llamacpp:requests_deferred",),
        running=("llamacpp:requests_processing",),
        kv_usage=("llamacpp:kv_cache_usage_ratio",),
    ),
    "vllm": MetricNames(
        waiting=("vllm:num_requests_waiting",),
        running=("vllm:num_requests_running",),
        kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    ),
    "sglang": MetricNames(
        waiting=("sglang:num_queue_reqs",),
        running=("sglang:num_running_reqs",),
        kv_usage=("sglang:token_usage",),
    ),
    # A generic OpenAI-compatible server publishes nothing llmgw can read.
    "openai": None,
}


def read_endpoint_key(ref: str | None) -> str | None:
    """The key an operator's own engine requires, from the file its api_key names (@/path).

    Raises SecretFileError, whose message names the file and never what it holds."""
    return None if ref is None else read_secret_file(ref[1:])


_REFUSED = (401, 403)
_KEY_REFUSED = (
    "; the engine wants a key llmgw does not send, or refuses the one it sends "
    "(an engine of server.yaml takes it from its endpoint's api_key)"
)


def _first(values: dict[str, float], names: tuple[str, ...]) -> float | None:
    for n in names:
        if n in values:
            return values[n]
    return None


class Endpoint:
    """One engine serving one model, and everything the router knows about it."""

    __slots__ = (
        "_api_key",
        "_breaker_cooldown",
        "_breaker_failures",
        "alive_at",
        "auth_headers",
        "capacity",
        "cooldown",
        "engine",
        "failures",
        "health_detail",
        "healthy",
        "inflight",
        "inflight_at_scrape",
        "kv_usage",
        "model",
        "names",
        "open_until",
        "post_headers",
        "prefixes",
        "queues_seen",
        "running",
        "scraped_at",
        "slots_seen",
        "trial_inflight",
        "upstream_model",
        "url",
        "waiting",
        "weight",
    )

    def __init__(
        self,
        model: str,
        url: str,
        engine: str,
        upstream_model: str | None,
        breaker_failures: int = 3,
        breaker_cooldown: float = 10.0,
        *,
        api_key: str | None = None,
    ) -> None:
        self.model = model
        self.url = url
        self.engine = engine
        self.upstream_model = upstream_model
        self.names = ENGINE_METRICS.get(engine)
        self.inflight = 0
        self.waiting: float | None = None
        self.running: float | None = None
        self.kv_usage: float | None = None
        self.scraped_at = 0.0
        # When the last probe that succeeded was sent: an engine that answers its probes is
        # alive, however long a request of its takes (the first-byte timeout asks this).
        self.alive_at = 0.0
        # The most requests the engine was seen running at once: what it can run before
        # requests queue inside it (admission counts the gateway's own in-flight beyond it).
        self.slots_seen = 0.0
        # The gateway's own in-flight count when the last scrape arrived: what it sent since
        # is what the engine's numbers do not show yet.
        self.inflight_at_scrape = 0
        # Whether the engine was ever seen queueing: one that was has a fixed number of slots,
        # and every request beyond them waits.
        self.queues_seen = False
        self.healthy = False
        self.health_detail = "not checked yet"
        self.failures = 0
        self.open_until = 0.0
        self.cooldown = breaker_cooldown
        self.trial_inflight = False
        self._breaker_failures = breaker_failures
        self._breaker_cooldown = breaker_cooldown
        # Block hashes of prompts sent here recently (prefix routing; made on first use).
        self.prefixes: PrefixLRU | None = None
        self.api_key = api_key
        # Set from the measured capacity of its replica's profile (`ctl bench --save`, see
        # control/capacity.py): the requests in flight at which admission counts it full (None:
        # not measured), and its share against the model's other endpoints in routing.
        self.capacity: int | None = None
        self.weight = 1.0

    @property
    def api_key(self) -> str | None:
        """The engine's own key (its replica's secret, or the operator's for an engine of
        server.yaml), sent on every request, scrape and health check; never shown."""
        return self._api_key

    @api_key.setter
    def api_key(self, key: str | None) -> None:
        self._api_key = key
        # Built once, not per request: the proxy and the scraper pass these as they are.
        self.auth_headers: dict[str, str] | None = {"Authorization": f"Bearer {key}"} if key else None
        self.post_headers: dict[str, str] = {"Content-Type": "application/json", **(self.auth_headers or {})}

    # The breaker: closed while failures < threshold; open (no traffic) until
    # open_until; then half-open, letting a single trial request through.
    @property
    def breaker_open(self) -> bool:
        return self.failures >= self._breaker_failures

    def available(self, now: float) -> bool:
        if not self.healthy:
            return False
        if self.failures < self._breaker_failures:
            return True
        return now >= self.open_until and not self.trial_inflight

    def record_success(self) -> None:
        if self.failures:
            if self.failures >= self._breaker_failures:
                log.info("endpoint %s (%s) answers again; breaker closed", self.url, self.model)
            self.failures = 0
            self.cooldown = self._breaker_cooldown
        self.trial_inflight = False

    def record_failure(self, why: str) -> None:
        self.trial_inflight = False
        self.failures += 1
        if self.failures >= self._breaker_failures:
            now = time.monotonic()
            if now >= self.open_until:
                if self.failures > self._breaker_failures:
                    # A failed trial: wait longer before the next one, up to a minute.
                    self.cooldown = min(self.cooldown * 2, 60.0)
                self.open_until = now + self.cooldown
                log.warning(
                    "endpoint %s (%s) taken out for %.0fs after %d failures: %s",
                    self.url,
                    self.model,
                    self.cooldown,
                    self.failures,
                    why,
                )

    def load(self, now: float, stale_after: float) -> float:
        """Requests ahead of a new one here; KV use breaks ties."""
        busy = float(self.inflight)
        if self.scraped_at and now - self.scraped_at <= stale_after:
            engine_busy = (self.running or 0.0) + (self.waiting or 0.0)
            if engine_busy > busy:
                busy = engine_busy
            return busy + (self.kv_usage or 0.0)
        return busy

    def metrics_stale(self, now: float, stale_after: float) -> bool:
        return self.names is not None and (not self.scraped_at or now - self.scraped_at > stale_after)

    def apply_scrape(self, text: str, now: float) -> None:
        names = self.names
        if names is None:
            return
        values = parse_prometheus(text, {*names.waiting, *names.running, *names.kv_usage})
        self.waiting = _first(values, names.waiting)
        self.running = _first(values, names.running)
        if self.running is not None and self.running > self.slots_seen:
            self.slots_seen = self.running
        self.inflight_at_scrape = self.inflight
        if self.waiting:
            self.queues_seen = True
        kv = _first(values, names.kv_usage)
        # Some engines report percent, the rest a ratio; the router works in ratios.
        self.kv_usage = kv / 100.0 if kv is not None and kv > 1.0 else kv
        self.scraped_at = now


class EndpointSet:
    """All endpoints of all models, and the background work that keeps them current."""

    def __init__(
        self, endpoints: list[Endpoint], scrape_interval: float, stale_after: float, connect_timeout: float
    ) -> None:
        self.endpoints = endpoints
        self.by_model: dict[str, list[Endpoint]] = {}
        for ep in endpoints:
            self.by_model.setdefault(ep.model, []).append(ep)
        self.scrape_interval = scrape_interval
        self.stale_after = stale_after
        self._connect_timeout = connect_timeout
        self._watchers: dict[Endpoint, asyncio.Task] = {}
        self._session: aiohttp.ClientSession | None = None
        # How to choose among a model's endpoints (routing.py); the gateway configures it.
        self.router = Router()
        # Processes serving the client API (server.yaml's workers): each admits against its
        # share of an engine's capacity (admission.py). Told of every add and remove: on_change.
        self.workers = 1
        self.on_change: list[Callable[[], None]] = []

    def choose(self, model: str, exclude: tuple[Endpoint, ...] = (), blocks: tuple[int, ...] = ()) -> Endpoint | None:
        """An available endpoint of a model, not in ``exclude``, as the model's routing
        strategy picks it (``blocks``: the request's prompt block hashes, for prefix
        routing). Without blocks, prefix routing is least loaded, ties at random."""
        now = time.monotonic()
        stale = self.stale_after
        best = self.router.choose(
            model,
            weighted(
                [
                    (ep, ep.load(now, stale))
                    for ep in self.by_model.get(model, ())
                    if ep not in exclude and ep.available(now)
                ]
            ),
            blocks,
        )
        if best is not None and best.failures:
            best.trial_inflight = True
        return best

    def add(self, ep: Endpoint) -> None:
        """Publish an endpoint (a replica the control plane saw become ready); it is
        watched like a configured one from now on."""
        if ep in self.endpoints:
            return
        self.endpoints.append(ep)
        self.by_model.setdefault(ep.model, []).append(ep)
        if self._session is not None:
            self._watchers[ep] = asyncio.create_task(self._watch(ep), name=f"scrape {ep.url}")
        for f in self.on_change:
            f()

    def remove(self, ep: Endpoint) -> None:
        """Stop routing new requests to ``ep``; requests already there finish."""
        if ep not in self.endpoints:
            return
        self.endpoints.remove(ep)
        peers = self.by_model.get(ep.model, [])
        if ep in peers:
            peers.remove(ep)
        if not peers:
            self.by_model.pop(ep.model, None)
        task = self._watchers.pop(ep, None)
        if task is not None:
            task.cancel()
        for f in self.on_change:
            f()

    def any_ready(self) -> bool:
        now = time.monotonic()
        return any(ep.available(now) for ep in self.endpoints)

    def model_ready(self, model: str) -> bool:
        now = time.monotonic()
        return any(ep.available(now) for ep in self.by_model.get(model, ()))

    async def start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=max(2.0, self.scrape_interval * 2), sock_connect=self._connect_timeout)
        self._session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))
        # One probe round before serving, so /ready is right from the first request.
        await asyncio.gather(*(self._probe(ep) for ep in self.endpoints))
        self._watchers = {ep: asyncio.create_task(self._watch(ep), name=f"scrape {ep.url}") for ep in self.endpoints}

    async def stop(self) -> None:
        tasks = list(self._watchers.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._watchers = {}
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _watch(self, ep: Endpoint) -> None:
        # Jitter keeps many endpoints from being scraped in lockstep.
        await asyncio.sleep(random.random() * self.scrape_interval)
        while True:
            await self._probe(ep)
            await asyncio.sleep(self.scrape_interval)

    async def _probe(self, ep: Endpoint) -> None:
        assert self._session is not None
        was = ep.healthy
        sent = time.monotonic()
        try:
            if ep.names is None:
                # Any OpenAI-compatible server lists its models; answering at all
                # (even 401 for a server that wants a key llmgw was not given) means
                # it is up. Refusing the key it was given means every request fails.
                async with self._session.get(ep.url + "/v1/models", headers=ep.auth_headers) as r:
                    await r.read()
                    ok, detail = r.status < 500, f"GET /v1/models answered {r.status}"
                    if ep.api_key and r.status in _REFUSED:
                        ok, detail = False, detail + _KEY_REFUSED
            else:
                # llama-server leaves /health open and wants the key for /metrics; both get it.
                async with self._session.get(ep.url + ep.names.health_path, headers=ep.auth_headers) as r:
                    await r.read()
                    ok, detail = r.status == 200, f"GET {ep.names.health_path} answered {r.status}"
                if ok:
                    async with self._session.get(ep.url + "/metrics", headers=ep.auth_headers) as r:
                        text = await r.text()
                        if r.status == 200:
                            ep.apply_scrape(text, time.monotonic())
                        elif r.status in _REFUSED:
                            # It would refuse every request too (llama-server guards both alike).
                            ok, detail = False, f"GET /metrics answered {r.status}" + _KEY_REFUSED
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            ok, detail = False, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a scrape must never kill the watcher
            log.exception("probing %s failed unexpectedly", ep.url)
            ok, detail = False, repr(exc)
        ep.healthy = ok
        if ok:
            ep.alive_at = sent
        ep.health_detail = "ok" if ok else detail
        if ok != was:
            if ok:
                log.info("endpoint %s (%s) is ready", ep.url, ep.model)
            else:
                log.warning("endpoint %s (%s) is not ready: %s", ep.url, ep.model, detail)
