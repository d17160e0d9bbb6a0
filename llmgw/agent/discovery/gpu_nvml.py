"""GPUs through NVML (the `pynvml` module of the nvidia-ml-py package).

NVML is the driver's own library: faster than running nvidia-smi every few
seconds, and it reads NVLink link by link. It is optional. Without the Python
package, or without libnvidia-ml (no driver), discovery falls back to
nvidia-smi; a node with neither has no NVIDIA GPUs.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from llmgw.protocol import GPU, GPUUsage, NVLinkPeer

from .errors import DiscoveryError
from .fabric import normalize_bus_id


class NVMLUnavailable(DiscoveryError, RuntimeError):
    """NVML cannot be used here; the message says why."""

    def __init__(self, message: str, *, no_driver: bool = False):
        super().__init__(message)
        # True when the library or driver is simply absent: a node without
        # NVIDIA cards, not a fault worth a warning.
        self.no_driver = no_driver


def load_pynvml() -> ModuleType | None:
    try:
        import pynvml  # without stubs (pyproject.toml lets it be missing), so Any to mypy
    except ImportError:
        return None
    module: ModuleType = pynvml
    return module


def _text(v: Any) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


class NVMLReader:
    """An initialised NVML session, kept open so each heartbeat's read is cheap.

    ``nvml`` is the pynvml module (or a stand-in with the same functions).
    """

    def __init__(self, nvml: ModuleType | Any):
        self.nvml = nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            absent = isinstance(
                exc,
                tuple(
                    getattr(nvml, n)
                    for n in ("NVMLError_LibraryNotFound", "NVMLError_DriverNotLoaded")
                    if hasattr(nvml, n)
                ),
            )
            raise NVMLUnavailable(f"NVML could not start: {exc}", no_driver=absent) from None
        self._open = True
        try:
            self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        except nvml.NVMLError as exc:
            self.close()
            raise NVMLUnavailable(f"NVML could not list the GPUs: {exc}") from None

    def close(self) -> None:
        if self._open:
            self._open = False
            try:
                self.nvml.nvmlShutdown()
            except self.nvml.NVMLError:
                pass

    def __enter__(self) -> NVMLReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _try(self, fn: Any, *args: Any) -> Any:
        # One unsupported query (utilisation on an old card, ECC on a
        # consumer one) costs that figure only.
        try:
            return fn(*args)
        except self.nvml.NVMLError:
            return None

    def driver_version(self) -> str | None:
        v = self._try(self.nvml.nvmlSystemGetDriverVersion)
        return _text(v) if v is not None else None

    def _usage_of(self, h: Any) -> tuple[int | None, int | None, int | None]:
        nvml = self.nvml
        mem = self._try(nvml.nvmlDeviceGetMemoryInfo, h)
        util = self._try(nvml.nvmlDeviceGetUtilizationRates, h)
        ecc = self._try(
            nvml.nvmlDeviceGetTotalEccErrors, h, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
        )
        return (
            int(mem.used) if mem is not None else None,
            int(util.gpu) if util is not None else None,
            int(ecc) if ecc is not None else None,
        )

    def gpus(self) -> list[GPU]:
        nvml = self.nvml
        out: list[GPU] = []
        for i, h in enumerate(self._handles):
            mem = self._try(nvml.nvmlDeviceGetMemoryInfo, h)
            used, util, ecc = self._usage_of(h)
            cc = self._try(nvml.nvmlDeviceGetCudaComputeCapability, h)
            pci = self._try(nvml.nvmlDeviceGetPciInfo, h)
            name = self._try(nvml.nvmlDeviceGetName, h)
            uuid = self._try(nvml.nvmlDeviceGetUUID, h)
            out.append(
                GPU(
                    index=i,
                    uuid=_text(uuid) if uuid is not None else None,
                    name=_text(name) if name is not None else None,
                    memory_total_bytes=int(mem.total) if mem is not None else None,
                    memory_used_bytes=used,
                    utilization_percent=util,
                    ecc_uncorrected=ecc,
                    compute_capability=f"{cc[0]}.{cc[1]}" if cc else None,
                    pci_bus_id=_text(pci.busId) if pci is not None else None,
                )
            )
        self._nvlink(out)
        return out

    def usage(self) -> list[GPUUsage]:
        out = []
        for i, h in enumerate(self._handles):
            used, util, ecc = self._usage_of(h)
            out.append(GPUUsage(index=i, memory_used_bytes=used, utilization_percent=util, ecc_uncorrected=ecc))
        return out

    def _nvlink(self, gpus: list[GPU]) -> None:
        """NVLink peers from the links themselves. A link whose far end is
        another GPU counts towards that GPU; one ending at an NVSwitch joins
        every GPU the switch fabric reaches (checked with NVML's P2P query)."""
        nvml = self.nvml
        by_bus = {normalize_bus_id(g.pci_bus_id): g.index for g in gpus if g.pci_bus_id}
        max_links = getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)
        switch_links: dict[int, int] = {}
        direct: dict[int, dict[int, int]] = {}
        for g, h in zip(gpus, self._handles, strict=True):
            for link in range(max_links):
                try:
                    state = nvml.nvmlDeviceGetNvLinkState(h, link)
                except nvml.NVMLError:
                    # Past the card's last link; on link 0, a card without
                    # NVLink (a PCIe card), which is an answer too.
                    break
                if state != nvml.NVML_FEATURE_ENABLED:
                    continue
                remote = self._try(nvml.nvmlDeviceGetNvLinkRemotePciInfo, h, link)
                if remote is None:
                    continue  # the far end is unknown: count it nowhere
                # A far end that is none of our GPUs is an NVSwitch.
                peer = by_bus.get(normalize_bus_id(_text(remote.busId)))
                if peer is None:
                    switch_links[g.index] = switch_links.get(g.index, 0) + 1
                elif peer != g.index:
                    counts = direct.setdefault(g.index, {})
                    counts[peer] = counts.get(peer, 0) + 1
        for g, h in zip(gpus, self._handles, strict=True):
            peers = dict(direct.get(g.index, {}))
            if switch_links.get(g.index):
                for other, oh in zip(gpus, self._handles, strict=True):
                    if other.index == g.index or not switch_links.get(other.index) or other.index in peers:
                        continue
                    if self._p2p_nvlink(h, oh) is not False:
                        peers[other.index] = switch_links[g.index]
            g.nvlink_peers = [NVLinkPeer(index=p, links=n) for p, n in sorted(peers.items())]

    def _p2p_nvlink(self, a: Any, b: Any) -> bool | None:
        nvml = self.nvml
        if not hasattr(nvml, "nvmlDeviceGetP2PStatus"):
            return None
        status = self._try(nvml.nvmlDeviceGetP2PStatus, a, b, nvml.NVML_P2P_CAPS_INDEX_NVLINK)
        if status is None:
            return None
        return bool(status == nvml.NVML_P2P_STATUS_OK)
