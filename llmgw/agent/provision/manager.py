"""Converging a node on the engines the control plane names.

For each wanted engine: pick the installer, and let it check what is
installed (never believing a directory without running what is in it) or
install it. Every state change goes to ``on_status`` as it happens. One
install per engine at a time; different engines proceed side by side.

:class:`ConvergeLoop` is the agent's timer around it: a pass whenever the
wanted set changes, again every ten minutes (an unrelated upgrade can remove
a library), and after a failure one minute later, backing off to ten. Each
failed engine's status then says when that next pass comes (``retry_at``).
The backoff lives only in memory: an agent that starts again (a restart, a
rerun ``llmgw node add``) tries a failed install on its first pass, at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import aiohttp

from llmgw.config.agent import DEFAULT_ENGINES_DIR
from llmgw.protocol import ProvisionState

from .fetch import make_session
from .host import HostFacts, detect
from .llamacpp_release import LlamaCppInstaller, ReleaseSource
from .os_packages import PackageInstaller
from .python_engines import ENGINES as PYTHON_ENGINES
from .python_engines import PythonEngineInstaller
from .runner import Runner, run_command
from .status import InstallRecord, NotHere, OnStatus, ProvisionError, Reporter, Unsupported

log = logging.getLogger(__name__)

DEFAULT_ROOT = Path(DEFAULT_ENGINES_DIR)
# What the agent tells the control plane it can install.
INSTALLABLE = ("llamacpp", "sglang", "vllm")
RECHECK_INTERVAL = 600.0
RETRY_FIRST = 60.0
RETRY_MAX = 600.0


@dataclass(frozen=True)
class Want:
    engine: str
    version: str
    # Base URL of release archives (a mirror), as EngineWant.source_url;
    # None = the configured or upstream one.
    source_url: str | None = None


class Installer:
    """Installs and re-checks engines under ``root`` for this machine."""

    def __init__(
        self,
        root: Path = DEFAULT_ROOT,
        host: HostFacts | None = None,
        *,
        on_status: OnStatus | None = None,
        run: Runner = run_command,
        packages: PackageInstaller | None = None,
        session_factory: Callable[[], aiohttp.ClientSession] = make_session,
        llamacpp_source: ReleaseSource | None = None,
        llamacpp: LlamaCppInstaller | None = None,
        python: PythonEngineInstaller | None = None,
    ) -> None:
        if host is None:
            host = detect()
        self.root = Path(root)
        self.host = host
        self.on_status = on_status
        # One PackageInstaller for every engine: it runs one package command at
        # a time, so two engines do not wait on each other's apt lock.
        self.packages = packages or PackageInstaller(run)
        self.llamacpp = llamacpp or LlamaCppInstaller(
            self.root, host, source=llamacpp_source, run=run, packages=self.packages, session_factory=session_factory
        )
        self.python = python or PythonEngineInstaller(
            self.root, host, run=run, packages=self.packages, session_factory=session_factory
        )
        self._locks: dict[str, asyncio.Lock] = {}
        self._last: dict[str, InstallRecord] = {}

    @staticmethod
    def installable() -> list[str]:
        return list(INSTALLABLE)

    @property
    def statuses(self) -> Mapping[str, InstallRecord]:
        """The latest status of every engine asked for, by engine name."""
        return dict(self._last)

    def _emit(self, st: InstallRecord) -> None:
        self._last[st.engine] = st
        if self.on_status is not None:
            try:
                self.on_status(st)
            except Exception:  # a listener's bug must not fail an install
                log.exception("provision status listener failed")

    async def converge(self, wants: Sequence[Want]) -> list[InstallRecord]:
        """Bring every wanted engine to ready or say why not; statuses in ``wants`` order."""
        seen: set[str] = set()
        unique = []
        for w in wants:
            if w.engine not in seen:  # one version per engine on a node
                seen.add(w.engine)
                unique.append(w)
        return list(await asyncio.gather(*(self.ensure(w) for w in unique)))

    async def ensure(self, want: Want) -> InstallRecord:
        lock = self._locks.setdefault(want.engine, asyncio.Lock())
        async with lock:
            return await self._ensure(want)

    async def _ensure(self, want: Want) -> InstallRecord:
        previous = self._last.get(want.engine)
        if previous is not None and previous.version == want.version:
            # Start from what the listener last heard, so a recheck that
            # finds everything in order sends nothing at all.
            start = replace(previous, bytes_done=None, bytes_total=None)
        else:
            start = InstallRecord(
                want.engine, want.version, ProvisionState.INSTALLING, f"checking {want.engine} {want.version}"
            )
        reporter = Reporter(start, self._emit, already_sent=previous)
        try:
            if not isinstance(want.version, str) or not want.version.strip():
                # server.yaml's `engines.<name>: ""` leaves the engine to the
                # operator, named in agent.yaml.
                raise NotHere(
                    f"{want.engine} is not installed by llmgw (its version is empty); "
                    "the agent uses the one named in its configuration"
                )
            if want.engine == "llamacpp":
                await self.llamacpp.ensure(want.version, reporter, base_url=want.source_url)
            elif want.engine in PYTHON_ENGINES:
                await self.python.ensure(want.engine, want.version, reporter)
            else:
                raise Unsupported(
                    f"this agent does not know how to install {want.engine}; install it "
                    "by hand and name it in the agent's configuration"
                )
        except NotHere as e:
            reporter.update(state=ProvisionState.SKIPPED, detail=str(e), binary="")
        except Unsupported as e:
            reporter.update(state=ProvisionState.UNSUPPORTED, detail=str(e), binary="")
        except ProvisionError as e:
            log.warning("installing %s %s failed: %s", want.engine, want.version, e)
            reporter.update(state=ProvisionState.FAILED, detail=str(e), binary="")
        except TimeoutError:
            reporter.update(
                state=ProvisionState.FAILED,
                binary="",
                detail=f"installing {want.engine} {want.version} took longer than allowed; it is tried again later",
            )
        except asyncio.CancelledError:
            raise
        except Exception as e:  # keep the agent running; say what happened
            log.exception("installing %s %s failed unexpectedly", want.engine, want.version)
            reporter.update(
                state=ProvisionState.FAILED,
                binary="",
                detail=f"installing {want.engine} {want.version} failed unexpectedly: {e.__class__.__name__}: {e}",
            )
        self._last[want.engine] = reporter.status
        return reporter.status

    def schedule_retry(self, engines: Sequence[str], at: float) -> None:
        """Say on each of ``engines`` still failed when it is tried again (wall clock)."""
        for engine in engines:
            st = self._last.get(engine)
            if st is not None and st.state == ProvisionState.FAILED and st.retry_at != at:
                self._emit(replace(st, retry_at=at))

    async def install_packages(
        self, by_family: Mapping[str, Sequence[str]], report: Callable[[str], None] | None = None
    ) -> list[str]:
        """OS packages for other parts of the agent (infiniband-diags, perftest)."""
        return await self.packages.ensure(self.host.family, by_family, report)


class ConvergeLoop:
    """Runs :meth:`Installer.converge` when the wanted set changes and on a timer."""

    def __init__(
        self,
        installer: Installer,
        *,
        recheck: float = RECHECK_INTERVAL,
        retry_first: float = RETRY_FIRST,
        retry_max: float = RETRY_MAX,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.installer = installer
        self.wall = wall
        self.recheck = recheck
        self.retry_first = retry_first
        self.retry_max = retry_max
        self._wants: list[Want] | None = None
        self._changed = asyncio.Event()
        self._retry = retry_first
        self.passes = 0

    def want(self, wants: Sequence[Want]) -> None:
        """The control plane's latest ``provision``; a pass starts promptly."""
        self._wants = list(wants)
        self._changed.set()

    def next_delay(self, statuses: Sequence[InstallRecord]) -> float:
        if any(s.state == ProvisionState.FAILED for s in statuses):
            delay, self._retry = self._retry, min(self._retry * 2, self.retry_max)
            return delay
        self._retry = self.retry_first
        return self.recheck

    async def run(self) -> None:
        """Until cancelled."""
        while True:
            await self._changed.wait()
            self._changed.clear()
            statuses = await self.installer.converge(self._wants or [])
            self.passes += 1
            delay = self.next_delay(statuses)
            failed = [s.engine for s in statuses if s.state == ProvisionState.FAILED]
            if failed:
                self.installer.schedule_retry(failed, self.wall() + delay)
            try:
                await asyncio.wait_for(self._changed.wait(), delay)
            except TimeoutError:
                self._changed.set()
