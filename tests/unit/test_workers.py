"""Workers: the setting, the channel between the server process and a worker, what travels on it."""

from __future__ import annotations

import asyncio
import socket

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram

from llmgw.config.loading import ConfigError
from llmgw.config.server import MAX_AUTO_WORKERS, parse_server_config, resolve_workers
from llmgw.server.gateway.admission import pool_capacity
from llmgw.server.gateway.endpoints import Endpoint, EndpointSet
from llmgw.server.workers import (
    Channel,
    WorkerError,
    add_snapshot,
    apply_endpoints,
    endpoint_rows,
    journal_path,
    leftover_journals,
    merge_families,
    parse_worker_arg,
    snapshot,
)


@pytest.mark.parametrize("bad", [0, -1, 65, "many", True, 2.5, None])
def test_a_workers_setting_that_is_not_a_count_or_auto_is_refused_saying_what_is_accepted(bad):
    with pytest.raises(ConfigError) as e:
        parse_server_config({"workers": bad})
    assert "workers" in str(e.value) and "auto" in str(e.value) and "1 to 64" in str(e.value)


def test_auto_workers_are_the_cores_this_process_may_use_capped():
    assert parse_server_config({}).workers == "auto"
    assert resolve_workers("auto", cores=2) == 2
    assert resolve_workers("auto", cores=96) == MAX_AUTO_WORKERS
    assert resolve_workers(3, cores=96) == 3


def test_workers_are_allowed_with_shared_limits_off_since_they_share_the_server_process_accountant():
    cfg = parse_server_config({"workers": 2, "auth": {"shared_limits": False}})
    assert cfg.workers == 2
    assert resolve_workers(parse_server_config({"auth": {"shared_limits": False}}).workers, cores=8) == 8


def test_the_worker_argument_is_checked():
    assert parse_worker_arg("1:7:2:8") == (1, 7, 2, 8)
    for bad in ("1:7", "1:7:2", "0:7:2:8", "2:7:2:8", "1:7:2:-1", "x:y:z:w"):
        with pytest.raises(WorkerError, match="--worker"):
            parse_worker_arg(bad)


def test_every_worker_slot_has_its_own_journal_and_slots_no_longer_run_are_found(tmp_path):
    paths = {journal_path(str(tmp_path), i) for i in range(4)}
    assert len(paths) == 4
    for i in range(4):
        journal_path(str(tmp_path), i).write_text("")
    assert leftover_journals(str(tmp_path), 2) == [journal_path(str(tmp_path), 2), journal_path(str(tmp_path), 3)]


async def test_the_channel_carries_json_lines_both_ways_and_says_when_the_other_side_is_gone():
    a, b = socket.socketpair()
    left, right = await Channel.open(a), await Channel.open(b)
    big = {"endpoints": [["m", f"http://e{i}", "vllm", None, None, None, 1.0, True] for i in range(5000)]}
    left.send(big)
    left.send({"touch": "m"})
    assert await right.receive() == big
    assert await right.receive() == {"touch": "m"}
    right.send({"metrics": []})
    assert await left.receive() == {"metrics": []}
    await left.close()
    assert await asyncio.wait_for(right.receive(), 5) is None
    await right.close()


def _set(*eps: Endpoint) -> EndpointSet:
    return EndpointSet(list(eps), 1.0, 10.0, 1.0)


def test_a_worker_takes_the_server_processs_endpoints_keeping_its_own_state_of_those_it_has():
    main = _set(Endpoint("m", "http://a", "vllm", "up"), Endpoint("m", "http://b", "vllm", "up"))
    main.endpoints[0].capacity, main.endpoints[0].healthy = 8, True
    worker = _set(Endpoint("m", "http://a", "vllm", "up"), Endpoint("m", "http://gone", "vllm", "up"))
    kept = worker.endpoints[0]
    kept.inflight = 3
    apply_endpoints(worker, endpoint_rows(main), (3, 10.0))
    assert [ep.url for ep in worker.endpoints] == ["http://a", "http://b"]
    assert worker.endpoints[0] is kept and kept.inflight == 3 and kept.capacity == 8
    assert [ep.url for ep in worker.by_model["m"]] == ["http://a", "http://b"]
    # Routable at once when the server process saw it ready: a worker must not wait for its own probe.
    fresh = Endpoint("m", "http://c", "vllm", "up")
    fresh.healthy = True
    main.add(fresh)
    apply_endpoints(worker, endpoint_rows(main), (3, 10.0))
    assert worker.by_model["m"][-1].healthy and worker.choose("m", exclude=(kept,)) is worker.by_model["m"][-1]


def test_each_worker_admits_against_its_share_of_a_measured_capacity_rounded_up():
    eps = _set(Endpoint("m", "http://a", "openai", None), Endpoint("m", "http://b", "openai", None))
    for ep in eps.endpoints:
        ep.capacity, ep.healthy = 10, True
    assert pool_capacity(eps, "m", 4.0) == 20
    eps.workers = 3
    assert pool_capacity(eps, "m", 4.0) == 8  # ceil(10 / 3) each


def test_the_server_processs_metrics_add_every_workers_counters_and_histograms():
    def registry(n: int) -> CollectorRegistry:
        reg = CollectorRegistry()
        c = Counter("llmgw_requests", "r", ["status"], registry=reg)
        h = Histogram("llmgw_request_duration_seconds", "d", buckets=(1.0,), registry=reg)
        for _ in range(n):
            c.labels("200").inc()
            h.observe(0.5)
        return reg

    own, one, two = registry(2), registry(3), registry(5)
    only_worker = Counter("llmgw_upstream_retries", "x", registry=two)
    only_worker.inc(4)
    totals: dict = {}
    add_snapshot(totals, snapshot(one))
    add_snapshot(totals, snapshot(two))
    merged = {f.name: f for f in merge_families(own.collect(), totals)}
    value = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in merged.values() for s in f.samples}
    assert value[("llmgw_requests_total", (("status", "200"),))] == 10
    assert value[("llmgw_request_duration_seconds_count", ())] == 10
    assert value[("llmgw_request_duration_seconds_bucket", (("le", "1.0"),))] == 10
    assert value[("llmgw_upstream_retries_total", ())] == 4
