"""perftest's `ib_write_bw` for `ctl fabric-test`: the command lines the agent
runs, and what their output says.

B's agent runs the server (no address), A's the client (B's management
address); both take the same TCP port for perftest's out-of-band exchange.
The flags, as perftest's usage text gives them:

* ``-d DEV`` the adapter, ``-i N`` its port (default 1);
* ``-p N`` the TCP port to listen on / connect to (default 18515);
* ``-D N`` run for N seconds (and so no peak is measured: perftest prints
  "BW peak won't be measured in this run" and a peak of 0.00);
* ``-F`` carry on when cpufreq is not at its maximum (without it perftest
  may find the CPU clock inconsistent and print "Can't produce a report");
* ``--report_gbits`` bandwidth in Gbit/s (10^9 bits) instead of MB/sec;
* ``-x N`` the GID index, RoCE only (an IB port needs no GID).

Both sides print the same table (the server prints the report the client
sends it). The bandwidth is read from the column headed ``BW average[…]``,
found by its heading, never by position: the QoS and per-port layouts add
columns in front of it or after it. Without ``--report_gbits`` perftest
prints "MB/sec" (older releases) or "MiB/sec" (newer): both are 2^20 bytes
(its format factor is 0x100000, and its help says "MiB=2^20 byte ...
Factor=10^9/(2^20*8)=119.2"), so Gbit/s = MB/sec x 2^20 x 8 / 10^9.

Parsing is pure; running the commands (and installing perftest on first
use) is the caller's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from llmgw.errors import LlmgwError

IB_WRITE_BW = "ib_write_bw"
DEFAULT_TCP_PORT = 18515  # perftest's DEF_PORT
MAX_SECONDS = 30  # the spec's ceiling for --seconds

# MB/sec and MiB/sec are both 2^20 bytes a second; Gb/sec is 10^9 bits.
_MIB_TO_GBIT = 2**20 * 8 / 1e9
_UNIT_TO_GBIT = {"gb/sec": 1.0, "mb/sec": _MIB_TO_GBIT, "mib/sec": _MIB_TO_GBIT}

_HEADING = re.compile(r"BW average\[([^\]]+)\]")
_DEVICE = re.compile(r"^\s*Dual-port\s*:.*?\bDevice\s*:\s*(\S+)", re.M)
_LINK_TYPE = re.compile(r"^\s*Link type\s*:\s*(\S+)", re.M)
# Older releases print "Gid index", newer "GID index"; "GID index2" is the second port's.
_GID_INDEX = re.compile(r"^\s*GID index\s*:\s*(\d+)", re.M | re.I)
_MTU = re.compile(r"^\s*Mtu\s*:\s*(\d+)", re.M)
_ADDRESS_GID = re.compile(r"^\s*(local|remote) address:.*\n\s*GID:\s*([\d:]+)", re.M)

_CONNECT_FAILED = re.compile(r"Couldn't connect to (\S+):(\d+)")
_DEVICE_NOT_FOUND = re.compile(r"IB device (\S+) not found")
_LISTEN_FAILED = re.compile(r"Couldn't listen to port (\d+)")
_QP_STATE = re.compile(r"Failed to modify QP (?:\S+ )?to (RTR|RTS|INIT)")
_WC_STATUS = re.compile(r"Failed status (\d+)")

# ibv_wc_status values a bandwidth test meets (rdma-core's ibv_wc_status_str words).
_WC_WORDS = {
    4: "local protection error",
    5: "work request flushed",
    10: "remote access error",
    11: "remote operation error",
    12: "transport retry counter exceeded",
    13: "RNR retry counter exceeded",
}


class FabricBenchError(LlmgwError):
    """An ib_write_bw command line that would not mean what was asked."""


@dataclass(frozen=True, slots=True)
class BwOutcome:
    """What one ib_write_bw run (either side) printed, read.

    Every figure it did not print is None. ``error`` is set only when no
    result came out; ``retryable`` when that was the server not listening
    yet, which the client tries again.
    """

    link_type: str | None = None  # "IB" or "Ethernet" (RoCE), as the banner says
    device: str | None = None
    gid_index: int | None = None  # printed only when one is in use (RoCE, or -x)
    mtu_bytes: int | None = None
    unit: str | None = None  # the table's unit as printed: "Gb/sec", "MB/sec", "MiB/sec"
    message_bytes: int | None = None
    iterations: int | None = None
    bw_average_gbps: float | None = None
    bw_peak_gbps: float | None = None  # None with -D: perftest does not measure it then
    msg_rate_mpps: float | None = None
    error: str | None = None
    retryable: bool = False


# -------------------------------------------------------------- command lines


def _word(value: str, what: str) -> str:
    # A value that starts with "-" would be read as a flag; whitespace would split it.
    if not value or value.startswith("-") or any(c.isspace() for c in value):
        raise FabricBenchError(f"{what} {value!r} is not a single word ib_write_bw can take")
    return value


def _common(device: str, port: int, gid_index: int | None, seconds: int, tcp_port: int) -> list[str]:
    if not 1 <= port <= 255:
        raise FabricBenchError(f"adapter port {port} is not a port number (1 and up)")
    if not 1 <= seconds <= MAX_SECONDS:
        raise FabricBenchError(f"a test runs 1 to {MAX_SECONDS} seconds, not {seconds}")
    if not 1 <= tcp_port <= 65535:
        raise FabricBenchError(f"TCP port {tcp_port} is out of range")
    args = ["-d", _word(device, "adapter"), "-i", str(port), "-p", str(tcp_port), "-D", str(seconds)]
    args += ["-F", "--report_gbits"]
    if gid_index is not None:
        if not 0 <= gid_index <= 255:
            raise FabricBenchError(f"GID index {gid_index} is out of range")
        args += ["-x", str(gid_index)]
    return args


def server_args(
    device: str,
    port: int,
    gid_index: int | None,
    seconds: int,
    tcp_port: int = DEFAULT_TCP_PORT,
    *,
    binary: str = IB_WRITE_BW,
) -> list[str]:
    """B's side: listens on ``tcp_port`` and waits for one client. ``gid_index`` on RoCE only."""
    return [binary, *_common(device, port, gid_index, seconds, tcp_port)]


def client_args(
    device: str,
    port: int,
    gid_index: int | None,
    server_address: str,
    seconds: int,
    tcp_port: int = DEFAULT_TCP_PORT,
    *,
    binary: str = IB_WRITE_BW,
) -> list[str]:
    """A's side: connects to the server at B's management address (the last argument, as perftest takes it)."""
    return [binary, *_common(device, port, gid_index, seconds, tcp_port), _word(server_address, "server address")]


# ------------------------------------------------------------------- parsing


def to_gbps(value: float, unit: str) -> float:
    """A bandwidth in perftest's unit ("Gb/sec", "MB/sec", "MiB/sec") as Gbit/s."""
    factor = _UNIT_TO_GBIT.get(unit.strip().lower())
    if factor is None:
        raise FabricBenchError(f"ib_write_bw reported bandwidth in {unit!r}, a unit this agent does not know")
    return value * factor


@dataclass(frozen=True, slots=True)
class _Row:
    unit: str
    values: dict[str, float]


def _columns(heading: str) -> list[str]:
    # Headings are separated by runs of spaces; within one ("BW peak[Gb/sec]") there is one space.
    return re.split(r"\s{2,}|\t+", heading.strip())


def _number(field: str) -> float | None:
    try:
        return float(field)
    except ValueError:
        return None


def _result_row(text: str) -> _Row | None:
    """The last complete row under a results heading; lines perftest prints in between are skipped."""
    columns: list[str] | None = None
    unit = ""
    found: _Row | None = None
    for line in text.splitlines():
        m = _HEADING.search(line)
        if m:
            columns, unit = _columns(line), m.group(1)
            continue
        if columns is None:
            continue
        fields = line.split()
        if len(fields) != len(columns):
            continue  # a warning, a dashed rule, a CUDA message
        numbers = [_number(f) for f in fields]
        if any(n is None for n in numbers):
            continue
        found = _Row(unit, {c: n for c, n in zip(columns, numbers, strict=True) if n is not None})
    return found


def _by_prefix(values: dict[str, float], prefix: str) -> float | None:
    return next((v for k, v in values.items() if k.startswith(prefix)), None)


def _zero_gid(gid: str) -> bool:
    return all(part.strip("0") == "" for part in gid.split(":"))


def _failure(
    stdout: str, stderr: str, link_type: str | None, gid_index: int | None, gids: dict[str, str]
) -> tuple[str, bool]:
    """A plain-language reason for a run that printed no result, and whether to try again."""
    text = stderr + "\n" + stdout
    if m := _CONNECT_FAILED.search(text):
        # The client dialled before the server was listening (or it never came up).
        return f"the peer's ib_write_bw server was not listening at {m.group(1)}:{m.group(2)}", True
    if m := _DEVICE_NOT_FOUND.search(text):
        return f"there is no RDMA adapter named {m.group(1)} on this node", False
    if "Did not detect devices" in text:
        return "no RDMA adapters were detected on this node: is the adapter's driver (mlx5_ib) loaded?", False
    if m := _LISTEN_FAILED.search(text):
        return (
            f"could not listen on TCP port {m.group(1)}: something else holds it (an earlier test still running?)",
            False,
        )
    if "Problem in resolving basic address and port" in text:
        return "the peer's address could not be resolved", False
    if "Couldn't get device attributes" in text:
        return (
            "the adapter did not answer a query of its attributes: the userspace verbs library and the "
            "kernel driver do not match (MLNX_OFED userspace on an upstream kernel, or the reverse)",
            False,
        )
    if "Found Incompatibility issue with GID types" in text:
        return "the two ends' GIDs are of different IP versions: give both a GID index of the same kind", False
    if m := _QP_STATE.search(text):
        state = m.group(1)
        if link_type == "Ethernet":
            where = f"GID index {gid_index}" if gid_index is not None else "the default GID index"
            if gids.get("local") and _zero_gid(gids["local"]):
                return (
                    f"{where} holds no address on this adapter (its GID is all zeros), so the queue pair "
                    f"could not be moved to {state}: the port has no IP address or the index is wrong",
                    False,
                )
            return (
                f"the queue pair could not be moved to {state} on RoCE with {where}: the index may not hold a "
                "routable RoCE v2 address on one of the two ports, or the two cannot reach each other",
                False,
            )
        return (
            f"the queue pair could not be moved to {state}: the two ports cannot reach each other on this fabric "
            "(different subnets, or no subnet manager has brought the port up)",
            False,
        )
    if m := _WC_STATUS.search(text):
        status = int(m.group(1))
        words = _WC_WORDS.get(status, f"status {status}")
        return f"transfers failed part way ({words}): the link dropped traffic or the peer went away", False
    if "Can't produce a report" in text:
        return "ib_write_bw could not time the test: the CPU clock is scaling (run with -F)", False
    if "Unable to set up socket connection" in text:
        # With -x, set_up_connection fails when the GID at that index cannot be read.
        return "ib_write_bw could not read the port's GID: the GID index may be past the port's GID table", False
    if "Failed to exchange data between server and clients" in text:
        return "the connection to the peer broke before the test finished (the other side exited?)", False
    if "Parser function exited with Error" in text:
        # perftest says what it refused first, then this line.
        return f"ib_write_bw refused its arguments: {_first_line(stderr) or _first_line(stdout)}", False
    # Its own words, stderr's first: that is where perftest writes what went wrong.
    last = _last_line(stderr) or _last_line(stdout)
    if last is None:
        return "ib_write_bw printed nothing", False
    return f"ib_write_bw printed no result: {last}", False


def _first_line(text: str) -> str:
    return next((ln.strip() for ln in text.splitlines() if ln.strip()), "")


def _last_line(text: str) -> str | None:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not set(ln.strip()) <= {"-", "*"}]
    return lines[-1] if lines else None


def parse_ib_write_bw(stdout: str, stderr: str) -> BwOutcome:
    """Read one side's output: the banner, the results row, or why there was none."""
    # perftest writes the banner and table to stdout and its errors to stderr,
    # but a runner that merges the two must read the same; each part is unique.
    text = stdout + "\n" + stderr
    device = m.group(1) if (m := _DEVICE.search(text)) else None
    link_type = m.group(1) if (m := _LINK_TYPE.search(text)) else None
    gid_index = int(m.group(1)) if (m := _GID_INDEX.search(text)) else None
    mtu = int(m.group(1)) if (m := _MTU.search(text)) else None
    gids: dict[str, str] = dict(_ADDRESS_GID.findall(text))

    row = _result_row(stdout) or _result_row(text)
    if row is None:
        error, retryable = _failure(stdout, stderr, link_type, gid_index, gids)
        return BwOutcome(
            link_type=link_type, device=device, gid_index=gid_index, mtu_bytes=mtu, error=error, retryable=retryable
        )
    if row.unit.strip().lower() not in _UNIT_TO_GBIT:
        # A heading this agent cannot convert: say so rather than report a wrong figure.
        error = f"ib_write_bw reported bandwidth in {row.unit!r}, a unit this agent does not know"
        return BwOutcome(
            link_type=link_type, device=device, gid_index=gid_index, mtu_bytes=mtu, unit=row.unit, error=error
        )

    average = _by_prefix(row.values, "BW average[")
    peak = _by_prefix(row.values, "BW peak[")
    size = _by_prefix(row.values, "#bytes")
    iterations = _by_prefix(row.values, "#iterations")
    avg_gbps = to_gbps(average, row.unit) if average is not None else None
    # A peak of 0.00 is perftest saying it did not measure one (always so with -D).
    peak_gbps = to_gbps(peak, row.unit) if peak else None
    return BwOutcome(
        link_type=link_type,
        device=device,
        gid_index=gid_index,
        mtu_bytes=mtu,
        unit=row.unit,
        message_bytes=int(size) if size is not None else None,
        iterations=int(iterations) if iterations is not None else None,
        bw_average_gbps=avg_gbps,
        bw_peak_gbps=peak_gbps,
        msg_rate_mpps=_by_prefix(row.values, "MsgRate["),
    )
