"""vLLM and SGLang as uv environments: decisions and commands, with uv faked.

uv itself is installed for real from a local release server (a shell script
standing in for it); what it is then asked to do is answered by a fake, since
a real vLLM needs a GPU and gigabytes.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from datetime import UTC, datetime
from pathlib import Path

import pytest
from aiohttp import web

from llmgw.agent.provision.host import HostFacts
from llmgw.agent.provision.manager import Installer, Want
from llmgw.agent.provision.os_packages import PackageInstaller
from llmgw.agent.provision.python_engines import (
    LOCK_NAME,
    UV_VERSION,
    PythonEngineInstaller,
    choose_build,
    compile_command,
    cuda_gate,
    exclude_newer,
    install_command,
    uv_env,
    venv_command,
)
from llmgw.agent.provision.runner import CommandResult, run_command
from llmgw.agent.provision.status import NotHere, ProvisionError, Unsupported
from llmgw.protocol import ProvisionState

GPU_NODE = HostFacts(arch="amd64", os_id="ubuntu", nvidia_driver="580.65.06", min_compute_capability=8.0)
CPU_NODE = HostFacts(arch="amd64", os_id="ubuntu", cpu_flags=frozenset({"avx2"}))
UV_ASSET = "uv-x86_64-unknown-linux-gnu.tar.gz"
FAKE_UV = f'#!/bin/sh\n[ "$1" = "--version" ] && echo "uv {UV_VERSION}" && exit 0\nexit 2\n'
PYPI_VLLM = {
    "info": {"name": "vllm"},
    "urls": [
        {
            "filename": "vllm-0.30.0-cp38-abi3-manylinux_2_31_x86_64.whl",
            "upload_time_iso_8601": "2026-09-22T05:22:21.647189Z",
        },
        {"filename": "vllm-0.30.0.tar.gz", "upload_time_iso_8601": "2026-09-22T05:23:10.039243Z"},
    ],
}


def uv_archive() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        data = FAKE_UV.encode()
        ti = tarfile.TarInfo("uv-x86_64-unknown-linux-gnu/uv")
        ti.size, ti.mode = len(data), 0o755
        tf.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


@pytest.fixture
async def servers():
    """One local server as GitHub (uv's release) and PyPI both."""
    archive = uv_archive()
    files = {
        f"/uv/{UV_VERSION}/{UV_ASSET}": archive,
        f"/uv/{UV_VERSION}/{UV_ASSET}.sha256": f"{hashlib.sha256(archive).hexdigest()} *{UV_ASSET}\n".encode(),
        "/pypi/vllm/0.30.0/json": json.dumps(PYPI_VLLM).encode(),
        "/pypi/sglang/0.5.20/json": json.dumps({"urls": [{"upload_time_iso_8601": "2026-09-01T10:00:00Z"}]}).encode(),
    }
    requests: list[str] = []

    async def handle(request: web.Request) -> web.Response:
        requests.append(request.path)
        if request.path not in files:
            raise web.HTTPNotFound()
        return web.Response(body=files[request.path])

    app = web.Application()
    app.router.add_get("/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    yield url, requests
    await runner.cleanup()


class FakeUV:
    """uv's venv/compile/install; package tools; everything else really run."""

    def __init__(self, installed=("gcc",), fail_install: str | None = None):
        self.installed = set(installed)
        self.fail_install = fail_install
        self.calls: list[tuple[list[str], dict, str | None]] = []

    async def __call__(self, argv, *, env=None, stdin=None, timeout=None):
        argv = list(argv)
        self.calls.append((argv, dict(env or {}), stdin))
        if argv[0] == "dpkg-query":
            return CommandResult(0, "ii ") if argv[-1] in self.installed else CommandResult(1, "")
        if argv[0] == "apt-get":
            if "install" in argv:
                self.installed.update(a for a in argv[argv.index("install") + 1 :] if not a.startswith("-"))
            return CommandResult(0, "")
        if argv[0].endswith("/uv") and argv[1] == "venv":
            venv = Path(argv[-1])
            (venv / "bin").mkdir(parents=True)
            (venv / "bin" / "python").write_text("#!/bin/sh\n")
            (venv / "bin" / "python").chmod(0o755)
            return CommandResult(0, "Creating virtual environment")
        if argv[0].endswith("/uv") and argv[1:3] == ["pip", "compile"]:
            lock = Path(argv[argv.index("--output-file") + 1])
            lock.write_text("".join(f"{r} \\\n    --hash=sha256:{'ab' * 32}\n" for r in stdin.split()))
            return CommandResult(0, "")
        if argv[0].endswith("/uv") and argv[1:3] == ["pip", "install"]:
            if self.fail_install:
                return CommandResult(1, self.fail_install)
            venv = Path(argv[argv.index("--python") + 1]).parent.parent
            vllm = venv / "bin" / "vllm"
            vllm.write_text('#!/bin/sh\n[ "$1" = --version ] && echo 0.30.0\n')
            vllm.chmod(0o755)
            # SGLang is proved by importing it with the environment's python.
            (venv / "bin" / "python").write_text("#!/bin/sh\necho sglang 0.5.20\n")
            return CommandResult(0, "Installed 187 packages")
        return await run_command(argv, env=env, stdin=stdin, timeout=timeout)

    def uv_calls(self):
        return [(c, env, stdin) for c, env, stdin in self.calls if c[0].endswith("/uv") and c[1] != "--version"]


def make(tmp_path, servers, system, host=GPU_NODE, free=100.0):
    url, _ = servers
    seen: list = []
    packages = PackageInstaller(system, which=lambda t: "/usr/bin/apt-get" if t == "apt-get" else None)
    python = PythonEngineInstaller(
        tmp_path / "engines",
        host,
        run=system,
        packages=packages,
        pypi_base=url,
        uv_base_url=url + "/uv",
        free_space=lambda p: free,
    )
    inst = Installer(tmp_path / "engines", host, on_status=seen.append, run=system, packages=packages, python=python)
    return inst, seen


# ----------------------------------------------------------------- commands


def test_uv_commands_make_a_relocatable_venv_and_install_only_hashed_pins():
    uv, py, lock = Path("/e/uv/uv"), Path("/e/vllm/v/bin/python"), Path("/e/vllm/v/" + LOCK_NAME)
    assert venv_command(uv, "3.12", Path("/e/vllm/v")) == [
        "/e/uv/uv",
        "venv",
        "--relocatable",
        "--python",
        "3.12",
        "/e/vllm/v",
    ]
    assert compile_command(uv, py, "2026-09-23T05:23:10Z", lock) == [
        "/e/uv/uv",
        "pip",
        "compile",
        "--python",
        str(py),
        "--exclude-newer",
        "2026-09-23T05:23:10Z",
        "--generate-hashes",
        "--quiet",
        "--output-file",
        str(lock),
        "-",
    ]
    assert install_command(uv, py, lock) == [
        "/e/uv/uv",
        "pip",
        "install",
        "--python",
        str(py),
        "--require-hashes",
        "--no-deps",
        "-r",
        str(lock),
    ]
    assert uv_env(Path("/e")) == {
        "UV_CACHE_DIR": "/e/.uv-cache",
        "UV_PYTHON_INSTALL_DIR": "/e/python",
        "UV_PYTHON_PREFERENCE": "only-managed",
        "UV_NO_CONFIG": "1",
    }


def test_resolution_is_as_pypi_stood_a_day_after_the_last_file():
    assert exclude_newer([u["upload_time_iso_8601"] for u in PYPI_VLLM["urls"]]) == "2026-09-23T05:23:10Z"
    assert exclude_newer([datetime(2026, 1, 31, 23, 0, tzinfo=UTC)]) == "2026-02-01T23:00:00Z"
    with pytest.raises(ProvisionError):
        exclude_newer([])


@pytest.mark.parametrize(
    "host, exc, words",
    [
        (CPU_NODE, NotHere, "runs on NVIDIA GPUs and this node has none"),
        (
            HostFacts(arch="amd64", nvidia_driver="550.54.15"),
            Unsupported,
            "needs NVIDIA driver 580 or newer; this node has 550.54.15",
        ),
        (
            HostFacts(arch="amd64", nvidia_driver="580.65.06", min_compute_capability=7.0),
            Unsupported,
            "compute capability 7.5 and newer; this node has one of 7.0",
        ),
        (HostFacts(arch="ppc64el", nvidia_driver="580.65.06"), Unsupported, "no Linux build for ppc64el"),
    ],
)
def test_vllm_is_not_for_every_node(host, exc, words):
    with pytest.raises(exc, match=words):
        cuda_gate("vLLM", host)


def test_engine_builds_are_chosen_per_version_and_host_and_bad_versions_refused():
    b = choose_build("vllm", "0.30.0", GPU_NODE)
    assert (b.variant, b.python, b.requirements, b.engine.binary) == ("cu13", "3.12", ("vllm==0.30.0",), "vllm")
    assert b.packages == {"deb": ("gcc",), "rpm": ("gcc",)} and b.free_gb == 25
    s = choose_build("sglang", "0.5.20", GPU_NODE)
    assert s.engine.binary == "python" and s.engine.version_args[0] == "-c"
    assert choose_build("vllm", "0.30.0", HostFacts(arch="arm64", nvidia_driver="580.1")).variant == "cu13"
    with pytest.raises(ProvisionError, match="is not a vLLM version"):
        choose_build("vllm", "0.30.0; rm -rf /", GPU_NODE)


# ----------------------------------------------------------------- installs


async def test_vllm_is_installed_on_a_gpu_node(tmp_path, servers):
    system = FakeUV(installed=())
    inst, seen = make(tmp_path, servers, system)
    [st] = await inst.converge([Want("vllm", "0.30.0")])

    assert st.state == ProvisionState.READY, st
    target = tmp_path / "engines" / "vllm" / "0.30.0-cu13"
    assert st.binary == str(target / "bin" / "vllm") and st.variant == "cu13"
    assert st.detail == "vllm 0.30.0"
    assert "gcc" in system.installed, "Triton's compiler was not installed"

    calls = system.uv_calls()
    uv = str(tmp_path / "engines" / "uv" / f"{UV_VERSION}-x86_64" / "uv-x86_64-unknown-linux-gnu" / "uv")
    assert [c[0][:2] for c in calls] == [[uv, "venv"], [uv, "pip"], [uv, "pip"]]
    venv_cmd, compile_cmd, install_cmd = (c[0] for c in calls)
    assert venv_cmd[2:5] == ["--relocatable", "--python", "3.12"]
    assert compile_cmd[compile_cmd.index("--exclude-newer") + 1] == "2026-09-23T05:23:10Z"
    assert "--generate-hashes" in compile_cmd and calls[1][2] == "vllm==0.30.0\n"
    assert "--require-hashes" in install_cmd and "--no-deps" in install_cmd
    assert all(c[1]["UV_PYTHON_PREFERENCE"] == "only-managed" and c[1]["UV_NO_CONFIG"] == "1" for c in calls)
    # Built in a scratch directory, renamed into place.
    assert ".partial-" in venv_cmd[-1] and Path(venv_cmd[-1]).parent.parent == target.parent

    assert (target / LOCK_NAME).read_text().startswith("vllm==0.30.0")
    assert not (tmp_path / "engines" / ".uv-cache").exists(), "the download cache was left behind"
    marker = json.loads((target / ".llmgw-installed").read_text())
    assert marker["exclude_newer"] == "2026-09-23T05:23:10Z" and marker["requirements"] == ["vllm==0.30.0"]
    assert marker["uv"] == UV_VERSION and marker["source"] == "uv"
    assert sorted(p.name for p in (tmp_path / "engines" / "vllm").iterdir()) == ["0.30.0-cu13"]
    assert any("resolving vllm==0.30.0 against PyPI as of 2026-09-23" in s.detail for s in seen)

    # The next pass checks, and installs nothing.
    before = len(system.uv_calls())
    [again] = await inst.converge([Want("vllm", "0.30.0")])
    assert again.state == ProvisionState.READY and len(system.uv_calls()) == before


async def test_sglang_is_proved_by_importing_it(tmp_path, servers):
    system = FakeUV()
    inst, _ = make(tmp_path, servers, system)
    [st] = await inst.converge([Want("sglang", "0.5.20")])
    assert st.state == ProvisionState.READY, st
    assert st.binary.endswith("/sglang/0.5.20-cu13/bin/python") and st.detail == "python sglang 0.5.20"
    # Proved in its scratch directory before the rename.
    proof = [c for c, _, _ in system.calls if c[0].endswith("/bin/python")]
    assert proof and proof[-1][1:] == ["-c", "import sglang; print('sglang', sglang.__version__)"]


@pytest.mark.parametrize(
    "host, state, words",
    [
        (CPU_NODE, ProvisionState.SKIPPED, "has none"),
        (HostFacts(arch="amd64", os_id="ubuntu", nvidia_driver="550.54.15"), ProvisionState.UNSUPPORTED, "driver 580"),
        (
            HostFacts(arch="amd64", os_id="ubuntu", nvidia_driver="580.65.06", min_compute_capability=7.0),
            ProvisionState.UNSUPPORTED,
            "7.5",
        ),
    ],
)
async def test_a_node_that_cannot_run_it_touches_nothing(tmp_path, servers, host, state, words):
    _, requests = servers
    system = FakeUV(installed=())
    inst, _seen = make(tmp_path, servers, system, host=host)
    [st] = await inst.converge([Want("vllm", "0.30.0")])
    assert st.state == state and words in st.detail
    assert system.calls == [] and requests == []
    assert not (tmp_path / "engines").exists()


async def test_a_python_engine_is_refused_without_the_disk_for_it(tmp_path, servers):
    _, requests = servers
    inst, _ = make(tmp_path, servers, FakeUV(), free=12.5)
    [st] = await inst.converge([Want("vllm", "0.30.0")])
    assert st.state == ProvisionState.FAILED
    assert "needs about 25 GB free" in st.detail and "there are 12.5 GB" in st.detail
    assert requests == []


async def test_a_failed_python_install_leaves_nothing_that_looks_installed(tmp_path, servers):
    system = FakeUV(fail_install="error: Hash mismatch for `torch==2.13.0`\n  Expected: sha256:ab\n")
    inst, _ = make(tmp_path, servers, system)
    (tmp_path / "engines" / ".uv-cache").mkdir(parents=True)
    [st] = await inst.converge([Want("vllm", "0.30.0")])
    assert st.state == ProvisionState.FAILED and "Hash mismatch" in st.detail
    assert list((tmp_path / "engines" / "vllm").iterdir()) == []
    assert (tmp_path / "engines" / ".uv-cache").exists(), "the cache is kept for the next attempt"


async def test_a_version_pypi_does_not_have_is_said_so(tmp_path, servers):
    inst, _ = make(tmp_path, servers, FakeUV())
    [st] = await inst.converge([Want("vllm", "9.9.9")])
    assert st.state == ProvisionState.FAILED and "PyPI has no vllm 9.9.9" in st.detail


async def test_a_uv_without_a_checksum_is_refused(tmp_path, servers):
    url, _ = servers
    system = FakeUV()
    packages = PackageInstaller(system, which=lambda t: None)
    python = PythonEngineInstaller(
        tmp_path / "e",
        GPU_NODE,
        run=system,
        packages=packages,
        pypi_base=url,
        uv_base_url=url + "/nowhere",
        free_space=lambda p: 100,
    )
    inst = Installer(tmp_path / "e", GPU_NODE, run=system, packages=packages, python=python)
    [st] = await inst.converge([Want("vllm", "0.30.0")])
    assert st.state == ProvisionState.FAILED
    assert st.detail.startswith("installing uv, which installs the Python engines: no checksum")
    assert system.uv_calls() == []
