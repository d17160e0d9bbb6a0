"""What a node is and how busy it is: the inventory an agent registers with,
and the figures it re-reads for every heartbeat.

Sizes are bytes, rates Gb/s, and every figure the node could not read is
``None`` ("unknown"), never zero. A list that is ``None`` was not looked at
(or could not be read); an empty list was looked at and holds nothing: a node
without GPUs reports ``gpus=[]``, a node told to skip GPU discovery reports
``gpus=None``.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from .base import WireModel

NonNegInt = Annotated[int, Field(ge=0)]

# Distances from a GPU to a network adapter as `nvidia-smi topo -m` names
# them, nearest first. A GPU should reach the fabric through the nearest one.
NIC_PATH_ORDER: tuple[str, ...] = ("PIX", "PXB", "PHB", "NODE", "SYS")

# Link layers as sysfs spells them.
LINK_INFINIBAND = "InfiniBand"
LINK_ETHERNET = "Ethernet"


class Host(WireModel):
    """The operating system and processor: what decides which software builds
    (engine archives, OS packages) can be installed here."""

    hostname: str | None = None
    # From /etc/os-release: ID, VERSION_ID, VERSION_CODENAME, ID_LIKE, PRETTY_NAME.
    os_id: str | None = None
    os_version: str | None = None
    os_codename: str | None = None
    os_like: list[str] | None = None
    os_name: str | None = None
    # debian, rhel, suse, arch or alpine: decides the package manager, which
    # the ID alone does not for every derivative.
    family: str | None = None
    package_manager: str | None = None
    # Debian's spelling (amd64, arm64): release archives and package indexes are keyed by it.
    arch: str | None = None
    kernel: str | None = None
    cpu_model: str | None = None
    cpus: NonNegInt | None = None  # logical CPUs
    cores: NonNegInt | None = None  # physical cores, where /proc/cpuinfo says
    sockets: NonNegInt | None = None
    # The vector extensions inference cares about, of those this CPU has. A VM
    # on QEMU's default CPU model has none and runs several times slower.
    cpu_flags: list[str] | None = None
    # The loaded kernel module's version; None when no NVIDIA driver is loaded.
    nvidia_driver: str | None = None


class MemoryInfo(WireModel):
    """Main memory, re-read every heartbeat (RAM can grow under a running VM)."""

    total_bytes: NonNegInt | None = None
    available_bytes: NonNegInt | None = None

    @property
    def used_bytes(self) -> int | None:
        """What the machine could not hand to a new process without evicting something."""
        if self.total_bytes is None or self.available_bytes is None:
            return None
        return max(self.total_bytes - self.available_bytes, 0)


class ShardLoad(WireModel):
    """One engine's process group: CPU in cores (the way top counts) and resident memory."""

    shard_id: str
    cpu_cores: float | None = None  # None on the first sample: there is nothing to compare with
    memory_rss_bytes: NonNegInt | None = None


class NodeLoad(WireModel):
    """How busy the machine is, sampled over the interval since the previous reading."""

    cpu_percent: float | None = None  # whole machine, 0-100; None on the first reading
    cpu_count: NonNegInt | None = None
    load1: float | None = None
    load5: float | None = None
    load15: float | None = None
    shards: list[ShardLoad] | None = None


class Storage(WireModel):
    """One filesystem holding model directories. Free space belongs to the
    filesystem, not the path: two directories on one disk are one pool."""

    mount_point: str
    fstype: str | None = None
    # Network and cluster filesystems (NFS, Lustre, GPFS, ...): their space is
    # everyone's, so the control plane sums them apart from the node's own.
    shared: bool | None = None
    total_bytes: NonNegInt | None = None
    free_bytes: NonNegInt | None = None  # available to an unprivileged writer
    dirs: list[str] | None = None  # the configured directories on this filesystem


class NVLinkPeer(WireModel):
    index: int
    links: NonNegInt | None = None  # bonded NVLinks to that GPU (NV18 -> 18)


class GPUFabric(WireModel):
    """A GPU's place in a multi-node NVLink domain, from `nvidia-smi -q`."""

    state: str | None = None  # Completed once the fabric manager joined it; In Progress, ...
    status: str | None = None  # Success, or why the join failed
    cluster_uuid: str | None = None
    clique_id: str | None = None
    bandwidth: str | None = None  # Full, or how the domain's NVLink is degraded

    @property
    def domain(self) -> str | None:
        """``cluster_uuid/clique_id`` once joined, else None. A single machine's
        NVSwitch reports an all-zero cluster: its NVLink ends at the chassis."""
        if (self.state or "").strip().lower() != "completed":
            return None
        uuid = (self.cluster_uuid or "").strip().lower()
        if not uuid or not uuid.replace("0", "").replace("-", ""):
            return None
        return f"{uuid}/{(self.clique_id or '').strip()}"


class GPU(WireModel):
    index: int
    uuid: str | None = None
    name: str | None = None
    memory_total_bytes: NonNegInt | None = None
    # In use when read; at agent start, memory held by a process llmgw did not start.
    memory_used_bytes: NonNegInt | None = None
    utilization_percent: NonNegInt | None = None  # None when the driver cannot say: not idle
    ecc_uncorrected: NonNegInt | None = None  # volatile (since the driver loaded)
    compute_capability: str | None = None  # "9.0"
    pci_bus_id: str | None = None  # as nvidia-smi prints it: 00000000:18:00.0
    numa_node: int | None = None
    cpu_affinity: str | None = None  # "0-55,112-167"
    nvlink_peers: list[NVLinkPeer] | None = None
    # How far each network adapter is, by adapter name: PIX, PXB, PHB, NODE or SYS.
    nic_paths: dict[str, str] | None = None
    fabric: GPUFabric | None = None
    # Words for a person on anything that should keep this card out of placement.
    problems: list[str] | None = None


class GPUUsage(WireModel):
    """What changes on a GPU between heartbeats."""

    index: int
    memory_used_bytes: NonNegInt | None = None
    utilization_percent: NonNegInt | None = None
    ecc_uncorrected: NonNegInt | None = None
    fabric: GPUFabric | None = None  # only when re-read (about once a minute)


class IBPort(WireModel):
    """One InfiniBand or RoCE port, read from sysfs (every heartbeat)."""

    hca: str
    port: int
    state: str | None = None  # ACTIVE, INIT, DOWN, ARMED
    phys_state: str | None = None  # LinkUp; Polling or Disabled when no cable/peer
    link_layer: str | None = None  # InfiniBand or Ethernet (RoCE)
    rate_gbps: float | None = None
    rate_detail: str | None = None  # "4X NDR"
    lid: int | None = None
    sm_lid: int | None = None
    node_guid: str | None = None  # 0x + 16 lower-case hex digits
    port_guid: str | None = None
    gid_prefix: str | None = None
    # RoCE only: the GID table index of the RoCE v2 entry holding an IPv4
    # address (what NCCL_IB_GID_INDEX must be), that GID, its address, the
    # interface carrying it and the IP network it sits in.
    gid_index: int | None = None
    gid: str | None = None
    roce_address: str | None = None
    netdev: str | None = None
    network: str | None = None
    # Cumulative, by sysfs name; the data counters in bytes. A counter the
    # driver does not have is absent, not zero.
    counters: dict[str, NonNegInt] | None = None

    @property
    def active(self) -> bool:
        return (self.state or "").upper() == "ACTIVE"

    @property
    def is_roce(self) -> bool:
        return (self.link_layer or "").lower() == LINK_ETHERNET.lower()


class HCA(WireModel):
    """An RDMA adapter (an entry under /sys/class/infiniband)."""

    name: str
    fw_ver: str | None = None
    node_guid: str | None = None
    board_id: str | None = None
    pci_address: str | None = None
    numa_node: int | None = None
    ports: list[IBPort] | None = None


class IMEX(WireModel):
    """nvidia-imex, which multi-node NVLink needs to share memory across nodes."""

    state: str | None = None  # systemd's word (active, inactive, failed); None when not installed
    channels: NonNegInt | None = None


class NodeInventory(WireModel):
    """Everything discovery found, sent whole on every registration so a
    reconnecting agent refreshes what the scheduler knows."""

    host: Host | None = None
    memory: MemoryInfo | None = None
    storage: list[Storage] | None = None
    gpus: list[GPU] | None = None
    gpu_source: str | None = None  # "nvml" or "nvidia-smi"
    adapters: list[HCA] | None = None
    imex: IMEX | None = None
    # What discovery could not read, in words; nothing here stops the agent.
    warnings: list[str] | None = None

    @property
    def ib_ports(self) -> list[IBPort]:
        return [p for a in self.adapters or () for p in a.ports or ()]


class NodeSample(WireModel):
    """The cheap re-read for a heartbeat; its fields have the heartbeat's names."""

    memory: MemoryInfo | None = None
    load: NodeLoad | None = None
    storage: list[Storage] | None = None
    gpus: list[GPUUsage] | None = None
    ib_ports: list[IBPort] | None = None
