"""Reading what doctor judges: discovery's inventory plus what the checks
need that discovery does not read (engines, glibc, memlock, the bootstrap
route, kernel modules, services, the control plane, NVIDIA's devices on the
PCI bus and whether the driver answers, nvidia-imex's peers, the InfiniBand
subnet managers: nvidia.py and subnet.py).

Every source is injectable (root directories, a command runner, a dialler)
so tests run on captured outputs. Nothing here judges: a missing tool or an
unreadable file leaves its fact ``None`` and says why in ``unreadable``.
Steps run side by side under one overall cap; a step still running when the
cap passes is recorded as unreadable and left behind (its thread is a
daemon), so a wedged driver cannot hang doctor.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from cryptography import x509

from llmgw.agent.discovery.collect import DiscoveryOptions, collect_inventory
from llmgw.agent.discovery.commands import SBIN_DIRS, Runner, Which, find_tool, run_command
from llmgw.agent.discovery.commands import which as default_which
from llmgw.agent.discovery.infiniband import DEFAULT_IB_ROOT, ports_of, read_adapters
from llmgw.agent.discovery.subnet import collect_subnet_managers
from llmgw.agent.discovery.topology import TOPO_TIMEOUT_S
from llmgw.agent.engines.common import nccl_env
from llmgw.agent.engines.spec import Adapter, NodeFacts, Profile, ShardLaunch
from llmgw.agent.provision.manager import DEFAULT_ROOT as DEFAULT_ENGINES_DIR
from llmgw.agent.provision.manager import INSTALLABLE
from llmgw.agent.provision.verify import installed_at
from llmgw.config.agent import DEFAULT_WEIGHTS_CACHE, AgentConfig
from llmgw.config.server import DEFAULT_LLAMACPP
from llmgw.errors import LlmgwError
from llmgw.pki.ca import PKIError, client_kind, load_cert, san_names
from llmgw.pki.tls import client_context
from llmgw.protocol import NodeInventory
from llmgw.protocol.doctor import (
    ControlPlane,
    DeclaredFabric,
    Facts,
    InstalledEngine,
    Memlock,
    PciDevice,
    Route,
    Service,
)

from .nvidia import IMEX_CONFIG_FILE, Connect, is_nvswitch, nvidia_pci, probe_smi, read_imex_config, tcp_connect

# The spec's cap on reading everything: long enough for a slow nvidia-smi on
# eight cards, short enough that `node add` on twenty machines is not stuck on one.
COLLECT_TIMEOUT_S = 60.0
# vLLM's version this llmgw installs when a profile does not say.
DEFAULT_VLLM = "0.30.0"
AGENT_UNIT = "llmgw-agent"
FABRIC_MANAGER_UNIT = "nvidia-fabricmanager"
IMEX_UNIT = "nvidia-imex"
# A short dial: a control plane that takes longer than this to accept is as
# good as down for an agent's heartbeat.
DIAL_TIMEOUT_S = 5.0
SYSTEMCTL_TIMEOUT_S = 5.0


class DoctorError(LlmgwError):
    """doctor could not start: what it was given is wrong."""


Dialler = Callable[["ControlPlaneTarget"], ControlPlane]
Resolver = Callable[[str], str | None]


@dataclass(frozen=True)
class ControlPlaneTarget:
    """Where and how to dial the control plane: agent.yaml's first address and TLS files."""

    address: str
    host: str
    port: int
    ca: str | None = None
    cert: str | None = None
    key: str | None = None


@dataclass(frozen=True)
class DoctorOptions:
    config: AgentConfig | None = None
    config_path: str | None = None
    vllm_version: str = DEFAULT_VLLM
    llamacpp_version: str = DEFAULT_LLAMACPP
    nvidia_smi: str | None = None  # overrides agent.yaml's discovery.nvidia_smi
    ib_root: Path | None = None  # overrides agent.yaml's discovery.ib_root
    proc_root: Path = Path("/proc")
    sys_root: Path = Path("/sys")
    dev_root: Path = Path("/dev")
    os_release: Path = Path("/etc/os-release")
    mounts_file: Path = Path("/proc/mounts")
    systemd_root: Path = Path("/run/systemd/system")  # exists when systemd is PID 1
    run: Runner = field(default=run_command, repr=False)
    which: Which = field(default=default_which, repr=False)
    nvml: Any = field(default=None, repr=False)  # None: nvidia-smi only; "auto": pynvml where installed
    glibc: Callable[[], str | None] | None = field(default=None, repr=False)
    memlock_rlimit: Callable[[], tuple[int, int]] = field(
        default=lambda: resource.getrlimit(resource.RLIMIT_MEMLOCK), repr=False
    )
    free_bytes: Callable[[str], int | None] | None = field(default=None, repr=False)
    resolve: Resolver | None = field(default=None, repr=False)
    dial: Dialler | None = field(default=None, repr=False)
    # Where tools root installs live (lspci, sminfo and saquery may be there).
    sbin_dirs: tuple[Path, ...] = SBIN_DIRS
    imex_config: Path = IMEX_CONFIG_FILE
    connect: Connect = field(default=tcp_connect, repr=False)  # dials the IMEX peers
    timeout_s: float = COLLECT_TIMEOUT_S


# --------------------------------------------------------------- collecting


def collect_facts(opts: DoctorOptions) -> Facts:
    """Read everything, each step in its own thread, all under opts.timeout_s."""
    cfg = opts.config
    facts = Facts(
        config_path=opts.config_path,
        vllm_version=opts.vllm_version,
        llamacpp_version=opts.llamacpp_version,
        engines_dir=cfg.engines_dir if cfg else os.fspath(DEFAULT_ENGINES_DIR),
        weights_dir=cfg.weights_cache if cfg else DEFAULT_WEIGHTS_CACHE,
        fabrics=[DeclaredFabric(name=f.name, hcas=list(f.hcas)) for f in cfg.fabrics] if cfg else None,
    )
    unreadable: list[str] = []
    steps: dict[str, Callable[[], Any]] = {
        "the inventory": lambda: collect_inventory(_discovery_options(opts)),
        "glibc": lambda: _glibc(opts),
        "engines": lambda: _engines(opts, facts.engines_dir or ""),
        "free disk": lambda: (_free(opts, facts.weights_dir), _free(opts, facts.engines_dir)),
        "the systemd units": lambda: _services(opts),
        "kernel modules": lambda: read_modules(opts.proc_root),
        "NVSwitch devices": lambda: nvswitch_devices(opts.dev_root, opts.proc_root),
        "the subnet managers": lambda: collect_subnet_managers(
            ports_of(read_adapters(_discovery_options(opts).ib_root)), opts.run, lambda name: tool(opts, name)
        ),
        "the IMEX configuration": lambda: read_imex_config(opts.imex_config, opts.run, opts.connect),
    }
    if not (cfg and cfg.discovery.skip_gpus):
        steps["the PCI bus"] = lambda: nvidia_pci(opts.run, tool(opts, "lspci"), opts.sys_root)
        smi = smi_path(opts)
        if smi:
            steps["the NVIDIA driver"] = lambda: probe_smi(smi, opts.run)
    target = control_plane_target(cfg) if cfg else None
    steps["the bootstrap route"] = lambda: bootstrap_route(opts, target.host if target else None)
    if target is not None:
        steps["the control plane"] = lambda: (opts.dial or dial_control_plane)(target)
    results = _run_steps(steps, opts.timeout_s, unreadable)

    inv: NodeInventory | None = results.get("the inventory")
    facts.inventory = inv
    facts.glibc = results.get("glibc")
    facts.engines = results.get("engines")
    free = results.get("free disk")
    if free is not None:
        facts.weights_free_bytes, facts.engines_free_bytes = free
    services = results.get("the systemd units")
    if services is not None:
        facts.systemd, facts.services, facts.memlock = services
    else:
        facts.memlock = _process_memlock(opts)
    facts.modules = results.get("kernel modules")
    facts.route = results.get("the bootstrap route")
    facts.control_plane = results.get("the control plane")
    facts.subnet_managers = results.get("the subnet managers")
    facts.imex_config = results.get("the IMEX configuration")
    facts.nvidia_pci, facts.nvidia_pci_source = results.get("the PCI bus") or (None, None)
    facts.nvidia_smi = results.get("the NVIDIA driver")
    devices = results.get("NVSwitch devices")
    facts.nvswitch, facts.nvswitch_evidence = nvswitch_from(devices, inv, facts.nvidia_pci)
    if inv is not None and inv.gpus:
        facts.topo_raw = _topo_raw(opts, unreadable)
    facts.nccl = nccl_per_fabric(facts)
    facts.unreadable = unreadable or None
    return facts


def _run_steps(steps: dict[str, Callable[[], Any]], timeout_s: float, unreadable: list[str]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    errors: dict[str, str] = {}

    def runner(name: str, fn: Callable[[], Any]) -> None:
        try:
            results[name] = fn()
        except Exception as exc:  # one source failing costs that source only
            errors[name] = f"{type(exc).__name__}: {exc}"

    threads = {name: threading.Thread(target=runner, args=(name, fn), daemon=True) for name, fn in steps.items()}
    for t in threads.values():
        t.start()
    deadline = time.monotonic() + timeout_s
    for name, t in threads.items():
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            unreadable.append(f"{name}: still not read after {timeout_s:g} s; left out")
        elif name in errors:
            unreadable.append(f"{name}: {errors[name]}")
    return {k: v for k, v in results.items() if not threads[k].is_alive()}


def _discovery_options(opts: DoctorOptions) -> DiscoveryOptions:
    cfg = opts.config
    d = cfg.discovery if cfg else None
    ib_root = opts.ib_root or (Path(d.ib_root) if d else DEFAULT_IB_ROOT)
    return DiscoveryOptions(
        nvidia_smi=opts.nvidia_smi or (d.nvidia_smi if d else None),
        ib_root=ib_root,
        prefer_nvml=opts.nvml is not None,
        skip_gpus=d.skip_gpus if d else False,
        proc_root=opts.proc_root,
        sys_root=opts.sys_root,
        dev_root=opts.dev_root,
        os_release=opts.os_release,
        mounts_file=opts.mounts_file,
        run=opts.run,
        which=opts.which,
        **({} if opts.nvml == "auto" else {"nvml": opts.nvml}),
    )


def smi_path(opts: DoctorOptions) -> str | None:
    return opts.nvidia_smi or (opts.config.discovery.nvidia_smi if opts.config else None) or opts.which("nvidia-smi")


def tool(opts: DoctorOptions, name: str) -> str | None:
    """A tool on PATH, else in the sbin directories."""
    return find_tool(name, opts.which, opts.sbin_dirs)


def _topo_raw(opts: DoctorOptions, unreadable: list[str]) -> str | None:
    smi = smi_path(opts)
    if not smi:
        return None
    res = opts.run([smi, "topo", "-m"], TOPO_TIMEOUT_S)
    if not res.ok:
        unreadable.append(f"nvidia-smi topo -m: {res.describe_failure()}")
        return None
    return res.stdout


# --------------------------------------------------------------- glibc


def _glibc(opts: DoctorOptions) -> str | None:
    if opts.glibc is not None:
        return opts.glibc()
    try:
        word = os.confstr("CS_GNU_LIBC_VERSION")  # "glibc 2.36"
    except (ValueError, OSError):
        word = None
    if word and word.startswith("glibc "):
        return word.split()[1]
    res = opts.run(["ldd", "--version"], 5.0)
    return parse_ldd_version(res.stdout + res.stderr) if res.returncode is not None else None


def parse_ldd_version(text: str) -> str | None:
    """The glibc version from `ldd --version`'s first line ("ldd (Debian GLIBC 2.36-9) 2.36"); None for musl."""
    first = text.strip().splitlines()[0] if text.strip() else ""
    if "musl" in text.lower() or not first:
        return None
    last = first.split()[-1]
    return last if last[:1].isdigit() else None


# --------------------------------------------------------------- engines


def _engines(opts: DoctorOptions, engines_dir: str) -> list[InstalledEngine]:
    out: list[InstalledEngine] = []
    root = Path(engines_dir)
    for engine in INSTALLABLE:
        try:
            dirs = sorted(p for p in (root / engine).iterdir() if p.is_dir())
        except OSError:
            dirs = []
        for d in dirs:
            inst = installed_at(d)
            if inst is not None:
                m = inst.marker
                out.append(
                    InstalledEngine(
                        engine=engine, version=m.version, variant=m.variant, path=str(inst.binary), state="installed"
                    )
                )
    if opts.config is not None:
        for engine, path in opts.config.engines.configured().items():
            exists = Path(path).exists() or opts.which(path) is not None
            out.append(InstalledEngine(engine=engine, path=path, state="configured" if exists else "missing"))
    return out


def _free(opts: DoctorOptions, path: str | None) -> int | None:
    if not path:
        return None
    if opts.free_bytes is not None:
        return opts.free_bytes(path)
    # The directory may not exist yet: its filesystem is the nearest parent's.
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


# --------------------------------------------------------------- systemd, memlock


def parse_systemctl_show(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        k, sep, v = line.partition("=")
        if sep:
            out[k.strip()] = v.strip()
    return out


def parse_memlock(value: str) -> Memlock:
    """systemd's LimitMEMLOCK ("infinity" or bytes) as a Memlock."""
    if value == "infinity":
        return Memlock(source=f"systemd unit {AGENT_UNIT}", unlimited=True)
    try:
        return Memlock(source=f"systemd unit {AGENT_UNIT}", unlimited=False, limit_bytes=int(value))
    except ValueError:
        return Memlock(source=f"systemd unit {AGENT_UNIT}")


def _services(opts: DoctorOptions) -> tuple[bool, list[Service] | None, Memlock]:
    """(systemd is running, the units' states, the agent's memlock)."""
    if not (opts.systemd_root.is_dir() and opts.which("systemctl")):
        return False, None, _process_memlock(opts)
    services = []
    memlock: Memlock | None = None
    for unit in (AGENT_UNIT, FABRIC_MANAGER_UNIT, IMEX_UNIT):
        props = ["LoadState", "ActiveState"] + (["LimitMEMLOCK"] if unit == AGENT_UNIT else [])
        res = opts.run(["systemctl", "show", unit, *(f"--property={p}" for p in props)], SYSTEMCTL_TIMEOUT_S)
        if not res.ok:
            continue
        got = parse_systemctl_show(res.stdout)
        svc = Service(name=unit, load_state=got.get("LoadState"), active_state=got.get("ActiveState"))
        services.append(svc)
        if unit == AGENT_UNIT and svc.installed and "LimitMEMLOCK" in got:
            memlock = parse_memlock(got["LimitMEMLOCK"])
    return True, services, memlock or _process_memlock(opts)


def _process_memlock(opts: DoctorOptions) -> Memlock:
    # No unit to ask: engines started from this shell would get this limit.
    soft, _hard = opts.memlock_rlimit()
    if soft == resource.RLIM_INFINITY:
        return Memlock(source="this process", unlimited=True)
    return Memlock(source="this process", unlimited=False, limit_bytes=soft)


# --------------------------------------------------------------- modules, NVSwitch


def read_modules(proc_root: Path) -> list[str] | None:
    """Loaded kernel modules from /proc/modules (first column); None where the
    kernel has no module support (a container sandbox, a monolithic kernel)."""
    try:
        text = (proc_root / "modules").read_text()
    except FileNotFoundError:
        return None
    return sorted({line.split()[0] for line in text.splitlines() if line.strip()})


def nvswitch_devices(dev_root: Path, proc_root: Path) -> int:
    """NVSwitch devices the nvidia-nvswitch driver exposes (A100/H100 HGX boards)."""
    n = 0
    try:
        n = len([p for p in dev_root.iterdir() if p.name.startswith("nvidia-nvswitch") and p.name[15:].isdigit()])
    except OSError:
        pass
    if not n:
        try:
            n = len(list((proc_root / "driver" / "nvidia-nvswitch" / "devices").iterdir()))
        except OSError:
            pass
    return n


# The most NVLinks any GPU has (H100, B200: 18). A card linked to its peers by
# more than that in total reaches them through a switch, which is how an
# NVSwitch board shows when the nvswitch device files are not visible.
MAX_DIRECT_NVLINKS = 18


def nvswitch_from(
    devices: int | None, inv: NodeInventory | None, pci: list[PciDevice] | None = None
) -> tuple[bool | None, str | None]:
    if devices:
        return True, f"{devices} NVSwitch device(s) under /dev"
    # The bus shows the switches with no driver loaded (no /dev files then,
    # and no nvidia-smi to count NVLinks with).
    switches = [d for d in pci or () if is_nvswitch(d)]
    if switches:
        return True, f"{len(switches)} NVSwitch(es) on the PCI bus ({switches[0].address} 10de:{switches[0].device_id})"
    for g in (inv.gpus if inv else None) or ():
        total = sum(p.links or 0 for p in g.nvlink_peers or ())
        if total > MAX_DIRECT_NVLINKS:
            return True, f"GPU {g.index} has {total} NVLinks to its peers, more than a card has without a switch"
    if (inv is None or inv.gpus is None) and pci is None:
        return None, None
    return False, None


# --------------------------------------------------------------- bootstrap route


def bootstrap_route(opts: DoctorOptions, host: str | None) -> Route | None:
    """The route the kernel takes towards the control plane, else the default route."""
    if host is not None:
        addr = (opts.resolve or _resolve)(host)
        if addr is not None:
            res = opts.run(["ip", "-j", "route", "get", addr], 5.0)
            if res.ok:
                r = parse_route_get(res.stdout, addr)
                if r is not None:
                    return r
    res = opts.run(["ip", "-j", "route", "show", "default"], 5.0)
    if not res.ok:
        return None
    route = parse_default_route(res.stdout)
    if route is None or route.interface is None:
        return route
    shown = opts.run(["ip", "-j", "-4", "addr", "show", "dev", route.interface], 5.0)
    if shown.ok:
        route.address = parse_first_address(shown.stdout)
    return route


def _resolve(host: str) -> str | None:
    try:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]  # type: ignore[return-value]
    except OSError:
        return None


def parse_route_get(text: str, target: str) -> Route | None:
    """`ip -j route get ADDR`: [{"dst": ..., "gateway"?: ..., "dev": ..., "prefsrc": ...}]."""
    data = json.loads(text or "[]")
    if not data:
        return None
    r = data[0]
    return Route(target=target, interface=r.get("dev"), address=r.get("prefsrc"), gateway=r.get("gateway"))


def parse_default_route(text: str) -> Route | None:
    data = json.loads(text or "[]")
    for r in data:
        if r.get("dst") in ("default", None):
            return Route(interface=r.get("dev"), address=r.get("prefsrc"), gateway=r.get("gateway"))
    return None


def parse_first_address(text: str) -> str | None:
    for link in json.loads(text or "[]"):
        for a in link.get("addr_info", ()):
            if a.get("family") == "inet" and a.get("local"):
                return str(a["local"])
    return None


# --------------------------------------------------------------- NCCL env


def nccl_per_fabric(facts: Facts) -> dict[str, dict[str, str]] | None:
    """The NCCL environment a shard of a two-node replica on each declared
    fabric would get, computed by the engines' own code."""
    if not facts.fabrics:
        return None
    inv = facts.inventory
    ports = {p.hca: p for p in (inv.ib_ports if inv else ())}
    out: dict[str, dict[str, str]] = {}
    for fab in facts.fabrics:
        adapters = []
        for hca in fab.hcas:
            p = ports.get(hca)
            roce = p is not None and p.is_roce
            adapters.append(
                Adapter(
                    name=hca,
                    link_layer="Ethernet" if roce else "InfiniBand",
                    gid_index=p.gid_index if p is not None and roce else None,
                )
            )
        launch = ShardLaunch(
            shard_id="doctor",
            engine="vllm",
            model="doctor",
            served_name="doctor",
            port=1,
            profile=Profile(nodes=2),
            node=NodeFacts(fabric_adapters=adapters, interface=facts.route.interface if facts.route else None),
            fabric=fab.name,
        )
        out[fab.name] = nccl_env(launch)
    return out


# --------------------------------------------------------------- control plane


def control_plane_target(cfg: AgentConfig) -> ControlPlaneTarget | None:
    addrs = cfg.addresses()
    if not addrs:
        return None
    u = urlsplit(addrs[0])
    host = u.hostname or ""
    port = u.port or 7443
    address = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
    if cfg.tls is None:
        return ControlPlaneTarget(address, host, port)
    return ControlPlaneTarget(address, host, port, ca=cfg.tls.ca, cert=cfg.tls.cert, key=cfg.tls.key)


# OpenSSL's verification codes that have a fix of their own.
_NAME_CODES = {62, 64}  # X509_V_ERR_HOSTNAME_MISMATCH, X509_V_ERR_IP_ADDRESS_MISMATCH
_AUTHORITY_CODES = {2, 18, 19, 20, 21}  # issuer unknown, self-signed, untrusted chain
_EXPIRED = 10
_NOT_YET_VALID = 9


def dial_control_plane(t: ControlPlaneTarget, timeout: float = DIAL_TIMEOUT_S) -> ControlPlane:
    """Connect as the agent would: TCP, the TLS handshake against agent.yaml's
    CA (presenting this node's certificate when readable), then one HTTP
    request whose Date header gives the control plane's clock."""
    cp = ControlPlane(address=t.address, host=t.host, port=t.port, tls=t.ca is not None, ca=t.ca)
    try:
        sock = socket.create_connection((t.host, t.port), timeout=timeout)
    except OSError as exc:
        cp.reachable = False
        cp.connect_error = exc.strerror or str(exc)
        return cp
    cp.reachable = True
    with sock:
        if t.ca is None:
            _clock(cp, sock, t)
            return cp
        try:
            ctx, cp.client_certificate = _client_ctx(t)
            if cp.client_certificate and t.cert:
                cp.client_certificate_kind = client_kind(load_cert(t.cert)) or "unmarked"
        except PKIError as exc:
            cp.certificate_ok = False
            cp.certificate_problem = "ca"
            cp.certificate_error = str(exc)
            return cp
        try:
            tls = ctx.wrap_socket(sock, server_hostname=t.host)
        except ssl.SSLCertVerificationError as exc:
            cp.certificate_ok = False
            cp.certificate_error = exc.verify_message or str(exc)
            code = exc.verify_code
            cp.certificate_problem = (
                "name"
                if code in _NAME_CODES
                else "authority"
                if code in _AUTHORITY_CODES
                else "expired"
                if code == _EXPIRED
                else "not-yet-valid"
                if code == _NOT_YET_VALID
                else "other"
            )
            cp.certificate_names = _peer_names(t, timeout)
            return cp
        except (ssl.SSLError, OSError) as exc:
            cp.certificate_ok = False
            cp.certificate_problem = "other"
            cp.certificate_error = f"the TLS handshake failed: {exc}"
            return cp
        with tls:
            cp.certificate_ok = True
            der = tls.getpeercert(binary_form=True)
            if der:
                cp.certificate_names = san_names(x509.load_der_x509_certificate(der))
            _clock(cp, tls, t)
    return cp


def _client_ctx(t: ControlPlaneTarget) -> tuple[ssl.SSLContext, bool]:
    assert t.ca is not None
    # The node's key is readable by root (and the agent's user) only; without
    # it the server certificate can still be checked, the clock cannot.
    if t.cert and t.key and os.access(t.cert, os.R_OK) and os.access(t.key, os.R_OK):
        try:
            return client_context(t.ca, t.cert, t.key), True
        except PKIError:
            pass
    return client_context(t.ca), False


def _peer_names(t: ControlPlaneTarget, timeout: float) -> list[str] | None:
    """What the server's certificate names, read without verifying it (to say so in the finding)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        with (
            socket.create_connection((t.host, t.port), timeout=timeout) as s,
            ctx.wrap_socket(s, server_hostname=t.host) as tls,
        ):
            der = tls.getpeercert(binary_form=True)
    except (OSError, ssl.SSLError):
        return None
    return san_names(x509.load_der_x509_certificate(der)) if der else None


def _clock(cp: ControlPlane, sock: socket.socket, t: ControlPlaneTarget) -> None:
    # The agent port is aiohttp, which puts Date on every answer (a 404 too).
    # Date has one-second resolution and is truncated: the middle of the
    # second is the best guess, and the request's midpoint the local moment.
    req = f"GET /health HTTP/1.1\r\nHost: {t.address}\r\nUser-Agent: llmgw-doctor\r\nConnection: close\r\n\r\n"
    try:
        before = time.time()
        sock.sendall(req.encode())
        head = b""
        while b"\r\n\r\n" not in head and len(head) < 65536:
            chunk = sock.recv(4096)
            if not chunk:
                break
            head += chunk
        after = time.time()
    except (OSError, ssl.SSLError) as exc:
        cp.clock_error = f"the control plane closed the connection ({exc})" + (
            "" if cp.client_certificate else "; this node's certificate could not be read, so it presented none"
        )
        return
    date = parse_date_header(head.decode("latin-1"))
    if date is None:
        if head:
            cp.clock_error = "the control plane's answer carried no Date header"
        elif cp.client_certificate:
            cp.clock_error = "the control plane closed the connection without answering"
        else:
            cp.clock_error = (
                "the control plane closed the connection: this node's certificate could not be read, "
                "so it presented none"
            )
        return
    cp.clock_offset_s = round(date + 0.5 - (before + after) / 2, 1)


def parse_date_header(head: str) -> float | None:
    for line in head.split("\r\n")[1:]:
        k, sep, v = line.partition(":")
        if sep and k.strip().lower() == "date":
            try:
                return parsedate_to_datetime(v.strip()).timestamp()
            except (TypeError, ValueError):
                return None
    return None
