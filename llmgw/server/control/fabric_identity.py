"""Which physical fabric each port is on, and what is wrong with the fabrics.

Agents read the subnet managers behind their ACTIVE InfiniBand ports (`sminfo`
names a port's master, `saquery SMIR` lists every SM of that subnet, cluster.md
§4.6) and send them with the adapters sysfs shows and the fabrics agent.yaml
declares (§4.7). This module is what the control plane makes of them, and
nothing else: no I/O, no clock (every call that needs the time is given it), no
store. The caller assembles one ``NodeFabricReport`` per node from what its
agent sent and hands it to ``FabricRegistry.update`` on each heartbeat.

Identity. Subnet managers listed together (on one port, or joined through
ports that share one of them) are one InfiniBand fabric, named ``ib:`` + the
lowest GUID among them: the master may change, the set barely does, so the
name survives a failover. Sets seen together are remembered for a day, so the
name also survives the old master vanishing from the listing altogether (its
host down, its switch replaced). A RoCE port is on ``roce:`` + the IP network
of its RoCE v2 address: RoCE has no subnet manager.

Problems (``problems()``), each with the message naming what is wrong and a
``fix`` saying what to do:

- ``no_standby``: the fabric's SMs are listed and none but the master is STANDBY;
- ``master_disagreement``: ports of one fabric name different masters;
- ``no_manager``: an ACTIVE port whose SM could not be read, or an INIT port
  (link up, never configured by an SM);
- ``master_changed``: the fabric's master changed in the last hour (changes
  are kept, and listed on the fabric, for a day);
- ``name_on_two_fabrics``: one agent.yaml name on ports of two physical fabrics;
- ``two_names_on_one_fabric``: one physical fabric under two names;
- ``undeclared_adapter``: an adapter with an ACTIVE port in no declared fabric;
- ``node_unchecked``: a node whose subnet managers could not be read at all
  (infiniband-diags missing, the check failed, or not reported).

A master change is recorded only once every port of the fabric names the new
master: while agents' heartbeats straddle a failover, ports briefly disagree
(flagged as such) and no change is counted twice. An ACTIVE port the SM read
has no row for yet (sysfs is re-read every heartbeat, the SMs once a minute)
is not flagged; one whose row says the read failed is.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from llmgw.errors import LlmgwError
from llmgw.protocol.doctor import SMRecord, SubnetManagers
from llmgw.protocol.inventory import HCA

# A master change stays a problem this long, and is listed (and remembered,
# with the subnet managers seen together) this long.
RECENT_CHANGE_S = 3600.0
HISTORY_S = 24 * 3600.0

INFINIBAND, ROCE = "infiniband", "roce"

# SM states in sminfo's words (what SMRecord.state holds), and the metric's label for each.
MASTER, STANDBY, DISCOVER, NOTACT = "SMINFO_MASTER", "SMINFO_STANDBY", "SMINFO_DISCOVER", "SMINFO_NOTACT"
STATE_LABELS: Mapping[str, str] = {MASTER: "master", STANDBY: "standby", DISCOVER: "discovering", NOTACT: "not_active"}
UNKNOWN_STATE = "unknown"

FAIL, WARN = "fail", "warn"

NO_STANDBY = "no_standby"
MASTER_DISAGREEMENT = "master_disagreement"
NO_MANAGER = "no_manager"
MASTER_CHANGED = "master_changed"
NAME_ON_TWO_FABRICS = "name_on_two_fabrics"
TWO_NAMES_ON_ONE_FABRIC = "two_names_on_one_fabric"
UNDECLARED_ADAPTER = "undeclared_adapter"
NODE_UNCHECKED = "node_unchecked"

# Every kind and how serious it is, most serious first. FAIL: shards placed on
# the fabric may not reach each other now; WARN: they do, but the next failure
# or a placement by name may go wrong.
KINDS: Mapping[str, str] = {
    MASTER_DISAGREEMENT: FAIL,
    NO_MANAGER: FAIL,
    NAME_ON_TWO_FABRICS: FAIL,
    NO_STANDBY: WARN,
    MASTER_CHANGED: WARN,
    TWO_NAMES_ON_ONE_FABRIC: WARN,
    UNDECLARED_ADAPTER: WARN,
    NODE_UNCHECKED: WARN,
}
_KIND_ORDER = {k: i for i, k in enumerate(KINDS)}

METRIC_MASTER_SM = "llmgw_fabric_master_sm"
METRIC_SUBNET_MANAGERS = "llmgw_fabric_subnet_managers"
METRIC_PROBLEMS = "llmgw_fabric_problems"

INSTALL_DIAGS = "install infiniband-diags"
# Ports named in one message before "and N more".
_LIST_AT_MOST = 4


class FabricIdentityError(LlmgwError):
    """A report the registry cannot take (it says which and why)."""


@dataclass(frozen=True)
class NodeFabricReport:
    """What one node's agent said about its fabrics, as of one heartbeat.

    ``hcas``: the adapters and ports sysfs shows (the inventory, refreshed by
    the heartbeat's ports). ``subnet_managers``: the agent's SM reads; None when
    it sent none. ``declared``: agent.yaml's fabrics, name -> adapters.
    ``checked`` False (with ``error`` saying why) when the agent could not run
    the check at all; its SM reads are then ignored.
    """

    node: str
    hcas: Sequence[HCA] = ()
    subnet_managers: SubnetManagers | None = None
    declared: Mapping[str, Sequence[str]] = field(default_factory=dict)
    checked: bool = True
    error: str | None = None


@dataclass(frozen=True)
class SubnetManager:
    guid: str  # 0x + 16 lower-case hex digits
    lid: int | None = None
    priority: int | None = None
    state: str | None = None  # sminfo's word: SMINFO_MASTER, SMINFO_STANDBY, …

    @property
    def state_label(self) -> str:
        """master, standby, discovering, not_active or unknown."""
        return STATE_LABELS.get(self.state or "", UNKNOWN_STATE)

    def describe(self) -> str:
        bits = [f"lid {self.lid}" if self.lid is not None else None]
        bits.append(f"priority {self.priority}" if self.priority is not None else None)
        bits.append(self.state_label)
        return f"{self.guid} ({', '.join(b for b in bits if b)})"


@dataclass(frozen=True)
class FabricMember:
    node: str
    hca: str
    port: int
    rate_gbps: float | None = None
    master_guid: str | None = None  # the master this port's sminfo named (InfiniBand)

    @property
    def where(self) -> str:
        return f"{self.node} {self.hca}/{self.port}"


@dataclass(frozen=True)
class MasterChange:
    fabric_id: str
    at: float  # the `now` of the update that saw it
    old_guid: str
    new_guid: str


@dataclass(frozen=True)
class PhysicalFabric:
    id: str  # ib:<lowest SM GUID> or roce:<network>
    kind: str  # infiniband or roce
    members: tuple[FabricMember, ...]
    managers: tuple[SubnetManager, ...] = ()  # every SM listed, by GUID; empty on RoCE
    master: SubnetManager | None = None
    declared: tuple[str, ...] = ()  # agent.yaml names its members' adapters are declared under
    master_changes: tuple[MasterChange, ...] = ()  # the last day's, oldest first
    network: str | None = None  # RoCE: the IP network
    # Whether any port listed the SMs (saquery); without, standbys are unknown.
    managers_listed: bool = False

    @property
    def standbys(self) -> tuple[SubnetManager, ...]:
        master = self.master.guid if self.master else None
        return tuple(m for m in self.managers if m.state == STANDBY and m.guid != master)


@dataclass(frozen=True)
class Problem:
    fabric_id: str | None
    node: str | None
    kind: str  # one of KINDS
    message: str  # what is wrong, with the names and GUIDs
    fix: str  # what to do about it

    @property
    def level(self) -> str:
        return KINDS[self.kind]


# What the registry keeps of a report: plain values, nothing the caller can
# change under it afterwards.


@dataclass(frozen=True)
class _Port:
    hca: str
    port: int
    state: str  # upper-case; "" unknown
    roce: bool
    network: str | None
    rate_gbps: float | None
    has_row: bool = False  # the SM read has a row for this port
    master: SubnetManager | None = None
    managers: tuple[SubnetManager, ...] | None = None
    error: str | None = None

    @property
    def active(self) -> bool:
        return self.state == "ACTIVE"

    @property
    def guids(self) -> frozenset[str]:
        """The SMs this port saw together: its master and those listed."""
        found = {m.guid for m in self.managers or ()}
        if self.master:
            found.add(self.master.guid)
        return frozenset(found)


@dataclass(frozen=True)
class _Node:
    name: str
    at: float
    ports: tuple[_Port, ...]
    adapters: tuple[str, ...]
    names_by_hca: Mapping[str, tuple[str, ...]]
    checked: bool
    error: str | None
    reported_sms: bool  # subnet_managers was sent
    missing_tools: tuple[str, ...]

    @property
    def sminfo_missing(self) -> bool:
        return "sminfo" in self.missing_tools

    @property
    def sm_usable(self) -> bool:
        """Whether this node's SM reads count (for grouping and for no_manager)."""
        return self.checked and self.reported_sms and not self.sminfo_missing

    def active_ib(self) -> list[_Port]:
        return [p for p in self.ports if p.active and not p.roce]


def normalize_guid(value: str | None) -> str | None:
    """0x + 16 lower-case hex digits, whatever the agent's spelling; None for no GUID."""
    if not value:
        return None
    g = value.strip().lower().removeprefix("0x").replace(":", "")
    if not g or any(c not in "0123456789abcdef" for c in g) or not g.strip("0"):
        return None
    return "0x" + g.rjust(16, "0")


def _sm(rec: SMRecord | None) -> SubnetManager | None:
    guid = normalize_guid(rec.guid) if rec else None
    if rec is None or guid is None:
        return None
    return SubnetManager(guid=guid, lid=rec.lid, priority=rec.priority, state=rec.state)


def _snapshot(report: NodeFabricReport, now: float) -> _Node:
    sms = report.subnet_managers
    rows = {(r.hca, r.port): r for r in (sms.ports or ())} if sms else {}
    ports = []
    for h in report.hcas:
        for p in h.ports or ():
            row = rows.get((p.hca, p.port))
            managers = None
            if row is not None and row.managers is not None:
                managers = tuple(m for m in (_sm(r) for r in row.managers) if m is not None)
            ports.append(
                _Port(
                    hca=p.hca,
                    port=p.port,
                    state=(p.state or "").strip().upper(),
                    roce=p.is_roce,
                    network=p.network or None,
                    rate_gbps=p.rate_gbps,
                    has_row=row is not None,
                    master=_sm(row.master) if row else None,
                    managers=managers,
                    error=row.error if row else None,
                )
            )
    names: dict[str, list[str]] = defaultdict(list)
    for name, hcas in report.declared.items():
        for hca in hcas:
            if name not in names[hca]:
                names[hca].append(name)
    return _Node(
        name=report.node,
        at=now,
        ports=tuple(sorted(ports, key=lambda p: (p.hca, p.port))),
        adapters=tuple(sorted({h.name for h in report.hcas})),
        names_by_hca={h: tuple(sorted(n)) for h, n in names.items()},
        checked=report.checked,
        error=report.error,
        reported_sms=sms is not None,
        missing_tools=tuple(sms.missing_tools or ()) if sms else (),
    )


class _Groups:
    """Union-find over SM GUIDs."""

    def __init__(self) -> None:
        self._parent: dict[str, str] = {}

    def find(self, g: str) -> str:
        self._parent.setdefault(g, g)
        while self._parent[g] != g:
            self._parent[g] = self._parent[self._parent[g]]
            g = self._parent[g]
        return g

    def join(self, guids: Iterable[str]) -> None:
        it = iter(sorted(guids))
        first = next(it, None)
        if first is None:
            return
        root = self.find(first)
        for g in it:
            other = self.find(g)
            if other != root:
                # The lower GUID is the root, so a group's root is its name.
                lo, hi = sorted((root, other))
                self._parent[hi] = lo
                root = lo


@dataclass
class _View:
    """Everything derived from the reports at one moment."""

    fabrics: list[PhysicalFabric]
    port_fabric: dict[tuple[str, str, int], str]  # (node, hca, port) -> fabric id
    # fabric id -> declared name -> how many of its ports are declared under it
    names: dict[str, Counter[str]]

    def commonest_name(self, fid: str) -> str | None:
        counts = self.names.get(fid)
        if not counts:
            return None
        return min(counts, key=lambda nm: (-counts[nm], nm))

    agreed: dict[str, str | None]  # IB fabric id -> the master every voting port names, None if they differ


def _ports_listed(members: Sequence[FabricMember]) -> str:
    shown = ", ".join(m.where for m in members[:_LIST_AT_MOST])
    more = len(members) - _LIST_AT_MOST
    return shown + (f" and {more} more" if more > 0 else "")


def _ago(seconds: float) -> str:
    s = max(seconds, 0.0)
    if s < 90:
        return f"{int(s)} s ago"
    return f"{round(s / 60)} min ago"


class FabricRegistry:
    """The control plane's view of the physical fabrics, across heartbeats.

    ``update`` on each node's report; ``fabrics``, ``problems`` and ``metrics``
    read it, as of the last update's time unless given another. ``remove``
    forgets a node. Not thread-safe: the caller holds its own lock.

    Deriving the fabrics reads every node, so a fleet registering at once must
    not derive them once per node: ``ingest`` takes a report without deriving,
    and ``settle`` (which every read does first) derives once for all the
    reports taken since. The derived view is kept until a report or a removal.
    """

    def __init__(self) -> None:
        self._nodes: dict[str, _Node] = {}
        # GUID sets seen together -> when last seen: keeps a fabric's name
        # through a master that drops out of the listing (for HISTORY_S).
        self._together: dict[frozenset[str], float] = {}
        # IB fabric id -> (the master its ports last agreed on, when last seen).
        self._masters: dict[str, tuple[str, float]] = {}
        self._changes: list[MasterChange] = []
        self._now: float | None = None
        self._cached: _View | None = None  # the view of the reports as they are; None once one changed
        self._unsettled = False  # reports taken that the masters' history has not seen yet

    # -- input

    def update(self, report: NodeFabricReport, now: float) -> None:
        self.ingest(report, now)
        self.settle()

    def ingest(self, report: NodeFabricReport, now: float) -> None:
        """Take a node's report; the fabrics are derived again at the next ``settle`` or read."""
        if not report.node or not report.node.strip():
            raise FabricIdentityError("a fabric report names no node; it cannot be told apart from the others")
        if not math.isfinite(now):
            raise FabricIdentityError(f"a fabric report from {report.node} has no usable time ({now!r})")
        node = _snapshot(report, now)
        self._nodes[node.name] = node
        self._now = now
        if node.sm_usable:
            for p in node.active_ib():
                if p.guids:
                    self._together[p.guids] = now
        self._cached = None
        self._unsettled = True

    def settle(self) -> None:
        """Derive the fabrics once for every report taken since the last time, and follow
        each fabric's master: a change is dated by the latest report (``ingest``'s now)."""
        if not self._unsettled or self._now is None:
            return
        self._unsettled = False
        now = self._now
        self._prune(now)
        self._cached = None
        view = self._view()
        for fid, guid in view.agreed.items():
            prev = self._masters.get(fid)
            if guid is None:
                if prev is not None:
                    self._masters[fid] = (prev[0], now)
                continue
            if prev is not None and prev[0] != guid:
                self._changes.append(MasterChange(fabric_id=fid, at=now, old_guid=prev[0], new_guid=guid))
            self._masters[fid] = (guid, now)

    def remove(self, node: str) -> None:
        """Forget a node (removed from the fleet, or gone). What it told about a
        fabric's managers and master changes stays, as the fabric's history."""
        if self._nodes.pop(node, None) is not None:
            self._cached = None

    def _prune(self, now: float) -> None:
        cutoff = now - HISTORY_S
        self._together = {k: t for k, t in self._together.items() if t >= cutoff}
        self._masters = {k: v for k, v in self._masters.items() if v[1] >= cutoff}
        self._changes = [c for c in self._changes if c.at >= cutoff]

    # -- output

    def master_changes(self, now: float | None = None) -> list[MasterChange]:
        """Every fabric's master changes of the last day, oldest first."""
        self.settle()
        cutoff = self._when(now) - HISTORY_S
        return [c for c in self._changes if c.at >= cutoff]

    def fabrics(self, now: float | None = None) -> list[PhysicalFabric]:
        self.settle()
        return self._with_history(self._view(), now)

    def _with_history(self, view: _View, now: float | None) -> list[PhysicalFabric]:
        changes = self.master_changes(now)
        return [_with_changes(f, tuple(c for c in changes if c.fabric_id == f.id)) for f in view.fabrics]

    def fabric_of(self, node: str, hca: str, port: int) -> str | None:
        """The physical fabric a port is on; None when it is on none known."""
        self.settle()
        return self._view().port_fabric.get((node, hca, port))

    def problems(self, now: float | None = None) -> list[Problem]:
        self.settle()
        when = self._when(now)
        view = self._view()
        out: list[Problem] = []
        for n in sorted(self._nodes.values(), key=lambda n: n.name):
            out.extend(_node_problems(n, view))
        fabrics = self._with_history(view, when)
        by_id = {f.id: f for f in fabrics}
        for f in fabrics:
            if f.kind == INFINIBAND:
                out.extend(self._ib_problems(f, view, when))
        out.extend(self._name_problems(view, by_id))
        out.sort(key=lambda p: (_KIND_ORDER[p.kind], p.fabric_id or "", p.node or "", p.message))
        return out

    def metrics(self, now: float | None = None) -> list[tuple[str, dict[str, str], float]]:
        """(name, labels, value): the master of each InfiniBand fabric (1, by
        its GUID), its SMs by state (every state, zeros too, so an alert on
        ``{state="standby"} == 0`` sees a fabric that has none), and problems by
        kind (every kind, zeros too)."""
        fabrics = self.fabrics(now)
        out: list[tuple[str, dict[str, str], float]] = [
            (METRIC_MASTER_SM, {"fabric": f.id, "sm_guid": f.master.guid}, 1.0)
            for f in fabrics
            if f.kind == INFINIBAND and f.master is not None
        ]
        for f in fabrics:
            if f.kind != INFINIBAND:
                continue
            counts = Counter(m.state_label for m in f.managers)
            out.extend(
                (METRIC_SUBNET_MANAGERS, {"fabric": f.id, "state": state}, float(counts[state]))
                for state in (*STATE_LABELS.values(), UNKNOWN_STATE)
                if state != UNKNOWN_STATE or counts[state]
            )
        kinds = Counter(p.kind for p in self.problems(now))
        out.extend(
            (METRIC_PROBLEMS, {"kind": kind, "level": level}, float(kinds[kind])) for kind, level in KINDS.items()
        )
        return out

    def _when(self, now: float | None) -> float:
        if now is not None:
            return now
        return self._now if self._now is not None else 0.0

    # -- derivation

    def _view(self) -> _View:
        if self._cached is None:
            self._cached = self._derive()
        return self._cached

    def _derive(self) -> _View:
        nodes = sorted(self._nodes.values(), key=lambda n: n.name)
        groups = _Groups()
        for guids in self._together:
            groups.join(guids)
        for n in nodes:
            if n.sm_usable:
                for p in n.active_ib():
                    groups.join(p.guids)

        ib: dict[str, list[tuple[_Node, _Port]]] = defaultdict(list)
        roce: dict[str, list[tuple[_Node, _Port]]] = defaultdict(list)
        for n in nodes:
            for p in n.ports:
                if not p.active:
                    continue
                if p.roce:
                    if p.network:
                        roce[p.network].append((n, p))
                elif n.sm_usable and p.guids:
                    root = groups.find(min(p.guids))
                    ib[root].append((n, p))

        fabrics: list[PhysicalFabric] = []
        port_fabric: dict[tuple[str, str, int], str] = {}
        agreed: dict[str, str | None] = {}
        for root, ports in ib.items():
            fid = "ib:" + root
            f, agreed_master = _ib_fabric(fid, ports)
            fabrics.append(f)
            agreed[fid] = agreed_master
            for n, p in ports:
                port_fabric[(n.name, p.hca, p.port)] = fid
        for network, ports in roce.items():
            fid = "roce:" + network
            fabrics.append(
                PhysicalFabric(
                    id=fid,
                    kind=ROCE,
                    network=network,
                    members=tuple(FabricMember(n.name, p.hca, p.port, p.rate_gbps) for n, p in ports),
                    declared=_declared(ports),
                )
            )
            for n, p in ports:
                port_fabric[(n.name, p.hca, p.port)] = fid
        fabrics.sort(key=lambda f: f.id)
        names: dict[str, Counter[str]] = defaultdict(Counter)
        for (node, hca, _port), fid in port_fabric.items():
            names[fid].update(self._names(node, hca))
        return _View(fabrics=fabrics, port_fabric=port_fabric, agreed=agreed, names=dict(names))

    def _ib_problems(self, f: PhysicalFabric, view: _View, now: float) -> list[Problem]:
        out: list[Problem] = []
        master = f.master
        votes: dict[str, list[FabricMember]] = defaultdict(list)
        for m in f.members:
            if m.master_guid:
                votes[m.master_guid].append(m)

        if len(votes) > 1:
            named = "; ".join(
                f"{g} by {_ports_listed(ms)}" for g, ms in sorted(votes.items(), key=lambda kv: (-len(kv[1]), kv[0]))
            )
            out.append(
                Problem(
                    fabric_id=f.id,
                    node=None,
                    kind=MASTER_DISAGREEMENT,
                    message=f"ports on fabric {f.id} disagree on the master subnet manager: {named}",
                    fix=(
                        "if the master just changed this clears within a heartbeat or two; if it stays, the subnet "
                        "is split and two SMs each believe they are master: check the cabling between the switches, "
                        "run `sminfo -C <hca> -P <port>` on a node on each side, and stop or lower the priority of "
                        "the SM that should be standby"
                    ),
                )
            )

        if f.managers_listed and master is not None and not f.standbys:
            others = [m for m in f.managers if m.guid != master.guid]
            also = ""
            if others:
                also = "; also listed, but not standby: " + ", ".join(m.describe() for m in others)
            if master.priority is not None and master.priority > 0:
                prio = f"priority below the master's {master.priority}, e.g. `opensm -p {master.priority - 1}`"
            elif master.priority == 0:
                prio = "priority 0 and a GUID above the master's, which then stays master"
            else:
                prio = "priority below the master's"
            fix = f"start a standby opensm on a second switch or host ({prio})"
            if others:
                fix += "; or restart the SM listed but not standby, so it can take over"
            out.append(
                Problem(
                    fabric_id=f.id,
                    node=None,
                    kind=NO_STANDBY,
                    message=(
                        f"fabric {f.id} has no standby subnet manager: only the master {master.describe()} would "
                        f"bring ports up, and if it fails nothing takes over{also}"
                    ),
                    fix=fix,
                )
            )
        elif not f.managers_listed:
            failed = [
                (n, p)
                for n in sorted(self._nodes.values(), key=lambda n: n.name)
                for p in n.active_ib()
                if view.port_fabric.get((n.name, p.hca, p.port)) == f.id and p.error
            ]
            if failed:
                n, p = failed[0]
                out.append(
                    Problem(
                        fabric_id=f.id,
                        node=n.name,
                        kind=NODE_UNCHECKED,
                        message=(
                            f"the subnet managers of fabric {f.id} could not be listed, so whether a standby would "
                            f"take over is unknown: on {n.name} {p.hca}/{p.port}, {p.error}"
                        ),
                        fix=(
                            f"run `saquery -C {p.hca} -P {p.port} SMIR` on {n.name} to see why; an SM that does not "
                            "serve SMInfoRecord is still read through `saquery -s`, so an error here usually means "
                            "the SA did not answer"
                        ),
                    )
                )

        cutoff = now - RECENT_CHANGE_S
        recent = [c for c in f.master_changes if c.at >= cutoff]
        if recent:
            last = recent[-1]
            count = f" ({len(recent)} changes in the last hour)" if len(recent) > 1 else ""
            out.append(
                Problem(
                    fabric_id=f.id,
                    node=None,
                    kind=MASTER_CHANGED,
                    message=(
                        f"the master subnet manager of fabric {f.id} changed {_ago(now - last.at)}, "
                        f"from {last.old_guid} to {last.new_guid}{count}"
                    ),
                    fix=(
                        f"find out why {last.old_guid} stopped being master: opensm's log on its host "
                        "(/var/log/opensm.log) or the switch's SM log; a new SM with a higher priority takes over "
                        "on purpose, repeated changes mean an SM is restarting or losing its link"
                    ),
                )
            )
        return out

    def _name_problems(self, view: _View, by_id: Mapping[str, PhysicalFabric]) -> list[Problem]:
        out: list[Problem] = []
        on: dict[str, set[str]] = defaultdict(set)
        for f in view.fabrics:
            for name in f.declared:
                on[name].add(f.id)
        for name, ids in sorted(on.items()):
            if len(ids) < 2:
                continue
            parts = []
            for fid in sorted(ids):
                ms = [m for m in by_id[fid].members if name in self._names(m.node, m.hca)]
                parts.append(f"{fid} ({_ports_listed(ms)})")
            out.append(
                Problem(
                    fabric_id=None,
                    node=None,
                    kind=NAME_ON_TWO_FABRICS,
                    message=(
                        f"fabric name {name!r} is on {len(ids)} physical fabrics: {'; '.join(parts)}; "
                        f"shards placed on {name!r} across them cannot reach each other"
                    ),
                    fix=(
                        "the adapters are on separate subnets: cable them into one fabric, or give each physical "
                        "fabric its own name in agent.yaml (fabrics[].name) on the nodes attached to it"
                    ),
                )
            )
        for f in view.fabrics:
            if len(f.declared) < 2:
                continue
            per_name: dict[str, list[FabricMember]] = {
                name: [m for m in f.members if name in self._names(m.node, m.hca)] for name in f.declared
            }
            keep = view.commonest_name(f.id) or f.declared[0]
            others = [nm for nm in f.declared if nm != keep]
            nodes = sorted({m.node for nm in others for m in per_name[nm]})
            out.append(
                Problem(
                    fabric_id=f.id,
                    node=None,
                    kind=TWO_NAMES_ON_ONE_FABRIC,
                    message=(
                        f"physical fabric {f.id} is declared under {len(f.declared)} names: "
                        + "; ".join(f"{nm!r} ({_ports_listed(per_name[nm])})" for nm in f.declared)
                        + "; placement keeps shards within one name, so these nodes are never used together"
                    ),
                    fix=(
                        f"use one name for it on every node: rename {', '.join(repr(o) for o in others)} "
                        f"to {keep!r} in agent.yaml on {', '.join(nodes)}"
                    ),
                )
            )
        return out

    def _names(self, node: str, hca: str) -> tuple[str, ...]:
        n = self._nodes.get(node)
        return n.names_by_hca.get(hca, ()) if n else ()


def _with_changes(f: PhysicalFabric, changes: tuple[MasterChange, ...]) -> PhysicalFabric:
    return dataclasses.replace(f, master_changes=changes) if changes else f


def _declared(ports: Sequence[tuple[_Node, _Port]]) -> tuple[str, ...]:
    return tuple(sorted({name for n, p in ports for name in n.names_by_hca.get(p.hca, ())}))


def _ib_fabric(fid: str, ports: Sequence[tuple[_Node, _Port]]) -> tuple[PhysicalFabric, str | None]:
    """The fabric, and the master every port that named one agrees on (None if they differ)."""
    merged: dict[str, SubnetManager] = {}
    # Oldest report first, so the most recent word on each SM wins.
    for _n, p in sorted(ports, key=lambda np: (np[0].at, np[0].name, np[1].hca, np[1].port)):
        listed = {m.guid for m in p.managers or ()}
        for m in p.managers or ():
            merged[m.guid] = m
        if p.master is not None and p.master.guid not in listed:
            merged[p.master.guid] = p.master
    votes = Counter(p.master.guid for _n, p in ports if p.master is not None)

    def rank(g: str) -> tuple[int, int, str]:
        return (-votes[g], 0 if merged.get(g, SubnetManager(g)).state == MASTER else 1, g)

    candidates = list(votes) or [g for g, m in merged.items() if m.state == MASTER]
    master_guid = min(candidates, key=rank) if candidates else None
    master = merged.get(master_guid) if master_guid else None
    members = tuple(
        FabricMember(n.name, p.hca, p.port, p.rate_gbps, p.master.guid if p.master else None) for n, p in ports
    )
    f = PhysicalFabric(
        id=fid,
        kind=INFINIBAND,
        members=members,
        managers=tuple(merged[g] for g in sorted(merged)),
        master=master,
        declared=_declared(ports),
        managers_listed=any(p.managers is not None for _n, p in ports),
    )
    return f, (next(iter(votes)) if len(votes) == 1 else None)


def _node_problems(n: _Node, view: _View) -> list[Problem]:
    out: list[Problem] = []
    active_ib = n.active_ib()
    if not n.checked:
        why = n.error or "its agent did not say why"
        if INSTALL_DIAGS in why.lower() or "infiniband-diags" in why.lower():
            fix = f"{INSTALL_DIAGS} on {n.name} (apt-get install infiniband-diags, or dnf install infiniband-diags)"
        else:
            fix = f"run `llmgw doctor` on {n.name} to see what fails, and fix what it names"
        out.append(Problem(None, n.name, NODE_UNCHECKED, f"{n.name}'s fabrics cannot be checked: {why}", fix))
    elif n.missing_tools and active_ib:
        tools = " and ".join(n.missing_tools)
        lost = "its ports' masters and " if n.sminfo_missing else ""
        out.append(
            Problem(
                None,
                n.name,
                NODE_UNCHECKED,
                (
                    f"{n.name} cannot read {lost}its fabrics' subnet managers: {tools} "
                    f"{'is' if len(n.missing_tools) == 1 else 'are'} not installed"
                ),
                (
                    f"{INSTALL_DIAGS} on {n.name} (apt-get install infiniband-diags, or dnf install "
                    "infiniband-diags); the agent installs it where there are adapters, so its log says why it did not"
                ),
            )
        )
    elif not n.reported_sms and active_ib:
        out.append(
            Problem(
                None,
                n.name,
                NODE_UNCHECKED,
                (
                    f"{n.name} reported no subnet managers for its {len(active_ib)} ACTIVE InfiniBand "
                    f"port{'s' if len(active_ib) != 1 else ''}, so which fabric they are on is unknown"
                ),
                f"upgrade the agent on {n.name} to one that reads subnet managers, or run `llmgw doctor` there",
            )
        )

    for p in n.ports:
        if p.roce:
            continue
        if p.state == "INIT":
            out.append(
                Problem(
                    None,
                    n.name,
                    NO_MANAGER,
                    (
                        f"{n.name} {p.hca}/{p.port} is INIT: its link is up but no subnet manager has brought it "
                        "up, so nothing can be sent over it"
                    ),
                    (
                        "start a subnet manager on the fabric this port is cabled to (`systemctl enable --now "
                        "opensm` on a host attached to it, or the SM of a managed switch), with a second at a lower "
                        "priority as standby; if one runs, check with `sminfo` that it sees this port's switch"
                    ),
                )
            )
        elif p.active and n.sm_usable and p.has_row and p.master is None:
            said = p.error or "sminfo found no subnet manager"
            if "umad" in said.lower():
                fix = (
                    f"load the ib_umad module on {n.name} (`modprobe ib_umad`, and add it to "
                    "/etc/modules-load.d/) so infiniband-diags can reach the port"
                )
            else:
                fix = (
                    f"run `sminfo -C {p.hca} -P {p.port}` on {n.name}; if no subnet manager answers, start opensm on "
                    "a host or managed switch attached to this fabric (and a standby at a lower priority)"
                )
            out.append(
                Problem(
                    None,
                    n.name,
                    NO_MANAGER,
                    f"{n.name} {p.hca}/{p.port} is ACTIVE but its subnet manager could not be read: {said}",
                    fix,
                )
            )

    names = n.names_by_hca
    for hca in n.adapters:
        if names.get(hca):
            continue
        active = [p for p in n.ports if p.hca == hca and p.active]
        if not active:
            continue
        fid = next((view.port_fabric[k] for p in active if (k := (n.name, p.hca, p.port)) in view.port_fabric), None)
        # Suggest the name others gave the fabric this adapter is on.
        suggestion = "<name>"
        if fid is not None:
            suggestion = view.commonest_name(fid) or suggestion
        ports = ", ".join(f"{p.hca}/{p.port}" for p in active)
        on = f" on {fid}" if fid else ""
        out.append(
            Problem(
                fid,
                n.name,
                UNDECLARED_ADAPTER,
                (
                    f"adapter {hca} on {n.name} is up ({ports} ACTIVE{on}) but in no fabric agent.yaml declares, "
                    "so no replica spanning nodes will use it"
                ),
                (
                    f"add it to agent.yaml on {n.name}: fabrics: [{{name: {suggestion}, hcas: [{hca}]}}] "
                    "(or to the hcas of the fabric it is cabled to), then restart the agent"
                ),
            )
        )
    return out
