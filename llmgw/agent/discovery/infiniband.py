"""InfiniBand and RoCE adapters from sysfs (/sys/class/infiniband).

Per adapter: fw_ver, node_guid, board_id, and the PCI device it is (the
`device` link) with its NUMA node. Per port (ports/N): state ("4: ACTIVE"),
phys_state ("5: LinkUp"), rate ("400 Gb/sec (4X NDR)"), link_layer, lid,
sm_lid, gids/0 (prefix and port GUID) and counters/. On a RoCE port
(link layer Ethernet) the GID table is searched for the RoCE v2 entry holding
an IPv4-mapped address: NCCL's default GID index 0 is a RoCE v1 link-local
entry on most hosts, which does not route, and a job on it hangs.

A node without adapters is normal (a single-node island), not an error.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path

from llmgw.protocol import HCA, IBPort

from .commands import Runner

DEFAULT_IB_ROOT = Path("/sys/class/infiniband")

# The counters worth watching: errors that say a cable, transceiver or switch
# port is going bad before a job fails on it, and the data counters that say
# whether the fabric carries anything.
PORT_COUNTERS: tuple[str, ...] = (
    "symbol_error",
    "link_error_recovery",
    "link_downed",
    "port_rcv_errors",
    "port_rcv_remote_physical_errors",
    "port_rcv_switch_relay_errors",
    "port_xmit_discards",
    "port_xmit_constraint_errors",
    "port_rcv_constraint_errors",
    "local_link_integrity_errors",
    "excessive_buffer_overrun_errors",
    "VL15_dropped",
    "port_xmit_wait",
    "port_xmit_data",
    "port_rcv_data",
    "port_xmit_packets",
    "port_rcv_packets",
)
# sysfs counts these in 4-byte words.
_WORD_COUNTERS = frozenset({"port_xmit_data", "port_rcv_data"})

_IPV4_MAPPED_PREFIX = "0000:0000:0000:0000:0000:ffff:"
_RATE = re.compile(r"^\s*([\d.]+)\s*Gb/sec(?:\s*\(([^)]*)\))?", re.I)

# netdev, IPv4 address -> the IP network it is configured in ("10.0.0.0/24").
NetworkLookup = Callable[[str, str], "str | None"]


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace").strip()
    except OSError:
        # Missing, or EINVAL: unpopulated GID attributes refuse to be read.
        return None


def strip_code(value: str | None) -> str | None:
    """ "4: ACTIVE" -> "ACTIVE", "5: LinkUp" -> "LinkUp"."""
    if not value:
        return None
    head, sep, rest = value.partition(":")
    return rest.strip() if sep and head.strip().isdigit() else value.strip()


def parse_rate(value: str | None) -> tuple[float | None, str | None]:
    """ "400 Gb/sec (4X NDR)" -> (400.0, "4X NDR")."""
    if not value:
        return None, None
    m = _RATE.match(value)
    if not m:
        return None, None
    return float(m.group(1)), (m.group(2).strip() if m.group(2) else None)


def parse_int(value: str | None) -> int | None:
    """Decimal or 0x-prefixed hex, as lid and sm_lid are written."""
    if not value:
        return None
    try:
        return int(value, 16) if value.lower().startswith("0x") else int(value)
    except ValueError:
        return None


def normalize_guid(value: str | None) -> str | None:
    """sysfs writes "0c42:a103:0045:bd6c", diagnostics "0x0c42a1030045bd6c";
    both become the latter. An all-zero GUID is no GUID."""
    if not value:
        return None
    g = value.strip().lower().removeprefix("0x").replace(":", "")
    if not g or not all(c in "0123456789abcdef" for c in g) or not g.strip("0"):
        return None
    return "0x" + g.rjust(16, "0")


def gid_prefix(gid: str | None) -> str | None:
    parts = (gid or "").lower().split(":")
    return ":".join(parts[:4]) if len(parts) == 8 else None


def port_guid_from_gid(gid: str | None) -> str | None:
    """The interface half of a GID (its last four groups) is the port GUID."""
    parts = (gid or "").split(":")
    return normalize_guid("".join(parts[4:])) if len(parts) == 8 else None


def gid_ipv4(gid: str | None) -> str | None:
    """The IPv4 address inside an IPv4-mapped GID (::ffff:a.b.c.d), else None."""
    g = (gid or "").strip().lower()
    if not g.startswith(_IPV4_MAPPED_PREFIX):
        return None
    hexpart = g.removeprefix(_IPV4_MAPPED_PREFIX).replace(":", "")
    if len(hexpart) != 8:
        return None
    try:
        return str(ipaddress.IPv4Address(bytes.fromhex(hexpart)))
    except ValueError:
        return None


def _numeric_entries(path: Path) -> list[int]:
    try:
        return sorted(int(n) for n in os.listdir(path) if n.isdigit())
    except OSError:
        return []


def find_rocev2_gid(port_dir: Path) -> int | None:
    """The GID index a RoCE port's traffic should use: the first RoCE v2 entry
    holding an IPv4 address, else the first RoCE v2 entry; None without one."""
    first_v2: int | None = None
    for i in _numeric_entries(port_dir / "gids"):
        kind = _read(port_dir / "gid_attrs" / "types" / str(i))
        if not kind or kind.strip().lower() != "roce v2":
            continue
        if gid_ipv4(_read(port_dir / "gids" / str(i))):
            return i
        if first_v2 is None:
            first_v2 = i
    return first_v2


def read_counters(port_dir: Path) -> dict[str, int] | None:
    counters: dict[str, int] = {}
    for name in PORT_COUNTERS:
        raw = _read(port_dir / "counters" / name)
        if raw is None:
            continue  # this driver does not have it: absent, not zero
        try:
            v = int(raw)
        except ValueError:
            continue
        counters[name] = v * 4 if name in _WORD_COUNTERS else v
    return counters or None


def read_port(
    hca: str,
    port_dir: Path,
    *,
    node_guid: str | None = None,
    netdevs: list[str] | None = None,
    network_of: NetworkLookup | None = None,
) -> IBPort:
    rate, detail = parse_rate(_read(port_dir / "rate"))
    gid0 = _read(port_dir / "gids" / "0")
    port = IBPort(
        hca=hca,
        port=int(port_dir.name),
        state=strip_code(_read(port_dir / "state")),
        phys_state=strip_code(_read(port_dir / "phys_state")),
        link_layer=_read(port_dir / "link_layer") or None,
        rate_gbps=rate,
        rate_detail=detail,
        lid=parse_int(_read(port_dir / "lid")),
        sm_lid=parse_int(_read(port_dir / "sm_lid")),
        node_guid=node_guid,
        port_guid=port_guid_from_gid(gid0),
        gid_prefix=gid_prefix(gid0),
        counters=read_counters(port_dir),
    )
    if port.is_roce:
        # RoCE has no LIDs or subnet manager; these read 0 and mean nothing.
        port.lid = port.sm_lid = None
        idx = find_rocev2_gid(port_dir)
        if idx is not None:
            port.gid_index = idx
            port.gid = _read(port_dir / "gids" / str(idx))
            port.roce_address = gid_ipv4(port.gid)
            port.netdev = _read(port_dir / "gid_attrs" / "ndevs" / str(idx)) or None
            if port.roce_address and port.netdev and network_of is not None:
                port.network = network_of(port.netdev, port.roce_address)
    if port.netdev is None and netdevs:
        port.netdev = netdevs[0]
    return port


def read_adapters(
    root: Path = DEFAULT_IB_ROOT,
    *,
    network_of: NetworkLookup | None = None,
) -> list[HCA]:
    """Every adapter under ``root`` with its ports, sorted by name. A missing
    root is a node without RDMA adapters: an empty list."""
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        return []
    adapters = []
    for name in names:
        d = root / name
        node_guid = normalize_guid(_read(d / "node_guid"))
        pci_address = numa = None
        try:
            dev = (d / "device").resolve(strict=True)
            pci_address = dev.name
            n = parse_int(_read(dev / "numa_node"))
            numa = n if n is not None and n >= 0 else None  # -1: no NUMA affinity
        except OSError:
            pass
        try:
            netdevs = sorted(os.listdir(d / "device" / "net"))
        except OSError:
            netdevs = []
        ports = [
            read_port(name, d / "ports" / str(p), node_guid=node_guid, netdevs=netdevs, network_of=network_of)
            for p in _numeric_entries(d / "ports")
        ]
        adapters.append(
            HCA(
                name=name,
                fw_ver=_read(d / "fw_ver") or None,
                node_guid=node_guid,
                board_id=_read(d / "board_id") or None,
                pci_address=pci_address,
                numa_node=numa,
                ports=ports,
            )
        )
    return adapters


def parse_ip_addr(text: str) -> list[ipaddress.IPv4Interface]:
    """IPv4 addresses from `ip -o -4 addr show`: "2: ens1f0    inet 10.0.0.1/24 brd ..."."""
    out = []
    for line in text.splitlines():
        f = line.split()
        for i, word in enumerate(f[:-1]):
            if word == "inet":
                try:
                    out.append(ipaddress.IPv4Interface(f[i + 1]))
                except ValueError:
                    pass
    return out


def ip_network_lookup(run: Runner) -> NetworkLookup:
    """A NetworkLookup asking `ip` which network the RoCE address is configured in."""

    def lookup(netdev: str, address: str) -> str | None:
        res = run(["ip", "-o", "-4", "addr", "show", "dev", netdev], 5.0)
        if not res.ok:
            return None
        for iface in parse_ip_addr(res.stdout):
            if str(iface.ip) == address:
                return str(iface.network)
        return None

    return lookup


def ports_of(adapters: Iterable[HCA]) -> list[IBPort]:
    return [p for a in adapters for p in a.ports or ()]
