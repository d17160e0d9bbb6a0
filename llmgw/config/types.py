"""Value types shared by configuration files: listen addresses, durations, byte sizes."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BeforeValidator, PlainSerializer


@dataclass(frozen=True, slots=True)
class ListenAddress:
    """Where a listener binds. An empty host means every interface."""

    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def bind_host(self) -> str | None:
        # aiohttp binds all interfaces (IPv4 and IPv6) when host is None.
        return self.host or None

    @property
    def connect_host(self) -> str:
        """The address a local client should dial to reach this listener."""
        if self.host in ("", "0.0.0.0"):
            return "127.0.0.1"
        if self.host == "::":
            return "::1"
        return self.host


def parse_listen(value: Any) -> ListenAddress:
    if isinstance(value, ListenAddress):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        value = f":{value}"
    if not isinstance(value, str):
        raise ValueError('should be an address such as ":8080" or "127.0.0.1:9090"')
    text = value.strip()
    m = re.fullmatch(r"(?:\[(?P<v6>[0-9a-fA-F:.]+)\]|(?P<host>[^:\[\]]*)):(?P<port>\d{1,5})", text)
    if not m:
        raise ValueError(f'"{value}" is not an address; write host:port, ":8080" or "[::1]:9090"')
    port = int(m.group("port"))
    if not 0 < port < 65536:
        raise ValueError(f'"{value}": port {port} is outside 1-65535')
    host = m.group("v6") if m.group("v6") is not None else (m.group("host") or "")
    return ListenAddress(host=host, port=port)


_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(value: Any) -> float:
    """Seconds from 90, 1.5, "250ms", "30s", "10m", "1h30m"."""
    if isinstance(value, bool):
        raise ValueError("should be a duration such as 30s, 10m or 250ms")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip()
        parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", text)
        if not parts or "".join(n + u for n, u in parts) != text.replace(" ", ""):
            raise ValueError(f'"{value}" is not a duration; write it like 30s, 10m, 1h30m or 250ms')
        seconds = sum(float(n) * _DURATION_UNITS[u] for n, u in parts)
    else:
        raise ValueError("should be a duration such as 30s, 10m or 250ms")
    if seconds <= 0:
        raise ValueError("should be longer than zero")
    return seconds


_SIZE_UNITS = {"": 1, "b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "kib": 1024, "mib": 1024**2, "gib": 1024**3}


def parse_size(value: Any) -> int:
    """Bytes from 1048576, "32MiB", "1.5GB"."""
    if isinstance(value, bool):
        raise ValueError("should be a size such as 32MiB")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", value)
        if not m or m.group(2).lower() not in _SIZE_UNITS:
            raise ValueError(f'"{value}" is not a size; write bytes or a unit: 32MiB, 500KB, 1GiB')
        size = int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
    else:
        raise ValueError("should be a size such as 32MiB")
    if size <= 0:
        raise ValueError("should be larger than zero")
    return size


Listen = Annotated[ListenAddress, BeforeValidator(parse_listen), PlainSerializer(str, return_type=str)]
Duration = Annotated[float, BeforeValidator(parse_duration)]
ByteSize = Annotated[int, BeforeValidator(parse_size)]
