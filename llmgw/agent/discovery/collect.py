"""Putting discovery together: the inventory an agent registers with, and the
cheap sample it re-reads for every heartbeat.

Nothing here raises for a machine being what it is. A node without GPUs,
without nvidia-smi, without adapters or without a model directory yet is a
normal node; what could not be read is said in ``warnings`` and the rest is
reported. Memory is read first, before anything that can fail, because it is
what a GPU-less node is placed by.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmgw.protocol import GPU, GPUUsage, NodeInventory, NodeSample

from . import fabric as fabric_mod
from .commands import Runner, Which, run_command
from .commands import which as default_which
from .disk import collect_storage
from .gpu_nvml import NVMLReader, NVMLUnavailable, load_pynvml
from .gpu_smi import SMIError, query_gpus, query_usage
from .host import collect_host
from .infiniband import DEFAULT_IB_ROOT, ip_network_lookup, ports_of, read_adapters
from .proc import LoadSampler, read_memory
from .topology import TOPO_TIMEOUT_S, TopologyError, apply_topology, parse_topology

log = logging.getLogger("llmgw.agent.discovery")

_AUTO = object()


@dataclass(frozen=True)
class DiscoveryOptions:
    """Where to look. The first group matches agent.yaml's ``discovery`` keys
    and ``model_dirs``; the rest lets tests point discovery at fixture trees."""

    model_dirs: tuple[str, ...] = ()
    nvidia_smi: str | None = None  # a path; None: look on PATH
    ib_root: Path = DEFAULT_IB_ROOT
    prefer_nvml: bool = True
    skip_gpus: bool = False

    proc_root: Path = Path("/proc")
    sys_root: Path = Path("/sys")
    dev_root: Path = Path("/dev")
    os_release: Path = Path("/etc/os-release")
    mounts_file: Path = Path("/proc/mounts")
    run: Runner = field(default=run_command, repr=False)
    which: Which = field(default=default_which, repr=False)
    # The pynvml module or a stand-in; _AUTO imports pynvml if installed,
    # None never uses NVML.
    nvml: Any = field(default=_AUTO, repr=False)


def _nvml_module(opts: DiscoveryOptions) -> Any:
    return load_pynvml() if opts.nvml is _AUTO else opts.nvml


def _smi_binary(opts: DiscoveryOptions, warnings: list[str]) -> str | None:
    """The nvidia-smi to run. Not configured and not on PATH is a node without
    NVIDIA cards; configured but missing is a mistake worth saying."""
    if opts.nvidia_smi:
        if opts.which(opts.nvidia_smi) or Path(opts.nvidia_smi).is_file():
            return opts.nvidia_smi
        warnings.append(
            f"nvidia_smi is set to {opts.nvidia_smi}, which does not exist; "
            "fix discovery.nvidia_smi in agent.yaml or remove it to look on PATH"
        )
        return None
    return opts.which("nvidia-smi")


def sysfs_bus_id(bus_id: str) -> str:
    """nvidia-smi's 00000000:18:00.0 as sysfs names it: 0000:18:00.0."""
    b = fabric_mod.normalize_bus_id(bus_id)
    domain, sep, rest = b.partition(":")
    try:
        return f"{int(domain, 16):04x}:{rest}" if sep else b
    except ValueError:
        return b


def gpu_problems(gpu: GPU) -> list[str]:
    """What should keep a card out of placement, in words."""
    problems = []
    if gpu.ecc_uncorrected:
        problems.append(
            f"{gpu.ecc_uncorrected} uncorrected ECC error(s) since the driver loaded; "
            "the card needs a reset (or replacing) before it can be trusted"
        )
    return problems


class Discovery:
    """Discovery for one agent: keeps the CPU sampler's previous reading and an
    open NVML session between heartbeats."""

    def __init__(self, options: DiscoveryOptions | None = None):
        self.options = options or DiscoveryOptions()
        self.sampler = LoadSampler(self.options.proc_root)
        self._nvml: NVMLReader | None = None
        self._smi: str | None = None
        self._gpu_source: str | None = None
        self._backend_open = False
        self._bus_by_index: dict[int, str] | None = None
        # inventory() reopens the GPU backend that sample() reads through; an
        # agent calling them from worker threads must not interleave them.
        self._lock = threading.RLock()

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._nvml is not None:
            self._nvml.close()
            self._nvml = None
        self._backend_open = False

    # ------------------------------------------------------------ inventory

    def inventory(self) -> NodeInventory:
        with self._lock:
            return self._inventory()

    def _inventory(self) -> NodeInventory:
        opts = self.options
        warnings: list[str] = []
        inv = NodeInventory(memory=read_memory(opts.proc_root))
        if inv.memory is None:
            warnings.append(f"could not read memory from {opts.proc_root / 'meminfo'}")

        inv.host = self._step(
            "the host",
            warnings,
            lambda: collect_host(os_release=opts.os_release, proc_root=opts.proc_root, which=opts.which),
        )
        if opts.model_dirs:
            inv.storage = self._step(
                "disk space",
                warnings,
                lambda: collect_storage(opts.model_dirs, mounts_file=opts.mounts_file, warnings=warnings),
            )
        if not opts.skip_gpus:
            inv.gpus = self._step("GPUs", warnings, lambda: self._discover_gpus(warnings))
            inv.gpu_source = self._gpu_source if inv.gpus else None
            if inv.host is not None and inv.host.nvidia_driver is None and self._nvml is not None:
                inv.host.nvidia_driver = self._nvml.driver_version()
            if inv.gpus:
                inv.imex = self._step(
                    "IMEX", warnings, lambda: fabric_mod.collect_imex(opts.run, opts.which, opts.dev_root)
                )
        inv.adapters = self._step(
            "RDMA adapters", warnings, lambda: read_adapters(opts.ib_root, network_of=ip_network_lookup(opts.run))
        )
        inv.warnings = warnings or None
        for w in warnings:
            log.warning("discovery: %s", w)
        return inv

    @staticmethod
    def _step(what: str, warnings: list[str], fn: Any) -> Any:
        # A bug or an unexpected format in one part costs that part only.
        try:
            return fn()
        except Exception as exc:
            warnings.append(f"could not read {what}: {exc}")
            log.debug("discovery of %s failed", what, exc_info=True)
            return None

    def _open_gpu_backend(self, warnings: list[str]) -> None:
        """Open NVML where it works, and find nvidia-smi (for the fallback, the
        topology and the fabric state, which NVML does not give)."""
        opts = self.options
        self._close()
        self._gpu_source = None
        nvml = _nvml_module(opts) if opts.prefer_nvml else None
        if nvml is not None:
            try:
                self._nvml = NVMLReader(nvml)
                self._gpu_source = "nvml"
            except NVMLUnavailable as exc:
                if not exc.no_driver:
                    warnings.append(f"{exc}; using nvidia-smi instead")
            except nvml.NVMLError as exc:
                warnings.append(f"NVML failed ({exc}); using nvidia-smi instead")
        self._smi = _smi_binary(opts, warnings)
        if self._nvml is None and self._smi is not None:
            self._gpu_source = "nvidia-smi"
        self._backend_open = True

    def _discover_gpus(self, warnings: list[str]) -> list[GPU] | None:
        opts = self.options
        self._open_gpu_backend(warnings)
        gpus: list[GPU] | None = None
        if self._nvml is not None:
            nvml_error = self._nvml.nvml.NVMLError
            try:
                gpus = self._nvml.gpus()
            except nvml_error as exc:
                self._close()
                self._backend_open = True  # nvidia-smi from here on
                warnings.append(f"NVML failed ({exc}); using nvidia-smi instead")
                self._gpu_source = "nvidia-smi" if self._smi else None
        if gpus is None:
            if self._smi is None:
                # No nvidia-smi and no NVML: no NVIDIA cards, unless a
                # configured path was wrong (then it is unknown).
                return None if opts.nvidia_smi else []
            try:
                gpus = query_gpus(self._smi, opts.run)
            except SMIError as exc:
                warnings.append(f"nvidia-smi could not list the GPUs: {exc}")
                return None
        if not gpus:
            return gpus
        self._bus_by_index = {g.index: fabric_mod.normalize_bus_id(g.pci_bus_id) for g in gpus if g.pci_bus_id}

        if self._smi is not None:
            # NVLink peers and adapter distances for either source: NVML knows
            # NVLink but not the adapters; the query knows neither. A failure
            # costs the topology, not the cards.
            res = opts.run([self._smi, "topo", "-m"], TOPO_TIMEOUT_S)
            try:
                if not res.ok:
                    raise TopologyError(res.describe_failure())
                apply_topology(gpus, parse_topology(res.stdout))
            except TopologyError as exc:
                warnings.append(f"could not read the GPU topology ({exc}); NVLink and adapter distances are unknown")
            try:
                fabric_mod.apply_fabric(gpus, fabric_mod.read_gpu_fabric(self._smi, opts.run))
            except RuntimeError as exc:
                warnings.append(f"could not read the GPUs' NVLink fabric state: {exc}")

        for g in gpus:
            if g.numa_node is None and g.pci_bus_id:
                g.numa_node = self._pci_numa_node(g.pci_bus_id)
            g.problems = gpu_problems(g) or None
        return gpus

    def _pci_numa_node(self, bus_id: str) -> int | None:
        # Older drivers' topo has no NUMA column; the kernel knows.
        try:
            devices = self.options.sys_root / "bus" / "pci" / "devices"
            n = int((devices / sysfs_bus_id(bus_id) / "numa_node").read_text().strip())
        except (OSError, ValueError):
            return None
        return n if n >= 0 else None

    # --------------------------------------------------------------- sample

    def sample(
        self,
        shards: Mapping[str, int] | None = None,
        *,
        gpus: bool = True,
        gpu_fabric: bool = False,
    ) -> NodeSample:
        """Memory, load, disk, GPU use and RDMA ports: what a heartbeat carries.
        ``gpu_fabric`` also re-reads `nvidia-smi -q` (slow; about once a minute)."""
        with self._lock:
            return self._sample(shards, gpus, gpu_fabric)

    def _sample(self, shards: Mapping[str, int] | None, gpus: bool, gpu_fabric: bool) -> NodeSample:
        opts = self.options
        s = NodeSample(memory=read_memory(opts.proc_root))
        s.load = self._quiet(lambda: self.sampler.sample(shards))
        if opts.model_dirs:
            s.storage = self._quiet(lambda: collect_storage(opts.model_dirs, mounts_file=opts.mounts_file))
        if gpus and not opts.skip_gpus:
            s.gpus = self._quiet(self._gpu_usage)
            if gpu_fabric and s.gpus and self._smi:
                smi = self._smi
                self._quiet(lambda: self._apply_usage_fabric(s.gpus, fabric_mod.read_gpu_fabric(smi, opts.run)))
        s.ib_ports = self._quiet(lambda: ports_of(read_adapters(opts.ib_root, network_of=ip_network_lookup(opts.run))))
        return s

    def _gpu_usage(self) -> list[GPUUsage] | None:
        if not self._backend_open:
            self._open_gpu_backend([])
        if self._nvml is not None:
            return self._nvml.usage()
        if self._smi is None:
            return None if self.options.nvidia_smi else []
        return query_usage(self._smi, self.options.run)

    def _apply_usage_fabric(self, usage: list[GPUUsage], fab: dict[str, Any]) -> None:
        # -q sections are keyed by PCI address, usage by index: the bus ids
        # come from the GPU list, read once.
        if self._bus_by_index is None:
            gpus = (
                self._nvml.gpus() if self._nvml is not None else query_gpus(self._smi, self.options.run)  # type: ignore[arg-type]  # only called with self._smi set
            )
            self._bus_by_index = {g.index: fabric_mod.normalize_bus_id(g.pci_bus_id) for g in gpus if g.pci_bus_id}
        for u in usage:
            bus = self._bus_by_index.get(u.index)
            if bus and bus in fab:
                u.fabric = fab[bus]

    @staticmethod
    def _quiet(fn: Any) -> Any:
        # A heartbeat goes out with what could be read; a failure is logged
        # once at debug level per call and the field stays unknown.
        try:
            return fn()
        except Exception:
            log.debug("heartbeat sample part failed", exc_info=True)
            return None


def collect_inventory(options: DiscoveryOptions | None = None, **overrides: Any) -> NodeInventory:
    """Everything discovery finds, once (for `llmgw agent inventory`, or a
    first registration). ``overrides`` are DiscoveryOptions fields."""
    opts = options or DiscoveryOptions()
    if overrides:
        opts = dataclasses.replace(opts, **_normalise(overrides))
    d = Discovery(opts)
    try:
        return d.inventory()
    finally:
        d.close()


def collect_heartbeat_sample(
    options: DiscoveryOptions | None = None,
    *,
    sampler: LoadSampler | None = None,
    shards: Mapping[str, int] | None = None,
    gpus: bool = True,
) -> NodeSample:
    """One heartbeat's re-read. Pass the same ``sampler`` each time: CPU use is
    the difference from its previous reading. A running agent holds a
    ``Discovery`` instead, which also keeps NVML open between calls."""
    d = Discovery(options)
    if sampler is not None:
        d.sampler = sampler
    try:
        return d.sample(shards, gpus=gpus)
    finally:
        d.close()


def _normalise(overrides: dict[str, Any]) -> dict[str, Any]:
    out = dict(overrides)
    if "model_dirs" in out:
        dirs: Iterable[Any] = out["model_dirs"] or ()
        out["model_dirs"] = tuple(os.fspath(d) for d in dirs)
    for key in ("ib_root", "proc_root", "sys_root", "dev_root", "os_release", "mounts_file"):
        if key in out and out[key] is not None:
            out[key] = Path(out[key])
    return out
