"""Prometheus metrics of the gateway, all prefixed llmgw_.

Per-request metrics are updated through cached label children (a dict lookup
instead of prometheus-client's label resolution on every request); endpoint
gauges are computed when Prometheus scrapes, so they cost nothing per request.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from llmgw.server.gateway.admission import Admission
    from llmgw.server.gateway.endpoints import EndpointSet
    from llmgw.server.gateway.usage import UsageRecorder

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120)
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter(
            "llmgw_requests",
            "Requests through the gateway, by model and HTTP status.",
            ["model", "route", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "llmgw_request_duration_seconds",
            "Whole request time as the client sees it, by model.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.ttft = Histogram(
            "llmgw_ttft_seconds",
            "Time to first token as the gateway sees it, by model (streamed requests).",
            ["model"],
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.overhead = Histogram(
            "llmgw_gateway_overhead_seconds",
            "The gateway's own time per request (the Server-Timing value).",
            buckets=OVERHEAD_BUCKETS,
            registry=self.registry,
        )
        self.tokens = Counter(
            "llmgw_tokens",
            "Tokens served, by model and direction (prompt or completion).",
            ["model", "direction"],
            registry=self.registry,
        )
        self.retries = Counter(
            "llmgw_upstream_retries",
            "Requests sent to another endpoint after one failed before the first byte.",
            ["model"],
            registry=self.registry,
        )
        self._requests: dict[tuple[str, str, int], Callable[[], None]] = {}
        self._latency: dict[str, Callable[[float], None]] = {}
        self._ttft: dict[str, Callable[[float], None]] = {}
        self._tokens: dict[tuple[str, str], Callable[[float], None]] = {}
        self.merged: Collector | None = None

    def count_request(self, model: str, route: str, status: int) -> None:
        key = (model, route, status)
        inc = self._requests.get(key)
        if inc is None:
            inc = self._requests[key] = self.requests.labels(model, route, str(status)).inc
        inc()

    def observe_latency(self, model: str, seconds: float) -> None:
        obs = self._latency.get(model)
        if obs is None:
            obs = self._latency[model] = self.latency.labels(model).observe
        obs(seconds)

    def observe_ttft(self, model: str, seconds: float) -> None:
        obs = self._ttft.get(model)
        if obs is None:
            obs = self._ttft[model] = self.ttft.labels(model).observe
        obs(seconds)

    def count_tokens(self, model: str, prompt: int, completion: int) -> None:
        for direction, n in (("prompt", prompt), ("completion", completion)):
            if n:
                key = (model, direction)
                inc = self._tokens.get(key)
                if inc is None:
                    inc = self._tokens[key] = self.tokens.labels(model, direction).inc
                inc(n)

    def watch(self, endpoints: EndpointSet, usage: UsageRecorder | None) -> None:
        self.registry.register(_StateCollector(endpoints, usage))

    def watch_fleet(self, collector: Collector) -> None:
        """Export the fleet (nodes, GPUs, replicas) from ``collector``, a
        ``llmgw.server.control.fleet_metrics.FleetCollector``, read at scrape time."""
        self.registry.register(collector)

    def watch_admission(self, admission: Admission, models: Callable[[], list[str]]) -> None:
        """Export admission's queues, pool saturation and refusals, read at scrape time."""
        self.registry.register(_AdmissionCollector(admission, models))

    def render(self) -> bytes:
        # With workers, the registry with every worker's counters added (server/workers.py).
        return generate_latest(self.merged or self.registry)  # type: ignore[arg-type]


class _StateCollector:
    """Endpoint and queue state, read at scrape time."""

    def __init__(self, endpoints: EndpointSet, usage: UsageRecorder | None) -> None:
        self._endpoints = endpoints
        self._usage = usage

    def collect(self) -> Iterable[Metric]:
        now = time.monotonic()
        eps = self._endpoints
        labels = ["model", "replica", "engine"]
        families = {
            "waiting": GaugeMetricFamily(
                "llmgw_endpoint_waiting",
                "Requests the engine has accepted but not started, as it reports them.",
                labels=labels,
            ),
            "running": GaugeMetricFamily(
                "llmgw_endpoint_running", "Requests the engine is working on, as it reports them.", labels=labels
            ),
            "kv": GaugeMetricFamily(
                "llmgw_endpoint_kv_cache_usage", "KV cache occupancy (0-1), as the engine reports it.", labels=labels
            ),
            "inflight": GaugeMetricFamily(
                "llmgw_endpoint_inflight", "Requests this gateway has in flight to the endpoint.", labels=labels
            ),
            "healthy": GaugeMetricFamily(
                "llmgw_endpoint_healthy", "1 when the endpoint's health check passes.", labels=labels
            ),
            "breaker": GaugeMetricFamily(
                "llmgw_endpoint_breaker_open",
                "1 when the router stopped sending to this endpoint after repeated failures.",
                labels=labels,
            ),
            "stale": GaugeMetricFamily(
                "llmgw_endpoint_metrics_stale",
                "1 when its scraped numbers are old, so the router is choosing with stale numbers.",
                labels=labels,
            ),
        }
        ready: dict[str, int] = {}
        for ep in eps.endpoints:
            lv = [ep.model, ep.url, ep.engine]
            stale = ep.metrics_stale(now, eps.stale_after)
            # Absent stays absent: a number the engine does not report is not a zero.
            if not stale:
                if ep.waiting is not None:
                    families["waiting"].add_metric(lv, ep.waiting)
                if ep.running is not None:
                    families["running"].add_metric(lv, ep.running)
                if ep.kv_usage is not None:
                    families["kv"].add_metric(lv, ep.kv_usage)
            families["inflight"].add_metric(lv, ep.inflight)
            families["healthy"].add_metric(lv, 1.0 if ep.healthy else 0.0)
            families["breaker"].add_metric(lv, 1.0 if ep.breaker_open else 0.0)
            if ep.names is not None:
                families["stale"].add_metric(lv, 1.0 if stale else 0.0)
            ready[ep.model] = ready.get(ep.model, 0) + (1 if ep.available(now) else 0)
        yield from families.values()
        replicas = GaugeMetricFamily(
            "llmgw_model_endpoints_ready", "Endpoints of a model that can take a request now.", labels=["model"]
        )
        for model, n in ready.items():
            replicas.add_metric([model], n)
        yield replicas
        if self._usage is not None:
            yield GaugeMetricFamily(
                "llmgw_usage_pending", "Usage rows waiting to be written to the store.", value=self._usage.pending
            )
            yield CounterMetricFamily(
                "llmgw_usage_dropped",
                "Usage rows lost: the queue was full while the store did not keep up, or at shutdown the usage journal could not be written, or a journal line was damaged.",
                value=self._usage.dropped,
            )


class _AdmissionCollector:
    def __init__(self, admission: Admission, models: Callable[[], list[str]]) -> None:
        self._admission = admission
        self._models = models

    def collect(self) -> Iterable[Metric]:
        st = self._admission.stats(self._models())
        depth = GaugeMetricFamily(
            "llmgw_admission_queue_depth", "Requests waiting for admission, by model.", labels=["model"]
        )
        for model, n in sorted(st.queue_depth.items()):
            depth.add_metric([model], n)
        sat = GaugeMetricFamily(
            "llmgw_pool_saturation",
            "The worst of queue depth and KV-cache use against healthy levels and requests in flight against "
            "measured capacity; 1 is the healthy limit.",
            labels=["model"],
        )
        for model, v in sorted(st.saturation.items()):
            sat.add_metric([model], v)
        rejected = CounterMetricFamily(
            "llmgw_admission_rejected", "Requests turned away by admission, by band.", labels=["band"]
        )
        for band, n in sorted(st.rejected.items()):
            rejected.add_metric([band], n)
        return [depth, sat, rejected]
