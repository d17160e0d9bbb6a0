"""Multi-node NVLink domains as racks: what `/api/v1/nvlink` and `/admin/nvlink` show.

A GB200 NVL72-style rack is one NVLink domain: its GPUs report one
``ClusterUUID`` once the fabric manager joined them (cluster.md §4.4). Each
node (a compute tray) is a ``Tray`` of its GPUs; the cliques inside a cluster
are the partitions the fabric manager cut it into (``Partition``), and NVLink
memory sharing ends at a clique's edge. This module only reads what the agents
reported: no I/O, no clock, no store. The caller builds one ``NodeNVLink`` per
node (``from_node`` does it from the control plane's record) and calls
``racks`` and ``unplaced``; ``to_json`` is the API's body.

What goes where:

- a GPU whose fabric names a non-zero cluster belongs to that cluster's rack,
  joined or not (In Progress, or a failed join still names the cluster);
- a GPU with an all-zero cluster is a single machine's NVSwitch (an HGX
  board): its NVLink ends at the chassis, so it is in no rack and not a problem;
- a GPU with a fabric but no cluster sits on its node's tray when other GPUs of
  that node name a rack (it is physically there, just not joined yet), and is
  ``unplaced`` with the reason when none do.

Each tray's ``problems`` are sentences saying what is wrong and what to do:
a GPU not joined (its state and status), IMEX not running or without a
channel, the fabric manager not running, degraded bandwidth, and GPUs of one
tray split across cliques or clusters.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from llmgw.errors import LlmgwError
from llmgw.protocol.inventory import GPU, IMEX, GPUFabric

if TYPE_CHECKING:
    from .agents import Node

IMEX_START = "systemctl start nvidia-imex"
IMEX_CHANNEL_FIX = (
    "echo 'options nvidia NVreg_CreateImexChannel0=1' > /etc/modprobe.d/nvidia-imex.conf and reload the driver"
)
FABRIC_MANAGER_FIX = "systemctl enable --now nvidia-fabricmanager (its version must match the driver's)"


class NVLinkError(LlmgwError):
    """The nodes handed in cannot be laid out as racks (a caller's mistake)."""


@dataclass(frozen=True)
class NodeNVLink:
    """What one node says about NVLink: its GPUs (with their latest fabric
    reading), nvidia-imex, and nvidia-fabricmanager's systemd state when known."""

    node: str
    gpus: Sequence[GPU] = ()
    imex: IMEX | None = None
    fabric_manager: str | None = None  # systemd's word; None: not known


@dataclass(frozen=True)
class TrayGPU:
    index: int
    uuid: str | None
    name: str | None
    state: str | None
    status: str | None
    bandwidth: str | None
    clique_id: str | None
    joined: bool
    degraded: bool


@dataclass(frozen=True)
class Tray:
    """One node's GPUs in one rack."""

    node: str
    gpus: tuple[TrayGPU, ...]
    joined: bool  # every GPU joined the domain
    degraded: bool
    cliques: tuple[str, ...]
    imex_state: str | None
    imex_channels: int | None
    fabric_manager: str | None
    problems: tuple[str, ...]

    @property
    def gpus_joined(self) -> int:
        return sum(g.joined for g in self.gpus)

    @property
    def ready(self) -> bool:
        """What placement needs of a node in a domain (placement.py): every card
        joined, one clique, IMEX active. Degraded bandwidth slows it, no more."""
        return self.joined and len(self.cliques) == 1 and _active(self.imex_state)


@dataclass(frozen=True)
class Partition:
    """One clique of a cluster: the GPUs that share NVLink memory with each other."""

    clique_id: str
    domain: str  # cluster_uuid/clique_id, as placement names it (nvl:<domain>)
    nodes: tuple[str, ...]
    gpus_joined: int
    gpus_total: int


@dataclass(frozen=True)
class Rack:
    """One multi-node NVLink domain (a ClusterUUID)."""

    id: str  # the cluster UUID, lower-case
    trays: tuple[Tray, ...]
    partitions: tuple[Partition, ...]
    gpus_joined: int
    gpus_total: int
    degraded: bool

    @property
    def joined(self) -> bool:
        return all(t.joined for t in self.trays)


@dataclass(frozen=True)
class Unplaced:
    """A GPU with a fabric that names no cluster, on a node no rack holds."""

    node: str
    index: int
    uuid: str | None
    state: str | None
    status: str | None
    reason: str


def from_node(node: Node, fabric_manager: str | None = None) -> NodeNVLink:
    """The node's GPUs as registered, each with the fabric of its latest
    heartbeat where one came (re-read about once a minute), and its IMEX.

    Agents do not report nvidia-fabricmanager's state to the control plane
    (only doctor reads it), so it is None unless the caller knows it."""
    inv = node.inventory
    fresh = {u.index: u.fabric for u in node.gpus or () if u.fabric is not None}
    gpus = []
    for g in (inv.gpus if inv else None) or ():
        fab = fresh.get(g.index)
        gpus.append(g.model_copy(update={"fabric": fab}) if fab is not None else g)
    imex = node.imex or (inv.imex if inv else None)
    return NodeNVLink(node=node.node_id, gpus=gpus, imex=imex, fabric_manager=fabric_manager)


def racks(nodes: Iterable[NodeNVLink]) -> list[Rack]:
    """Every multi-node NVLink domain the nodes report, by cluster UUID."""
    placed, _ = _layout(nodes)
    return [_rack(cluster, members) for cluster, members in sorted(placed.items())]


def unplaced(nodes: Iterable[NodeNVLink]) -> list[Unplaced]:
    """GPUs with a fabric but no cluster, on nodes none of whose GPUs name a rack."""
    _, loose = _layout(nodes)
    return loose


def to_json(rack_list: Iterable[Rack], unplaced_gpus: Iterable[Unplaced] = ()) -> dict[str, Any]:
    """The API's body: racks by id, trays by node (tray-2 before tray-10), GPUs by index."""
    return {
        "racks": [_rack_json(r) for r in sorted(rack_list, key=lambda r: r.id)],
        "unplaced": [
            {
                "node": u.node,
                "index": u.index,
                "uuid": u.uuid,
                "state": u.state,
                "status": u.status,
                "reason": u.reason,
            }
            for u in sorted(unplaced_gpus, key=lambda u: (_natural(u.node), u.index))
        ],
    }


# ---------------------------------------------------------------------------


@dataclass
class _Member:
    """One node's GPUs that belong to one cluster."""

    node: NodeNVLink
    gpus: list[tuple[GPU, GPUFabric]] = field(default_factory=list)
    other_clusters: list[str] = field(default_factory=list)


def _layout(nodes: Iterable[NodeNVLink]) -> tuple[dict[str, list[_Member]], list[Unplaced]]:
    placed: dict[str, list[_Member]] = defaultdict(list)
    loose: list[Unplaced] = []
    seen: set[str] = set()
    for n in nodes:
        if n.node in seen:
            raise NVLinkError(f"node {n.node} is listed twice: one node is one tray")
        seen.add(n.node)
        by_cluster: dict[str, list[tuple[GPU, GPUFabric]]] = defaultdict(list)
        clusterless: list[tuple[GPU, GPUFabric]] = []
        for g in sorted(n.gpus, key=lambda g: g.index):
            if g.fabric is None:
                continue
            cluster = _cluster(g.fabric)
            if cluster is None:
                clusterless.append((g, g.fabric))
            elif not _all_zero(cluster):
                by_cluster[cluster].append((g, g.fabric))
            # An all-zero cluster: one chassis's NVSwitch, no rack.
        if not by_cluster:
            loose.extend(_unplaced(n.node, g, f) for g, f in clusterless)
            continue
        # A GPU that names no cluster yet is still on this tray: count it where
        # most of its neighbours are, so the rack shows the tray whole.
        home = max(sorted(by_cluster), key=lambda c: len(by_cluster[c]))
        by_cluster[home].extend(clusterless)
        for cluster, gpus in by_cluster.items():
            others = sorted(c for c in by_cluster if c != cluster)
            gpus.sort(key=lambda gf: gf[0].index)
            placed[cluster].append(_Member(node=n, gpus=gpus, other_clusters=others))
    return placed, loose


def _unplaced(node: str, g: GPU, f: GPUFabric) -> Unplaced:
    how = _state_words(f)
    if _completed(f):
        reason = (
            f"GPU {g.index} says its fabric join completed ({how}) but names no cluster: "
            f"`nvidia-smi -q -d FABRIC` on {node}; restart nvidia-fabricmanager and nvidia-imex there"
        )
    else:
        reason = (
            f"GPU {g.index} has not joined any NVLink domain ({how}): "
            f"`nvidia-smi -q -d FABRIC` on {node} says why; check the NVLink switch trays' fabric manager "
            f"and {IMEX_START} there"
        )
    return Unplaced(node=node, index=g.index, uuid=g.uuid, state=f.state, status=f.status, reason=reason)


def _rack(cluster: str, members: list[_Member]) -> Rack:
    trays = tuple(sorted((_tray(m) for m in members), key=lambda t: _natural(t.node)))
    cliques: dict[str, list[TrayGPU]] = defaultdict(list)
    nodes_of: dict[str, set[str]] = defaultdict(set)
    for t in trays:
        for g in t.gpus:
            if g.clique_id is not None:
                cliques[g.clique_id].append(g)
                nodes_of[g.clique_id].add(t.node)
    partitions = tuple(
        Partition(
            clique_id=c,
            domain=f"{cluster}/{c}",
            nodes=tuple(sorted(nodes_of[c], key=_natural)),
            gpus_joined=sum(g.joined for g in gs),
            gpus_total=len(gs),
        )
        for c, gs in sorted(cliques.items(), key=lambda kv: _natural(kv[0]))
    )
    return Rack(
        id=cluster,
        trays=trays,
        partitions=partitions,
        gpus_joined=sum(t.gpus_joined for t in trays),
        gpus_total=sum(len(t.gpus) for t in trays),
        degraded=any(t.degraded for t in trays),
    )


def _tray(m: _Member) -> Tray:
    n = m.node
    gpus = tuple(_tray_gpu(g, f) for g, f in m.gpus)
    problems: list[str] = []
    for g in gpus:
        if g.joined:
            continue
        how = _state_words_of(g.state, g.status)
        completed = (g.state or "").strip().lower() == "completed"
        if completed and (g.status or "").strip().lower() not in ("", "success"):
            problems.append(
                f"GPU {g.index}'s NVLink fabric join ended with {g.status}: run `nvidia-smi -q -d FABRIC` on "
                f"{n.node}, restart nvidia-imex ({IMEX_START}), then check the NVLink switch trays"
            )
        elif completed:
            problems.append(
                f"GPU {g.index} says its fabric join completed ({how}) but names no cluster: "
                f"`nvidia-smi -q -d FABRIC` on {n.node}; restart nvidia-fabricmanager and nvidia-imex there"
            )
        else:
            problems.append(
                f"GPU {g.index} has not joined the NVLink domain ({how}): `nvidia-smi -q -d FABRIC` on {n.node} "
                "says why; check the NVLink switch trays' fabric manager and nvidia-imex there"
            )
    imex_state = n.imex.state if n.imex else None
    imex_channels = n.imex.channels if n.imex else None
    if not _active(imex_state):
        if imex_state:
            problems.append(
                f"nvidia-imex is {imex_state}: GPUs cannot share memory across the rack; start nvidia-imex: {IMEX_START} "
                "(with every tray of the domain in /etc/nvidia-imex/nodes_config.cfg)"
            )
        else:
            problems.append(
                "nvidia-imex is not installed (or its agent did not report it): GPUs cannot share memory across "
                f"the rack; install it, then start nvidia-imex: {IMEX_START}"
            )
    elif not imex_channels:
        # channels None: /dev/nvidia-caps-imex-channels was not there at all.
        problems.append(f"nvidia-imex runs but there is no IMEX channel: {IMEX_CHANNEL_FIX}")
    fm = (n.fabric_manager or "").strip().lower() if n.fabric_manager is not None else None
    # On NVL72 the fabric manager runs on the NVLink switch trays, so a compute
    # tray's unit may be inactive with every card joined; it is a problem when
    # it failed, or is stopped while cards are not joined.
    if fm is not None and fm != "active" and (fm == "failed" or not all(g.joined for g in gpus)):
        problems.append(
            f"nvidia-fabricmanager is {n.fabric_manager or 'not installed'}: GPUs cannot join the NVLink domain; "
            f"{FABRIC_MANAGER_FIX}"
        )
    by_bandwidth: dict[str, list[int]] = defaultdict(list)
    for g in gpus:
        if g.degraded and g.bandwidth:
            by_bandwidth[g.bandwidth].append(g.index)
    for bw, idx in sorted(by_bandwidth.items()):
        problems.append(
            f"bandwidth {bw} on GPU {_list(idx)}: check NVLink cables/trays (reseat this tray and its cable "
            f"cartridge; `nvidia-smi nvlink -s` on {n.node} shows which links are down)"
        )
    counts = Counter(g.clique_id for g in gpus if g.clique_id is not None)
    cliques = tuple(sorted(counts, key=_natural))
    if len(cliques) > 1:
        split = "; ".join(f"clique {c}: GPU {_list([g.index for g in gpus if g.clique_id == c])}" for c in cliques)
        problems.append(
            f"this tray's GPUs sit in {len(cliques)} cliques ({split}): a replica across trays can use only one; "
            "check the fabric manager's partition configuration on the NVLink switch trays"
        )
    if m.other_clusters:
        problems.append(
            f"this tray's GPUs sit in more than one NVLink domain (also {', '.join(m.other_clusters)}): "
            "check the NVLink cabling of this tray and the switch trays' fabric manager"
        )
    return Tray(
        node=n.node,
        gpus=gpus,
        joined=bool(gpus) and all(g.joined for g in gpus),
        degraded=any(g.degraded for g in gpus),
        cliques=cliques,
        imex_state=imex_state,
        imex_channels=imex_channels,
        fabric_manager=n.fabric_manager,
        problems=tuple(problems),
    )


def _tray_gpu(g: GPU, f: GPUFabric) -> TrayGPU:
    status = (f.status or "").strip().lower()
    # A join that "completed" with a failure status is not one: nvidia-smi
    # says Completed once the attempt ends, Success only when it worked.
    joined = _completed(f) and _cluster(f) is not None and status in ("", "success")
    bw = (f.bandwidth or "").strip()
    clique = (f.clique_id or "").strip() or None
    return TrayGPU(
        index=g.index,
        uuid=g.uuid,
        name=g.name,
        state=f.state,
        status=f.status,
        bandwidth=f.bandwidth,
        clique_id=clique,
        joined=joined,
        degraded=bool(bw) and bw.lower() != "full",
    )


def _rack_json(r: Rack) -> dict[str, Any]:
    return {
        "id": r.id,
        "joined": r.joined,
        "degraded": r.degraded,
        "gpus_joined": r.gpus_joined,
        "gpus_total": r.gpus_total,
        "partitions": [
            {
                "clique_id": p.clique_id,
                "domain": p.domain,
                "nodes": list(p.nodes),
                "gpus_joined": p.gpus_joined,
                "gpus_total": p.gpus_total,
            }
            for p in r.partitions
        ],
        "trays": [
            {
                "node": t.node,
                "joined": t.joined,
                "ready": t.ready,
                "degraded": t.degraded,
                "gpus_joined": t.gpus_joined,
                "gpus_total": len(t.gpus),
                "cliques": list(t.cliques),
                "imex": {"state": t.imex_state, "channels": t.imex_channels},
                "fabric_manager": t.fabric_manager,
                "problems": list(t.problems),
                "gpus": [
                    {
                        "index": g.index,
                        "uuid": g.uuid,
                        "name": g.name,
                        "state": g.state,
                        "status": g.status,
                        "bandwidth": g.bandwidth,
                        "clique_id": g.clique_id,
                        "joined": g.joined,
                        "degraded": g.degraded,
                    }
                    for g in sorted(t.gpus, key=lambda g: g.index)
                ],
            }
            for t in sorted(r.trays, key=lambda t: _natural(t.node))
        ],
    }


def _cluster(f: GPUFabric) -> str | None:
    uuid = (f.cluster_uuid or "").strip().lower()
    return uuid if uuid and uuid != "n/a" else None


def _all_zero(uuid: str) -> bool:
    return not uuid.replace("0", "").replace("-", "")


def _completed(f: GPUFabric) -> bool:
    return (f.state or "").strip().lower() == "completed"


def _active(state: str | None) -> bool:
    return (state or "").strip().lower() == "active"


def _state_words(f: GPUFabric) -> str:
    return _state_words_of(f.state, f.status)


def _state_words_of(state: str | None, status: str | None) -> str:
    words = f"state {state or 'unknown'}"
    return f"{words}, status {status}" if status else words


def _list(indexes: Sequence[int]) -> str:
    return ", ".join(str(i) for i in sorted(indexes))


def _natural(s: str) -> tuple[Any, ...]:
    # Tray names carry numbers: tray-2 sits above tray-10 in the rack.
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", s))
