"""The map of one InfiniBand fabric, from what `ibnetdiscover` prints.

One node per physical fabric runs `ibnetdiscover -C <hca> -P <port>` and sends the
raw text back (cluster.md §1.9); this module is everything the control plane does
with it, and nothing else: no I/O, no clock, no store. Two steps:

- ``parse_ibnetdiscover(text)`` reads the default output of infiniband-diags'
  ``ibnetdiscover`` (``dump_topology``'s printf formats, the same in the 2010
  sources as in rdma-core 44; only speed names were added) into switches, adapters and cables, each cable once although the
  tool prints it from both ends. A line it does not know is an error naming the
  line: the spec's rule is that a new format is a control-plane upgrade, and a map
  quietly missing half the fabric would be worse than none.
- ``analyse(topology)`` derives what an operator and placement want: switch tiers
  (leaf, spine, core, by distance from the hosts' adapters), the node each adapter
  belongs to, cables trained below others of their kind, switch ports without a
  cable, and rail alignment.

``to_json`` gives the API its form (``/api/v1/fabrics/{id}/topology``), in an order
that depends only on the fabric, never on the order the tool printed it in.

Link rates are data rates, what operators quote (4xHDR = 200 Gb/s, 4xNDR =
400 Gb/s), not signalling rates: per lane SDR 2, DDR 4, QDR 8, FDR10 10,
FDR 13.64, EDR 25, HDR 50, NDR 100, XDR 200 Gb/s, times the lanes (1x, 2x, 4x, 8x,
12x). (Signalling is 2.5, 5, 10, 10.3125, 14.0625, 25.78125, 53.125, 106.25 and
212.5 GBd; the difference is line coding.)
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict, deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llmgw.errors import LlmgwError

# The agent caps what it sends at 16 MB (cluster.md §1.9); anything larger did not
# come from an agent, and is not worth holding in memory to find out.
MAX_OUTPUT_BYTES = 16 << 20

LANE_GBPS: Mapping[str, float] = {
    "SDR": 2.0,
    "DDR": 4.0,
    "QDR": 8.0,
    "FDR10": 10.0,
    "FDR": 13.64,
    "EDR": 25.0,
    "HDR": 50.0,
    "NDR": 100.0,
    "XDR": 200.0,
}
WIDTH_LANES: Mapping[str, int] = {"1x": 1, "2x": 2, "4x": 4, "8x": 8, "12x": 12}

# Tiers, nearest the hosts first. "unknown": a switch no host adapter can reach.
LEAF, SPINE, CORE, UNKNOWN = "leaf", "spine", "core", "unknown"
_TIER_ORDER = {LEAF: 0, SPINE: 1, CORE: 2, UNKNOWN: 3}

# Adapter kinds. A SHARP aggregation node is a CA inside a Quantum switch (on its
# last port); it is not a host, so it must not make its switch a leaf.
HCA, AGGREGATION, ROUTER = "hca", "aggregation", "router"

# Cable kinds; "degraded" compares a cable only with others of its kind.
ADAPTER_CABLE, SWITCH_CABLE, INTERNAL_CABLE, DIRECT_CABLE, ROUTER_CABLE = (
    "adapter",
    "switch",
    "internal",
    "direct",
    "router",
)

WARN, INFO = "warn", "info"


class FabricMapError(LlmgwError):
    """ibnetdiscover output this module cannot read; says which line and what it expected."""

    def __init__(self, message: str, line: int | None = None) -> None:
        super().__init__(message)
        self.line = line


# ------------------------------------------------------------------ the parsed fabric


@dataclass(frozen=True, slots=True)
class Endpoint:
    guid: str  # node GUID, "0x" + 16 lower-case hex digits
    port: int


@dataclass(frozen=True, slots=True)
class Cable:
    a: Endpoint  # the adapter's end when one end is an adapter
    b: Endpoint
    width: str  # "4x"; "??" when the tool could not name it
    speed: str  # "NDR"; "???" likewise
    rate_gbps: float | None  # data rate; None when width or speed is unnamed

    @property
    def label(self) -> str:
        return self.width + self.speed

    def other(self, guid: str) -> Endpoint:
        return self.b if self.a.guid == guid else self.a


@dataclass(frozen=True, slots=True)
class Switch:
    guid: str
    ports: int  # the port count the switch reports (Quantum-2: 65, Quantum: 41)
    description: str
    lid: int

    @property
    def name(self) -> str:
        """ "MF0;ib-leaf-01:MQM9700/U1" -> "ib-leaf-01": the host name a managed
        switch puts between ';' and ':'; otherwise the description itself."""
        m = re.match(r"^[^;]*;([^:]+):", self.description)
        return m.group(1) if m else self.description


@dataclass(frozen=True, slots=True)
class Adapter:
    guid: str
    description: str
    node: str | None  # "node-a mlx5_0" -> "node-a"; None when the description names no host
    device: str | None  # "mlx5_0"
    ports: int
    port_guids: tuple[tuple[int, str], ...]  # (port number, port GUID) of its cabled ports
    kind: str = HCA

    @property
    def label(self) -> str:
        return f"{self.node} {self.device}" if self.node else self.description


@dataclass(frozen=True, slots=True)
class Topology:
    switches: tuple[Switch, ...]  # by GUID
    adapters: tuple[Adapter, ...]  # by GUID
    cables: tuple[Cable, ...]  # by endpoints
    initiated_from: str | None = None  # the adapter the scan ran from


# ------------------------------------------------------------------------ parsing

_GUID16 = r"(?P<guid>[0-9a-fA-F]{16})"
_RATE = r"(?P<width>\d+x|\?\?)(?P<speed>FDR10|SDR|DDR|QDR|FDR|EDR|HDR|NDR|XDR|\?\?\?)"
# -f adds " s=.. w=.. v=.. [e=..]"; Xsigo gear adds " slot N" or " (scp)". Both harmless.
_TAIL = r"(?:\s+s=\d+\s+w=\d+\s+v=\d+(?:\s+e=\d+)?)?(?:\s+slot\s+\d+|\s+\(scp\))?"
_EXT = r"(?:\[ext \d+\])?"  # -g only

_SWITCH = re.compile(
    r'^Switch\s+(?P<ports>\d+)\s+"S-' + _GUID16 + r'"\s+#\s+"(?P<desc>.*)"\s+(?:enhanced|base)\s+port\s+0\s+'
    r"lid\s+(?P<lid>\d+)\s+lmc\s+\d+$"
)
_CA = re.compile(
    r'^(?P<type>Ca|Rt)\s+(?P<ports>\d+)\s+"(?P<letter>[HR])-' + _GUID16 + r'"\s+#\s+"(?P<desc>.*)"(?:\s+\(scp\))?$'
)
# On a switch: [port]  "X-peer"[peer port](peer port GUID, CAs only)  # "peer desc" lid N 4xNDR
_SWITCH_PORT = re.compile(
    r"^\[(?P<port>\d+)\]"
    + _EXT
    + r'\s*"(?P<letter>[SHR])-'
    + _GUID16
    + r'"\[(?P<rport>\d+)\]'
    + _EXT
    + r"(?:\((?P<rpguid>[0-9a-fA-F]+)\))?\s*#\s+\"(?P<desc>.*)\"\s+lid\s+(?P<lid>\d+)\s+"
    + _RATE
    + _TAIL
    + "$"
)
# On a CA: [port](own port GUID)  "X-peer"[peer port] (peer port GUID, CAs only)  # lid N lmc M "peer desc" lid N 4xNDR
_CA_PORT = re.compile(
    r"^\[(?P<port>\d+)\]\((?P<pguid>[0-9a-fA-F]+)\)\s*\"(?P<letter>[SHR])-"
    + _GUID16
    + r'"\[(?P<rport>\d+)\]'
    + _EXT
    + r"(?:\s*\((?P<rpguid>[0-9a-fA-F]+)\))?\s*#\s+lid\s+\d+\s+lmc\s+\d+\s+\"(?P<desc>.*)\"\s+lid\s+(?P<lid>\d+)\s+"
    + _RATE
    + _TAIL
    + "$"
)
# The lines before each node's own line, and -g's chassis lines: nothing the map needs.
_IDS = re.compile(
    r"^(?:vendid=0x[0-9a-fA-F]+|devid=0x[0-9a-fA-F]+|sysimgguid=0x[0-9a-fA-F]+(?:\s+#.*)?"
    r"|switchguid=0x[0-9a-fA-F]+\([0-9a-fA-F]+\)(?:\s+#.*)?|(?:ca|rt)guid=0x[0-9a-fA-F]+"
    r"|Non-Chassis Nodes|Chassis \d+.*|Hostname: .*)$"
)
_INITIATED = re.compile(r"^#\s*Initiated from node ([0-9a-fA-F]+)")
_HOST_DEVICE = re.compile(r"^(\S+)\s+(\S+)$")

_NODE_LINE = 'a node line: Switch <ports> "S-<guid>" # "<description>" enhanced port 0 lid <n> lmc <n>, or Ca <ports> "H-<guid>" # "<description>"'
_EXPECT_SWITCH_PORT = (
    f'a switch port line: [<port>] "S-<guid>"[<port>] # "<description>" lid <n> 4xNDR, a blank line, or {_NODE_LINE}'
)
_EXPECT_CA_PORT = f'an adapter port line: [<port>](<port guid>) "S-<guid>"[<port>] # lid <n> lmc <n> "<description>" lid <n> 4xNDR, a blank line, or {_NODE_LINE}'


def guid(value: str) -> str:
    """ "c42a1030012f3a0" or "0x0C42..." -> "0x0c42a1030012f3a0", the form discovery uses."""
    return "0x" + value.lower().removeprefix("0x").rjust(16, "0")


def link_rate_gbps(width: str, speed: str) -> float | None:
    """Data rate of a link: 4xNDR -> 400.0, 2xHDR -> 100.0; None for what the tool could not name."""
    lanes, per_lane = WIDTH_LANES.get(width), LANE_GBPS.get(speed)
    if lanes is None or per_lane is None:
        return None
    return round(lanes * per_lane, 2)


def host_and_device(description: str) -> tuple[str | None, str | None]:
    """rdma-ndd writes "<host> <device>" ("node-a mlx5_0"; older stacks "node01 HCA-1").
    A driver's own description ("MT4123 ConnectX6 Mellanox Technologies") names no host."""
    m = _HOST_DEVICE.match(description.strip())
    if not m:
        return None, None
    return m.group(1), m.group(2)


def _adapter_kind(type_word: str, description: str) -> str:
    if type_word == "Rt":
        return ROUTER
    return AGGREGATION if "aggregation node" in description.lower() else HCA


@dataclass(slots=True)
class _Node:
    kind: str  # "S", "H" or "R"
    guid: str
    ports: int
    description: str
    lid: int
    line: int
    adapter_kind: str = HCA


def parse_ibnetdiscover(text: str) -> Topology:
    """Switches, adapters and cables from `ibnetdiscover`'s default output."""
    # len() counts characters, never more than the bytes they encode to: cheap first.
    if len(text) > MAX_OUTPUT_BYTES or len(text.encode("utf-8", "surrogatepass")) > MAX_OUTPUT_BYTES:
        raise FabricMapError(
            f"ibnetdiscover output of more than {MAX_OUTPUT_BYTES} bytes (16 MiB) is refused: "
            "an agent caps a scan at that, so this is not one"
        )
    nodes: dict[str, _Node] = {}
    peers: dict[Endpoint, tuple[Endpoint, int]] = {}  # each end -> (the other end, line first seen)
    cables: dict[frozenset[Endpoint], Cable] = {}
    port_guids: dict[str, dict[int, str]] = defaultdict(dict)
    named: list[tuple[str, str, int]] = []  # (letter, guid, line) of every peer a port line names
    initiated: str | None = None
    current: _Node | None = None

    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            current = None  # each node's block ends at a blank line
            continue
        if line.startswith("#"):
            m = _INITIATED.match(line)
            if m:
                initiated = guid(m.group(1))
            continue
        if _IDS.match(line):
            current = None
            continue
        m = _SWITCH.match(line)
        if m:
            current = _Node(
                "S", guid(m.group("guid")), int(m.group("ports")), m.group("desc"), int(m.group("lid")), number
            )
            _add_node(nodes, current)
            continue
        m = _CA.match(line)
        if m:
            desc = m.group("desc")
            current = _Node(m.group("letter"), guid(m.group("guid")), int(m.group("ports")), desc, 0, number)
            current.adapter_kind = _adapter_kind(m.group("type"), desc)
            _add_node(nodes, current)
            continue
        if current is None:
            what = (
                _NODE_LINE
                if not line.startswith("[")
                else f"a port line only inside a node's block, after {_NODE_LINE}"
            )
            raise _expected(number, what, raw)
        m = (_SWITCH_PORT if current.kind == "S" else _CA_PORT).match(line)
        if not m:
            raise _expected(number, _EXPECT_SWITCH_PORT if current.kind == "S" else _EXPECT_CA_PORT, raw)
        port = int(m.group("port"))
        if not 1 <= port <= current.ports:
            raise FabricMapError(
                f"ibnetdiscover output line {number}: port {port} of a node with {current.ports} ports", number
            )
        local = Endpoint(current.guid, port)
        remote = Endpoint(guid(m.group("guid")), int(m.group("rport")))
        if current.kind != "S":
            port_guids[current.guid][port] = guid(m.group("pguid"))
        if m.group("rpguid"):
            port_guids[remote.guid][remote.port] = guid(m.group("rpguid"))
        named.append((m.group("letter"), remote.guid, number))
        for end, other in ((local, remote), (remote, local)):
            seen = peers.get(end)
            if seen and seen[0] != other:
                raise FabricMapError(
                    f"ibnetdiscover output line {number}: port {end.port} of {end.guid} is cabled to "
                    f"{other.guid}[{other.port}] here but to {seen[0].guid}[{seen[0].port}] on line {seen[1]}",
                    number,
                )
            peers.setdefault(end, (other, number))
        width, speed = m.group("width"), m.group("speed")
        cable = Cable(local, remote, width, speed, link_rate_gbps(width, speed))
        key = frozenset((local, remote))
        known = cables.get(key)
        # Both ends report the link; should they ever disagree (a scan mid-retrain), keep the slower.
        if known is None or (cable.rate_gbps or 0.0) < (known.rate_gbps or 0.0):
            cables[key] = cable

    for letter, g, number in named:
        node = nodes.get(g)
        if node is None:
            raise FabricMapError(
                f"ibnetdiscover output line {number}: {letter}-{g[2:]} has no block of its own (output cut short?)",
                number,
            )
        if node.kind != letter:
            raise FabricMapError(
                f"ibnetdiscover output line {number}: {letter}-{g[2:]} is declared as {node.kind}- on line {node.line}",
                number,
            )

    switches = tuple(
        Switch(n.guid, n.ports, n.description, n.lid)
        for n in sorted(nodes.values(), key=lambda n: n.guid)
        if n.kind == "S"
    )
    adapters = []
    for n in sorted(nodes.values(), key=lambda n: n.guid):
        if n.kind == "S":
            continue
        host, device = host_and_device(n.description) if n.adapter_kind == HCA else (None, None)
        pg = tuple(sorted(port_guids.get(n.guid, {}).items()))
        adapters.append(Adapter(n.guid, n.description, host, device, n.ports, pg, n.adapter_kind))
    oriented = (_orient(c, nodes) for c in cables.values())
    ordered = tuple(sorted(oriented, key=lambda c: (c.a.guid, c.a.port, c.b.guid, c.b.port)))
    return Topology(switches, tuple(adapters), ordered, initiated)


def _add_node(nodes: dict[str, _Node], node: _Node) -> None:
    before = nodes.get(node.guid)
    if before is not None:
        raise FabricMapError(
            f"ibnetdiscover output line {node.line}: {node.guid} already has a block, on line {before.line}", node.line
        )
    nodes[node.guid] = node


def _expected(number: int, what: str, raw: str) -> FabricMapError:
    shown = raw if len(raw) <= 160 else raw[:157] + "..."
    return FabricMapError(f"ibnetdiscover output line {number}: expected {what}; got {shown!r}", number)


def _orient(c: Cable, nodes: Mapping[str, _Node]) -> Cable:
    """The adapter's end first; otherwise the lower endpoint, so a cable has one form."""
    a_switch, b_switch = nodes[c.a.guid].kind == "S", nodes[c.b.guid].kind == "S"
    swap = (c.b.guid, c.b.port) < (c.a.guid, c.a.port) if a_switch == b_switch else a_switch
    return Cable(c.b, c.a, c.width, c.speed, c.rate_gbps) if swap else c


# ----------------------------------------------------------------------- analysis


@dataclass(frozen=True, slots=True)
class Degraded:
    cable: Cable
    kind: str
    expected_gbps: float
    reason: str  # "4xHDR (200 Gb/s) where others of its kind are 4xNDR (400 Gb/s)"


@dataclass(frozen=True, slots=True)
class NodeOnFabric:
    name: str
    adapters: tuple[str, ...]  # adapter GUIDs, in device order (mlx5_0, mlx5_1 …)
    leaves: tuple[str, ...]  # leaf GUIDs its adapters are cabled to
    degraded: bool  # one of its adapters' cables trained below the others


@dataclass(frozen=True, slots=True)
class Rail:
    index: int
    device: str | None  # "mlx5_1" when every node names its adapters alike
    leaves: tuple[str, ...]  # leaf GUIDs its adapters sit on
    nodes: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Misaligned:
    node: str
    reasons: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Problem:
    level: str  # "warn" or "info"
    subject: str  # a node name, a switch name or a GUID
    text: str


@dataclass(frozen=True)
class FabricMap:
    topology: Topology
    tiers: Mapping[str, str]  # switch GUID -> leaf / spine / core / unknown
    cable_kinds: Mapping[Cable, str]
    degraded: tuple[Degraded, ...]
    down_ports: Mapping[str, tuple[int, ...]]  # switch GUID -> its ports with no cable
    adapter_leaves: Mapping[str, tuple[str, ...]]  # adapter GUID -> leaf GUIDs
    nodes: tuple[NodeOnFabric, ...]
    rails: tuple[Rail, ...]
    rail_of: Mapping[str, int]  # adapter GUID -> rail index
    rail_aligned: bool
    misaligned: tuple[Misaligned, ...]
    problems: tuple[Problem, ...]

    def degraded_reason(self, cable: Cable) -> str | None:
        for d in self.degraded:
            if d.cable == cable:
                return d.reason
        return None

    def node(self, name: str) -> NodeOnFabric | None:
        return next((n for n in self.nodes if n.name == name), None)


def natural_key(s: str) -> tuple[tuple[int, int, str], ...]:
    """mlx5_2 before mlx5_10, node-9 before node-10."""
    return tuple((0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", s) if t)


def _fmt(gbps: float) -> str:
    return f"{gbps:g}"


def analyse(topo: Topology) -> FabricMap:
    switches = {s.guid: s for s in topo.switches}
    adapters = {a.guid: a for a in topo.adapters}

    kinds = {c: _cable_kind(c, switches, adapters) for c in topo.cables}
    tiers, distance = _tiers(switches, kinds)
    adapter_leaves = _adapter_leaves(kinds)
    degraded = _degraded(kinds)
    degraded_adapters = {d.cable.a.guid for d in degraded if d.kind == ADAPTER_CABLE}

    down: dict[str, tuple[int, ...]] = {}
    cabled: dict[str, set[int]] = defaultdict(set)
    for c in topo.cables:
        cabled[c.a.guid].add(c.a.port)
        cabled[c.b.guid].add(c.b.port)
    for s in topo.switches:
        down[s.guid] = tuple(p for p in range(1, s.ports + 1) if p not in cabled[s.guid])

    by_node: dict[str, list[Adapter]] = defaultdict(list)
    for a in topo.adapters:
        if a.kind == HCA and a.node:
            by_node[a.node].append(a)
    for members in by_node.values():
        members.sort(key=lambda a: (natural_key(a.device or ""), a.guid))
    nodes = tuple(
        NodeOnFabric(
            name,
            tuple(a.guid for a in members),
            tuple(sorted({leaf for a in members for leaf in adapter_leaves.get(a.guid, ())})),
            any(a.guid in degraded_adapters for a in members),
        )
        for name, members in sorted(by_node.items(), key=lambda kv: natural_key(kv[0]))
    )

    rails, rail_of, misaligned = _rails(by_node, adapter_leaves, switches)

    problems = [
        Problem(WARN, _subject(d.cable, switches, adapters), f"{_describe(d.cable, switches, adapters)}: {d.reason}")
        for d in degraded
    ]
    problems += _short_of_uplinks(switches, tiers, distance, kinds)
    problems += [Problem(WARN, m.node, f"{m.node} is not rail-aligned: " + "; ".join(m.reasons)) for m in misaligned]
    problems += [
        Problem(
            WARN,
            _subject(c, switches, adapters),
            f"{_describe(c, switches, adapters)} trained at {c.label}, a rate this map cannot name",
        )
        for c in topo.cables
        if c.rate_gbps is None
    ]
    problems += [
        Problem(
            INFO,
            a.guid,
            f'adapter {a.guid} ("{a.description}") does not say which host it is in: '
            'its node description is not "<host> <device>" (is rdma-ndd running there?)',
        )
        for a in topo.adapters
        if a.kind == HCA and a.node is None
    ]
    problems += [
        Problem(INFO, s.name, f"switch {s.name} ({s.guid}) has no path to any host adapter")
        for s in topo.switches
        if tiers[s.guid] == UNKNOWN
    ]

    return FabricMap(
        topology=topo,
        tiers=tiers,
        cable_kinds=kinds,
        degraded=degraded,
        down_ports=down,
        adapter_leaves=adapter_leaves,
        nodes=nodes,
        rails=rails,
        rail_of=rail_of,
        rail_aligned=bool(rails) and not misaligned,
        misaligned=misaligned,
        problems=tuple(problems),
    )


def _cable_kind(c: Cable, switches: Mapping[str, Switch], adapters: Mapping[str, Adapter]) -> str:
    a_sw, b_sw = c.a.guid in switches, c.b.guid in switches
    if a_sw and b_sw:
        return SWITCH_CABLE
    if not a_sw and not b_sw:
        return DIRECT_CABLE
    adapter = adapters[c.b.guid if a_sw else c.a.guid]
    return {HCA: ADAPTER_CABLE, AGGREGATION: INTERNAL_CABLE}.get(adapter.kind, ROUTER_CABLE)


def _tiers(switches: Mapping[str, Switch], kinds: Mapping[Cable, str]) -> tuple[dict[str, str], dict[str, int]]:
    """Breadth first over switch-to-switch cables from the switches hosts are cabled to."""
    neighbours: dict[str, set[str]] = defaultdict(set)
    leaves: set[str] = set()
    for c, kind in kinds.items():
        if kind == SWITCH_CABLE:
            neighbours[c.a.guid].add(c.b.guid)
            neighbours[c.b.guid].add(c.a.guid)
        elif kind == ADAPTER_CABLE:
            leaves.add(c.b.guid)
    distance = dict.fromkeys(leaves, 0)
    queue = deque(sorted(leaves))
    while queue:
        g = queue.popleft()
        for n in sorted(neighbours[g]):
            if n not in distance:
                distance[n] = distance[g] + 1
                queue.append(n)
    tiers = {}
    for g in switches:
        d = distance.get(g)
        tiers[g] = UNKNOWN if d is None else LEAF if d == 0 else SPINE if d == 1 else CORE
    return tiers, distance


def _adapter_leaves(kinds: Mapping[Cable, str]) -> dict[str, tuple[str, ...]]:
    found: dict[str, set[str]] = defaultdict(set)
    for c, kind in kinds.items():
        if kind == ADAPTER_CABLE:
            found[c.a.guid].add(c.b.guid)
    return {g: tuple(sorted(s)) for g, s in sorted(found.items())}


def _degraded(kinds: Mapping[Cable, str]) -> tuple[Degraded, ...]:
    """A cable below the most common rate of its kind. Host cables and switch uplinks
    are compared apart (a fabric may run HDR to hosts and NDR between switches); the
    switch's own aggregation node is not a cable anyone can reseat."""
    groups: dict[str, list[Cable]] = defaultdict(list)
    for c, kind in kinds.items():
        if kind != INTERNAL_CABLE and c.rate_gbps is not None:
            groups[kind].append(c)
    found = []
    for kind, members in groups.items():
        if len(members) < 2:
            continue
        counts = Counter(c.rate_gbps or 0.0 for c in members)
        top = max(counts.values())
        # On a tie the higher rate is the norm: two HDR and two NDR cables is two
        # cables worth a look, not a fabric that is fine.
        expected = max(r for r, n in counts.items() if n == top)
        labels = Counter(c.label for c in members if c.rate_gbps == expected)
        expected_label = min(labels, key=lambda lbl: (-labels[lbl], lbl))
        for c in members:
            if c.rate_gbps is not None and c.rate_gbps < expected:
                reason = (
                    f"{c.label} ({_fmt(c.rate_gbps)} Gb/s) where others of its kind are "
                    f"{expected_label} ({_fmt(expected)} Gb/s)"
                )
                found.append(Degraded(c, kind, expected, reason))
    found.sort(key=lambda d: (d.cable.a.guid, d.cable.a.port, d.cable.b.guid, d.cable.b.port))
    return tuple(found)


def _short_of_uplinks(
    switches: Mapping[str, Switch],
    tiers: Mapping[str, str],
    distance: Mapping[str, int],
    kinds: Mapping[Cable, str],
) -> list[Problem]:
    """A switch with fewer cables up than the others of its tier: unused ports and
    dead ones look the same in ibnetdiscover, but a leaf one uplink short of its
    siblings has lost a cable."""
    up: dict[str, int] = defaultdict(int)
    for c, kind in kinds.items():
        if kind != SWITCH_CABLE:
            continue
        da, db = distance.get(c.a.guid), distance.get(c.b.guid)
        if da is None or db is None or da == db:
            continue
        up[c.a.guid if da < db else c.b.guid] += 1
    problems = []
    for tier in (LEAF, SPINE, CORE):
        members = sorted((g for g, t in tiers.items() if t == tier), key=lambda g: natural_key(switches[g].name))
        if len(members) < 2:
            continue
        counts = Counter(up[g] for g in members)
        top = max(counts.values())
        usual = max(n for n, k in counts.items() if k == top)
        for g in members:
            if usual > 0 and up[g] < usual:
                s = switches[g]
                problems.append(
                    Problem(
                        WARN,
                        s.name,
                        f"{tier} {s.name} has {up[g]} uplinks where other {tier} switches have {usual}: "
                        "a cable up from it is unplugged or down",
                    )
                )
    return problems


def _rails(
    by_node: Mapping[str, list[Adapter]],
    adapter_leaves: Mapping[str, tuple[str, ...]],
    switches: Mapping[str, Switch],
) -> tuple[tuple[Rail, ...], dict[str, int], tuple[Misaligned, ...]]:
    """Rail N is every node's Nth adapter (by device name). The fabric is rail-aligned
    when no leaf carries two rails (so rail N of every node meets on rail N's own
    leaf) and every node has every rail. A rail may span several leaves, one per
    pod, as long as each carries that rail alone."""
    if not by_node:
        return (), {}, ()
    names = sorted({a.device or "" for members in by_node.values() for a in members}, key=natural_key)
    most = max(len(m) for m in by_node.values())
    # When every node draws its device names from one set of that size (mlx5_0..3
    # everywhere), rail N is the Nth name: a node whose mlx5_1 is down then lacks rail 1
    # rather than having its mlx5_2 and mlx5_3 each counted one rail early.
    by_name = len(names) == most
    rail_of: dict[str, int] = {}
    for members in by_node.values():
        for i, a in enumerate(members):
            rail_of[a.guid] = names.index(a.device or "") if by_name else i
    count = len(names) if by_name else most

    reasons: dict[str, list[tuple[int, str]]] = defaultdict(list)

    def leaf_name(g: str) -> str:
        return switches[g].name if g in switches else g

    # Two adapters of one node on one leaf: the plainest way not to be rail-aligned.
    shared: set[tuple[str, str]] = set()  # (adapter guid, leaf guid) already explained
    for node, members in by_node.items():
        on_leaf: dict[str, list[Adapter]] = defaultdict(list)
        for a in members:
            leaves = adapter_leaves.get(a.guid, ())
            if not leaves:
                reasons[node].append((rail_of[a.guid], f"{a.device} is not cabled to a switch"))
            for leaf in leaves:
                on_leaf[leaf].append(a)
        for leaf, together in sorted(on_leaf.items()):
            if len(together) > 1:
                devs = ", ".join(str(a.device) for a in together)
                reasons[node].append((rail_of[together[0].guid], f"{devs} share leaf {leaf_name(leaf)}"))
                shared.update((a.guid, leaf) for a in together)

    # A leaf carrying several rails: the adapters of its minority rails are the ones cabled wrong.
    per_leaf: dict[str, list[tuple[str, Adapter]]] = defaultdict(list)
    for node, members in by_node.items():
        for a in members:
            for leaf in adapter_leaves.get(a.guid, ()):
                per_leaf[leaf].append((node, a))
    for leaf, here in sorted(per_leaf.items()):
        tally = Counter(rail_of[a.guid] for _, a in here)
        if len(tally) < 2:
            continue
        top = max(tally.values())
        majors = sorted(r for r, n in tally.items() if n == top)
        major = majors[0] if len(majors) == 1 else None
        for node, a in here:
            r = rail_of[a.guid]
            if r == major or (a.guid, leaf) in shared:
                continue
            if major is not None:
                text = (
                    f"{a.device} (rail {r}) is on {leaf_name(leaf)}, which carries rail {major} "
                    f"for {tally[major]} other adapters"
                )
            else:
                carried = ", ".join(str(x) for x in sorted(tally))
                text = f"{a.device} (rail {r}) is on {leaf_name(leaf)}, which carries rails {carried} alike"
            reasons[node].append((r, text))

    # A node short of a rail: its adapter's port is down, so ibnetdiscover never saw it.
    for node, members in by_node.items():
        if len(members) == count:
            continue
        if by_name:
            have = {a.device for a in members}
            for i, dev in enumerate(names):
                if dev not in have:
                    reasons[node].append((i, f"has no {dev} on this fabric (rail {i}): its port is down or not cabled"))
        else:
            reasons[node].append(
                (len(members), f"has {len(members)} adapters on this fabric where others have {count}")
            )

    rails = []
    for i in range(count):
        in_rail = [(node, a) for node, members in by_node.items() for a in members if rail_of[a.guid] == i]
        rails.append(
            Rail(
                i,
                names[i] if by_name else None,
                tuple(sorted({leaf for _, a in in_rail for leaf in adapter_leaves.get(a.guid, ())})),
                tuple(sorted({node for node, _ in in_rail}, key=natural_key)),
            )
        )
    misaligned = tuple(
        Misaligned(node, tuple(text for _, text in sorted(items)))
        for node, items in sorted(reasons.items(), key=lambda kv: natural_key(kv[0]))
    )
    return tuple(rails), rail_of, misaligned


def _end_name(e: Endpoint, switches: Mapping[str, Switch], adapters: Mapping[str, Adapter]) -> str:
    if e.guid in switches:
        return f"{switches[e.guid].name} port {e.port}"
    a = adapters[e.guid]
    return a.label if a.ports == 1 else f"{a.label} port {e.port}"


def _describe(c: Cable, switches: Mapping[str, Switch], adapters: Mapping[str, Adapter]) -> str:
    return f"the cable {_end_name(c.a, switches, adapters)} – {_end_name(c.b, switches, adapters)}"


def _subject(c: Cable, switches: Mapping[str, Switch], adapters: Mapping[str, Adapter]) -> str:
    a = adapters.get(c.a.guid)
    if a is not None and a.node:
        return a.node
    return switches[c.a.guid].name if c.a.guid in switches else c.a.guid


# --------------------------------------------------------------------------- JSON


def to_json(fmap: FabricMap) -> dict[str, Any]:
    """The map for the API and the page: plain types, ordered by the fabric alone."""
    topo = fmap.topology
    switches = sorted(topo.switches, key=lambda s: (_TIER_ORDER[fmap.tiers[s.guid]], natural_key(s.name), s.guid))
    adapters = sorted(
        topo.adapters,
        key=lambda a: (a.node is None, natural_key(a.node or ""), natural_key(a.device or a.description), a.guid),
    )
    reasons = {d.cable: d.reason for d in fmap.degraded}

    def end(e: Endpoint) -> dict[str, Any]:
        return {"guid": e.guid, "port": e.port}

    tier_counts = Counter(fmap.tiers.values())
    return {
        "initiated_from": topo.initiated_from,
        "summary": {
            "switches": len(topo.switches),
            "adapters": sum(1 for a in topo.adapters if a.kind == HCA),
            "cables": len(topo.cables),
            "nodes": len(fmap.nodes),
            "tiers": {t: tier_counts.get(t, 0) for t in (LEAF, SPINE, CORE, UNKNOWN)},
            "degraded_cables": len(fmap.degraded),
            "down_ports": sum(len(p) for p in fmap.down_ports.values()),
            "rail_aligned": fmap.rail_aligned,
        },
        "switches": [
            {
                "guid": s.guid,
                "name": s.name,
                "description": s.description,
                "lid": s.lid,
                "ports": s.ports,
                "tier": fmap.tiers[s.guid],
                "down_ports": list(fmap.down_ports.get(s.guid, ())),
                "down_port_count": len(fmap.down_ports.get(s.guid, ())),
            }
            for s in switches
        ],
        "adapters": [
            {
                "guid": a.guid,
                "description": a.description,
                "kind": a.kind,
                "node": a.node,
                "device": a.device,
                "ports": a.ports,
                "port_guids": {str(p): g for p, g in a.port_guids},
                "leaves": list(fmap.adapter_leaves.get(a.guid, ())),
                "rail": fmap.rail_of.get(a.guid),
            }
            for a in adapters
        ],
        "cables": [
            {
                "a": end(c.a),
                "b": end(c.b),
                "kind": fmap.cable_kinds[c],
                "width": c.width,
                "speed": c.speed,
                "rate_gbps": c.rate_gbps,
                "degraded": c in reasons,
                "reason": reasons.get(c),
            }
            for c in topo.cables
        ],
        "nodes": [
            {"name": n.name, "adapters": list(n.adapters), "leaves": list(n.leaves), "degraded": n.degraded}
            for n in fmap.nodes
        ],
        "rails": [
            {"index": r.index, "device": r.device, "leaves": list(r.leaves), "nodes": list(r.nodes)} for r in fmap.rails
        ],
        "rail_aligned": fmap.rail_aligned,
        "misaligned": [{"node": m.node, "reasons": list(m.reasons)} for m in fmap.misaligned],
        "problems": [{"level": p.level, "subject": p.subject, "text": p.text} for p in fmap.problems],
    }
