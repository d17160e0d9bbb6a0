"""Usage is never lost: the journal at shutdown, its replay at start, the final flush's
time limit, and every row that is lost counted and logged."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import stat
import time
from datetime import UTC, datetime

import pytest

from llmgw.server.gateway.endpoints import EndpointSet
from llmgw.server.gateway.usage import JournalError, UsageRecorder
from llmgw.server.gateway.usage_journal import JOURNAL_NAME, UsageJournal
from llmgw.server.metrics import GatewayMetrics
from llmgw.store import Store, UsageRow
from llmgw.testing.waiting import async_until

UTC = UTC


def _row(i: int = 0, **kw) -> UsageRow:
    return UsageRow(model="m", endpoint="http://e", status=200, latency_ms=1.5, key_id=f"k{i}", **kw)


class Sink:
    """A store that takes rows, or fails (`fail`), or never answers (`hang`)."""

    def __init__(self) -> None:
        self.rows: list[UsageRow] = []
        self.fail = False
        self.hang = False
        self.calls = 0
        self.started = asyncio.Event()

    async def insert_usage(self, rows):
        self.calls += 1
        self.started.set()
        if self.hang:
            await asyncio.Event().wait()
        if self.fail:
            raise ConnectionError("connection refused")
        self.rows.extend(rows)


class StubbornSink(Sink):
    """A driver whose write never ends and that, cancelled, takes its time to unwind."""

    async def insert_usage(self, rows):
        self.started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await asyncio.sleep(1.0)  # the slow unwind is what this fake is for
            raise


@pytest.fixture
async def store(address):
    s = await Store.open(address)
    yield s
    await s.close()


def _journal(tmp_path) -> UsageJournal:
    return UsageJournal(tmp_path / "data" / JOURNAL_NAME)


def _dropped_metric(rec: UsageRecorder) -> float:
    m = GatewayMetrics()
    m.watch(EndpointSet([], 1.0, 5.0, 1.0), rec)
    return m.registry.get_sample_value("llmgw_usage_dropped_total")


# -- the journal file ---------------------------------------------------------------


def test_rows_appended_to_the_journal_read_back_as_they_were_written(tmp_path):
    j = _journal(tmp_path)
    at = datetime(2025, 3, 1, 12, 0, 0, 123456, tzinfo=UTC)
    full = UsageRow(
        model="llama",
        endpoint="http://n1:8000",
        status=200,
        latency_ms=12.5,
        key_id="k1",
        project="p",
        served_model="llama-3b",
        prompt_tokens=10,
        completion_tokens=5,
        ttft_ms=3.25,
        stream=True,
        at=at,
        user_id="u",
        project_id="pr",
        team_id="t",
        org_id="o",
        cost_micros=42,
    )
    sparse = UsageRow(model="x", endpoint="http://e", status=401, latency_ms=1, at=at)
    j.append([full, sparse])
    j.append([_row(3)])
    rows, torn = j.read()
    assert rows == [full, sparse, _row(3, at=rows[2].at, request_id=rows[2].request_id)]
    assert torn == []
    assert stat.S_IMODE(j.path.stat().st_mode) == 0o600  # rows name keys and people


def test_every_row_gets_its_own_request_id():
    ids = {_row().request_id for _ in range(1000)}
    assert len(ids) == 1000 and all(len(i) == 32 for i in ids)


def test_a_line_cut_short_by_a_crash_is_skipped_and_the_next_append_starts_a_line_of_its_own(tmp_path):
    j = _journal(tmp_path)
    first, cut, after = _row(1), _row(2), _row(3)
    j.append([first, cut])
    data = j.path.read_bytes()
    j.path.write_bytes(data[:-20])  # the crash came in the middle of the second line
    j.append([after])
    rows, torn = j.read()
    assert [r.request_id for r in rows] == [first.request_id, after.request_id]
    assert [(t.number, t.reason) for t in torn] == [(2, torn[0].reason)]
    assert "not JSON" in torn[0].reason


def test_damaged_lines_are_skipped_with_the_reason_and_the_rest_is_read(tmp_path):
    j = _journal(tmp_path)
    good = _row(1)
    j.append([good])
    with open(j.path, "ab") as f:
        f.write(b"[1, 2]\n")
        f.write(
            b'{"model": "m", "endpoint": "e", "status": 200, "latency_ms": 1.0, "at": "2025-03-01T00:00:00+00:00"}\n'
        )
        f.write(
            b'{"model": "m", "endpoint": "e", "status": "200", "latency_ms": 1.0, '
            b'"at": "2025-03-01T00:00:00+00:00", "request_id": "a"}\n'
        )
        f.write(
            b'{"model": "m", "endpoint": "e", "status": 200, "latency_ms": 1.0, '
            b'"at": "2025-03-01T00:00:00", "request_id": "b"}\n'
        )
        f.write(b"\x00" * 4096)  # zeroed blocks a crash can leave at the end: not a row at all
        f.write(b'{"model": "m", "endpoint": "e", "status": 200')  # no end
    rows, torn = j.read()
    assert rows == [good]
    reasons = [t.reason for t in torn]
    assert reasons[0] == "not a JSON object"
    assert reasons[1] == "missing request_id"  # without it a second replay could store the row twice
    assert reasons[2] == "wrong type of status"
    assert reasons[3] == "a time without its zone"
    assert reasons[4].startswith("the line has no end")


def test_a_missing_journal_reads_as_empty_and_removing_it_is_harmless(tmp_path):
    j = _journal(tmp_path)
    assert j.read() == ([], []) and not j.exists()
    j.remove()


# -- the store skips request ids it holds ----------------------------------------------


async def test_rows_whose_request_id_is_stored_are_skipped_on_both_backends(store):
    a, b, c = _row(1), _row(2), _row(3)
    await store.insert_usage([a, b])
    await store.insert_usage([b, c, c])
    assert await store.count_usage() == 3
    got = await store.list_usage()
    assert sorted(r.request_id for r in got) == sorted([a.request_id, b.request_id, c.request_id])
    # Rows of before 0005 have no id: never a conflict.
    await store.insert_usage([_row(4, request_id=None), _row(4, request_id=None)])
    assert await store.count_usage() == 5


# -- replay at start ------------------------------------------------------------------


async def test_replay_writes_the_journal_to_the_store_once_and_removes_it(tmp_path, store):
    j = _journal(tmp_path)
    rows = [_row(i) for i in range(7)]
    j.append(rows)
    assert await UsageRecorder(store, batch_size=3, journal=j).replay_journal() == 7
    assert not j.exists()
    assert sorted(r.request_id for r in await store.list_usage()) == sorted(r.request_id for r in rows)
    assert await UsageRecorder(store, journal=j).replay_journal() == 0
    assert await store.count_usage() == 7


async def test_a_replay_cut_short_before_the_journal_was_removed_stores_nothing_twice(tmp_path, store):
    j = _journal(tmp_path)
    rows = [_row(i) for i in range(5)]
    j.append(rows)
    # The crash came after the first rows reached the store, before the journal went.
    await store.insert_usage(rows[:3])
    assert await UsageRecorder(store, journal=j).replay_journal() == 5
    assert await store.count_usage() == 5
    assert sorted(r.request_id for r in await store.list_usage()) == sorted(r.request_id for r in rows)


async def test_a_replay_the_store_refuses_keeps_the_journal_and_says_why(tmp_path):
    j = _journal(tmp_path)
    j.append([_row(i) for i in range(4)])
    sink = Sink()
    sink.fail = True
    with pytest.raises(JournalError) as e:
        await UsageRecorder(sink, batch_size=3, journal=j).replay_journal()
    assert str(j.path) in str(e.value) and "4 rows" in str(e.value) and "connection refused" in str(e.value)
    assert "budgets are restored from usage" in str(e.value)
    assert len(j.read()[0]) == 4
    sink.fail = False
    assert await UsageRecorder(sink, journal=j).replay_journal() == 4
    assert len(sink.rows) == 4 and not j.exists()


async def test_a_journal_that_cannot_be_read_stops_the_start_and_is_kept(tmp_path):
    j = UsageJournal(tmp_path)  # a directory: reading it fails as an unreadable file would
    with pytest.raises(JournalError, match="cannot be read"):
        await UsageRecorder(Sink(), journal=j).replay_journal()
    assert tmp_path.exists()


async def test_torn_lines_at_replay_are_logged_and_counted_as_dropped(tmp_path, caplog):
    j = _journal(tmp_path)
    j.append([_row(1), _row(2)])
    j.path.write_bytes(j.path.read_bytes()[:-5])
    sink = Sink()
    rec = UsageRecorder(sink, journal=j)
    with caplog.at_level(logging.ERROR, "llmgw.gateway.usage"):
        assert await rec.replay_journal() == 1
    assert len(sink.rows) == 1 and not j.exists()
    assert rec.dropped == 1 and _dropped_metric(rec) == 1
    assert any("line 2: skipped" in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)


# -- stop: the final flush and its limit ---------------------------------------------------


async def test_stop_writes_what_is_queued_when_the_store_takes_it(tmp_path):
    sink = Sink()
    j = _journal(tmp_path)
    rec = UsageRecorder(sink, flush_interval=3600, journal=j)
    rec.start()
    for i in range(3):
        rec.record(_row(i))
    await rec.stop()
    assert len(sink.rows) == 3 and not j.exists() and rec.dropped == 0


async def test_rows_the_store_refuses_at_stop_go_to_the_journal(tmp_path, caplog):
    sink = Sink()
    sink.fail = True
    j = _journal(tmp_path)
    rec = UsageRecorder(sink, flush_interval=3600, batch_size=2, journal=j)
    rows = [_row(i) for i in range(5)]
    for r in rows:
        rec.record(r)
    with caplog.at_level(logging.WARNING, "llmgw.gateway.usage"):
        await rec.stop()
    assert j.read()[0] == rows
    assert rec.journaled == 5 and rec.dropped == 0 and rec.pending == 0
    assert any(
        "5 usage rows kept in the usage journal" in r.getMessage() and "connection refused" in r.getMessage()
        for r in caplog.records
    )


async def test_the_final_flush_gives_up_on_a_store_that_hangs_within_its_limit(tmp_path, caplog):
    sink = Sink()
    sink.hang = True
    j = _journal(tmp_path)
    rec = UsageRecorder(sink, flush_interval=3600, batch_size=2, journal=j, final_flush=0.3)
    rows = [_row(i) for i in range(5)]
    for r in rows:
        rec.record(r)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, "llmgw.gateway.usage"):
        await rec.stop()
    assert 0.3 <= time.monotonic() - t0 < 2.0
    # The batch the store held when time ran out is journaled too, and order is kept.
    assert j.read()[0] == rows
    assert any("within usage.final_flush (0.3s)" in r.getMessage() for r in caplog.records)


async def test_the_final_flush_keeps_its_limit_on_a_locked_sqlite_store_and_the_rows_land_once(tmp_path):
    path = tmp_path / "store.db"
    store = await Store.open(str(path))
    locker = sqlite3.connect(path, isolation_level=None)
    try:
        # Another writer holds the database: each write waits out SQLite's 15 s busy timeout.
        locker.execute("BEGIN IMMEDIATE")
        j = _journal(tmp_path)
        rec = UsageRecorder(store, flush_interval=3600, journal=j, final_flush=0.5)
        rows = [_row(i) for i in range(10)]
        for r in rows:
            rec.record(r)
        t0 = time.monotonic()
        await rec.stop()
        assert time.monotonic() - t0 < 3.0
        assert j.read()[0] == rows
        locker.execute("ROLLBACK")
        assert await UsageRecorder(store, journal=j).replay_journal() == 10
        assert sorted(r.request_id for r in await store.list_usage()) == sorted(r.request_id for r in rows)
    finally:
        locker.close()
        await store.close()


async def test_a_writer_stuck_unwinding_a_cancelled_write_does_not_hold_the_stop(tmp_path):
    sink = StubbornSink()
    j = _journal(tmp_path)
    rec = UsageRecorder(sink, flush_interval=0.01, journal=j, final_flush=0.3)
    rec.start()
    rows = [_row(i) for i in range(4)]
    for r in rows:
        rec.record(r)
    await asyncio.wait_for(sink.started.wait(), 5)  # the writer has the rows in hand
    t0 = time.monotonic()
    await rec.stop()
    assert time.monotonic() - t0 < 2.0
    assert j.read()[0] == rows


async def test_rows_recorded_after_stop_go_to_the_journal(tmp_path):
    j = _journal(tmp_path)
    rec = UsageRecorder(Sink(), journal=j)
    await rec.stop()
    late = _row(9)
    rec.record(late)
    assert j.read()[0] == [late] and rec.dropped == 0


# -- dropped means dropped ---------------------------------------------------------------


async def test_rows_lost_because_the_journal_cannot_be_written_are_counted_and_logged(tmp_path, caplog):
    (tmp_path / "data").write_text("a file where the data directory should be")
    sink = Sink()
    sink.fail = True
    rec = UsageRecorder(sink, journal=_journal(tmp_path))
    for i in range(6):
        rec.record(_row(i))
    with caplog.at_level(logging.ERROR, "llmgw.gateway.usage"):
        await rec.stop()
    assert rec.dropped == 6 and rec.journaled == 0 and _dropped_metric(rec) == 6
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and errors[0].startswith("6 usage rows dropped") and "cannot be written" in errors[0]


async def test_rows_beyond_the_queue_limit_are_counted_and_each_logged_as_an_error(tmp_path, caplog):
    sink = Sink()
    sink.fail = True
    rec = UsageRecorder(sink, flush_interval=3600, queue_limit=100, journal=_journal(tmp_path))
    with caplog.at_level(logging.ERROR, "llmgw.gateway.usage"):
        for i in range(150):
            rec.record(_row(i))
        assert rec.pending == 100 and rec.dropped == 50 and _dropped_metric(rec) == 50
        await rec.stop()
    # One line at once, the rest summed up (here at stop): every dropped row is in a line.
    counts = [
        int(r.getMessage().split()[0])
        for r in caplog.records
        if r.levelno == logging.ERROR and "queue holds 100 rows" in r.getMessage()
    ]
    assert counts == [1, 49]
    assert rec.journaled == 100  # the queued ones were kept


async def test_a_failed_periodic_write_keeps_the_rows_and_is_written_later(caplog):
    sink = Sink()
    sink.fail = True
    rec = UsageRecorder(sink, flush_interval=0.01)
    rec.start()
    try:
        with caplog.at_level(logging.WARNING, "llmgw.gateway.usage"):
            rec.record(_row(1))
            await asyncio.wait_for(sink.started.wait(), 5)
            sink.fail = False
            await async_until(lambda: sink.rows, 5, "the row written after the store came back")
        assert rec.dropped == 0 and rec.pending == 0
        assert any("will retry" in r.getMessage() for r in caplog.records)
    finally:
        await rec.stop()


class GatedSink(Sink):
    """A store whose first write waits until the test lets it finish; later ones land at once."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()

    async def insert_usage(self, rows):
        self.calls += 1
        self.started.set()
        if self.calls == 1:
            await self.gate.wait()
        self.rows.extend(rows)


async def test_flush_returns_only_once_a_batch_the_periodic_writer_had_in_flight_is_stored():
    # A reader that flushes and then reads the store (the tests, a report) must see every
    # row recorded before it asked, not miss the batch the writer was still sending.
    sink = GatedSink()
    rec = UsageRecorder(sink, flush_interval=0.01)
    rec.start()
    try:
        rec.record(_row(1))
        await asyncio.wait_for(sink.started.wait(), 5)  # the periodic writer holds row 1
        rec.record(_row(2))
        flushing = asyncio.ensure_future(rec.flush())
        # The flush queues behind the write in flight (the recorder's one write lock), rather
        # than writing row 2 beside it and returning before row 1 is stored.
        await async_until(lambda: bool(getattr(rec._writing, "_waiters", None)), 5, "the flush waiting its turn")
        assert not flushing.done() and sink.calls == 1 and sink.rows == []
        sink.gate.set()
        await asyncio.wait_for(flushing, 5)
        assert [r.key_id for r in sink.rows] == ["k1", "k2"]
    finally:
        await rec.stop()
