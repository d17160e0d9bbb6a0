"""The placement index (Fleet.place over candidates) against the exhaustive filter
(every node through _fits, then _rank): on fleets of several shapes and seeded random
catalogs, the same placements in the same order and the same refusal words."""

from __future__ import annotations

import dataclasses
import random

import pytest

from llmgw.protocol import GPU, GPUUsage, MemoryInfo, NodeInventory, Storage
from llmgw.server.control.agents import Node, NodeState
from llmgw.server.control.placement import (
    Claims,
    Fleet,
    GPUView,
    NodeFabricFacts,
    NodeView,
    NodeViewCache,
    Placement,
    PlacementRequest,
    node_view,
    place_all,
)

ZONES = ("zone-0", "zone-1", "zone-2")


def _gpus(cls: str, n: int, rng: random.Random, *, held: float = 0.0, bad: float = 0.0) -> tuple[GPUView, ...]:
    out = []
    for i in range(n):
        problems = ("3 uncorrected ECC errors",) if rng.random() < bad else ()
        out.append(
            GPUView(
                index=i,
                gpu_class=cls,
                healthy=not problems,
                problems=problems,
                free=rng.random() >= held,
                numa_node=i * 2 // n,
                nvlink_peers=frozenset(p for p in range(n) if p != i and (p < n // 2) == (i < n // 2)),
            )
        )
    return tuple(out)


def _fleet(shape: str, n: int, seed: int) -> list[NodeView]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        nid = f"node-{i}"
        labels = {"zone": ZONES[i % 3], "tier": "batch" if i % 5 == 0 else "prod"}
        kw: dict = dict(
            engines={"llamacpp": "b6000"},
            memory_total_gb=256.0,
            disk_free_gb=1000.0,
            labels=labels,
            replicas=0,
        )
        kind = "cpu" if shape == "cpu" else ("h100", "h100", "l40s", "cpu")[i % 4]
        if kind == "h100":
            kw.update(engines={"llamacpp": "b6000", "vllm": "0.11.0"}, memory_total_gb=2048.0)
            kw["gpus"] = _gpus("h100-80g", 8, rng, held=0.3 if shape == "held" else 0.0, bad=0.1 * (shape == "held"))
        elif kind == "l40s":
            kw.update(engines={"llamacpp": "b6000", "vllm": "0.11.0"}, memory_total_gb=512.0)
            kw["gpus"] = _gpus("l40s-45g", 4, rng, held=0.3 if shape == "held" else 0.0, bad=0.1 * (shape == "held"))
        if shape == "held":
            kw["memory_claimed_gb"] = float(rng.choice((0, 16, 64, 200)))
            kw["replicas"] = rng.randrange(3)
            if rng.random() < 0.1:
                kw["engines_probed"] = False
                kw["engines"] = {}
        if shape == "states":
            r = rng.random()
            if r < 0.15:
                kw["state"] = rng.choice((NodeState.UNREACHABLE, NodeState.LOST))
            elif r < 0.3:
                kw["cordoned"] = True
            elif r < 0.4:
                kw["draining"] = True
        if shape == "full":
            kw["memory_total_gb"] = 4.0
            kw["engines"] = {}  # nothing installed: no request fits
            kw["provision"] = {"vllm": "fetching"} if i % 2 else {}
            if kw.get("gpus"):
                kw["gpus"] = tuple(dataclasses.replace(g, free=False) for g in kw["gpus"])
        if shape == "fabrics" and kind == "h100":
            kw["fabrics"] = {"ib-a": ("mlx5_0", "mlx5_1")} if i % 3 else {"ib-b": ("mlx5_0",)}
            kw["fabric_facts"] = NodeFabricFacts(
                physical={"ib-a": frozenset({f"ib:0x{i % 2}"})},
                leaves={"mlx5_0": (f"leaf-{i // 8}",)},
                degraded={"mlx5_1": "trained at 200 Gb/s"} if i % 7 == 0 else {},
            )
        if rng.random() < 0.1:
            kw["weights"] = frozenset({f"/var/lib/llmgw/weights/model-{rng.randrange(20):03d}"})
        out.append(NodeView(node_id=nid, **kw))
    rng.shuffle(out)  # the fleet's order is not the node order: ties must still end alike
    return out


def _catalog(seed: int, count: int, *, multi: bool) -> list[PlacementRequest]:
    rng = random.Random(seed)
    out = []
    for m in range(count):
        name = f"model-{m:03d}"
        sel = rng.choice(({}, {}, {"zone": rng.choice(ZONES)}, {"tier": "batch"}, {"tier": "none"}))
        source = f"hf:org/{name}/model-{rng.randrange(20):03d}" if rng.random() < 0.5 else None
        mem = rng.choice((None, 8.0, 32.0, 300.0, 1000.0))
        disk = rng.choice((None, None, 40.0, 2000.0))
        kind = rng.random()
        if kind < 0.35:
            r = PlacementRequest(name, min_memory_gb=mem, disk_gb=disk, node_selector=sel, source=source)
        else:
            cls = rng.choice(("h100-80g", "h100-80g", "l40s-45g", "a100-40g"))
            tp = rng.choice((1, 2, 4, 8))
            nodes = rng.choice((1, 1, 2, 3)) if multi and cls == "h100-80g" else 1
            r = PlacementRequest(
                name,
                engine="vllm",
                gpu_class=cls,
                tp=tp,
                nodes=nodes,
                min_memory_gb=mem,
                disk_gb=disk,
                node_selector=sel,
                source=source,
            )
        out += [r] * rng.randrange(1, 4)
    return out


def _answers(results) -> list[tuple]:
    out = []
    for res in results:
        if isinstance(res, Placement):
            out.append(("placed", res.nodes, res.explanation, res.fabric, res.nvlink_domain, res.adapters))
        else:
            out.append(("refused", res.explanation))
    return out


@pytest.mark.parametrize("shape", ["cpu", "mixed", "held", "states", "fabrics", "full"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_placement_with_the_index_gives_the_same_placements_and_refusals_as_every_node_checked(shape, seed):
    nodes = _fleet(shape, 60, seed)
    requests = _catalog(seed * 100, 40, multi=shape == "fabrics")
    exhaustive, views_e = place_all(requests, nodes, indexed=False)
    indexed, views_i = place_all(requests, nodes, indexed=True)
    assert _answers(indexed) == _answers(exhaustive)
    assert views_i == views_e
    placed = sum(isinstance(r, Placement) for r in exhaustive)
    # Each shape says something: "full" only refuses, the others both place and refuse.
    if shape == "full":
        assert placed == 0
    else:
        assert 0 < placed < len(requests)


def test_a_refusal_reworded_after_claims_matches_one_worded_from_scratch():
    nodes = _fleet("mixed", 40, 7)
    big = PlacementRequest("big", engine="vllm", gpu_class="h100-80g", tp=8, min_memory_gb=5000.0)
    small = PlacementRequest("small", engine="vllm", gpu_class="h100-80g", tp=4)
    fleet = Fleet(nodes)
    first = fleet.place(big)
    assert not first.ok
    for _ in range(5):
        res = fleet.place(small)
        assert isinstance(res, Placement)
        fleet.claim(res, None)
    again = fleet.place(dataclasses.replace(big, model="big-2"))
    fresh = Fleet(fleet.views, indexed=False).place(dataclasses.replace(big, model="big-2"))
    assert again.explanation == fresh.explanation
    assert again.explanation != first.explanation.replace("cannot place big:", "cannot place big-2:")


def _node(i: int, free_bytes: int, used: int) -> Node:
    gpu = GPU(index=0, name="NVIDIA L40S", memory_total_bytes=48_305_799_168)
    return Node(
        node_id=f"node-{i}",
        inventory=NodeInventory(gpus=[gpu], memory=MemoryInfo(total_bytes=256 << 30)),
        engine_versions={"vllm": "0.11.0"},
        labels={"zone": "a"},
        gpus=[GPUUsage(index=0, memory_used_bytes=used, utilization_percent=used % 100)],
        storage=[Storage(mount_point="/w", shared=False, free_bytes=free_bytes)],
        version=1,
    )


def test_a_cached_node_view_is_kept_across_usage_figures_and_rebuilt_when_placement_inputs_change():
    cache = NodeViewCache()
    n = _node(1, 5 << 40, 100)
    v1 = cache.view(n)
    assert v1 == node_view(n)
    # A heartbeat with new GPU usage figures only: the same view.
    n.gpus = [GPUUsage(index=0, memory_used_bytes=999, utilization_percent=40)]
    n.version += 1
    assert cache.view(n) is v1
    # Free disk, a label, a state, claims: each is read by placement, so a new view.
    n.storage = [Storage(mount_point="/w", shared=False, free_bytes=1 << 40)]
    n.version += 1
    v2 = cache.view(n)
    assert v2 is not v1 and v2 == node_view(n)
    n.labels = {"zone": "b"}
    n.version += 1
    assert cache.view(n).labels == {"zone": "b"}
    n.state = NodeState.UNREACHABLE  # set without a version bump, as a test might
    assert cache.view(n).state is NodeState.UNREACHABLE
    claims = Claims(frozenset({0}), 8.0, 1)
    assert cache.view(n, claims=claims) == node_view(n, claims=claims)
