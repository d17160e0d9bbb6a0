"""Usage is never lost: the real `llmgw server` with its PostgreSQL store cut off, requests
served, SIGTERM, the store back, a restart, and every row in the store exactly once."""

from __future__ import annotations

import asyncio
import signal
import sqlite3
import subprocess
import time

import httpx
import orjson
import pytest
from harness import Gateway, Proc, llmgw_cmd, wait_until

from llmgw.testing.tcp_relay import CuttableProxy

pytestmark = pytest.mark.e2e

BEFORE, DURING = 20, 500


def _in_store(address: str, read):
    """What ``read(store)`` returns, read straight from the database (not through the proxy)."""
    from llmgw.store import Store

    async def run():
        s = await Store.open(address)
        try:
            return await read(s)
        finally:
            await s.close()

    return asyncio.run(run())


def _stored(address: str) -> list:
    return _in_store(address, lambda s: s.list_usage(limit=10_000))


def _key_id(address: str) -> str:
    async def only_key(s):
        (key,) = await s.list_keys()
        return key.id

    return _in_store(address, only_key)


def _cli(*args: str) -> str:
    r = subprocess.run(llmgw_cmd(*args), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def _chat(client: httpx.Client, n: int) -> None:
    for i in range(n):
        r = client.post(
            "/v1/chat/completions",
            json={"model": "fake", "messages": [{"role": "user", "content": f"request {i}"}], "max_tokens": 8},
        )
        assert r.status_code == 200, r.text


def test_rows_queued_while_the_store_is_unreachable_are_stored_exactly_once_after_a_restart(
    tmp_path, pg_address, fake_engine
):
    engine_proc, models = fake_engine
    proxy = CuttableProxy(("127.0.0.1", 5432))
    proxy.start()
    through_proxy = pg_address.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
    # Priced, so the journal's rows carry spend that the next start must count against budgets.
    auth = {"pricing": {"fake": {"prompt_per_1k": 0.0, "completion_per_1k": 1.0}}}
    procs: list[Proc] = [engine_proc]
    try:
        # A key with a budget (spend is recorded where a budget binds), ample for now.
        key = _cli("keys", "create", "--name", "journal", "--store", pg_address).strip().splitlines()[-1]
        _cli("keys", "limits", "--scope", "key", "--id", _key_id(pg_address), "--budget", "1000", "--store", pg_address)
        gw = Gateway(tmp_path, models, store=through_proxy, auth=auth)
        procs.append(gw)
        gw.wait_up()
        client = httpx.Client(base_url=gw.url, headers={"Authorization": f"Bearer {key}"}, timeout=30)

        _chat(client, BEFORE)
        wait_until(lambda: len(_stored(pg_address)) == BEFORE, 15, "the first rows to be stored", procs)

        proxy.cut()
        _chat(client, DURING)  # served from memory: nothing on the request path needs the store
        wait_until(lambda: "will retry" in gw.text(), 15, "a usage write to fail", procs)
        client.close()
        assert gw.stop() == 0, gw.text()[-3000:]
        assert f"{DURING} usage rows kept in the usage journal" in gw.text()
        assert "usage rows dropped" not in gw.text()

        journal = tmp_path / "usage-journal"
        journaled = [orjson.loads(line)["request_id"] for line in journal.read_bytes().splitlines()]
        assert len(journaled) == DURING == len(set(journaled))
        before = {r.request_id for r in _stored(pg_address)}
        assert before.isdisjoint(journaled)

        # A budget below what the key spent in all, above what it spent before the cut.
        proxy.start()
        spent = sum(r.cost_micros for r in _stored(pg_address))
        per_request = spent // BEFORE
        assert per_request > 0
        budget = per_request * (BEFORE + DURING // 2) / 1_000_000
        _cli(
            "keys",
            "limits",
            "--scope",
            "key",
            "--id",
            _key_id(pg_address),
            "--budget",
            f"{budget:.6f}",
            "--store",
            pg_address,
        )
        kept = journal.read_bytes()

        again = Gateway(tmp_path, models, store=through_proxy, auth=auth)
        procs.append(again)
        again.wait_up()
        assert not journal.exists()
        assert f"usage journal: {DURING} rows written to the store" in again.text()
        rows = _stored(pg_address)
        ids = [r.request_id for r in rows]
        assert len(rows) == BEFORE + DURING and len(set(ids)) == len(ids)
        assert set(ids) == before | set(journaled)
        # Budgets restored at start counted the replayed spend: the key is over its budget.
        r = httpx.post(
            again.url + "/v1/chat/completions",
            headers={"Authorization": f"Bearer {key}"},
            timeout=30,
            json={"model": "fake", "messages": [{"role": "user", "content": "one more"}], "max_tokens": 8},
        )
        assert r.status_code == 429, r.text
        assert again.stop() == 0, again.text()[-3000:]
        stored = sorted(r.request_id for r in _stored(pg_address))

        # A start that died after writing the rows but before removing the journal: the
        # next start writes it again and the store keeps one of each.
        journal.write_bytes(kept)
        third = Gateway(tmp_path, models, store=through_proxy, auth=auth)
        procs.append(third)
        third.wait_up()
        assert not journal.exists()
        assert sorted(r.request_id for r in _stored(pg_address)) == stored
        assert third.stop() == 0, third.text()[-3000:]
    finally:
        for p in procs[1:]:
            p.kill()
        proxy.cut()


def test_a_locked_sqlite_store_holds_the_final_flush_no_longer_than_its_limit(tmp_path, fake_engine):
    engine_proc, models = fake_engine
    store = str(tmp_path / "llmgw.db")
    gw = Gateway(tmp_path, models, store=store, timeouts={"drain": "2s"}, usage={"final_flush": "1s"})
    procs = [engine_proc, gw]
    locker = None
    try:
        gw.wait_up()
        key = gw.create_key("locked")
        # Another writer holds the database: every write waits out SQLite's 15 s busy timeout.
        locker = sqlite3.connect(store, isolation_level=None)
        locker.execute("BEGIN IMMEDIATE")
        with httpx.Client(base_url=gw.url, headers={"Authorization": f"Bearer {key}"}, timeout=30) as client:
            _chat(client, 50)
        gw.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        wait_until(lambda: "usage rows kept in the usage journal" in gw.text(), 15, "the rows to be journaled", procs)
        # Nothing was in flight, so no drain; then final_flush, and not the 15 s lock wait.
        assert time.monotonic() - signalled < 6.0, gw.text()[-3000:]
        assert "50 usage rows kept in the usage journal" in gw.text()
        assert "within usage.final_flush (1s)" in gw.text()
        locker.execute("ROLLBACK")
        assert gw.proc.wait(30) == 0, gw.text()[-3000:]
        gw.stop()

        again = Gateway(tmp_path, models, store=store)
        procs.append(again)
        again.wait_up()
        rows = _stored(store)
        assert len(rows) == 50 and len({r.request_id for r in rows}) == 50
        assert not (tmp_path / "usage-journal").exists()
        assert again.stop() == 0, again.text()[-3000:]
    finally:
        if locker is not None:
            locker.close()
        for p in procs[1:]:
            p.kill()
