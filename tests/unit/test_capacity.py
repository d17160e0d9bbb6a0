"""Measured capacity put to use: admission counts a pool at its measured concurrency as
saturated, routing weighs replicas by it, explain-placement says it, and the admin API and
`ctl bench --save` / `ctl capacity` keep and show it, against an in-process control plane
whose one replica is the fake engine (adopted as an agent would describe it)."""

from __future__ import annotations

import asyncio
import json
import re
import time
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from typer.testing import CliRunner

from llmgw.cli.main import app as cli
from llmgw.config import parse_server_config
from llmgw.config.server import AdmissionConfig, ModelConfig
from llmgw.protocol import (
    PROTOCOL_VERSION,
    EngineProfile,
    MemoryInfo,
    NodeInventory,
    Register,
    RunningShard,
    ShardState,
    StartShard,
)
from llmgw.server.app import Server
from llmgw.server.control.capacity import Capacities
from llmgw.server.control.catalog import Catalog
from llmgw.server.control.reconciler import Replica
from llmgw.server.gateway.admission import Admission, pool_capacity, pool_saturation
from llmgw.server.gateway.endpoints import Endpoint, EndpointSet
from llmgw.server.gateway.routing import weighted
from llmgw.store import MeasuredCapacity, Store
from llmgw.testing.admin import admin_headers
from llmgw.testing.fake_engine import FakeEngine
from llmgw.testing.ports import free_port
from llmgw.testing.waiting import async_until

NOTHING = "Nothing has been measured. Run `llmgw ctl bench <model> --target <replica> --save`.\n"
TINY = {
    "name": "tiny",
    "aliases": ["small"],
    "source": "http://127.0.0.1:9/tiny.gguf",
    "scaling": {"min": 0},
    "profiles": [{"engine": "llamacpp"}, {"name": "heavy", "engine": "llamacpp", "weight": 3}],
}


def endpoint(url: str, engine: str = "openai", *, capacity: int | None = None, inflight: int = 0) -> Endpoint:
    ep = Endpoint("m", url, engine, None)
    ep.healthy = True
    ep.capacity, ep.inflight = capacity, inflight
    return ep


def pool(*eps: Endpoint) -> EndpointSet:
    return EndpointSet(list(eps), scrape_interval=1.0, stale_after=10.0, connect_timeout=1.0)


# -- admission and routing --------------------------------------------------------------------


def test_a_pool_at_its_measured_concurrency_reads_saturated_and_its_capacity_is_the_sum_measured():
    a, b = endpoint("http://a", capacity=2), endpoint("http://b", capacity=4)
    s = pool(a, b)
    # Engines that publish nothing (openai) were left out of saturation; measured, they count.
    assert pool_saturation(s, "m", 8, 0.9) == 0.0 and pool_capacity(s, "m", 8) == 6
    a.inflight, b.inflight = 1, 2
    assert pool_saturation(s, "m", 8, 0.9) == pytest.approx(3 / 6)
    a.inflight, b.inflight = 2, 4
    assert pool_saturation(s, "m", 8, 0.9) == pytest.approx(1.0)  # at it: saturated
    b.inflight = 7
    assert pool_saturation(s, "m", 8, 0.9) > 1.0
    # An endpoint that is down takes its capacity with it.
    b.healthy = False
    assert pool_saturation(s, "m", 8, 0.9) == pytest.approx(2 / 2) and pool_capacity(s, "m", 8) == 2


def test_measured_capacity_counts_only_when_every_available_endpoint_has_one():
    measured, unmeasured = endpoint("http://a", capacity=1, inflight=5), endpoint("http://b", inflight=0)
    assert pool_saturation(pool(measured, unmeasured), "m", 8, 0.9) == 0.0  # b's headroom is nobody's guess
    # An engine that publishes its queue keeps that ratio; the measured one is the worse of them here.
    now = time.monotonic()
    llama = endpoint("http://c", "llamacpp", capacity=4, inflight=4)
    llama.apply_scrape("llamacpp:requests_processing 4\nllamacpp:requests_deferred 0\n", now)
    assert pool_saturation(pool(llama), "m", 8, 0.9, now=now) == pytest.approx(1.0)
    llama.capacity = None
    assert pool_saturation(pool(llama), "m", 8, 0.9, now=now) == 0.0


async def test_admission_holds_requests_past_a_pools_measured_concurrency_and_lets_one_in_as_one_finishes():
    s = pool(endpoint("http://a", capacity=2))
    (ep,) = s.endpoints
    adm = Admission(
        AdmissionConfig(),
        lambda m: pool_saturation(s, m, 8, 0.9),
        capacity=lambda m: pool_capacity(s, m, 8),
    )
    first = [adm.try_admit("m", "normal", "A") for _ in range(2)]
    assert all(t is not None for t in first)
    ep.inflight = 2  # what the proxy counts once they are sent
    assert adm.try_admit("m", "normal", "A") is None  # saturated: it must wait
    waiter = asyncio.create_task(adm.wait("m", "normal", "A"))
    await async_until(lambda: adm.queue_depth("m") == 1, what="the third request queued")
    ep.inflight = 1
    adm.release(first[0])
    ticket = await asyncio.wait_for(waiter, 5)
    assert ticket.model == "m" and adm.queue_depth("m") == 0


def test_routing_sends_an_endpoint_of_three_times_the_weight_three_times_the_requests():
    heavy, light = endpoint("http://heavy"), endpoint("http://light")
    heavy.weight, light.weight = 3.0, 1.0
    s = pool(heavy, light)
    s.router.configure("least_loaded", 1.25, 256, 4096)
    for _ in range(40):
        s.choose("m").inflight += 1
    assert 29 <= heavy.inflight <= 31 and heavy.inflight + light.inflight == 40
    # Equal weights leave the loads exactly as they were.
    same = [(endpoint("http://x"), 2.0), (endpoint("http://y"), 5.0)]
    assert weighted(same) is same


# -- the control plane's copy ----------------------------------------------------------------


def measurement(model: str = "tiny", profile: str = "llamacpp-cpu", concurrent: int = 8, **kw) -> MeasuredCapacity:
    base = dict(
        model=model,
        profile=profile,
        concurrent=concurrent,
        tokens_per_s=400.0,
        ttft_p99=0.31,
        tpot_p99=0.022,
        wait=2,
        kv=None,
        slo_ttft_p99=2.0,
        slo_tpot_p99=0.1,
        target="http://127.0.0.1:20001",
        measured_at=datetime.now(UTC) - timedelta(hours=3),
        measured_by="token adm-0123456789ab",
    )
    base.update(kw)
    return MeasuredCapacity(**base)


def replica(rid: str, profile: str, url: str) -> Replica:
    r = Replica(rid, "tiny", profile, None, "llamacpp", "none/cpu", 0.0, 20001, 1, 0.0, 0.0)
    r.endpoint = Endpoint("tiny", url, "llamacpp", None)
    return r


async def test_a_measurement_gives_a_replicas_endpoint_its_limit_and_weight_unless_the_profile_sets_a_weight(
    tmp_path,
):
    store = await Store.open(str(tmp_path / "s.db"))
    try:
        caps = Capacities(store, Catalog([ModelConfig.model_validate(TINY)]))
        plain, heavy = replica("r1", "llamacpp-cpu", "http://a"), replica("r2", "heavy", "http://b")
        caps.replicas = lambda: [plain, heavy]
        await caps.start()
        assert (plain.endpoint.capacity, plain.endpoint.weight) == (None, 1.0)  # nothing measured yet
        await caps.save(measurement())
        assert (plain.endpoint.capacity, plain.endpoint.weight) == (8, 8.0)
        await caps.save(measurement(profile="heavy", concurrent=5))
        assert (heavy.endpoint.capacity, heavy.endpoint.weight) == (5, 3.0)  # the profile's weight: 3
        # None at the SLO is kept, and limits nothing.
        await caps.save(measurement(concurrent=0, ttft_p99=None, tpot_p99=None))
        assert (plain.endpoint.capacity, plain.endpoint.weight) == (None, 1.0)
        # A measurement another control plane saved is read at the next pass.
        await store.capacity_put(measurement(concurrent=6))
        await caps.load()
        assert plain.endpoint.capacity == 6
        words = caps.words("tiny", "llamacpp-cpu")
        assert words.startswith("capacity measured 3h ago by token adm-0123456789ab: 6 concurrent at the SLO")
        assert "(TTFT p99 2.0 s, TPOT p99 100 ms), 400 tok/s" in words
        assert words.endswith("admission counts a replica full at 6 in flight, routing weight 6")
        assert caps.words("tiny", "other").startswith("capacity not measured; `llmgw ctl bench tiny --target")
        await caps.stop()
    finally:
        await store.close()


# -- an in-process control plane --------------------------------------------------------------


@pytest.fixture
async def engine():
    async with FakeEngine(model="tiny", tokens=6, token_ms=2) as fe:
        yield fe


@pytest.fixture
async def server(tmp_path):
    cfg = parse_server_config(
        {
            "listen": f"127.0.0.1:{free_port()}",
            "admin_listen": f"127.0.0.1:{free_port()}",
            "metrics_listen": None,
            "agent_listen": f"127.0.0.1:{free_port()}",
            "agent_tls": None,
            "control": {"enabled": True, "interval": "200ms"},
            "auth": {"store": str(tmp_path / "gw.db")},
            "router": {"scrape_interval": "200ms"},
            "models": [TINY, {"name": "static", "endpoints": [{"url": "http://127.0.0.1:9", "engine": "openai"}]}],
        }
    )
    s = Server(cfg)
    await s.start()
    yield s
    await s.stop()


def admin_url(server: Server) -> str:
    return f"http://127.0.0.1:{server.config.admin_listen.port}"


def adopt(server: Server, port: int) -> None:
    """A node describes one ready shard of tiny on llamacpp-cpu listening on ``port``: the
    control plane adopts it as a replica whose endpoint is http://127.0.0.1:PORT."""
    spec = StartShard(
        shard_id="tiny-r1-0",
        replica_id="tiny-r1",
        model="tiny",
        engine="llamacpp",
        http_port=port,
        profile=EngineProfile(name="llamacpp-cpu"),
        pool="none/cpu",
    )
    assert server.agents is not None
    server.agents._apply_register(
        Register(
            node_id="node-a",
            protocol_version=PROTOCOL_VERSION,
            agent_version="t",
            inventory=NodeInventory(memory=MemoryInfo(total_bytes=64 << 30)),
            engine_versions={"llamacpp": "1"},
            mgmt_addr="127.0.0.1",
            shards=[RunningShard(shard_id="tiny-r1-0", replica_id="tiny-r1", state=ShardState.READY, spec=spec)],
        ),
        "127.0.0.1",
    )


def ctl(server: Server | None, *args: str, admin: str | None = None):
    """`llmgw ctl ARGS` in a thread (the server runs on this loop), with the server's token."""
    where = ["--server", admin or admin_url(server)]
    if server is not None:
        where += ["--token-file", str(server.admin_token_file)]
    return asyncio.to_thread(CliRunner().invoke, cli, ["ctl", *args, *where])


def body(**kw) -> dict:
    out = {
        "model": "tiny",
        "profile": "llamacpp-cpu",
        "max_concurrency_at_slo": 4,
        "throughput_tok_per_sec": 182.4,
        "ttft_p99": 0.31,
        "tpot_p99": 0.022,
        "suggested_target_waiting": 2,
        "suggested_kv_ceiling": 0.41,
        "slo": {"ttft_p99": 2.0, "tpot_p99": 0.1},
        "target": "http://10.0.0.5:20001",
        "measured_at": (datetime.now(UTC) - timedelta(hours=3)).isoformat(),
    }
    out.update(kw)
    return out


async def test_a_capacity_put_is_filed_under_the_models_profile_listed_with_who_saved_it_and_explained(server):
    base, auth = admin_url(server), admin_headers(server)
    async with httpx.AsyncClient(base_url=base, headers=auth) as http:
        assert (await http.get("/api/v1/capacity")).json() == {"capacity": []}
        r = await http.put("/api/v1/models/small/capacity", json=body(model="small"))  # an alias: the model's name
        assert r.status_code == 200, r.text
        saved = r.json()
        token_id = (await server.store.list_admin_tokens())[0].id
        assert saved["model"] == "tiny" and saved["measured_by"] == f"token {token_id}"
        assert saved["max_concurrency_at_slo"] == 4 and saved["slo"] == {"ttft_p99": 2.0, "tpot_p99": 0.1}
        assert (await http.get("/api/v1/capacity")).json() == {"capacity": [saved]}
        assert server.capacity.get("tiny", "llamacpp-cpu").concurrent == 4  # applied at once

        placement = (await http.get("/api/v1/models/tiny/placement")).json()
        by_profile = {p["profile"]: p["capacity"] for p in placement["profiles"]}
        assert by_profile["llamacpp-cpu"].startswith("capacity measured 3h ago by token ")
        assert "4 concurrent at the SLO" in by_profile["llamacpp-cpu"]
        assert by_profile["heavy"].startswith("capacity not measured")

        refusals = [
            ("/api/v1/models/nope/capacity", body(), 404, "model_not_found"),
            ("/api/v1/models/tiny/capacity", body(profile="vllm-h100"), 404, "profile_not_found"),
            ("/api/v1/models/tiny/capacity", body(model="other"), 400, "invalid_request"),
            ("/api/v1/models/static/capacity", body(model="static"), 400, "not_managed"),
            ("/api/v1/models/tiny/capacity", body(max_concurrency_at_slo=-1), 400, "invalid_request"),
            ("/api/v1/models/tiny/capacity", {"model": "tiny"}, 400, "invalid_request"),
        ]
        for path, sent, status, code in refusals:
            r = await http.put(path, json=sent)
            assert (r.status_code, r.json()["error"]["code"]) == (status, code), (path, sent, r.text)
        r = await http.put("/api/v1/models/tiny/capacity", json=body(profile="vllm-h100"))
        assert r.json()["error"]["message"] == "tiny has no profile vllm-h100; its profiles are llamacpp-cpu, heavy"
    out = await ctl(server, "explain-placement", "tiny")
    assert out.exit_code == 0, out.output
    assert "profile llamacpp-cpu:\n  capacity measured 3h ago by token" in out.stdout


async def test_ctl_capacity_shows_the_measurements_table_and_says_what_to_run_when_there_is_none(server):
    out = await ctl(server, "capacity")
    assert (out.exit_code, out.stdout) == (0, NOTHING)
    async with httpx.AsyncClient(base_url=admin_url(server), headers=admin_headers(server)) as http:
        assert (await http.put("/api/v1/models/tiny/capacity", json=body())).status_code == 200
        zero = body(profile="heavy", max_concurrency_at_slo=0, throughput_tok_per_sec=0, ttft_p99=None, tpot_p99=None)
        zero["suggested_target_waiting"] = zero["suggested_kv_ceiling"] = None
        assert (await http.put("/api/v1/models/tiny/capacity", json=zero)).status_code == 200
    out = await ctl(server, "capacity")
    assert out.exit_code == 0, out.output
    header, *rows = out.stdout.splitlines()
    columns = ["MODEL", "PROFILE", "CONCURRENT", "TOK/S", "TTFT p99", "TPOT p99", "WAIT", "KV", "MEASURED", "BY"]
    assert re.split(r"\s{2,}", header.strip()) == columns
    token_id = (await server.store.list_admin_tokens())[0].id
    assert rows[0].split() == ["tiny", "heavy", "none", "at", "SLO", "0", "-", "-", "-", "-", "3h", "ago"] + [
        "token",
        token_id,
    ]
    assert rows[1].split() == [
        "tiny",
        "llamacpp-cpu",
        "4",
        "182",
        "310",
        "ms",
        "22",
        "ms",
        "2",
        "41%",
        "3h",
        "ago",
        "token",
        token_id,
    ]


async def test_ctl_bench_save_files_the_result_under_the_replicas_profile_and_the_gateway_admits_by_it(server, engine):
    adopt(server, engine.port)
    target = f"{engine.url}/"  # pasted with a trailing slash: the same endpoint
    await async_until(lambda: [r["endpoint"] for r in server.reconciler.replica_rows()] == [engine.url])

    out = await ctl(server, "bench", "tiny", "--target", target, "--steps", "1,2", "--requests-per-step", "4", "--save")
    assert out.exit_code == 0, out.output
    lines = out.stdout.splitlines()
    assert lines[0] == f"tiny at {engine.url}: ramping 1, 2 until the SLO breaks"
    assert re.split(r"\s{2,}", lines[1].strip()) == [
        "CONCURRENT", "REQUESTS", "TTFT p99", "TPOT p99", "TOK/S", "WAIT", "KV", "RESULT"
    ]  # fmt: skip
    assert [line.split()[0] for line in lines[2:4]] == ["1", "2"] and all(x.endswith("held") for x in lines[2:4])
    assert lines[5].startswith("last level that held: 2 concurrent, ")
    assert lines[6] == "every level held, up to 2: add higher --steps to find where it breaks"
    assert lines[7].startswith("weight: 2  ")
    assert out.stderr == "saved: tiny on profile llamacpp-cpu, 2 concurrent at the SLO\n"

    (saved,) = await server.store.capacity_list()
    assert (saved.model, saved.profile, saved.concurrent, saved.target) == ("tiny", "llamacpp-cpu", 2, engine.url)
    assert (saved.slo_ttft_p99, saved.slo_tpot_p99) == (2.0, 0.1) and saved.kv is None  # llama.cpp's has none
    # The replica's endpoint took it at once: admission's limit and routing's weight.
    (ep,) = server.endpoints.by_model["tiny"]
    assert (ep.capacity, ep.weight) == (2, 2.0)
    async with httpx.AsyncClient(base_url=admin_url(server), headers=admin_headers(server)) as http:
        rows = (await http.get("/api/v1/endpoints")).json()["endpoints"]
    assert [(e["url"], e["capacity"], e["weight"]) for e in rows if e["model"] == "tiny"] == [(engine.url, 2, 2.0)]

    # Driven past it through the gateway: the third request waits in admission's queue.
    engine.token_ms = 300  # each reply now takes 1.5 s
    gateway = f"http://127.0.0.1:{server.config.listen.port}"
    key = (await server.store.create_key(name="t"))[0]
    await server.keys.load()  # now, rather than at the next poll of the store
    chat = {"model": "tiny", "max_tokens": 6, "messages": [{"role": "user", "content": "hi"}]}
    async with httpx.AsyncClient(base_url=gateway, headers={"Authorization": f"Bearer {key}"}, timeout=60) as http:
        sent = [asyncio.create_task(http.post("/v1/chat/completions", json=chat)) for _ in range(3)]
        admission = server.gateway.admission
        await async_until(
            lambda: admission.queue_depth("tiny") == 1 and ep.inflight == 2,
            what="two requests at the engine and the third held in admission's queue",
        )
        assert admission.saturation("tiny") >= 1.0
        assert [r.status_code for r in await asyncio.gather(*sent)] == [200, 200, 200]
    assert engine.peak_waiting == 0  # the engine never had more than the measured two at once (it has no slots)


async def test_ctl_bench_save_against_an_endpoint_that_is_no_replica_says_it_measures_the_path_and_saves_nothing(
    server, engine
):
    out = await ctl(
        server, "bench", "tiny", "--target", engine.url, "--steps", "1", "--requests-per-step", "2", "--save"
    )
    assert out.exit_code == 0, out.output
    assert "last level that held: 1 concurrent" in out.stdout
    assert out.stderr == (
        f"the measurement was not saved: {engine.url} is not a replica of tiny, so this run measures the path "
        "rather than the hardware; point --target at a replica endpoint from `llmgw ctl replicas`\n"
    )
    assert await server.store.capacity_list() == []


async def test_ctl_bench_save_that_cannot_reach_the_control_plane_says_so_and_the_measurement_still_stands(engine):
    nowhere = f"http://127.0.0.1:{free_port()}"
    out = await ctl(
        None, "bench", "tiny", "--target", engine.url, "--steps", "1", "--requests-per-step", "2", "--save",
        admin=nowhere,
    )  # fmt: skip
    assert out.exit_code == 0, out.output
    assert "weight: 1  " in out.stdout
    assert out.stderr.startswith(
        f"the measurement was not saved: cannot reach the control plane's admin API at {nowhere}/api/v1/replicas"
    )


async def test_ctl_bench_json_and_a_first_request_that_fails(engine):
    out = await ctl(None, "bench", "tiny", "--target", engine.url, "--steps", "1", "--requests-per-step", "2", "--json",
                    admin="http://127.0.0.1:9")  # fmt: skip
    assert out.exit_code == 0, out.output
    got = json.loads(out.stdout)
    assert got["max_concurrency_at_slo"] == 1 and got["weight"] == 1 and got["levels"][0]["held"] is True
    engine.fail_next(1, status=401, message="invalid api key")
    out = await ctl(None, "bench", "tiny", "--target", engine.url, "--steps", "1", admin="http://127.0.0.1:9")
    assert out.exit_code == 1
    assert "error: the first request to " in out.stderr and "so nothing was measured: answered 401" in out.stderr


def test_ctl_bench_and_ctl_capacity_say_what_they_do_and_the_default_targets_in_their_help():
    runner = CliRunner()
    out = runner.invoke(cli, ["ctl", "bench", "--help"], env={"COLUMNS": "200"})
    assert out.exit_code == 0
    assert "[default: 2s]" in out.stdout and "[default: 100ms]" in out.stdout
    assert "Defaults: TTFT p99 2s, TPOT p99 100ms." in out.stdout
    out = runner.invoke(cli, ["ctl", "capacity", "--help"], env={"COLUMNS": "200"})
    assert out.exit_code == 0 and "ctl bench --save" in out.stdout
