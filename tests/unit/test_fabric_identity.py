"""The control plane's fabric identity: subnet managers listed together are one
InfiniBand fabric named by the lowest GUID, RoCE ports one fabric per network,
and the problems an operator is shown, each with what to do.

Subnet-manager reads come from doctor's fixtures (tests/fixtures/doctor/README.md
says what each is), run through the agent's own collector and parsers
(llmgw/agent/discovery/subnet.py); where a second subnet or a failover is needed, the
fixture text is rewritten (GUIDs, states) and still read by the real parser.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from llmgw.agent.discovery.commands import CommandResult
from llmgw.agent.discovery.subnet import collect_subnet_managers, parse_sminfo, parse_smir
from llmgw.errors import LlmgwError
from llmgw.protocol.doctor import PortSubnetManagers, SubnetManagers
from llmgw.protocol.inventory import HCA, IBPort
from llmgw.server.control.fabric_identity import (
    HISTORY_S,
    INFINIBAND,
    KINDS,
    MASTER_CHANGED,
    MASTER_DISAGREEMENT,
    METRIC_MASTER_SM,
    METRIC_PROBLEMS,
    METRIC_SUBNET_MANAGERS,
    NAME_ON_TWO_FABRICS,
    NO_MANAGER,
    NO_STANDBY,
    NODE_UNCHECKED,
    RECENT_CHANGE_S,
    ROCE,
    TWO_NAMES_ON_ONE_FABRIC,
    UNDECLARED_ADAPTER,
    FabricIdentityError,
    FabricRegistry,
    NodeFabricReport,
    Problem,
    normalize_guid,
)

FIX = Path(__file__).resolve().parent.parent / "fixtures" / "doctor"
T0 = 1_700_000_000.0

# The fixtures' two SMs: A the master (priority 15), B its standby (14).
A, B = "0x248a070300f7d3a0", "0x248a070300f7d3c8"
# A third SM (above both) and a second subnet's pair (below both).
C = "0x248a070300f7d3f0"
X, Y = "0x0c42a10300aa0010", "0x0c42a10300aa0020"


def fx(name: str) -> str:
    return (FIX / name).read_text()


SMINFO_A = fx("sminfo_master.txt")
SMINFO_B_MASTER = fx("sminfo_lid2_standby.txt").replace("state 2 SMINFO_STANDBY", "state 3 SMINFO_MASTER")
SMIR_AB = fx("saquery_smir_master_standby.txt")
SMIR_A_ONLY = fx("saquery_smir_master_only.txt")
SMIR_A_NOTACT = fx("saquery_smir_master_notactive.txt")


def swap_states(smir: str) -> str:
    """The SMIR dump after a failover: the master standby, the standby master."""
    return (
        smir.replace("SMState...............3", "@")
        .replace("SMState...............2", "SMState...............3")
        .replace("@", "SMState...............2")
    )


def regid(text: str, mapping: Mapping[str, str]) -> str:
    for old, new in mapping.items():
        text = text.replace(old, new)
    return text


SMIR_BA_AFTER_FAILOVER = swap_states(SMIR_AB)
SMIR_B_ONLY = regid(SMIR_A_ONLY, {A: B}).replace("LID...................1", "LID...................2")
SMIR_XY = regid(SMIR_AB, {A: X, B: Y})
SMINFO_X = regid(SMINFO_A, {A: X})
SMIR_BC = regid(SMIR_BA_AFTER_FAILOVER, {A: C})  # B master, C standby: A not listed

OK = 0
NO_UMAD = CommandResult(("sminfo",), 255, fx("sminfo_no_umad.stdout"), fx("sminfo_no_umad.stderr"))
NO_SA = CommandResult(("saquery",), 255, "", fx("saquery_no_sa.stderr"))


def ib_port(hca: str, state: str = "ACTIVE", port: int = 1, rate: float = 400.0) -> IBPort:
    return IBPort(hca=hca, port=port, state=state, link_layer="InfiniBand", rate_gbps=rate, sm_lid=1)


def roce_port(hca: str, network: str | None, state: str = "ACTIVE") -> IBPort:
    return IBPort(hca=hca, port=1, state=state, link_layer="Ethernet", rate_gbps=100.0, network=network, gid_index=3)


def adapters(ports: Sequence[IBPort]) -> list[HCA]:
    by: dict[str, list[IBPort]] = {}
    for p in ports:
        by.setdefault(p.hca, []).append(p)
    return [HCA(name=name, ports=ps) for name, ps in by.items()]


def collected(
    ports: Sequence[IBPort],
    sminfo: str | CommandResult | Mapping[str, str | CommandResult] = SMINFO_A,
    smir: str | CommandResult = SMIR_AB,
    tools: Sequence[str] = ("sminfo", "saquery"),
) -> SubnetManagers | None:
    """What the agent's collector reads, its tools answering with the given texts."""

    def run(argv: Sequence[str], timeout: float) -> CommandResult:
        hca, args = argv[2], tuple(argv[5:])
        if argv[0].endswith("sminfo"):
            said = sminfo[hca] if isinstance(sminfo, Mapping) else sminfo
        elif args == ("SMIR",):
            said = smir
        else:  # saquery -s: this SA serves nothing either
            said = NO_SA
        if isinstance(said, CommandResult):
            return CommandResult(tuple(argv), said.returncode, said.stdout, said.stderr)
        return CommandResult(tuple(argv), OK, said)

    return collect_subnet_managers(ports, run, lambda t: f"/usr/sbin/{t}" if t in tools else None)


def ib_report(
    node: str,
    hcas: Sequence[str] = ("mlx5_0", "mlx5_1"),
    declared: Mapping[str, Sequence[str]] | None = None,
    extra: Sequence[IBPort] = (),
    **reads: object,
) -> NodeFabricReport:
    """A node whose InfiniBand adapters are all declared under ib-compute unless said otherwise."""
    ports = [ib_port(h) for h in hcas]
    sms = collected(ports, **reads)  # type: ignore[arg-type]
    return NodeFabricReport(
        node=node,
        hcas=adapters([*ports, *extra]),
        subnet_managers=sms,
        declared={"ib-compute": list(hcas)} if declared is None else declared,
    )


def kinds(problems: Sequence[Problem]) -> list[str]:
    return [p.kind for p in problems]


def only(problems: Sequence[Problem], kind: str) -> Problem:
    found = [p for p in problems if p.kind == kind]
    assert len(found) == 1, problems
    return found[0]


def assert_explained(problems: Sequence[Problem]) -> None:
    for p in problems:
        assert p.kind in KINDS and p.message and p.fix, p


def registry(*reports: NodeFabricReport, now: float = T0) -> FabricRegistry:
    reg = FabricRegistry()
    for r in reports:
        reg.update(r, now)
    return reg


# -- identity


def test_managers_listed_together_are_one_fabric_named_by_the_lowest_guid_with_its_master_and_members():
    reg = registry(ib_report("node-a"), ib_report("node-b"))
    [f] = reg.fabrics()
    assert f.id == f"ib:{A}" and f.kind == INFINIBAND
    assert f.master is not None and (f.master.guid, f.master.lid, f.master.priority) == (A, 1, 15)
    assert [(m.guid, m.lid, m.priority, m.state_label) for m in f.managers] == [
        (A, 1, 15, "master"),
        (B, 2, 14, "standby"),
    ]
    assert [m.guid for m in f.standbys] == [B]
    assert [(m.node, m.hca, m.port) for m in f.members] == [
        ("node-a", "mlx5_0", 1),
        ("node-a", "mlx5_1", 1),
        ("node-b", "mlx5_0", 1),
        ("node-b", "mlx5_1", 1),
    ]
    assert f.declared == ("ib-compute",)
    assert reg.fabric_of("node-b", "mlx5_1", 1) == f"ib:{A}"
    assert reg.problems() == []


def test_managers_are_joined_transitively_through_ports_that_share_one():
    # node-a lists A and B; node-c, mid-failover, lists B and C only. One
    # subnet: named by A, which node-c never saw.
    reg = registry(
        ib_report("node-a"),
        ib_report("node-c", sminfo=SMINFO_B_MASTER, smir=SMIR_BC),
    )
    [f] = reg.fabrics()
    assert f.id == f"ib:{A}"
    assert [m.guid for m in f.managers] == [A, B, C]
    assert {m.node for m in f.members} == {"node-a", "node-c"}


def test_subnets_with_no_manager_in_common_are_separate_fabrics():
    reg = registry(ib_report("node-a"), ib_report("node-x", sminfo=SMINFO_X, smir=SMIR_XY, declared={"ib-x": []}))
    assert [f.id for f in reg.fabrics()] == [f"ib:{X}", f"ib:{A}"]


def test_guids_in_any_spelling_are_one_manager():
    assert normalize_guid("248A:0703:00F7:D3A0") == A == normalize_guid("0x248A070300F7D3A0")
    assert normalize_guid("0x0") is None and normalize_guid("") is None and normalize_guid("zz") is None


def test_roce_ports_are_one_fabric_per_network_and_have_no_subnet_managers():
    def node(name: str, network: str | None) -> NodeFabricReport:
        return NodeFabricReport(
            node=name, hcas=adapters([roce_port("mlx5_2", network)]), declared={"roce-a": ["mlx5_2"]}
        )

    reg = registry(
        node("node-a", "10.20.0.0/24"),
        node("node-b", "10.20.0.0/24"),
        node("node-c", "10.30.0.0/24"),
        node("node-d", None),  # no IPv4 RoCE v2 address: on no fabric known
    )
    fabrics = reg.fabrics()
    assert [(f.id, f.kind, f.network, [m.node for m in f.members]) for f in fabrics] == [
        ("roce:10.20.0.0/24", ROCE, "10.20.0.0/24", ["node-a", "node-b"]),
        ("roce:10.30.0.0/24", ROCE, "10.30.0.0/24", ["node-c"]),
    ]
    assert all(f.managers == () and f.master is None for f in fabrics)
    assert reg.fabric_of("node-d", "mlx5_2", 1) is None
    # One name on two RoCE networks is the same mistake as on two subnets.
    assert kinds(reg.problems()) == [NAME_ON_TWO_FABRICS]
    assert not [m for m in reg.metrics() if m[0] != METRIC_PROBLEMS]


# -- master changes and history


def failover(reg: FabricRegistry, at: float, nodes: Sequence[str] = ("node-a", "node-b")) -> None:
    for n in nodes:
        reg.update(ib_report(n, sminfo=SMINFO_B_MASTER, smir=SMIR_BA_AFTER_FAILOVER), at)


def test_the_fabric_keeps_its_id_through_a_master_change_which_is_recorded_once_every_port_agrees():
    reg = registry(ib_report("node-a"), ib_report("node-b"))
    reg.update(ib_report("node-a", sminfo=SMINFO_B_MASTER, smir=SMIR_BA_AFTER_FAILOVER), T0 + 30)
    # Heartbeats straddle the failover: the ports disagree, and nothing is counted yet.
    assert kinds(reg.problems()) == [MASTER_DISAGREEMENT]
    assert reg.master_changes() == []
    reg.update(ib_report("node-b", sminfo=SMINFO_B_MASTER, smir=SMIR_BA_AFTER_FAILOVER), T0 + 45)
    [f] = reg.fabrics()
    assert f.id == f"ib:{A}"
    assert f.master is not None and f.master.guid == B
    assert [(c.fabric_id, c.at, c.old_guid, c.new_guid) for c in f.master_changes] == [(f"ib:{A}", T0 + 45, A, B)]
    p = only(reg.problems(), MASTER_CHANGED)
    assert p.fabric_id == f"ib:{A}" and A in p.message and B in p.message and "0 s ago" in p.message
    assert "opensm" in p.fix and A in p.fix
    # The old master is standby now, so the standby check is satisfied.
    assert kinds(reg.problems()) == [MASTER_CHANGED]
    # Later heartbeats under the same master record nothing more.
    failover(reg, T0 + 60)
    assert len(reg.master_changes()) == 1


def test_the_fabric_keeps_its_id_for_a_day_after_the_old_master_drops_out_of_the_listing():
    reg = registry(ib_report("node-a"))
    reg.update(ib_report("node-a", sminfo=SMINFO_B_MASTER, smir=SMIR_B_ONLY), T0 + 60)
    [f] = reg.fabrics()
    assert f.id == f"ib:{A}" and [m.guid for m in f.managers] == [B]
    assert kinds(reg.problems()) == [NO_STANDBY, MASTER_CHANGED]
    # A day without anyone listing A: the name is B's.
    reg.update(ib_report("node-a", sminfo=SMINFO_B_MASTER, smir=SMIR_B_ONLY), T0 + HISTORY_S + 61)
    assert [f.id for f in reg.fabrics()] == [f"ib:{B}"]


def test_a_master_change_is_a_problem_for_an_hour_and_listed_for_a_day_then_pruned():
    reg = registry(ib_report("node-a"), ib_report("node-b"))
    failover(reg, T0 + 100)
    assert MASTER_CHANGED in kinds(reg.problems(now=T0 + 100 + RECENT_CHANGE_S - 1))
    assert "60 min ago" in only(reg.problems(now=T0 + 100 + RECENT_CHANGE_S - 1), MASTER_CHANGED).message
    later = T0 + 100 + RECENT_CHANGE_S + 1
    failover(reg, later)
    assert reg.problems() == []
    assert len(reg.fabrics()[0].master_changes) == 1
    # Read a day on without an update, it is no longer listed; after an update a day on, it is gone.
    assert reg.fabrics(now=T0 + 101 + HISTORY_S)[0].master_changes == ()
    failover(reg, T0 + 101 + HISTORY_S)
    assert reg.master_changes() == [] and reg.master_changes(now=T0) == []


def test_several_changes_in_the_hour_are_counted_in_one_problem():
    reg = registry(ib_report("node-a"))
    reg.update(ib_report("node-a", sminfo=SMINFO_B_MASTER, smir=SMIR_BA_AFTER_FAILOVER), T0 + 60)
    reg.update(ib_report("node-a"), T0 + 120)
    p = only(reg.problems(), MASTER_CHANGED)
    assert f"from {B} to {A}" in p.message and "2 changes in the last hour" in p.message


# -- subnet-manager problems


def test_ports_disagreeing_on_the_master_are_flagged_with_each_master_and_the_ports_naming_it():
    reg = registry(
        ib_report("node-a"),
        ib_report("node-b"),
        ib_report("node-c", hcas=["mlx5_0"], sminfo=SMINFO_B_MASTER, smir=SMIR_BA_AFTER_FAILOVER),
        ib_report("node-d"),
    )
    p = only(reg.problems(), MASTER_DISAGREEMENT)
    assert p.fabric_id == f"ib:{A}" and p.level == "fail"
    assert (
        f"{A} by node-a mlx5_0/1, node-a mlx5_1/1, node-b mlx5_0/1, node-b mlx5_1/1 and 2 more; {B} by node-c mlx5_0/1"
        in p.message
    )
    assert "split" in p.fix
    [f] = reg.fabrics()
    assert f.master is not None and f.master.guid == A  # what most ports say


def test_a_fabric_whose_only_manager_is_the_master_has_no_standby():
    reg = registry(ib_report("node-a", smir=SMIR_A_ONLY))
    p = only(reg.problems(), NO_STANDBY)
    assert p.fabric_id == f"ib:{A}" and A in p.message and "priority 15" in p.message
    assert p.fix.startswith("start a standby opensm on a second switch or host")
    assert "priority below the master's 15" in p.fix and "opensm -p 14" in p.fix


def test_a_manager_listed_but_not_active_is_no_standby():
    reg = registry(ib_report("node-a", smir=SMIR_A_NOTACT))
    p = only(reg.problems(), NO_STANDBY)
    assert f"also listed, but not standby: {B} (lid 2, priority 14, not_active)" in p.message
    assert "restart the SM listed but not standby" in p.fix


def test_a_fabric_whose_managers_could_not_be_listed_says_its_standby_is_unknown():
    reg = registry(ib_report("node-a", smir=NO_SA))
    p = only(reg.problems(), NODE_UNCHECKED)
    assert (p.fabric_id, p.node) == (f"ib:{A}", "node-a")
    assert "No SM/SA found on port" in p.message and "standby" in p.message
    assert "saquery -C mlx5_0 -P 1 SMIR" in p.fix
    assert NO_STANDBY not in kinds(reg.problems())


def test_an_active_port_whose_manager_could_not_be_read_is_up_with_no_manager():
    reg = registry(ib_report("node-a", sminfo={"mlx5_0": SMINFO_A, "mlx5_1": NO_UMAD}))
    p = only(reg.problems(), NO_MANAGER)
    assert (p.fabric_id, p.node) == (None, "node-a")
    assert "node-a mlx5_1/1 is ACTIVE but its subnet manager could not be read" in p.message
    assert "is ib_umad module loaded?" in p.message
    assert "modprobe ib_umad" in p.fix
    assert [(m.hca, m.port) for m in reg.fabrics()[0].members] == [("mlx5_0", 1)]


def test_an_active_port_where_sminfo_found_no_manager_says_start_one():
    sms = SubnetManagers(ports=[PortSubnetManagers(hca="mlx5_0", port=1)])
    report = NodeFabricReport(
        node="node-a", hcas=adapters([ib_port("mlx5_0")]), subnet_managers=sms, declared={"ib": ["mlx5_0"]}
    )
    p = only(registry(report).problems(), NO_MANAGER)
    assert "sminfo found no subnet manager" in p.message and "start opensm" in p.fix


def test_an_init_port_is_up_with_no_manager():
    reg = registry(
        ib_report(
            "node-a", extra=[ib_port("mlx5_3", state="INIT")], declared={"ib-compute": ["mlx5_0", "mlx5_1", "mlx5_3"]}
        )
    )
    p = only(reg.problems(), NO_MANAGER)
    assert "node-a mlx5_3/1 is INIT" in p.message and "systemctl enable --now opensm" in p.fix


def test_missing_infiniband_diags_makes_the_node_unchecked_and_says_install_it():
    reg = registry(ib_report("node-a", tools=()))
    assert kinds(reg.problems()) == [NODE_UNCHECKED]
    p = reg.problems()[0]
    assert (p.fabric_id, p.node) == (None, "node-a")
    assert "sminfo and saquery are not installed" in p.message
    assert "install infiniband-diags on node-a" in p.fix
    assert reg.fabrics() == []  # its ports are on no fabric known


def test_without_saquery_the_masters_are_still_read_and_the_node_is_flagged():
    reg = registry(ib_report("node-a", tools=("sminfo",)))
    p = only(reg.problems(), NODE_UNCHECKED)
    assert "saquery is not installed" in p.message and "install infiniband-diags" in p.fix
    [f] = reg.fabrics()
    assert f.id == f"ib:{A}" and not f.managers_listed
    assert NO_STANDBY not in kinds(reg.problems())


def test_a_node_whose_check_failed_is_flagged_with_its_error():
    report = NodeFabricReport(
        node="node-a",
        hcas=adapters([ib_port("mlx5_0")]),
        subnet_managers=collected([ib_port("mlx5_0")]),
        declared={"ib": ["mlx5_0"]},
        checked=False,
        error="the subnet-manager check timed out",
    )
    reg = registry(report)
    p = only(reg.problems(), NODE_UNCHECKED)
    assert p.message == "node-a's fabrics cannot be checked: the subnet-manager check timed out"
    assert "llmgw doctor" in p.fix
    assert reg.fabrics() == []  # its reads are not trusted
    told = NodeFabricReport(node="node-b", checked=False, error="sminfo: not found; install infiniband-diags")
    assert "install infiniband-diags on node-b" in only(registry(told).problems(), NODE_UNCHECKED).fix


def test_a_node_that_sent_no_subnet_managers_for_its_active_ib_ports_cannot_be_checked():
    report = NodeFabricReport(node="node-a", hcas=adapters([ib_port("mlx5_0")]), declared={"ib": ["mlx5_0"]})
    p = only(registry(report).problems(), NODE_UNCHECKED)
    assert "reported no subnet managers for its 1 ACTIVE InfiniBand port," in p.message and "upgrade" in p.fix


# -- declared names


def test_one_declared_name_on_two_physical_fabrics_is_flagged_with_both():
    reg = registry(
        ib_report("node-a"),
        ib_report("node-x", hcas=["mlx5_0"], sminfo=SMINFO_X, smir=SMIR_XY),
    )
    p = only(reg.problems(), NAME_ON_TWO_FABRICS)
    assert (p.fabric_id, p.level) == (None, "fail")
    assert f"'ib-compute' is on 2 physical fabrics: ib:{X} (node-x mlx5_0/1); ib:{A} (node-a mlx5_0/1" in p.message
    assert "its own name" in p.fix


def test_two_declared_names_on_one_physical_fabric_are_flagged_and_the_fix_keeps_the_commoner_name():
    reg = registry(
        ib_report("node-a"),
        ib_report("node-b"),
        ib_report("node-c", declared={"compute": ["mlx5_0", "mlx5_1"]}),
        ib_report("node-d", hcas=["mlx5_0"], declared={}),
    )
    p = only(reg.problems(), TWO_NAMES_ON_ONE_FABRIC)
    assert p.fabric_id == f"ib:{A}"
    assert "'compute' (node-c mlx5_0/1, node-c mlx5_1/1)" in p.message
    assert p.fix == "use one name for it on every node: rename 'compute' to 'ib-compute' in agent.yaml on node-c"
    assert reg.fabrics()[0].declared == ("compute", "ib-compute")
    # An undeclared adapter on it is told the name most of its ports carry.
    assert "name: ib-compute," in only(reg.problems(), UNDECLARED_ADAPTER).fix


def test_an_active_adapter_in_no_declared_fabric_is_flagged_with_the_name_to_add_it_under():
    reg = registry(
        ib_report("node-a"),
        ib_report("node-b", declared={"ib-compute": ["mlx5_0"]}, extra=[ib_port("mlx5_7", state="DOWN")]),
    )
    p = only(reg.problems(), UNDECLARED_ADAPTER)
    assert (p.fabric_id, p.node) == (f"ib:{A}", "node-b")
    assert f"adapter mlx5_1 on node-b is up (mlx5_1/1 ACTIVE on ib:{A})" in p.message
    assert "fabrics: [{name: ib-compute, hcas: [mlx5_1]}]" in p.fix
    # mlx5_7 is down: undeclared, but nothing would use it anyway.


def test_a_node_declaring_nothing_has_each_active_adapter_flagged():
    reg = registry(ib_report("node-a", declared={}))
    problems = reg.problems()
    assert kinds(problems) == [UNDECLARED_ADAPTER, UNDECLARED_ADAPTER]
    assert "name: <name>" in problems[0].fix  # nobody named this fabric yet


# -- metrics, forgetting, refusing


def metric(reg: FabricRegistry, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {tuple(sorted(labels.items())): v for n, labels, v in reg.metrics() if n == name}


def test_metrics_give_each_fabrics_master_its_managers_by_state_and_problems_by_kind():
    reg = registry(
        ib_report("node-a"),
        ib_report("node-x", sminfo=SMINFO_X, smir=SMIR_A_ONLY.replace(A, X), declared={"ib-x": ["mlx5_0", "mlx5_1"]}),
    )
    fa, fx_ = f"ib:{A}", f"ib:{X}"
    assert metric(reg, METRIC_MASTER_SM) == {
        (("fabric", fa), ("sm_guid", A)): 1.0,
        (("fabric", fx_), ("sm_guid", X)): 1.0,
    }
    sms = metric(reg, METRIC_SUBNET_MANAGERS)
    assert sms[(("fabric", fa), ("state", "master"))] == 1.0
    assert sms[(("fabric", fa), ("state", "standby"))] == 1.0
    assert sms[(("fabric", fx_), ("state", "standby"))] == 0.0  # present at zero, for alerts
    assert sms[(("fabric", fx_), ("state", "not_active"))] == 0.0
    assert len(sms) == 8  # four states each, no "unknown"
    problems = metric(reg, METRIC_PROBLEMS)
    assert problems[(("kind", NO_STANDBY), ("level", "warn"))] == 1.0
    assert problems[(("kind", MASTER_DISAGREEMENT), ("level", "fail"))] == 0.0
    assert len(problems) == len(KINDS)
    failover(reg, T0 + 10, nodes=["node-a"])
    assert metric(reg, METRIC_MASTER_SM)[(("fabric", fa), ("sm_guid", B))] == 1.0
    assert metric(reg, METRIC_PROBLEMS)[(("kind", MASTER_CHANGED), ("level", "warn"))] == 1.0


def test_removing_a_node_forgets_its_ports_and_its_problems():
    reg = registry(ib_report("node-a"), ib_report("node-b", declared={}))
    assert UNDECLARED_ADAPTER in kinds(reg.problems())
    reg.remove("node-b")
    assert [m.node for m in reg.fabrics()[0].members] == ["node-a", "node-a"]
    assert reg.problems() == []
    reg.remove("node-a")
    reg.remove("never-seen")
    assert reg.fabrics() == [] and reg.fabric_of("node-a", "mlx5_0", 1) is None


def test_a_report_naming_no_node_or_no_time_is_refused():
    with pytest.raises(FabricIdentityError, match="names no node") as e:
        FabricRegistry().update(NodeFabricReport(node=" "), T0)
    assert isinstance(e.value, LlmgwError)
    with pytest.raises(FabricIdentityError, match="no usable time"):
        FabricRegistry().update(NodeFabricReport(node="node-a"), float("nan"))


def test_every_problem_says_what_is_wrong_and_what_to_do():
    reg = registry(
        ib_report("node-a", smir=SMIR_A_ONLY, declared={}),
        ib_report("node-b", sminfo={"mlx5_0": SMINFO_A, "mlx5_1": NO_UMAD}),
        ib_report("node-c", sminfo=SMINFO_B_MASTER, smir=SMIR_BC, declared={"other": ["mlx5_0", "mlx5_1"]}),
        ib_report("node-d", tools=()),
        ib_report("node-x", sminfo=SMINFO_X, smir=SMIR_XY),
        NodeFabricReport(node="node-e", checked=False),
    )
    problems = reg.problems()
    assert_explained(problems)
    assert {p.kind for p in problems} >= {
        MASTER_DISAGREEMENT,
        NO_MANAGER,
        NAME_ON_TWO_FABRICS,
        TWO_NAMES_ON_ONE_FABRIC,
        UNDECLARED_ADAPTER,
        NODE_UNCHECKED,
    }
    # The most serious first.
    levels = [p.level for p in problems]
    assert levels == sorted(levels, key=lambda lv: lv != "fail")


def test_a_report_assembled_from_the_parsed_tools_reads_the_same_as_the_collectors():
    rows = [
        PortSubnetManagers(
            hca=h, port=1, master=parse_sminfo(SMINFO_A), managers=parse_smir(SMIR_AB), source="saquery SMIR"
        )
        for h in ("mlx5_0", "mlx5_1")
    ]
    by_hand = NodeFabricReport(
        node="node-a",
        hcas=adapters([ib_port("mlx5_0"), ib_port("mlx5_1")]),
        subnet_managers=SubnetManagers(ports=rows),
        declared={"ib-compute": ["mlx5_0", "mlx5_1"]},
    )
    assert registry(by_hand).fabrics() == registry(ib_report("node-a")).fabrics()
