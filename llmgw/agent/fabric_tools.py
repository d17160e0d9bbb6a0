"""The fabric tools the control plane asks the agent to run: `ibnetdiscover` for
the fabric map, `ib_write_bw` for `ctl fabric-test`, and the installing of the
packages they come in (infiniband-diags, perftest) the first time one is missing.

Each runs with a deadline and a ceiling on what it may print: a scan of a
huge or looping fabric must not fill the agent's memory, and a map cut short
would be a wrong map, so a scan past the ceiling is an error, never a
truncated answer. The reading of `ib_write_bw`'s output is fabric_bench's.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

from llmgw.agent.discovery.commands import find_tool, run_command
from llmgw.agent.discovery.subnet import collect_subnet_managers
from llmgw.agent.fabric_bench import (
    IB_WRITE_BW,
    BwOutcome,
    FabricBenchError,
    client_args,
    parse_ib_write_bw,
    server_args,
)
from llmgw.agent.provision.status import ProvisionError
from llmgw.protocol import FabricScanReply, FabricScanRequest, FabricTestReply, FabricTestRequest, IBPort
from llmgw.protocol.doctor import SubnetManagers

log = logging.getLogger("llmgw.agent.fabric")

IBNETDISCOVER = "ibnetdiscover"
# The spec's bounds for one scan (§1.9): a large fabric takes tens of seconds.
SCAN_TIMEOUT_S = 120.0
SCAN_OUTPUT_CAP = 16 << 20
# ib_write_bw prints a banner and a table: anything near this is not a result.
BENCH_OUTPUT_CAP = 1 << 20
# What is kept of a tool's stderr: its first lines say what went wrong.
STDERR_CAP = 64 << 10
# A server answers when its test is over; past the test's seconds plus this it
# is stopped (the client never came), and a client that hangs likewise.
TEST_MARGIN_S = 60.0
# The client dials before the server may be listening (§6.2: 10 retries, 1 s apart).
CLIENT_RETRIES = 10
CLIENT_RETRY_S = 1.0
# Lines of ib_write_bw's output sent back with a test's result.
OUTPUT_LINES = 20
# After a failed install, a missing tool is reported without trying again until this passes.
INSTALL_RETRY_S = 600.0

DIAGS = "infiniband-diags"
PERFTEST = "perftest"
# Both families name the packages the same (Debian, Ubuntu, RHEL, SUSE).
DIAGS_PACKAGES: Mapping[str, Sequence[str]] = {"deb": (DIAGS,), "rpm": (DIAGS,)}
PERFTEST_PACKAGES: Mapping[str, Sequence[str]] = {"deb": (PERFTEST,), "rpm": (PERFTEST,)}

# The package installer of the agent (Installer.install_packages), or None where there is none.
InstallPackages = Callable[[Mapping[str, Sequence[str]]], Awaitable[list[str]]]


class PackageOnDemand:
    """One OS package installed the first time a tool in it is missing.

    One attempt at a time; after a failed one, none for ``retry_s``, so a node
    that cannot install (not root, no package sources) is not asked every minute.
    """

    def __init__(
        self,
        package: str,
        by_family: Mapping[str, Sequence[str]],
        install: InstallPackages | None,
        *,
        retry_s: float = INSTALL_RETRY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.package = package
        self.by_family = by_family
        self.install = install
        self.retry_s = retry_s
        self.clock = clock
        self.last_error: str | None = None
        self._failed_at: float | None = None
        self._lock = asyncio.Lock()

    async def find(self, *names: str) -> dict[str, str | None]:
        """Each tool's path, installing the package first when one is missing."""
        found = {n: find_tool(n) for n in names}
        if all(found.values()) or self.install is None:
            return found
        async with self._lock:
            found = {n: find_tool(n) for n in names}  # another caller may just have installed it
            if all(found.values()) or not self._may_try():
                return found
            missing = [n for n, p in found.items() if p is None]
            log.info("%s missing: installing %s", ", ".join(missing), self.package)
            try:
                await self.install(self.by_family)
            except ProvisionError as exc:
                self.last_error = str(exc)
            found = {n: find_tool(n) for n in names}
            if all(found.values()):
                self._failed_at, self.last_error = None, None
                log.info("installed %s", self.package)
            else:
                # Also when nothing was installed at all (a family with no package manager known).
                self._failed_at = self.clock()
                log.warning(
                    "%s could not be installed: %s", self.package, self.last_error or "the tools are still missing"
                )
        return found

    def _may_try(self) -> bool:
        return self._failed_at is None or self.clock() - self._failed_at >= self.retry_s

    def missing_words(self, names: Sequence[str]) -> str:
        """A sentence for tools still missing, ending in what to do."""
        verb = "is" if len(names) == 1 else "are"
        failed = f" and installing {self.package} failed ({self.last_error})" if self.last_error else ""
        return f"{' and '.join(names)} {verb} not installed on this node{failed}; install {self.package}"


# --------------------------------------------------------------- running


@dataclass(frozen=True, slots=True)
class Ran:
    """What one bounded run printed and how it ended."""

    argv: tuple[str, ...]
    returncode: int | None  # None: it did not end by itself (timed out, over the cap, never started)
    stdout: str = ""
    stderr: str = ""
    timed_out: bool = False
    over_cap: bool = False
    not_started: str | None = None  # why it could not be started

    def lines(self, n: int) -> list[str]:
        """The last ``n`` non-empty lines of stdout then stderr."""
        text = self.stdout + "\n" + self.stderr
        return [ln.rstrip() for ln in text.splitlines() if ln.strip()][-n:]


async def _drain(stream: asyncio.StreamReader, into: bytearray, cap: int, on_over: Callable[[], None] | None) -> None:
    while chunk := await stream.read(1 << 16):
        room = cap - len(into)
        if room <= 0:
            continue  # still read, so the tool never blocks on a full pipe
        into += chunk[:room]
        if len(chunk) > room and on_over is not None:
            on_over()


async def run_bounded(argv: Sequence[str], timeout: float, cap: int) -> Ran:
    """Run ``argv`` for at most ``timeout`` seconds; past ``cap`` bytes of stdout it
    is stopped and ``over_cap`` set. Its process group is killed on every early end,
    a cancellation included."""
    args = tuple(argv)
    try:
        proc = await asyncio.create_subprocess_exec(
            *args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            # A fixed, English locale: the parsers read the tools' words.
            env={**os.environ, "LC_ALL": "C"},
            start_new_session=True,
        )
    except OSError as exc:
        return Ran(args, None, not_started=f"{args[0]} could not be started ({exc.strerror or exc})")
    out, err = bytearray(), bytearray()
    over = False

    def stop_over() -> None:
        nonlocal over
        over = True
        _kill_group(proc)

    assert proc.stdout is not None and proc.stderr is not None
    timed_out = False
    try:
        await asyncio.wait_for(
            asyncio.gather(_drain(proc.stdout, out, cap, stop_over), _drain(proc.stderr, err, STDERR_CAP, None)),
            timeout,
        )
    except TimeoutError:
        timed_out = True
        _kill_group(proc)
    except BaseException:
        _kill_group(proc)
        raise
    rc = await proc.wait()
    return Ran(
        args,
        None if (timed_out or over) else rc,
        out.decode(errors="replace"),
        err.decode(errors="replace"),
        timed_out=timed_out,
        over_cap=over,
    )


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _ms_since(started: float) -> int:
    return int((time.monotonic() - started) * 1000)


def _size(n: int) -> str:
    return f"{n >> 20} MB" if n >= 1 << 20 else f"{n} bytes"


def _single_word(value: str, what: str) -> str | None:
    """Why ``value`` cannot be one argument of a tool (a leading "-" would read as a flag)."""
    if not value or value.startswith("-") or any(c.isspace() for c in value):
        return f"{what} {value!r} is not a name a tool can take"
    return None


# --------------------------------------------------------------- subnet managers


def infiniband_ports(ports: Sequence[IBPort] | None) -> list[IBPort]:
    """The ports a subnet manager stands behind: ACTIVE and InfiniBand (RoCE has none)."""
    return [p for p in ports or () if p.active and not p.is_roce]


async def read_subnet_managers(
    ports: Sequence[IBPort] | None, diags: PackageOnDemand
) -> tuple[SubnetManagers | None, str | None]:
    """(the managers behind the ACTIVE InfiniBand ports, a sentence when the tools are
    missing); (None, None) when there is no such port, and then nothing is run."""
    ib = infiniband_ports(ports)
    if not ib:
        return None, None
    await diags.find("sminfo", "saquery")
    # The collector runs its tools in threads of its own and blocks until they answer.
    managers = await asyncio.to_thread(collect_subnet_managers, ib, run_command, find_tool)
    missing = managers.missing_tools if managers is not None else None
    return managers, diags.missing_words(missing) if missing else None


# --------------------------------------------------------------- the fabric map


async def fabric_scan(msg: FabricScanRequest, diags: PackageOnDemand) -> FabricScanReply:
    """`ibnetdiscover -C hca -P port`, whole, or why there is no map."""
    started = time.monotonic()

    def failed(error: str) -> FabricScanReply:
        log.warning("fabric scan from %s port %d: %s", msg.hca, msg.port, error)
        return FabricScanReply(id=msg.id, error=error, took_ms=_ms_since(started))

    if bad := _single_word(msg.hca, "adapter"):
        return failed(bad)
    binary = (await diags.find(IBNETDISCOVER))[IBNETDISCOVER]
    if binary is None:
        return failed(diags.missing_words([IBNETDISCOVER]))
    ran = await run_bounded([binary, "-C", msg.hca, "-P", str(msg.port)], SCAN_TIMEOUT_S, SCAN_OUTPUT_CAP)
    command = f"`{IBNETDISCOVER} -C {msg.hca} -P {msg.port}`"
    if ran.not_started:
        return failed(ran.not_started)
    if ran.over_cap:
        return failed(
            f"{command} printed more than {_size(SCAN_OUTPUT_CAP)} and was stopped; no map is sent "
            "rather than part of one"
        )
    if ran.timed_out:
        return failed(f"{command} did not finish in {SCAN_TIMEOUT_S:g} s")
    if ran.returncode != 0:
        said = "; ".join([ln.strip() for ln in ran.stderr.splitlines() if ln.strip()][:3])
        return failed(f"{command} exited with status {ran.returncode}" + (f": {said}" if said else ""))
    return FabricScanReply(id=msg.id, output=ran.stdout, took_ms=_ms_since(started))


# --------------------------------------------------------------- fabric-test


async def fabric_test(msg: FabricTestRequest, perftest: PackageOnDemand) -> FabricTestReply:
    """One side of one rail: the server until its test is over (or no client came
    in time), or the client against ``msg.peer``, retried while the server is not
    listening yet."""
    started = time.monotonic()

    def reply(ran: Ran | None, gbps: float | None, error: str | None) -> FabricTestReply:
        if error:
            log.warning("fabric test (%s on %s port %d): %s", msg.role, msg.hca, msg.port, error)
        output = "\n".join(ran.lines(OUTPUT_LINES)) if ran is not None else None
        return FabricTestReply(id=msg.id, gbps=gbps, output=output or None, error=error, took_ms=_ms_since(started))

    binary = (await perftest.find(IB_WRITE_BW))[IB_WRITE_BW]
    if binary is None:
        return reply(None, None, perftest.missing_words([IB_WRITE_BW]))
    try:
        if msg.role == "server":
            argv = server_args(msg.hca, msg.port, msg.gid_index, msg.seconds, msg.tcp_port, binary=binary)
        elif not msg.peer:
            return reply(None, None, "the client side of a fabric test needs the server's address (peer)")
        else:
            argv = client_args(msg.hca, msg.port, msg.gid_index, msg.peer, msg.seconds, msg.tcp_port, binary=binary)
    except FabricBenchError as exc:
        return reply(None, None, str(exc))
    limit = msg.seconds + TEST_MARGIN_S
    ran = await run_bounded(argv, limit, BENCH_OUTPUT_CAP)
    outcome = _outcome(ran)
    retries = 0
    while msg.role == "client" and outcome.retryable and retries < CLIENT_RETRIES:
        retries += 1
        await asyncio.sleep(CLIENT_RETRY_S)
        ran = await run_bounded(argv, limit, BENCH_OUTPUT_CAP)
        outcome = _outcome(ran)
    if retries:
        log.info(
            "fabric test client on %s: %d retr%s while the server came up",
            msg.hca,
            retries,
            "ies" if retries > 1 else "y",
        )
    if ran.not_started:
        return reply(ran, None, ran.not_started)
    if ran.timed_out and outcome.bw_average_gbps is None:
        if msg.role == "server":
            error = f"no client connected within {limit:g} s, so ib_write_bw's server was stopped"
        else:
            error = f"ib_write_bw did not finish within {limit:g} s and was stopped"
        return reply(ran, None, error)
    if ran.over_cap:
        return reply(ran, None, f"ib_write_bw printed more than {_size(BENCH_OUTPUT_CAP)} and was stopped")
    if outcome.bw_average_gbps is None:
        error = outcome.error or "ib_write_bw printed a result with no BW average column"
        if outcome.retryable:
            error += f" ({CLIENT_RETRIES} retries, {CLIENT_RETRY_S:g} s apart)"
        return reply(ran, None, error)
    return reply(ran, outcome.bw_average_gbps, None)


def _outcome(ran: Ran) -> BwOutcome:
    return parse_ib_write_bw(ran.stdout, ran.stderr)
