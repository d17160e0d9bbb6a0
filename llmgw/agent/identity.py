"""Who this node is and how it is reached: node id, management address and interface.

Each is found unless agent.yaml says otherwise; what is written wins.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from llmgw.config.agent import AgentConfig

_SIOCGIFADDR = 0x8915


@dataclass(frozen=True, slots=True)
class Identity:
    node_id: str
    mgmt_addr: str | None
    mgmt_interface: str | None


def source_address(url: str) -> str | None:
    """The local address the kernel picks to reach url's host.

    A UDP connect chooses a route and a source address without sending anything.
    """
    parts = urlsplit(url)
    host, port = parts.hostname, parts.port or 7443
    if not host:
        return None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, _, _, _, sockaddr in infos:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            try:
                s.connect(sockaddr)
                return s.getsockname()[0]
            except OSError:
                continue
    return None


def _ipv4_of(ifname: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", ifname.encode()[:15]))
        except OSError:  # the interface has no IPv4 address
            return None
    return socket.inet_ntoa(packed[20:24])


def interface_of(addr: str, if_inet6: Path = Path("/proc/net/if_inet6")) -> str | None:
    """The interface holding addr (IPv4 through the kernel, IPv6 from /proc/net/if_inet6)."""
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        return None
    if ip.version == 6:
        try:
            for line in if_inet6.read_text().splitlines():
                fields = line.split()
                if len(fields) >= 6 and ipaddress.ip_address(int(fields[0], 16)) == ip:
                    return fields[5]
        except OSError:
            return None
        return None
    for _, name in socket.if_nameindex():
        if _ipv4_of(name) == addr:
            return name
    return None


def resolve_identity(cfg: AgentConfig) -> Identity:
    node_id = cfg.node_id or socket.gethostname()
    addr = cfg.mgmt_addr
    if addr is None:
        for server in cfg.addresses():
            addr = source_address(server)
            if addr:
                break
    iface = cfg.mgmt_interface or (interface_of(addr) if addr else None)
    return Identity(node_id=node_id, mgmt_addr=addr, mgmt_interface=iface)
