"""vLLM and SGLang as virtual environments built by uv.

Two things make an environment as trustworthy as an archive checked against
its publisher's checksum. Dependencies are resolved as PyPI stood a day after
the engine's release (``--exclude-newer``), so a node built next month gets
what one built today got, not whatever a dependency released since (the
usual way a working vLLM stops working). And the resolution is written out
with every file's sha256 (``--generate-hashes``) and installed with
``--require-hashes``, so a file that does not match is refused. The resolved
list stays in the environment as the record of what is installed.

uv itself is installed like llama.cpp: a release archive checked against the
``.sha256`` uv publishes beside it.
"""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import aiohttp

from llmgw.protocol import ProvisionState

from .archive import unpack
from .fetch import download, fetch_sidecar, http_get, make_session, normalise_sha256, status_error
from .host import HostFacts
from .os_packages import PackageInstaller
from .runner import Runner, last_lines, run_command
from .status import NotHere, ProvisionError, Reporter, Unsupported
from .verify import (
    Installed,
    Marker,
    find_binary,
    installed_at,
    move_into_place,
    now_utc,
    prove_runs,
    sha256_file,
    still_runs,
    work_dir_beside,
    write_marker,
)

log = logging.getLogger(__name__)

UV_VERSION = "0.12.20"
UV_BASE_URL = "https://github.com/astral-sh/uv/releases/download"
PYPI_BASE = "https://pypi.org"
# uv fetches this interpreter, so the node's own Python (or its absence)
# does not matter.
PYTHON_VERSION = "3.12"
# Every vLLM since 0.26 and SGLang since 0.5 is built on torch for CUDA 13,
# which needs driver 580 and dropped Volta (compute capability 7.0, the V100).
MIN_DRIVER = 580
MIN_COMPUTE_CAPABILITY = 7.5
VARIANT = "cu13"
# vLLM 0.30.0 with its torch is about 7.7 GB installed, plus uv's cache of
# the same during the install; one that fills the disk halfway leaves the
# node worse off than one that never began.
FREE_GB = 25
LOCK_NAME = "llmgw-requirements.txt"
INSTALL_TIMEOUT = 3600.0
# Importing torch and the engine on a cold disk takes a while.
VERIFY_TIMEOUT = 180.0
# Triton compiles a small launcher for its kernels the first time a model
# loads; without gcc that load fails long after the install looked finished.
COMPILER_PACKAGES: Mapping[str, tuple[str, ...]] = {"deb": ("gcc",), "rpm": ("gcc",)}

_VERSION = re.compile(r"[0-9][0-9A-Za-z.+!_-]{0,63}")


@dataclass(frozen=True)
class PythonEngine:
    name: str  # llmgw's name: "vllm"
    display: str  # a person's name: "vLLM"
    project: str  # on PyPI
    binary: str  # in the environment's bin/
    version_args: tuple[str, ...] = ("--version",)


ENGINES: Mapping[str, PythonEngine] = {
    "vllm": PythonEngine("vllm", "vLLM", "vllm", "vllm"),
    # SGLang is launched as a module, so the agent is given the environment's
    # interpreter, and the proof is importing it.
    "sglang": PythonEngine(
        "sglang", "SGLang", "sglang", "python", ("-c", "import sglang; print('sglang', sglang.__version__)")
    ),
}


@dataclass(frozen=True)
class PythonBuild:
    engine: PythonEngine
    version: str
    variant: str
    python: str
    requirements: tuple[str, ...]
    packages: Mapping[str, tuple[str, ...]]
    free_gb: float


def _leading_int(s: str) -> int:
    m = re.match(r"\s*(\d+)", s)
    return int(m.group(1)) if m else 0


def cuda_gate(display: str, host: HostFacts) -> None:
    """Raise NotHere (no GPU: skipped) or Unsupported (too old) for a CUDA 13 engine."""
    if host.arch not in ("amd64", "arm64"):
        raise Unsupported(f"{display} publishes no Linux build for {host.arch or 'an unrecognised system'}")
    if not host.has_nvidia_driver:
        raise NotHere(f"{display} runs on NVIDIA GPUs and this node has none; it serves llama.cpp models")
    major = _leading_int(host.nvidia_driver)
    if 0 < major < MIN_DRIVER:
        raise Unsupported(
            f"{display} is built for CUDA 13, which needs NVIDIA driver {MIN_DRIVER} or "
            f"newer; this node has {host.nvidia_driver}"
        )
    cc = host.min_compute_capability
    if cc is not None and 0 < cc < MIN_COMPUTE_CAPABILITY:
        raise Unsupported(
            f"{display} is built for CUDA 13, which supports GPUs of compute capability "
            f"{MIN_COMPUTE_CAPABILITY} and newer; this node has one of {cc:.1f}"
        )


def choose_build(engine: str, version: str, host: HostFacts) -> PythonBuild:
    spec = ENGINES.get(engine)
    if spec is None:
        raise Unsupported(f"this agent does not know how to install {engine!r} with uv")
    if not isinstance(version, str) or not _VERSION.fullmatch(version):
        raise ProvisionError(f"{version!r} is not a {spec.display} version; use one such as 0.30.0")
    cuda_gate(spec.display, host)
    return PythonBuild(
        spec, version, VARIANT, PYTHON_VERSION, (f"{spec.project}=={version}",), COMPILER_PACKAGES, FREE_GB
    )


# ------------------------------------------------------------------ resolution date


def parse_upload_time(value: str) -> datetime:
    t = datetime.fromisoformat(value.replace("Z", "+00:00"))
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def exclude_newer(upload_times: Iterable[str | datetime]) -> str:
    """The ``--exclude-newer`` instant: a day after the release's last file.

    A day, because a release's own wheels trickle in for hours after the
    first, and its pinned dependencies are those that existed then.
    """
    times = [t if isinstance(t, datetime) else parse_upload_time(t) for t in upload_times]
    if not times:
        raise ProvisionError("the release lists no files")
    last = max(times) + timedelta(days=1)
    return last.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


async def published_files(session: aiohttp.ClientSession, pypi_base: str, project: str, version: str) -> list[str]:
    """Upload times of every file of ``project`` ``version`` on PyPI (JSON API)."""
    url = f"{pypi_base.rstrip('/')}/pypi/{project}/{version}/json"
    resp = await http_get(session, url)
    async with resp:
        if resp.status == 404:
            raise ProvisionError(f"PyPI has no {project} {version}; check the version in server.yaml `engines:`")
        if resp.status != 200:
            raise status_error(resp, f"{project} {version}")
        try:
            body = await resp.json(content_type=None)
        except ValueError:
            raise ProvisionError(
                f"PyPI's answer for {project} {version} is not JSON (is {pypi_base} a package index?)"
            ) from None
    urls = body.get("urls") if isinstance(body, dict) else None
    times = [
        u["upload_time_iso_8601"]
        for u in urls or []
        if isinstance(u, dict) and isinstance(u.get("upload_time_iso_8601"), str)
    ]
    if not times:
        raise ProvisionError(f"PyPI lists no files for {project} {version}")
    return times


# ------------------------------------------------------------------ commands


def uv_env(root: Path) -> dict[str, str]:
    return {
        "UV_CACHE_DIR": str(root / ".uv-cache"),
        "UV_PYTHON_INSTALL_DIR": str(root / "python"),
        # Only the interpreter uv fetched: the system's may be the wrong
        # version, or change under the environment with the next upgrade.
        "UV_PYTHON_PREFERENCE": "only-managed",
        # Nobody's uv.toml or pip.conf decides what is installed here.
        "UV_NO_CONFIG": "1",
    }


def venv_command(uv: Path, python: str, venv: Path) -> list[str]:
    # Relocatable: built under a scratch name and renamed into place, its
    # scripts find their interpreter relative to themselves.
    return [str(uv), "venv", "--relocatable", "--python", python, str(venv)]


def compile_command(uv: Path, venv_python: Path, as_of: str, lock: Path) -> list[str]:
    """Resolve the requirements given on stdin as PyPI stood at ``as_of``, with hashes."""
    return [
        str(uv),
        "pip",
        "compile",
        "--python",
        str(venv_python),
        "--exclude-newer",
        as_of,
        "--generate-hashes",
        "--quiet",
        "--output-file",
        str(lock),
        "-",
    ]


def install_command(uv: Path, venv_python: Path, lock: Path) -> list[str]:
    # --no-deps: the lock already lists every dependency, each with its hash.
    return [str(uv), "pip", "install", "--python", str(venv_python), "--require-hashes", "--no-deps", "-r", str(lock)]


def free_gb(path: Path) -> float:
    p = path
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free / (1 << 30)


def uv_asset(arch: str) -> str:
    a = {"amd64": "x86_64", "arm64": "aarch64"}.get(arch)
    if a is None:
        raise Unsupported(f"uv publishes no Linux build for {arch or 'an unrecognised system'}")
    return f"uv-{a}-unknown-linux-gnu.tar.gz"


# ------------------------------------------------------------------ installer


class PythonEngineInstaller:
    """Installs vLLM and SGLang environments under ``root``."""

    def __init__(
        self,
        root: Path,
        host: HostFacts,
        *,
        run: Runner = run_command,
        packages: PackageInstaller | None = None,
        session_factory: Callable[[], aiohttp.ClientSession] = make_session,
        pypi_base: str = PYPI_BASE,
        uv_base_url: str = UV_BASE_URL,
        uv_sha256: str | None = None,
        uv_binary: Path | None = None,
        free_space: Callable[[Path], float] = free_gb,
    ) -> None:
        self.root = Path(root)
        self.host = host
        self.run = run
        self.packages = packages or PackageInstaller(run)
        self.session_factory = session_factory
        self.pypi_base = pypi_base
        self.uv_base_url = uv_base_url.rstrip("/")
        self.uv_sha256 = normalise_sha256(uv_sha256, "uv") if uv_sha256 else None
        self.uv_binary = Path(uv_binary) if uv_binary else None
        self.free_space = free_space

    def install_dir(self, build: PythonBuild) -> Path:
        return self.root / build.engine.name / f"{build.version}-{build.variant}"

    async def ensure(self, engine: str, version: str, reporter: Reporter) -> None:
        """Bring ``engine`` ``version`` to ready, or raise NotHere/Unsupported/ProvisionError.

        The hardware is judged before anything is touched: a node that cannot
        run it installs nothing and downloads nothing.
        """
        build = choose_build(engine, version, self.host)
        reporter.update(variant=build.variant)
        await self.packages.ensure(self.host.family, build.packages, reporter.installing)
        found = await still_runs(
            self.install_dir(build), self.check, reporter, logged=f"{engine} {version}", shown=build.engine.display
        )
        if found is not None:
            reporter.update(
                state=ProvisionState.READY,
                binary=str(found[0].binary),
                detail=f"{build.engine.binary} {found[1]}".strip(),
            )
            return
        installed = await asyncio.wait_for(self.install(build, reporter), INSTALL_TIMEOUT)
        reporter.update(
            state=ProvisionState.READY,
            binary=str(installed.binary),
            detail=f"{build.engine.binary} {installed.marker.version_line}".strip(),
        )

    async def check(self, installed: Installed) -> str:
        """Re-verify an environment: its program still starts (imports, for SGLang)."""
        spec = ENGINES[installed.marker.engine]
        if not installed.binary.exists():
            raise ProvisionError(f"{installed.binary} is gone")
        return await prove_runs(
            self.run, installed.binary, version_args=spec.version_args, use_ldd=False, timeout=VERIFY_TIMEOUT
        )

    async def install(self, build: PythonBuild, reporter: Reporter) -> Installed:
        spec = build.engine
        self.root.mkdir(parents=True, exist_ok=True)
        free = self.free_space(self.root)
        if free < build.free_gb:
            raise ProvisionError(
                f"{spec.display} needs about {build.free_gb:.0f} GB free under {self.root} and there are {free:.1f} GB"
            )
        uv = await self.ensure_uv(reporter)
        async with self.session_factory() as session:
            reporter.installing(f"asking PyPI when {spec.project} {build.version} was published")
            as_of = exclude_newer(await published_files(session, self.pypi_base, spec.project, build.version))
        env = uv_env(self.root)
        target = self.install_dir(build)
        work = await asyncio.to_thread(work_dir_beside, target)
        try:
            venv = work / "venv"
            python = venv / "bin" / "python"
            lock = venv / LOCK_NAME
            reporter.installing(f"creating a Python {build.python} environment for {spec.display}")
            await self._uv(venv_command(uv, build.python, venv), env, "creating the environment")
            reporter.installing(f"resolving {' '.join(build.requirements)} against PyPI as of {as_of[:10]}")
            await self._uv(
                compile_command(uv, python, as_of, lock),
                env,
                f"resolving {' '.join(build.requirements)}",
                stdin="\n".join(build.requirements) + "\n",
            )
            reporter.installing(
                f"downloading and installing {' '.join(build.requirements)} and its "
                "dependencies: several gigabytes, which takes minutes"
            )
            await self._uv(install_command(uv, python, lock), env, f"installing {' '.join(build.requirements)}")
            reporter.installing(f"checking that {spec.display} runs")
            binary = venv / "bin" / spec.binary
            if not binary.exists():
                raise ProvisionError(
                    f"{spec.binary} is not in the environment after installing {' '.join(build.requirements)}"
                )
            line = await prove_runs(
                self.run, binary, version_args=spec.version_args, use_ldd=False, timeout=VERIFY_TIMEOUT
            )
            marker = Marker(
                engine=spec.name,
                version=build.version,
                variant=build.variant,
                binary=f"bin/{spec.binary}",
                source="uv",
                version_line=line,
                sha256={LOCK_NAME: await asyncio.to_thread(sha256_file, lock)},
                requirements=list(build.requirements),
                exclude_newer=as_of,
                uv=UV_VERSION,
                url=f"{self.pypi_base.rstrip('/')}/pypi/{spec.project}/{build.version}",
                installed=now_utc(),
            )
            await asyncio.to_thread(write_marker, venv, marker)
            await asyncio.to_thread(move_into_place, venv, target)
        finally:
            await asyncio.to_thread(shutil.rmtree, work, True)
        # The cache is as large as the environment: kept after a failure so
        # the next attempt does not download it all again, dropped after success.
        await asyncio.to_thread(shutil.rmtree, self.root / ".uv-cache", True)
        log.info("installed %s %s into %s (PyPI as of %s)", spec.name, build.version, target, as_of)
        return Installed(target, marker)

    async def _uv(self, argv: Sequence[str], env: Mapping[str, str], what: str, stdin: str | None = None) -> None:
        r = await self.run(list(argv), env=env, stdin=stdin, timeout=INSTALL_TIMEOUT)
        if not r.ok:
            raise ProvisionError(f"{what} failed (uv exit {r.returncode}): {last_lines(r.output) or 'no output'}")

    async def ensure_uv(self, reporter: Reporter) -> Path:
        """uv at UV_VERSION, installed under ``<root>/uv`` from its release archive."""
        if self.uv_binary is not None:
            return self.uv_binary
        asset = uv_asset(self.host.arch)
        target = self.root / "uv" / f"{UV_VERSION}-{asset.split('-')[1]}"
        existing = installed_at(target)
        if existing is not None:
            try:
                await prove_runs(self.run, existing.binary, use_ldd=False)
                return existing.binary
            except ProvisionError as e:
                log.warning("the installed uv no longer runs (%s); installing it again", e)
        reporter.installing(f"installing uv {UV_VERSION}, which installs the Python engines")
        url = f"{self.uv_base_url}/{UV_VERSION}/{asset}"
        work = await asyncio.to_thread(work_dir_beside, target)
        try:
            tree = work / "tree"
            tree.mkdir()
            async with self.session_factory() as session:
                sha = self.uv_sha256 or await fetch_sidecar(session, url + ".sha256", asset)
                if sha is None:
                    raise ProvisionError(
                        f"no checksum is published for {asset} (looked for {url}.sha256), so it cannot be verified"
                    )
                archive = work / asset
                await download(session, url, archive, sha, label=asset)
            await asyncio.to_thread(unpack, archive, tree, label=asset)
            binary = await asyncio.to_thread(find_binary, tree, "uv")
            line = await prove_runs(self.run, binary, use_ldd=False)
            marker = Marker(
                engine="uv",
                version=UV_VERSION,
                variant=asset.split("-")[1],
                binary=binary.relative_to(tree).as_posix(),
                source="release",
                version_line=line,
                sha256={asset: sha},
                url=url,
                installed=now_utc(),
                binary_sha256=await asyncio.to_thread(sha256_file, binary),
            )
            await asyncio.to_thread(write_marker, tree, marker)
            await asyncio.to_thread(move_into_place, tree, target)
        except ProvisionError as e:
            raise ProvisionError(f"installing uv, which installs the Python engines: {e}") from None
        finally:
            await asyncio.to_thread(shutil.rmtree, work, True)
        return target / marker.binary
