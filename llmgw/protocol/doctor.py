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
    # Seconds the control plane's clock is ahead of this node's (negative: behind).
    clock_offset_s: float | None = None
    clock_error: str | None = None


class DeclaredFabric(WireModel):
    name: str
    hcas: list[str]


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
    topo_raw: str | None = None  # `nvidia-smi topo -m`, kept for --verbose and for whoever reads the JSON
    # Steps that failed or ran past the time allowed, in words.
    unreadable: list[str] | None = None

    def service(self, name: str) -> Service | None:
        return next((s for s in self.services or () if s.name == name), None)


class DoctorReport(WireModel):
    """`llmgw doctor --json`."""

    findings: list[Finding]
    facts: Facts
