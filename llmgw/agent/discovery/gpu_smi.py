"""GPUs from `nvidia-smi --query-gpu`, the fallback when NVML cannot be used.

Values the driver cannot give come back as "[N/A]" or "[Not Supported]" and
are read as unknown (None), never as zero: an unreported utilisation shown as
0 reads as an idle card, and the most idle-looking card gets the next model.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from llmgw.protocol import GPU, GPUUsage

from .commands import Runner
from .errors import DiscoveryError

QUERY_FIELDS: tuple[str, ...] = (
    "index",
    "uuid",
    "name",
    "memory.total",
    "memory.used",
    "utilization.gpu",
    "ecc.errors.uncorrected.volatile.total",
    "compute_cap",
    "pci.bus_id",
)
# A driver too old to know these refuses the whole query, so they are dropped
# and the query asked again rather than losing every GPU on that node.
OPTIONAL_FIELDS: frozenset[str] = frozenset({"utilization.gpu", "compute_cap", "ecc.errors.uncorrected.volatile.total"})
# Without these a row is not a GPU anyone can place on.
REQUIRED_FIELDS: tuple[str, ...] = ("index", "name", "memory.total")

USAGE_FIELDS: tuple[str, ...] = ("index", "memory.used", "utilization.gpu", "ecc.errors.uncorrected.volatile.total")

QUERY_TIMEOUT_S = 15.0
MIB = 1 << 20

_UNKNOWN = re.compile(
    r"^\[?(N/A|Not Supported|Unknown Error|Insufficient Permissions|GPU is lost|GPU requires reset)\]?$", re.I
)
_INVALID_FIELD = re.compile(r'Field "([^"]+)" is not a valid field to query', re.I)


class SMIError(DiscoveryError, RuntimeError):
    """nvidia-smi ran and gave no usable answer; the message says why."""


def _value(cell: str) -> str | None:
    cell = cell.strip()
    return None if not cell or _UNKNOWN.match(cell) else cell


def _int(cell: str | None) -> int | None:
    if cell is None:
        return None
    try:
        return int(float(cell))
    except ValueError:
        return None


def parse_query_csv(text: str, fields: Sequence[str] = QUERY_FIELDS) -> list[dict[str, str | None]]:
    """Rows of `--format=csv,noheader,nounits` as field -> value (None when unknown).

    A row shorter than the field list lacks trailing fields (older drivers);
    a longer one has a comma inside the name, the only free-text field.
    """
    rows = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        cells = [c.strip() for c in line.split(",")]
        if len(cells) > len(fields) and "name" in fields:
            extra = len(cells) - len(fields)
            i = list(fields).index("name")
            cells = cells[:i] + [", ".join(cells[i : i + extra + 1])] + cells[i + extra + 1 :]
        row = {f: (_value(cells[n]) if n < len(cells) else None) for n, f in enumerate(fields)}
        missing = [f for f in REQUIRED_FIELDS if f in fields and row.get(f) is None]
        if missing:
            raise SMIError(f"nvidia-smi query line {lineno} has no {', '.join(missing)}: {line.strip()[:200]!r}")
        rows.append(row)
    return rows


def gpus_from_rows(rows: list[dict[str, str | None]]) -> list[GPU]:
    gpus = []
    for row in rows:
        index = _int(row.get("index"))
        if index is None:
            raise SMIError(f"nvidia-smi reported a GPU index that is not a number: {row.get('index')!r}")
        total = _int(row.get("memory.total"))
        used = _int(row.get("memory.used"))
        gpus.append(
            GPU(
                index=index,
                uuid=row.get("uuid"),
                name=row.get("name"),
                memory_total_bytes=total * MIB if total is not None else None,
                memory_used_bytes=used * MIB if used is not None else None,
                utilization_percent=_int(row.get("utilization.gpu")),
                ecc_uncorrected=_int(row.get("ecc.errors.uncorrected.volatile.total")),
                compute_capability=row.get("compute_cap"),
                pci_bus_id=row.get("pci.bus_id"),
            )
        )
    return sorted(gpus, key=lambda g: g.index)


def _query(binary: str, fields: Sequence[str], run: Runner) -> tuple[str, list[str]]:
    """Run the query, dropping optional fields the driver does not know."""
    fields = list(fields)
    for _ in range(len(OPTIONAL_FIELDS) + 1):
        res = run([binary, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"], QUERY_TIMEOUT_S)
        if res.ok:
            return res.stdout, fields
        m = _INVALID_FIELD.search(res.stdout + res.stderr)
        if m and m.group(1) in fields and m.group(1) in OPTIONAL_FIELDS:
            fields.remove(m.group(1))
            continue
        raise SMIError(res.describe_failure())
    raise SMIError(f"{binary} refused every form of the GPU query")


def query_gpus(binary: str, run: Runner) -> list[GPU]:
    out, fields = _query(binary, QUERY_FIELDS, run)
    return gpus_from_rows(parse_query_csv(out, fields))


def query_usage(binary: str, run: Runner) -> list[GPUUsage]:
    """Memory used, utilisation and ECC per GPU: what a heartbeat re-reads."""
    out, fields = _query(binary, USAGE_FIELDS, run)
    usage = []
    for row in parse_query_csv(out, fields):
        index = _int(row.get("index"))
        if index is None:
            continue
        used = _int(row.get("memory.used"))
        usage.append(
            GPUUsage(
                index=index,
                memory_used_bytes=used * MIB if used is not None else None,
                utilization_percent=_int(row.get("utilization.gpu")),
                ecc_uncorrected=_int(row.get("ecc.errors.uncorrected.volatile.total")),
            )
        )
    return sorted(usage, key=lambda u: u.index)
