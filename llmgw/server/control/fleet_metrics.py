"""Prometheus metrics about the fleet, read from the control plane's memory at scrape time.

Nothing here keeps a ticker or a copy: each scrape walks the agent service's
node records and the reconciler's replicas. A value a node did not report is
absent, never 0 (a card whose utilisation the driver cannot read is not
idle). A node whose last message is older than ``stale_after`` seconds keeps
only ``llmgw_node_up`` and ``llmgw_node_last_seen_seconds``: its other
numbers describe a machine as it was, not as it is.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from llmgw.server.control.agents import NodeState
from llmgw.server.control.placement import gpu_class_of
from llmgw.server.control.reconciler import NodeMark, ReplicaState

if TYPE_CHECKING:
    from llmgw.protocol import GPU, GPUUsage, IBPort
    from llmgw.server.control.agents import AgentService, Node

STALE_AFTER = 60.0

# A port's traffic counters, which say it carries data, not that it is failing; every other
# counter the agent reads (symbol errors, link downs, discards ...) is an error counter.
TRAFFIC_COUNTERS = frozenset(
    {"port_xmit_data", "port_rcv_data", "port_xmit_packets", "port_rcv_packets", "port_xmit_wait"}
)


class ReplicaLike(Protocol):
    # Read-only: the reconciler's Replica computes state and node_ids.
    @property
    def model(self) -> str: ...
    @property
    def state(self) -> ReplicaState: ...
    @property
    def node_ids(self) -> list[str]: ...


Replicas = Callable[[], Iterable[ReplicaLike]]
NodeMarks = Callable[[], Mapping[str, NodeMark]]  # node id -> its mark


def _gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


class FleetCollector:
    """A prometheus_client collector over the nodes and replicas the control plane knows."""

    def __init__(
        self,
        agents: AgentService,
        replicas: Replicas,
        node_marks: NodeMarks | None = None,
        *,
        stale_after: float = STALE_AFTER,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._agents = agents
        self._replicas = replicas
        self._marks = node_marks
        self._stale_after = stale_after
        self._clock = clock

    def collect(self) -> Iterable[Metric]:
        now = self._clock()
        marks = dict(self._marks() or {}) if self._marks is not None else {}
        f = _Families()
        for node in self._agents.nodes():
            self._node(f, node, marks.get(node.node_id), now)
        yield from f.all()
        yield from self._replica_families()

    # -- nodes ----------------------------------------------------------------

    def _node(self, f: _Families, node: Node, mark: NodeMark | None, now: float) -> None:
        nid = node.node_id
        ready = node.state is NodeState.READY
        # An unreachable node says so, marked or not.
        state = mark if ready and mark is not None else node.state
        f.up.add_metric([nid, state.value], 1.0 if ready and mark is None else 0.0)
        if node.last_seen is None:
            return
        age = max(0.0, now - node.last_seen)
        f.last_seen.add_metric([nid], age)
        if age > self._stale_after:
            return

        inv = node.inventory
        memory = node.memory or (inv.memory if inv else None)
        if memory is not None:
            if memory.total_bytes is not None:
                f.mem_total.add_metric([nid], memory.total_bytes)
            if memory.available_bytes is not None:
                f.mem_avail.add_metric([nid], memory.available_bytes)
            if memory.used_bytes is not None:
                f.mem_used.add_metric([nid], memory.used_bytes)

        load = node.load
        if load is not None and load.cpu_percent is not None:
            f.cpu_util.add_metric([nid], load.cpu_percent)
        cpus = load.cpu_count if load is not None and load.cpu_count is not None else None
        if cpus is None and inv is not None and inv.host is not None:
            cpus = inv.host.cpus
        if cpus is not None:
            f.cpus.add_metric([nid], cpus)
        if load is not None:
            for window, value in (("1m", load.load1), ("5m", load.load5), ("15m", load.load15)):
                if value is not None:
                    f.load.add_metric([nid, window], value)
            for sh in load.shards or ():
                if sh.cpu_cores is not None:
                    f.shard_cpu.add_metric([nid, sh.shard_id], sh.cpu_cores)
                if sh.memory_rss_bytes is not None:
                    f.shard_mem.add_metric([nid, sh.shard_id], sh.memory_rss_bytes)

        # The weights filesystem: the first one that is the node's own. A shared
        # filesystem's space is everyone's and says nothing about this node.
        storage = node.storage or (inv.storage if inv else None) or []
        own = next((s for s in storage if not s.shared), None)
        if own is not None:
            if own.free_bytes is not None:
                f.disk_free.add_metric([nid], own.free_bytes)
            if own.total_bytes is not None:
                f.disk_total.add_metric([nid], own.total_bytes)

        self._gpus(f, nid, (inv.gpus if inv else None) or [], node.gpus)

        imex = node.imex or (inv.imex if inv else None)
        if imex is not None and imex.state is not None:  # None: not installed
            f.imex.add_metric([nid], 1.0 if imex.state.strip().lower() == "active" else 0.0)

        ports: list[IBPort] = list(node.ib_ports or ())
        if node.ib_ports is None and inv is not None:
            ports = [p for hca in inv.adapters or () for p in hca.ports or ()]
        for p in ports:
            if p.state is not None:
                f.ib_active.add_metric(
                    [nid, p.hca, str(p.port), p.state, p.phys_state or ""],
                    1.0 if p.state.strip().upper() == "ACTIVE" else 0.0,
                )
            if p.rate_gbps is not None:
                f.ib_rate.add_metric([nid, p.hca, str(p.port)], p.rate_gbps)
            for name, value in sorted((p.counters or {}).items()):
                # Only errors that happened: a fleet of clean ports adds no series.
                if value and name not in TRAFFIC_COUNTERS:
                    f.ib_errors.add_metric([nid, p.hca, str(p.port), name], float(value))

        for engine, st in sorted(node.provision.items()):
            f.provision.add_metric([nid, engine, st.state.value], 1.0)

    @staticmethod
    def _gpus(f: _Families, nid: str, gpus: list[GPU], usage_list: list[GPUUsage] | None) -> None:
        usage = {u.index: u for u in usage_list or ()}
        by_class: dict[str, int] = {}
        for g in gpus:
            cls = gpu_class_of(g)
            by_class[cls] = by_class.get(cls, 0) + 1
            idx = str(g.index)
            u = usage.get(g.index)
            # Health as placement sees it: problems found at discovery, or
            # uncorrected ECC errors in the latest reading.
            ecc = u.ecc_uncorrected if u is not None and u.ecc_uncorrected is not None else g.ecc_uncorrected
            f.gpu_healthy.add_metric([nid, idx], 0.0 if (g.problems or ecc) else 1.0)
            util = u.utilization_percent if u is not None else g.utilization_percent
            if util is not None:
                f.gpu_util.add_metric([nid, idx], util)
            if g.nvlink_peers is not None:
                f.nvlink_peers.add_metric([nid, idx], len(g.nvlink_peers))
            fabric = (u.fabric if u is not None and u.fabric is not None else None) or g.fabric
            if fabric is not None and fabric.state is not None:
                f.nvlink_joined.add_metric([nid, idx], 1.0 if fabric.state.strip().lower() == "completed" else 0.0)
        for cls, n in sorted(by_class.items()):
            f.gpus.add_metric([nid, cls], n)

    # -- replicas -------------------------------------------------------------

    def _replica_families(self) -> Iterable[Metric]:
        # Every state, so llmgw_replicas{state} lists each one, 0 when none.
        by_state = dict.fromkeys(ReplicaState, 0)
        ready: dict[str, int] = {}
        for r in self._replicas():
            by_state[r.state] += 1
            ready[r.model] = ready.get(r.model, 0) + (1 if r.state is ReplicaState.READY else 0)
        fam = _gauge("llmgw_replicas", "Replicas by state.", ["state"])
        for state, n in by_state.items():
            fam.add_metric([state.value], n)
        yield fam
        fam = _gauge(
            "llmgw_model_replicas_ready",
            "Ready replicas of a model; present only for models with a replica placed.",
            ["model"],
        )
        for model, n in sorted(ready.items()):
            fam.add_metric([model], n)
        yield fam


class _Families:
    """One scrape's node and GPU families, filled node by node."""

    def __init__(self) -> None:
        n = ["node"]
        g = ["node", "gpu"]
        self.up = _gauge(
            "llmgw_node_up", "1 when the node takes work: ready, not cordoned or draining.", ["node", "state"]
        )
        self.last_seen = _gauge(
            "llmgw_node_last_seen_seconds", "Seconds since the node's last message (heartbeats every 5 s).", n
        )
        self.mem_total = _gauge("llmgw_node_memory_bytes", "Main memory.", n)
        self.mem_used = _gauge(
            "llmgw_node_memory_used_bytes", "Memory a new process could not have without evicting something.", n
        )
        self.mem_avail = _gauge(
            "llmgw_node_memory_available_bytes", "Memory available to new processes (MemAvailable).", n
        )
        self.cpu_util = _gauge(
            "llmgw_node_cpu_utilization_percent", "Whole-machine CPU use since the previous heartbeat, 0-100.", n
        )
        self.cpus = _gauge("llmgw_node_cpus", "Logical CPUs.", n)
        self.load = _gauge("llmgw_node_load", "Load average over the window.", ["node", "window"])
        self.shard_cpu = _gauge("llmgw_shard_cpu_cores", "CPU cores an engine's process group uses.", ["node", "shard"])
        self.shard_mem = _gauge(
            "llmgw_shard_memory_bytes", "Resident memory of an engine's process group.", ["node", "shard"]
        )
        self.disk_free = _gauge("llmgw_node_disk_free_bytes", "Free space on the node's own weights filesystem.", n)
        self.disk_total = _gauge("llmgw_node_disk_total_bytes", "Size of the node's own weights filesystem.", n)
        self.gpus = _gauge("llmgw_node_gpus", "GPUs on the node, by class.", ["node", "gpu_class"])
        self.gpu_healthy = _gauge(
            "llmgw_gpu_healthy", "0 when the card is kept out of placement (problems or uncorrected ECC errors).", g
        )
        self.gpu_util = _gauge(
            "llmgw_gpu_utilization_percent", "GPU utilisation; absent when the driver does not report it.", g
        )
        self.nvlink_peers = _gauge("llmgw_gpu_nvlink_peers", "GPUs this card reaches over NVLink.", g)
        self.nvlink_joined = _gauge("llmgw_gpu_nvlink_joined", "0 when the card has not joined its NVLink domain.", g)
        self.imex = _gauge("llmgw_imex_up", "1 when nvidia-imex is active.", n)
        self.ib_active = _gauge(
            "llmgw_ib_port_active",
            "1 when the InfiniBand/RoCE port is ACTIVE.",
            ["node", "hca", "port", "state", "phys_state"],
        )
        self.ib_rate = _gauge("llmgw_ib_port_rate_gbps", "Link rate of the port.", ["node", "hca", "port"])
        self.ib_errors = CounterMetricFamily(
            "llmgw_ib_port_counter",
            "An InfiniBand/RoCE port's error counter as sysfs counts it (since the driver loaded); only non-zero ones.",
            labels=["node", "hca", "port", "counter"],
        )
        self.provision = _gauge(
            "llmgw_node_provision", "1 for each engine's provisioning state on the node.", ["node", "engine", "state"]
        )

    def all(self) -> Iterable[Metric]:
        return list(vars(self).values())


# The fabric registry's metrics: its own (name, labels, value) triples, documented here.
_FABRIC_HELP = {
    "llmgw_fabric_master_sm": "1 for each InfiniBand fabric's master subnet manager, by GUID (it changes on failover).",
    "llmgw_fabric_subnet_managers": "Subnet managers per InfiniBand fabric, by state (0 standby: no failover).",
    "llmgw_fabric_problems": "Fabric problems the control plane sees, by kind and level (docs/fabrics.md).",
}

FabricMetrics = Callable[[], Iterable[tuple[str, dict[str, str], float]]]


class FabricCollector:
    """A prometheus_client collector over the fabric registry, read at scrape time."""

    def __init__(self, metrics: FabricMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[Metric]:
        families: dict[str, GaugeMetricFamily] = {}
        for name, labels, value in self._metrics():
            fam = families.get(name)
            if fam is None:
                fam = families[name] = _gauge(name, _FABRIC_HELP.get(name, name), sorted(labels))
            fam.add_metric([labels[k] for k in sorted(labels)], value)
        # Every family is present even before any fabric is known, so an alert's absence is a real zero.
        for name, doc in _FABRIC_HELP.items():
            if name not in families:
                families[name] = _gauge(name, doc, [])
        return list(families.values())
