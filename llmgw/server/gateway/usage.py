"""Usage rows, collected off the request path and written to the store in batches.

What the store has not taken when the server stops goes to the usage journal on
local disk, and the next start writes the journal to the store before it serves.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Sequence
from typing import Protocol

from llmgw.errors import LlmgwError
from llmgw.server.gateway.usage_journal import UsageJournal
from llmgw.store import UsageRow

log = logging.getLogger("llmgw.gateway.usage")

DROP_LOG_EVERY_S = 10.0  # a store away for hours drops rows all along: one line per period, with the count
TORN_LINES_SHOWN = 10


class UsageSink(Protocol):
    async def insert_usage(self, rows: Sequence[UsageRow]) -> None: ...


class JournalError(LlmgwError):
    """The journal of an earlier run could not be read or written to the store; its rows
    are still in it. The message says what to do."""


class UsageRecorder:
    """A bounded in-memory queue drained by one background task.

    Recording is a deque append, so a slow or unreachable store never slows a
    request; when the store stays away long enough for the queue to fill,
    further rows are counted as dropped rather than held without bound. At stop,
    the store gets `final_flush` seconds for what is queued; the rest goes to the
    journal. Every row lost (queue full, journal unwritable, a torn journal line)
    is counted in `dropped` and logged as an error.
    """

    def __init__(
        self,
        sink: UsageSink,
        flush_interval: float = 1.0,
        batch_size: int = 500,
        queue_limit: int = 100_000,
        journal: UsageJournal | None = None,
        final_flush: float = 5.0,
    ) -> None:
        self._sink = sink
        self._pending: collections.deque[UsageRow] = collections.deque()
        self._limit = queue_limit
        self._interval = flush_interval
        self._batch = batch_size
        self._journal = journal
        self._final_flush = final_flush
        self._task: asyncio.Task | None = None
        self._stopped = False
        self._inflight: list[UsageRow] = []
        # One write at a time: flush() returns only once what was recorded before it is in
        # the store, including a batch the periodic writer already had in flight.
        self._writing = asyncio.Lock()
        self.dropped = 0
        self._dropped_logged = 0
        self._next_drop_log = 0.0
        self.written = 0
        self.failures = 0
        self.journaled = 0

    @property
    def pending(self) -> int:
        return len(self._pending)

    def record(self, row: UsageRow) -> None:
        if self._stopped:
            # A request that finished after the final flush: nothing serves any more, so
            # the disk write cannot slow a request.
            self._to_journal([row], "it arrived after the final flush")
            return
        if len(self._pending) >= self._limit:
            self.dropped += 1
            if time.monotonic() >= self._next_drop_log:
                self._log_queue_drops()
            return
        self._pending.append(row)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="usage writer")

    async def replay_journal(self) -> int:
        """Write the rows an earlier run left in the journal to the store, then remove it;
        rows the store already holds (a replay cut short by a crash) are skipped. Returns
        how many rows the journal held. Raises JournalError, keeping the journal, when it
        cannot be read or the store does not take its rows."""
        j = self._journal
        if j is None or not j.exists():
            return 0
        try:
            rows, torn = j.read()
        except OSError as exc:
            raise JournalError(
                f"the usage journal {j.path} cannot be read: {exc.strerror or exc}; "
                "make it readable by the server's user and start again"
            ) from None
        for t in torn[:TORN_LINES_SHOWN]:
            log.error("usage journal %s, line %d: skipped, %s: %r", j.path, t.number, t.reason, t.start)
        if len(torn) > TORN_LINES_SHOWN:
            log.error("usage journal %s: %d more damaged lines skipped", j.path, len(torn) - TORN_LINES_SHOWN)
        if torn:
            self._count_lost(len(torn))
        if rows:
            log.info("writing %d usage rows from the journal %s to the store", len(rows), j.path)
        for i in range(0, len(rows), self._batch):
            try:
                await self._sink.insert_usage(rows[i : i + self._batch])
            except Exception as exc:
                raise JournalError(
                    f"the usage journal {j.path} holds {len(rows)} rows of an earlier run that the store "
                    f"did not take: {_brief(exc)}. They stay in the journal. The server does not start without "
                    "them, because budgets are restored from usage; start it again once the store takes "
                    "writes"
                ) from exc
        try:
            j.remove()
        except OSError as exc:
            # Its rows are in the store; writing them again later stores nothing twice.
            log.error(
                "the usage journal %s was written to the store but cannot be removed (%s); "
                "the next start writes it again, skipping what is stored",
                j.path,
                exc.strerror or exc,
            )
        if rows:
            log.info("usage journal: %d rows written to the store (those already there skipped)", len(rows))
        return len(rows)

    async def stop(self) -> None:
        """Write what is still queued within final_flush seconds; what the store has not
        taken by then goes to the journal."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._final_flush
        problem = f"the store did not take them within usage.final_flush ({self._final_flush:g}s)"
        # Waited on with asyncio.wait, which leaves what is still running at its timeout
        # alone, so the limit holds whatever the store does. A write cut short may still
        # commit; replaying it later skips the rows stored.
        writer_done = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=self._final_flush)
            writer_done = self._task.done()
        if writer_done:
            final = asyncio.create_task(self._write(), name="usage final flush")
            await asyncio.wait({final}, timeout=max(0.0, deadline - loop.time()))
            if not final.done():
                final.cancel()
            elif (error := final.result()) is not None:
                problem = f"writing failed: {_brief(error)}"
        self._stopped = True
        rows = self._inflight + list(self._pending)
        self._inflight = []
        self._pending.clear()
        if rows:
            self._to_journal(rows, problem)
        self._log_queue_drops()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            await self.flush()
            if self.dropped > self._dropped_logged and time.monotonic() >= self._next_drop_log:
                self._log_queue_drops()

    async def flush(self) -> None:
        """Write what is queued; on failure the rows stay queued for the next round."""
        error = await self._write()
        if error is not None:
            log.warning(
                "writing %d usage rows failed (will retry in %gs): %s",
                len(self._pending),
                self._interval,
                _brief(error),
            )

    async def _write(self) -> Exception | None:
        async with self._writing:
            return await self._write_queued()

    async def _write_queued(self) -> Exception | None:
        while self._pending:
            batch = [self._pending.popleft() for _ in range(min(self._batch, len(self._pending)))]
            # Held here while the store has it, so stop() finds it if the write never ends.
            self._inflight = batch
            # Shielded: a cancellation is never pushed into the driver. aiosqlite, cancelled a
            # second time while it unwinds a write stuck on a lock (stop, then the loop's own
            # shutdown), waits forever and the process never exits. Left alone, the write
            # ends by itself (SQLite's busy timeout) or with the loop's one cancellation.
            write = asyncio.ensure_future(self._sink.insert_usage(batch))
            write.add_done_callback(_consume)
            try:
                await asyncio.shield(write)
            except asyncio.CancelledError:
                # The batch may have reached the store; its request ids make writing it again safe.
                self._requeue(batch)
                raise
            except Exception as exc:
                # Keep the rows for the next round; the queue limit bounds how many.
                self._requeue(batch)
                self.failures += 1
                return exc
            self._inflight = []
            self.written += len(batch)
        return None

    def _requeue(self, batch: list[UsageRow]) -> None:
        if self._inflight is batch:  # not when stop() has already taken it for the journal
            self._inflight = []
            self._pending.extendleft(reversed(batch))

    def _to_journal(self, rows: list[UsageRow], why: str) -> None:
        if self._journal is None:
            self._count_lost(len(rows))
            log.error("%d usage rows dropped: %s and there is no usage journal", len(rows), why)
            return
        try:
            self._journal.append(rows)
        except OSError as exc:
            self._count_lost(len(rows))
            log.error(
                "%d usage rows dropped: %s and the usage journal %s cannot be written: %s",
                len(rows),
                why,
                self._journal.path,
                exc.strerror or exc,
            )
            return
        self.journaled += len(rows)
        log.warning(
            "%d usage rows kept in the usage journal %s (%s); the next start writes them to the store",
            len(rows),
            self._journal.path,
            why,
        )

    def _count_lost(self, n: int) -> None:
        # Logged where they are lost, so the queue-full report does not count them again.
        self.dropped += n
        self._dropped_logged += n

    def _log_queue_drops(self) -> None:
        n = self.dropped - self._dropped_logged
        if n:
            log.error(
                "%d usage rows dropped: the queue holds %d rows at most and the store is not taking "
                "them (%d dropped since start)",
                n,
                self._limit,
                self.dropped,
            )
            self._dropped_logged = self.dropped
        self._next_drop_log = time.monotonic() + DROP_LOG_EVERY_S


def _consume(task: asyncio.Future) -> None:
    # A shielded write left running after stop() may fail later; nobody awaits it then.
    if not task.cancelled():
        task.exception()


def _brief(exc: BaseException) -> str:
    # A driver's error can carry the statement and a batch's parameters: its first line says enough.
    text = str(exc).strip().split("\n", 1)[0] or type(exc).__name__
    return text if len(text) <= 300 else text[:300] + "…"
