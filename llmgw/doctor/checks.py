"""Judging the facts: ``evaluate(facts)`` → findings, most serious first.

Pure: no I/O, so every check is tested on facts built from captured outputs.
A check whose facts are absent is skipped, not failed: a node without GPUs
gets no GPU findings, one without agent.yaml no control-plane findings.
"""

from __future__ import annotations

from collections.abc import Callable

from llmgw.agent.discovery.subnet import MASTER, STANDBY
from llmgw.agent.provision.llamacpp_release import RELEASE_MIN_GLIBC
from llmgw.agent.provision.python_engines import FREE_GB as VLLM_FREE_GB
from llmgw.agent.provision.python_engines import MIN_COMPUTE_CAPABILITY as VLLM_MIN_CC
from llmgw.agent.provision.python_engines import MIN_DRIVER as VLLM_MIN_DRIVER
from llmgw.pki.ca import CERT_BACKDATE
from llmgw.protocol import IBPort
from llmgw.protocol.doctor import ControlPlane, Facts, Finding, Level, PortSubnetManagers, SMRecord

from .nvidia import is_gpu

GIB = 1 << 30
# Below this a machine holds only the smallest models next to its OS; engines
# are placed by memory, so the node is nearly useless for serving.
MIN_MEMORY_BYTES = 4 * GIB
# Free room where weights go: under FAIL_ not even a small quantised model
# fits; under WARN_ one 7-8B model at 4 bits (about 5 GB) and the next download do not.
DISK_FAIL_BYTES = 1 * GIB
DISK_WARN_BYTES = 20 * GIB
# Date has one-second resolution: past a few seconds the clocks really
# disagree (logs, usage records and token expiry are then out of step).
CLOCK_WARN_S = 5.0
# Certificates are issued backdated by this much: a clock further behind
# than that refuses a freshly issued certificate as not yet valid (and the
# other side refuses this node's), so mutual TLS breaks.
CLOCK_FAIL_S = CERT_BACKDATE.total_seconds()
# NCCL pins its buffers for RDMA; a few MB of locked memory (the usual
# default) fails with ibv_reg_mr errors on the first multi-node collective.
MEMLOCK_MIN_BYTES = 1 << 40
# Counters that say a cable, transceiver or switch port is going bad (the
# data counters are traffic, not trouble).
PORT_ERROR_COUNTERS = frozenset(
    {
        "symbol_error",
        "link_error_recovery",
        "link_downed",
        "port_rcv_errors",
        "port_rcv_remote_physical_errors",
        "local_link_integrity_errors",
        "excessive_buffer_overrun_errors",
    }
)

FABRIC_MANAGER_FIX = "systemctl enable --now nvidia-fabricmanager (its version must match the driver's)"


def evaluate(facts: Facts) -> list[Finding]:
    out: list[Finding] = []
    for check in CHECKS:
        check(facts, out)
    # Stable: within a level, findings keep the order checks were run in.
    return sorted(out, key=lambda f: f.level.rank)


def _add(out: list[Finding], level: Level, area: str, message: str, fix: str | None = None) -> None:
    out.append(Finding(level=level, area=area, message=message, fix=fix))


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / GIB:.1f} GiB"


# ------------------------------------------------------------------ host


def check_cpu(f: Facts, out: list[Finding]) -> None:
    host = f.inventory.host if f.inventory else None
    if host is None or host.cpu_flags is None:
        return
    if host.arch == "amd64" and "avx2" not in host.cpu_flags:
        _add(
            out,
            Level.WARN,
            "cpu",
            "the CPU reports no AVX2: llama.cpp on the CPU runs several times slower",
            'a VM needs CPU type "host" (libvirt: <cpu mode="host-passthrough"/>; Proxmox: CPU type host)',
        )
        return
    flags = " ".join(host.cpu_flags) or "none of interest"
    _add(out, Level.OK, "cpu", f"{host.cpus or '?'} CPUs, vector extensions: {flags}")


def check_memory(f: Facts, out: list[Finding]) -> None:
    mem = f.inventory.memory if f.inventory else None
    if mem is None or mem.total_bytes is None:
        return
    text = f"{_gib(mem.total_bytes)} memory, {_gib(mem.available_bytes)} available"
    if mem.total_bytes < MIN_MEMORY_BYTES:
        _add(out, Level.WARN, "memory", f"{text}: only the smallest models fit", "give the machine more memory")
    else:
        _add(out, Level.OK, "memory", text)


def check_disk(f: Facts, out: list[Finding]) -> None:
    free = f.weights_free_bytes
    if free is None:
        return
    where = f.weights_dir or "the weights directory"
    fix = f"free space on the filesystem holding {where}, or set weights_cache in agent.yaml to a larger one"
    if free < DISK_FAIL_BYTES:
        _add(out, Level.FAIL, "disk", f"{_gib(free)} free where weights go ({where}): no model fits", fix)
    elif free < DISK_WARN_BYTES:
        _add(out, Level.WARN, "disk", f"{_gib(free)} free where weights go ({where}): room for one small model", fix)
    else:
        _add(out, Level.OK, "disk", f"{_gib(free)} free where weights go ({where})")


def check_engines(f: Facts, out: list[Finding]) -> None:
    if f.engines is None:
        return
    for e in f.engines:
        if e.state == "missing":
            _add(
                out,
                Level.FAIL,
                "engine",
                f"agent.yaml names {e.path} as {e.engine}'s binary, and it does not exist",
                f"fix engines.{e.engine} in agent.yaml, or remove it to let the agent install {e.engine}",
            )
    if not any(e.state != "missing" for e in f.engines):
        _add(out, Level.OK, "engine", "no engine installed yet: the agent installs llama.cpp when it joins")


def check_glibc(f: Facts, out: list[Finding]) -> None:
    host = f.inventory.host if f.inventory else None
    configured = any(e.engine == "llamacpp" and e.state == "configured" for e in f.engines or ())
    need = ".".join(map(str, RELEASE_MIN_GLIBC))
    release = f"llama.cpp {f.llamacpp_version}'s release builds" if f.llamacpp_version else "llama.cpp's release builds"
    if f.glibc is None:
        if host is not None and host.os_id == "alpine" and not configured:
            _add(
                out,
                Level.FAIL,
                "engine",
                f"this system has no glibc (musl): {release} need glibc {need} and will not load",
                "set engines.llamacpp.bin in agent.yaml to a llama-server built on this machine",
            )
        return
    have = _version_tuple(f.glibc)
    if have >= RELEASE_MIN_GLIBC:
        _add(out, Level.OK, "engine", f"glibc {f.glibc}: {release} load here (they need {need})")
    elif configured:
        _add(out, Level.OK, "engine", f"glibc {f.glibc} is older than {release} need, and agent.yaml names its own")
    else:
        _add(
            out,
            Level.FAIL,
            "engine",
            f"glibc {f.glibc} is older than the {need} {release} need: the agent cannot install llama.cpp here",
            "use Ubuntu 22.04+, Debian 12+ or RHEL 10, or set engines.llamacpp.bin in agent.yaml to a "
            "llama-server built on this machine",
        )


def _version_tuple(v: str) -> tuple[int, ...]:
    parts = []
    for p in v.split("."):
        digits = "".join(c for c in p if c.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def check_memlock(f: Facts, out: list[Finding]) -> None:
    m = f.memlock
    if m is None or m.unlimited is None:
        return
    has_rdma = bool(f.inventory and f.inventory.adapters)
    if m.unlimited or (m.limit_bytes or 0) >= MEMLOCK_MIN_BYTES:
        _add(out, Level.OK, "agent", f"locked memory is unlimited ({m.source})")
        return
    limit = f"{(m.limit_bytes or 0) // 1024} KiB"
    fix = (
        "set LimitMEMLOCK=infinity in the llmgw-agent unit (`systemctl edit llmgw-agent`)"
        if m.source.startswith("systemd")
        else "run the agent from its systemd unit, which sets LimitMEMLOCK=infinity (or `ulimit -l unlimited`)"
    )
    if has_rdma:
        _add(
            out,
            Level.WARN,
            "agent",
            f"locked memory is limited to {limit} ({m.source}): NCCL over RDMA fails registering its buffers",
            fix,
        )
    else:
        _add(out, Level.OK, "agent", f"locked memory is limited to {limit} ({m.source}); no RDMA adapter needs more")


def check_route(f: Facts, out: list[Finding]) -> None:
    r = f.route
    if r is None:
        return  # `ip` was not there or failed: said under unreadable
    if r.interface is None:
        _add(
            out,
            Level.WARN,
            "agent",
            "could not tell which interface NCCL would bootstrap over: no route found",
            "give the machine a default route, or set mgmt_interface in agent.yaml",
        )
        return
    towards = f" towards the control plane ({r.target})" if r.target else " (the default route)"
    _add(out, Level.OK, "agent", f"NCCL bootstraps over {r.interface} ({r.address or 'no IPv4 address'}){towards}")


# ------------------------------------------------------------------ control plane


def check_control_plane(f: Facts, out: list[Finding]) -> None:
    cp = f.control_plane
    if cp is None:
        return
    if not cp.reachable:
        _add(
            out,
            Level.FAIL,
            "control",
            f"the control plane at {cp.address} does not answer: {cp.connect_error}",
            "check server: in agent.yaml, that llmgw-server runs there with control.enabled, and that a firewall "
            f"lets this machine reach port {cp.port}",
        )
        return
    if cp.tls and not cp.certificate_ok:
        problem = cp.certificate_problem
        names = f" (it names {', '.join(cp.certificate_names)})" if cp.certificate_names else ""
        if problem == "name":
            msg = f"the control plane's certificate does not name {cp.host}, the address dialled{names}"
            fix = f"on the control plane: llmgw server init --host {cp.host} (reissues it with that name added)"
        elif problem == "authority":
            msg = f"the control plane's certificate is not from the authority in {cp.ca}: {cp.certificate_error}"
            fix = f"copy the control plane's ca.pem to {cp.ca} (or rerun `llmgw node add` for this machine)"
        elif problem in ("expired", "not-yet-valid"):
            msg = f"the control plane's certificate is {problem.replace('-', ' ')}: {cp.certificate_error}"
            fix = "check both clocks (timedatectl), then reissue the server certificate if it has expired"
        elif problem == "ca":
            msg = f"this node's CA could not be read: {cp.certificate_error}"
            fix = "rerun `llmgw node add` for this machine from the control plane to install it"
        else:
            msg = f"TLS with the control plane at {cp.address} failed: {cp.certificate_error}"
            fix = "check that server: in agent.yaml names the agent port (7443 by default), which speaks TLS"
        _add(out, Level.FAIL, "control", msg, fix)
        return
    what = "answers, its certificate verifies and names " + cp.host if cp.tls else "answers (plaintext)"
    _add(out, Level.OK, "control", f"the control plane at {cp.address} {what}")
    check_node_certificate_mark(cp, out)
    check_clock(f, out)


def check_node_certificate_mark(cp: ControlPlane, out: list[Finding]) -> None:
    """This node's own certificate must be a node's: the agent stream refuses an administrator's, and an
    unmarked one once the control plane sets agent_tls.require_node_mark."""
    fix = "on the control plane: llmgw node add for this machine again (it issues and installs a node's certificate)"
    if cp.client_certificate_kind == "admin":
        _add(
            out,
            Level.FAIL,
            "control",
            "this node's certificate is an administrator's, which the control plane refuses as a node",
            fix,
        )
    elif cp.client_certificate_kind == "unmarked":
        _add(
            out,
            Level.WARN,
            "control",
            "this node's certificate has no node mark (issued before llmgw marked node certificates); a control "
            "plane with agent_tls.require_node_mark refuses it",
            fix,
        )


def check_clock(f: Facts, out: list[Finding]) -> None:
    cp = f.control_plane
    if cp is None:
        return
    if cp.clock_offset_s is None:
        if cp.clock_error:
            _add(
                out,
                Level.WARN,
                "control",
                f"could not read the control plane's clock: {cp.clock_error}",
                "run doctor as root (to present this node's certificate), or compare `date -u` on both",
            )
        return
    off = cp.clock_offset_s
    side = "ahead of" if off > 0 else "behind"
    text = f"the control plane's clock is {abs(off):.0f} s {side} this node's"
    fix = "synchronise both with NTP (timedatectl set-ntp true; chrony or systemd-timesyncd)"
    if abs(off) > CLOCK_FAIL_S:
        _add(
            out,
            Level.FAIL,
            "control",
            f"{text}: more than the {CLOCK_FAIL_S:.0f} s certificates allow, so a new certificate is refused as "
            "not yet valid",
            fix,
        )
    elif abs(off) > CLOCK_WARN_S:
        _add(out, Level.WARN, "control", f"{text}: logs and usage records will disagree", fix)
    else:
        _add(out, Level.OK, "control", f"clocks agree with the control plane's (within {CLOCK_WARN_S:.0f} s)")


# ------------------------------------------------------------------ GPUs, NVLink


def check_gpus(f: Facts, out: list[Finding]) -> None:
    inv = f.inventory
    if inv is None or not inv.gpus:
        return
    driver = inv.host.nvidia_driver if inv.host else None
    names = sorted({g.name or "?" for g in inv.gpus})
    _add(out, Level.OK, "gpu", f"{len(inv.gpus)} GPU(s) ({', '.join(names)}), driver {driver or '?'}")
    for g in inv.gpus:
        for p in g.problems or ():
            _add(out, Level.FAIL, "gpu", f"GPU {g.index}: {p}", "nvidia-smi -r -i " + str(g.index) + " (or replace it)")


def check_driver(f: Facts, out: list[Finding]) -> None:
    """The NVIDIA driver answering: NVIDIA GPUs on the PCI bus with no
    nvidia-smi, or an nvidia-smi that does not list them."""
    inv = f.inventory
    loaded = inv.host.nvidia_driver if inv and inv.host else None
    on_bus = [d for d in f.nvidia_pci or () if is_gpu(d)]
    smi = f.nvidia_smi
    if smi is None:
        if on_bus and not (inv and inv.gpus):
            names = ", ".join(sorted({d.name or f"10de:{d.device_id}" for d in on_bus}))
            why = (
                f"the kernel module {loaded} is loaded but nvidia-smi is not installed"
                if loaded
                else "no NVIDIA driver is installed (no nvidia-smi)"
            )
            _add(
                out,
                Level.FAIL,
                "gpu",
                f"{len(on_bus)} NVIDIA GPU(s) on the PCI bus ({names}), and {why}: the agent sees no GPU here",
                "install the NVIDIA driver with its utilities (580 or newer, which vLLM needs), then rerun doctor",
            )
        return
    if not smi.answered:
        _add(
            out,
            Level.FAIL,
            "gpu",
            f"the NVIDIA driver does not answer: {smi.error or 'nvidia-smi -L failed'}: "
            + (f"it lists {smi.gpus} GPU(s) and fails on the rest" if smi.gpus else "the agent sees no GPU here"),
            _driver_fix(smi.error or "", f.modules, loaded),
        )
    elif on_bus and smi.gpus is not None and smi.gpus < len(on_bus):
        said = f" ({smi.error})" if smi.error else ""
        _add(
            out,
            Level.WARN,
            "gpu",
            f"{len(on_bus)} NVIDIA GPUs are on the PCI bus but the driver lists {smi.gpus}{said}: "
            "the others are not used",
            "`dmesg | grep -i -e xid -e nvrm` says why (a GPU given to a VM through vfio-pci is meant to be missing); "
            "a GPU that fell off the bus needs a reboot",
        )


def _driver_fix(error: str, modules: list[str] | None, loaded: str | None) -> str:
    e = error.lower()
    if "version mismatch" in e:
        return (
            f"reboot: the driver's libraries were upgraded and the kernel still runs the old module ({loaded or '?'})"
            ", or reinstall one driver version throughout"
        )
    if "couldn't communicate" in e or "could not communicate" in e:
        if modules is not None and "nouveau" in modules:
            return (
                "nouveau holds the GPUs: blacklist it (echo 'blacklist nouveau' > /etc/modprobe.d/blacklist-nouveau.conf"
                ", then rebuild the initramfs) and reboot"
            )
        return (
            "load the driver: `modprobe nvidia`; when that fails `dmesg | grep -i nvrm` says why (Secure Boot "
            "refusing an unsigned module, a kernel updated without its DKMS build)"
        )
    if "device handle" in e or "gpu is lost" in e:
        return "a GPU fell off the bus: reboot; if it happens again check its power and seating (`dmesg | grep -i xid`)"
    if "no devices were found" in e:
        return "the driver supports none of these GPUs, or vfio-pci holds them: `dmesg | grep -i nvrm`"
    if "did not answer within" in e or "did not finish" in e:
        return "the driver is wedged (`dmesg | grep -i -e xid -e nvrm`): reboot the machine"
    return "`dmesg | grep -i nvrm` says why"


def check_fabric_manager(f: Facts, out: list[Finding]) -> None:
    if not f.nvswitch:
        return
    fm = f.service("nvidia-fabricmanager")
    if fm is None:
        if f.systemd is False:
            _add(
                out,
                Level.WARN,
                "nvlink",
                f"this machine has NVSwitch ({f.nvswitch_evidence}); without systemd doctor cannot tell "
                "whether nvidia-fabricmanager runs",
                "make sure nvidia-fabricmanager runs (its version must match the driver's)",
            )
        return
    if not fm.active:
        state = "not installed" if not fm.installed else (fm.active_state or "inactive")
        _add(
            out,
            Level.FAIL,
            "nvlink",
            f"this machine has NVSwitch but nvidia-fabricmanager is {state}: CUDA will not initialise on its GPUs",
            FABRIC_MANAGER_FIX,
        )
    else:
        _add(out, Level.OK, "nvlink", "NVSwitch present and nvidia-fabricmanager is active")


def check_nvlink_domain(f: Facts, out: list[Finding]) -> None:
    gpus = f.inventory.gpus if f.inventory else None
    if not gpus:
        return
    with_fabric = [g for g in gpus if g.fabric is not None]
    if not with_fabric:
        return
    domains = {g.fabric.domain for g in with_fabric if g.fabric and g.fabric.domain}
    not_joined = [g for g in with_fabric if g.fabric and (g.fabric.state or "").lower() != "completed"]
    failed = [g for g in with_fabric if g.fabric and g.fabric.status and g.fabric.status.lower() != "success"]
    if not_joined:
        states = ", ".join(f"GPU {g.index} {g.fabric.state or '?'}" for g in not_joined if g.fabric)
        _add(
            out,
            Level.FAIL,
            "nvlink",
            f"GPUs not joined to their NVLink domain ({states}): multi-node NVLink replicas cannot use them",
            "check the NVLink switch trays' fabric manager and nvidia-imex here; `nvidia-smi -q -d FABRIC` shows why",
        )
    for g in failed:
        if g in not_joined or g.fabric is None:
            continue
        _add(
            out,
            Level.FAIL,
            "nvlink",
            f"GPU {g.index}'s NVLink fabric join ended with {g.fabric.status}",
            "`nvidia-smi -q -d FABRIC`; restart nvidia-imex, then check the switch trays",
        )
    degraded = [g for g in with_fabric if g.fabric and g.fabric.bandwidth and g.fabric.bandwidth.lower() != "full"]
    if degraded:
        detail = ", ".join(f"GPU {g.index} {g.fabric.bandwidth}" for g in degraded if g.fabric)
        _add(
            out,
            Level.WARN,
            "nvlink",
            f"NVLink bandwidth is degraded ({detail})",
            "check the NVLink cables and switch trays; `nvidia-smi nvlink -s`",
        )
    if domains and not not_joined:
        _add(out, Level.OK, "nvlink", f"GPUs joined NVLink domain {', '.join(sorted(domains))}")


def check_imex(f: Facts, out: list[Finding]) -> None:
    gpus = f.inventory.gpus if f.inventory else None
    if not gpus or not any(g.fabric and g.fabric.domain for g in gpus):
        return  # IMEX only matters inside a multi-node NVLink domain
    imex = f.inventory.imex if f.inventory else None
    svc = f.service("nvidia-imex")
    state = imex.state if imex and imex.state else (svc.active_state if svc else None)
    if state != "active":
        _add(
            out,
            Level.FAIL,
            "nvlink",
            f"nvidia-imex is {state or 'not installed'}: GPUs cannot share memory across the NVLink domain",
            "systemctl enable --now nvidia-imex (with every node of the domain in /etc/nvidia-imex/nodes_config.cfg)",
        )
    elif not (imex and imex.channels):
        _add(
            out,
            Level.FAIL,
            "nvlink",
            "nvidia-imex runs but there is no IMEX channel (/dev/nvidia-caps-imex-channels is empty)",
            "echo 'options nvidia NVreg_CreateImexChannel0=1' > /etc/modprobe.d/nvidia-imex.conf and reload the driver",
        )
    else:
        _add(out, Level.OK, "nvlink", f"nvidia-imex is active with {imex.channels} channel(s)")
    check_imex_peers(f, out)


def check_imex_peers(f: Facts, out: list[Finding]) -> None:
    """The nodes of nodes_config.cfg: this node among them, the others answering on the IMEX port."""
    c = f.imex_config
    if c is None:
        return  # no config.cfg: nvidia-imex is not installed, which check_imex says
    if c.peers is None:
        _add(
            out,
            Level.FAIL,
            "nvlink",
            f"nvidia-imex's node list {c.nodes_file} could not be read ({c.error}): IMEX cannot start without it",
            f"list every node of the NVLink domain in {c.nodes_file}, one IP address per line, on every node",
        )
        return
    if c.local_addresses is not None and not any(p.local for p in c.peers):
        _add(
            out,
            Level.FAIL,
            "nvlink",
            f"none of this node's addresses is in {c.nodes_file} ({', '.join(p.address for p in c.peers) or 'empty'})"
            ": nvidia-imex does not find itself in its domain and will not start",
            f"add this node's address on the IMEX network to {c.nodes_file} on every node of the domain, "
            "then `systemctl restart nvidia-imex` on each",
        )
    silent = [p for p in c.peers if p.reachable is False]
    if silent:
        _add(
            out,
            Level.WARN,
            "nvlink",
            f"IMEX peer(s) do not answer on port {c.port}: "
            + ", ".join(f"{p.address} ({p.error})" for p in silent)
            + ": GPU memory cannot be shared with them",
            f"start nvidia-imex on them, and let TCP port {c.port} through between the domain's nodes",
        )
    answered = [p for p in c.peers if p.reachable]
    if answered and not silent:
        _add(
            out, Level.OK, "nvlink", f"the {len(answered)} other IMEX peer(s) in {c.nodes_file} answer on port {c.port}"
        )


def check_vllm(f: Facts, out: list[Finding]) -> None:
    inv = f.inventory
    if inv is None or not inv.gpus:
        return
    name = f"vLLM {f.vllm_version}" if f.vllm_version else "vLLM"
    why: list[str] = []
    driver = inv.host.nvidia_driver if inv.host else None
    major = int(driver.split(".")[0]) if driver and driver.split(".")[0].isdigit() else None
    if major is not None and major < VLLM_MIN_DRIVER:
        why.append(f"it needs NVIDIA driver {VLLM_MIN_DRIVER} or newer (CUDA 13) and this node has {driver}")
    ccs = [float(g.compute_capability) for g in inv.gpus if g.compute_capability]
    if ccs and min(ccs) < VLLM_MIN_CC:
        why.append(f"it needs compute capability {VLLM_MIN_CC} (Turing) or newer and a GPU here is {min(ccs):.1f}")
    free = f.engines_free_bytes
    if free is not None and free < VLLM_FREE_GB * 1e9:
        why.append(f"it needs {VLLM_FREE_GB} GB free in {f.engines_dir} and there are {free / 1e9:.0f} GB")
    if why:
        _add(
            out,
            Level.WARN,
            "engine",
            f"{name} cannot be installed: " + "; ".join(why) + " (llama.cpp still serves here)",
            "upgrade the driver to 580 or newer" if major is not None and major < VLLM_MIN_DRIVER else None,
        )
    else:
        _add(out, Level.OK, "engine", f"{name} can be installed")


# ------------------------------------------------------------------ RDMA fabric


def check_rdma_modules(f: Facts, out: list[Finding]) -> None:
    inv = f.inventory
    if inv is None or not inv.adapters or f.modules is None:
        return
    mods = set(f.modules)
    if "ib_uverbs" not in mods:
        _add(
            out,
            Level.WARN,
            "fabric",
            "ib_uverbs is not loaded: NCCL cannot open the RDMA adapters and falls back to TCP sockets",
            "modprobe ib_uverbs",
        )
    if inv.gpus and not ({"nvidia_peermem", "nv_peer_mem"} & mods):
        _add(
            out,
            Level.WARN,
            "fabric",
            "nvidia_peermem is not loaded: NCCL cannot use GPUDirect RDMA and copies through host memory",
            "modprobe nvidia_peermem",
        )


def _port_name(p: IBPort) -> str:
    return f"{p.hca}/{p.port}"


def check_ports(f: Facts, out: list[Finding]) -> None:
    inv = f.inventory
    if inv is None or not inv.adapters:
        return
    ports = inv.ib_ports
    fastest: dict[str, float] = {}
    for p in ports:
        if p.active and p.rate_gbps:
            layer = p.link_layer or "?"
            fastest[layer] = max(fastest.get(layer, 0.0), p.rate_gbps)
    for p in ports:
        name = _port_name(p)
        rate = f"{p.rate_gbps:g} Gb/s" if p.rate_gbps is not None else "? Gb/s"
        if (p.state or "").upper() == "INIT" and (p.phys_state or "").lower() == "linkup":
            # The cable works (the link trained) but no SM has configured the port.
            _add(
                out,
                Level.WARN,
                "fabric",
                f"{name} is INIT with its link up: no subnet manager has configured it",
                "start a subnet manager on the fabric (opensm, or the switch's own), or check that it sees this port",
            )
            continue
        if not p.active:
            _add(
                out,
                Level.WARN,
                "fabric",
                f"{name} is {p.state or '?'} ({p.phys_state or '?'})",
                "check the cable and the switch port (`ibstat`); a port on no fabric can be left out of agent.yaml",
            )
            continue
        errors = {k: v for k, v in (p.counters or {}).items() if v and k in PORT_ERROR_COUNTERS}
        if errors:
            _add(
                out,
                Level.WARN,
                "fabric",
                f"{name} counts errors: " + ", ".join(f"{k}={v}" for k, v in sorted(errors.items())),
                "a cable or transceiver going bad: reseat or replace it, then `perfquery -x -R` to clear",
            )
        best = fastest.get(p.link_layer or "?", 0.0)
        if p.rate_gbps is not None and p.rate_gbps < best:
            _add(
                out,
                Level.WARN,
                "fabric",
                f"{name} runs at {rate}, slower than this machine's other ports ({best:g} Gb/s): a degraded link",
                "check the cable and the switch port's speed",
            )
        if not p.is_roce and not p.sm_lid:
            _add(
                out,
                Level.FAIL,
                "fabric",
                f"{name} is ACTIVE but no subnet manager answers for it (SM lid {p.sm_lid})",
                "start a subnet manager on the fabric (opensm, or the switch's own)",
            )
        elif p.is_roce and p.gid_index is None:
            _add(
                out,
                Level.WARN,
                "fabric",
                f"{name} (RoCE on {p.netdev or '?'}) has no RoCE v2 GID with an IPv4 address: NCCL would use a "
                "link-local v1 GID, which does not route",
                f"give {p.netdev or 'its interface'} an IPv4 address, or set NCCL_IB_GID_INDEX in the profile's env",
            )
        else:
            detail = f" ({p.rate_detail})" if p.rate_detail else ""
            _add(out, Level.OK, "fabric", f"{name} ACTIVE {rate}{detail} {p.link_layer or ''}".rstrip())


def _sm(r: SMRecord) -> str:
    return f"{r.guid or '?'} (lid {r.lid if r.lid is not None else '?'}, priority {r.priority if r.priority is not None else '?'})"


def _ports(rows: list[PortSubnetManagers]) -> str:
    return ", ".join(f"{r.hca}/{r.port}" for r in rows)


def _diags_fix(f: Facts) -> str:
    pm = f.inventory.host.package_manager if f.inventory and f.inventory.host else None
    return f"{pm} install infiniband-diags" if pm else "install infiniband-diags (apt-get, dnf or zypper)"


def check_subnet_managers(f: Facts, out: list[Finding]) -> None:
    """Each ACTIVE InfiniBand port's master SM, and a standby on its subnet."""
    sm = f.subnet_managers
    if sm is None or not sm.ports:
        return
    if sm.missing_tools:
        _add(
            out,
            Level.WARN,
            "fabric",
            f"infiniband-diags is not installed (no {', '.join(sm.missing_tools)}): doctor cannot see which subnet "
            f"managers serve {_ports(sm.ports)} nor whether one stands by",
            _diags_fix(f),
        )
    for row in sm.ports:
        if row.error:
            e = row.error.lower()
            fix = (
                "modprobe ib_umad (the diagnostics talk to the adapter through it)"
                if "ib_umad" in e
                else "run doctor as root: the diagnostics open /dev/infiniband/umad*, which only root may"
                if "umad" in e or "permission" in e
                else f"`sminfo -C {row.hca} -P {row.port}` and `saquery -C {row.hca} -P {row.port} SMIR` by hand"
            )
            what = "its subnet manager" if row.master is None else "the subnet managers of its subnet"
            _add(out, Level.WARN, "fabric", f"could not ask {row.hca}/{row.port} for {what}: {row.error}", fix)
    by_master: dict[str, list[PortSubnetManagers]] = {}
    for row in sm.ports:
        if row.master and row.master.guid:
            by_master.setdefault(row.master.guid, []).append(row)
    for rows in by_master.values():
        master = rows[0].master
        assert master is not None
        if master.state != MASTER:
            _add(
                out,
                Level.WARN,
                "fabric",
                f"the subnet manager {_ports(rows)} point(s) to, {_sm(master)}, reports {master.state}, not master: "
                "the subnet is sweeping or its master just failed",
                "rerun doctor in a minute; if it stays, check the subnet managers (`sminfo`, the SM's log)",
            )
            continue
        managers = next((r.managers for r in rows if r.managers is not None), None)
        if managers is None:
            continue  # could not be read: said above
        standbys = [m for m in managers if m.state == STANDBY and m.guid != master.guid]
        if not standbys:
            _add(
                out,
                Level.WARN,
                "fabric",
                f"no standby subnet manager on the subnet of {_ports(rows)} (master {_sm(master)}): "
                "a master's failure stops the fabric's routing changes",
                "run a second subnet manager at a lower priority on another switch or host (e.g. `opensm -p 14`, "
                "or the switch's SM high-availability setting), so it stands by to take over",
            )
        else:
            _add(
                out,
                Level.OK,
                "fabric",
                f"subnet of {_ports(rows)}: master {_sm(master)}, standby " + ", ".join(_sm(m) for m in standbys),
            )


def check_declared_fabrics(f: Facts, out: list[Finding]) -> None:
    inv = f.inventory
    if inv is None or inv.adapters is None or f.fabrics is None:
        return
    ports_by_hca: dict[str, list[IBPort]] = {}
    for p in inv.ib_ports:
        ports_by_hca.setdefault(p.hca, []).append(p)
    declared = set()
    for fab in f.fabrics:
        for hca in fab.hcas:
            declared.add(hca)
            if hca not in {a.name for a in inv.adapters}:
                _add(
                    out,
                    Level.FAIL,
                    "fabric",
                    f"agent.yaml puts {hca} on fabric {fab.name}, but this machine has no adapter {hca}",
                    f"fix fabrics: in agent.yaml (adapters here: {', '.join(a.name for a in inv.adapters) or 'none'})",
                )
            elif not any(p.active for p in ports_by_hca.get(hca, ())):
                _add(
                    out,
                    Level.FAIL,
                    "fabric",
                    f"{hca} is on fabric {fab.name} in agent.yaml but none of its ports is ACTIVE",
                    "check its cable and the switch port, or take it out of fabrics: in agent.yaml",
                )
    spare = sorted({p.hca for p in inv.ib_ports if p.active} - declared)
    if spare:
        _add(
            out,
            Level.WARN,
            "fabric",
            f"active adapter(s) {', '.join(spare)} are on no fabric in agent.yaml: multi-node replicas will not use "
            "them",
            "name their fabric: `llmgw node add --fabric NAME:" + ",".join(spare) + "` or fabrics: in agent.yaml",
        )


def check_unreadable(f: Facts, out: list[Finding]) -> None:
    for what in f.unreadable or ():
        _add(out, Level.WARN, "doctor", f"could not read {what}", None)
    for what in (f.inventory.warnings if f.inventory else None) or ():
        _add(out, Level.WARN, "doctor", what, None)


CHECKS: tuple[Callable[[Facts, list[Finding]], None], ...] = (
    check_gpus,
    check_driver,
    check_fabric_manager,
    check_nvlink_domain,
    check_imex,
    check_rdma_modules,
    check_ports,
    check_subnet_managers,
    check_declared_fabrics,
    check_control_plane,
    check_cpu,
    check_memory,
    check_disk,
    check_engines,
    check_glibc,
    check_vllm,
    check_memlock,
    check_route,
    check_unreadable,
)
