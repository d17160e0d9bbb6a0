"""Raw HTTP/1.1 over a socket, for tests that send what no client library would (bad bytes, huge headers)."""

from __future__ import annotations

import asyncio
import socket


def parse_response(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """(status, headers with lowercased names, body) of the first response in ``raw``."""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(lines[0].split()[1]), headers, body


def exchange(port: int, data: bytes, timeout: float = 20.0) -> bytes:
    """Send ``data`` to 127.0.0.1:``port``; everything the server sends until it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


async def exchange_async(port: int, data: bytes, timeout: float = 5.0) -> bytes:
    """:func:`exchange` for a test whose server runs in the same event loop."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()
