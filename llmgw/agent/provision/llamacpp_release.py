"""Installing llama.cpp's ``llama-server`` from its published release archives.

The Linux builds are published from Ubuntu but are not Ubuntu's in any way
that matters: they need glibc 2.34 and GCC 12's libstdc++ (Ubuntu 22.04+,
Debian 12+, RHEL-family 10; not RHEL 9). So the distribution's name decides
nothing: the build is tried everywhere and ``ldd`` says whether it loads.

Layout: ``<root>/llamacpp/<version>-<variant>/`` holding the unpacked
archive(s) and the marker ``.llmgw-installed`` (written last). It is built in
a scratch directory beside it and renamed into place once it has run.

When the release server cannot be reached at all, llama-server is built from
the llama.cpp source in the pinned ``llama-cpp-python`` sdist (the recipe of
``scripts/build-llama-server``) and installed into the same layout, as
``<root>/llamacpp/llama-cpp-python-<version>-source-cpu``.
"""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp

from llmgw.progress import human_size
from llmgw.protocol import ProvisionState

from . import llamacpp_source
from .archive import unpack
from .fetch import download, fetch_sidecar, github_release_digests, make_session, normalise_sha256
from .host import HostFacts
from .os_packages import PackageInstaller
from .runner import Runner, run_command
from .status import ProvisionError, Reporter, Unreachable, Unsupported
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

ENGINE = "llamacpp"
REPO = "ggml-org/llama.cpp"
DEFAULT_BASE_URL = f"https://github.com/{REPO}/releases/download"
GITHUB_API_RELEASE = f"https://api.github.com/repos/{REPO}/releases/tags/{{tag}}"
BINARY = "llama-server"
# The glibc the release builds link against (built on Ubuntu 22.04); doctor checks the node against it.
RELEASE_MIN_GLIBC = (2, 34)
# The CUDA build taken on an NVIDIA node. Its release carries a matching
# cudart archive, so the node needs the driver and no toolkit.
CUDA_VERSION = "12.8"
VARIANTS = ("auto", "cpu", "cuda", "vulkan")
# Newer releases publish .tar.gz, older ones .zip; whichever the checksum
# source lists (or the mirror serves) is taken, in this order.
ARCHIVE_SUFFIXES = (".tar.gz", ".zip")
# OpenMP's runtime is the one library the build links that a cloud image
# lacks, and the server does not start without it.
PACKAGES: Mapping[str, tuple[str, ...]] = {"deb": ("libgomp1",), "rpm": ("libgomp",)}
VULKAN_PACKAGES: Mapping[str, tuple[str, ...]] = {
    "deb": ("libgomp1", "libvulkan1"),
    "rpm": ("libgomp", "vulkan-loader"),
}
SOURCE_VARIANT = "source-cpu"

_TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


@dataclass(frozen=True)
class LlamaCppBuild:
    version: str
    variant: str
    # Asset names without their archive suffix, unpacked in order into one tree.
    assets: tuple[str, ...]
    packages: Mapping[str, tuple[str, ...]]
    # Extensions the build is slow without: reported, never refused.
    cpu_flags: tuple[str, ...] = ()


def check_tag(version: str) -> str:
    if not isinstance(version, str) or not _TAG.fullmatch(version):
        raise ProvisionError(f"{version!r} is not a llama.cpp release tag; use one such as b10991")
    return version


def choose_build(version: str, host: HostFacts, variant: str = "auto") -> LlamaCppBuild:
    """The build for this machine: CUDA when an NVIDIA driver is loaded (x64), CPU otherwise.

    ``variant`` forces one ("cpu", "cuda", "vulkan"); "auto" decides.
    """
    check_tag(version)
    if variant not in VARIANTS:
        raise ProvisionError(f"llama.cpp variant {variant!r} is unknown; use one of {', '.join(VARIANTS)}")
    arch = {"amd64": "x64", "arm64": "arm64"}.get(host.arch)
    if arch is None:
        raise Unsupported(f"llama.cpp publishes no Linux build for {host.arch or 'an unrecognised system'}")
    # The archive carries a backend per x86 CPU generation and loads the
    # best; below AVX2 it runs, several times slower.
    flags = ("avx2",) if arch == "x64" else ()
    if variant == "auto":
        # arm64 CUDA builds target a newer CUDA than the driver may support,
        # so an arm64 GPU node runs the CPU build until told otherwise.
        variant = "cuda" if host.has_nvidia_driver and arch == "x64" else "cpu"
    if variant == "cuda":
        if arch != "x64":
            raise Unsupported(f"llama.cpp publishes no CUDA build for Linux on {host.arch}")
        stem = f"bin-ubuntu-cuda-{CUDA_VERSION}-x64"
        return LlamaCppBuild(
            version,
            f"cuda-{CUDA_VERSION}",
            (f"llama-{version}-{stem}", f"cudart-llama-{version}-{stem}"),
            PACKAGES,
            flags,
        )
    if variant == "vulkan":
        return LlamaCppBuild(version, "vulkan", (f"llama-{version}-bin-ubuntu-vulkan-{arch}",), VULKAN_PACKAGES, flags)
    return LlamaCppBuild(version, "cpu", (f"llama-{version}-bin-ubuntu-{arch}",), PACKAGES, flags)


@dataclass
class ReleaseSource:
    """Where release archives and their checksums come from."""

    # Archives are fetched from <base_url>/<tag>/<asset>: GitHub's releases
    # by default; a mirror (or a test server) laid out the same way otherwise.
    base_url: str = DEFAULT_BASE_URL
    # GitHub's release API, asked for checksums; "auto" = only when base_url
    # is GitHub's own, None = never (then <asset>.sha256 beside each asset).
    api_url: str | None = "auto"
    # Checksums given by the operator, by asset file name; they win over any
    # published one.
    expected_sha256: Mapping[str, str] = field(default_factory=dict)
    variant: str = "auto"
    # Build from source when the release server cannot be reached at all.
    allow_source_build: bool = True

    def __post_init__(self) -> None:
        u = urlsplit(self.base_url)
        if u.scheme not in ("http", "https") or not u.netloc:
            raise ProvisionError(
                f"release base URL {self.base_url!r} is not an http(s) URL; the default is {DEFAULT_BASE_URL}"
            )
        self.base_url = self.base_url.rstrip("/")
        if self.variant not in VARIANTS:
            raise ProvisionError(f"llama.cpp variant {self.variant!r} is unknown; use one of {', '.join(VARIANTS)}")
        self.expected_sha256 = {name: normalise_sha256(sha, name) for name, sha in dict(self.expected_sha256).items()}

    def asset_url(self, tag: str, asset: str) -> str:
        return f"{self.base_url}/{tag}/{asset}"

    def api_release_url(self, tag: str) -> str | None:
        if self.api_url == "auto":
            return GITHUB_API_RELEASE.format(tag=tag) if self.base_url == DEFAULT_BASE_URL else None
        return self.api_url.format(tag=tag) if self.api_url else None


BuildFromSource = Callable[[Callable[[str, "float | None"], None]], Path]


def _default_build_from_source(progress: Callable[[str, float | None], None]) -> Path:
    return llamacpp_source.build_llama_server(progress)


def slow_cpu_note(host: HostFacts, flags: tuple[str, ...]) -> str:
    if host.cpu_flags is None:
        return ""  # not measured, which is not "lacks everything"
    missing = [f for f in flags if not host.has_cpu_flag(f)]
    if not missing:
        return ""
    # Said on every report: it is the difference between five tokens a
    # second and forty, and a VM on QEMU's default CPU model otherwise looks
    # entirely healthy.
    return f'; this CPU lacks {", ".join(missing)}, so it will run several times slower (a VM needs CPU type "host")'


class LlamaCppInstaller:
    """Installs and re-checks llama-server under ``root``."""

    engine = ENGINE

    def __init__(
        self,
        root: Path,
        host: HostFacts,
        *,
        source: ReleaseSource | None = None,
        run: Runner = run_command,
        packages: PackageInstaller | None = None,
        session_factory: Callable[[], aiohttp.ClientSession] = make_session,
        build_from_source: BuildFromSource = _default_build_from_source,
    ) -> None:
        self.root = Path(root)
        self.host = host
        self.source = source or ReleaseSource()
        self.run = run
        self.packages = packages or PackageInstaller(run)
        self.session_factory = session_factory
        self.build_from_source = build_from_source

    # -------------------------------------------------------------- layout

    def install_dir(self, build: LlamaCppBuild) -> Path:
        return self.root / ENGINE / f"{build.version}-{build.variant}"

    def source_install_dir(self) -> Path:
        return self.root / ENGINE / f"llama-cpp-python-{llamacpp_source.LLAMA_CPP_PYTHON_VERSION}-{SOURCE_VARIANT}"

    # -------------------------------------------------------------- converge

    async def ensure(self, version: str, reporter: Reporter, *, base_url: str | None = None) -> None:
        """Bring ``version`` to ready (or raise); reports each step on ``reporter``.

        Installed before: checked again rather than believed (a library can
        be removed by somebody's upgrade), and reinstalled if it no longer
        runs. Never downloads what is installed and runs. ``base_url`` (the
        control plane's mirror for this engine) overrides the configured one.
        """
        source = self.source
        if base_url:
            source = replace(source, base_url=base_url, api_url=None if source.api_url == "auto" else source.api_url)
        build = choose_build(version, self.host, source.variant)
        reporter.update(variant=build.variant)
        await self.packages.ensure(self.host.family, build.packages, reporter.installing)

        found = await still_runs(
            self.install_dir(build), self.check, reporter, logged=f"llama.cpp {version}", shown=BINARY
        )
        if found is not None:
            self._ready(reporter, build, found[0].binary, found[1])
            return
        try:
            installed = await self.install(build, reporter, source)
        except Unreachable as e:
            if not source.allow_source_build:
                raise
            installed = await self._from_source(reporter, e)
            line = installed.marker.version_line
            reporter.update(variant=SOURCE_VARIANT)
            self._ready(
                reporter,
                build,
                installed.binary,
                f"{line} (built from the llama.cpp source in llama-cpp-python "
                f"{llamacpp_source.LLAMA_CPP_PYTHON_VERSION}: the release downloads "
                f"could not be reached: {e})",
            )
            return
        self._ready(reporter, build, installed.binary, installed.marker.version_line)

    def _ready(self, reporter: Reporter, build: LlamaCppBuild, binary: Path, line: str) -> None:
        reporter.update(
            state=ProvisionState.READY,
            binary=str(binary),
            detail=f"{BINARY} {line}".strip() + slow_cpu_note(self.host, build.cpu_flags),
        )

    async def check(self, installed: Installed) -> str:
        """Re-verify an install (the ten-minute recheck): returns its version line."""
        binary = installed.binary
        if not binary.is_file():
            raise ProvisionError(f"{binary} is gone")
        if installed.marker.binary_sha256:
            actual = await asyncio.to_thread(sha256_file, binary)
            if actual != installed.marker.binary_sha256:
                raise ProvisionError(f"{binary} was changed after it was installed (its sha256 differs)")
        return await prove_runs(self.run, binary)

    # -------------------------------------------------------------- release

    async def install(self, build: LlamaCppBuild, reporter: Reporter, source: ReleaseSource | None = None) -> Installed:
        """Download, check, unpack, prove and mark ``build``, then rename it into place."""
        source = source or self.source
        target = self.install_dir(build)
        work = await asyncio.to_thread(work_dir_beside, target)
        try:
            tree, downloads = work / "tree", work / "downloads"
            tree.mkdir()
            downloads.mkdir()
            async with self.session_factory() as session:
                reporter.installing(f"looking up the checksums of llama.cpp {build.version}")
                assets = await self.resolve_assets(session, build, source)
                for name, sha in assets.items():
                    archive = downloads / name
                    await download(
                        session,
                        source.asset_url(build.version, name),
                        archive,
                        sha,
                        self._progress(reporter, name),
                        label=name,
                    )
                    reporter.installing(f"unpacking {name}")
                    await asyncio.to_thread(unpack, archive, tree, label=name)
                    archive.unlink()
            binary = await asyncio.to_thread(find_binary, tree, BINARY)
            reporter.installing(f"checking that {BINARY} runs")
            line = await prove_runs(self.run, binary)
            marker = Marker(
                engine=ENGINE,
                version=build.version,
                variant=build.variant,
                binary=binary.relative_to(tree).as_posix(),
                source="release",
                version_line=line,
                sha256=dict(assets),
                binary_sha256=await asyncio.to_thread(sha256_file, binary),
                url=source.asset_url(build.version, next(iter(assets))),
                installed=now_utc(),
            )
            await asyncio.to_thread(write_marker, tree, marker)
            await asyncio.to_thread(move_into_place, tree, target)
        finally:
            await asyncio.to_thread(shutil.rmtree, work, True)
        log.info("installed llama.cpp %s (%s) into %s", build.version, build.variant, target)
        return Installed(target, marker)

    def _progress(self, reporter: Reporter, name: str) -> Callable[[int, int | None], None]:
        first = True

        def on_progress(done: int, total: int | None) -> None:
            nonlocal first
            if first:
                first = False
                size = f" ({human_size(total)})" if total else ""
                reporter.update(
                    state=ProvisionState.INSTALLING,
                    detail=f"downloading {name}{size}",
                    bytes_done=done,
                    bytes_total=total,
                )
            else:
                reporter.progress(done, total)

        return on_progress

    async def resolve_assets(
        self, session: aiohttp.ClientSession, build: LlamaCppBuild, source: ReleaseSource | None = None
    ) -> dict[str, str]:
        """``{asset file name: sha256}`` for each asset of ``build``, in order.

        Explicit checksums first, then GitHub's API (for GitHub), else a
        sidecar ``<asset>.sha256``. An asset with no checksum is refused.
        """
        source = source or self.source
        out: dict[str, str] = {}
        api = source.api_release_url(build.version)
        digests = None
        if api is not None and not all(self._explicit(source, s) for s in build.assets):
            digests = await github_release_digests(session, api, f"llama.cpp release {build.version}")
        for stem in build.assets:
            candidates = [stem + s for s in ARCHIVE_SUFFIXES]
            found = self._explicit(source, stem)
            if found is None and digests is not None:
                found = next(((n, digests[n]) for n in candidates if n in digests), None)
                if found is None:
                    raise ProvisionError(
                        f"llama.cpp release {build.version} publishes no {stem}{ARCHIVE_SUFFIXES[0]} "
                        "with a checksum, so it cannot be verified (is the tag right for this build?)"
                    )
            if found is None:
                for name in candidates:
                    url = source.asset_url(build.version, name) + ".sha256"
                    sha = await fetch_sidecar(session, url, name)
                    if sha is not None:
                        found = (name, sha)
                        break
            if found is None:
                raise ProvisionError(
                    f"no checksum is published for {candidates[0]} (looked for "
                    f"{source.asset_url(build.version, candidates[0])}.sha256), so it cannot be "
                    "verified; publish the .sha256 beside it or give the sha256 in the agent configuration"
                )
            out[found[0]] = found[1]
        return out

    @staticmethod
    def _explicit(source: ReleaseSource, stem: str) -> tuple[str, str] | None:
        for s in ARCHIVE_SUFFIXES:
            if stem + s in source.expected_sha256:
                return stem + s, source.expected_sha256[stem + s]
        return None

    # -------------------------------------------------------------- source

    async def _from_source(self, reporter: Reporter, why: Unreachable) -> Installed:
        """The second source: build from the llama-cpp-python sdist, install it like a release."""
        target = self.source_install_dir()
        existing = installed_at(target)
        if existing is not None:
            try:
                await self.check(existing)
                return existing
            except ProvisionError as e:
                log.warning("the source-built llama-server no longer runs (%s); building it again", e)
        reporter.update(
            state=ProvisionState.INSTALLING,
            variant=SOURCE_VARIANT,
            detail=f"the release downloads cannot be reached ({why}); building "
            f"{BINARY} from source instead, which takes several minutes",
        )
        loop = asyncio.get_running_loop()
        last: dict[str, object] = {}

        def progress(phase: str, pct: float | None) -> None:
            # Called from the build thread; a status per phase and per 5%.
            step = None if pct is None else int(pct // 5)
            if last.get("phase") == phase and last.get("step") == step:
                return
            last.update(phase=phase, step=step)
            words = f"building {BINARY} from source: {phase}" + ("" if pct is None else f" {pct:.0f}%")
            loop.call_soon_threadsafe(reporter.installing, words)

        try:
            built = await asyncio.to_thread(self.build_from_source, progress)
        except ProvisionError as e:
            raise ProvisionError(
                f"the release downloads cannot be reached ({why}), and building from source failed too: {e}"
            ) from None
        work = await asyncio.to_thread(work_dir_beside, target)
        try:
            tree = work / "tree"
            (tree / "bin").mkdir(parents=True)
            binary = tree / "bin" / BINARY
            await asyncio.to_thread(shutil.copy2, built, binary)
            binary.chmod(0o755)
            line = await prove_runs(self.run, binary)
            marker = Marker(
                engine=ENGINE,
                version=llamacpp_source.LLAMA_CPP_PYTHON_VERSION,
                variant=SOURCE_VARIANT,
                binary="bin/" + BINARY,
                source="source",
                version_line=line,
                sha256={llamacpp_source.SDIST_FILENAME: llamacpp_source.SDIST_SHA256},
                binary_sha256=await asyncio.to_thread(sha256_file, binary),
                url=f"pypi:llama-cpp-python=={llamacpp_source.LLAMA_CPP_PYTHON_VERSION}",
                installed=now_utc(),
            )
            await asyncio.to_thread(write_marker, tree, marker)
            await asyncio.to_thread(move_into_place, tree, target)
        finally:
            await asyncio.to_thread(shutil.rmtree, work, True)
        return Installed(target, marker)
