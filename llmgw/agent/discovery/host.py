"""The operating system and processor: /etc/os-release, /proc/cpuinfo, the
NVIDIA kernel module's version, and the package manager that goes with them."""

from __future__ import annotations

import os
import platform
import re
import shlex
import socket
from dataclasses import dataclass
from pathlib import Path

from llmgw.protocol import Host

from .commands import Which
from .commands import which as default_which

# Vector extensions that decide how fast CPU inference runs (x86 "flags",
# ARM "Features"); the rest of the list is noise for this purpose.
INTERESTING_CPU_FLAGS: tuple[str, ...] = (
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx_vnni",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
    "asimd",
    "asimddp",
    "i8mm",
    "sve",
    "sve2",
)

# os-release IDs (ID or any word of ID_LIKE) to a family.
_FAMILIES: dict[str, str] = {
    "debian": "debian",
    "ubuntu": "debian",
    "linuxmint": "debian",
    "pop": "debian",
    "raspbian": "debian",
    "kali": "debian",
    "rhel": "rhel",
    "centos": "rhel",
    "fedora": "rhel",
    "rocky": "rhel",
    "almalinux": "rhel",
    "ol": "rhel",
    "amzn": "rhel",
    "sles": "suse",
    "sled": "suse",
    "suse": "suse",
    "opensuse": "suse",
    "opensuse-leap": "suse",
    "opensuse-tumbleweed": "suse",
    "arch": "arch",
    "manjaro": "arch",
    "alpine": "alpine",
}

# The package managers of a family, preferred first (dnf before yum).
PACKAGE_MANAGERS: dict[str, tuple[str, ...]] = {
    "debian": ("apt-get",),
    "rhel": ("dnf", "yum"),
    "suse": ("zypper",),
    "arch": ("pacman",),
    "alpine": ("apk",),
}

# platform.machine() to Debian's architecture names.
_DEBIAN_ARCH: dict[str, str] = {
    "x86_64": "amd64",
    "amd64": "amd64",
    "aarch64": "arm64",
    "arm64": "arm64",
    "i386": "i386",
    "i686": "i386",
    "armv7l": "armhf",
    "armv6l": "armel",
    "ppc64le": "ppc64el",
    "s390x": "s390x",
    "riscv64": "riscv64",
}


def parse_os_release(text: str) -> dict[str, str]:
    """KEY=value lines, values unquoted the way a shell would."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, _, raw = line.partition("=")
        try:
            words = shlex.split(raw)
        except ValueError:  # an unbalanced quote: take the text as written
            words = [raw.strip("\"'")]
        out[key.strip()] = " ".join(words)
    return out


def os_family(os_id: str | None, os_like: list[str] | None) -> str | None:
    """debian, rhel, suse, arch or alpine, from ID first and then ID_LIKE."""
    for word in [os_id or "", *(os_like or [])]:
        word = word.strip().lower()
        if word in _FAMILIES:
            return _FAMILIES[word]
        if word.startswith("opensuse"):
            return "suse"
    return None


def package_manager(family: str | None, which: Which = default_which) -> str | None:
    """The first of the family's package managers installed here."""
    for name in PACKAGE_MANAGERS.get(family or "", ()):
        if which(name):
            return name
    return None


def debian_arch(machine: str) -> str:
    return _DEBIAN_ARCH.get(machine.lower(), machine.lower())


@dataclass(frozen=True, slots=True)
class CPUInfo:
    model: str | None = None
    # The interesting flags, in INTERESTING_CPU_FLAGS order; None when the
    # file had no flags line at all (unknown, not "none").
    flags: list[str] | None = None
    processors: int | None = None
    cores: int | None = None  # physical; x86 only (ARM and many VMs do not say)
    sockets: int | None = None


def parse_cpuinfo(text: str) -> CPUInfo:
    model: str | None = None
    processors = 0
    flags: set[str] | None = None
    cores: set[tuple[str, str]] = set()
    sockets: set[str] = set()
    physical = core = None
    for line in text.splitlines() + [""]:
        if not line.strip():
            # A blank line ends one processor's block.
            if physical is not None and core is not None:
                cores.add((physical, core))
            if physical is not None:
                sockets.add(physical)
            physical = core = None
            continue
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key, value = key.strip(), value.strip()
        if key == "processor":
            processors += 1
        elif key == "model name" and model is None:
            model = value
        elif key in ("flags", "Features") and flags is None:
            # The first processor is enough: a machine does not mix instruction sets.
            flags = set(value.split())
        elif key == "physical id":
            physical = value
        elif key == "core id":
            core = value
    return CPUInfo(
        model=model,
        flags=[f for f in INTERESTING_CPU_FLAGS if f in flags] if flags is not None else None,
        processors=processors or None,
        cores=len(cores) or None,
        sockets=len(sockets) or None,
    )


_VERSION = re.compile(r"\b(\d+\.\d+(?:\.\d+)?)\b")


def parse_nvidia_driver_version(text: str) -> str | None:
    """The version in /proc/driver/nvidia/version's NVRM line, for the
    proprietary ("Kernel Module  550.54.15") and open ("Open Kernel Module for
    x86_64  570.86.15") modules alike."""
    for line in text.splitlines():
        if "NVRM" in line:
            m = _VERSION.search(line.split("Module", 1)[-1])
            if m:
                return m.group(1)
    return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return None


def collect_host(
    *,
    os_release: Path = Path("/etc/os-release"),
    proc_root: Path = Path("/proc"),
    which: Which = default_which,
    machine: str | None = None,
) -> Host:
    """What the machine is. Every part is optional: a file that cannot be read
    leaves its fields unknown."""
    rel_text = _read(os_release)
    if rel_text is None and os_release == Path("/etc/os-release"):
        rel_text = _read(Path("/usr/lib/os-release"))  # the fallback os-release(5) names
    rel = parse_os_release(rel_text or "")
    os_like = rel.get("ID_LIKE", "").split() or None
    family = os_family(rel.get("ID"), os_like)
    cpu = parse_cpuinfo(_read(proc_root / "cpuinfo") or "")
    driver_text = _read(proc_root / "driver" / "nvidia" / "version")
    return Host(
        hostname=socket.gethostname() or None,
        os_id=rel.get("ID") or None,
        os_version=rel.get("VERSION_ID") or None,
        os_codename=rel.get("VERSION_CODENAME") or None,
        os_like=os_like,
        os_name=rel.get("PRETTY_NAME") or None,
        family=family,
        package_manager=package_manager(family, which),
        arch=debian_arch(machine or platform.machine()),
        kernel=platform.release() or None,
        cpu_model=cpu.model,
        cpus=cpu.processors or os.cpu_count(),
        cores=cpu.cores,
        sockets=cpu.sockets,
        cpu_flags=cpu.flags,
        nvidia_driver=parse_nvidia_driver_version(driver_text) if driver_text else None,
    )
