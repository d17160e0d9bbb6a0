"""What `llmgw doctor` read on a node and what it found: the JSON `--json`
prints and `node add` reads back from a remote node.

Facts are what was read, unjudged; findings are the judgement. Both travel,
so an operator (or a support thread) sees what a finding was based on. Every
fact that could not be read is ``None``; ``unreadable`` says why.
"""

from __future__ import annotations

from enum import StrEnum

from .base import WireModel
from .inventory import NodeInventory


class Level(StrEnum):
    """How serious a finding is; FAIL means something will not work until it is fixed."""

    FAIL = "FAIL"
    WARN = "WARN"
    OK = "OK"

    @property
    def rank(self) -> int:
        """0 for the most serious: findings are listed in this order."""
        return _RANK[self]


_RANK = {Level.FAIL: 0, Level.WARN: 1, Level.OK: 2}


class Finding(WireModel):
    level: Level
    area: str  # cpu, memory, disk, engine, agent, gpu, nvlink, fabric, control
    message: str
    fix: str | None = None  # what to run or change; FAIL and WARN have one where there is one


class InstalledEngine(WireModel):
    """An engine under engines_dir (its install marker read) or named in agent.yaml."""

    engine: str
    version: str | None = None
    variant: str | None = None
    path: str | None = None
    # "installed" (the agent put it there), "configured" (agent.yaml names
    # it), "missing" (agent.yaml names a path that is not there).
    state: str


class Memlock(WireModel):
    """The locked-memory limit engines will run under. RDMA pins memory."""

    # "systemd unit llmgw-agent" or "this process" (no unit to ask).
    source: str
    unlimited: bool | None = None
    limit_bytes: int | None = None  # None with unlimited


class Route(WireModel):
    """The interface and address NCCL and Gloo would bootstrap over."""

    target: str | None = None  # the control plane's address; None: the default route
    interface: str | None = None
    address: str | None = None
    gateway: str | None = None


class Service(WireModel):
    """A systemd unit's state; load_state "not-found" means it is not installed."""

    name: str
    load_state: str | None = None
    active_state: str | None = None

    @property
    def installed(self) -> bool:
        return (self.load_state or "") not in ("", "not-found")

    @property
    def active(self) -> bool:
        return self.active_state == "active"


class ControlPlane(WireModel):
    """Dialling the control plane's agent port as the agent would."""

    address: str  # host:port as agent.yaml names it
    host: str
    port: int
    tls: bool = True
    ca: str | None = None
    reachable: bool | None = None  # the TCP connection was made
    connect_error: str | None = None
    certificate_ok: bool | None = None  # verified against the CA and names the host dialled
    certificate_error: str | None = None
    # Why the certificate failed, for the fix: "name" (does not name the
    # host), "authority" (not from this CA), "expired", "not-yet-valid", "other".
    certificate_problem: str | None = None
    certificate_names: list[str] | None = None  # what the server's certificate names
    client_certificate: bool | None = None  # this node's certificate was presented
    # The mark this node's certificate carries: "node", "admin" (refused on the agent stream), or
    # "unmarked" (issued before llmgw marked node certificates).
    client_certificate_kind: str | None = None
    # Seconds the control plane's clock is ahead of this node's (negative: behind).
    clock_offset_s: float | None = None
    clock_error: str | None = None


class DeclaredFabric(WireModel):
    name: str
    hcas: list[str]


class PciDevice(WireModel):
    """An NVIDIA device on the PCI bus (`lspci -Dnn -d 10de:`, else sysfs):
    seen whether or not a driver answers for it."""

    address: str  # 0000:07:00.0
    class_id: str  # 4 hex digits: 0302 3D controller, 0300 VGA, 0680 other bridge (NVSwitch)
    device_id: str  # 4 lower hex digits; the vendor is always NVIDIA's 10de
    name: str | None = None  # lspci's words, when its pci.ids knows the device


class SmiProbe(WireModel):
    """`nvidia-smi -L`, run to see whether the driver answers."""

    path: str
    answered: bool
    gpus: int | None = None  # "GPU n:" lines listed
    # What it said instead of (or besides) listing the GPUs: the driver not
    # loaded, a version mismatch, a GPU it cannot reach, or a timeout.
    error: str | None = None


class SMRecord(WireModel):
    """One subnet manager, as `sminfo` or `saquery SMIR` reports it."""

    guid: str | None = None  # 0x + 16 lower-case hex digits
    lid: int | None = None
    priority: int | None = None
    state: str | None = None  # sminfo's words: SMINFO_MASTER, SMINFO_STANDBY, SMINFO_DISCOVER, SMINFO_NOTACT


class PortSubnetManagers(WireModel):
    """What one ACTIVE InfiniBand port learns about its subnet's managers."""

    hca: str
    port: int
    master: SMRecord | None = None  # `sminfo -C hca -P port`: the SM this port's SM LID names
    # Every SM on that subnet; None when not read. Asked once per master, on
    # one port, and copied to the others under that master.
    managers: list[SMRecord] | None = None
    source: str | None = None  # "saquery SMIR", "saquery -s + sminfo", "as mlx5_0/1"
    error: str | None = None  # why the master or the managers could not be read


class SubnetManagers(WireModel):
    """The subnet managers behind this node's ACTIVE InfiniBand ports (infiniband-diags)."""

    missing_tools: list[str] | None = None  # sminfo, saquery: not installed
    ports: list[PortSubnetManagers] | None = None


class ImexPeer(WireModel):
    """One address of nodes_config.cfg, dialled on the IMEX port."""

    address: str
    local: bool = False  # one of this node's own addresses: not dialled
    reachable: bool | None = None
    error: str | None = None


class ImexConfig(WireModel):
    """nvidia-imex's configuration as this node has it, and whether its peers answer."""

    config_file: str  # /etc/nvidia-imex/config.cfg
    nodes_file: str  # its IMEX_NODE_CONFIG_FILE
    port: int  # its SERVER_PORT
    peers: list[ImexPeer] | None = None  # None when nodes_file could not be read
    error: str | None = None  # why nodes_file could not be read
    # This node's addresses as `ip` lists them; None when unknown (then no
    # peer is marked local and none is said missing).
    local_addresses: list[str] | None = None


class Facts(WireModel):
    """Everything doctor read on this node."""

    inventory: NodeInventory | None = None
    config_path: str | None = None  # the agent.yaml read; None when there was none
    glibc: str | None = None  # "2.36"; None on musl or when unreadable
    engines_dir: str | None = None
    engines: list[InstalledEngine] | None = None
    llamacpp_version: str | None = None  # the release this llmgw installs
    vllm_version: str | None = None  # the version installability is judged for
    weights_dir: str | None = None
    weights_free_bytes: int | None = None  # free on the filesystem weights go to
    engines_free_bytes: int | None = None  # free where engines are installed (vLLM needs room)
    memlock: Memlock | None = None
    route: Route | None = None
    modules: list[str] | None = None  # loaded kernel modules
    services: list[Service] | None = None  # nvidia-fabricmanager, nvidia-imex, llmgw-agent
    systemd: bool | None = None
    # NVSwitch in this machine, and what showed it (device files, NVLink count).
    nvswitch: bool | None = None
    nvswitch_evidence: str | None = None
    fabrics: list[DeclaredFabric] | None = None  # agent.yaml's
    # The NCCL environment a multi-node shard on each declared fabric is given.
    nccl: dict[str, dict[str, str]] | None = None
    control_plane: ControlPlane | None = None
    nvidia_pci: list[PciDevice] | None = None  # None: neither lspci nor sysfs could be read
    nvidia_pci_source: str | None = None  # "lspci" or "sysfs"
    nvidia_smi: SmiProbe | None = None  # None: no nvidia-smi to run
    subnet_managers: SubnetManagers | None = None  # None: no ACTIVE InfiniBand port
    imex_config: ImexConfig | None = None  # None: no nvidia-imex configuration here
    topo_raw: str | None = None  # `nvidia-smi topo -m`, kept for --verbose and for whoever reads the JSON
    # Steps that failed or ran past the time allowed, in words.
    unreadable: list[str] | None = None

    def service(self, name: str) -> Service | None:
        return next((s for s in self.services or () if s.name == name), None)


class DoctorReport(WireModel):
    """`llmgw doctor --json`."""

    findings: list[Finding]
    facts: Facts
