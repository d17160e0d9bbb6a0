"""Host discovery: /etc/os-release, family and package manager, /proc/cpuinfo, the NVIDIA driver."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.agent.discovery.host import (
    collect_host,
    debian_arch,
    os_family,
    package_manager,
    parse_cpuinfo,
    parse_nvidia_driver_version,
    parse_os_release,
)

FIX = Path(__file__).parent.parent / "fixtures" / "discovery"


@pytest.mark.parametrize(
    "fixture, os_id, version, codename, like, family, manager",
    [
        ("os_release_debian12", "debian", "12", "bookworm", None, "debian", "apt-get"),
        ("os_release_ubuntu2404", "ubuntu", "24.04", "noble", ["debian"], "debian", "apt-get"),
        ("os_release_rocky9", "rocky", "9.4", None, ["rhel", "centos", "fedora"], "rhel", "dnf"),
        ("os_release_sles15", "sles", "15.5", None, ["suse"], "suse", "zypper"),
    ],
)
def test_the_os_and_its_family_come_from_os_release(tmp_path, fixture, os_id, version, codename, like, family, manager):
    installed = {"apt-get", "dnf", "yum", "zypper"}
    host = collect_host(
        os_release=FIX / fixture,
        proc_root=tmp_path,  # no cpuinfo, no driver
        which=lambda name: f"/usr/bin/{name}" if name in installed else None,
        machine="x86_64",
    )
    assert (host.os_id, host.os_version, host.os_codename) == (os_id, version, codename)
    assert host.os_like == like
    assert (host.family, host.package_manager) == (family, manager)
    assert host.arch == "amd64"
    # Nothing was readable in /proc: unknown, not empty.
    assert host.cpu_flags is None and host.nvidia_driver is None and host.cpu_model is None


def test_quoting_in_os_release_is_undone_like_a_shell_would():
    rel = parse_os_release('ID="rocky"\nID_LIKE=\'rhel centos\'\nNAME="Rocky \\"Linux\\""\n# comment\nbroken line\n')
    assert rel == {"ID": "rocky", "ID_LIKE": "rhel centos", "NAME": 'Rocky "Linux"'}


def test_the_family_follows_id_like_for_derivatives():
    assert os_family("pop", ["ubuntu", "debian"]) == "debian"
    assert os_family("almalinux", ["rhel", "centos", "fedora"]) == "rhel"
    assert os_family("amzn", ["fedora"]) == "rhel"
    assert os_family("opensuse-leap", ["suse", "opensuse"]) == "suse"
    assert os_family("opensuse-microos", None) == "suse"
    assert os_family("somethingnew", ["debian"]) == "debian"
    assert os_family("gentoo", None) is None


def test_dnf_is_preferred_and_yum_is_the_fallback():
    assert package_manager("rhel", lambda n: "/usr/bin/" + n) == "dnf"
    assert package_manager("rhel", lambda n: "/usr/bin/yum" if n == "yum" else None) == "yum"
    assert package_manager("rhel", lambda n: None) is None
    assert package_manager(None, lambda n: "/x") is None


def test_cpu_flags_model_cores_and_sockets_from_x86_cpuinfo():
    cpu = parse_cpuinfo((FIX / "cpuinfo_x86_2socket").read_text())
    assert cpu.model == "Intel(R) Xeon(R) Platinum 8480+"
    flags = cpu.flags
    for f in ("avx", "avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_tile", "amx_int8", "avx_vnni"):
        assert f in flags
    assert "sse2" not in flags  # only the extensions inference cares about
    assert cpu.cores == 2 and cpu.sockets == 2 and cpu.processors == 4


def test_arm_features_are_read_too():
    cpu = parse_cpuinfo((FIX / "cpuinfo_arm64_grace").read_text())
    assert {"asimd", "asimddp", "sve", "sve2", "i8mm"} <= set(cpu.flags)
    assert "avx2" not in cpu.flags
    assert cpu.model is None and cpu.cores is None


def test_a_vm_without_avx2_says_so_by_its_flags():
    cpu = parse_cpuinfo("processor\t: 0\nmodel name\t: QEMU Virtual CPU version 2.5+\nflags\t\t: fpu sse sse2\n")
    assert cpu.flags == []
    assert parse_cpuinfo("").flags is None


@pytest.mark.parametrize(
    "text, version",
    [
        (
            "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.90.07  Fri May 31 09:35:42 UTC 2024\n"
            "GCC version:  gcc version 12.3.0 (Ubuntu 12.3.0-1ubuntu1~22.04)\n",
            "550.90.07",
        ),
        # The open kernel module puts more words between "Module" and the version.
        (
            "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.133.20  Release Build  "
            "(dvs-builder@U16-I2-C03-12-4)  Fri Mar 14 07:59:59 UTC 2025\n",
            "570.133.20",
        ),
        ("NVRM version: NVIDIA UNIX Open Kernel Module for aarch64  580.82.07  Release Build\n", "580.82.07"),
        ("something else entirely\n", None),
    ],
)
def test_the_driver_version_is_read_from_the_kernel_module(text, version):
    assert parse_nvidia_driver_version(text) == version


def test_collect_host_reads_proc(tmp_path):
    (tmp_path / "driver" / "nvidia").mkdir(parents=True)
    (tmp_path / "driver" / "nvidia" / "version").write_text(
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.90.07  Fri May 31 09:35:42 UTC 2024\n"
    )
    (tmp_path / "cpuinfo").write_text((FIX / "cpuinfo_x86_2socket").read_text())
    host = collect_host(
        os_release=FIX / "os_release_ubuntu2404", proc_root=tmp_path, which=lambda n: None, machine="aarch64"
    )
    assert host.nvidia_driver == "550.90.07"
    assert "avx2" in host.cpu_flags and host.sockets == 2
    assert host.arch == "arm64"
    assert host.package_manager is None  # apt-get is not installed in this fake
    assert host.hostname and host.cpus


def test_a_missing_os_release_leaves_the_os_unknown(tmp_path):
    host = collect_host(os_release=tmp_path / "nope", proc_root=tmp_path, which=lambda n: None, machine="x86_64")
    assert host.os_id is None and host.family is None and host.package_manager is None


def test_architecture_names_are_debians():
    assert [debian_arch(m) for m in ("x86_64", "aarch64", "i686", "armv7l", "ppc64le")] == [
        "amd64",
        "arm64",
        "i386",
        "armhf",
        "ppc64el",
    ]
