"""The stream to the control plane: dialling, failing over between addresses, backing off.

A standby refusing, a stopped control plane refusing the connection and a
crashed one never answering look the same from a node: each is a reason to
try the next address. Backoff waits only once every address has just failed.
"""

from __future__ import annotations

import asyncio
import logging
import random
import ssl
import time
from collections.abc import Callable, Coroutine
from typing import Any

import aiohttp

from llmgw.config.agent import AgentConfig
from llmgw.errors import LlmgwError
from llmgw.pki import PKIError, client_context
from llmgw.protocol import STREAM_PATH

log = logging.getLogger("llmgw.agent.client")

_HEALTHY_SESSION = 5.0  # seconds a session must last to reset the backoff

Session = Callable[[aiohttp.ClientWebSocketResponse, str], Coroutine[Any, Any, None]]


class LinkError(LlmgwError):
    """The agent cannot dial at all (bad TLS files); the message says what to fix."""


def tls_context(cfg: AgentConfig) -> ssl.SSLContext | None:
    if cfg.tls is None:
        return None
    try:
        return client_context(cfg.tls.ca, cfg.tls.cert, cfg.tls.key)
    except PKIError as exc:
        raise LinkError(f"tls: {exc}") from None


def next_delay(previous: float, base: float, cap: float) -> tuple[float, float]:
    """(the wait, the new ceiling): exponential backoff with full jitter, never below a tenth of base."""
    ceiling = min(cap, max(base, previous * 2))
    return max(base / 10, random.uniform(0, ceiling)), ceiling


async def _wait_or_stop(stop: asyncio.Event, delay: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), delay)
    except TimeoutError:
        pass


class ControlPlaneLink:
    def __init__(self, cfg: AgentConfig, session: Session, heartbeat: float = 20.0) -> None:
        self.addresses = cfg.addresses()
        self._ssl = tls_context(cfg)
        self._session = session
        self._base, self._cap = cfg.reconnect_base, cfg.reconnect_max
        self._heartbeat = heartbeat
        self.connected_to: str | None = None
        self.last_error: str | None = None

    async def run(self, stop: asyncio.Event) -> None:
        """Hold a stream to some control plane until stop is set."""
        ceiling = 0.0
        async with aiohttp.ClientSession() as http:
            while not stop.is_set():
                served = False
                for addr in self.addresses:
                    if stop.is_set():
                        return
                    served = await self._attempt(http, addr, stop) or served
                    if served:
                        break  # a working session ended: start again from the preferred address
                if stop.is_set():
                    return
                if served:
                    # A restarted control plane loses every agent at the same moment: a
                    # jittered first redial spreads their handshakes over reconnect_base.
                    ceiling = 0.0
                    await _wait_or_stop(stop, random.uniform(0, self._base))
                    continue
                delay, ceiling = next_delay(ceiling, self._base, self._cap)
                log.info("no control plane answered; trying again in %.1fs", delay)
                await _wait_or_stop(stop, delay)

    async def _attempt(self, http: aiohttp.ClientSession, addr: str, stop: asyncio.Event) -> bool:
        """One connection; True when a session was established and lasted (whatever ended it)."""
        url = addr + STREAM_PATH
        try:
            ws = await http.ws_connect(
                url,
                ssl=self._ssl if self._ssl is not None else True,
                heartbeat=self._heartbeat,
                max_msg_size=64 << 20,
                timeout=aiohttp.ClientWSTimeout(ws_close=5.0),
            )
        except aiohttp.WSServerHandshakeError as exc:
            # The control plane answered and refused: a standby, or a certificate that
            # names another node. Its words go to the operator as they are.
            # aiohttp keeps only the status line of a refused upgrade; the control
            # plane repeats its reason in a header so it reaches the operator.
            reason = (exc.headers.get("X-Llmgw-Refusal") if exc.headers is not None else None) or exc.message
            self.last_error = f"{addr} refused the stream ({exc.status}): {reason}"
            log.warning("%s", self.last_error)
            return False
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            self.last_error = f"{addr}: {type(exc).__name__}: {exc}"
            log.warning("cannot reach the control plane at %s", self.last_error)
            return False
        self.connected_to = addr
        started = time.monotonic()
        log.info("connected to the control plane at %s", addr)
        session = asyncio.create_task(self._session(ws, addr))
        stopper = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({session, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
            if not session.done():
                session.cancel()
            await ws.close()
            try:
                await session
            except asyncio.CancelledError:
                pass
            except Exception as exc:  # a session error is not a clean close
                self.last_error = f"{addr}: the session failed: {exc!r}"
                log.warning("%s", self.last_error)
            self.connected_to = None
        if not stop.is_set():
            log.warning("the stream to %s ended", addr)
        # A stream refused or dropped right after it opened (a rejected certificate, a
        # control plane restarting) counts as a failure, so reconnecting backs off
        # instead of hammering the control plane.
        return time.monotonic() - started >= _HEALTHY_SESSION
