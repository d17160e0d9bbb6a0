"""Multi-node NVLink: each GPU's Fabric section in `nvidia-smi -q`, and the
nvidia-imex service such a domain needs.

The -q output is indented blocks: a "GPU <pci bus id>" line per card at the
left margin, and inside it a "Fabric" block with State, Status, CliqueId,
ClusterUUID (newer drivers: "Clique ID", "Cluster UUID") and a Health block
holding Bandwidth. Drivers before the fabric manager era have no Fabric block
at all; a card without a fabric reports "N/A" everywhere. Both mean no
fabric, which is not an error.
"""

from __future__ import annotations

import os
from pathlib import Path

from llmgw.protocol import GPU, IMEX, GPUFabric

from .commands import Runner, Which

QUERY_TIMEOUT_S = 20.0

_KEYS = {
    "state": "state",
    "status": "status",
    "clusteruuid": "cluster_uuid",
    "cluster uuid": "cluster_uuid",
    "cliqueid": "clique_id",
    "clique id": "clique_id",
    "bandwidth": "bandwidth",
}
_NOT_A_VALUE = {"", "n/a", "[n/a]", "not supported", "[not supported]"}


def normalize_bus_id(bus_id: str) -> str:
    """One spelling for a PCI address: lower-case, the domain as 8 hex digits
    (nvidia-smi) whether it came as 4 (sysfs) or 8."""
    b = bus_id.strip().lower()
    domain, sep, rest = b.partition(":")
    if sep and rest.count(":") == 1 and all(c in "0123456789abcdef" for c in domain):
        return f"{int(domain, 16):08x}:{rest}"
    return b


def parse_gpu_fabric(text: str) -> dict[str, GPUFabric]:
    """Fabric state by normalised PCI bus id; cards without one are absent."""
    out: dict[str, GPUFabric] = {}
    bus: str | None = None
    cur: dict[str, str] | None = None
    fabric_indent = -1

    def flush() -> None:
        nonlocal cur
        if bus and cur and cur.get("state"):
            out[bus] = GPUFabric(**cur)
        cur = None

    for line in text.splitlines():
        stripped = line.strip()
        if not stripped:
            continue
        indent = len(line) - len(line.lstrip(" \t"))
        if indent == 0 and stripped.startswith("GPU ") and ":" in stripped[4:]:
            flush()
            bus = normalize_bus_id(stripped[4:])
            continue
        if stripped == "Fabric":
            flush()
            cur, fabric_indent = {}, indent
            continue
        if cur is None:
            continue
        if indent <= fabric_indent:
            flush()  # the block ended
            continue
        key, sep, value = stripped.partition(":")
        if not sep:
            continue
        name = _KEYS.get(key.strip().lower())
        value = value.strip()
        if name and value.lower() not in _NOT_A_VALUE:
            cur[name] = value
    flush()
    return out


def apply_fabric(gpus: list[GPU], fabric: dict[str, GPUFabric]) -> None:
    for g in gpus:
        if g.pci_bus_id:
            f = fabric.get(normalize_bus_id(g.pci_bus_id))
            if f is not None:
                g.fabric = f


def read_gpu_fabric(binary: str, run: Runner) -> dict[str, GPUFabric]:
    res = run([binary, "-q"], QUERY_TIMEOUT_S)
    if not res.ok:
        raise RuntimeError(res.describe_failure())
    return parse_gpu_fabric(res.stdout)


def collect_imex(run: Runner, which: Which, dev_root: Path = Path("/dev")) -> IMEX | None:
    """IMEX channels and service state; None on a node with neither."""
    channels: int | None = None
    try:
        channels = len(os.listdir(dev_root / "nvidia-caps-imex-channels"))
    except OSError:
        pass
    state: str | None = None
    installed = which("nvidia-imex") is not None or Path("/usr/bin/nvidia-imex").exists()
    if installed and which("systemctl"):
        res = run(["systemctl", "is-active", "nvidia-imex"], 5.0)
        # is-active exits non-zero for inactive/failed but still prints the word.
        word = res.stdout.strip()
        state = word or None
    if channels is None and state is None:
        return None
    return IMEX(state=state, channels=channels)
