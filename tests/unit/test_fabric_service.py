"""The control plane's fabric service: agents' reports become physical fabrics,
problems and metrics; one node per InfiniBand fabric is asked for a map; `ctl
fabric-test` runs rail by rail over the agents' streams; placement is told each
node's fabric identity, leaves and degraded cables.

The agents here are a stand-in for AgentService holding Node records (the real
stream is exercised end to end in tests/e2e/test_fabrics_e2e.py); what they
report is the fixtures' real tool output, read by the real parsers.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, cast

import pytest

from llmgw.agent.discovery.commands import CommandResult
from llmgw.agent.discovery.subnet import collect_subnet_managers
from llmgw.protocol import (
    FEATURES,
    HCA,
    Ack,
    FabricAttachment,
    FabricScanReply,
    FabricScanRequest,
    FabricTestReply,
    FabricTestRequest,
    IBPort,
    Message,
    NodeInventory,
)
from llmgw.protocol.fabric_test import Grade
from llmgw.server.control.agents import AgentService, Node
from llmgw.server.control.fabric_identity import MASTER_CHANGED, METRIC_MASTER_SM
from llmgw.server.control.fabrics import FabricService, FabricTestRefused, UnknownFabric
from llmgw.server.control.fleet_metrics import FabricCollector
from llmgw.testing.ib_machine import SM_A, SM_B, map_guids, sminfo_text, smir_text

FIX = Path(__file__).resolve().parent.parent / "fixtures"
FAT_TREE = (FIX / "fabric" / "ibnetdiscover_fat_tree.txt").read_text()
DEGRADED = (FIX / "fabric" / "ibnetdiscover_fat_tree_degraded.txt").read_text()
A_GUID, B_GUID = SM_A, SM_B
FABRIC = f"ib:{A_GUID}"
SMINFO_A, SMIR_AB = sminfo_text(), smir_text()
SMINFO_B, SMIR_BA = sminfo_text(failed_over=True), smir_text(failed_over=True)
# The fat tree's adapters: host -> device -> node GUID, as ibnetdiscover printed them.
GUIDS = map_guids(FAT_TREE)


def sm_reads(ports: list[IBPort], sminfo: str = SMINFO_A, smir: str = SMIR_AB):
    def run(argv, timeout):
        out = sminfo if argv[0].endswith("sminfo") else smir
        return CommandResult(tuple(argv), 0, out, "")

    return collect_subnet_managers(ports, run, lambda name: f"/usr/sbin/{name}")


def ib_node(
    name: str,
    devices: tuple[str, ...] = ("mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"),
    *,
    rate: float = 400.0,
    sminfo: str = SMINFO_A,
    smir: str = SMIR_AB,
    features: tuple[str, ...] = FEATURES,
    state: str = "ACTIVE",
) -> Node:
    hcas = []
    for d in devices:
        guid = GUIDS.get(name, {}).get(d, "0x" + f"{abs(hash((name, d))):016x}"[:16])
        port = IBPort(hca=d, port=1, state=state, link_layer="InfiniBand", rate_gbps=rate, node_guid=guid)
        hcas.append(HCA(name=d, node_guid=guid, ports=[port]))
    node = Node(node_id=name, connected=True, features=list(features), mgmt_addr=f"10.0.0.{ord(name[-1])}")
    node.inventory = NodeInventory(adapters=hcas)
    node.fabrics = [FabricAttachment(fabric="rail", hcas=list(devices), rate_gbps=rate)]
    node.declared_fabrics = list(node.fabrics)
    node.subnet_managers = sm_reads([p for h in hcas for p in h.ports or ()], sminfo, smir)
    return node


class Agents:
    """Node records and scripted answers, in place of the agent stream."""

    def __init__(self) -> None:
        self._nodes: dict[str, Node] = {}
        self._listeners: list[Any] = []
        self.sent: list[tuple[str, Message]] = []
        self.answer: Any = None  # (node, msg) -> reply, awaited when a coroutine

    def on_report(self, fn) -> None:
        self._listeners.append(fn)

    def put(self, node: Node) -> None:
        self._nodes[node.node_id] = node
        for fn in self._listeners:
            fn(node)

    def drop(self, nid: str) -> None:
        del self._nodes[nid]

    def get(self, nid: str) -> Node | None:
        return self._nodes.get(nid)

    def nodes(self) -> list[Node]:
        return [self._nodes[k] for k in sorted(self._nodes)]

    def is_connected(self, nid: str) -> bool:
        return nid in self._nodes and self._nodes[nid].connected

    async def request(self, nid: str, msg: Message, timeout: float = 30.0, *, sent: asyncio.Event | None = None):
        self.sent.append((nid, msg))
        if sent is not None:
            sent.set()
        got = self.answer(nid, msg)
        return await got if asyncio.iscoroutine(got) else got


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def service(*nodes: Node) -> tuple[FabricService, Agents, Clock]:
    agents, clock = Agents(), Clock()
    svc = FabricService(cast(AgentService, agents), scan_interval=300.0, clock=clock)
    for n in nodes:
        agents.put(n)
    return svc, agents, clock


def test_nodes_whose_ports_list_the_same_subnet_managers_are_one_fabric_named_by_the_lowest_guid():
    svc, _, _ = service(ib_node("node-a"), ib_node("node-b"))
    reply = svc.reply()
    assert [f.id for f in reply.fabrics] == [FABRIC]
    f = reply.fabrics[0]
    assert f.declared == ["rail"]
    assert f.master is not None and f.master.guid == A_GUID and f.master.state == "master"
    assert [m.state for m in f.managers] == ["master", "standby"]
    assert len(f.members) == 8
    assert f.map is not None and f.map.scanned_at is None  # not scanned yet
    assert not [p for p in reply.problems if p.level == "fail"]


def test_a_master_change_is_a_problem_and_moves_the_master_metric():
    svc, agents, clock = service(ib_node("node-a"), ib_node("node-b"))
    clock.now += 120
    for name in ("node-a", "node-b"):
        agents.put(ib_node(name, sminfo=SMINFO_B, smir=SMIR_BA))
    reply = svc.reply()
    assert [f.id for f in reply.fabrics] == [FABRIC], "the identity survives the failover"
    f = reply.fabrics[0]
    assert [(c.old_guid, c.new_guid) for c in f.master_changes] == [(A_GUID, B_GUID)]
    changed = [p for p in reply.problems if p.kind == MASTER_CHANGED]
    assert changed and changed[0].fix
    masters = [m for m in svc.metrics() if m[0] == METRIC_MASTER_SM]
    assert masters == [(METRIC_MASTER_SM, {"fabric": FABRIC, "sm_guid": B_GUID}, 1.0)]
    # An hour on, the change is history, no longer a problem.
    clock.now += 3700
    for name in ("node-a", "node-b"):
        agents.put(ib_node(name, sminfo=SMINFO_B, smir=SMIR_BA))
    assert not [p for p in svc.reply().problems if p.kind == MASTER_CHANGED]
    assert svc.reply().fabrics[0].master_changes


def test_the_fabric_metrics_are_exported_with_every_family_even_before_any_fabric():
    empty, _, _ = service()
    names = {m.name for m in FabricCollector(empty.metrics).collect()}
    assert names == {"llmgw_fabric_master_sm", "llmgw_fabric_subnet_managers", "llmgw_fabric_problems"}
    svc, _, _ = service(ib_node("node-a"))
    fams = {m.name: m for m in FabricCollector(svc.metrics).collect()}
    standby = [s for s in fams["llmgw_fabric_subnet_managers"].samples if s.labels["state"] == "standby"]
    assert standby[0].value == 1.0 and standby[0].labels["fabric"] == FABRIC


def test_a_node_that_reports_nothing_new_is_given_to_the_registry_again_only_after_ten_minutes():
    node = ib_node("node-a")
    svc, agents, clock = service(node)
    calls = []
    real = svc.registry.ingest
    svc.registry.ingest = lambda r, now: (calls.append(now), real(r, now))[1]  # type: ignore[method-assign]
    # Counters move on every heartbeat; they are not what the registry reads.
    node.ib_ports = [p.model_copy(update={"counters": {"port_xmit_data": 10}}) for p in node.inventory.ib_ports]
    agents.put(node)
    clock.now += 61
    node.subnet_managers = node.subnet_managers.model_copy()  # a new read, saying the same
    agents.put(node)
    assert calls == []
    node.ib_ports = [node.ib_ports[0].model_copy(update={"state": "DOWN"}), *node.ib_ports[1:]]
    agents.put(node)
    assert calls == [clock.now]
    clock.now += 601
    agents.put(node)
    assert calls[-1] == clock.now


def test_a_removed_node_leaves_the_fabrics():
    svc, agents, _ = service(ib_node("node-a"), ib_node("node-b"))
    agents.drop("node-b")
    assert {m.node for m in svc.reply().fabrics[0].members} == {"node-a"}


async def test_one_node_per_fabric_is_asked_for_a_map_and_the_map_is_kept():
    svc, agents, _ = service(ib_node("node-a"), ib_node("node-b"))
    agents.answer = lambda nid, msg: FabricScanReply(id=msg.id, output=FAT_TREE, took_ms=900)
    await svc.scan_due()
    scans = [(nid, m) for nid, m in agents.sent if isinstance(m, FabricScanRequest)]
    assert len(scans) == 1 and scans[0][1].port == 1
    topo = svc.topology(FABRIC)
    assert topo["map"] is not None and topo["error"] is None
    assert len(topo["map"]["switches"]) == 6
    assert set(topo["llmgw_nodes"].values()) == {"node-a", "node-b"}
    row = svc.reply().fabrics[0].map
    assert row is not None and (row.switches, row.adapters, row.cables) == (6, 32, 64) and row.rails_aligned
    # Within the interval nothing is asked again.
    await svc.scan_due()
    assert len([m for _, m in agents.sent if isinstance(m, FabricScanRequest)]) == 1


async def test_a_failed_or_unreadable_scan_keeps_the_last_map_and_says_why():
    svc, agents, clock = service(ib_node("node-a"))
    agents.answer = lambda nid, msg: FabricScanReply(id=msg.id, output=FAT_TREE)
    await svc.scan_due()
    clock.now += 301
    agents.answer = lambda nid, msg: FabricScanReply(id=msg.id, output=FAT_TREE + "\nSomething new 1 2 3\n")
    await svc.scan_due()
    topo = svc.topology(FABRIC)
    assert topo["map"] is not None, "the last good map stays"
    assert "could not be read" in topo["error"] and "line" in topo["error"]
    clock.now += 301
    agents.answer = lambda nid, msg: FabricScanReply(id=msg.id, error="`ibnetdiscover` did not finish in 120 s")
    await svc.scan_due()
    assert "did not finish" in svc.topology(FABRIC)["error"]


async def test_a_fabric_with_no_agent_that_scans_is_said_so_and_nothing_is_asked():
    svc, agents, _ = service(ib_node("node-a", features=("logs",)))
    await svc.scan_due()
    assert agents.sent == []
    assert "no connected node" in svc.topology(FABRIC)["error"]


def test_an_unknown_fabric_id_is_refused_with_the_known_ones():
    svc, _, _ = service(ib_node("node-a"))
    with pytest.raises(UnknownFabric, match=FABRIC):
        svc.topology("ib:0x0000000000000001")


async def test_placement_facts_give_each_node_its_physical_fabric_leaves_and_degraded_cables():
    svc, agents, _ = service(ib_node("node-c"), ib_node("node-d"))
    agents.answer = lambda nid, msg: FabricScanReply(id=msg.id, output=DEGRADED)
    await svc.scan_due()
    facts = svc.facts()
    assert facts["node-c"].physical == {"rail": frozenset({FABRIC})}
    assert len(facts["node-c"].leaves) == 4 and all(len(v) == 1 for v in facts["node-c"].leaves.values())
    assert facts["node-c"].leaves["mlx5_0"] == facts["node-d"].leaves["mlx5_0"]
    assert "mlx5_2" in facts["node-c"].degraded and "HDR" in facts["node-c"].degraded["mlx5_2"]
    assert facts["node-d"].degraded == {}


def bw_answers(measured: dict[str, float], server_error: str | None = None):
    """Each rail's server answers once its client has; the client carries the figure."""
    done: dict[int, asyncio.Event] = {}

    async def answer(nid: str, msg: Message):
        assert isinstance(msg, FabricTestRequest)
        ev = done.setdefault(msg.tcp_port, asyncio.Event())
        if msg.role == "server":
            await ev.wait()
            return FabricTestReply(id=msg.id, error=server_error, gbps=None if server_error else 1.0)
        ev.set()
        gbps = measured.get(msg.hca)
        return FabricTestReply(id=msg.id, gbps=gbps, error=None if gbps else "nothing came back")

    return answer


async def test_a_fabric_test_runs_each_rail_server_first_and_grades_it_against_the_link_rate():
    svc, agents, _ = service(ib_node("node-a"), ib_node("node-b"))
    agents.answer = bw_answers({"mlx5_0": 388.2, "mlx5_1": 390.0, "mlx5_2": 250.0, "mlx5_3": 391.0})
    view = await svc.fabric_test("node-a", "node-b", None, 3)
    assert view.fabric == "rail" and not view.ok
    assert [(r.adapter, r.grade) for r in view.rails] == [
        ("mlx5_0", Grade.OK),
        ("mlx5_1", Grade.OK),
        ("mlx5_2", Grade.SLOW),
        ("mlx5_3", Grade.OK),
    ]
    reqs = [(nid, m) for nid, m in agents.sent if isinstance(m, FabricTestRequest)]
    assert [(nid, m.role, m.hca) for nid, m in reqs[:2]] == [
        ("node-b", "server", "mlx5_0"),
        ("node-a", "client", "mlx5_0"),
    ]
    client = reqs[1][1]
    assert client.peer == agents.get("node-b").mgmt_addr and client.tcp_port == reqs[0][1].tcp_port
    assert len({m.tcp_port for _, m in reqs}) == 4, "each rail on its own port"


async def test_a_rail_nothing_got_through_fails_with_both_sides_words():
    svc, agents, _ = service(ib_node("node-a", ("mlx5_0",)), ib_node("node-b", ("mlx5_0",)))
    agents.answer = bw_answers({}, server_error="no client connected within 63 s")
    view = await svc.fabric_test("node-a", "node-b", "rail", 3)
    r = view.rails[0]
    assert r.grade == Grade.FAIL and r.measured_gbps is None
    assert "nothing came back" in r.detail and "no client connected" in r.detail


async def test_a_fabric_test_is_refused_at_once_to_an_agent_without_the_feature():
    svc, agents, _ = service(ib_node("node-a"), ib_node("node-b", features=("logs", "drain")))
    agents.answer = bw_answers({})
    with pytest.raises(FabricTestRefused, match="node-b's agent .* does not run fabric tests"):
        await svc.fabric_test("node-a", "node-b", None, 3)
    assert agents.sent == []


async def test_a_fabric_test_names_the_fabrics_when_the_nodes_share_none_or_several():
    a, b = ib_node("node-a", ("mlx5_0", "mlx5_1")), ib_node("node-b", ("mlx5_0", "mlx5_1"))
    b.fabrics = [FabricAttachment(fabric="storage", hcas=["mlx5_0"])]
    svc, _, _ = service(a, b)
    with pytest.raises(FabricTestRefused, match="share no fabric"):
        await svc.fabric_test("node-a", "node-b", None, 3)
    with pytest.raises(FabricTestRefused, match="node-b does not advertise fabric 'rail'"):
        await svc.fabric_test("node-a", "node-b", "rail", 3)
    a.fabrics = [FabricAttachment(fabric="rail", hcas=["mlx5_0"]), FabricAttachment(fabric="storage", hcas=["mlx5_1"])]
    b.fabrics = [FabricAttachment(fabric="rail", hcas=["mlx5_0"]), FabricAttachment(fabric="storage", hcas=["mlx5_1"])]
    with pytest.raises(FabricTestRefused, match="choose one with --fabric"):
        await svc.fabric_test("node-a", "node-b", None, 3)


async def test_a_fabric_test_refuses_bad_seconds_one_node_and_unknown_nodes():
    svc, _, _ = service(ib_node("node-a"), ib_node("node-b"))
    with pytest.raises(FabricTestRefused, match="from 1 to 30"):
        await svc.fabric_test("node-a", "node-b", None, 31)
    with pytest.raises(FabricTestRefused, match="needs two nodes"):
        await svc.fabric_test("node-a", "node-a", None, 3)
    with pytest.raises(FabricTestRefused, match="no node 'node-z'"):
        await svc.fabric_test("node-a", "node-z", None, 3)


async def test_an_adapter_missing_on_b_or_down_fails_its_rail_and_the_others_still_run():
    a = ib_node("node-a", ("mlx5_0", "mlx5_1", "mlx5_2"))
    b = ib_node("node-b", ("mlx5_0", "mlx5_1"))
    b.inventory.adapters[1].ports[0] = b.inventory.adapters[1].ports[0].model_copy(update={"state": "DOWN"})
    svc, agents, _ = service(a, b)
    agents.answer = bw_answers({"mlx5_0": 395.0})
    view = await svc.fabric_test("node-a", "node-b", None, 3)
    by = {r.adapter: r for r in view.rails}
    assert by["mlx5_0"].grade == Grade.OK
    assert by["mlx5_1"].grade == Grade.FAIL and "no ACTIVE port" in by["mlx5_1"].detail
    assert by["mlx5_2"].grade == Grade.FAIL and "node-b has no mlx5_2" in by["mlx5_2"].detail


async def test_a_refusing_agent_fails_the_rail_with_its_words():
    svc, agents, _ = service(ib_node("node-a", ("mlx5_0",)), ib_node("node-b", ("mlx5_0",)))
    agents.answer = lambda nid, msg: Ack(id=msg.id, ok=False, error="a fabric test is already running here")
    view = await svc.fabric_test("node-a", "node-b", None, 3)
    assert view.rails[0].grade == Grade.FAIL and "already running" in view.rails[0].detail
