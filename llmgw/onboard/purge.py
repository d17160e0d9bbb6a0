"""`llmgw node remove NAME --purge`: the agent stopped and its files removed on the node over SSH, then the
node forgotten by the control plane once it is unreachable with nothing placed on it.

The engines run in the agent's unit's cgroup (KillMode=process leaves them
running when the agent alone stops, so a restart adopts them); a purge kills
the whole cgroup, engines included, before the files go.
"""

from __future__ import annotations

import asyncio
import shlex

from llmgw.config.agent import DEFAULT_AGENT_CONFIG_PATH, DEFAULT_ENGINES_DIR, DEFAULT_WEIGHTS_CACHE
from llmgw.init.machine import DEFAULT_BINARY
from llmgw.init.units import AGENT_UNIT
from llmgw.onboard import OnboardError
from llmgw.onboard.add import REMOTE_CA, REMOTE_CERT, REMOTE_KEY, TRUST, UNIT_PATH
from llmgw.onboard.ssh import DEFAULT_KNOWN_HOSTS, Target, connect
from llmgw.progress import Status, Steps

# What node add (and the agent) put on a node; weights and engines go too, the operator asked to purge.
PURGED = [
    DEFAULT_AGENT_CONFIG_PATH,
    REMOTE_CERT,
    REMOTE_KEY,
    REMOTE_CA,
    UNIT_PATH,
    "/var/lib/llmgw-agent",
    DEFAULT_ENGINES_DIR,
    DEFAULT_WEIGHTS_CACHE,
    DEFAULT_BINARY,
    *(f"{d}/{n}" for d, n, _ in TRUST),
]


async def _purge(target: Target, steps: Steps, *, identity: str | None, known_hosts: str, wait: float) -> None:
    key = f"{target.host} purge"
    steps.begin(key, "purge")
    try:
        session, _ = await connect(target, identity=identity, known_hosts=known_hosts, wait=wait)
    except OnboardError as exc:
        steps.end(key, Status.FAILED, str(exc))
        raise
    try:
        await session.check_sudo()
        # stop, then kill what KillMode=process left in the unit's cgroup (the engines)
        await session.run(f"systemctl disable --now {AGENT_UNIT}; systemctl kill --signal=KILL {AGENT_UNIT}")
        await session.must(
            "rm -rf -- "
            + " ".join(shlex.quote(p) for p in PURGED)
            # the directories node add made, when nothing else is in them
            + " && { rmdir /etc/llmgw /opt/llmgw 2>/dev/null; true; } && systemctl daemon-reload",
            "removing the agent's files",
        )
        for _, _, command in TRUST:
            await session.run(f"command -v {command} >/dev/null && {command}")
    except OnboardError as exc:
        steps.end(key, Status.FAILED, str(exc))
        raise
    finally:
        await session.close()
    steps.end(
        key, Status.CHANGED, f"stopped {AGENT_UNIT} and its engines; removed {', '.join(PURGED[:5])} and the rest"
    )


def purge_node(
    target: Target,
    steps: Steps,
    *,
    identity: str | None = None,
    known_hosts: str = DEFAULT_KNOWN_HOSTS,
    wait: float = 30.0,
) -> None:
    asyncio.run(_purge(target, steps, identity=identity, known_hosts=known_hosts, wait=wait))
