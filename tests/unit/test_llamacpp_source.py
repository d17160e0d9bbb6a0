"""Unit tests for the llama-server source build, with a fake sdist and a fake cmake."""

from __future__ import annotations

import hashlib
import io
import os
import stat
import sys
import tarfile
from pathlib import Path

import pytest

from llmgw.agent.provision import llamacpp_source as ls
from llmgw.agent.provision.status import ProvisionError

ROOT = "llama_cpp_python-0.3.36"
FAKE_CMAKE = r"""#!/usr/bin/env python3
# Stands in for cmake: records its argv, "configures" and "builds" a fake llama-server.
import os, sys
args = sys.argv[1:]
with open(os.environ["FAKE_CMAKE_LOG"], "a") as f:
    f.write(" ".join(args) + "\n")
if "--build" in args:
    if os.environ.get("FAKE_CMAKE_FAIL"):
        print("error: the compiler exploded")
        sys.exit(2)
    build = args[args.index("--build") + 1]
    for pct in (3, 34, 67, 100):
        print(f"[{pct:3d}%] Building CXX object x.o", flush=True)
    os.makedirs(os.path.join(build, "bin"), exist_ok=True)
    out = os.path.join(build, "bin", "llama-server")
    with open(out, "w") as f:
        f.write("#!/bin/sh\necho 'version: 1 (fake)' >&2\nexit 0\n")
    os.chmod(out, 0o755)
else:
    os.makedirs(args[args.index("-B") + 1], exist_ok=True)
    print("-- Configuring done")
"""


def _add(tf: tarfile.TarFile, name: str, data: bytes = b"x", **attrs) -> None:
    ti = tarfile.TarInfo(name)
    ti.size = len(data)
    for k, v in attrs.items():
        setattr(ti, k, v)
    tf.addfile(ti, io.BytesIO(data) if ti.isfile() else None)


def make_sdist(path: Path, extra=None) -> str:
    with tarfile.open(path, "w:gz") as tf:
        _add(tf, f"{ROOT}/PKG-INFO", b"Name: llama_cpp_python\n")
        _add(tf, f"{ROOT}/vendor/llama.cpp/CMakeLists.txt", b"project(llama)\n")
        _add(tf, f"{ROOT}/vendor/llama.cpp/models/ggml-vocab-llama-spm.gguf", b"GGUF-spm")
        _add(tf, f"{ROOT}/vendor/llama.cpp/models/ggml-vocab-llama-bpe.gguf", b"GGUF-bpe")
        for args in extra or ():
            _add(tf, *args[:2], **(args[2] if len(args) > 2 else {}))
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("LLMGW_CACHE_DIR", str(d))
    return d


@pytest.fixture
def sdist(tmp_path, monkeypatch):
    p = tmp_path / ls.SDIST_FILENAME
    monkeypatch.setattr(ls, "SDIST_SHA256", make_sdist(p))
    return p


@pytest.fixture
def fake_tools(tmp_path, monkeypatch):
    """A PATH with only a fake cmake and stand-in compilers/make."""
    bindir = tmp_path / "fakebin"
    bindir.mkdir()
    (bindir / "cmake").write_text(FAKE_CMAKE.replace("/usr/bin/env python3", sys.executable, 1))
    for tool in ("cc", "c++", "make"):
        (bindir / tool).write_text("#!/bin/sh\nexit 0\n")
    for f in bindir.iterdir():
        f.chmod(0o755)
    log = tmp_path / "cmake.log"
    monkeypatch.setenv("PATH", str(bindir))
    monkeypatch.setenv("FAKE_CMAKE_LOG", str(log))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    return log


def _exe(path: Path, rc: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\nexit {rc}\n")
    path.chmod(0o755)
    return path


def test_cache_dir_env_override(cache):
    assert ls.cache_dir() == cache
    assert ls.cached_binary_path() == cache / "llama-server-0.3.36" / "bin" / "llama-server"
    assert ls.vocab_dir() == cache / "llama-server-0.3.36" / "vocab"


def test_cache_dir_default(monkeypatch, tmp_path):
    monkeypatch.delenv("LLMGW_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert ls.cache_dir() == tmp_path / ".cache" / "llmgw"


def test_the_llamacpp_sdist_is_pinned_by_version_and_sha256_and_built_static():
    assert ls.LLAMA_CPP_PYTHON_VERSION == "0.3.36"
    assert ls.SDIST_SHA256 == "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
    assert "-DBUILD_SHARED_LIBS=OFF" in ls.CMAKE_FLAGS
    assert "-DLLAMA_BUILD_SERVER=ON" in ls.CMAKE_FLAGS


@pytest.mark.parametrize(
    "line,pct",
    [
        ("[ 34%] Building CXX object foo.o", 34.0),
        ("[  0%] Built target ggml", 0.0),
        ("[100%] Linking CXX executable ../../bin/llama-server", 100.0),
        ("  [  7%] Building C object x", 7.0),
        ("-- Configuring done", None),
        ("gmake[2]: Entering directory", None),
        ("", None),
    ],
)
def test_parse_cmake_progress(line, pct):
    assert ls.parse_cmake_progress(line) == pct


def test_vocab_filename_rejects_paths():
    assert ls.vocab_filename("llama-spm") == "ggml-vocab-llama-spm.gguf"
    for bad in ("../x", "a/b", "", ".hidden"):
        with pytest.raises(ValueError):
            ls.vocab_filename(bad)


def test_verify_sdist_mismatch_is_clear(tmp_path):
    p = tmp_path / "x.tar.gz"
    p.write_bytes(b"not the sdist")
    with pytest.raises(ProvisionError, match="expected 832db069.*refusing"):
        ls.verify_sdist(p)


def test_verify_sdist_ok(tmp_path):
    p = tmp_path / "x"
    p.write_bytes(b"abc")
    ls.verify_sdist(p, hashlib.sha256(b"abc").hexdigest())


def test_safe_extract_normal(tmp_path, sdist):
    names = ls.safe_extract(sdist, tmp_path / "out")
    assert f"{ROOT}/vendor/llama.cpp/CMakeLists.txt" in names
    assert (tmp_path / "out" / ROOT / "vendor/llama.cpp/models/ggml-vocab-llama-spm.gguf").read_bytes() == b"GGUF-spm"


def test_safe_extract_select(tmp_path, sdist):
    names = ls.safe_extract(sdist, tmp_path / "out", lambda n: n.endswith("PKG-INFO"))
    assert names == [f"{ROOT}/PKG-INFO"]
    assert not (tmp_path / "out" / ROOT / "vendor").exists()


@pytest.mark.parametrize(
    "member",
    [
        ("../evil.txt", b"x"),
        (f"{ROOT}/../../evil.txt", b"x"),
        ("/tmp/evil.txt", b"x"),
        (f"{ROOT}/link", b"", {"type": tarfile.SYMTYPE, "linkname": "../../etc/passwd"}),
        (f"{ROOT}/abslink", b"", {"type": tarfile.SYMTYPE, "linkname": "/etc/passwd"}),
        (f"{ROOT}/hard", b"", {"type": tarfile.LNKTYPE, "linkname": "../outside"}),
        (f"{ROOT}/dev", b"", {"type": tarfile.CHRTYPE}),
    ],
)
def test_safe_extract_refuses_escapes(tmp_path, member):
    p = tmp_path / "evil.tar.gz"
    make_sdist(p, extra=[member])
    out = tmp_path / "out"
    with pytest.raises(ProvisionError, match="refusing to extract"):
        ls.safe_extract(p, out)
    # Checked before writing: nothing at all was extracted.
    assert not any(out.rglob("*"))
    assert not (tmp_path / "evil.txt").exists()


def test_safe_extract_allows_inner_symlink(tmp_path):
    p = tmp_path / "ok.tar.gz"
    make_sdist(p, extra=[(f"{ROOT}/vendor/alias", b"", {"type": tarfile.SYMTYPE, "linkname": "llama.cpp"})])
    ls.safe_extract(p, tmp_path / "out")
    assert (tmp_path / "out" / ROOT / "vendor" / "alias").is_symlink()


def test_find_llama_server_explicit(tmp_path, cache, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    exe = _exe(tmp_path / "my-llama-server")
    assert ls.find_llama_server(str(exe)) == exe.resolve()
    # A wrong explicit path does not fall back to something else.
    _exe(ls.cached_binary_path())
    assert ls.find_llama_server(str(tmp_path / "missing")) is None


def test_find_llama_server_path_before_cache(tmp_path, cache, monkeypatch):
    bindir = tmp_path / "bin"
    on_path = _exe(bindir / "llama-server")
    _exe(ls.cached_binary_path())
    monkeypatch.setenv("PATH", str(bindir))
    assert ls.find_llama_server() == on_path


def test_find_llama_server_cache_must_run(tmp_path, cache, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert ls.find_llama_server() is None
    _exe(ls.cached_binary_path(), rc=1)
    assert ls.find_llama_server() is None  # broken binary is not "found"
    _exe(ls.cached_binary_path(), rc=0)
    assert ls.find_llama_server() == ls.cached_binary_path()


def test_missing_toolchain_says_what_to_install(tmp_path, cache, monkeypatch, sdist):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(ProvisionError, match=r"needs cmake.*apt-get install cmake g\+\+"):
        ls.build_llama_server(sdist=sdist)


def test_build_with_fake_cmake(cache, sdist, fake_tools):
    events: list[tuple[str, float | None]] = []
    path = ls.build_llama_server(lambda ph, pct: events.append((ph, pct)), sdist=sdist, jobs=3)
    assert path == ls.cached_binary_path()
    assert os.stat(path).st_mode & stat.S_IXUSR
    assert ls.binary_works(path)
    # Only the chosen vocab is kept, and no temp directories are left behind.
    assert (ls.vocab_dir() / "ggml-vocab-llama-spm.gguf").read_bytes() == b"GGUF-spm"
    assert not (ls.vocab_dir() / "ggml-vocab-llama-bpe.gguf").exists()
    leftovers = [p.name for p in ls.install_dir().iterdir() if p.name.startswith(".") and p.name != ".lock"]
    assert leftovers == []
    assert [p.name for p in path.parent.iterdir()] == ["llama-server"]

    phases = [ph for ph, _ in events]
    for ph in ("verify", "extract", "configure", "build", "install"):
        assert ph in phases
    assert "download" not in phases  # --sdist given
    build_pcts = [pct for ph, pct in events if ph == "build"]
    assert build_pcts == [0.0, 3.0, 34.0, 67.0, 100.0, 100.0]

    calls = fake_tools.read_text().splitlines()
    assert len(calls) == 2
    configure, build = calls
    for flag in ls.CMAKE_FLAGS:
        assert flag in configure.split()
    assert "vendor/llama.cpp" in configure
    assert build.endswith("--target llama-server -j 3")

    # Second call reuses the cache without running cmake.
    events.clear()
    assert ls.build_llama_server(lambda ph, pct: events.append((ph, pct)), sdist=sdist) == path
    assert events == [("cached", 100.0)]
    assert len(fake_tools.read_text().splitlines()) == 2

    # --force rebuilds.
    ls.build_llama_server(sdist=sdist, force=True)
    assert len(fake_tools.read_text().splitlines()) == 4


def test_build_failure_leaves_no_binary(cache, sdist, fake_tools, monkeypatch):
    monkeypatch.setenv("FAKE_CMAKE_FAIL", "1")
    with pytest.raises(ProvisionError, match="the compiler exploded"):
        ls.build_llama_server(sdist=sdist)
    assert not ls.cached_binary_path().exists()
    assert (ls.install_dir() / "build.log").is_file()


def test_build_refuses_bad_sdist(cache, tmp_path, fake_tools):
    bad = tmp_path / ls.SDIST_FILENAME
    make_sdist(bad)  # SDIST_SHA256 left at the real pin: mismatch
    with pytest.raises(ProvisionError, match="sha256"):
        ls.build_llama_server(sdist=bad)
    assert not fake_tools.exists()  # cmake never ran


def test_vocab_path_extracts_only_vocab(cache, sdist):
    p = ls.vocab_path("llama-bpe", sdist=sdist)
    assert p == ls.vocab_dir() / "ggml-vocab-llama-bpe.gguf"
    assert p.read_bytes() == b"GGUF-bpe"
    assert not ls.cached_binary_path().exists()
    # Cached: no sdist needed the second time.
    assert ls.vocab_path("llama-bpe", sdist="/nonexistent") == p


def test_vocab_path_unknown(cache, sdist):
    with pytest.raises(ProvisionError, match="ggml-vocab-nope.gguf"):
        ls.vocab_path("nope", sdist=sdist)


def test_vocab_path_downloads_with_pip(cache, monkeypatch, tmp_path):
    src = tmp_path / "src.tar.gz"
    monkeypatch.setattr(ls, "SDIST_SHA256", make_sdist(src))
    seen = {}

    def fake_download(dest: Path) -> Path:
        seen["dest"] = dest
        dest.mkdir(parents=True, exist_ok=True)
        out = dest / ls.SDIST_FILENAME
        out.write_bytes(src.read_bytes())
        return out

    monkeypatch.setattr(ls, "download_sdist", fake_download)
    assert ls.vocab_path().read_bytes() == b"GGUF-spm"
    assert "dest" in seen and not seen["dest"].exists()  # temp download cleaned up


def test_main_print_path(cache, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    _exe(ls.cached_binary_path())
    assert ls.main(["--print-path"]) == 0
    assert capsys.readouterr().out.strip() == str(ls.cached_binary_path())


def test_main_reports_errors(cache, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert ls.main(["--sdist", str(tmp_path / "missing.tar.gz")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("build-llama-server: ")
