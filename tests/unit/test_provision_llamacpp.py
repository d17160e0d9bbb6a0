"""llama.cpp from release archives, against a release server on 127.0.0.1.

The archives hold a fake ``llama-server`` (a shell script answering
``--version``); it is really run, and really ``ldd``-ed (which says "not a
dynamic executable" and so finds nothing). Package tools are faked: nothing
here installs anything on the machine.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import socket
import tarfile
import zipfile
from pathlib import Path

import pytest
from aiohttp import web

from llmgw.agent.provision import llamacpp_source
from llmgw.agent.provision.host import HostFacts, detect
from llmgw.agent.provision.llamacpp_release import DEFAULT_BASE_URL, ReleaseSource, choose_build, slow_cpu_note
from llmgw.agent.provision.manager import Installer, Want
from llmgw.agent.provision.os_packages import PackageInstaller
from llmgw.agent.provision.runner import CommandResult, run_command
from llmgw.agent.provision.status import ProvisionError, Unsupported
from llmgw.agent.provision.verify import MARKER, read_marker
from llmgw.protocol import ProvisionState

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "provision"
UBUNTU = HostFacts(arch="amd64", os_id="ubuntu", cpu_flags=frozenset({"avx2", "sse4_2"}))
ROCKY = HostFacts(arch="amd64", os_id="rocky", os_like=("rhel", "centos", "fedora"), cpu_flags=frozenset({"avx2"}))
TAG = "b1"
CPU_ASSET = f"llama-{TAG}-bin-ubuntu-x64"

FAKE_SERVER = """#!/bin/sh
if [ "$1" = "--version" ]; then
  echo "version: 10991 (abc1234)" >&2
  echo "built with cc (GCC) 12.2.0 for x86_64-linux-gnu" >&2
  exit 0
fi
exit 1
"""


# ----------------------------------------------------------------- archives


def tar_gz(
    files: dict[str, str],
    *,
    symlinks: dict[str, str] | None = None,
    extra: list[tarfile.TarInfo] | None = None,
    links_first: bool = False,
) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:

        def add_links():
            for name, target in (symlinks or {}).items():
                ti = tarfile.TarInfo(name)
                ti.type, ti.linkname = tarfile.SYMTYPE, target
                tf.addfile(ti)

        if links_first:
            add_links()
        for name, body in files.items():
            data = body.encode()
            ti = tarfile.TarInfo(name)
            ti.size, ti.mode = len(data), 0o755
            tf.addfile(ti, io.BytesIO(data))
        if not links_first:
            add_links()
        for ti in extra or []:
            tf.addfile(ti)
    return buf.getvalue()


def zip_bytes(files: dict[str, str], *, symlinks: dict[str, str] | None = None) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, body in files.items():
            zi = zipfile.ZipInfo(name)
            zi.external_attr = 0o100755 << 16
            zf.writestr(zi, body)
        for name, target in (symlinks or {}).items():
            zi = zipfile.ZipInfo(name)
            zi.external_attr = 0o120777 << 16
            zf.writestr(zi, target)
    return buf.getvalue()


def good_release() -> bytes:
    return tar_gz(
        {f"llama-{TAG}/llama-server": FAKE_SERVER, f"llama-{TAG}/libllama.so.0": "x"},
        symlinks={f"llama-{TAG}/libllama.so": "libllama.so.0"},
    )


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


class ReleaseServer:
    """Files by path, with request counting; ``<asset>.sha256`` sidecars as asked."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.requests: list[str] = []
        # Paths answered by a handler of the test's own instead.
        self.special: dict = {}
        self.url = ""
        self._runner: web.AppRunner | None = None

    def publish(self, tag: str, name: str, body: bytes, *, checksum: str | None = "auto") -> None:
        self.files[f"/{tag}/{name}"] = body
        if checksum == "auto":
            checksum = sha(body)
        if checksum is not None:
            self.files[f"/{tag}/{name}.sha256"] = f"{checksum}  {name}\n".encode()

    async def _handle(self, request: web.Request) -> web.Response:
        self.requests.append(request.path)
        if request.path in self.special:
            return await self.special[request.path](request)
        body = self.files.get(request.path)
        if body is None:
            raise web.HTTPNotFound()
        return web.Response(body=body)

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self._runner:
            await self._runner.cleanup()


@pytest.fixture
async def release():
    srv = ReleaseServer()
    await srv.start()
    yield srv
    await srv.stop()


class FakeSystem:
    """Package tools as a fake; ldd optionally faked; everything else really run."""

    def __init__(self, installed: set[str] | None = None, ldd: str | None = None) -> None:
        self.installed = set(installed or ())
        self.ldd = ldd
        self.calls: list[list[str]] = []

    async def __call__(self, argv, *, env=None, stdin=None, timeout=None) -> CommandResult:
        argv = list(argv)
        self.calls.append(argv)
        name = argv[0]
        if name == "dpkg-query" or (name == "rpm" and argv[1] == "-q"):
            return CommandResult(0, "ii ") if argv[-1] in self.installed else CommandResult(1, "no packages found")
        if name in ("apt-get", "dnf", "yum", "zypper"):
            if "install" in argv:
                i = argv.index("install")
                self.installed.update(a for a in argv[i + 1 :] if not a.startswith("-"))
            return CommandResult(0, "")
        if name == "ldd" and self.ldd is not None:
            return CommandResult(0, self.ldd)
        return await run_command(argv, env=env, stdin=stdin, timeout=timeout)

    def commands(self, name: str) -> list[list[str]]:
        return [c for c in self.calls if c[0] == name]


def make_installer(
    tmp_path: Path, release: ReleaseServer, system: FakeSystem, host=UBUNTU, **source_kw
) -> tuple[Installer, list]:
    seen: list = []
    tools = {"apt-get", "dnf"} if host is UBUNTU else {"dnf"}
    packages = PackageInstaller(system, which=lambda t: f"/usr/bin/{t}" if t in tools else None)
    source = ReleaseSource(base_url=source_kw.pop("base_url", release.url), **source_kw)
    inst = Installer(
        tmp_path / "engines", host, on_status=seen.append, run=system, packages=packages, llamacpp_source=source
    )
    return inst, seen


def leftovers(root: Path) -> list[str]:
    d = root / "llamacpp"
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


# ----------------------------------------------------------------- installing


async def test_an_engine_is_installed_from_nothing(tmp_path, release):
    release.publish(TAG, CPU_ASSET + ".tar.gz", good_release())
    system = FakeSystem()
    inst, seen = make_installer(tmp_path, release, system)

    [st] = await inst.converge([Want("llamacpp", TAG)])

    assert st.state == ProvisionState.READY, st
    assert st.variant == "cpu"
    assert st.detail.startswith("llama-server version: 10991 (abc1234)")
    assert "avx2" not in st.detail  # this CPU has it
    target = tmp_path / "engines" / "llamacpp" / f"{TAG}-cpu"
    assert st.binary == str(target / f"llama-{TAG}" / "llama-server")
    assert (target / f"llama-{TAG}" / "libllama.so").is_symlink(), "library symlink not kept"
    # The OpenMP runtime the build links against was installed with apt.
    assert "libgomp1" in system.installed
    apt = system.commands("apt-get")
    assert apt[0] == ["apt-get", "-o=DPkg::Lock::Timeout=600", "update"]
    assert apt[1][-1] == "libgomp1" and "--no-install-recommends" in apt[1]
    # Nothing but the finished directory is left beside it.
    assert leftovers(tmp_path / "engines") == [f"{TAG}-cpu"]
    # Download progress was reported, with bytes, while it ran.
    downloading = [s for s in seen if "downloading" in s.detail]
    assert downloading and downloading[0].detail.startswith(f"downloading {CPU_ASSET}.tar.gz")
    assert any(s.bytes_total == len(release.files[f"/{TAG}/{CPU_ASSET}.tar.gz"]) for s in downloading)
    assert seen[-1].state == ProvisionState.READY and seen[-1].bytes_done is None

    m = read_marker(target)
    assert m is not None
    assert m.engine == "llamacpp" and m.version == TAG and m.variant == "cpu"
    assert m.source == "release" and m.binary == f"llama-{TAG}/llama-server"
    assert m.sha256 == {CPU_ASSET + ".tar.gz": sha(release.files[f"/{TAG}/{CPU_ASSET}.tar.gz"])}
    assert m.version_line == "version: 10991 (abc1234)" and m.installed.endswith("Z")
    assert m.url == f"{release.url}/{TAG}/{CPU_ASSET}.tar.gz"
    raw = json.loads((target / MARKER).read_text())
    assert {"engine", "version", "variant", "binary", "sha256", "installed"} <= set(raw)


async def test_the_marker_is_written_last(tmp_path, release):
    release.publish(TAG, CPU_ASSET + ".tar.gz", good_release())
    inst, _ = make_installer(tmp_path, release, FakeSystem())
    await inst.converge([Want("llamacpp", TAG)])
    target = tmp_path / "engines" / "llamacpp" / f"{TAG}-cpu"
    marker_time = (target / MARKER).stat().st_mtime_ns
    others = [p for p in target.rglob("*") if p.name != MARKER and not p.is_symlink()]
    assert others and all(p.stat().st_mtime_ns <= marker_time for p in others)


async def test_a_build_that_does_not_run_gets_no_marker_and_no_directory(tmp_path, release):
    broken = tar_gz({f"llama-{TAG}/llama-server": "#!/bin/sh\necho 'Illegal instruction' >&2\nexit 132\n"})
    release.publish(TAG, CPU_ASSET + ".tar.gz", broken)
    inst, _ = make_installer(tmp_path, release, FakeSystem({"libgomp1"}))
    [st] = await inst.converge([Want("llamacpp", TAG)])
    assert st.state == ProvisionState.FAILED
    assert "llama-server --version` failed (exit 132): Illegal instruction" in st.detail
    assert leftovers(tmp_path / "engines") == []


async def test_an_installed_engine_is_checked_not_fetched_again(tmp_path, release):
    release.publish(TAG, CPU_ASSET + ".tar.gz", good_release())
    system = FakeSystem()
    inst, seen = make_installer(tmp_path, release, system)
    await inst.converge([Want("llamacpp", TAG)])
    requests, reports = len(release.requests), len(seen)

    [again] = await inst.converge([Want("llamacpp", TAG)])

    assert again.state == ProvisionState.READY
    assert len(release.requests) == requests, "a ready engine was downloaded again"
    assert len(seen) == reports, "a recheck that changed nothing was reported"
    # It was run again, not believed.
    assert sum(1 for c in system.calls if c[-1] == "--version") == 2
    # And a fresh agent (no memory of the last pass) also only checks.
    inst2, _ = make_installer(tmp_path, release, system)
    [st] = await inst2.converge([Want("llamacpp", TAG)])
    assert st.state == ProvisionState.READY and len(release.requests) == requests


async def test_an_install_changed_on_disk_is_installed_again(tmp_path, release):
    release.publish(TAG, CPU_ASSET + ".tar.gz", good_release())
    inst, _ = make_installer(tmp_path, release, FakeSystem())
    [st] = await inst.converge([Want("llamacpp", TAG)])
    Path(st.binary).write_text("#!/bin/sh\necho tampered\n")
    before = len(release.requests)

    [again] = await inst.converge([Want("llamacpp", TAG)])

    assert again.state == ProvisionState.READY
    assert len(release.requests) > before
    assert "version: 10991" in Path(again.binary).read_text()


async def test_check_reverifies_an_install(tmp_path, release):
    release.publish(TAG, CPU_ASSET + ".tar.gz", good_release())
    system = FakeSystem()
    inst, _ = make_installer(tmp_path, release, system)
    await inst.converge([Want("llamacpp", TAG)])
    from llmgw.agent.provision.verify import installed_at

    installed = installed_at(tmp_path / "engines" / "llamacpp" / f"{TAG}-cpu")
    assert installed is not None
    assert await inst.llamacpp.check(installed) == "version: 10991 (abc1234)"
    # A library removed by somebody's upgrade is found by the recheck.
    system.ldd = (FIXTURES / "ldd-cloud-image-without-libgomp.txt").read_text()
    with pytest.raises(ProvisionError, match="libgomp.so.1 not found"):
        await inst.llamacpp.check(installed)


async def test_a_zip_release_installs(tmp_path, release):
    # Older releases publish .zip; no .tar.gz (nor its .sha256) exists.
    release.publish(
        TAG,
        CPU_ASSET + ".zip",
        zip_bytes(
            {"build/bin/llama-server": FAKE_SERVER, "build/bin/libggml.so.0": "x"},
            symlinks={"build/bin/libggml.so": "libggml.so.0"},
        ),
    )
    inst, _ = make_installer(tmp_path, release, FakeSystem({"libgomp1"}))
    [st] = await inst.converge([Want("llamacpp", TAG)])
    assert st.state == ProvisionState.READY, st
    assert st.binary.endswith("/build/bin/llama-server")
    assert os.readlink(Path(st.binary).parent / "libggml.so") == "libggml.so.0"


async def test_an_explicit_sha256_is_used_and_checked(tmp_path, release):
    body = good_release()
    release.publish(TAG, CPU_ASSET + ".tar.gz", body, checksum=None)  # no sidecar at all
    inst, _ = make_installer(
        tmp_path,
        release,
        FakeSystem({"libgomp1"}),
        expected_sha256={CPU_ASSET + ".tar.gz": "SHA256:" + sha(body).upper()},
    )
    [st] = await inst.converge([Want("llamacpp", TAG)])
    assert st.state == ProvisionState.READY, st

    inst, _ = make_installer(
        tmp_path / "b", release, FakeSystem({"libgomp1"}), expected_sha256={CPU_ASSET + ".tar.gz": "0" * 64}
    )
    [st] = await inst.converge([Want("llamacpp", TAG)])
    assert st.state == ProvisionState.FAILED and "does not match the checksum" in st.detail


async def test_a_release_without_a_published_checksum_is_refused(tmp_path, release):
    release.publish(TAG, CPU_ASSET + ".tar.gz", good_release(), checksum=None)
    inst, _ = make_installer(tmp_path, release, FakeSystem({"libgomp1"}))
    [st] = await inst.converge([Want("llamacpp", TAG)])
    assert st.state == ProvisionState.FAILED
    assert "no checksum is published" in st.detail and ".sha256" in st.detail
    assert not any(r.endswith(".tar.gz") for r in release.requests), "downloaded unchecked"
    assert leftovers(tmp_path / "engines") == []


async def test_checksums_from_the_github_api(tmp_path, release):
    body = good_release()
    release.publish(TAG, CPU_ASSET + ".tar.gz", body, checksum=None)
    api = {
        "assets": [
            {"name": CPU_ASSET + ".tar.gz", "digest": "sha256:" + sha(body)},
            {"name": "other.zip", "digest": None},
        ]
    }
    release.files[f"/api/{TAG}"] = json.dumps(api).encode()
    inst, _ = make_installer(tmp_path, release, FakeSystem({"libgomp1"}), api_url=release.url + "/api/{tag}")
    [st] = await inst.converge([Want("llamacpp", TAG)])
    assert st.state == ProvisionState.READY, st
    assert f"/api/{TAG}" in release.requests

    # An asset GitHub lists without a digest cannot be verified.
    api["assets"][0]["digest"] = None
    release.files[f"/api/{TAG}"] = json.dumps(api).encode()
    inst, _ = make_installer(tmp_path / "b", release, FakeSystem({"libgomp1"}), api_url=release.url + "/api/{tag}")
    [st] = await inst.converge([Want("llamacpp", TAG)])
    assert st.state == ProvisionState.FAILED and "publishes no" in st.detail and "cannot be verified" in st.detail


def test_the_github_api_is_asked_only_for_github():
    assert ReleaseSource().api_release_url("b9") == "https://api.github.com/repos/ggml-org/llama.cpp/releases/tags/b9"
    assert ReleaseSource().asset_url("b9", "x.tar.gz") == f"{DEFAULT_BASE_URL}/b9/x.tar.gz"
    assert ReleaseSource(base_url="http://mirror:8081/llama.cpp/").api_release_url("b9") is None
    assert (
        ReleaseSource(base_url="http://mirror:8081/llama.cpp/").asset_url("b9", "x")
        == "http://mirror:8081/llama.cpp/b9/x"
    )


@pytest.mark.parametrize(
    "kw, words",
    [
        ({"base_url": "ftp://mirror/llama"}, "is not an http(s) URL"),
        ({"base_url": "mirror/llama"}, "is not an http(s) URL"),
        ({"variant": "rocm"}, "variant 'rocm' is unknown"),
        ({"expected_sha256": {"a.tar.gz": "abc"}}, "is not 64 hexadecimal digits"),
    ],
)
def test_bad_release_configuration_is_refused_with_words(kw, words):
    with pytest.raises(ProvisionError, match=words.replace("(", r"\(").replace(")", r"\)")):
        ReleaseSource(**kw)


# ----------------------------------------------------------------- refusals


async def test_a_tampered_archive_is_refused_and_nothing_installed(tmp_path, release):
    body = good_release()
    release.publish(TAG, CPU_ASSET + ".tar.gz", body)
    # Someone swapped the archive after its checksum was published.
    release.files[f"/{TAG}/{CPU_ASSET}.tar.gz"] = tar_gz({f"llama-{TAG}/llama-server": "#!/bin/sh\nrm -rf /\n"})
    inst, _seen = make_installer(tmp_path, release, FakeSystem({"libgomp1"}))
    [st] = await inst.converge([Want("llamacpp", TAG)])
    assert st.state == ProvisionState.FAILED
    assert "does not match the checksum its publisher gave" in st.detail
    assert "it was not installed" in st.detail
    assert leftovers(tmp_path / "engines") == []


def _device() -> tarfile.TarInfo:
    ti = tarfile.TarInfo(f"llama-{TAG}/null")
    ti.type, ti.devmajor, ti.devminor = tarfile.CHRTYPE, 1, 3
    return ti


def _fifo() -> tarfile.TarInfo:
    ti = tarfile.TarInfo(f"llama-{TAG}/pipe")
    ti.type = tarfile.FIFOTYPE
    return ti


def _hardlink(target: str) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(f"llama-{TAG}/hard")
    ti.type, ti.linkname = tarfile.LNKTYPE, target
    return ti


SERVER = {f"llama-{TAG}/llama-server": FAKE_SERVER}
EVIL = {
    "dotdot": (tar_gz({**SERVER, "../evil": "x"}), "'../evil' climbs out of the install directory"),
    "deep-dotdot": (tar_gz({**SERVER, f"llama-{TAG}/../../../evil": "x"}), "climbs out"),
    "absolute": (tar_gz({**SERVER, "/tmp/llmgw-evil": "x"}), "is an absolute path"),
    "symlink-out": (tar_gz(SERVER, symlinks={f"llama-{TAG}/etc": "../../../../etc"}), "outside the install directory"),
    "symlink-absolute": (
        tar_gz(SERVER, symlinks={f"llama-{TAG}/etc": "/etc"}),
        "is a link to the absolute path '/etc'",
    ),
    # A link to somewhere harmless, then a file written "through" it.
    "write-through-link": (
        tar_gz({**SERVER, f"llama-{TAG}/lib/evil": "x"}, symlinks={f"llama-{TAG}/lib": "."}, links_first=True),
        "lies beneath the link 'llama-b1/lib'",
    ),
    "link-over-directory": (
        tar_gz({**SERVER, f"llama-{TAG}/lib/evil": "x"}, symlinks={f"llama-{TAG}/lib": "."}),
        "is both a directory and a symlink",
    ),
    # Each link looks harmless alone; together they lead out.
    "link-chain-out": (
        tar_gz(SERVER, symlinks={f"llama-{TAG}/b": "..", f"llama-{TAG}/a": "b/.."}),
        "leads outside the install directory",
    ),
    "device": (tar_gz(SERVER, extra=[_device()]), "is a device file"),
    "fifo": (tar_gz(SERVER, extra=[_fifo()]), "is a FIFO"),
    "hardlink-out": (
        tar_gz(SERVER, extra=[_hardlink("../../etc/passwd")]),
        "'llama-b1/hard' is a hard link to '../../etc/passwd', outside",
    ),
    "hardlink-absolute": (tar_gz(SERVER, extra=[_hardlink("/etc/shadow")]), "is a hard link to '/etc/shadow'"),
    "zip-dotdot": (zip_bytes({**SERVER, "../evil": "x"}), "climbs out"),
    "zip-symlink-out": (zip_bytes(SERVER, symlinks={f"llama-{TAG}/etc": "../../etc"}), "outside the install directory"),
}


@pytest.mark.parametrize("case", sorted(EVIL))
async def test_an_archive_cannot_write_outside_its_directory(tmp_path, release, case):
    body, words = EVIL[case]
    suffix = ".zip" if case.startswith("zip") else ".tar.gz"
    release.publish(TAG, CPU_ASSET + suffix, body)
    inst, _ = make_installer(tmp_path, release, FakeSystem({"libgomp1"}))
    [st] = await inst.converge([Want("llamacpp", TAG)])
    assert st.state == ProvisionState.FAILED, st
    assert words in st.detail, st.detail
    assert f"{CPU_ASSET}{suffix} is refused" in st.detail
    assert leftovers(tmp_path / "engines") == []
    assert not (tmp_path / "engines" / "evil").exists() and not (tmp_path / "evil").exists()


# ----------------------------------------------------------------- ldd


async def test_an_engine_that_cannot_load_a_library_is_not_ready(tmp_path, release):
    release.publish(TAG, CPU_ASSET + ".tar.gz", good_release())
    ldd = (FIXTURES / "ldd-cuda-build-without-driver.txt").read_text()
    inst, _ = make_installer(tmp_path, release, FakeSystem({"libgomp1"}, ldd=ldd))
    [st] = await inst.converge([Want("llamacpp", TAG)])
    assert st.state == ProvisionState.FAILED
    assert st.detail == (
        "llama-server cannot run on this system: libcuda.so.1 not found: the NVIDIA driver is not installed"
    )
    assert leftovers(tmp_path / "engines") == []


async def test_a_system_too_old_for_the_build_says_what_it_lacks(tmp_path, release):
    release.publish(TAG, CPU_ASSET + ".tar.gz", good_release())
    ldd = (FIXTURES / "ldd-rhel9-glibcxx-too-old.txt").read_text()
    inst, _ = make_installer(tmp_path, release, FakeSystem({"libgomp1"}, ldd=ldd))
    [st] = await inst.converge([Want("llamacpp", TAG)])
    assert st.state == ProvisionState.FAILED
    assert "libstdc++.so.6 is too old (needs GLIBCXX_3.4.30)" in st.detail
    assert st.detail.count("GLIBCXX") == 1


async def test_the_real_ldd_output_of_our_build_passes(tmp_path, release):
    release.publish(TAG, CPU_ASSET + ".tar.gz", good_release())
    ldd = (FIXTURES / "ldd-llama-server-0.3.36-debian12.txt").read_text()
    inst, _ = make_installer(tmp_path, release, FakeSystem({"libgomp1"}, ldd=ldd))
    [st] = await inst.converge([Want("llamacpp", TAG)])
    assert st.state == ProvisionState.READY, st


# ----------------------------------------------------------------- hardware


def test_the_build_follows_the_hardware():
    cpu = choose_build("b10991", UBUNTU)
    assert cpu.variant == "cpu" and cpu.assets == ("llama-b10991-bin-ubuntu-x64",)
    assert cpu.packages == {"deb": ("libgomp1",), "rpm": ("libgomp",)}

    gpu = choose_build("b10991", HostFacts(arch="amd64", nvidia_driver="570.86.15"))
    assert gpu.variant == "cuda-12.8"
    assert gpu.assets == ("llama-b10991-bin-ubuntu-cuda-12.8-x64", "cudart-llama-b10991-bin-ubuntu-cuda-12.8-x64")

    # arm64 GPU nodes get the CPU build (the arm64 CUDA build wants a newer CUDA).
    arm = choose_build("b10991", HostFacts(arch="arm64", nvidia_driver="580.65.06"))
    assert arm.variant == "cpu" and arm.assets == ("llama-b10991-bin-ubuntu-arm64",)
    assert arm.cpu_flags == ()

    vk = choose_build("b10991", UBUNTU, "vulkan")
    assert vk.variant == "vulkan" and vk.assets == ("llama-b10991-bin-ubuntu-vulkan-x64",)
    assert "libvulkan1" in vk.packages["deb"]
    assert choose_build("b10991", HostFacts(arch="amd64", nvidia_driver="580.1"), "cpu").variant == "cpu"

    with pytest.raises(Unsupported, match="no Linux build for riscv64"):
        choose_build("b10991", HostFacts(arch="riscv64"))
    with pytest.raises(Unsupported, match="no CUDA build"):
        choose_build("b10991", HostFacts(arch="arm64"), "cuda")
    with pytest.raises(ProvisionError, match="not a llama.cpp release tag"):
        choose_build("../b1", UBUNTU)


def test_a_cpu_without_avx2_is_called_out():
    slow = HostFacts(arch="amd64", cpu_flags=frozenset({"sse4_2"}))
    note = slow_cpu_note(slow, ("avx2",))
    assert "lacks avx2" in note and "several times slower" in note and 'CPU type "host"' in note
    assert slow_cpu_note(UBUNTU, ("avx2",)) == ""
    # Unknown flags are not "lacks everything".
    assert slow_cpu_note(HostFacts(arch="amd64"), ("avx2",)) == ""


async def test_a_slow_cpu_is_named_in_the_ready_detail(tmp_path, release):
    release.publish(TAG, CPU_ASSET + ".tar.gz", good_release())
    inst, _ = make_installer(tmp_path, release, FakeSystem({"libgomp1"}), host=UBUNTU)
    inst.llamacpp.host = HostFacts(arch="amd64", os_id="ubuntu", cpu_flags=frozenset())
    [st] = await inst.converge([Want("llamacpp", TAG)])
    assert st.state == ProvisionState.READY and "this CPU lacks avx2" in st.detail


async def test_a_gpu_node_installs_the_cuda_build_and_its_runtime(tmp_path, release):
    stem = "bin-ubuntu-cuda-12.8-x64"
    release.publish(TAG, f"llama-{TAG}-{stem}.tar.gz", tar_gz({f"llama-{TAG}/llama-server": FAKE_SERVER}))
    release.publish(TAG, f"cudart-llama-{TAG}-{stem}.tar.gz", tar_gz({f"llama-{TAG}/libcudart.so.12": "x"}))
    inst, _ = make_installer(tmp_path, release, FakeSystem({"libgomp1"}))
    inst.llamacpp.host = HostFacts(arch="amd64", os_id="ubuntu", nvidia_driver="570.86.15")
    [st] = await inst.converge([Want("llamacpp", TAG)])
    assert st.state == ProvisionState.READY and st.variant == "cuda-12.8", st
    target = tmp_path / "engines" / "llamacpp" / f"{TAG}-cuda-12.8"
    assert (target / f"llama-{TAG}" / "libcudart.so.12").is_file()
    assert len(read_marker(target).sha256) == 2


def test_the_driver_is_read_from_proc(tmp_path):
    (tmp_path / "proc/driver/nvidia").mkdir(parents=True)
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/os-release").write_text('ID=rocky\nID_LIKE="rhel centos fedora"\n')
    (tmp_path / "proc/cpuinfo").write_text("processor\t: 0\nflags\t\t: fpu sse4_2 avx avx2\n")
    assert detect(tmp_path).nvidia_driver == ""  # no version file: no driver loaded
    (tmp_path / "proc/driver/nvidia/version").write_text((FIXTURES / "nvidia-version-open-580.txt").read_text())
    h = detect(tmp_path)
    assert h.nvidia_driver == "580.65.06" and h.family == "rpm" and h.has_cpu_flag("avx2")
    assert choose_build("b1", HostFacts(arch="amd64", nvidia_driver=h.nvidia_driver)).variant.startswith("cuda")
    (tmp_path / "proc/driver/nvidia/version").write_text((FIXTURES / "nvidia-version-proprietary-550.txt").read_text())
    assert detect(tmp_path).nvidia_driver == "550.54.15"


async def test_a_red_hat_family_node_installs_with_its_own_package_manager(tmp_path, release):
    release.publish(TAG, CPU_ASSET + ".tar.gz", good_release())
    system = FakeSystem()
    inst, _ = make_installer(tmp_path, release, system, host=ROCKY)
    [st] = await inst.converge([Want("llamacpp", TAG)])
    assert st.state == ProvisionState.READY, st
    assert "libgomp" in system.installed and "libgomp1" not in system.installed
    assert system.commands("dnf") == [["dnf", "install", "-y", "libgomp"]]


# ----------------------------------------------------------------- second source


def _closed_port_url() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now: connections are refused
    return f"http://127.0.0.1:{port}/releases"


async def test_unreachable_releases_fall_back_to_a_source_build(tmp_path, release):
    built = tmp_path / "cache" / "llama-server"
    built.parent.mkdir()
    built.write_text(FAKE_SERVER)
    built.chmod(0o755)
    phases = []

    def fake_build(progress):
        for phase, pct in (("download", None), ("build", 0.0), ("build", 50.0), ("install", 100.0)):
            progress(phase, pct)
            phases.append(phase)
        return built

    inst, seen = make_installer(tmp_path, release, FakeSystem({"libgomp1"}), base_url=_closed_port_url())
    inst.llamacpp.build_from_source = fake_build
    [st] = await inst.converge([Want("llamacpp", TAG)])

    assert st.state == ProvisionState.READY, st
    assert st.variant == "source-cpu"
    assert "built from the llama.cpp source in llama-cpp-python" in st.detail
    assert "cannot reach 127.0.0.1" in st.detail
    target = (
        tmp_path / "engines" / "llamacpp" / (f"llama-cpp-python-{llamacpp_source.LLAMA_CPP_PYTHON_VERSION}-source-cpu")
    )
    assert st.binary == str(target / "bin" / "llama-server")
    m = read_marker(target)
    assert m.source == "source" and m.sha256 == {llamacpp_source.SDIST_FILENAME: llamacpp_source.SDIST_SHA256}
    assert any("building llama-server from source: build 50%" in s.detail for s in seen)

    # The next pass tries the release again, finds it still unreachable, and
    # uses the build it has rather than building again.
    phases.clear()
    [again] = await inst.converge([Want("llamacpp", TAG)])
    assert again.state == ProvisionState.READY and phases == []


async def test_a_failed_source_build_says_both_reasons(tmp_path, release):
    def failing(progress):
        raise ProvisionError("building llama-server needs cmake, which is not installed")

    inst, _ = make_installer(tmp_path, release, FakeSystem({"libgomp1"}), base_url=_closed_port_url())
    inst.llamacpp.build_from_source = failing
    [st] = await inst.converge([Want("llamacpp", TAG)])
    assert st.state == ProvisionState.FAILED
    assert "cannot reach" in st.detail and "needs cmake" in st.detail
    assert leftovers(tmp_path / "engines") == []


async def test_the_source_build_can_be_turned_off(tmp_path, release):
    inst, _ = make_installer(
        tmp_path, release, FakeSystem({"libgomp1"}), base_url=_closed_port_url(), allow_source_build=False
    )
    inst.llamacpp.build_from_source = lambda progress: pytest.fail("built from source")
    [st] = await inst.converge([Want("llamacpp", TAG)])
    assert st.state == ProvisionState.FAILED and "cannot reach 127.0.0.1" in st.detail


async def test_a_missing_release_is_not_a_reason_to_build(tmp_path, release):
    inst, _ = make_installer(tmp_path, release, FakeSystem({"libgomp1"}))
    inst.llamacpp.build_from_source = lambda progress: pytest.fail("built from source")
    [st] = await inst.converge([Want("llamacpp", "b99999")])
    assert st.state == ProvisionState.FAILED and "no checksum is published" in st.detail


async def test_the_control_plane_can_name_a_mirror(tmp_path, release):
    release.publish(f"mirror/{TAG}", CPU_ASSET + ".tar.gz", good_release())
    inst, _ = make_installer(tmp_path, release, FakeSystem({"libgomp1"}), base_url=_closed_port_url())
    [st] = await inst.converge([Want("llamacpp", TAG, source_url=release.url + "/mirror")])
    assert st.state == ProvisionState.READY, st
    assert f"/mirror/{TAG}/{CPU_ASSET}.tar.gz" in release.requests


async def test_the_locally_built_llama_server_installs_like_a_release(tmp_path, release):
    """The real binary (static llama.cpp, dynamic libc/libstdc++/libgomp), real ldd, real --version."""
    built = llamacpp_source.cached_binary_path()
    if not llamacpp_source.binary_works(built):
        pytest.skip("no locally built llama-server (scripts/build-llama-server builds it)")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        tf.add(built, arcname=f"llama-{TAG}/llama-server")
    release.publish(TAG, CPU_ASSET + ".tar.gz", buf.getvalue())
    system = FakeSystem({"libgomp1"})
    inst, _ = make_installer(tmp_path, release, system)
    [st] = await inst.converge([Want("llamacpp", TAG)])
    assert st.state == ProvisionState.READY, st
    assert st.detail.startswith("llama-server version: ")
    # ldd really ran on it (and found every library).
    assert any(c[0] == "ldd" for c in system.calls)


async def test_a_download_cut_short_is_retried_later_not_built_from_source(tmp_path, release):
    body = good_release()
    release.publish(TAG, CPU_ASSET + ".tar.gz", body)

    async def truncated(request):
        resp = web.StreamResponse(headers={"Content-Length": str(len(body))})
        await resp.prepare(request)
        await resp.write(body[:100])
        request.transport.close()  # the connection drops mid-file
        return resp

    inst, _ = make_installer(tmp_path, release, FakeSystem({"libgomp1"}))
    inst.llamacpp.build_from_source = lambda progress: pytest.fail("built from source")
    release.files.pop(f"/{TAG}/{CPU_ASSET}.tar.gz")
    release.special = {f"/{TAG}/{CPU_ASSET}.tar.gz": truncated}
    [st] = await inst.converge([Want("llamacpp", TAG)])
    assert st.state == ProvisionState.FAILED, st
    assert "was cut short" in st.detail or "ended after 100" in st.detail
    assert leftovers(tmp_path / "engines") == []


async def test_a_mirror_in_trouble_counts_as_unreachable(tmp_path, release):
    async def unavailable(request):
        raise web.HTTPServiceUnavailable()

    built = tmp_path / "llama-server"
    built.write_text(FAKE_SERVER)
    built.chmod(0o755)
    release.special = {f"/{TAG}/{CPU_ASSET}.tar.gz.sha256": unavailable}
    inst, _ = make_installer(tmp_path, release, FakeSystem({"libgomp1"}))
    inst.llamacpp.build_from_source = lambda progress: built
    [st] = await inst.converge([Want("llamacpp", TAG)])
    assert st.state == ProvisionState.READY and st.variant == "source-cpu", st
    assert "answered 503" in st.detail
