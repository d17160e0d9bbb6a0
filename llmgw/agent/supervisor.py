"""Engine processes: start, watch, stop, and adopt them again after the agent restarts.

An engine must outlive the agent that started it (an agent upgrade or crash must
not cost every model on the node a reload), so:

* each engine leads its own session and process group, and is stopped by
  signalling the whole group, because engines fork workers that hold GPU memory
  and outlive a signal sent to the leader alone;
* its output goes to a file it appends to, never to a pipe the agent holds: a
  pipe would break (and kill the engine with SIGPIPE) when the agent dies;
* what was started is recorded on disk (spec, fingerprint, pid, start time) so a
  restarted agent can adopt it: watched by polling /proc, since it is no longer
  our child, and health-checked in the background like a fresh engine;
* a pid alone proves nothing (pids are reused and a zombie still answers
  ``kill(pid, 0)``), so identity is the pid plus its start time from
  ``/proc/<pid>/stat`` and the boot id, plus its command line or its marker
  environment.

Linux only: /proc is the source of truth for identity, zombies, and load.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import functools
import hashlib
import inspect
import logging
import os
import re
import signal
import subprocess
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from llmgw.errors import LlmgwError
from llmgw.files import write_atomic
from llmgw.filewatch import FileWrites
from llmgw.protocol import ShardState

log = logging.getLogger("llmgw.agent.supervisor")

# Environment markers set in every process the supervisor starts. /proc/<pid>/environ
# keeps them for the process's life, so a restarted agent can recognise engines
# nobody recorded (it died between spawning and writing the record) and tell
# them apart from engines belonging to another agent on the same machine.
ENV_SHARD_ID = "LLMGW_SHARD_ID"
ENV_STATE_DIR = "LLMGW_STATE_DIR"

RECORD_VERSION = 1
_SHARD_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_MAX_LINE = 8192  # longer lines are cut in the tail, never in the file


class SupervisorError(LlmgwError):
    """A request the supervisor cannot carry out; the message is for a person."""


class UnknownShardError(SupervisorError, KeyError):
    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "unknown shard"


class Role(StrEnum):
    LEADER = "leader"  # serves HTTP; ready when /health and /v1/models say so
    WORKER = "worker"  # a rank that serves nothing; judged by staying alive


class Sidecar(BaseModel):
    """A process that lives as long as the shard and dies with it (a Ray head, a join)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    argv: list[str] = Field(min_length=1)
    env: dict[str, str] | None = Field(
        default=None, description="Set on the inherited environment; None: the shard's env."
    )

    @field_validator("argv")
    @classmethod
    def _check_argv(cls, v: list[str]) -> list[str]:
        _check_command(v, "sidecar")
        return v

    @field_validator("env")
    @classmethod
    def _check_env(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        return v if v is None else _check_env_vars(v)


class ShardSpec(BaseModel):
    """What to run for one shard. Kept on disk verbatim, so fields are only ever added."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    shard_id: str
    argv: list[str] = Field(min_length=1)
    env: dict[str, str] = Field(
        default_factory=dict,
        repr=False,  # may hold the engine's key
        description="Set on top of the inherited environment.",
    )
    inherit_env: bool = Field(default=True, description="Start from the agent's environment (else from env alone).")
    cwd: str | None = None
    role: Role = Role.LEADER
    base_url: str | None = Field(default=None, description="Leader only: /health and /v1/models are asked under it.")
    model: str | None = Field(default=None, description="The id /v1/models must list; None accepts any.")
    sidecars: list[Sidecar] = Field(
        default_factory=list, description="Started first, killed with the shard; a bare argv list is accepted."
    )
    wait_for: str | None = Field(
        default=None,
        description="host:port that must accept connections before the engine starts (after the sidecars).",
    )
    wait_timeout: float | None = Field(default=None, gt=0, description="Default: the supervisor's rendezvous_timeout.")
    stop_timeout: float | None = Field(default=None, ge=0, description="Default: the supervisor's stop_timeout.")
    meta: dict[str, Any] = Field(
        default_factory=dict, repr=False, description="Opaque to the supervisor; kept with the record."
    )
    api_key: str | None = Field(
        default=None,
        repr=False,
        description="The engine's key: sent on its readiness probes, and masked wherever the supervisor shows a "
        "command line or the engine's output. Giving it to the engine is the argv's or env's job.",
    )

    def __repr_args__(self) -> Iterable[tuple[str | None, Any]]:
        # An engine that takes its key only as a flag (SGLang) has it in argv.
        for name, value in super().__repr_args__():
            yield name, [_mask(a, (self.api_key,)) for a in value] if name == "argv" and self.api_key else value

    @field_validator("shard_id")
    @classmethod
    def _check_id(cls, v: str) -> str:
        # The id names files under the state directory.
        if not _SHARD_ID_RE.match(v) or v in (".", ".."):
            raise ValueError(
                f"shard id {v!r} must be 1-128 letters, digits, '.', '_' or '-', not starting with a symbol"
            )
        return v

    @field_validator("argv")
    @classmethod
    def _check_argv(cls, v: list[str]) -> list[str]:
        _check_command(v, "argv")
        return v

    @field_validator("sidecars", mode="before")
    @classmethod
    def _bare_argv(cls, v: Any) -> Any:
        if isinstance(v, list):
            out = []
            for i, item in enumerate(v):
                if isinstance(item, (list, tuple)):
                    if not item:
                        raise ValueError(f"sidecar {i} has an empty command")
                    item = {"argv": list(item)}
                out.append(item)
            return out
        return v

    @field_validator("env")
    @classmethod
    def _check_env(cls, v: dict[str, str]) -> dict[str, str]:
        return _check_env_vars(v)

    @field_validator("base_url")
    @classmethod
    def _check_url(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^https?://[^/\s]+", v):
            raise ValueError(f"base_url {v!r} must be an http:// or https:// address")
        return v.rstrip("/") if v else v

    @field_validator("wait_for")
    @classmethod
    def _check_wait_for(cls, v: str | None) -> str | None:
        if v is not None:
            split_host_port(v)
        return v

    @model_validator(mode="after")
    def _check_role(self) -> ShardSpec:
        if self.role is Role.LEADER and not self.base_url:
            raise ValueError("a leader needs base_url: it is ready only when its /health and /v1/models answer")
        if self.role is Role.WORKER and self.base_url:
            raise ValueError("a worker is judged by staying alive; base_url is for leaders only")
        return self

    @property
    def fingerprint(self) -> str:
        """sha256 of what makes the command line: argv, the explicit environment, sidecars.

        The inherited environment is left out: it differs between an agent and
        its restarted self without the engine being any different.
        """
        body = orjson.dumps(
            {
                "argv": self.argv,
                "env": self.env,
                "cwd": self.cwd,
                "sidecars": [{"argv": s.argv, "env": s.env} for s in self.sidecars],
            },
            option=orjson.OPT_SORT_KEYS,
        )
        return hashlib.sha256(body).hexdigest()


def _check_env_vars(v: dict[str, str]) -> dict[str, str]:
    for k, val in v.items():
        if not _ENV_KEY_RE.match(k):
            raise ValueError(f"environment name {k!r} is not a valid variable name")
        if "\0" in val:
            raise ValueError(f"environment value of {k} contains a NUL byte")
        if k in (ENV_SHARD_ID, ENV_STATE_DIR):
            raise ValueError(f"{k} is set by the supervisor itself")
    return v


def _check_command(argv: list[str], what: str) -> None:
    if not argv[0]:
        raise ValueError(f"{what}: the program name is empty")
    for a in argv:
        if "\0" in a:
            raise ValueError(f"{what}: argument {a!r} contains a NUL byte")


def split_host_port(addr: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port), with an error a person can act on."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{addr!r} is not host:port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        p = int(port)
    except ValueError:
        raise ValueError(f"{addr!r}: port {port!r} is not a number") from None
    if not 0 < p < 65536:
        raise ValueError(f"{addr!r}: port {p} is out of range")
    return host, p


@dataclass(frozen=True)
class SupervisedShard:
    """A shard as the supervisor sees it at one moment; the agent builds the wire
    ``ShardStatus`` and ``RunningShard`` from it."""

    shard_id: str
    state: ShardState
    detail: str  # words for a person: what is happening or what went wrong
    pid: int | None
    fingerprint: str
    adopted: bool = False  # started by an earlier agent and taken over by this one
    exit: str | None = None  # how the engine ended, in words
    tail: tuple[str, ...] = ()  # the last lines of output, sent with a failure
    since: float = 0.0  # wall-clock time of the last state change
    meta: Mapping[str, Any] = field(default_factory=dict, repr=False)  # the agent's start request: holds the key

    def to_dict(self) -> dict[str, Any]:
        return {
            "shard_id": self.shard_id,
            "state": self.state.value,
            "detail": self.detail,
            "pid": self.pid,
            "fingerprint": self.fingerprint,
            "adopted": self.adopted,
            "exit": self.exit,
            "tail": list(self.tail),
            "since": self.since,
            "meta": dict(self.meta),
        }


@dataclass(frozen=True)
class ShardUsage:
    cpu_cores: float | None  # None on the first sample: a rate needs two readings
    rss_bytes: int
    processes: int


@dataclass(frozen=True)
class SweptProcess:
    pid: int
    shard_id: str
    command: str


@dataclass
class AdoptReport:
    adopted: list[str] = field(default_factory=list)
    # (shard id, why its record was dropped): dead, a zombie, a different process, corrupt
    dropped: list[tuple[str, str]] = field(default_factory=list)
    # adopted shards whose recorded fingerprint differs from the desired spec given
    stale: list[str] = field(default_factory=list)
    killed: list[SweptProcess] = field(default_factory=list)


# ------------------------------------------------------------------ /proc


@dataclass(frozen=True)
class ProcStat:
    pid: int
    state: str
    ppid: int
    pgrp: int
    jiffies: int  # utime + stime
    start_time: int  # clock ticks after boot; with the pid, a process's identity
    rss_pages: int


def read_stat(pid: int, proc: str = "/proc") -> ProcStat | None:
    try:
        with open(f"{proc}/{pid}/stat", "rb") as f:
            raw = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    return parse_stat(raw)


def parse_stat(raw: str) -> ProcStat | None:
    # comm (field 2) is in parentheses and may itself contain spaces and ')'.
    head, sep, tail = raw.rpartition(")")
    if not sep:
        return None
    try:
        pid = int(head.split("(", 1)[0])
        f = tail.split()
        # f[0] is field 3 (state); field n is f[n - 3].
        return ProcStat(
            pid=pid,
            state=f[0],
            ppid=int(f[1]),
            pgrp=int(f[2]),
            jiffies=int(f[11]) + int(f[12]),
            start_time=int(f[19]),
            rss_pages=int(f[21]),
        )
    except (ValueError, IndexError):
        return None


def _all_pids(proc: str = "/proc") -> list[int]:
    try:
        return [int(n) for n in os.listdir(proc) if n.isdigit()]
    except OSError:
        return []


def read_cmdline(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    parts = raw.split(b"\0")
    if parts and parts[-1] == b"":
        parts.pop()
    return [os.fsdecode(p) for p in parts]


def read_environ(pid: int) -> dict[str, str] | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    env: dict[str, str] = {}
    for item in raw.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep:
            env[os.fsdecode(k)] = os.fsdecode(v)
    return env


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def alive(pid: int, start_time: int | None = None) -> bool:
    """Is this process running (a zombie is dead), and still the one that started at start_time?"""
    st = read_stat(pid)
    if st is None or st.state in ("Z", "X", "x"):
        return False
    return start_time is None or st.start_time == start_time


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in a process group."""
    out = []
    for pid in _all_pids():
        st = read_stat(pid)
        if st and st.pgrp == pgid and st.state not in ("Z", "X", "x"):
            out.append(pid)
    return out


def describe_wait_status(status: int) -> str:
    code = os.waitstatus_to_exitcode(status)
    return describe_exit_code(code)


def describe_exit_code(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name} (signal {-code})"
    return f"exited with status {code}"


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


# ------------------------------------------------------------------ processes

# Children of a closed supervisor keep running (that is the point), but their
# Popen objects must not be garbage-collected: Popen.__del__ warns that the
# process is still running. They are polled here so they are reaped once they end.
_DETACHED: list[subprocess.Popen] = []


def _reap_detached() -> None:
    _DETACHED[:] = [p for p in _DETACHED if p.poll() is None]


class _Proc:
    """One process of a shard (the engine or a sidecar), ours or adopted.

    ``exited`` resolves to words describing the end, once, for every waiter.
    """

    def __init__(
        self, pid: int, start_time: int, argv: list[str], log_path: Path, label: str, popen: subprocess.Popen | None
    ) -> None:
        self.pid = pid
        self.start_time = start_time
        self.argv = argv
        self.log_path = log_path
        self.label = label  # "" for the engine, "sidecar N" for sidecars
        self.popen = popen
        self.exited: asyncio.Future[str] = asyncio.get_running_loop().create_future()  # words
        self._pidfd: int | None = None
        self._poller: asyncio.Task | None = None

    @property
    def adopted(self) -> bool:
        return self.popen is None

    def watch(self, poll_interval: float) -> None:
        loop = asyncio.get_running_loop()
        if self.popen is not None:
            try:
                # pidfd: readable the moment the child exits, no polling and no
                # SIGCHLD handler that could reap someone else's children.
                self._pidfd = os.pidfd_open(self.pid)
                loop.add_reader(self._pidfd, self._child_exited)
                return
            except (OSError, AttributeError):  # an old kernel or Python without pidfd
                self._pidfd = None
        self._poller = asyncio.create_task(self._poll(poll_interval))

    def _child_exited(self) -> None:
        self._close_pidfd()
        self.settle()

    async def _poll(self, interval: float) -> None:
        while not self.settle():  # noqa: ASYNC110 — no pidfd here: another process's end has no event to await
            await asyncio.sleep(interval)

    def running(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None  # reaps it if it has ended
        return alive(self.pid, self.start_time)

    def settle(self) -> bool:
        """Resolve ``exited`` if the process has ended; True once it has."""
        if self.exited.done():
            return True
        if self.running():
            return False
        if self.popen is not None:
            words = describe_exit_code(self.popen.returncode)
        else:
            words = f"process {self.pid} ended (its exit status is unknown: an earlier agent started it)"
        self.exited.set_result(words)
        return True

    def _close_pidfd(self) -> None:
        if self._pidfd is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._pidfd)
            with contextlib.suppress(OSError):
                os.close(self._pidfd)
            self._pidfd = None

    def release(self) -> None:
        """Stop watching without touching the process (the shard is over, or the supervisor closes)."""
        self._close_pidfd()
        if self._poller is not None:
            self._poller.cancel()
        if self.popen is not None and self.popen.poll() is None:
            _DETACHED.append(self.popen)
        if not self.exited.done():
            self.exited.cancel()

    def signal(self, sig: int) -> None:
        # The whole group: the process leads its own. Once the leader has gone
        # the group id stays reserved while any member holds it, so the group is
        # still safe to signal; with no member left the number may be reused.
        if not self.running() and not group_members(self.pid):
            return
        _signal_group(self.pid, sig)

    def gone(self) -> bool:
        """The process has ended and nothing is left in its group."""
        return not self.running() and not group_members(self.pid)

    def record(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "start_time": self.start_time,
            "argv": self.argv,
            "log": self.log_path.name,
            "label": self.label,
        }


# ------------------------------------------------------------------ logs


class _LogFollower:
    """Reads what a process appends to its log file into the shard's tail.

    The file is capped by copy-and-truncate: the process keeps appending to the
    same open file (O_APPEND, so after truncation it writes at the new end) and
    the old content moves to ``<name>.1``. What arrives during the copy is read
    before truncating, so only bytes written in the instant between that last
    read and the truncation can be lost; a pipe through the agent would lose
    nothing but would kill the engine along with the agent.
    """

    def __init__(self, path: Path, prefix: str, max_bytes: int, hide: tuple[str, ...] = ()) -> None:
        self.path = path
        self.prefix = prefix
        self.max_bytes = max_bytes
        self.hide = hide
        self.offset = 0
        self._partial = b""
        self._skip_partial = False  # the first line read is cut off; drop it

    def start_at_end(self, keep_bytes: int = 0) -> _LogFollower:
        """Read only what comes next, or the last ``keep_bytes`` too (after adoption:
        the engine's recent output, which is in the file, not in any memory)."""
        try:
            size = self.path.stat().st_size
        except OSError:
            size = 0
        self.offset = max(0, size - keep_bytes)
        self._skip_partial = 0 < self.offset < size
        return self

    def read(self, limit: int = 1 << 20) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < self.offset:  # truncated by someone else
                    self.offset = 0
                    self._partial = b""
                f.seek(self.offset)
                data = f.read(limit)
        except OSError:
            return []
        self.offset += len(data)
        lines = self._lines(data)
        if self.offset > self.max_bytes and len(data) < limit:
            lines += self._rotate()
        return lines

    def _lines(self, data: bytes) -> list[str]:
        if self._skip_partial and data:
            nl = data.find(b"\n")
            data = data[nl + 1 :] if nl >= 0 else b""
            self._skip_partial = nl < 0
        data = self._partial + data
        raw_lines = data.split(b"\n")
        self._partial = raw_lines.pop()
        if len(self._partial) > _MAX_LINE * 4:  # a runaway line without newlines
            raw_lines.append(self._partial)
            self._partial = b""
        out = []
        for raw in raw_lines:
            text = _mask(raw.decode("utf-8", "replace").rstrip("\r"), self.hide)
            if len(text) > _MAX_LINE:
                text = text[:_MAX_LINE] + " [cut]"
            out.append(self.prefix + text)
        return out

    def flush_partial(self) -> list[str]:
        if not self._partial:
            return []
        text = _mask(self._partial.decode("utf-8", "replace"), self.hide)[:_MAX_LINE]
        self._partial = b""
        return [self.prefix + text]

    def _rotate(self) -> list[str]:
        old = self.path.with_name(self.path.name + ".1")
        try:
            with open(self.path, "rb") as src, open(old, "wb") as dst:
                left = self.offset
                while left > 0 and (chunk := src.read(min(left, 1 << 20))):
                    dst.write(chunk)
                    left -= len(chunk)
                # The slow part is done; take what arrived meanwhile and truncate at once.
                src.seek(self.offset)
                extra = src.read()
                os.truncate(self.path, 0)
                dst.write(extra)
        except OSError as exc:
            log.warning("could not rotate %s: %s", self.path, exc)
            return []
        self.offset = 0
        return self._lines(extra)


# ------------------------------------------------------------------ shards


class _Shard:
    def __init__(self, spec: ShardSpec, tail_lines: int, adopted: bool = False) -> None:
        self.spec = spec
        self.fingerprint = spec.fingerprint
        # Masked in every line shown: an engine may print its own arguments (SGLang does).
        self.secrets: tuple[str, ...] = (spec.api_key,) if spec.api_key else ()
        self.state = ShardState.PENDING
        self.detail = "accepted"
        self.since = time.time()
        self.exit: str | None = None
        self.adopted = adopted
        self.engine: _Proc | None = None
        self.sidecars: list[_Proc] = []
        self.tail: deque[str] = deque(maxlen=tail_lines)
        self.followers: list[_LogFollower] = []
        self.run_task: asyncio.Task | None = None
        self.log_task: asyncio.Task | None = None
        self.stop_task: asyncio.Task | None = None
        self.stopping = False

    def procs(self) -> list[_Proc]:
        return [*self.sidecars, *([self.engine] if self.engine else [])]


OnChange = Callable[[SupervisedShard], "Awaitable[None] | None"]


class Supervisor:
    """Runs engine processes for one agent, keeping what it started in ``state_dir``.

    ``state_dir/shards/<id>.json`` holds each running shard's record and
    ``state_dir/logs/<id>.log`` its output. One supervisor per state
    directory at a time (an exclusive lock, released by the kernel even when
    the agent is SIGKILLed).
    """

    def __init__(
        self,
        state_dir: Path | str,
        *,
        on_change: OnChange | None = None,
        tail_lines: int = 512,
        failure_tail_lines: int = 100,
        log_max_bytes: int = 16 << 20,
        stop_timeout: float = 60.0,
        rendezvous_timeout: float = 600.0,
        health_interval: float = 2.0,
        health_first: float = 0.05,
        http_timeout: float = 5.0,
        poll_interval: float = 0.5,
        log_interval: float = 0.25,
        worker_settle: float = 2.0,
        sweep_grace: float = 5.0,
    ) -> None:
        if tail_lines < 1 or failure_tail_lines < 0 or log_max_bytes < 1024:
            raise ValueError("tail_lines must be >= 1, failure_tail_lines >= 0 and log_max_bytes >= 1024")
        self.state_dir = Path(state_dir).resolve()
        self.shards_dir = self.state_dir / "shards"
        self.logs_dir = self.state_dir / "logs"
        for d in (self.shards_dir, self.logs_dir):
            try:
                d.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise SupervisorError(f"cannot create {d}: {exc.strerror}") from exc
        self.on_change = on_change
        self.tail_lines = tail_lines
        self.failure_tail_lines = failure_tail_lines
        self.log_max_bytes = log_max_bytes
        self.stop_timeout = stop_timeout
        self.rendezvous_timeout = rendezvous_timeout
        self.health_interval = health_interval
        self.health_first = health_first
        self.http_timeout = http_timeout
        self.poll_interval = poll_interval
        self.log_interval = log_interval
        self.worker_settle = worker_settle
        self.sweep_grace = sweep_grace
        self._shards: dict[str, _Shard] = {}
        self._boot_id = boot_id()
        self._session: aiohttp.ClientSession | None = None
        self._events: asyncio.Queue[SupervisedShard] | None = None
        self._dispatcher: asyncio.Task | None = None
        self._usage_prev: tuple[float, dict[str, int]] | None = None
        self._closed = False
        self._lock_fd = self._lock()

    # ---------------------------------------------------------- public

    async def start(self, spec: ShardSpec) -> SupervisedShard:
        """Start a shard; returns once its processes are spawned (or it waits for its leader).

        Starting a shard that already runs with the same fingerprint returns its
        status (the control plane repeats itself after reconnecting); with a
        different one it is refused: stop it first.
        """
        self._check_open()
        _reap_detached()
        if not isinstance(spec, ShardSpec):
            raise TypeError("start() takes a ShardSpec")
        old = self._shards.get(spec.shard_id)
        if old is not None and old.state.running:
            if old.fingerprint == spec.fingerprint:
                return self._status(old)
            raise SupervisorError(f"shard {spec.shard_id} already runs with a different command line; stop it first")
        if old is not None:
            self._cancel_tasks(old)
        sh = _Shard(spec, self.tail_lines)
        self._shards[spec.shard_id] = sh
        sh.followers.append(
            _LogFollower(self._engine_log(spec.shard_id), "", self.log_max_bytes, sh.secrets).start_at_end()
        )
        self._note(sh, f"llmgw: starting shard {spec.shard_id}: {_quote(spec.argv, sh.secrets)}")
        self._emit(self._status(sh))
        sh.log_task = asyncio.create_task(self._follow_logs(sh))
        if not self._launch_sidecars(sh):
            return self._status(sh)
        if spec.wait_for is None and not self._launch_engine(sh):
            return self._status(sh)
        sh.run_task = asyncio.create_task(self._run(sh))
        return self._status(sh)

    async def stop(self, shard_id: str, timeout: float | None = None) -> SupervisedShard:
        """SIGTERM to the shard's process groups, SIGKILL after the stop timeout."""
        sh = self._shards.get(shard_id)
        if sh is None:
            raise UnknownShardError(f"no shard {shard_id!r} on this node")
        if not sh.state.running:
            return self._status(sh)
        if sh.stop_task is None:
            sh.stop_task = asyncio.create_task(self._stop(sh, timeout))
        await asyncio.shield(sh.stop_task)
        return self._status(sh)

    async def stop_all(self, timeout: float | None = None) -> None:
        running = [s.spec.shard_id for s in self._shards.values() if s.state.running]
        await asyncio.gather(*(self.stop(i, timeout) for i in running))

    async def adopt(self, desired: Mapping[str, ShardSpec] | None = None) -> AdoptReport:
        """Take over the engines an earlier agent left running, then sweep unknown ones.

        Returns at once; adopted leaders are health-checked in the background
        (a slow check must not delay registration). ``desired``, when the caller
        knows it, marks adopted shards whose command line no longer matches.
        """
        self._check_open()
        report = AdoptReport()
        for path in sorted(self.shards_dir.iterdir()):
            if ".json.tmp" in path.name:  # an interrupted atomic write
                path.unlink(missing_ok=True)
                continue
            if not path.name.endswith(".json"):
                continue
            shard_id = path.name[: -len(".json")]
            if shard_id in self._shards:
                continue
            reason = self._adopt_one(path, shard_id, report)
            if reason is not None:
                log.info("shard %s not adopted: %s", shard_id, reason)
                report.dropped.append((shard_id, reason))
                path.unlink(missing_ok=True)
        if desired:
            for sid in report.adopted:
                want = desired.get(sid)
                if want is not None and want.fingerprint != self._shards[sid].fingerprint:
                    report.stale.append(sid)
        report.killed = await self.sweep()
        return report

    async def sweep(self) -> list[SweptProcess]:
        """Kill processes marked as started from this state directory that nothing accounts for.

        They hold ports and GPU memory nobody can describe (an agent that died
        between spawning and recording, a record lost). Engines of other
        agents (another state directory) are never touched.
        """
        self._check_open()
        me = os.getpid()
        known: set[int] = set()
        for sh in self._shards.values():
            if sh.state.running:
                known.update(p.pid for p in sh.procs())
        stats = {pid: st for pid in _all_pids() if (st := read_stat(pid)) is not None}

        def accounted(st: ProcStat) -> bool:
            if st.pgrp in known or st.pid in known:
                return True
            seen, p = 0, st.ppid  # a descendant of a known engine that made its own group
            while p > 1 and seen < 64:
                if p in known:
                    return True
                parent = stats.get(p)
                p, seen = (parent.ppid if parent else 0), seen + 1
            return False

        victims: list[tuple[ProcStat, SweptProcess]] = []
        for pid, st in stats.items():
            if pid == me or st.state in ("Z", "X", "x") or accounted(st):
                continue
            env = read_environ(pid)
            if not env or env.get(ENV_STATE_DIR) != str(self.state_dir) or ENV_SHARD_ID not in env:
                continue
            cmd = _quote(read_cmdline(pid) or [])
            victims.append((st, SweptProcess(pid, env[ENV_SHARD_ID], cmd)))
        if not victims:
            return []
        for st, v in victims:
            log.warning("killing pid %d (shard %s), an engine nothing accounts for: %s", v.pid, v.shard_id, v.command)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(st.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.sweep_grace
        while time.monotonic() < deadline and any(alive(st.pid, st.start_time) for st, _ in victims):  # noqa: ASYNC110 — not our children: no event tells of their end
            await asyncio.sleep(0.05)
        for st, _ in victims:
            if alive(st.pid, st.start_time):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(st.pid, signal.SIGKILL)
        _reap_detached()
        return [v for _, v in victims]

    def status(self, shard_id: str) -> SupervisedShard:
        sh = self._shards.get(shard_id)
        if sh is None:
            raise UnknownShardError(f"no shard {shard_id!r} on this node")
        return self._status(sh)

    def statuses(self) -> list[SupervisedShard]:
        return [self._status(sh) for sh in self._shards.values()]

    def tail(self, shard_id: str, lines: int = 200) -> list[str]:
        sh = self._shards.get(shard_id)
        if sh is None:
            raise UnknownShardError(f"no shard {shard_id!r} on this node")
        for fl in sh.followers:  # include what arrived since the last poll
            sh.tail.extend(fl.read())
        n = max(0, lines)
        return list(sh.tail)[-n:] if n else []

    def is_stale(self, spec: ShardSpec) -> bool:
        """Does the running shard of this id run a different command line than ``spec``?"""
        sh = self._shards.get(spec.shard_id)
        return sh is not None and sh.state.running and sh.fingerprint != spec.fingerprint

    def forget(self, shard_id: str) -> None:
        """Drop a finished shard's status and its log files."""
        sh = self._shards.get(shard_id)
        if sh is not None and sh.state.running:
            raise SupervisorError(f"shard {shard_id} is still running; stop it first")
        self._shards.pop(shard_id, None)
        for pattern in (
            f"{shard_id}.log",
            f"{shard_id}.log.1",
            f"{shard_id}.sidecar*.log",
            f"{shard_id}.sidecar*.log.1",
        ):
            for p in self.logs_dir.glob(pattern):
                p.unlink(missing_ok=True)

    def usage(self) -> dict[str, ShardUsage]:
        """CPU cores and resident memory per running shard, summed over its process groups.

        CPU is a rate, so the first call reports ``cpu_cores=None``.
        """
        groups: dict[int, str] = {}
        for sid, sh in self._shards.items():
            if sh.state.running:
                for p in sh.procs():
                    groups[p.pid] = sid
        jiffies: dict[str, int] = dict.fromkeys(groups.values(), 0)
        rss: dict[str, int] = dict.fromkeys(jiffies, 0)
        count: dict[str, int] = dict.fromkeys(jiffies, 0)
        for pid in _all_pids():
            st = read_stat(pid)
            if st is None or st.pgrp not in groups or st.state in ("Z", "X", "x"):
                continue
            sid = groups[st.pgrp]
            jiffies[sid] += st.jiffies
            rss[sid] += st.rss_pages
            count[sid] += 1
        now = time.monotonic()
        hz = os.sysconf("SC_CLK_TCK")
        page = os.sysconf("SC_PAGE_SIZE")
        prev = self._usage_prev
        self._usage_prev = (now, jiffies)
        out = {}
        for sid in jiffies:
            cores = None
            if prev is not None and sid in prev[1] and now > prev[0]:
                # A member that exited takes its CPU time with it; never report negative use.
                cores = max(0, jiffies[sid] - prev[1][sid]) / hz / (now - prev[0])
            out[sid] = ShardUsage(cpu_cores=cores, rss_bytes=rss[sid] * page, processes=count[sid])
        return out

    async def wait(self, shard_id: str, *states: ShardState, timeout: float = 60.0) -> SupervisedShard:
        """Wait until the shard is in one of ``states`` (or has finished); for callers and tests."""
        want = set(states) or {ShardState.READY}
        deadline = time.monotonic() + timeout
        while True:
            st = self.status(shard_id)
            if st.state in want or not st.state.running:
                return st
            if time.monotonic() >= deadline:
                raise TimeoutError(f"shard {shard_id} is still {st.state.value} ({st.detail}) after {timeout}s")
            await asyncio.sleep(0.02)

    async def close(self) -> None:
        """Stop supervising and leave every engine running, recorded for the next agent."""
        if self._closed:
            return
        self._closed = True
        for sh in self._shards.values():
            for fl in sh.followers:
                sh.tail.extend(fl.read())
            self._cancel_tasks(sh)
            for p in sh.procs():
                p.release()
        if self._events is not None and self._dispatcher is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._events.join(), 2.0)
            self._dispatcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._dispatcher
        if self._session is not None:
            await self._session.close()
        os.close(self._lock_fd)

    async def __aenter__(self) -> Supervisor:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---------------------------------------------------------- launching

    def _env(self, sh: _Shard, own: dict[str, str]) -> dict[str, str]:
        env = dict(os.environ) if sh.spec.inherit_env else {}
        env.update(own)
        env[ENV_SHARD_ID] = sh.spec.shard_id
        env[ENV_STATE_DIR] = str(self.state_dir)
        return env

    def _launch_sidecars(self, sh: _Shard) -> bool:
        """Spawn the sidecars; False (and the shard failed) if one cannot be.

        Spawning and registering are synchronous on purpose here and in
        _launch_engine: nothing runs in between, so a sweep can never take a
        process being started for an unknown one.
        """
        spec = sh.spec
        if spec.cwd is not None and not os.path.isdir(spec.cwd):
            return self._cannot_start(sh, f"could not start: the working directory {spec.cwd} does not exist")
        for i, sc in enumerate(spec.sidecars):
            path = self.logs_dir / f"{spec.shard_id}.sidecar{i}.log"
            sh.followers.append(_LogFollower(path, f"[sidecar {i}] ", self.log_max_bytes, sh.secrets).start_at_end())
            env = self._env(sh, spec.env if sc.env is None else sc.env)
            try:
                p = self._spawn(sc.argv, env, spec.cwd, path, f"sidecar {i}")
            except OSError as exc:
                return self._cannot_start(
                    sh, f"could not start sidecar {i} ({exc.filename or sc.argv[0]}): {exc.strerror or exc}"
                )
            sh.sidecars.append(p)
            p.watch(self.poll_interval)
            p.exited.add_done_callback(functools.partial(self._sidecar_ended, sh, p))
        return True

    def _launch_engine(self, sh: _Shard) -> bool:
        spec = sh.spec
        try:
            sh.engine = self._spawn(spec.argv, self._env(sh, spec.env), spec.cwd, self._engine_log(spec.shard_id), "")
        except OSError as exc:
            return self._cannot_start(sh, f"could not start {exc.filename or spec.argv[0]}: {exc.strerror or exc}")
        sh.engine.watch(self.poll_interval)
        try:
            self._write_record(sh)
        except OSError as exc:
            # Without a record a restarted agent would sweep the engine; say so, keep serving.
            log.error("shard %s: could not write its record: %s", spec.shard_id, exc)
            self._note(sh, f"llmgw: could not record this shard ({exc}); a restarted agent will not adopt it")
        self._set(sh, ShardState.STARTING, f"process {sh.engine.pid} started")
        return True

    def _cannot_start(self, sh: _Shard, words: str) -> bool:
        for p in sh.sidecars:
            p.signal(signal.SIGKILL)
        self._note(sh, f"llmgw: {words}")
        self._fail(sh, words)
        return False

    def _spawn(self, argv: list[str], env: dict[str, str], cwd: str | None, log_path: Path, label: str) -> _Proc:
        out = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o640)
        try:
            popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=cwd,
                close_fds=True,
                start_new_session=True,  # its own session and group: signals to the agent's group miss it
            )
        finally:
            os.close(out)
        st = read_stat(popen.pid)
        # A process that already exited still has its stat until reaped; 0 only if /proc is unreadable.
        return _Proc(popen.pid, st.start_time if st else 0, list(argv), log_path, label, popen)

    def _engine_log(self, shard_id: str) -> Path:
        return self.logs_dir / f"{shard_id}.log"

    async def _run(self, sh: _Shard) -> None:
        spec = sh.spec
        if sh.engine is None:
            host, port = split_host_port(spec.wait_for or "")
            limit = spec.wait_timeout or self.rendezvous_timeout
            self._set(sh, ShardState.PENDING, f"waiting for the leader at {spec.wait_for} to accept connections")
            if not await _wait_port(host, port, limit):
                self._cannot_start(sh, f"the leader at {spec.wait_for} did not accept connections within {limit:g}s")
                return
            if sh.stopping or not self._launch_engine(sh):
                return
        engine = sh.engine
        assert engine is not None  # adopted, or just launched above
        ready = asyncio.create_task(self._readiness(sh))
        try:
            either: set[asyncio.Future[Any]] = {engine.exited, ready}
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            if not engine.exited.done():
                await asyncio.shield(engine.exited)
        finally:
            ready.cancel()
        if ready.done() and not ready.cancelled() and ready.exception() is not None:
            log.error("shard %s: health checking broke", sh.spec.shard_id, exc_info=ready.exception())
        if sh.stopping:
            return  # _stop reports the end
        words = engine.exited.result()
        for p in sh.sidecars:  # sidecars die with the shard
            p.signal(signal.SIGKILL)
        engine.signal(signal.SIGKILL)  # workers it forked must not keep the GPUs
        self._fail(sh, f"the engine {words}", exit=words)

    async def _readiness(self, sh: _Shard) -> None:
        if sh.spec.role is Role.WORKER:
            await asyncio.sleep(0 if sh.adopted else self.worker_settle)
            self._set(sh, ShardState.READY, "worker alive")
            return
        # A small model is ready within a fraction of a second, a large one after minutes: ask
        # often at first and back off (a quarter longer each time) to health_interval, so a long
        # load costs few probes. And ask at once whenever the engine writes to its output: an
        # engine says it listens, and then that it is ready, in a line, so readiness is learnt
        # from the engine within milliseconds rather than at the next timed probe.
        wait = min(self.health_first, self.health_interval)
        said = FileWrites.open(sh.engine.log_path) if sh.engine is not None else None
        try:
            while True:
                state, detail = await self._probe(sh)
                if state is ShardState.STARTING and sh.state is ShardState.LOADING:
                    state = ShardState.LOADING  # a busy engine timing out is not starting over
                self._set(sh, state, detail)
                if state is ShardState.READY:
                    return
                if said is None:
                    await asyncio.sleep(wait)
                else:
                    await said.wait(wait)
                wait = min(wait * 1.25, self.health_interval)
        finally:
            if said is not None:
                said.close()

    async def _probe(self, sh: _Shard) -> tuple[ShardState, str]:
        base = sh.spec.base_url
        session = self._http()
        # llama-server leaves /health open but wants the key for /v1/models; send it to both.
        auth = {"Authorization": f"Bearer {sh.spec.api_key}"} if sh.spec.api_key else None
        try:
            async with session.get(f"{base}/health", headers=auth) as r:
                if r.status != 200:
                    return ShardState.LOADING, f"{base}/health answered {r.status}; waiting for the model to load"
            async with session.get(f"{base}/v1/models", headers=auth) as r:
                if r.status != 200:
                    return ShardState.LOADING, f"{base}/v1/models answered {r.status}"
                body = await r.read()
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            return ShardState.STARTING, f"waiting for {base}/health to answer ({type(exc).__name__})"
        try:
            doc = orjson.loads(body)
            ids = [m.get("id") for m in doc.get("data", []) if isinstance(m, dict)]
        except (orjson.JSONDecodeError, AttributeError, TypeError):
            return ShardState.LOADING, f"{base}/v1/models did not answer with a model list"
        want = sh.spec.model
        if (want is None and ids) or (want is not None and want in ids):
            return ShardState.READY, f"serving {want or ids[0]}"
        listed = ", ".join(str(i) for i in ids) or "nothing"
        return ShardState.LOADING, f"{base}/v1/models lists {listed}, not {want or 'a model'} yet"

    def _sidecar_ended(self, sh: _Shard, p: _Proc, fut: asyncio.Future) -> None:
        if fut.cancelled() or sh.stopping or not sh.state.running:
            return
        self._note(sh, f"llmgw: {p.label} ({_quote(p.argv, sh.secrets)}) {fut.result()}")

    # ---------------------------------------------------------- stopping

    async def _stop(self, sh: _Shard, timeout: float | None) -> None:
        sh.stopping = True
        limit = (
            timeout
            if timeout is not None
            else (sh.spec.stop_timeout if sh.spec.stop_timeout is not None else self.stop_timeout)
        )
        if sh.engine is None and sh.run_task:  # still waiting for its leader
            sh.run_task.cancel()
        procs = sh.procs()
        if not procs:
            await self._finish(sh, ShardState.STOPPED, "stopped before it started")
            return
        for p in procs:
            p.signal(signal.SIGTERM)
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline and not all(p.gone() for p in procs):  # noqa: ASYNC110 — gone() counts the group's members too, whose end no event tells of
            await asyncio.sleep(0.05)
        detail = "stopped"
        if not all(p.gone() for p in procs):
            for p in procs:
                p.signal(signal.SIGKILL)
            detail = f"stopped with SIGKILL: it did not exit within {limit:g}s of SIGTERM"
            end = time.monotonic() + 10
            while time.monotonic() < end and not all(p.gone() for p in procs):  # noqa: ASYNC110 — polled, as above
                await asyncio.sleep(0.05)
            if not all(p.gone() for p in procs):  # uninterruptible sleep, usually a driver
                detail += "; some of its processes are still there after SIGKILL"
        for p in procs:
            p.settle()
        if sh.engine and sh.engine.exited.done() and not sh.engine.exited.cancelled():
            sh.exit = sh.engine.exited.result()
        if sh.run_task:
            sh.run_task.cancel()
        await self._finish(sh, ShardState.STOPPED, detail)

    async def _finish(self, sh: _Shard, state: ShardState, detail: str) -> None:
        self._drain_logs(sh)
        self._remove_record(sh.spec.shard_id)
        if sh.log_task:
            sh.log_task.cancel()
        for p in sh.procs():
            p.settle()
            p.release()
        self._set(sh, state, detail)

    def _fail(self, sh: _Shard, detail: str, exit: str | None = None) -> None:
        sh.exit = exit
        self._drain_logs(sh)
        self._remove_record(sh.spec.shard_id)
        if sh.log_task:
            sh.log_task.cancel()
        for p in sh.procs():
            p.release()
        log.warning("shard %s failed: %s", sh.spec.shard_id, detail)
        self._set(sh, ShardState.FAILED, detail)

    def _cancel_tasks(self, sh: _Shard) -> None:
        for t in (sh.run_task, sh.log_task, sh.stop_task):
            if t is not None and not t.done():
                t.cancel()

    # ---------------------------------------------------------- adoption

    def _adopt_one(self, path: Path, shard_id: str, report: AdoptReport) -> str | None:
        """Adopt the shard recorded at ``path``; the reason it was not, otherwise."""
        try:
            rec = orjson.loads(path.read_bytes())
            # Fields are only ever added: a newer agent's record must still be readable.
            spec = ShardSpec.model_validate({k: v for k, v in rec["spec"].items() if k in ShardSpec.model_fields})
            pid, start_time = int(rec["pid"]), int(rec["start_time"])
            sidecars = list(rec.get("sidecars", []))
            if spec.shard_id != shard_id:
                raise ValueError(f"it describes shard {spec.shard_id}")
        except (OSError, orjson.JSONDecodeError, ValidationError, KeyError, TypeError, ValueError) as exc:
            return f"its record is unreadable ({_short(exc)}); removed"
        if rec.get("boot_id") and self._boot_id and rec["boot_id"] != self._boot_id:
            return "the machine has restarted since it was started"
        st = read_stat(pid)
        if st is None:
            self._kill_identified(sidecars)
            return f"process {pid} is gone"
        if st.state in ("Z", "X", "x"):
            self._kill_identified(sidecars)
            return f"process {pid} has exited (a zombie nobody reaped)"
        if st.start_time != start_time:
            return f"pid {pid} now belongs to another process (its start time differs); left alone"
        if not _same_program(pid, spec.argv, shard_id, str(self.state_dir)):
            return f"pid {pid} runs a different command line than recorded; left alone"
        sh = _Shard(spec, self.tail_lines, adopted=True)
        sh.fingerprint = str(rec.get("fingerprint") or spec.fingerprint)
        engine_log = self._engine_log(shard_id)
        sh.engine = _Proc(pid, start_time, spec.argv, engine_log, "", None)
        sh.followers.append(_LogFollower(engine_log, "", self.log_max_bytes, sh.secrets).start_at_end(64 << 10))
        for i, sc in enumerate(sidecars):
            try:
                spid, sstart, sargv = int(sc["pid"]), int(sc["start_time"]), list(sc["argv"])
            except (KeyError, TypeError, ValueError):
                continue
            if alive(spid, sstart) and _same_program(spid, sargv, shard_id, str(self.state_dir)):
                label = str(sc.get("label") or f"sidecar {i}")
                # The file name comes from disk: keep it to a plain name inside logs/.
                name = os.path.basename(str(sc.get("log") or f"{shard_id}.sidecar{i}.log"))
                lp = self.logs_dir / name
                sh.sidecars.append(_Proc(spid, sstart, sargv, lp, label, None))
                sh.followers.append(
                    _LogFollower(lp, f"[{label}] ", self.log_max_bytes, sh.secrets).start_at_end(16 << 10)
                )
        self._shards[shard_id] = sh
        self._note(sh, f"llmgw: adopted pid {pid} after an agent restart (output above is from the log file)")
        self._drain_logs(sh)
        for p in sh.procs():
            p.watch(self.poll_interval)
            if p.label:
                p.exited.add_done_callback(functools.partial(self._sidecar_ended, sh, p))
        self._set(sh, ShardState.STARTING, f"adopted process {pid}; checking it answers")
        with contextlib.suppress(OSError):
            self._write_record(sh)  # sidecars that died are dropped from it
        sh.log_task = asyncio.create_task(self._follow_logs(sh))
        sh.run_task = asyncio.create_task(self._run(sh))
        report.adopted.append(shard_id)
        return None

    def _kill_identified(self, sidecars: Iterable[dict]) -> None:
        # The engine is gone; its sidecars (a Ray head holding the port the next
        # replica needs) go with it, if they are still the processes recorded.
        for sc in sidecars:
            try:
                pid, start = int(sc["pid"]), int(sc["start_time"])
            except (KeyError, TypeError, ValueError):
                continue
            if alive(pid, start):
                _signal_group(pid, signal.SIGKILL)

    # ---------------------------------------------------------- records

    def _write_record(self, sh: _Shard) -> None:
        assert sh.engine is not None
        rec = {
            "version": RECORD_VERSION,
            "spec": sh.spec.model_dump(mode="json"),
            "fingerprint": sh.fingerprint,
            "pid": sh.engine.pid,
            "start_time": sh.engine.start_time,
            "boot_id": self._boot_id,
            "sidecars": [p.record() for p in sh.sidecars],
            "started_at": time.time(),
        }
        write_atomic(self.shards_dir / f"{sh.spec.shard_id}.json", orjson.dumps(rec, option=orjson.OPT_INDENT_2), 0o600)

    def _remove_record(self, shard_id: str) -> None:
        with contextlib.suppress(OSError):
            (self.shards_dir / f"{shard_id}.json").unlink(missing_ok=True)

    # ---------------------------------------------------------- logs and events

    async def _follow_logs(self, sh: _Shard) -> None:
        while True:
            for fl in sh.followers:
                sh.tail.extend(fl.read())
            await asyncio.sleep(self.log_interval)

    def _drain_logs(self, sh: _Shard) -> None:
        for fl in sh.followers:
            sh.tail.extend(fl.read(limit=1 << 24))
            sh.tail.extend(fl.flush_partial())

    def _note(self, sh: _Shard, line: str) -> None:
        """A line from the supervisor itself, appended to the engine's log file (where
        the follower picks it up for the tail), so the file tells the whole story."""
        try:
            fd = os.open(
                self._engine_log(sh.spec.shard_id), os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o640
            )
            try:
                os.write(fd, (line + "\n").encode())
            finally:
                os.close(fd)
        except OSError:
            sh.tail.append(line)

    def _set(self, sh: _Shard, state: ShardState, detail: str) -> None:
        changed = state is not sh.state
        sh.detail = detail
        if changed:
            sh.state = state
            sh.since = time.time()
            log.info("shard %s: %s (%s)", sh.spec.shard_id, state.value, detail)
            self._emit(self._status(sh))

    def _status(self, sh: _Shard) -> SupervisedShard:
        tail: tuple[str, ...] = ()
        if sh.state is ShardState.FAILED and self.failure_tail_lines:
            tail = tuple(list(sh.tail)[-self.failure_tail_lines :])
        return SupervisedShard(
            shard_id=sh.spec.shard_id,
            state=sh.state,
            detail=sh.detail,
            pid=sh.engine.pid if sh.engine else None,
            fingerprint=sh.fingerprint,
            adopted=sh.adopted,
            exit=sh.exit,
            tail=tail,
            since=sh.since,
            meta=sh.spec.meta,
        )

    def _emit(self, st: SupervisedShard) -> None:
        if self.on_change is None or self._closed:
            return
        if self._events is None:
            self._events = asyncio.Queue()
            self._dispatcher = asyncio.create_task(self._dispatch())
        self._events.put_nowait(st)

    async def _dispatch(self) -> None:
        # One consumer keeps the callback's view in order, and a slow callback
        # delays only other reports, never supervision.
        assert self._events is not None and self.on_change is not None
        while True:
            st = await self._events.get()
            try:
                res = self.on_change(st)
                if inspect.isawaitable(res):
                    await res
            except Exception:
                log.exception("shard status callback failed for %s", st.shard_id)
            finally:
                self._events.task_done()

    # ---------------------------------------------------------- misc

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.http_timeout),
                connector=aiohttp.TCPConnector(force_close=True),
            )
        return self._session

    def _check_open(self) -> None:
        if self._closed:
            raise SupervisorError("this supervisor is closed")

    def _lock(self) -> int:
        path = self.state_dir / "supervisor.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise SupervisorError(
                    f"{self.state_dir} is in use by another supervisor (pid {holder}); one agent per state directory"
                ) from None
            raise SupervisorError(f"cannot lock {path}: {exc.strerror}") from exc
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd


def _same_program(pid: int, argv: list[str], shard_id: str, state_dir: str) -> bool:
    """Is ``pid`` the recorded program: the same command line, or our marker for this shard?

    The marker covers engines that rewrite their process title (and so their
    /proc cmdline); the start time has already been checked by the caller.
    """
    if read_cmdline(pid) == argv:
        return True
    env = read_environ(pid) or {}
    return env.get(ENV_SHARD_ID) == shard_id and env.get(ENV_STATE_DIR) == state_dir


async def _wait_port(host: str, port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        try:
            _, w = await asyncio.wait_for(asyncio.open_connection(host, port), min(left, 5.0))
        except (TimeoutError, OSError):
            await asyncio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
            continue
        w.close()
        with contextlib.suppress(Exception):
            await w.wait_closed()
        return True


# Flags whose value is a secret, masked even in a command line read from /proc (the sweep's).
_SECRET_FLAGS = ("--api-key",)
_HIDDEN = "[hidden]"


def _mask(text: str, secrets: Iterable[str]) -> str:
    for secret in secrets:
        if secret:
            text = text.replace(secret, _HIDDEN)
    return text


def _quote(argv: list[str], secrets: Iterable[str] = ()) -> str:
    """A command line for a person to read, with no key in it."""
    import shlex

    secrets = tuple(secrets)
    shown: list[str] = []
    hide_next = False
    for a in argv:
        flag, eq, _value = a.partition("=")
        if hide_next:
            shown.append(_HIDDEN)
        elif eq and flag in _SECRET_FLAGS:
            shown.append(f"{flag}={_HIDDEN}")
        else:
            shown.append(shlex.quote(_mask(a, secrets)))
        hide_next = a in _SECRET_FLAGS
    return " ".join(shown)


def _short(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text[:200]
