"""Build llama.cpp's ``llama-server`` (CPU) from the source vendored in the
``llama-cpp-python`` sdist on PyPI.

PyPI is the only package source reachable from CI and air-gapped build hosts
(through pip), and the sdist carries a full llama.cpp tree plus its vocabulary
GGUF files, so it gives us a pinned, hash-checked llama.cpp without GitHub.

The result is cached under ``$LLMGW_CACHE_DIR`` (default ``~/.cache/llmgw``)::

    llama-server-<version>/bin/llama-server
    llama-server-<version>/vocab/ggml-vocab-llama-spm.gguf

The binary is linked with ``BUILD_SHARED_LIBS=OFF`` so it does not point back
at the build directory and can be moved or archived.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath

from llmgw.files import replace_durably, sha256_file
from llmgw.paths import PathRefused, relative_path, resolve_inside

from .status import ProvisionError

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
SDIST_FILENAME = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"

# Where llama.cpp lives inside the sdist (below the top-level directory).
LLAMA_CPP_SUBDIR = "vendor/llama.cpp"
VOCAB_SUBDIR = f"{LLAMA_CPP_SUBDIR}/models"
# Vocabularies copied into the cache by a build; others are fetched on demand.
DEFAULT_VOCABS = ("llama-spm",)

CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
)
BUILD_TARGET = "llama-server"
INSTALL_HINT = "install them with `apt-get install cmake g++` (or your platform's equivalent)"

Progress = Callable[[str, "float | None"], None]

_CMAKE_PERCENT = re.compile(r"^\[\s*(\d{1,3})%\]")


# ---------------------------------------------------------------- paths


def cache_dir() -> Path:
    env = os.environ.get("LLMGW_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "llmgw"


def install_dir() -> Path:
    return cache_dir() / f"llama-server-{LLAMA_CPP_PYTHON_VERSION}"


def cached_binary_path() -> Path:
    return install_dir() / "bin" / "llama-server"


def vocab_dir() -> Path:
    return install_dir() / "vocab"


def vocab_filename(name: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9._-]+", name) or name.startswith("."):
        raise ValueError(f"bad vocab name {name!r}")
    return f"ggml-vocab-{name}.gguf"


# ---------------------------------------------------------------- lookup


def _is_executable(p: Path) -> bool:
    return p.is_file() and os.access(p, os.X_OK)


def binary_works(path: Path, timeout: float = 30.0) -> bool:
    """True when ``path --version`` exits 0 (catches truncated or foreign-arch files)."""
    if not _is_executable(path):
        return False
    try:
        r = subprocess.run(
            [str(path), "--version"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=timeout,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return r.returncode == 0


def find_llama_server(explicit: str | None = None) -> Path | None:
    """The llama-server to use: ``explicit`` if given, else PATH, else the cache.

    An explicit path that is not an executable file gives None rather than
    silently falling back to some other binary.
    """
    if explicit:
        p = Path(explicit).expanduser()
        return p.resolve() if _is_executable(p) else None
    on_path = shutil.which("llama-server")
    if on_path:
        return Path(on_path)
    cached = cached_binary_path()
    return cached if binary_works(cached) else None


# ---------------------------------------------------------------- sdist


def verify_sdist(path: Path, expected: str | None = None) -> None:
    expected = expected or SDIST_SHA256  # looked up at call time so tests can pin a fake sdist
    actual = sha256_file(path)
    if actual != expected:
        raise ProvisionError(
            f"{path} has sha256 {actual}, expected {expected} for "
            f"llama-cpp-python {LLAMA_CPP_PYTHON_VERSION}; refusing to build from it "
            "(delete it and let the build download a fresh copy)"
        )


def download_sdist(dest: Path) -> Path:
    """Fetch the pinned sdist with pip (the one route to PyPI we can count on)."""
    dest.mkdir(parents=True, exist_ok=True)
    python = sys.executable
    if getattr(sys, "frozen", False):
        # In the one-file llmgw, sys.executable is llmgw itself, which has no pip.
        found = shutil.which("python3") or shutil.which("python")
        if found is None:
            raise ProvisionError(
                f"downloading llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} needs pip, and this "
                "llmgw binary has none: install python3 with pip, or pass --sdist FILE"
            )
        python = found
    cmd = [
        python,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-binary",
        ":all:",
        "--disable-pip-version-check",
        f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}",
        "-d",
        str(dest),
    ]
    r = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    target = dest / SDIST_FILENAME
    if r.returncode != 0 or not target.is_file():
        tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-15:])
        raise ProvisionError(
            f"could not download llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} from PyPI "
            f"with pip (exit {r.returncode}); pass --sdist FILE to use a copy you already "
            f"have.\n{tail}"
        )
    return target


def _member_target(dest: Path, name: str) -> Path:
    """Where ``name`` lands under ``dest``; refuses anything that escapes it."""
    try:
        target = resolve_inside(dest, relative_path(name))
    except PathRefused:
        target = None
    if target is None:
        raise ProvisionError(f"refusing to extract {name!r}: it points outside the target directory")
    return target


def _check_member(dest: Path, m: tarfile.TarInfo) -> None:
    target = _member_target(dest, m.name)
    if m.issym() or m.islnk():
        # A link resolved relative to its own directory (symlink) or the
        # archive root (hard link) must also stay inside dest.
        base = target.parent if m.issym() else dest.resolve()
        if PurePosixPath(m.linkname).is_absolute():
            raise ProvisionError(f"refusing to extract {m.name!r}: absolute link to {m.linkname!r}")
        _member_target(dest, os.path.relpath(base / m.linkname, dest.resolve()))
    elif not (m.isfile() or m.isdir()):
        raise ProvisionError(f"refusing to extract {m.name!r}: not a regular file or directory")


def safe_extract(sdist: Path, dest: Path, select: Callable[[str], bool] | None = None) -> list[str]:
    """Extract (the selected members of) ``sdist`` into ``dest``; returns the names.

    Every member is checked before anything is written, so a hostile archive
    leaves nothing behind.
    """
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist, "r:*") as tf:
        members = [m for m in tf.getmembers() if select is None or select(m.name)]
        for m in members:
            _check_member(dest, m)
        if hasattr(tarfile, "data_filter"):
            tf.extractall(dest, members=members, filter="data")
        else:  # a Python from before extraction filters (3.11.4)
            tf.extractall(dest, members=members)
    return [m.name for m in members]


def _sdist_root(names: list[str]) -> str:
    tops = {PurePosixPath(n).parts[0] for n in names if n}
    if len(tops) != 1:
        raise ProvisionError(f"unexpected sdist layout: top-level entries {sorted(tops)[:5]}")
    return tops.pop()


def _extract_vocabs(sdist: Path, vocabs: tuple[str, ...]) -> dict[str, Path]:
    """Copy the named vocab GGUFs from the sdist into the cache atomically."""
    wanted = {vocab_filename(v) for v in vocabs}
    out_dir = vocab_dir()
    out_dir.mkdir(parents=True, exist_ok=True)

    def select(name: str) -> bool:
        p = PurePosixPath(name)
        return p.name in wanted and "/".join(p.parts[1:-1]) == VOCAB_SUBDIR

    found: dict[str, Path] = {}
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".extract-") as tmp:
        for name in safe_extract(sdist, Path(tmp), select):
            src = Path(tmp) / name
            final = out_dir / src.name
            replace_durably(src, final)
            found[src.name] = final
    missing = wanted - set(found)
    if missing:
        raise ProvisionError(f"{sdist} has no {', '.join(sorted(missing))}")
    return found


# ---------------------------------------------------------------- build


def parse_cmake_progress(line: str) -> float | None:
    """The percentage of a ``[ 34%] Building ...`` line, else None."""
    m = _CMAKE_PERCENT.match(line.lstrip())
    return float(m.group(1)) if m else None


def _find_compiler(env: str, names: tuple[str, ...]) -> str | None:
    # Mirrors what cmake will look for: $CC/$CXX first, then the usual names.
    chosen = os.environ.get(env)
    if chosen:
        return chosen if shutil.which(chosen.split()[0]) else None
    return next((c for c in names if shutil.which(c)), None)


def check_toolchain() -> None:
    missing = []
    if not shutil.which("cmake"):
        missing.append("cmake")
    if _find_compiler("CC", ("cc", "gcc", "clang")) is None:
        missing.append("a C compiler")
    if _find_compiler("CXX", ("c++", "g++", "clang++")) is None:
        missing.append("a C++ compiler")
    if not (shutil.which("make") or shutil.which("ninja")):
        missing.append("make")
    if missing:
        raise ProvisionError(
            f"building llama-server needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} "
            f"not installed: {INSTALL_HINT}"
        )


def _run_logged(cmd: list[str], log, on_line: Callable[[str], None] | None = None, cwd: Path | None = None) -> None:
    """Run ``cmd``, appending its output to ``log``; the tail goes into the error."""
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    tail: deque[str] = deque(maxlen=25)
    with subprocess.Popen(
        cmd,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        bufsize=1,
    ) as p:
        assert p.stdout is not None
        for line in p.stdout:
            log.write(line)
            tail.append(line.rstrip("\n"))
            if on_line:
                on_line(line)
        rc = p.wait()
    log.flush()
    if rc != 0:
        raise ProvisionError(
            f"`{' '.join(cmd[:3])} ...` failed with exit {rc} (full log: {log.name}):\n" + "\n".join(tail)
        )


@contextmanager
def _install_lock() -> Iterator[None]:
    # Serialise concurrent builds (parallel test runners) on one cache dir.
    d = install_dir()
    d.mkdir(parents=True, exist_ok=True)
    with open(d / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _obtain_sdist(sdist: Path | None, workdir: Path, progress: Progress) -> Path:
    if sdist is None:
        progress("download", None)
        sdist = download_sdist(workdir / "download")
        progress("download", 100.0)
    elif not Path(sdist).is_file():
        raise ProvisionError(f"{sdist}: no such file")
    progress("verify", None)
    verify_sdist(Path(sdist))
    progress("verify", 100.0)
    return Path(sdist)


def _noop(phase: str, pct: float | None) -> None:
    pass


def build_llama_server(
    progress: Progress | None = None,
    *,
    sdist: Path | str | None = None,
    force: bool = False,
    jobs: int | None = None,
) -> Path:
    """Build (or reuse) the cached llama-server and return its path.

    ``progress(phase, percent)`` is called with phases download, verify,
    extract, configure, build, install (and cached when a build is reused);
    ``percent`` is 0-100, or None when unknown. During ``build`` it follows
    cmake's ``[ NN%]`` lines.
    """
    progress = progress or _noop
    final = cached_binary_path()
    with _install_lock():
        if not force and binary_works(final):
            progress("cached", 100.0)
            return final
        check_toolchain()
        root = install_dir()
        with tempfile.TemporaryDirectory(dir=root, prefix=".build-") as tmp:
            work = Path(tmp)
            src_sdist = _obtain_sdist(Path(sdist) if sdist else None, work, progress)

            progress("extract", None)
            names = safe_extract(src_sdist, work / "src")
            src = work / "src" / _sdist_root(names) / LLAMA_CPP_SUBDIR
            if not (src / "CMakeLists.txt").is_file():
                raise ProvisionError(f"{src_sdist} has no {LLAMA_CPP_SUBDIR}/CMakeLists.txt")
            _extract_vocabs(src_sdist, DEFAULT_VOCABS)
            progress("extract", 100.0)

            build = work / "build"
            log_path = root / "build.log"
            with open(log_path, "w") as log:
                progress("configure", None)
                _run_logged(["cmake", "-S", str(src), "-B", str(build), *CMAKE_FLAGS], log)
                progress("configure", 100.0)

                progress("build", 0.0)

                def on_line(line: str) -> None:
                    pct = parse_cmake_progress(line)
                    if pct is not None:
                        progress("build", pct)

                n = str(jobs or os.cpu_count() or 1)
                _run_logged(["cmake", "--build", str(build), "--target", BUILD_TARGET, "-j", n], log, on_line)
                progress("build", 100.0)

            progress("install", None)
            built = build / "bin" / BUILD_TARGET
            if not built.is_file():
                raise ProvisionError(f"the build finished but produced no {built}")
            final.parent.mkdir(parents=True, exist_ok=True)
            # Copy to a temp name beside the final one, check it runs, then
            # rename: readers never see a half-written binary.
            tmp_bin = final.with_name(f".{final.name}.tmp-{os.getpid()}")
            shutil.copy2(built, tmp_bin)
            os.chmod(tmp_bin, 0o755)
            if not binary_works(tmp_bin):
                tmp_bin.unlink(missing_ok=True)
                raise ProvisionError(f"the freshly built llama-server does not run `--version` (log: {log_path})")
            replace_durably(tmp_bin, final)
            progress("install", 100.0)
    return final


def vocab_path(name: str = "llama-spm", *, sdist: Path | str | None = None) -> Path:
    """Path of ``ggml-vocab-<name>.gguf`` from the pinned sdist, fetched if needed.

    Only downloads (or reads ``sdist``) and extracts that one file; no build.
    """
    bundled = Path(__file__).resolve().parents[2] / "vocab" / vocab_filename(name)
    if bundled.is_file():  # the frozen binary carries the default one (build/pyinstaller.spec)
        return bundled
    target = vocab_dir() / vocab_filename(name)
    if target.is_file():
        return target
    with _install_lock():
        if target.is_file():
            return target
        with tempfile.TemporaryDirectory(dir=install_dir(), prefix=".vocab-") as tmp:
            src = _obtain_sdist(Path(sdist) if sdist else None, Path(tmp), _noop)
            _extract_vocabs(src, (name,))
    return target


# ---------------------------------------------------------------- CLI


def _console_progress() -> Progress:
    last: dict[str, object] = {"phase": None, "pct": -10.0}

    def report(phase: str, pct: float | None) -> None:
        # One line per phase, then every 10% of the build, on stderr so
        # --print-path output stays machine-readable.
        if phase != last["phase"]:
            last["phase"], last["pct"] = phase, -10.0
            print(f"llama-server: {phase}...", file=sys.stderr, flush=True)
        if phase == "build" and pct is not None and (pct >= float(last["pct"]) + 10 or pct == 100):  # type: ignore[arg-type]
            last["pct"] = pct
            print(f"llama-server: build {pct:.0f}%", file=sys.stderr, flush=True)

    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="build-llama-server",
        description=(
            f"Build llama-server (CPU) from the llama.cpp source in the llama-cpp-python "
            f"{LLAMA_CPP_PYTHON_VERSION} sdist and cache it under {cache_dir()}."
        ),
    )
    ap.add_argument("--print-path", action="store_true", help="print the binary path (building it if missing)")
    ap.add_argument("--sdist", metavar="FILE", help="use this already-downloaded sdist (still sha256-checked)")
    ap.add_argument("--force", action="store_true", help="rebuild even when a cached binary works")
    ap.add_argument("-j", "--jobs", type=int, default=None, help="parallel compile jobs (default: CPU count)")
    args = ap.parse_args(argv)
    try:
        path = build_llama_server(_console_progress(), sdist=args.sdist, force=args.force, jobs=args.jobs)
    except ProvisionError as e:
        print(f"build-llama-server: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    if args.print_path:
        print(path)
    else:
        print(f"llama-server ready: {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
