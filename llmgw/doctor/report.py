"""What `llmgw doctor` prints: the spec's human layout, or the JSON that keeps everything read."""

from __future__ import annotations

import orjson

from llmgw.protocol import NIC_PATH_ORDER, IBPort
from llmgw.protocol.doctor import DoctorReport, Facts, Finding, Level

# Counters that are traffic, not trouble: left out of the ERRORS column.
_TRAFFIC = frozenset({"port_xmit_data", "port_rcv_data", "port_xmit_packets", "port_rcv_packets", "port_xmit_wait"})


def render_json(findings: list[Finding], facts: Facts) -> str:
    report = DoctorReport(findings=findings, facts=facts)
    return orjson.dumps(report.model_dump(mode="json", exclude_none=True), option=orjson.OPT_INDENT_2).decode() + "\n"


def counts(findings: list[Finding]) -> tuple[int, int]:
    return (
        sum(1 for f in findings if f.level is Level.FAIL),
        sum(1 for f in findings if f.level is Level.WARN),
    )


def render_text(findings: list[Finding], facts: Facts, *, verbose: bool = False) -> str:
    out: list[str] = [header(facts), ""]
    for f in findings:
        out.append(f"{f.level.value:<4} {f.area:<6} {f.message}")
        if f.fix and f.level is not Level.OK:
            out.append(f"     → {f.fix}")
    _gpu_table(facts, out)
    _adapter_table(facts, out)
    for fabric, env in (facts.nccl or {}).items():
        out += ["", f"A shard on {fabric} is given:"]
        out += [f"  {k}={v}" for k, v in env.items()]
    out += ["", "Engines:"]
    if facts.engines:
        for e in facts.engines:
            what = " ".join(x for x in (e.version, f"({e.variant})" if e.variant else None) if x)
            state = f"{e.state} {what}".strip() if e.state == "installed" else f"{e.state} {e.path}"
            out.append(f"  {e.engine}: {state}")
    else:
        out.append("  none installed" if facts.engines is not None else "  unknown")
    if verbose and facts.topo_raw:
        out += ["", "nvidia-smi topo -m:", facts.topo_raw.rstrip("\n")]
    failed, warned = counts(findings)
    out += [
        "",
        f"{failed} failed, {warned} warnings. `llmgw doctor --json > report.json` keeps everything read, to send back.",
    ]
    return "\n".join(out) + "\n"


def header(facts: Facts) -> str:
    h = facts.inventory.host if facts.inventory else None
    host = (h.hostname if h else None) or "?"
    os_part = " ".join(x or "?" for x in ((h.os_id, h.os_version, h.arch) if h else ("?", "?", "?")))
    driver = (h.nvidia_driver if h else None) or "-"
    return f"{host} · {os_part} · driver {driver}"


def _table(rows: list[list[str]], out: list[str]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out.append("")
    out.extend("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def _gpu_table(facts: Facts, out: list[str]) -> None:
    gpus = facts.inventory.gpus if facts.inventory else None
    if not gpus:
        return
    rows = [["GPU", "NAME", "NUMA", "NVLINK PEERS", "NEAREST ADAPTER"]]
    for g in gpus:
        peers = ",".join(str(p.index) for p in g.nvlink_peers or ()) or "-"
        nearest = "-"
        if g.nic_paths:
            best = min(g.nic_paths.values(), key=NIC_PATH_ORDER.index)
            name = sorted(n for n, rel in g.nic_paths.items() if rel == best)[0]
            nearest = f"{name} ({best})"
        numa = str(g.numa_node) if g.numa_node is not None else "-"
        rows.append([str(g.index), g.name or "?", numa, peers, nearest])
    _table(rows, out)


def _adapter_table(facts: Facts, out: list[str]) -> None:
    inv = facts.inventory
    if inv is None or not inv.adapters:
        return
    numa = {a.name: a.numa_node for a in inv.adapters}
    rows = [["ADAPTER", "STATE", "PHYS", "RATE", "LINK", "NUMA", "ROCE GID", "ERRORS"]]
    rows.extend(_port_row(p, numa.get(p.hca)) for p in inv.ib_ports)
    _table(rows, out)


def _port_row(p: IBPort, numa: int | None) -> list[str]:
    rate = f"{p.rate_gbps:g} Gb/s" if p.rate_gbps is not None else "?"
    gid = "-"
    if p.is_roce:
        gid = str(p.gid_index) if p.gid_index is not None else "none"
    errors = ",".join(f"{k}={v}" for k, v in sorted((p.counters or {}).items()) if v and k not in _TRAFFIC) or "-"
    return [
        f"{p.hca}/{p.port}",
        p.state or "?",
        p.phys_state or "?",
        rate,
        p.link_layer or "?",
        str(numa) if numa is not None else "-",
        gid,
        errors,
    ]
