"""The official MCP Python SDK's client, connected over the streamable HTTP transport with a
bearer token: how the tests drive llmgw's MCP route as an agent would."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from mcp import ClientSession
from mcp.client import streamable_http


@asynccontextmanager
async def client_streams(url: str, token: str) -> AsyncIterator[tuple[Any, Any]]:
    """The official transport's read and write streams, with the bearer token on every request.

    mcp 1.9 has streamablehttp_client(headers=); 1.24 adds streamable_http_client(http_client=)
    on httpx, 2.x on httpx2 (the module's own import says which); 1.x yields a third item.
    """
    headers = {"Authorization": f"Bearer {token}"}
    if hasattr(streamable_http, "streamable_http_client"):
        client_httpx = getattr(streamable_http, "httpx2", httpx)
        async with (
            client_httpx.AsyncClient(headers=headers) as http,
            streamable_http.streamable_http_client(url, http_client=http) as streams,
        ):
            yield streams[0], streams[1]
    else:
        async with streamable_http.streamablehttp_client(url, headers=headers) as streams:  # type: ignore[attr-defined]
            yield streams[0], streams[1]


@asynccontextmanager
async def official_client(url: str, token: str) -> AsyncIterator[ClientSession]:
    """An initialized session of the SDK's ClientSession."""
    async with client_streams(url, token) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        yield session
