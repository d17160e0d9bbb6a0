"""Placement: which nodes (and which GPUs on them) a replica should run on.

Deterministic and explainable. Filters refuse a node with words a person can
act on ("node-3 has 8 GB of memory, needs 24"); preferences only rank the
nodes that are left. The same views and request always give the same answer:
every tie ends at the node id.

Placing works on ``NodeView``s, flat snapshots built once from the agent
service's ``Node`` records (``node_view``), so that placing a catalog over a
large fleet does not re-read pydantic models for every request.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from llmgw.protocol import GPU, NIC_PATH_ORDER, GPUUsage, ProvisionState
from llmgw.server.control.agents import Node, NodeState

GiB = 1 << 30
CPU_ENGINE = "llamacpp"  # the only engine that runs without a GPU

# Distance of a GPU to an adapter: PIX nearest; a path not reported ranks last.
_PATH_RANK = {p: i for i, p in enumerate(NIC_PATH_ORDER)}
_UNKNOWN_PATH = len(NIC_PATH_ORDER)

# Above this many GPU subsets to score, choose greedily: a 16-card node asked
# for 8 would otherwise score 12,870 sets on every placement.
_MAX_SUBSETS = 4096

# Words in product names that say nothing about which card it is.
_VENDOR_WORDS = {"nvidia", "tesla", "geforce", "quadro"}
_MEMORY_WORD = re.compile(r"^\d+\s*gb$")


# --------------------------------------------------------------- GPU classes


def gpu_class_of(gpu: GPU) -> str:
    """A GPU's class, model and memory: ``h100-80g``, ``l40s-45g``, ``a100-40g``.

    Memory is rounded to whole GiB because that is how cards are sold and how
    operators write ``gpu_class`` (an H100 reports 79.6 GiB, an L40S 44.99).
    """
    return _class_of(gpu.name, gpu.memory_total_bytes)


@functools.lru_cache(maxsize=256)
def _class_of(name: str | None, memory_total_bytes: int | None) -> str:
    # A fleet has a few kinds of card and a view is built for every card of every node.
    model = _gpu_model(name)
    if memory_total_bytes is None:
        return model
    return f"{model}-{round(memory_total_bytes / GiB)}g"


def _gpu_model(name: str | None) -> str:
    if not name:
        return "gpu"
    # "NVIDIA A100-SXM4-40GB": the model is the first dash-separated part.
    words = [w for w in re.split(r"[\s_]+", name.strip().lower()) if w]
    words = [w for w in words if w not in _VENDOR_WORDS]
    parts = [p for w in words for p in w.split("-") if p]
    parts = [p for p in parts if not _MEMORY_WORD.match(p)]
    if not parts:
        return "gpu"
    # "RTX 4090", "RTX A6000": the bare prefix would lump every RTX together.
    if parts[0] == "rtx" and len(parts) > 1:
        return "rtx" + parts[1]
    return parts[0]


# ---------------------------------------------------------------- node views


@dataclass(frozen=True)
class GPUView:
    index: int
    gpu_class: str
    memory_gb: float | None = None
    healthy: bool = True
    problems: tuple[str, ...] = ()
    free: bool = True  # not held by another replica
    numa_node: int | None = None
    nvlink_peers: frozenset[int] = frozenset()
    nic_paths: Mapping[str, str] = field(default_factory=dict)
    nvlink_domain: str | None = None  # multi-node NVLink domain, once joined


@dataclass(frozen=True)
class Claims:
    """What other replicas already hold on a node: GPU indexes and declared memory."""

    gpus: frozenset[int] = frozenset()
    memory_gb: float = 0.0
    replicas: int = 0


@dataclass(frozen=True)
class NodeFabricFacts:
    """What the control plane knows of one node's fabrics beyond agent.yaml's names."""

    # declared fabric name -> the physical fabric ids (e.g. "ib:0x..." or "roce:10.0.0.0/24")
    # its adapters' ACTIVE ports are on; a name absent or mapped to an empty set: not known
    physical: Mapping[str, frozenset[str]] = field(default_factory=dict)
    # adapter (hca) name -> the GUIDs of the leaf switches it is cabled to, from the fabric map; absent: not mapped
    leaves: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # adapter name -> a sentence saying why its cable is degraded (trained below others of its kind)
    degraded: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class NodeView:
    node_id: str
    state: NodeState = NodeState.READY
    cordoned: bool = False
    draining: bool = False
    engines: Mapping[str, str] = field(default_factory=dict)  # ready engine -> version ("" unknown)
    # False when the node has not said what it has (an older agent): it is
    # then not refused for lack of an engine.
    engines_probed: bool = True
    provision: Mapping[str, str] = field(default_factory=dict)  # engine -> words, not ready ones
    gpus: tuple[GPUView, ...] = ()
    memory_total_gb: float | None = None
    memory_claimed_gb: float = 0.0
    replicas: int = 0  # replicas already here, so CPU replicas spread even without declared memory
    disk_free_gb: float | None = None  # on the weights filesystem; None: unknown or shared
    weights: frozenset[str] = frozenset()  # paths or sources of weights already here
    labels: Mapping[str, str] = field(default_factory=dict)
    fabrics: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # name -> adapters
    nvlink_domain: str | None = None  # every card joined one domain and IMEX is up
    # Physical identity, leaf switches and degraded cables; empty: placement knows names only.
    fabric_facts: NodeFabricFacts = field(default_factory=NodeFabricFacts)
    # Derived once, so each request's filters are dictionary look-ups.
    free_by_class: Mapping[str, tuple[int, ...]] = field(init=False, repr=False, compare=False)
    free_gpus: int = field(init=False, repr=False, compare=False)
    sort_key: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_class: dict[str, list[int]] = {}
        for g in self.gpus:
            if g.free and g.healthy:
                by_class.setdefault(g.gpu_class, []).append(g.index)
        object.__setattr__(self, "free_by_class", {c: tuple(sorted(v)) for c, v in by_class.items()})
        object.__setattr__(self, "free_gpus", sum(len(v) for v in by_class.values()))
        object.__setattr__(self, "sort_key", natural_key(self.node_id))

    @property
    def memory_free_gb(self) -> float | None:
        if self.memory_total_gb is None:
            return None
        return self.memory_total_gb - self.memory_claimed_gb

    def with_claim(self, gpus: Iterable[int] = (), memory_gb: float = 0.0) -> NodeView:
        """This node after a new replica takes ``gpus`` and declares ``memory_gb``."""
        taken = set(gpus)
        new_gpus = tuple(dataclasses.replace(g, free=False) if g.index in taken else g for g in self.gpus)
        return dataclasses.replace(
            self,
            gpus=new_gpus,
            memory_claimed_gb=self.memory_claimed_gb + (memory_gb or 0.0),
            replicas=self.replicas + 1,
        )


def natural_key(s: str) -> tuple:
    """node-2 before node-10, as a person reads them."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", s))


def node_view(
    node: Node,
    cordoned: bool = False,
    draining: bool = False,
    claims: Claims | None = None,
    fabric_facts: NodeFabricFacts | None = None,
) -> NodeView:
    """Flatten a ``Node`` record (registration plus latest heartbeat) for placement;
    ``fabric_facts`` is what the control plane learnt of its fabrics (identity, map)."""
    claims = claims or Claims()
    inv = node.inventory

    # Engines: proved ones with versions; words for those still being provisioned.
    versions = node.engine_versions or {}
    engines = {e: versions.get(e, "") for e in node.ready_engines()}
    for e, st in node.provision.items():
        if st.state == ProvisionState.READY and st.version and not engines.get(e):
            engines[e] = st.version
    provision: dict[str, str] = {}
    for e, st in node.provision.items():
        if e in engines or st.state == ProvisionState.READY:
            continue
        provision[e] = f"{st.state.value}: {st.detail}" if st.detail else st.state.value
    probed = node.engine_versions is not None or bool(node.provision)

    # GPUs: the inventory, with health figures from the latest heartbeat.
    usage: dict[int, GPUUsage] = {u.index: u for u in node.gpus or ()}
    gpus: list[GPUView] = []
    domains: set[str | None] = set()
    for g in (inv.gpus if inv else None) or ():
        u = usage.get(g.index)
        problems = list(g.problems or ())
        ecc = u.ecc_uncorrected if u and u.ecc_uncorrected is not None else g.ecc_uncorrected
        if ecc:
            problems.append(f"{ecc} uncorrected ECC errors")
        fab = (u.fabric if u and u.fabric else None) or g.fabric
        domain = fab.domain if fab else None
        domains.add(domain)
        gpus.append(
            GPUView(
                index=g.index,
                gpu_class=gpu_class_of(g),
                memory_gb=g.memory_total_bytes / GiB if g.memory_total_bytes is not None else None,
                healthy=not problems,
                problems=tuple(problems),
                free=g.index not in claims.gpus,
                numa_node=g.numa_node,
                nvlink_peers=frozenset(p.index for p in g.nvlink_peers or ()),
                nic_paths=dict(g.nic_paths or {}),
                nvlink_domain=domain,
            )
        )
    # A node is in an NVLink domain only when every card joined the same one
    # and IMEX, which shares memory across nodes, is running.
    imex_up = bool(node.imex and (node.imex.state or "").lower() == "active")
    nvlink_domain = None
    if gpus and imex_up and len(domains) == 1:
        nvlink_domain = next(iter(domains))

    memory = node.memory or (inv.memory if inv else None)
    total_gb = memory.total_bytes / GiB if memory and memory.total_bytes is not None else None

    # The weights filesystem is the first one listed; a shared one is everyone's
    # space and is not counted per node.
    storage = node.storage or (inv.storage if inv else None) or []
    disk_free = None
    if storage and not storage[0].shared and storage[0].free_bytes is not None:
        disk_free = storage[0].free_bytes / GiB

    # An empty directory is not weights.
    weights = frozenset(w.path for w in node.weights or () if w.size_bytes != 0)

    return NodeView(
        node_id=node.node_id,
        state=node.state,
        cordoned=cordoned,
        draining=draining,
        engines=engines,
        engines_probed=probed,
        provision=provision,
        gpus=tuple(gpus),
        memory_total_gb=total_gb,
        memory_claimed_gb=claims.memory_gb,
        replicas=claims.replicas,
        disk_free_gb=disk_free,
        weights=weights,
        labels=dict(node.labels or {}),
        fabrics={f.fabric: tuple(f.hcas or ()) for f in node.fabrics or ()},
        nvlink_domain=nvlink_domain,
        fabric_facts=fabric_facts if fabric_facts is not None else NodeFabricFacts(),
    )


def _view_inputs(node: Node) -> tuple:
    """Every figure of a ``Node`` that ``node_view`` reads, and nothing else (not GPU
    utilisation or memory used, load, last seen): equal inputs, equal views. The
    inventory, replaced only by a registration, is compared apart by identity."""
    inv = node.inventory
    memory = node.memory or (inv.memory if inv else None)
    storage = node.storage or (inv.storage if inv else None) or []
    first = (storage[0].shared, storage[0].free_bytes) if storage else None
    return (
        node.state,
        tuple(node.engine_versions.items()) if node.engine_versions is not None else None,
        tuple((e, st.state, st.version, st.detail) for e, st in node.provision.items()),
        tuple((u.index, u.ecc_uncorrected, bool(u.fabric), u.fabric.domain if u.fabric else None) for u in node.gpus)
        if node.gpus
        else (),
        (node.imex.state if node.imex else None, bool(node.imex)),
        memory.total_bytes if memory else None,
        first,
        tuple((w.path, w.size_bytes != 0) for w in node.weights or ()),
        tuple((node.labels or {}).items()),
        tuple((f.fabric, tuple(f.hcas or ())) for f in node.fabrics or ()),
    )


def _view_refs(node: Node) -> tuple:
    """The objects ``node_view`` reads: all the same ones (a heartbeat replaces what it
    reports), and the same version, and the record is as it was."""
    return (
        node.version,
        node.state,
        node.inventory,
        node.engine_versions,
        node.gpus,
        node.imex,
        node.memory,
        node.storage,
        node.weights,
        node.labels,
        node.fabrics,
        *node.provision.values(),  # merged into one dict in place, so each status apart
    )


@dataclass
class _CachedView:
    refs: tuple
    inventory: object
    inputs: tuple
    extra: tuple
    view: NodeView


class NodeViewCache:
    """Node views kept between passes: a node's view is built again only when what
    placement reads of it changed (its record's figures, its mark, its claims, its
    fabric facts), not on every heartbeat."""

    def __init__(self) -> None:
        self._views: dict[str, _CachedView] = {}

    def view(
        self,
        node: Node,
        cordoned: bool = False,
        draining: bool = False,
        claims: Claims | None = None,
        fabric_facts: NodeFabricFacts | None = None,
    ) -> NodeView:
        """``node_view(node, ...)``, from the cache when nothing it reads changed."""
        extra = (cordoned, draining, claims or Claims(), fabric_facts)
        refs = _view_refs(node)
        c = self._views.get(node.node_id)
        if c is not None and c.extra == extra:
            same = len(c.refs) == len(refs) and all(a is b for a, b in zip(c.refs[1:], refs[1:], strict=True))
            if same and c.refs[0] == refs[0]:
                return c.view
            if c.inventory is node.inventory and c.inputs == _view_inputs(node):
                c.refs = refs
                return c.view
        v = node_view(node, cordoned=cordoned, draining=draining, claims=claims, fabric_facts=fabric_facts)
        self._views[node.node_id] = _CachedView(refs, node.inventory, _view_inputs(node), extra, v)
        return v

    def forget_except(self, node_ids: Iterable[str]) -> None:
        """Drop the views of nodes no longer known."""
        keep = set(node_ids)
        for nid in [n for n in self._views if n not in keep]:
            del self._views[nid]


# ------------------------------------------------------------------ requests


@dataclass(frozen=True)
class PlacementRequest:
    model: str
    engine: str = CPU_ENGINE
    gpu_class: str | None = None  # None: CPU
    tp: int = 1  # GPUs per node
    nodes: int = 1
    min_memory_gb: float | None = None
    disk_gb: float | None = None  # None: size of the weights unknown
    node_selector: Mapping[str, str] = field(default_factory=dict)
    source: str | None = None  # the weights, to prefer nodes that hold them

    def __post_init__(self) -> None:
        # Bad profiles are refused here rather than placed wrongly.
        if self.gpu_class is None and self.engine != CPU_ENGINE:
            raise ValueError(f"{self.engine} needs a gpu_class: only {CPU_ENGINE} runs on CPU")
        if self.tp < 1 or self.nodes < 1:
            raise ValueError("tp and nodes must be at least 1")

    @property
    def gpus_per_node(self) -> int:
        return self.tp if self.gpu_class else 0


# ------------------------------------------------------------------- results


@dataclass(frozen=True)
class NodeVerdict:
    node_id: str
    chosen: bool
    reasons: list[str]


@dataclass(frozen=True)
class PlacementGroup:
    """Where a multi-node replica may form: one NVLink domain, or one part of a
    declared fabric (the nodes whose adapters for that name are on one physical
    fabric, or those that cannot say which)."""

    name: str  # the domain (cluster/clique) or the fabric's declared name
    nvlink: bool = False  # an NVLink domain, preferred; else a declared fabric
    identity: str | None = None  # the physical fabric id; None: not known

    def __str__(self) -> str:
        if self.nvlink:
            return f"nvlink domain {self.name}"
        return f"fabric {self.name} ({self.identity})" if self.identity else f"fabric {self.name}"

    def adapters(self, v: NodeView) -> tuple[str, ...]:
        """The node's adapters NCCL is given: the fabric's; none inside an NVLink domain."""
        return () if self.nvlink else tuple(v.fabrics.get(self.name, ()))


def _groups_of(v: NodeView) -> list[PlacementGroup]:
    out = [PlacementGroup(v.nvlink_domain, nvlink=True)] if v.nvlink_domain else []
    physical = v.fabric_facts.physical
    for f in v.fabrics:
        ids = physical.get(f) or frozenset()
        if len(ids) > 1:
            continue  # on two physical fabrics: refused for this name (see _split_words)
        # Nodes that cannot say share one group of their own, so a cluster with
        # no identity known places exactly as on names alone.
        out.append(PlacementGroup(f, identity=next(iter(ids)) if ids else None))
    return out


_COUNT_WORDS = {2: "two", 3: "three", 4: "four"}


def _split_words(v: NodeView) -> list[str]:
    """A refusal for each declared name whose adapters sit on more than one physical fabric."""
    out = []
    for f in v.fabrics:
        ids = sorted(v.fabric_facts.physical.get(f) or ())
        if len(ids) > 1:
            count = _COUNT_WORDS.get(len(ids), str(len(ids)))
            out.append(
                f"{v.node_id} is refused on fabric {f}: its adapters for fabric {f} "
                f"are cabled to {count} fabrics: {', '.join(ids)}"
            )
    return out


def _degraded_of(v: NodeView, group: PlacementGroup) -> list[tuple[str, str]]:
    """(adapter, why) for the node's adapters on the group's fabric whose cable is degraded."""
    deg = v.fabric_facts.degraded
    if not deg:
        return []
    return [(a, deg[a]) for a in group.adapters(v) if a in deg]


def _leaves_of(v: NodeView, group: PlacementGroup) -> frozenset[str]:
    """The leaf switches the node's adapters on the group's fabric are cabled to."""
    leaves = v.fabric_facts.leaves
    if not leaves:
        return frozenset()
    return frozenset(leaf for a in group.adapters(v) for leaf in leaves.get(a, ()))


def _degraded_words(degraded: Sequence[tuple[str, str]]) -> str:
    return " and ".join(f"its cable on {a} is degraded ({why})" for a, why in degraded)


def _and(items: Iterable[str]) -> str:
    items = list(items)
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


@dataclass(frozen=True)
class Placement:
    nodes: list[tuple[str, tuple[int, ...]]]  # (node id, GPU indexes), rank 0 first
    explanation: str
    ok: bool = dataclasses.field(default=True, init=False)
    # Multi-node only: the declared fabric the replica formed on (its adapters on each
    # node go to NCCL), or the NVLink domain it formed in.
    fabric: str | None = None
    nvlink_domain: str | None = None
    adapters: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)  # node -> adapters


@dataclass(frozen=True)
class Refusal:
    model: str
    verdicts: list[NodeVerdict]
    ok: bool = dataclasses.field(default=False, init=False)

    @property
    def explanation(self) -> str:
        if not self.verdicts:
            return f"cannot place {self.model}: no nodes"
        lines = [f"cannot place {self.model}:"]
        lines += [f"  {r}" for v in self.verdicts for r in v.reasons]
        return "\n".join(lines)


# ------------------------------------------------------------------- filters


def _n(x: float) -> str:
    """A size as a person writes it: 8, 7.5, 120."""
    if x >= 10 or abs(x - round(x)) < 0.05:
        return str(round(x))
    return f"{x:.1f}"


def _holds_weights(view: NodeView, source: str | None) -> bool:
    if not source or not view.weights:
        return False
    if source in view.weights:
        return True
    # A node reports where it keeps the weights, not the URL they came from:
    # match on the last part of the source (the file, or the set's directory).
    tail = source.rstrip("/").rsplit("/", 1)[-1]
    return bool(tail) and any(w.rstrip("/").rsplit("/", 1)[-1] == tail for w in view.weights)


def _fits(v: NodeView, r: PlacementRequest, why: list[str] | None = None) -> bool:
    """Whether the node passes every filter; each filter is written here, once.

    Without ``why``: the yes/no alone, ending at the first refusal without
    building its words (placing asks this of every node for every request, and
    a call per filter would cost more than the filters). With a list: every
    filter runs and appends its refusal to it in words (see ``_refusals``).
    """
    nid = v.node_id
    if v.state is not NodeState.READY:
        if why is None:
            return False
        why.append(f"{nid} is {v.state}")
    if v.cordoned:
        if why is None:
            return False
        why.append(f"{nid} is cordoned")
    if v.draining:
        if why is None:
            return False
        why.append(f"{nid} is draining")
    if v.engines_probed and r.engine not in v.engines:
        if why is None:
            return False
        if r.engine in v.provision:
            why.append(f"{nid} cannot run {r.engine} yet: {v.provision[r.engine]}")
        else:
            why.append(f"{nid} does not have {r.engine} installed")
    if r.gpu_class and (free := len(v.free_by_class.get(r.gpu_class, ()))) < r.tp:
        if why is None:
            return False
        why.append(_gpu_refusal(v, r, free))
    if (
        r.min_memory_gb
        and v.memory_total_gb is not None
        and (avail := v.memory_total_gb - v.memory_claimed_gb) < r.min_memory_gb
    ):
        if why is None:
            return False
        claimed = (
            f" ({_n(v.memory_claimed_gb)} of {_n(v.memory_total_gb)} claimed by other replicas)"
            if v.memory_claimed_gb
            else ""
        )
        why.append(f"{nid} has {_n(max(avail, 0))} GB of memory, needs {_n(r.min_memory_gb)}{claimed}")
    if r.disk_gb and v.disk_free_gb is not None and v.disk_free_gb < r.disk_gb and not _holds_weights(v, r.source):
        if why is None:
            return False
        why.append(f"{nid} has {_n(v.disk_free_gb)} GB free for weights, needs {_n(r.disk_gb)}")
    for k, want in r.node_selector.items():
        if (have := v.labels.get(k)) != want:
            if why is None:
                return False
            it_has = f" (it has {k}={have})" if have is not None else ""
            why.append(f"{nid} lacks label {k}={want}{it_has}")
    return not why


def _gpu_refusal(v: NodeView, r: PlacementRequest, free: int) -> str:
    """Why fewer than ``tp`` cards of the class are free: none of the class, held, or unhealthy."""
    of_class = [g for g in v.gpus if g.gpu_class == r.gpu_class]
    if not of_class:
        classes = sorted({g.gpu_class for g in v.gpus})
        has = f" (it has {', '.join(classes)})" if classes else " (it has no GPUs)"
        return f"{v.node_id} has no {r.gpu_class} GPUs{has}"
    held = sum(1 for g in of_class if not g.free)
    bad = [g for g in of_class if not g.healthy]
    parts = []
    if held:
        parts.append(f"{held} held by other replicas")
    if bad:
        parts.append("unhealthy: " + "; ".join(f"GPU {g.index} {', '.join(g.problems)}" for g in bad))
    suffix = f" ({'; '.join(parts)})" if parts else ""
    return f"{v.node_id} has {free} free {r.gpu_class} GPUs, needs {r.tp}{suffix}"


def _refusals(v: NodeView, r: PlacementRequest) -> list[str]:
    """Every filter this node fails, in words; empty when it fits."""
    why: list[str] = []
    _fits(v, r, why)
    return why


# --------------------------------------------------------------- preferences


def _rank(v: NodeView, r: PlacementRequest) -> tuple:
    """Lower is better: weights already here, then packed (GPU) or spread (CPU), then id."""
    holds = 0 if _holds_weights(v, r.source) else 1
    if r.gpu_class:
        # Packing: the node left with the fewest free GPUs keeps whole nodes
        # free for the replicas that need them.
        return (holds, v.free_gpus - r.tp, v.sort_key)
    # CPU replicas spread: nothing stops two sharing a machine's cores.
    free = v.memory_free_gb
    return (holds, v.replicas, -(free if free is not None else -1.0), v.sort_key)


def _choose_gpus(v: NodeView, r: PlacementRequest, adapters: Sequence[str] = ()) -> tuple[int, ...]:
    """The best ``tp`` free GPUs of the class on one node.

    Scored by NVLink: a fully connected set first, then the most pairs; then,
    for a multi-node shard, how near each card is to one of the fabric's
    adapters; then NUMA nodes spanned; the lowest indexes break ties (and are
    all a node without topology gets).
    """
    if not r.gpu_class:
        return ()
    free = v.free_by_class.get(r.gpu_class, ())
    k = r.tp
    if len(free) == k:
        return free
    by_index = {g.index: g for g in v.gpus}

    def score(subset: tuple[int, ...]) -> tuple:
        pairs = sum(1 for a, b in itertools.combinations(subset, 2) if b in by_index[a].nvlink_peers)
        full = pairs == k * (k - 1) // 2
        if adapters:
            near = sum(
                min(_PATH_RANK.get(by_index[i].nic_paths.get(a, ""), _UNKNOWN_PATH) for a in adapters) for i in subset
            )
        else:
            near = 0
        numa = len({by_index[i].numa_node for i in subset})
        return (0 if full and k > 1 else 1, -pairs, near, numa, subset)

    n_subsets = 1
    for i in range(k):
        n_subsets = n_subsets * (len(free) - i) // (i + 1)
    if n_subsets <= _MAX_SUBSETS:
        return min(itertools.combinations(free, k), key=score)
    # Greedy: grow from each starting card by the best next card.
    best = None
    for start in free:
        chosen = [start]
        while len(chosen) < k:
            rest = [i for i in free if i not in chosen]
            chosen.append(min(rest, key=lambda i: score(tuple(sorted(chosen + [i])))))
        cand = tuple(sorted(chosen))
        if best is None or score(cand) < score(best):
            best = cand
    return best  # type: ignore[return-value]


def _gpu_words(v: NodeView, gpus: tuple[int, ...]) -> str:
    if not gpus:
        return "CPU"
    by_index = {g.index: g for g in v.gpus}
    words = f"GPUs {','.join(map(str, gpus))}"
    if len(gpus) > 1 and all(b in by_index[a].nvlink_peers for a, b in itertools.combinations(gpus, 2)):
        words += " (NVLink-connected)"
    return words


# ------------------------------------------------------------------- placing


def place(request: PlacementRequest, nodes: Sequence[NodeView]) -> Placement | Refusal:
    """Choose nodes and GPUs for one replica, or say why every node was refused."""
    r = request
    fit = [v for v in nodes if _fits(v, r)]
    if r.nodes == 1:
        if not fit:
            return _refuse(r, nodes)
        best = min(fit, key=lambda v: _rank(v, r))
        gpus = _choose_gpus(best, r)
        return Placement(nodes=[(best.node_id, gpus)], explanation=_why_single(best, gpus, r))
    formed = _best_group(r, fit)
    if formed is None:
        return _refuse(r, nodes)
    group, members = formed
    chosen = [(v.node_id, _choose_gpus(v, r, group.adapters(v))) for v in members]
    words = "; ".join(f"{nid}: {_gpu_words(v, g)}" for (nid, g), v in zip(chosen, members, strict=True))
    notes = [_leaf_note(group, members)] + [
        f"{v.node_id}: {_degraded_words(d)}" for v in members if (d := _degraded_of(v, group))
    ]
    return Placement(
        nodes=chosen,
        explanation=f"{r.model} on {len(chosen)} nodes in {group}: {words}" + "".join(f"; {n}" for n in notes if n),
        fabric=None if group.nvlink else group.name,
        nvlink_domain=group.name if group.nvlink else None,
        adapters={v.node_id: group.adapters(v) for v in members},
    )


def _why_single(v: NodeView, gpus: tuple[int, ...], r: PlacementRequest) -> str:
    parts = [f"{r.model} on {v.node_id}: {_gpu_words(v, gpus)}"]
    if _holds_weights(v, r.source):
        parts.append("it already holds the weights")
    if r.gpu_class:
        parts.append(f"packed: {v.free_gpus - r.tp} free GPUs left there")
    elif v.memory_free_gb is not None:
        parts.append(f"spread: the most free memory ({_n(v.memory_free_gb)} GB)")
    return "; ".join(parts)


def _groups(fit: Sequence[NodeView]) -> dict[PlacementGroup, list[NodeView]]:
    """The nodes that fit, by the groups they are in."""
    groups: dict[PlacementGroup, list[NodeView]] = {}
    for v in fit:
        for g in _groups_of(v):
            groups.setdefault(g, []).append(v)
    return groups


def _best_group(r: PlacementRequest, fit: Sequence[NodeView]) -> tuple[PlacementGroup, list[NodeView]] | None:
    best = None
    for group, members in _groups(fit).items():
        if len(members) < r.nodes:
            continue
        chosen = _choose_in_group(r, group, members)
        # NVLink domains first (InfiniBand is the fallback); then the fewest
        # nodes with a degraded cable, then the most under one leaf switch
        # (the network is paid on every step, a fetch of the weights once);
        # then the set holding the most weights and packing tightest; then the name.
        key = (
            0 if group.nvlink else 1,
            sum(1 for v in chosen if _degraded_of(v, group)),
            -_leaf_score(group, chosen)[0],
            sorted(_rank(v, r)[:2] for v in chosen),
            str(group),
        )
        if best is None or key < best[0]:
            best = (key, group, chosen)
    return None if best is None else (best[1], best[2])


def _choose_in_group(r: PlacementRequest, group: PlacementGroup, members: Sequence[NodeView]) -> list[NodeView]:
    """The group's ``r.nodes`` best members: the fewest with a degraded cable,
    then the most under one leaf switch, then by ``_rank``; in that order."""
    n = r.nodes
    key = {v.node_id: (bool(_degraded_of(v, group)), _rank(v, r)) for v in members}
    ranked = sorted(members, key=lambda v: key[v.node_id])
    if group.nvlink or not any(v.fabric_facts.leaves for v in members):
        return ranked[:n]
    healthy = sum(1 for v in ranked if not key[v.node_id][0])
    # Each leaf's nodes in rank order, healthy and degraded apart; a set uses n at most.
    by_leaf: dict[str, tuple[list[NodeView], list[NodeView]]] = {}
    for v in ranked:
        for leaf in _leaves_of(v, group):
            side = by_leaf.setdefault(leaf, ([], []))[key[v.node_id][0]]
            if len(side) < n:
                side.append(v)

    def reach(leaf: str) -> int:
        """How many of a set with the fewest degraded nodes can sit under the leaf."""
        h, d = by_leaf[leaf]
        return min(n, len(h)) if healthy >= n else len(h) + min(n - healthy, len(d))

    def under_first(leaf: str) -> list[NodeView]:
        # As sorting ``ranked`` by (degraded, not under the leaf) would, without
        # sorting every member for every leaf: a fleet has many leaves.
        h, d = by_leaf[leaf]
        order = itertools.chain(
            h, (ranked[i] for i in range(healthy)), d, (ranked[i] for i in range(healthy, len(ranked)))
        )
        out: list[NodeView] = []
        seen: set[str] = set()
        for v in order:
            if v.node_id not in seen:
                seen.add(v.node_id)
                out.append(v)
                if len(out) == n:
                    break
        return out

    most = max((reach(leaf) for leaf in by_leaf), default=0)
    candidates = [ranked[:n]]
    if most >= 2:
        candidates += [under_first(leaf) for leaf in sorted(by_leaf) if reach(leaf) == most]
    best = min(candidates, key=lambda c: (-_leaf_score(group, c)[0], sorted(key[v.node_id][1] for v in c)))
    return sorted(best, key=lambda v: key[v.node_id])


def _leaf_score(group: PlacementGroup, chosen: Sequence[NodeView]) -> tuple[int, list[str]]:
    """The most chosen nodes under one leaf switch, and those leaves; 0 when no two share one."""
    counts: dict[str, int] = {}
    for v in chosen:
        for leaf in _leaves_of(v, group):
            counts[leaf] = counts.get(leaf, 0) + 1
    top = max(counts.values(), default=0)
    if top < 2:
        return 0, []
    return top, sorted(x for x, c in counts.items() if c == top)


def _leaf_note(group: PlacementGroup, chosen: Sequence[NodeView]) -> str:
    """What the explanation says of the chosen nodes' leaf switches; empty when none shared."""
    top, leaves = _leaf_score(group, chosen)
    if not top:
        return ""
    if top == len(chosen):
        if len(leaves) == 1:
            return f"all under one leaf switch {leaves[0]}"
        return f"all under the same leaf switches {_and(leaves)}"
    return f"at most {top} of {len(chosen)} under one leaf switch ({', '.join(leaves)})"


def _refuse(r: PlacementRequest, nodes: Sequence[NodeView]) -> Refusal:
    return Refusal(model=r.model, verdicts=[v for v in explain(r, nodes) if not v.chosen])


def _multi_node_words(v: NodeView, r: PlacementRequest, groups: dict[PlacementGroup, list[NodeView]]) -> str:
    mine = [g for g, members in groups.items() if any(m is v for m in members)]
    counts = ", ".join(f"{g} has {len(groups[g])}" for g in sorted(mine, key=str))
    return f"{v.node_id} fits, but no fabric it is on has {r.nodes} nodes that fit ({counts})"


def explain(request: PlacementRequest, nodes: Sequence[NodeView]) -> list[NodeVerdict]:
    """Every node, in node order, with whether it was chosen and why (for
    ``llmgw ctl explain-placement``)."""
    r = request
    fit = [v for v in nodes if _fits(v, r)]
    chosen: dict[str, tuple[int, ...]] = {}
    lead: NodeView | None = None
    group: PlacementGroup | None = None
    members: list[NodeView] = []
    groups: dict[PlacementGroup, list[NodeView]] = {}
    if r.nodes == 1 and fit:
        lead = min(fit, key=lambda v: _rank(v, r))
        chosen[lead.node_id] = _choose_gpus(lead, r)
    elif r.nodes > 1:
        groups = _groups(fit)
        formed = _best_group(r, fit)
        if formed:
            group, members = formed
            for v in members:
                chosen[v.node_id] = _choose_gpus(v, r, group.adapters(v))
            lead = members[0]

    leaf_note = _leaf_note(group, members) if group is not None else ""
    out = []
    for v in sorted(nodes, key=lambda v: v.sort_key):
        if v.node_id in chosen:
            words = _why_single(v, chosen[v.node_id], r)
            if group is not None:
                words += f"; in {group}"
                if leaf_note:
                    words += f", {leaf_note}"
                if d := _degraded_of(v, group):
                    words += f"; {_degraded_words(d)}"
            out.append(NodeVerdict(v.node_id, True, [words]))
            continue
        reasons = _refusals(v, r)
        # Filter 7 refuses a name, not the node: said alongside whatever else applies.
        split = _split_words(v) if r.nodes > 1 else []
        if reasons:
            reasons += split
        elif r.nodes > 1 and not _groups_of(v):
            reasons = split or [f"{v.node_id} is on no fabric, so it cannot join a {r.nodes}-node replica"]
        elif lead is None:
            reasons = split + [_multi_node_words(v, r, groups)]
        else:
            reasons = split + [_preferred_words(v, lead, r, group, members)]
        out.append(NodeVerdict(v.node_id, False, reasons))
    return out


def _preferred_words(
    v: NodeView, lead: NodeView, r: PlacementRequest, group: PlacementGroup | None, members: Sequence[NodeView] = ()
) -> str:
    """Why a node that fits lost to the chosen one(s)."""
    if group is not None and group not in _groups_of(v):
        return f"{v.node_id} fits, but the replica was placed in {group}{_identity_words(v, group)}"
    if r.nodes > 1:
        if group is not None and not group.nvlink and members and (words := _fabric_loss_words(v, group, members)):
            return words
        return f"{v.node_id} fits, but enough nodes ranked ahead of it in {group}"
    if _holds_weights(lead, r.source) and not _holds_weights(v, r.source):
        return f"{v.node_id} fits, but {lead.node_id} already holds the weights"
    if r.gpu_class:
        mine, theirs = v.free_gpus - r.tp, lead.free_gpus - r.tp
        if mine != theirs:
            return f"{v.node_id} fits, but {lead.node_id} packs tighter ({theirs} free GPUs left there, {mine} here)"
    else:
        if v.replicas != lead.replicas:
            return (
                f"{v.node_id} fits, but {lead.node_id} runs fewer replicas ({lead.replicas} there, {v.replicas} here)"
            )
        mine_m, theirs_m = v.memory_free_gb, lead.memory_free_gb
        if mine_m != theirs_m:
            here = f"{_n(mine_m)} GB" if mine_m is not None else "unknown"
            return (
                f"{v.node_id} fits, but {lead.node_id} has more free memory ({_n(theirs_m or 0)} GB there, {here} here)"
            )
    return f"{v.node_id} fits, but {lead.node_id} comes first by name"


def _fabric_loss_words(v: NodeView, group: PlacementGroup, members: Sequence[NodeView]) -> str:
    """Why a node in the chosen fabric group lost for its cable or its leaf
    switch; empty when neither is why."""
    if (degraded := _degraded_of(v, group)) and any(not _degraded_of(m, group) for m in members):
        return f"{v.node_id} fits, but {_degraded_words(degraded)}"
    shared = sorted(frozenset.intersection(*(_leaves_of(m, group) for m in members)))
    leaves = _leaves_of(v, group)
    if not shared or leaves.intersection(shared):
        return ""
    where = (
        f"{v.node_id} is under {_and(sorted(leaves))}"
        if leaves
        else f"{v.node_id}'s adapters are not on the fabric map"
    )
    switches = "leaf switches" if len(shared) > 1 else "leaf switch"
    return f"{v.node_id} fits, but the chosen nodes share {switches} {_and(shared)} and {where}"


def _identity_words(v: NodeView, group: PlacementGroup) -> str:
    """Why a node on the group's declared fabric is not in it: another physical
    fabric, or one side cannot say which it is on."""
    if group.nvlink or group.name not in v.fabrics:
        return ""
    ids = sorted(v.fabric_facts.physical.get(group.name) or ())
    if len(ids) > 1:
        return ""  # the two-fabric refusal says why
    if ids and group.identity:
        return f"; its adapters for {group.name} are on {ids[0]}"
    if ids:
        return (
            f", among nodes that cannot say which physical fabric they are on; "
            f"its adapters for {group.name} are on {ids[0]}"
        )
    return f"; it cannot say which physical fabric its adapters for {group.name} are on"


def _schedulable(v: NodeView) -> bool:
    """Whether a node can take new work at all: the first three filters of ``_fits``."""
    return v.state is NodeState.READY and not v.cordoned and not v.draining


def _tail(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def _refusal_key(r: PlacementRequest) -> tuple:
    """What a refusal's node-by-node words depend on: the request without its model name
    (the source only through the disk filter's "already holds the weights")."""
    return (
        r.engine,
        r.gpu_class,
        r.tp,
        r.nodes,
        r.min_memory_gb,
        r.disk_gb,
        tuple(sorted(r.node_selector.items())),
        r.source if r.disk_gb else None,
    )


class _Pool:
    """The schedulable nodes one engine and GPU class (or CPU) can use, in ``_rank``
    order without its first part (weights held), which a request checks apart."""

    def __init__(self, engine: str, gpu_class: str | None) -> None:
        self.engine = engine
        self.gpu_class = gpu_class
        self.keys: list[tuple] = []  # sorted; each ends in the node's position in the fleet

    def key(self, v: NodeView, pos: int) -> tuple | None:
        """The node's place in this pool, as ``_rank`` orders it; None when it is not in it."""
        if not _schedulable(v) or (v.engines_probed and self.engine not in v.engines):
            return None
        if self.gpu_class:
            # free_gpus - tp ranks as free_gpus does; a node with none of the class free never fits.
            if not v.free_by_class.get(self.gpu_class):
                return None
            return (v.free_gpus, v.sort_key, pos)
        free = v.memory_free_gb
        return (v.replicas, -(free if free is not None else -1.0), v.sort_key, pos)

    def update(self, old: NodeView, new: NodeView, pos: int) -> None:
        if (k := self.key(old, pos)) is not None:
            del self.keys[bisect.bisect_left(self.keys, k)]
        if (k := self.key(new, pos)) is not None:
            bisect.insort(self.keys, k)


class Fleet:
    """Node views that placements claim from in turn, so that each request
    placed sees the GPUs and memory the earlier ones took.

    ``place`` looks only at candidates: the nodes an index of the views (by
    schedulable state, engine, free GPUs of a class, rank order, weights held)
    says could fit, checked with ``_fits`` in ``_rank`` order until the first
    that fits; what it gives is exactly what ``place`` over every view gives.
    Claims update the index in place. A refusal's words (every node, and why)
    are kept per request shape and redone only for the nodes claimed since.
    ``indexed=False`` places over every view, as the reference the index is
    tested against.
    """

    def __init__(self, nodes: Iterable[NodeView], indexed: bool = True) -> None:
        self.views = list(nodes)
        self.indexed = indexed
        self._pos = {v.node_id: i for i, v in enumerate(self.views)}
        self._pools: dict[tuple[str, str | None], _Pool] = {}
        self._weights: dict[str, set[int]] | None = None  # path, or its last part -> positions
        self._claimed: list[int] = []  # positions, in the order claims changed them
        # request shape -> (claims seen, verdict per position) for single-node refusals;
        # (claims seen, verdicts) for multi-node ones
        self._refused: dict[tuple, tuple[int, list[NodeVerdict]]] = {}
        self._order: list[int] | None = None  # positions in node order, as ``explain`` lists them

    def claim(self, placement: Placement, memory_gb: float | None) -> None:
        """``placement``'s GPUs taken, and ``memory_gb`` declared on each of its nodes."""
        for nid, gpus in placement.nodes:
            i = self._pos[nid]
            old = self.views[i]
            new = self.views[i] = old.with_claim(gpus, memory_gb or 0.0)
            for pool in self._pools.values():
                pool.update(old, new, i)
            self._claimed.append(i)

    def place(self, request: PlacementRequest) -> Placement | Refusal:
        """``place(request, self.views)``, looking only at the candidates."""
        if not self.indexed:
            return place(request, self.views)
        r = request
        if r.nodes > 1:
            # The nodes that fit, in fleet order, are all that forming a group reads.
            res = place(r, [self.views[i] for i in sorted(self._candidates(r))])
            return res if isinstance(res, Placement) else self._refuse(r)
        best = self._best_single(r)
        if best is None:
            return self._refuse(r)
        gpus = _choose_gpus(best, r)
        return Placement(nodes=[(best.node_id, gpus)], explanation=_why_single(best, gpus, r))

    # -- the index --------------------------------------------------------------

    def _pool(self, r: PlacementRequest) -> _Pool:
        key = (r.engine, r.gpu_class)
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = _Pool(r.engine, r.gpu_class)
            pool.keys = sorted(k for i, v in enumerate(self.views) if (k := pool.key(v, i)) is not None)
        return pool

    def _holders(self, source: str | None) -> set[int]:
        """Positions of nodes that may hold ``source``'s weights (``_holds_weights`` decides)."""
        if not source:
            return set()
        if self._weights is None:
            self._weights = {}
            for i, v in enumerate(self.views):
                for w in v.weights:
                    self._weights.setdefault(w, set()).add(i)
                    if t := _tail(w):
                        self._weights.setdefault("\0" + t, set()).add(i)
        out = set(self._weights.get(source, ()))
        if t := _tail(source):
            out |= self._weights.get("\0" + t, set())
        return out

    def _best_single(self, r: PlacementRequest) -> NodeView | None:
        """The node ``min(fit, key=_rank)`` would give, or None when no node fits."""
        views = self.views
        # Holding the weights ranks first, and few nodes hold any one model's.
        held = [
            (_rank(v, r), i) for i in self._holders(r.source) if _holds_weights(v := views[i], r.source) and _fits(v, r)
        ]
        if held:
            return views[min(held)[1]]
        return next((v for i in self._in_pool(r) if _fits(v := views[i], r)), None)

    def _candidates(self, r: PlacementRequest) -> list[int]:
        """Positions of every node that fits."""
        return [i for i in self._in_pool(r) if _fits(self.views[i], r)]

    def _in_pool(self, r: PlacementRequest) -> Iterator[int]:
        """Positions of the pool's nodes in rank order, from the first that could be enough."""
        keys = self._pool(r).keys
        # Fewer free GPUs in all than tp: none of the class can be enough.
        start = bisect.bisect_left(keys, (r.tp,)) if r.gpu_class else 0
        return (k[-1] for k in itertools.islice(keys, start, None))

    # -- refusals ------------------------------------------------------------------

    def _refuse(self, r: PlacementRequest) -> Refusal:
        """``_refuse(r, self.views)``: worded once per request shape, then again only
        for the nodes claimed since."""
        key = _refusal_key(r)
        seen = self._refused.get(key)
        if r.nodes > 1:
            # Multi-node words count every group's members: any claim may change them.
            if seen is None or seen[0] != len(self._claimed):
                seen = self._refused[key] = (len(self._claimed), _refuse(r, self.views).verdicts)
            return Refusal(model=r.model, verdicts=list(seen[1]))
        if seen is None:
            by_pos = [NodeVerdict(v.node_id, False, _refusals(v, r)) for v in self.views]
        else:
            by_pos = list(seen[1])
            for i in set(self._claimed[seen[0] :]):
                by_pos[i] = NodeVerdict(self.views[i].node_id, False, _refusals(self.views[i], r))
        self._refused[key] = (len(self._claimed), by_pos)
        if self._order is None:
            self._order = sorted(range(len(self.views)), key=lambda i: self.views[i].sort_key)
        return Refusal(model=r.model, verdicts=[by_pos[i] for i in self._order])


def place_all(
    requests: Iterable[PlacementRequest], nodes: Sequence[NodeView], indexed: bool = True
) -> tuple[list[Placement | Refusal], list[NodeView]]:
    """Place requests in order, each seeing the GPUs and memory the earlier
    ones claimed; returns the results and the views after all claims."""
    fleet = Fleet(nodes, indexed=indexed)
    results: list[Placement | Refusal] = []
    for r in requests:
        res = fleet.place(r)
        results.append(res)
        if isinstance(res, Placement):
            fleet.claim(res, r.min_memory_gb)
    return results, fleet.views
