"""Judging the facts: ``evaluate(facts)`` → findings, most serious first.

Pure: no I/O, so every check is tested on facts built from captured outputs.
A check whose facts are absent is skipped, not failed: a node without GPUs
gets no GPU findings, one without agent.yaml no control-plane findings.
"""

from __future__ import annotations

from collections.abc import Callable

from llmgw.agent.provision.llamacpp_release import RELEASE_MIN_GLIBC
from llmgw.agent.provision.python_engines import FREE_GB as VLLM_FREE_GB
from llmgw.agent.provision.python_engines import MIN_COMPUTE_CAPABILITY as VLLM_MIN_CC
from llmgw.agent.provision.python_engines import MIN_DRIVER as VLLM_MIN_DRIVER
from llmgw.pki.ca import CERT_BACKDATE
from llmgw.protocol import IBPort
from llmgw.protocol.doctor import Facts, Finding, Level

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
    check_clock(f, out)


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
    check_fabric_manager,
    check_nvlink_domain,
    check_imex,
    check_rdma_modules,
    check_ports,
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
