"""Readiness: /health says the process is up, /v1/models listing the name says the weights loaded.

Routing on /health alone sends traffic into a model still loading, so both
questions are asked, in that order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import aiohttp

from llmgw.agent.engines.plan import HealthCheck


@dataclass(frozen=True, slots=True)
class Readiness:
    state: Literal["starting", "loading", "ready"]
    detail: str

    @property
    def ready(self) -> bool:
        return self.state == "ready"


def listed_models(payload: Any) -> list[str]:
    """Model names in a /v1/models answer (OpenAI's data[].id; llama.cpp adds aliases and its own models[])."""
    names: list[str] = []
    if not isinstance(payload, dict):
        return names
    for item in payload.get("data") or []:
        if isinstance(item, dict):
            for n in [item.get("id"), *(item.get("aliases") or [])]:
                if isinstance(n, str) and n not in names:
                    names.append(n)
    for item in payload.get("models") or []:
        if isinstance(item, dict):
            for n in (item.get("name"), item.get("model")):
                if isinstance(n, str) and n not in names:
                    names.append(n)
    return names


def lists_model(payload: Any, name: str) -> bool:
    return name in listed_models(payload)


async def probe(check: HealthCheck, session: aiohttp.ClientSession, timeout: float = 5.0) -> Readiness:
    """One readiness probe of a leader; never raises for an engine that is not there yet."""
    t = aiohttp.ClientTimeout(total=timeout)
    where = f"{check.host}:{check.port}"
    try:
        async with session.get(check.url(check.health_path), timeout=t, headers=check.headers) as resp:
            if resp.status != 200:
                return Readiness("loading", f"{check.health_path} answered {resp.status}")
        async with session.get(check.url(check.models_path), timeout=t, headers=check.headers) as resp:
            if resp.status != 200:
                return Readiness("loading", f"{check.models_path} answered {resp.status}")
            payload = await resp.json(content_type=None)
    except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, ConnectionError):
        return Readiness("starting", f"nothing answers on {where} yet")
    except (TimeoutError, aiohttp.ClientError) as exc:
        return Readiness("loading", f"{where} did not answer in time ({type(exc).__name__})")
    except ValueError:
        return Readiness("loading", f"{check.models_path} did not answer JSON")
    names = listed_models(payload)
    if check.model not in names:
        return Readiness(
            "loading",
            f"{check.models_path} does not list {check.model} yet (it lists: {', '.join(names) or 'nothing'})",
        )
    return Readiness("ready", f"{check.model} is listed")
