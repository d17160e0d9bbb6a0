"""The reconciler over a simulated fleet: the real agent service's records, commands captured."""

from __future__ import annotations

import asyncio
import random

import pytest

from llmgw.config.server import ModelConfig, ServerConfig
from llmgw.protocol import (
    GPU,
    PROTOCOL_VERSION,
    Ack,
    DrainShard,
    EngineProfile,
    FabricAttachment,
    FetchProgress,
    MemoryInfo,
    NodeInventory,
    Provision,
    Register,
    RunningShard,
    ShardState,
    ShardStatus,
    StartShard,
    StopShard,
)
from llmgw.server.control.agents import AgentService, AgentServiceError, NodeState
from llmgw.server.control.catalog import Catalog
from llmgw.server.control.reconciler import Reconciler
from llmgw.server.gateway.endpoints import EndpointSet

GiB = 1 << 30
H100 = dict(name="NVIDIA H100 80GB HBM3", memory_total_bytes=81559 << 20)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Fleet:
    """An AgentService whose nodes register in memory and whose commands are recorded."""

    def __init__(self) -> None:
        self.svc = AgentService()
        self.sent: list[tuple[str, object]] = []
        self.refuse: dict[str, str] = {}  # node -> error for start_shard
        self.connected: set[str] = set()
        self.svc.request = self._request  # type: ignore[method-assign]
        self.svc.send = self._send  # type: ignore[method-assign]
        self.svc.is_connected = lambda nid: nid in self.connected  # type: ignore[method-assign]

    async def _request(self, node_id, msg, timeout=30.0):
        self.sent.append((node_id, msg))
        if isinstance(msg, StartShard) and node_id in self.refuse:
            return Ack(id="x", ok=False, error=self.refuse[node_id])
        return Ack(id="x", ok=True)

    async def _send(self, node_id, msg):
        self.sent.append((node_id, msg))

    def add(
        self,
        node_id: str,
        *,
        gpus: int = 0,
        memory_gb: float = 64,
        labels=None,
        shards: list[RunningShard] | None = None,
        engines=("llamacpp", "vllm"),
        fabrics=None,
    ) -> None:
        inv = NodeInventory(
            memory=MemoryInfo(total_bytes=int(memory_gb * GiB)), gpus=[GPU(index=i, **H100) for i in range(gpus)]
        )
        self.connected.add(node_id)
        self.svc._apply_register(
            Register(
                node_id=node_id,
                protocol_version=PROTOCOL_VERSION,
                agent_version="t",
                features=["logs", "remove-weights", "drain"],
                inventory=inv,
                engine_versions=dict.fromkeys(engines, "1"),
                labels=labels or {},
                mgmt_addr=f"10.0.0.{len(self.connected)}",
                shards=shards or [],
                fabrics=fabrics,
            ),
            "10.9.9.9",
        )

    def report(self, node_id: str, shard_id: str, state: ShardState, **kw) -> None:
        node = self.svc.get(node_id)
        self.svc._apply_shard(node, ShardStatus(shard_id=shard_id, state=state, **kw))

    def starts(self, node: str | None = None) -> list[tuple[str, StartShard]]:
        return [(n, m) for n, m in self.sent if isinstance(m, StartShard) and (node is None or n == node)]

    def stops(self) -> list[tuple[str, object]]:
        return [(n, m) for n, m in self.sent if isinstance(m, (StopShard, DrainShard))]


def model(
    name="m",
    *,
    min=1,
    max=None,
    gpu=False,
    idle="10m",
    tp=1,
    memory=None,
    selector=None,
    startup="30m",
    profiles=None,
    **extra,
) -> ModelConfig:
    profile = {"engine": "vllm", "gpu_class": "h100-80g", "tp": tp} if gpu else {"engine": "llamacpp"}
    profile["startup_timeout"] = startup
    if memory:
        profile["min_memory_gb"] = memory
    if selector:
        profile["node_selector"] = selector
    scaling = {"min": min, "idle_timeout": idle}
    if max is not None:
        scaling["max"] = max
    return ModelConfig.model_validate(
        {
            "name": name,
            "source": "https://example.com/m.gguf" if not gpu else "org/m",
            "scaling": scaling,
            "profiles": profiles or [profile],
            **extra,
        }
    )


def make(fleet: Fleet, models: list[ModelConfig], clock: Clock, **control) -> Reconciler:
    cfg = ServerConfig.model_validate(
        {"control": {"enabled": True, "base_backoff": "10s", "max_backoff": "40s", "cold_start_wait": "5s", **control}}
    )
    eps = EndpointSet([], 1.0, 10.0, 1.0)
    return Reconciler(cfg, Catalog(models), fleet.svc, eps, clock=clock, rng=random.Random(7))


async def settle() -> None:
    # Yields to the loop, so woken tasks run; no clock is involved, so load cannot make it flake.
    for _ in range(5):
        await asyncio.sleep(0)


def ready_all(fleet: Fleet, rec: Reconciler, model_name: str | None = None) -> None:
    for r in list(rec.replicas.values()):
        if model_name is None or r.model == model_name:
            for s in r.shards:
                fleet.report(s.node_id, s.shard_id, ShardState.READY, pid=4242)


@pytest.fixture
def clock() -> Clock:
    return Clock()


async def test_places_targets_and_publishes_ready_replicas(clock):
    fleet = Fleet()
    for i in range(1, 4):
        fleet.add(f"cpu-{i}")
    fleet.add("gpu-1", gpus=8)
    rec = make(fleet, [model("small", min=2), model("big", gpu=True, tp=2)], clock)
    # Every registration was told which engines to converge on.
    await rec.tick()
    await settle()
    starts = fleet.starts()
    assert sorted(m.model for _, m in starts) == ["big", "small", "small"]
    # CPU replicas are spread; the GPU replica takes two cards.
    small_nodes = sorted(n for n, m in starts if m.model == "small")
    assert small_nodes == ["cpu-1", "cpu-2"]
    ((gnode, gspec),) = [(n, m) for n, m in starts if m.model == "big"]
    assert gnode == "gpu-1" and gspec.gpus == [0, 1] and gspec.profile.tensor_parallel == 2
    for _, spec in starts:
        assert 20000 <= spec.http_port <= 29999
        assert spec.profile.name and spec.profile_fp and spec.replica_id and spec.shard_id.startswith(spec.replica_id)
    assert all(r.state == "starting" for r in rec.replicas.values())
    assert not rec.endpoints.endpoints

    # Nothing more is started while they start.
    await rec.tick()
    assert len(fleet.starts()) == 3

    ready_all(fleet, rec)
    urls = sorted(ep.url for ep in rec.endpoints.endpoints)
    assert len(urls) == 3 and all(ep.healthy for ep in rec.endpoints.endpoints)
    big = next(r for r in rec.replicas.values() if r.model == "big")
    assert big.endpoint.url == f"http://10.0.0.4:{gspec.http_port}"
    assert rec.endpoints.model_ready("small") and rec.endpoints.model_ready("big")
    rows = rec.replica_rows()
    assert {r["state"] for r in rows} == {"ready"} and not any(r["stale"] for r in rows)


async def test_provision_is_sent_on_every_registration(clock):
    fleet = Fleet()
    rec = make(fleet, [], clock)
    fleet.add("n1")
    await settle()
    provs = [m for n, m in fleet.sent if isinstance(m, Provision)]
    assert len(provs) == 1 and provs[0].engines[0].engine == "llamacpp"
    assert provs[0].engines[0].version == rec.config.engines.llamacpp


async def test_a_refused_start_backs_off_and_doubles(clock):
    fleet = Fleet()
    fleet.add("n1")
    fleet.refuse["n1"] = "llama.cpp is not installed"
    rec = make(fleet, [model("m")], clock)
    await rec.tick()
    await settle()
    assert len(fleet.starts()) == 1
    status = rec.model_status("m")
    assert status["backoff"]["failures"] == 1 and "llama.cpp is not installed" in status["backoff"]["last_failure"]
    clock.now += 9
    await rec.tick()
    assert len(fleet.starts()) == 1  # still waiting out 10 s
    clock.now += 2
    await rec.tick()
    await settle()
    assert len(fleet.starts()) == 2
    clock.now += 11
    await rec.tick()
    assert len(fleet.starts()) == 2  # the second failure doubled the wait to 20 s
    clock.now += 10
    await rec.tick()
    await settle()
    assert len(fleet.starts()) == 3
    # A success clears the backoff.
    del fleet.refuse["n1"]
    clock.now += 41
    await rec.tick()
    await settle()
    ready_all(fleet, rec)
    assert rec.model_status("m")["backoff"] is None and rec.endpoints.model_ready("m")


async def test_a_failed_shard_is_stopped_and_retried_later(clock):
    fleet = Fleet()
    fleet.add("n1")
    rec = make(fleet, [model("m")], clock)
    await rec.tick()
    ((node, spec),) = fleet.starts()
    fleet.report(
        node,
        spec.shard_id,
        ShardState.FAILED,
        reason="exited with code 1",
        output_tail=["loading model", "error: unknown model architecture: 'foo'"],
    )
    await settle()
    assert rec.model_status("m")["backoff"]["last_failure"].endswith(
        "exited with code 1 (last output: error: unknown model architecture: 'foo')"
    )
    # The failed replica is told to stop and forgotten once the agent says so.
    assert [m.shard_id for _, m in fleet.stops()] == [spec.shard_id]
    assert not rec.replicas
    # Its failure stays readable until the model serves again.
    (row,) = rec.replica_rows()
    assert row["state"] == "failed" and "unknown model architecture" in row["reason"]
    clock.now += 11
    await rec.tick()
    ready_all(fleet, rec)
    assert [r["state"] for r in rec.replica_rows()] == ["ready"]


async def test_startup_timeout_is_not_reset_by_fetch_progress(clock):
    fleet = Fleet()
    fleet.add("n1")
    rec = make(fleet, [model("m", startup="100s")], clock)
    await rec.tick()
    ((node, spec),) = fleet.starts()
    for done in range(1, 6):
        clock.now += 19
        fleet.report(
            node,
            spec.shard_id,
            ShardState.PENDING,
            fetch=FetchProgress(source="s", bytes_done=done * 10, bytes_total=100),
        )
        await rec.tick()
    assert rec.replica_rows()[0]["shards"][0]["fetch"]["percent"] == 50.0
    assert not fleet.stops()
    clock.now += 10  # 105 s since the start
    await rec.tick()
    await settle()
    assert [m.shard_id for _, m in fleet.stops()] == [spec.shard_id]
    reason = rec.model_status("m")["backoff"]["last_failure"]
    assert "not ready 100s after it was started (startup_timeout; still starting, fetching its weights (50%))" in reason


async def test_a_lost_node_has_its_replica_placed_again_at_once(clock):
    fleet = Fleet()
    fleet.add("n1")
    fleet.add("n2")
    rec = make(fleet, [model("m")], clock)
    await rec.tick()
    ((node, _spec),) = fleet.starts()
    ready_all(fleet, rec)
    assert rec.endpoints.model_ready("m")
    fleet.svc.get(node).state = NodeState.UNREACHABLE
    await rec.tick()
    assert len(fleet.starts()) == 1 and rec.endpoints.model_ready("m")  # unreachable: kept
    fleet.svc.get(node).state = NodeState.LOST
    fleet.connected.discard(node)
    await rec.tick()
    await settle()
    starts = fleet.starts()
    assert len(starts) == 2 and starts[1][0] != node
    assert rec.model_status("m")["backoff"] is None
    assert not rec.endpoints.model_ready("m")  # the lost one was unpublished


async def test_node_remove_takes_a_lost_node_or_an_unreachable_one_with_nothing_placed_on_it(clock):
    fleet = Fleet()
    for n in ("n1", "n2", "n3"):
        fleet.add(n)
    rec = make(fleet, [model("m")], clock)
    await rec.tick()
    ((busy, spec),) = fleet.starts()
    ready_all(fleet, rec)
    empty, stray = (n for n in ("n1", "n2", "n3") if n != busy)
    # A shard the node runs that no replica holds (here: one never adopted) is placed there too.
    fleet.report(stray, "x-0", ShardState.READY)
    for n in ("n1", "n2", "n3"):
        fleet.svc.get(n).state = NodeState.UNREACHABLE
        fleet.connected.discard(n)

    with pytest.raises(AgentServiceError, match=rf"{busy} is unreachable .* and {spec.replica_id} is placed on it"):
        rec.remove_node(busy)
    with pytest.raises(AgentServiceError, match=r"x-0 is placed on it; drain it .* or wait until it is lost"):
        rec.remove_node(stray)
    assert rec.remove_node(empty).node_id == empty and fleet.svc.get(empty) is None

    fleet.svc.get(busy).state = NodeState.LOST
    assert rec.remove_node(busy).node_id == busy and fleet.svc.get(busy) is None
    await rec.tick()
    assert not rec.endpoints.model_ready("m")  # its replica went with it, to be placed again


async def test_adoption_after_a_restart_starts_nothing(clock):
    fleet = Fleet()
    m = model("m")
    rec = make(fleet, [m], clock)
    profile = m.profiles[0]
    spec = StartShard(
        shard_id="m-abc-0",
        replica_id="m-abc",
        model="m",
        engine="llamacpp",
        source=m.source,
        http_port=20500,
        profile=EngineProfile(name=profile.name),
        profile_fp=profile.fingerprint,
        pool="none/cpu",
    )
    stale = spec.model_copy(
        update={"shard_id": "m-old-0", "replica_id": "m-old", "http_port": 20501, "profile_fp": "0" * 64}
    )
    foreign = spec.model_copy(update={"shard_id": "x-0", "replica_id": "x", "model": "gone"})
    fleet.add(
        "n1",
        shards=[
            RunningShard(shard_id="m-abc-0", replica_id="m-abc", state=ShardState.READY, pid=11, spec=spec),
            RunningShard(shard_id="m-old-0", replica_id="m-old", state=ShardState.READY, pid=12, spec=stale),
            RunningShard(shard_id="x-0", replica_id="x", state=ShardState.READY, pid=13, spec=foreign),
            RunningShard(shard_id="nospec", state=ShardState.READY, pid=14),
        ],
    )
    await settle()
    assert set(rec.replicas) == {"m-abc", "m-old"}
    assert sorted(ep.url for ep in rec.endpoints.endpoints) == ["http://10.0.0.1:20500", "http://10.0.0.1:20501"]
    stopped = sorted((m.shard_id, m.reason) for _, m in fleet.stops())
    assert stopped == [
        ("nospec", "the control plane does not know this shard: the agent kept no start request for it"),
        ("x-0", "the control plane does not know this shard: model gone is not in the catalog"),
    ]
    rows = {r["id"]: r for r in rec.replica_rows()}
    assert rows["m-old"]["stale"] and not rows["m-abc"]["stale"] and rows["m-abc"]["adopted"]
    # Two replicas where one is wanted: the extra is stopped, a stale one is never restarted for being stale.
    await rec.tick()
    await settle()
    assert len(fleet.starts()) == 0
    assert len([1 for _, m in fleet.stops() if m.shard_id.startswith("m-")]) == 1


async def test_a_registration_without_a_shard_lets_it_go(clock):
    fleet = Fleet()
    fleet.add("n1")
    rec = make(fleet, [model("m")], clock)
    await rec.tick()
    ready_all(fleet, rec)
    clock.now += 10
    fleet.add("n1")  # the agent restarted and reports nothing
    await settle()
    assert not rec.replicas and not rec.endpoints.endpoints
    assert not [1 for _, m in fleet.stops()]  # nothing to stop there: it is not running
    await rec.tick()
    await settle()
    assert len(fleet.starts()) == 2 and rec.model_status("m")["backoff"] is None


async def test_scale_to_zero_and_back(clock):
    fleet = Fleet()
    fleet.add("n1")
    rec = make(fleet, [model("m", min=2)], clock)
    await rec.tick()
    ready_all(fleet, rec)
    rec.catalog = Catalog([model("m", min=0, max=0)])
    await rec.tick()
    await settle()
    assert len(fleet.stops()) == 2 and not rec.endpoints.endpoints
    # The agent answers a stop once the engine is gone.
    assert not rec.replicas
    assert await rec.wait_ready("m") == (
        "model 'm' is stopped (its scaling has max 0); an operator can start it with llmgw ctl scale"
    )
    rec.catalog = Catalog([model("m", min=1)])
    await rec.tick()
    assert len(fleet.starts()) == 3


async def test_on_demand_loads_on_request_and_stops_when_idle(clock):
    fleet = Fleet()
    fleet.add("n1")
    rec = make(fleet, [model("m", min=0, idle="60s")], clock)
    await rec.tick()
    assert not fleet.starts()
    waiter = asyncio.create_task(rec.wait_ready("m"))
    await settle()
    await rec.tick()
    await settle()
    assert len(fleet.starts()) == 1 and not waiter.done()
    ready_all(fleet, rec)
    assert await asyncio.wait_for(waiter, 2) is None
    clock.now += 30
    rec.touch("m")
    clock.now += 59
    await rec.tick()
    assert not fleet.stops()
    clock.now += 2
    await rec.tick()
    await settle()
    assert len(fleet.stops()) == 1 and "idle" in fleet.stops()[0][1].reason


async def test_on_demand_that_cannot_be_placed_answers_at_once(clock):
    fleet = Fleet()
    fleet.add("n1", memory_gb=8)
    rec = make(fleet, [model("m", min=0, memory=24)], clock)
    rec._task = asyncio.create_task(rec._loop())
    try:
        problem = await asyncio.wait_for(rec.wait_ready("m"), 3)
    finally:
        await rec.stop()
    assert problem == (
        "model 'm' cannot be started now: no node can take it; an operator can see why with "
        "llmgw ctl explain-placement m"
    )
    assert "n1" not in problem
    # The operator's view keeps the reasons.
    assert rec.problems["m"] == "cannot place m:\n  n1 has 8 GB of memory, needs 24"


async def test_cordon_keeps_work_and_drain_moves_it_one_at_a_time(clock):
    fleet = Fleet()
    fleet.add("n1")
    fleet.add("n2")
    rec = make(fleet, [model("a"), model("b")], clock)
    await rec.tick()
    ready_all(fleet, rec)
    on_n1 = sorted(r.id for r in rec.replicas.values() if "n1" in r.node_ids)
    assert len(on_n1) == 1  # CPU replicas are spread
    assert "keep running" in await rec.cordon("n1")
    assert rec.node_state(fleet.svc.get("n1")) == "cordoned"
    await rec.tick()
    assert not fleet.stops() and len(fleet.starts()) == 2

    fleet.add("n3")
    await rec.drain("n1")
    await rec.tick()
    await settle()
    starts = fleet.starts()
    assert len(starts) == 3 and starts[-1][0] != "n1"
    assert not fleet.stops()  # the old one serves until its replacement is ready
    old = rec.replicas[on_n1[0]]
    assert old.replaced_by == starts[-1][1].replica_id
    fleet.report(starts[-1][0], starts[-1][1].shard_id, ShardState.READY)
    await settle()
    ((node, msg),) = fleet.stops()
    assert node == "n1" and isinstance(msg, DrainShard) and msg.reason.startswith("drained: replica")
    fleet.report("n1", msg.shard_id, ShardState.STOPPED)
    await rec.tick()
    assert not [r for r in rec.replicas.values() if "n1" in r.node_ids]
    assert len(fleet.starts()) == 3  # nothing else started: targets are met
    assert "takes new work again (it was draining)" in await rec.uncordon("n1")


async def test_drain_waits_when_nothing_else_fits(clock):
    fleet = Fleet()
    fleet.add("n1", memory_gb=64)
    fleet.add("n2", memory_gb=8)
    rec = make(fleet, [model("a", memory=24)], clock)
    await rec.tick()
    ready_all(fleet, rec)
    await rec.drain("n1")
    await rec.tick()
    assert len(fleet.starts()) == 1 and not fleet.stops()
    assert "n2 has 8 GB of memory, needs 24" in rec.node_warnings["n1"]


async def test_model_leaving_the_catalog_is_stopped(clock):
    fleet = Fleet()
    fleet.add("n1")
    rec = make(fleet, [model("a"), model("b")], clock)
    await rec.tick()
    rec.catalog = Catalog([model("a")])
    await rec.tick()
    await settle()
    ((_node, msg),) = fleet.stops()
    assert msg.reason == "model b left the catalog"


async def test_unknown_node_operations_are_refused(clock):
    fleet = Fleet()
    rec = make(fleet, [], clock)
    from llmgw.server.control.reconciler import ControlError

    with pytest.raises(ControlError, match="no node named ghost is known"):
        await rec.cordon("ghost")
    assert rec.marks == {}


async def test_many_models_over_a_large_fleet_place_deterministically(clock):
    fleet = Fleet()
    for i in range(60):
        fleet.add(f"g-{i}", gpus=8) if i % 2 else fleet.add(f"c-{i}", labels={"zone": "eu" if i % 4 else "us"})
    models = [
        model(
            f"m{i}",
            min=1 + i % 3,
            gpu=bool(i % 2),
            tp=[1, 2, 4, 8][i % 4] if i % 2 else 1,
            selector={"zone": "us"} if i % 10 == 0 else None,
        )
        for i in range(40)
    ]
    rec = make(fleet, models, clock)
    await rec.tick()
    await settle()
    placed = {}
    for node, spec in fleet.starts():
        placed.setdefault(spec.model, []).append((node, tuple(spec.gpus or ())))
    assert sum(len(v) for v in placed.values()) == sum(1 + i % 3 for i in range(40))
    # No GPU is given twice on a node.
    seen = set()
    for node, spec in fleet.starts():
        for g in spec.gpus or ():
            assert (node, g) not in seen
            seen.add((node, g))
    # node_selector is honoured.
    for i in range(0, 40, 10):
        assert all(fleet.svc.get(n).labels.get("zone") == "us" for n, _ in placed[f"m{i}"])


async def test_after_a_start_nothing_is_placed_until_agents_had_time_to_reconnect(clock):
    fleet = Fleet()
    fleet.add("n1")
    rec = make(fleet, [model("m")], clock, unreachable_after="15s", lost_after="60s")
    await rec.start()
    await rec.stop()
    await rec.tick()
    assert not fleet.starts() and "m" not in rec.problems
    clock.now += 15
    await rec.tick()
    assert len(fleet.starts()) == 1


async def test_after_a_start_it_places_at_once_when_every_expected_node_has_registered(clock):
    fleet = Fleet()
    rec = make(fleet, [model("m")], clock, unreachable_after="15s", lost_after="60s", expected_nodes=["n1", "n2"])
    await rec.start()
    await rec.stop()
    fleet.add("n1")
    await rec.tick()
    assert not fleet.starts()  # n2 may still come back running a replica of m
    clock.now += 1
    fleet.add("n2")
    await rec.tick()
    assert len(fleet.starts()) == 1


async def test_after_a_start_with_an_expected_node_missing_it_waits_out_the_settle_time(clock):
    fleet = Fleet()
    rec = make(fleet, [model("m")], clock, unreachable_after="15s", lost_after="60s", expected_nodes=["n1", "n2"])
    await rec.start()
    await rec.stop()
    fleet.add("n1")
    fleet.add("other")  # a node not listed does not stand in for a listed one
    clock.now += 14.9
    await rec.tick()
    assert not fleet.starts()
    clock.now += 0.1
    await rec.tick()
    assert len(fleet.starts()) == 1


async def test_a_node_registered_before_a_new_leadership_does_not_count_as_back(clock):
    fleet = Fleet()
    rec = make(fleet, [model("m")], clock, unreachable_after="15s", lost_after="60s", expected_nodes=["n1"])
    fleet.add("n1")  # registered with an earlier term; its stream is closed when this one steps down
    await rec.start()
    await rec.stop()
    await rec.tick()
    assert not fleet.starts()
    fleet.add("n1")
    await rec.tick()
    assert len(fleet.starts()) == 1


async def test_a_multi_node_replica_starts_its_leader_first_on_one_fabric(clock):
    fleet = Fleet()
    fleet.add("g-1", gpus=8, fabrics=[FabricAttachment(fabric="ib-a", hcas=["mlx5_0", "mlx5_1"])])
    fleet.add("g-2", gpus=8, fabrics=[FabricAttachment(fabric="ib-a", hcas=["mlx5_2"])])
    fleet.add("g-3", gpus=8)  # no fabric: a single-node island
    big = model("big", gpu=True, profiles=[{"engine": "vllm", "gpu_class": "h100-80g", "tp": 16, "nodes": 2}])
    rec = make(fleet, [big], clock)
    await rec.tick()
    await settle()
    (n0, s0), (n1, s1) = fleet.starts()
    assert {n0, n1} == {"g-1", "g-2"} and s0.rank == 0 and s1.rank == 1
    assert s0.nnodes == s1.nnodes == 2 and s0.replica_id == s1.replica_id
    leader = fleet.svc.get(n0)
    assert s1.leader_addr == leader.mgmt_addr and s0.leader_port == s1.leader_port and s0.leader_port
    assert s0.http_port and s1.http_port is None  # only the leader serves HTTP
    assert s0.pool == "ib-a/h100-80g" and s0.fabric == "ib-a"
    hcas = {"g-1": ["mlx5_0", "mlx5_1"], "g-2": ["mlx5_2"]}
    assert s0.hcas == hcas[n0] and s1.hcas == hcas[n1]
    assert len(s0.gpus) == len(s1.gpus) == 8
