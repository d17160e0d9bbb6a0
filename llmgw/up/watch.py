"""Watching the control plane until the model is served: its progress in words, and why it cannot go on."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llmgw.protocol import ProvisionState
from llmgw.up import UpError
from llmgw.up.pki import NODE_ID
from llmgw.up.processes import AgentProcess

if TYPE_CHECKING:
    from llmgw.server.app import Server


@dataclass
class Progress:
    """What `up` is waiting for, in words, and the reason it cannot go on (None while it can)."""

    words: str
    failure: str | None = None


def describe(node: Any, rows: list[dict[str, Any]], model_status: dict[str, Any] | None = None) -> Progress:
    """``node``: the agent service's record of the local node (None before it registers);
    ``rows``: the reconciler's replica rows for the model; ``model_status``: its status
    (a failed replica is dropped from the rows at once, its reason kept there)."""
    if node is None or not getattr(node, "connected", False):
        return Progress("waiting for the local agent to connect over mutual TLS")
    p = (node.provision or {}).get("llamacpp")
    if p is None or p.state != ProvisionState.READY:
        if p is None:
            return Progress("the agent is looking at llama.cpp")
        if p.state == ProvisionState.FAILED:
            return Progress(
                "installing llama.cpp failed", f"installing llama.cpp failed: {p.detail or 'no reason given'}"
            )
        if p.state in (ProvisionState.UNSUPPORTED, ProvisionState.SKIPPED):
            return Progress(
                "llama.cpp cannot be installed", f"llama.cpp cannot be installed here: {p.detail or p.state.value}"
            )
        words = f"installing llama.cpp: {p.detail or p.state.value}"
        if p.progress is not None and p.progress.percent is not None:
            words += f" ({p.progress.percent:.0f}%)"
        return Progress(words)
    backoff = (model_status or {}).get("backoff")
    if backoff and backoff.get("failures"):
        # One machine, one node: a start that failed fails the same way again.
        return Progress(
            "the engine failed", f"the engine failed to start: {backoff.get('last_failure') or 'no reason given'}"
        )
    if not rows:
        problem = (model_status or {}).get("problem")
        return Progress(f"placing the model on this machine{f': {problem}' if problem else ''}")
    failed = [r for r in rows if r["state"] == "failed"]
    if failed and not any(r["state"] in ("starting", "ready") for r in rows):
        return Progress(
            "the engine failed", f"the engine failed to start: {failed[-1].get('reason') or 'no reason given'}"
        )
    row = next((r for r in rows if r["state"] in ("starting", "ready")), rows[-1])
    for shard in row.get("shards") or ():
        fetch = shard.get("fetch")
        if fetch and shard.get("state") == "pending":
            pct = fetch.get("percent")
            return Progress(f"fetching the weights{'' if pct is None else f' {pct:.0f}%'}")
    if row["state"] == "ready":
        return Progress("llama-server is up; waiting for its health check")
    return Progress("starting llama-server with the model")


def engine_pids(rows: list[dict[str, Any]]) -> set[int]:
    return {s["pid"] for r in rows for s in r.get("shards") or () if s.get("pid")}


async def wait_until_served(
    server: Server,
    model: str,
    agent: AgentProcess,
    status: Callable[[str], None],
    seen_pids: set[int],
    interval: float = 0.1,
) -> None:
    """Until the gateway has a healthy endpoint for ``model``; UpError with the reason when it cannot get one."""
    last = None
    said_ready = False
    while True:
        rc = agent.exited()
        if rc is not None:
            raise UpError(f"the agent exited with status {rc}; its last lines ({agent.log_path}):\n{agent.tail()}")
        rows = server.reconciler.replica_rows(model) if server.reconciler is not None else []
        seen_pids |= engine_pids(rows)
        if server.endpoints.model_ready(model):
            return
        node = server.agents.get(NODE_ID) if server.agents is not None else None
        installed = (node.provision or {}).get("llamacpp") if node is not None else None
        if installed is not None and installed.state == ProvisionState.READY and not said_ready:
            said_ready = True
            status(f"llama.cpp is ready: {installed.detail or installed.version}")
        p = describe(node, rows, server.reconciler.model_status(model) if server.reconciler is not None else None)
        if p.failure is not None:
            raise UpError(f"{p.failure}\nthe agent's last lines ({agent.log_path}):\n{agent.tail()}")
        if p.words != last:
            last = p.words
            status(p.words)
        await asyncio.sleep(interval)
