"""The subnet managers behind this node's ACTIVE InfiniBand ports, read with
infiniband-diags: `sminfo` names the master a port's SM LID points to, and
`saquery SMIR` lists every SM on that subnet with its state (else `saquery -s`
lists the ports running an SM and `sminfo <lid>` asks each).

sysfs gives only the master's LID; whether a standby would take over is
only visible here. The parsers read the formats the tools print (their
printf strings in rdma-core's infiniband-diags); the collector asks once per
master, on one port, as the spec asks for (§4.6).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence

from llmgw.agent.discovery.commands import CommandResult, Runner
from llmgw.agent.discovery.infiniband import normalize_guid
from llmgw.protocol import IBPort
from llmgw.protocol.doctor import PortSubnetManagers, SMRecord, SubnetManagers

# A port's SM answers an SMP in milliseconds; past this the fabric or the
# port is in trouble and waiting longer does not help (the spec's 5 s).
SMINFO_TIMEOUT_S = 5.0
# An SA query walks the SA's tables; a busy SM on a large fabric is slower.
SAQUERY_TIMEOUT_S = 10.0
# sminfo's words for SMInfo's state (sminfo.c's statestr), indexed by the number.
SM_STATES = ("SMINFO_NOTACT", "SMINFO_DISCOVER", "SMINFO_STANDBY", "SMINFO_MASTER")
MASTER, STANDBY = SM_STATES[3], SM_STATES[2]

_SMINFO = re.compile(
    r"sm lid (?P<lid>\d+) sm guid (?P<guid>0x[0-9a-fA-F]+), activity count \d+ "
    r"priority (?P<prio>\d+) state (?P<num>\d+) (?P<word>\S+)"
)
# saquery's dumps: "\t\tGUID..................0x248a070300f7d3a0"
_FIELD = re.compile(r"^\s*(?P<key>[A-Za-z_]+)\.{2,}(?P<value>\S+)")
_PID = re.compile(r"\[\d+\] ")

Tool = Callable[[str], "str | None"]


def _state(num: int | None, word: str | None = None) -> str | None:
    if num is not None and 0 <= num < len(SM_STATES):
        return SM_STATES[num]
    return word


def _int(v: str | None) -> int | None:
    try:
        return int(v, 0) if v is not None else None
    except ValueError:
        return None


def parse_sminfo(text: str) -> SMRecord | None:
    """`sminfo: sm lid 1 sm guid 0x248a070300f7d3a0, activity count 36453 priority 15 state 3 SMINFO_MASTER`."""
    m = _SMINFO.search(text)
    if not m:
        return None
    return SMRecord(
        guid=normalize_guid(m["guid"]),
        lid=int(m["lid"]),
        priority=int(m["prio"]),
        state=_state(int(m["num"]), m["word"]),
    )


def parse_smir(text: str) -> list[SMRecord]:
    """`saquery SMIR`: one "SMInfoRecord dump:" block per SM (LID, GUID, Priority, SMState)."""
    out = []
    for block in text.split("SMInfoRecord dump:")[1:]:
        fields = {}
        for line in block.splitlines():
            m = _FIELD.match(line)
            if m:
                fields[m["key"]] = m["value"]
        out.append(
            SMRecord(
                guid=normalize_guid(fields.get("GUID")),
                lid=_int(fields.get("LID")),
                priority=_int(fields.get("Priority")),
                state=_state(_int(fields.get("SMState"))),
            )
        )
    return out


def parse_issm_lids(text: str) -> list[int]:
    """`saquery -s`: the LIDs of the ports under "IsSM ports" (those under
    "IsSMdisabled ports" run no SM)."""
    enabled = text.split("IsSMdisabled ports", 1)[0]
    lids = []
    for line in enabled.splitlines():
        m = _FIELD.match(line)
        if m and m["key"] == "EndPortLid":
            lid = _int(m["value"])
            if lid and lid not in lids:
                lids.append(lid)
    return lids


def said(res: CommandResult, timeout: float) -> str:
    """What a diagnostic printed when it failed (its pid numbers left out)."""
    if res.timed_out:
        return f"`{' '.join(res.argv)}` did not finish in {timeout:g} s"
    if res.missing:
        return res.describe_failure()
    lines = [_PID.sub("", ln.strip()) for ln in (res.stderr + "\n" + res.stdout).splitlines() if ln.strip()]
    return "; ".join(lines[:3]) or f"`{' '.join(res.argv)}` exited with status {res.returncode}"


def _on_port(tool: str, p: IBPort, *args: str) -> list[str]:
    return [tool, "-C", p.hca, "-P", str(p.port), *args]


def _sminfo(run: Runner, sminfo: str, p: IBPort, *lid: str) -> tuple[SMRecord | None, str | None]:
    res = run(_on_port(sminfo, p, *lid), SMINFO_TIMEOUT_S)
    rec = parse_sminfo(res.stdout) if res.ok else None
    return (rec, None) if rec else (None, said(res, SMINFO_TIMEOUT_S))


def _managers(run: Runner, sminfo: str, saquery: str, p: IBPort) -> tuple[list[SMRecord] | None, str | None, str]:
    """(every SM on p's subnet, why not, where from)."""
    res = run(_on_port(saquery, p, "SMIR"), SAQUERY_TIMEOUT_S)
    records = parse_smir(res.stdout) if res.ok else []
    if records:
        return records, None, "saquery SMIR"
    why = said(res, SAQUERY_TIMEOUT_S) if not res.ok else "saquery SMIR listed no subnet manager"
    # Some SAs do not serve SMInfoRecord; the ports with IsSM set, each asked
    # over an SMP, give the same answer.
    res = run(_on_port(saquery, p, "-s"), SAQUERY_TIMEOUT_S)
    lids = parse_issm_lids(res.stdout) if res.ok else []
    if not lids:
        return None, why, "saquery SMIR"
    found = [_sminfo(run, sminfo, p, str(lid)) for lid in lids]
    records = [r for r, _ in found if r is not None]
    if not records:
        return None, next((e for _, e in found if e), why), "saquery -s + sminfo"
    return records, None, "saquery -s + sminfo"


def _parallel(fns: Sequence[Callable[[], None]], timeout: float) -> None:
    # Daemon threads, like doctor's own steps: a hung tool costs its port only.
    threads = [threading.Thread(target=fn, daemon=True) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)


def collect_subnet_managers(ports: Sequence[IBPort], run: Runner, tool: Tool) -> SubnetManagers | None:
    """The masters of every ACTIVE InfiniBand port and the SMs of each
    subnet; None when there is no such port (RoCE has no subnet manager)."""
    ib = [p for p in ports if p.active and not p.is_roce]
    if not ib:
        return None
    sminfo, saquery = tool("sminfo"), tool("saquery")
    missing = [name for name, path in (("sminfo", sminfo), ("saquery", saquery)) if path is None]
    rows = [PortSubnetManagers(hca=p.hca, port=p.port) for p in ib]
    out = SubnetManagers(missing_tools=missing or None, ports=rows)
    if sminfo is None:
        return out

    def asker(p: IBPort, row: PortSubnetManagers) -> Callable[[], None]:
        def ask() -> None:
            row.master, row.error = _sminfo(run, sminfo, p)

        return ask

    _parallel([asker(p, r) for p, r in zip(ib, rows, strict=True)], SMINFO_TIMEOUT_S + 5)
    if saquery is None:
        return out
    first: dict[str, tuple[IBPort, PortSubnetManagers]] = {}
    for p, row in zip(ib, rows, strict=True):
        guid = row.master.guid if row.master else None
        if guid is None:
            continue
        if guid not in first:
            first[guid] = (p, row)
            row.managers, why, row.source = _managers(run, sminfo, saquery, p)
            row.error = row.error or why
        else:
            # One subnet, one answer: the other ports under this master share it.
            asked_p, asked = first[guid]
            row.managers, row.source = asked.managers, f"as {asked_p.hca}/{asked_p.port}"
    return out
