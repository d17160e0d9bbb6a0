"""`nvidia-smi topo -m`: which GPUs NVLink joins, how far each network adapter
is from each GPU, and the NUMA node and CPUs each GPU sits nearest.

Two layouts exist. Newer drivers name adapters NIC0, NIC1... in the header and
map them to device names in a "NIC Legend" below, and end with the columns
CPU Affinity, NUMA Affinity and GPU NUMA ID. Older ones put the adapter names
(mlx5_0) in the header directly and may lack the affinity columns. Cells are
tab-separated; data rows carry an extra empty cell where a header name is
wider than a tab stop ("0<tab><tab>N/A"), so empty cells are dropped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from llmgw.protocol import GPU, NIC_PATH_ORDER, NVLinkPeer

from .errors import DiscoveryError

TOPO_TIMEOUT_S = 15.0

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_GPU = re.compile(r"^GPU(\d+)$")
_NV = re.compile(r"^NV(\d+)$")
_LEGEND = re.compile(r"^\s*(NIC\d+)\s*:\s*(\S+)\s*$")
_AFFINITY_COLUMNS = {"CPU Affinity", "NUMA Affinity", "GPU NUMA ID"}
# SOC is what drivers before SYS called a path across the processor interconnect.
_ALIASES = {"SOC": "SYS"}


class TopologyError(DiscoveryError, ValueError):
    """The text is not a topology matrix (often nvidia-smi's own error message)."""


@dataclass
class Topology:
    # gpu -> peer -> bonded links
    nvlink: dict[int, dict[int, int]] = field(default_factory=dict)
    # gpu -> adapter name -> PIX/PXB/PHB/NODE/SYS
    nic_paths: dict[int, dict[str, str]] = field(default_factory=dict)
    numa: dict[int, int] = field(default_factory=dict)
    cpu_affinity: dict[int, str] = field(default_factory=dict)
    adapters: list[str] = field(default_factory=list)


def _cells(line: str) -> list[str]:
    line = line.rstrip("\r\n")
    # Copied output that lost its tabs: columns are at least two spaces apart.
    parts = line.split("\t") if "\t" in line else re.split(r"\s{2,}", line)
    return [p.strip() for p in parts]


def _header_cells(line: str) -> list[str]:
    # A header cell can hide two names joined by spaces when tabs were lost
    # ("CPU Affinity    NUMA Affinity").
    out: list[str] = []
    for cell in _cells(line):
        out.extend(c for c in re.split(r"\s{2,}", cell) if c) if cell else out.append("")
    return out


def parse_topology(text: str) -> Topology:
    text = _ANSI.sub("", text)
    lines = text.splitlines()
    legend = {m.group(1): m.group(2) for m in (_LEGEND.match(ln) for ln in lines) if m}

    start, header = -1, []
    for i, line in enumerate(lines):
        cells = _header_cells(line)
        names = [c for c in cells if c]
        # The header starts with a GPU column and, unlike every GPU's row, has
        # no "X" (the GPU itself) in it.
        if names and _GPU.match(names[0]) and "X" not in names:
            start, header = i, names
            break
    if start < 0:
        snippet = text.strip().splitlines()[0][:200] if text.strip() else "(no output)"
        raise TopologyError(f"no GPU matrix in the nvidia-smi topo output: {snippet}")

    topo = Topology()
    topo.adapters = [legend.get(c, c) for c in header if not _GPU.match(c) and c not in _AFFINITY_COLUMNS]
    rows = 0
    for line in lines[start + 1 :]:
        if not line.strip():
            break  # the matrix ends at the first blank line, before the legend
        cells = [c for c in _cells(line) if c]
        m = _GPU.match(cells[0]) if cells else None
        if not m:
            continue  # an adapter's row repeats the same distances from its side
        gpu = int(m.group(1))
        rows += 1
        for col, value in zip(header, cells[1:], strict=False):  # a row may be short of trailing columns
            peer = _GPU.match(col)
            if peer:
                nv = _NV.match(value)
                if nv and int(peer.group(1)) != gpu:
                    topo.nvlink.setdefault(gpu, {})[int(peer.group(1))] = int(nv.group(1))
            elif col == "NUMA Affinity":
                if value.lstrip("-").isdigit() and int(value) >= 0:
                    topo.numa[gpu] = int(value)
            elif col == "CPU Affinity":
                if value and value.upper() != "N/A":
                    topo.cpu_affinity[gpu] = value
            elif col == "GPU NUMA ID":
                pass  # a GPU's own memory node (Grace Hopper); not used for placement
            else:
                rel = _ALIASES.get(value.upper(), value.upper())
                if rel in NIC_PATH_ORDER:
                    topo.nic_paths.setdefault(gpu, {})[legend.get(col, col)] = rel
    if rows == 0:
        raise TopologyError("the nvidia-smi topo matrix had a header but no GPU rows")
    return topo


def apply_topology(gpus: list[GPU], topo: Topology) -> None:
    """Put what the matrix says on the GPUs it describes. NVLink peers already
    found (NVML reads the links themselves, the more exact source) are kept."""
    for g in gpus:
        if g.nvlink_peers is None and g.index in topo.nvlink:
            g.nvlink_peers = [NVLinkPeer(index=p, links=n) for p, n in sorted(topo.nvlink[g.index].items())]
        elif g.nvlink_peers is None:
            g.nvlink_peers = []
        if g.index in topo.numa:
            g.numa_node = topo.numa[g.index]
        if g.index in topo.cpu_affinity:
            g.cpu_affinity = topo.cpu_affinity[g.index]
        if topo.nic_paths.get(g.index):
            g.nic_paths = dict(topo.nic_paths[g.index])
