"""`llmgw agent inventory [--json]`: what the control plane would see of this node."""

from __future__ import annotations

import orjson

from llmgw.protocol import GPU, NIC_PATH_ORDER, NodeInventory


def render_inventory(inv: NodeInventory, as_json: bool) -> str:
    """The inventory as a readable summary, or (``as_json``) as the JSON the
    agent sends, unknown fields left out."""
    if as_json:
        return orjson.dumps(inv.model_dump(mode="json", exclude_none=True), option=orjson.OPT_INDENT_2).decode()
    out: list[str] = []
    _host(inv, out)
    _memory(inv, out)
    _disks(inv, out)
    _gpus(inv, out)
    _adapters(inv, out)
    if inv.warnings:
        out.append("")
        out.append("Could not read")
        out.extend(f"  - {w}" for w in inv.warnings)
    return "\n".join(out) + "\n"


def size(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _count(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _row(label: str, text: str) -> str:
    return f"{label:<9} {text}"


def _host(inv: NodeInventory, out: list[str]) -> None:
    h = inv.host
    if h is None:
        out.append(_row("Host", "unknown"))
        return
    os_name = h.os_name or " ".join(x for x in (h.os_id, h.os_version) if x) or "unknown OS"
    bits = [os_name]
    if h.family:
        bits.append(f"{h.family} family")
    bits.append(f"packages: {h.package_manager or 'no package manager found'}")
    if h.arch:
        bits.append(h.arch)
    if h.kernel:
        bits.append(f"kernel {h.kernel}")
    out.append(_row("Host", f"{h.hostname or '?'}: " + ", ".join(bits)))
    cpu = [h.cpu_model or "CPU"]
    counts = _count(h.cpus, "logical CPU") if h.cpus else "CPU count unknown"
    extra = [_count(h.cores, "core") if h.cores else "", _count(h.sockets, "socket") if h.sockets else ""]
    extra = [e for e in extra if e]
    if extra:
        counts += f" ({', '.join(extra)})"
    cpu.append(counts)
    if h.cpu_flags is not None:
        cpu.append("flags: " + (" ".join(h.cpu_flags) if h.cpu_flags else "none of interest"))
        if "avx2" not in h.cpu_flags and h.arch == "amd64":
            cpu.append('no AVX2: CPU inference will be several times slower (a VM needs CPU type "host")')
    out.append(_row("CPU", ", ".join(cpu)))
    out.append(_row("Driver", f"NVIDIA {h.nvidia_driver}" if h.nvidia_driver else "no NVIDIA driver loaded"))


def _memory(inv: NodeInventory, out: list[str]) -> None:
    m = inv.memory
    if m is None or m.total_bytes is None:
        out.append(_row("Memory", "unknown"))
        return
    avail = f", {size(m.available_bytes)} available" if m.available_bytes is not None else ""
    out.append(_row("Memory", f"{size(m.total_bytes)} total{avail}"))


def _disks(inv: NodeInventory, out: list[str]) -> None:
    if inv.storage is None:
        out.append(_row("Disks", "no model directories configured"))
        return
    if not inv.storage:
        out.append(_row("Disks", "none of the model directories exists yet"))
        return
    out.append("Disks")
    for s in inv.storage:
        kind = "shared" if s.shared else ("local" if s.shared is False else "?")
        out.append(
            f"  {s.mount_point:<24} {s.fstype or '?':<8} {kind:<6} "
            f"{size(s.free_bytes)} free of {size(s.total_bytes)}  ({', '.join(s.dirs or [])})"
        )


def _gpus(inv: NodeInventory, out: list[str]) -> None:
    if inv.gpus is None:
        out.append(_row("GPUs", "not discovered (skipped, or see below)"))
        return
    if not inv.gpus:
        out.append(_row("GPUs", "none"))
        return
    out.append(f"GPUs ({len(inv.gpus)}, read with {inv.gpu_source or '?'})")
    for g in inv.gpus:
        out.append("  " + _gpu_line(g))
        if g.nvlink_peers:
            links = {p.links for p in g.nvlink_peers}
            if len(links) == 1:
                out.append(f"      NVLink to {_indices([p.index for p in g.nvlink_peers])} ({links.pop()} links each)")
            else:
                out.append("      NVLink to " + ", ".join(f"{p.index} ({p.links} links)" for p in g.nvlink_peers))
        elif g.nvlink_peers is not None:
            out.append("      no NVLink")
        if g.nic_paths:
            best = min(g.nic_paths.values(), key=NIC_PATH_ORDER.index)
            near = sorted(n for n, rel in g.nic_paths.items() if rel == best)
            out.append(f"      nearest adapters: {', '.join(near)} ({best})")
        if g.fabric is not None:
            f = g.fabric
            dom = f"domain {f.domain}" if f.domain else "no multi-node domain"
            out.append(f"      fabric: {f.state or '?'}{'/' + f.status if f.status else ''}, {dom}")
        out.extend(f"      PROBLEM: {p}" for p in g.problems or ())
    if inv.imex is not None:
        out.append(f"  IMEX: {inv.imex.state or 'not installed'}, {inv.imex.channels or 0} channel(s)")


def _gpu_line(g: GPU) -> str:
    bits = [f"{g.index}", g.name or "?", size(g.memory_total_bytes)]
    if g.memory_used_bytes:
        bits.append(f"({size(g.memory_used_bytes)} in use)")
    if g.compute_capability:
        bits.append(f"cc {g.compute_capability}")
    if g.pci_bus_id:
        bits.append(g.pci_bus_id)
    if g.numa_node is not None:
        bits.append(f"NUMA {g.numa_node}")
    if g.utilization_percent is not None:
        bits.append(f"{g.utilization_percent}% busy")
    return "  ".join(bits)


def _indices(xs: list[int]) -> str:
    """[1,2,3,5] -> "1-3, 5"."""
    xs = sorted(xs)
    parts, start = [], None
    for i, x in enumerate(xs):
        if start is None:
            start = x
        if i + 1 == len(xs) or xs[i + 1] != x + 1:
            parts.append(f"{start}-{x}" if x > start else f"{x}")
            start = None
    return ", ".join(parts)


def _adapters(inv: NodeInventory, out: list[str]) -> None:
    if inv.adapters is None:
        out.append(_row("Adapters", "unknown"))
        return
    if not inv.adapters:
        out.append(_row("Adapters", "no InfiniBand or RoCE adapters"))
        return
    out.append("Adapters")
    for a in inv.adapters:
        where = ", ".join(x for x in (a.pci_address, f"NUMA {a.numa_node}" if a.numa_node is not None else "") if x)
        out.append(f"  {a.name}  fw {a.fw_ver or '?'}  {a.node_guid or ''}  {where}".rstrip())
        for p in a.ports or ():
            rate = f"{p.rate_gbps:g} Gb/s" if p.rate_gbps is not None else "? Gb/s"
            if p.rate_detail:
                rate += f" ({p.rate_detail})"
            line = f"    port {p.port}: {p.state or '?'}/{p.phys_state or '?'}  {rate}  {p.link_layer or '?'}"
            if p.is_roce:
                if p.gid_index is not None:
                    addr = f", {p.roce_address}" if p.roce_address else ""
                    on = f" on {p.netdev}" if p.netdev else ""
                    net = f", network {p.network}" if p.network else ""
                    line += f"  RoCE v2 GID {p.gid_index}{addr}{on}{net}"
                else:
                    line += "  no RoCE v2 GID (NCCL would pick a link-local one)"
            elif p.lid is not None:
                line += f"  lid {p.lid}, SM lid {p.sm_lid if p.sm_lid is not None else '?'}"
            errors = {k: v for k, v in (p.counters or {}).items() if v and k not in _TRAFFIC}
            if errors:
                line += "  errors: " + ", ".join(f"{k}={v}" for k, v in errors.items())
            out.append(line)


_TRAFFIC = frozenset({"port_xmit_data", "port_rcv_data", "port_xmit_packets", "port_rcv_packets", "port_xmit_wait"})
