"""What doctor reads about NVIDIA hardware beyond discovery's inventory: the
devices on the PCI bus (seen with no driver at all), whether the driver
answers `nvidia-smi -L`, and nvidia-imex's configuration with its peers
dialled.

Parsers take the tools' text as they print it; collectors take the command
runner and the roots, so tests feed captured outputs. Nothing here judges.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from llmgw.agent.discovery.commands import CommandResult, Runner
from llmgw.protocol.doctor import ImexConfig, ImexPeer, PciDevice, SmiProbe

NVIDIA_VENDOR = "10de"
# `-d 10de:` keeps NVIDIA's devices only; `-D` always prints the PCI domain.
LSPCI_ARGS = ("-Dnn", "-d", f"{NVIDIA_VENDOR}:")
LSPCI_TIMEOUT_S = 5.0
GPU_CLASSES = frozenset({"0300", "0302"})  # VGA compatible controller, 3D controller
NVSWITCH_CLASS = "0680"  # "Bridge": PCI class 06, subclass 80 (other)
# The NVSwitch management endpoints the nvidia-nvswitch driver binds, from
# its own tables (open-gpu-kernel-modules, src/common/nvswitch/kernel/nvswitch.c):
# LR10 (A100 boards) and LS10 (H100/H200 boards). An older pci.ids names
# them only "Device [10de:22a3]", so the id decides, not the words. Other
# NVIDIA class-0680 devices exist (nForce Ethernet on old desktops), and
# Grace's PCIe root ports are NVIDIA bridges too (class 0604): neither is a switch.
NVSWITCH_DEVICE_IDS = frozenset({"1ae8", *(f"1af{d:x}" for d in range(16)), *(f"22a{d}" for d in range(8))})


# --------------------------------------------------------------- PCI


_LSPCI_LINE = re.compile(
    r"^(?P<addr>(?:[0-9a-f]{4,8}:)?[0-9a-f]{2}:[0-9a-f]{2}\.[0-7])\s+"
    r"[^\[]*\[(?P<cls>[0-9a-f]{4})\]:\s+"
    r"(?P<name>.*?)\s*\[(?P<vendor>[0-9a-f]{4}):(?P<device>[0-9a-f]{4})\]",
    re.IGNORECASE,
)
_VENDOR_WORDS = re.compile(r"^nvidia corporation\s*", re.IGNORECASE)


def parse_lspci(text: str) -> list[PciDevice]:
    """NVIDIA's devices in `lspci -nn` lines ("0000:07:00.0 Bridge [0680]:
    NVIDIA Corporation GH100 [H100 NVSwitch] [10de:22a3] (rev a1)"); other
    vendors' lines are skipped."""
    out = []
    for line in text.splitlines():
        m = _LSPCI_LINE.match(line.strip())
        if not m or m["vendor"].lower() != NVIDIA_VENDOR:
            continue
        addr = m["addr"].lower()
        if addr.count(":") == 1:  # lspci without -D leaves out domain 0
            addr = "0000:" + addr
        name = _VENDOR_WORDS.sub("", m["name"]).strip()
        out.append(
            PciDevice(
                address=addr,
                class_id=m["cls"].lower(),
                device_id=m["device"].lower(),
                name=None if name in ("", "Device") else name,
            )
        )
    return out


def read_pci_sysfs(sys_root: Path) -> list[PciDevice] | None:
    """The same from /sys/bus/pci/devices (vendor, device, class files), for
    machines without pciutils; None when that directory cannot be read."""
    base = sys_root / "bus" / "pci" / "devices"
    try:
        entries = sorted(base.iterdir())
    except OSError:
        return None
    out = []
    for d in entries:
        try:
            vendor = (d / "vendor").read_text().strip().lower().removeprefix("0x")
            if vendor != NVIDIA_VENDOR:
                continue
            device = (d / "device").read_text().strip().lower().removeprefix("0x")
            cls = (d / "class").read_text().strip().lower().removeprefix("0x")  # "068000": class, subclass, prog-if
        except OSError:
            continue
        out.append(PciDevice(address=d.name.lower(), class_id=cls[:4], device_id=device))
    return out


def nvidia_pci(run: Runner, lspci: str | None, sys_root: Path) -> tuple[list[PciDevice] | None, str | None]:
    """(NVIDIA's PCI devices, "lspci" or "sysfs"): lspci where installed (it
    names the devices), else sysfs."""
    if lspci:
        res = run([lspci, *LSPCI_ARGS], LSPCI_TIMEOUT_S)
        if res.ok:
            return parse_lspci(res.stdout), "lspci"
    devices = read_pci_sysfs(sys_root)
    return devices, "sysfs" if devices is not None else None


def is_gpu(d: PciDevice) -> bool:
    return d.class_id in GPU_CLASSES


def is_nvswitch(d: PciDevice) -> bool:
    return d.class_id == NVSWITCH_CLASS and (d.device_id in NVSWITCH_DEVICE_IDS or "nvswitch" in (d.name or "").lower())


# --------------------------------------------------------------- nvidia-smi -L

# Listing the cards is the cheapest question the driver answers; a wedged
# driver makes it hang, and this is how long that is waited for.
SMI_LIST_TIMEOUT_S = 15.0
_GPU_LINE = re.compile(r"^GPU \d+:")


def probe_smi(path: str, run: Runner) -> SmiProbe | None:
    """Run `nvidia-smi -L`; None when that nvidia-smi is not there."""
    res = run([path, "-L"], SMI_LIST_TIMEOUT_S)
    return None if res.missing else parse_smi_list(path, res)


def parse_smi_list(path: str, res: CommandResult) -> SmiProbe:
    lines = [ln.strip() for ln in (res.stdout + "\n" + res.stderr).splitlines() if ln.strip()]
    gpus = sum(1 for ln in lines if _GPU_LINE.match(ln))
    # MIG instances are listed indented under their GPU: they are not trouble.
    said = [ln for ln in lines if not _GPU_LINE.match(ln) and not ln.startswith("MIG ")]
    if res.timed_out:
        said.insert(0, f"nvidia-smi -L did not answer within {SMI_LIST_TIMEOUT_S:g} s")
    error = "; ".join(said[:3]) or (None if res.ok else res.describe_failure())
    return SmiProbe(path=path, answered=res.ok, gpus=gpus if res.ok or gpus else None, error=error)


# --------------------------------------------------------------- IMEX

IMEX_CONFIG_FILE = Path("/etc/nvidia-imex/config.cfg")
# nvidia-imex's defaults when config.cfg does not set them (NVIDIA's IMEX guide).
IMEX_DEFAULT_NODES_FILE = "/etc/nvidia-imex/nodes_config.cfg"
IMEX_DEFAULT_PORT = 50000
# Peers are dialled side by side, each for this long: a domain of 18 trays
# costs a few seconds at worst, well inside doctor's 60 s.
IMEX_DIAL_TIMEOUT_S = 3.0

Connect = Callable[[str, int, float], None]


def parse_key_values(text: str) -> dict[str, str]:
    """KEY=VALUE lines of config.cfg; # starts a comment."""
    out = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        k, sep, v = line.partition("=")
        if sep and k.strip():
            out[k.strip()] = v.strip()
    return out


def parse_nodes_config(text: str) -> list[str]:
    """nodes_config.cfg: one address per line (blank lines and # comments skipped)."""
    out = []
    for line in text.splitlines():
        words = line.split("#", 1)[0].split()
        if words and words[0] not in out:
            out.append(words[0])
    return out


def parse_all_addresses(text: str) -> list[str]:
    """Every address of `ip -j addr show` (IPv4 and IPv6)."""
    return [str(a["local"]) for link in json.loads(text or "[]") for a in link.get("addr_info", ()) if a.get("local")]


def tcp_connect(host: str, port: int, timeout: float) -> None:
    with socket.create_connection((host, port), timeout=timeout):
        pass


def read_imex_config(config_file: Path, run: Runner, connect: Connect = tcp_connect) -> ImexConfig | None:
    """nvidia-imex's config and its peers, each dialled on the IMEX port;
    None on a machine without an IMEX configuration."""
    try:
        cfg = parse_key_values(config_file.read_text())
    except OSError:
        return None
    nodes_file = cfg.get("IMEX_NODE_CONFIG_FILE") or IMEX_DEFAULT_NODES_FILE
    try:
        port = int(cfg.get("SERVER_PORT") or IMEX_DEFAULT_PORT)
    except ValueError:
        port = IMEX_DEFAULT_PORT
    out = ImexConfig(config_file=str(config_file), nodes_file=nodes_file, port=port)
    res = run(["ip", "-j", "addr", "show"], 5.0)
    if res.ok:
        out.local_addresses = parse_all_addresses(res.stdout)
    try:
        addresses = parse_nodes_config(Path(nodes_file).read_text())
    except OSError as exc:
        out.error = exc.strerror or str(exc)
        return out
    local = set(out.local_addresses or ())
    out.peers = [ImexPeer(address=a, local=a in local) for a in addresses]
    dial_peers([p for p in out.peers if not p.local], port, connect)
    return out


def dial_peers(peers: Sequence[ImexPeer], port: int, connect: Connect, timeout: float = IMEX_DIAL_TIMEOUT_S) -> None:
    """Dial every peer at once. Daemon threads, and results taken only from
    the dials that ended: one that hangs past its timeout is said as silent
    and holds nothing up."""
    results: dict[int, str | None] = {}

    def dial(i: int, p: ImexPeer) -> None:
        try:
            connect(p.address, port, timeout)
            results[i] = None
        except TimeoutError:
            results[i] = f"no answer within {timeout:g} s"
        except OSError as exc:
            results[i] = exc.strerror or str(exc)

    threads = [threading.Thread(target=dial, args=(i, p), daemon=True) for i, p in enumerate(peers)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout + 1.0
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    done = dict(results)  # a copy: a late dial may still be writing
    for i, p in enumerate(peers):
        if i in done:
            p.reachable, p.error = done[i] is None, done[i]
        else:
            p.reachable, p.error = False, f"no answer within {timeout:g} s"
