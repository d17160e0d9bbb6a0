"""NVLink domains as racks: which GPUs make a rack, which tray is joined, and
what keeps a tray out, in words an operator can act on.

Fabric values are spelled as `nvidia-smi -q` prints them (State Completed /
In Progress, Status Success, Bandwidth Full / Degraded), as the agent's parser
(llmgw/agent/discovery/fabric.py) hands them on.
"""

from __future__ import annotations

import json

import pytest

from llmgw.errors import LlmgwError
from llmgw.protocol import (
    GPU,
    IMEX,
    PROTOCOL_VERSION,
    GPUFabric,
    GPUUsage,
    Heartbeat,
    Host,
    NodeInventory,
    Register,
)
from llmgw.server.control.agents import AgentService
from llmgw.server.control.nvlink import (
    NodeNVLink,
    NVLinkError,
    from_node,
    racks,
    to_json,
    unplaced,
)

RACK_A = "5c3e1a2b-7f64-4d0e-9a1b-2c3d4e5f6a7b"
RACK_B = "0b9d8c7e-6f5a-4b3c-8d2e-1f0a9b8c7d6e"
ZERO = "00000000-0000-0000-0000-000000000000"
ACTIVE = IMEX(state="active", channels=1)


def gpu(
    index: int,
    cluster: str | None = RACK_A,
    clique: str | None = "32766",
    state: str = "Completed",
    status: str | None = "Success",
    bandwidth: str | None = "Full",
) -> GPU:
    return GPU(
        index=index,
        uuid=f"GPU-{cluster or 'none'}-{index}",
        name="NVIDIA GB200",
        fabric=GPUFabric(state=state, status=status, cluster_uuid=cluster, clique_id=clique, bandwidth=bandwidth),
    )


def tray(name: str, gpus: list[GPU] | None = None, imex: IMEX | None = ACTIVE, fm: str | None = None) -> NodeNVLink:
    return NodeNVLink(
        node=name, gpus=gpus if gpus is not None else [gpu(i) for i in range(4)], imex=imex, fabric_manager=fm
    )


def nvl72(cluster: str = RACK_A, prefix: str = "gb200-") -> list[NodeNVLink]:
    return [tray(f"{prefix}{t}", [gpu(i, cluster=cluster) for i in range(4)]) for t in range(1, 19)]


def only(nodes: list[NodeNVLink]):
    (rack,) = racks(nodes)
    return rack


def tray_of(rack, node: str):
    (t,) = [t for t in rack.trays if t.node == node]
    return t


def test_an_nvl72_rack_of_eighteen_joined_trays_is_one_rack_with_every_gpu_joined():
    rack = only(nvl72())
    assert rack.id == RACK_A
    assert len(rack.trays) == 18
    assert (rack.gpus_joined, rack.gpus_total) == (72, 72)
    assert rack.joined and not rack.degraded
    assert all(t.joined and t.ready and not t.problems for t in rack.trays)
    assert [(p.clique_id, p.domain, len(p.nodes), p.gpus_total) for p in rack.partitions] == [
        ("32766", f"{RACK_A}/32766", 18, 72)
    ]
    # Trays stand in the rack by number, not by string order (gb200-2 above gb200-10).
    assert [t.node for t in rack.trays][:3] == ["gb200-1", "gb200-2", "gb200-3"]
    assert rack.trays[-1].node == "gb200-18"


def test_a_gpu_still_in_progress_keeps_its_tray_out_and_says_how_to_find_out_why():
    nodes = nvl72()
    nodes[4] = tray("gb200-5", [gpu(0), gpu(1), gpu(2, state="In Progress", status="N/A"), gpu(3)])
    rack = only(nodes)
    t = tray_of(rack, "gb200-5")
    assert not t.joined and not t.ready and not rack.joined
    assert (t.gpus_joined, len(t.gpus)) == (3, 4)
    assert (rack.gpus_joined, rack.gpus_total) == (71, 72)
    assert [g.joined for g in t.gpus] == [True, True, False, True]
    (problem,) = t.problems
    assert "GPU 2 has not joined" in problem and "In Progress" in problem
    assert "nvidia-smi -q -d FABRIC" in problem and "gb200-5" in problem


def test_a_gpu_that_names_no_cluster_yet_still_sits_on_its_nodes_tray():
    # nvidia-smi leaves ClusterUUID N/A (parsed as absent) until the join completes.
    nodes = [
        tray("gb200-1"),
        tray("gb200-2", [gpu(0), gpu(1), gpu(2), gpu(3, cluster=None, clique=None, state="In Progress")]),
    ]
    rack = only(nodes)
    t = tray_of(rack, "gb200-2")
    assert [g.index for g in t.gpus] == [0, 1, 2, 3]
    assert not t.gpus[3].joined and t.cliques == ("32766",)
    assert unplaced(nodes) == []


def test_a_join_that_completed_with_a_failure_status_is_not_joined():
    rack = only([tray("gb200-1", [gpu(0), gpu(1, status="Failure"), gpu(2), gpu(3)])])
    t = rack.trays[0]
    assert not t.gpus[1].joined and not t.joined
    assert any("GPU 1's NVLink fabric join ended with Failure" in p for p in t.problems)


def test_imex_down_on_one_tray_is_a_problem_that_says_to_start_it_and_keeps_the_tray_not_ready():
    nodes = nvl72()
    nodes[2] = tray("gb200-3", imex=IMEX(state="inactive", channels=1))
    rack = only(nodes)
    t = tray_of(rack, "gb200-3")
    assert t.joined  # its GPUs did join; IMEX is what keeps it out
    assert not t.ready
    (problem,) = t.problems
    assert "nvidia-imex is inactive" in problem
    assert "start nvidia-imex: systemctl start nvidia-imex" in problem
    assert all(not o.problems for o in rack.trays if o.node != "gb200-3")


def test_imex_missing_or_without_a_channel_is_a_problem_too():
    missing = tray_of(only([tray("gb200-1", imex=None)]), "gb200-1")
    assert any("not installed" in p and "systemctl start nvidia-imex" in p for p in missing.problems)
    no_channel = tray_of(only([tray("gb200-1", imex=IMEX(state="active", channels=0))]), "gb200-1")
    assert any("no IMEX channel" in p and "NVreg_CreateImexChannel0" in p for p in no_channel.problems)


def test_degraded_bandwidth_marks_the_tray_and_rack_and_says_to_check_the_cables():
    nodes = nvl72()
    nodes[7] = tray("gb200-8", [gpu(0), gpu(1, bandwidth="Degraded"), gpu(2), gpu(3, bandwidth="Degraded")])
    rack = only(nodes)
    t = tray_of(rack, "gb200-8")
    assert rack.degraded and t.degraded
    assert t.joined and t.ready  # slower, still usable
    assert [g.degraded for g in t.gpus] == [False, True, False, True]
    (problem,) = t.problems
    assert problem.startswith("bandwidth Degraded on GPU 1, 3: check NVLink cables/trays")
    assert not tray_of(rack, "gb200-1").degraded


def test_the_fabric_manager_stopped_is_a_problem_only_where_it_can_be_the_cause():
    # On NVL72 the fabric manager lives on the switch trays: a compute tray's
    # unit inactive with every card joined is normal.
    fine = tray_of(only([tray("gb200-1", fm="inactive")]), "gb200-1")
    assert fine.problems == ()
    stuck = tray_of(only([tray("gb200-1", [gpu(0, state="In Progress")], fm="inactive")]), "gb200-1")
    assert any(
        "nvidia-fabricmanager is inactive" in p and "systemctl enable --now nvidia-fabricmanager" in p
        for p in stuck.problems
    )
    failed = tray_of(only([tray("gb200-1", fm="failed")]), "gb200-1")
    assert any("nvidia-fabricmanager is failed" in p for p in failed.problems)
    unknown = tray_of(only([tray("gb200-1", [gpu(0, state="In Progress")], fm=None)]), "gb200-1")
    assert not any("fabricmanager" in p for p in unknown.problems)


def test_two_clusters_are_two_racks_ordered_by_id():
    nodes = nvl72(RACK_A, "a-") + nvl72(RACK_B, "b-")
    got = racks(nodes)
    assert [r.id for r in got] == sorted([RACK_A, RACK_B])
    assert {r.id: {t.node[:2] for t in r.trays} for r in got} == {RACK_A: {"a-"}, RACK_B: {"b-"}}
    assert all((r.gpus_joined, r.gpus_total) == (72, 72) for r in got)


def test_a_single_chassis_hgx_with_an_all_zero_cluster_is_not_a_rack_nor_unplaced():
    hgx = NodeNVLink(node="hgx-1", gpus=[gpu(i, cluster=ZERO, clique="0") for i in range(8)], imex=None)
    assert racks([hgx]) == []
    assert unplaced([hgx]) == []
    assert [r.id for r in racks([hgx, *nvl72()])] == [RACK_A]


def test_two_cliques_in_one_cluster_are_two_partitions_and_a_split_tray_is_flagged():
    nodes = [tray(f"gb200-{t}", [gpu(i, clique="1") for i in range(4)]) for t in (1, 2)]
    nodes += [tray(f"gb200-{t}", [gpu(i, clique="2") for i in range(4)]) for t in (3, 4)]
    nodes.append(tray("gb200-5", [gpu(0, clique="1"), gpu(1, clique="1"), gpu(2, clique="2"), gpu(3, clique="2")]))
    rack = only(nodes)
    assert [(p.clique_id, p.nodes, p.gpus_total) for p in rack.partitions] == [
        ("1", ("gb200-1", "gb200-2", "gb200-5"), 10),
        ("2", ("gb200-3", "gb200-4", "gb200-5"), 10),
    ]
    split = tray_of(rack, "gb200-5")
    assert split.cliques == ("1", "2") and split.joined and not split.ready
    (problem,) = split.problems
    assert "2 cliques" in problem and "clique 1: GPU 0, 1" in problem and "clique 2: GPU 2, 3" in problem
    assert tray_of(rack, "gb200-1").ready


def test_a_gpu_with_a_fabric_but_no_cluster_on_a_node_no_rack_holds_is_unplaced_with_the_reason():
    lone = tray("lone-1", [gpu(0, cluster=None, clique=None, state="In Progress", status=None), GPU(index=1)])
    assert racks([lone]) == []
    (u,) = unplaced([lone])
    assert (u.node, u.index, u.state) == ("lone-1", 0, "In Progress")
    assert "has not joined any NVLink domain" in u.reason and "nvidia-smi -q -d FABRIC" in u.reason


def test_one_node_listed_twice_is_refused_as_an_llmgw_error():
    with pytest.raises(NVLinkError) as e:
        racks([tray("gb200-1"), tray("gb200-1")])
    assert isinstance(e.value, LlmgwError)


def test_to_json_is_stable_and_serialisable_whatever_order_the_nodes_came_in():
    nodes = nvl72(RACK_A, "a-") + nvl72(RACK_B, "b-")
    nodes[0] = tray("a-1", [gpu(3), gpu(1, bandwidth="Degraded"), gpu(0), gpu(2)])
    nodes.append(tray("lone", [gpu(0, cluster=None, clique=None, state="In Progress")]))
    body = to_json(racks(nodes), unplaced(nodes))
    again = to_json(racks(list(reversed(nodes))), unplaced(list(reversed(nodes))))
    assert json.dumps(body, sort_keys=False) == json.dumps(again, sort_keys=False)
    rack = body["racks"][[r["id"] for r in body["racks"]].index(RACK_A)]
    first = rack["trays"][0]
    assert first["node"] == "a-1" and [g["index"] for g in first["gpus"]] == [0, 1, 2, 3]
    assert first["degraded"] and rack["degraded"] and first["problems"]
    assert first["imex"] == {"state": "active", "channels": 1}
    assert (rack["gpus_joined"], rack["gpus_total"]) == (72, 72)
    assert body["unplaced"][0]["node"] == "lone"


def test_from_node_reads_the_inventory_with_the_latest_heartbeats_fabric_and_imex():
    svc = AgentService()
    inv = NodeInventory(
        host=Host(cpus=144),
        gpus=[gpu(0, state="In Progress", status=None), gpu(1), GPU(index=2, name="no fabric")],
        imex=IMEX(state="inactive", channels=1),
    )
    svc._apply_register(Register(node_id="gb200-1", protocol_version=PROTOCOL_VERSION, inventory=inv), None)
    svc._apply_heartbeat(
        svc.get("gb200-1"),
        Heartbeat(
            gpus=[GPUUsage(index=0, fabric=gpu(0).fabric), GPUUsage(index=1)],
            imex=IMEX(state="active", channels=1),
        ),
    )
    n = from_node(svc.get("gb200-1"))
    assert n.node == "gb200-1" and n.fabric_manager is None
    assert n.imex == IMEX(state="active", channels=1)
    assert [(g.index, g.fabric.state if g.fabric else None) for g in n.gpus] == [
        (0, "Completed"),  # the heartbeat's re-read, not the registration's
        (1, "Completed"),
        (2, None),
    ]
    t = only([n]).trays[0]
    assert t.joined and t.ready and [g.index for g in t.gpus] == [0, 1]


def test_from_node_on_a_node_that_reported_no_inventory_gives_no_gpus():
    svc = AgentService()
    svc._apply_register(Register(node_id="cpu-1", protocol_version=PROTOCOL_VERSION), None)
    n = from_node(svc.get("cpu-1"), fabric_manager="active")
    assert (n.gpus, n.imex, n.fabric_manager) == ([], None, "active")
    assert racks([n]) == [] and unplaced([n]) == []
