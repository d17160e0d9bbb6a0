"""What every role's process shares: its logging, its event loop, running until a signal.

Each role (`llmgw server`, `llmgw agent`, `llmgw mirror serve`, `llmgw up`, the
fake engine) exposes one coroutine that takes an :class:`asyncio.Event` and
serves until the event is set; :func:`run_until_stopped` runs it on uvloop
when available and sets the event on SIGTERM or SIGINT. Imports nothing of
the roles, so an agent process loads no server code.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def setup_logging(level: str = "info") -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO), format="%(asctime)s %(levelname)-7s %(name)s: %(message)s"
    )
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop where it is installed; None (asyncio's own) elsewhere."""
    try:
        import uvloop
    except ImportError:  # uvloop is optional on platforms without it
        return None
    return uvloop.new_event_loop


def run_until_stopped(main: Callable[[asyncio.Event], Awaitable[T]]) -> T:
    """Run ``main(stop)`` in a new event loop; SIGTERM and SIGINT set ``stop``, and ``main`` decides
    how to wind down. Returns what ``main`` returns; what it raises goes to the caller."""

    async def go() -> T:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, stop.set)
        try:
            return await main(stop)
        finally:
            for sig in STOP_SIGNALS:
                loop.remove_signal_handler(sig)

    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(go())
