"""Usage rows, collected off the request path and written to the store in batches."""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Protocol, Sequence

from llmgw.store import UsageRow

log = logging.getLogger("llmgw.gateway.usage")


class UsageSink(Protocol):
    async def insert_usage(self, rows: Sequence[UsageRow]) -> None: ...


class UsageRecorder:
    """A bounded in-memory queue drained by one background task.

    Recording is a deque append, so a slow or unreachable store never slows a
    request; when the store stays away long enough for the queue to fill,
    further rows are counted as dropped rather than held without bound.
    """

    def __init__(self, sink: UsageSink, flush_interval: float = 1.0, batch_size: int = 500,
                 queue_limit: int = 100_000) -> None:
        self._sink = sink
        self._pending: collections.deque[UsageRow] = collections.deque()
        self._limit = queue_limit
        self._interval = flush_interval
        self._batch = batch_size
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self.dropped = 0
        self.written = 0
        self.failures = 0

    @property
    def pending(self) -> int:
        return len(self._pending)

    def record(self, row: UsageRow) -> None:
        if len(self._pending) >= self._limit:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.error("usage queue is full (%d rows; the store is not keeping up); %d rows dropped so far",
                          self._limit, self.dropped)
            return
        self._pending.append(row)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="usage writer")

    async def stop(self) -> None:
        """Write what is still queued, then stop."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        await self.flush()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            await self.flush()

    async def flush(self) -> None:
        while self._pending:
            batch = [self._pending.popleft() for _ in range(min(self._batch, len(self._pending)))]
            try:
                await self._sink.insert_usage(batch)
            except asyncio.CancelledError:
                self._pending.extendleft(reversed(batch))
                raise
            except Exception as exc:
                # Keep the rows for the next round; the queue limit bounds how many.
                self._pending.extendleft(reversed(batch))
                self.failures += 1
                log.warning("writing %d usage rows failed (will retry): %s", len(batch), exc)
                return
            self.written += len(batch)
