"""One accountant for every worker of a server: limits across workers exactly as in one process.

With `workers: N` (server/workers.py) N processes serve the client listener. Were each to count a
key's requests, tokens and budget on its own, a key would get up to N times its limits; leasing
shares of each pool through the store (shared_limits.py, what gateways on several machines do)
admits a chunk per process over the limit and carries budgets' spend only once usage rows are
written, so a burst at a budget spent it N times over. Instead the server process's accountant
(limits.py) is the only one: a worker asks it, over a socket pair of its own, to admit each
request, and tells it how each ended. What the accountant decides is then exactly what one
process decides, whatever N is, and it never waits for the store, so the store being locked or
unreachable changes nothing here.

The cost is a round trip on loopback per limited request (a key with no limits and no allow-list
is not asked about at all), measured in docs/benchmarks.md. Settlements and cancellations need no
answer, and wait up to SETTLE_DELAY_S to leave with the next admission. Messages are
length-prefixed orjson arrays, written once per turn of the loop however many were sent in it, so
a burst costs one system call a turn:

    worker -> server   ["p", pools_id, [[key, rpm, tpm, budget_micros, period], ...]]   pools, once
                       ["c", call_id, pools_id, model, est_prompt, est_completion]      admit (model
                                                                                        null: no model)
                       ["s", reservation_id, prompt_tokens, completion_tokens]         settle
                       ["x", reservation_id]                                            cancel
    server -> worker   ["ok", call_id, reservation_id, headers]
                       ["no", call_id, status, message, code, retry_after, headers]

A principal's pools travel once per process under a number (its key id, project and person never
do: refusals name pools, not keys), since a key's pools are the same objects request after
request. The allow-list needs no trip: the worker has the same principal and checks it itself.

A worker that dies leaves reservations the server cannot settle with real counts: each is charged
its estimate (the engine may well have served it), which is what admitting it already assumed.
The server process going away closes the socket and the worker stops (server/workers.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from collections.abc import Callable
from typing import Any

import orjson

from llmgw.server.gateway.limits import Accountant, AllowancePending, LimitError, Pricing, Reservation
from llmgw.server.gateway.principal import Pool, Principal

log = logging.getLogger("llmgw.gateway.worker_limits")

_LEN = struct.Struct(">I")
MAX_MESSAGE = 1 << 20  # one message at most: a principal's pools are a few hundred bytes
MAX_POOL_SETS = 100_000  # pools numbered by one worker before both sides start the numbering again
# How long a settlement or cancellation may wait to leave with the next admission: one wake of the
# server a request instead of two when requests come one at a time. Waiting only keeps the estimate
# held a moment longer, which errs on the safe side.
SETTLE_DELAY_S = 0.005


class _Frames(asyncio.Protocol):
    """Length-prefixed orjson arrays over a stream socket; what is sent in one turn of the loop
    leaves in one write."""

    def __init__(self, on_message: Callable[[Any], None]) -> None:
        self._on_message = on_message  # each message, as it arrives
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._out: list[bytes] = []
        self._flush: asyncio.Handle | None = None
        self._flush_soon = False  # the write queued is this turn's, not a delayed one
        self.closed = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # (uvloop's is no asyncio.Transport subclass)

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        at = 0
        n = len(buf)
        while n - at >= 4:
            (size,) = _LEN.unpack_from(buf, at)
            if size > MAX_MESSAGE:
                log.error("limits channel: a message of %d bytes; closing it", size)
                self.close()
                return
            if n - at - 4 < size:
                break
            try:
                msg = orjson.loads(memoryview(buf)[at + 4 : at + 4 + size])
            except orjson.JSONDecodeError:
                log.error("limits channel: a message that is not JSON; closing it")
                self.close()
                return
            at += 4 + size
            try:
                self._on_message(msg)
            except Exception:
                log.exception("limits channel: a message could not be handled: %.200r", msg)
        if at:
            del buf[:at]

    def send(self, msg: list[Any], *, soon: bool = True) -> None:
        """Queue a message: it leaves at the end of this turn of the loop, or with ``soon`` false
        within SETTLE_DELAY_S (sooner with the next message that cannot wait)."""
        if self.transport is None or self.transport.is_closing():
            return
        data = orjson.dumps(msg)
        self._out.append(_LEN.pack(len(data)) + data)
        flush = self._flush
        if flush is None or (soon and not self._flush_soon):
            if flush is not None:
                flush.cancel()  # a delayed write, brought forward
            loop = asyncio.get_running_loop()
            self._flush = loop.call_soon(self._write) if soon else loop.call_later(SETTLE_DELAY_S, self._write)
            self._flush_soon = soon

    def _write(self) -> None:
        self._flush = None
        out, self._out = self._out, []
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(out))

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        if not self.closed.done():
            self.closed.set_result(None)
        self.lost()

    def lost(self) -> None:
        pass


# -- the server process's side ----------------------------------------------------------


def _pools(rows: list[list[Any]]) -> tuple[Pool, ...]:
    return tuple(
        Pool(str(key), rpm if rpm is None else int(rpm), tpm if tpm is None else int(tpm), budget, period)
        for key, rpm, tpm, budget, period in rows
    )


class AccountantLink(_Frames):
    """The server process's end of one worker's limits channel: its accountant answers."""

    def __init__(self, accountant: Accountant, worker: int) -> None:
        super().__init__(self.received)
        self.accountant = accountant
        self.worker = worker
        self._principals: dict[int, Principal] = {}
        self._reservations: dict[int, Reservation] = {}
        self._next = 0
        self._waits: set[asyncio.Task[None]] = set()

    def received(self, msg: Any) -> None:
        op = msg[0]
        if op == "c":
            _, cid, pid, model, ep, ec = msg
            principal = self._principals[pid]
            try:
                res = self.accountant.check(principal, model, ep, ec)
            except AllowancePending as pending:
                # Shared limits across gateways: the share here is short and a refill is coming.
                t = asyncio.create_task(self._after_refill(cid, pending, principal, model, ep, ec))
                self._waits.add(t)
                t.add_done_callback(self._waits.discard)
                return
            except LimitError as exc:
                self._refuse(cid, exc)
                return
            self._admitted(cid, res, principal)
        elif op == "s":
            _, rid, prompt, completion = msg
            ended = self._reservations.pop(rid, None)
            if ended is not None:
                self.accountant.settle(ended, prompt, completion)
        elif op == "x":
            ended = self._reservations.pop(msg[1], None)
            if ended is not None:
                self.accountant.cancel(ended)
        elif op == "p":
            _, pid, rows = msg
            if pid == 0:
                self._principals.clear()  # the worker starts its numbering again
            self._principals[pid] = Principal(key_id=None, key_prefix=None, project=None, pools=_pools(rows))
        else:
            log.error("limits channel of worker %d: unknown message %.100r", self.worker, msg)

    async def _after_refill(
        self, cid: int, pending: AllowancePending, principal: Principal, model: str | None, ep: int, ec: int
    ) -> None:
        try:
            res = await self.accountant.refilled(pending, principal, model, ep, ec)
        except LimitError as exc:
            self._refuse(cid, exc)
            return
        if self.transport is None or self.transport.is_closing():
            self.accountant.cancel(res)  # the worker is gone: nobody will use it
            return
        self._admitted(cid, res, principal)

    def _admitted(self, cid: int, res: Reservation, principal: Principal) -> None:
        self._next += 1
        rid = self._next
        self._reservations[rid] = res
        self.send(["ok", cid, rid, self.accountant.headers(principal)])

    def _refuse(self, cid: int, exc: LimitError) -> None:
        self.send(["no", cid, exc.status, exc.message, exc.code, exc.retry_after, exc.headers])

    def lost(self) -> None:
        for t in self._waits:
            t.cancel()
        left = self._reservations
        self._reservations = {}
        for res in left.values():
            self.accountant.forfeit(res)
        if left:
            log.warning(
                "worker %d went away with %d request(s) in progress; each is charged its estimate",
                self.worker,
                len(left),
            )

    @property
    def in_progress(self) -> int:
        return len(self._reservations)


async def serve_accountant(accountant: Accountant, sock: socket.socket, worker: int) -> AccountantLink:
    """Answer one worker's limits channel on this loop until it closes."""
    loop = asyncio.get_running_loop()
    _, link = await loop.create_unix_connection(lambda: AccountantLink(accountant, worker), sock=sock)
    return link


# -- a worker's side ----------------------------------------------------------------------


class RemoteReservation(Reservation):
    """A reservation the server process's accountant holds, under its number there."""

    __slots__ = ("rid",)

    def __init__(self, principal: Principal, model: str | None, estimated_tokens: int, rid: int) -> None:
        super().__init__(principal, model, principal.pools, estimated_tokens, 0.0)
        self.rid = rid


class WorkerAccountant(_Frames):
    """A worker's accountant: what the request path calls (admit, settle, cancel, headers), each
    answered by the server process's accountant."""

    def __init__(self, pricing: Pricing) -> None:
        super().__init__(self.received)
        self.pricing = pricing
        self._ids: dict[tuple[Pool, ...], int] = {}
        self._headers: dict[int, dict[str, str]] = {}
        self._calls: dict[int, asyncio.Future[list[Any]]] = {}
        self._next_call = 0

    @classmethod
    async def connect(cls, pricing: Pricing, sock: socket.socket) -> WorkerAccountant:
        loop = asyncio.get_running_loop()
        _, acc = await loop.create_unix_connection(lambda: cls(pricing), sock=sock)
        return acc

    def _pools_id(self, pools: tuple[Pool, ...]) -> int:
        pid = self._ids.get(pools)
        if pid is None:
            if len(self._ids) >= MAX_POOL_SETS:
                self._ids.clear()  # limits edited many times over: number afresh from 0
                self._headers.clear()
            pid = len(self._ids)
            self._ids[pools] = pid
            self.send(["p", pid, [[p.key, p.rpm, p.tpm, p.budget_micros, p.period] for p in pools]])
        return pid

    async def admit(
        self, principal: Principal, model: str | None, estimated_prompt: int, estimated_completion: int = 0
    ) -> Reservation:
        if model is not None:  # None: a request that calls no model (limits.Accountant.check)
            Accountant.allowed(principal, model)
        if self.transport is None or self.transport.is_closing():
            raise LimitError(503, "the server is stopping; send the request again", "unavailable")
        pid = self._pools_id(principal.pools)
        self._next_call += 1
        cid = self._next_call
        fut: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        self._calls[cid] = fut
        ep, ec = max(estimated_prompt, 0), max(estimated_completion, 0)
        self.send(["c", cid, pid, model, ep, ec])
        try:
            reply = await fut
        finally:
            self._calls.pop(cid, None)
        if reply[0] == "ok":
            self._headers[pid] = reply[3]
            return RemoteReservation(principal, model, ep + ec, reply[2])
        _, _, status, message, code, retry_after, headers = reply
        raise LimitError(status, message, code, retry_after, headers)

    def received(self, msg: Any) -> None:
        fut = self._calls.get(msg[1])
        if fut is not None and not fut.done():
            fut.set_result(msg)

    def settle(self, reservation: Reservation, prompt_tokens: int, completion_tokens: int) -> int:
        if reservation.done:
            return 0
        reservation.done = True
        assert isinstance(reservation, RemoteReservation)
        self.send(["s", reservation.rid, max(prompt_tokens, 0), max(completion_tokens, 0)], soon=False)
        cost = self.pricing.cost_micros(reservation.model, prompt_tokens, completion_tokens)
        reservation.cost_micros = cost
        return cost

    def cancel(self, reservation: Reservation) -> None:
        if reservation.done:
            return
        reservation.done = True
        assert isinstance(reservation, RemoteReservation)
        self.send(["x", reservation.rid], soon=False)

    def headers(self, principal: Principal) -> dict[str, str]:
        """The x-ratelimit-* headers of the principal's pools as the server's accountant gave them
        with this worker's latest admission for them (this request's estimate charged)."""
        pid = self._ids.get(principal.pools)
        return dict(self._headers.get(pid, {})) if pid is not None else {}

    def lost(self) -> None:
        for fut in self._calls.values():
            if not fut.done():
                fut.set_result(["no", 0, 503, "the server is stopping; send the request again", "unavailable", 1.0, {}])

    async def aclose(self) -> None:
        """Send what is waiting and close."""
        if self._flush is not None:
            self._flush.cancel()
            self._write()
        if self.transport is not None:
            self.transport.close()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait((self.closed,), timeout=2.0)
