"""Limits hold across workers exactly as in one process: bursts of 500 on new connections (the
kernel spreads connections across the workers) against a key's budget, an organization's budget
shared by two projects, requests and tokens per minute, with workers 1, 2 and 4; and the same
budgets with the store locked (SQLite held by BEGIN EXCLUSIVE) or cut (PostgreSQL behind a relay
that drops every connection). Budgets are checked against the usage rows in the store: what
was really spent, priced by the gateway."""

from __future__ import annotations

import asyncio
import signal
import sqlite3
import subprocess
from collections.abc import Callable

import aiohttp
import httpx
import orjson
import pytest
from harness import Gateway, llmgw_cmd

from llmgw.testing.tcp_relay import CuttableProxy
from llmgw.testing.waiting import until

pytestmark = pytest.mark.e2e

BURST = 500
MAX_TOKENS = 8
PRICE = {"fake": {"prompt_per_1k": 1.0, "completion_per_1k": 1.0}}  # 1,000 micro-units a token
KEY_BUDGET, ORG_BUDGET = 1.0, 0.5
RPM, TPM = 100, 2000


def _body(i: int) -> bytes:
    return orjson.dumps(
        {"model": "fake", "messages": [{"role": "user", "content": f"request {i:04d}"}], "max_tokens": MAX_TOKENS}
    )


# The gateway's estimate of one request (proxy._estimate): a token per four bytes of body, and the
# output limit; at 1.00 per 1,000 tokens, 1,000 micro-units a token.
EST_TOKENS = len(_body(0)) // 4 + MAX_TOKENS
EST_MICROS = EST_TOKENS * 1000


def _cli(store: str, *args: str) -> str:
    """A CLI command on the store itself (no server needed); its standard output and error."""
    r = subprocess.run(llmgw_cmd(*args, "--store", store), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout + r.stderr


def _secret_and_id(store: str, name: str, *extra: str) -> tuple[str, str]:
    r = subprocess.run(
        llmgw_cmd("keys", "create", "--name", name, *extra, "--store", store),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    key_id = next(w for w in r.stderr.split() if w.startswith("key-"))
    return r.stdout.strip().splitlines()[-1], key_id


def _tenancy(store: str) -> dict[str, tuple[str, str]]:
    """Keys and limits, made in the store before the gateway starts, so every worker starts with them."""
    # Keys of no project first: once projects exist, a key must name one.
    keys = {name: _secret_and_id(store, name) for name in ("budget", "rpm", "tpm")}
    _cli(store, "org", "add", "org", "Acme")
    _cli(store, "org", "add", "team", "t", "--in", "Acme")
    _cli(store, "org", "add", "project", "p1", "--in", "Acme/t")
    _cli(store, "org", "add", "project", "p2", "--in", "Acme/t")
    keys["p1"] = _secret_and_id(store, "p1", "--project", "Acme/t/p1")
    keys["p2"] = _secret_and_id(store, "p2", "--project", "Acme/t/p2")
    _cli(store, "keys", "limits", "--scope", "key", "--id", keys["budget"][1], "--budget", str(KEY_BUDGET))
    _cli(store, "keys", "limits", "--scope", "org", "--id", "Acme", "--budget", str(ORG_BUDGET))
    _cli(store, "keys", "limits", "--scope", "key", "--id", keys["rpm"][1], "--rpm", str(RPM))
    _cli(store, "keys", "limits", "--scope", "key", "--id", keys["tpm"][1], "--tpm", str(TPM))
    return keys


async def _burst(url: str, secrets: list[str], n: int = BURST) -> list[tuple[int, str]]:
    """n requests at once, each on a new connection, taking the keys in turn: (status, error code)."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True)) as s:

        async def one(i: int) -> tuple[int, str]:
            async with s.post(
                url + "/v1/chat/completions",
                headers={"Authorization": f"Bearer {secrets[i % len(secrets)]}", "Content-Type": "application/json"},
                data=_body(i),
            ) as r:
                body = await r.read()
                code = orjson.loads(body).get("error", {}).get("code", "") if r.status != 200 else ""
                return r.status, code

        return list(await asyncio.gather(*(one(i) for i in range(n))))


def _serving(gw: Gateway) -> int:
    text = httpx.get(gw.admin + "/metrics", headers=gw.admin_auth).text
    return int(float(next(line.split()[1] for line in text.splitlines() if line.startswith("llmgw_workers "))))


def _start(gw: Gateway, workers: int) -> None:
    gw.wait_up()
    if workers > 1:
        until(lambda: _serving(gw) == workers, 60, f"all {workers} workers to listen", [gw])


def _stop(gw: Gateway) -> None:
    gw.proc.send_signal(signal.SIGTERM)
    assert gw.proc.wait(60) == 0, gw.text()[-3000:]


def _assert_budget(statuses: list[tuple[int, str]], spent: int, budget: float, what: str) -> None:
    codes = {c for s, c in statuses if s != 200}
    assert {s for s, _ in statuses} <= {200, 429}, statuses
    assert codes <= {"budget_spent", "budget_held"}, codes
    assert codes, f"{what}: nothing was refused; the burst did not reach the budget"
    # At most the budget and one request's estimate, whatever the number of workers.
    assert spent <= budget * 1_000_000 + EST_MICROS, (what, spent)
    # And the burst reached it: refusals come once what is spent and held (each request in progress
    # holds its estimate, more than it really costs here) fills the budget.
    assert spent >= budget * 1_000_000 / 2, (what, spent)


def _sqlite_sum(path: str, sql: str, args: tuple = ()) -> int:
    with sqlite3.connect(path) as db:
        return int(db.execute(sql, args).fetchone()[0] or 0)


def _rows_written(count: Callable[[], int], want: int, gw: Gateway | None = None) -> None:
    until(lambda: count() >= want, 60, f"{want} usage rows in the store", [gw] if gw else [])


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_budgets_rates_and_tokens_hold_exactly_across_workers(tmp_path, fake_engine, workers):
    store = str(tmp_path / "llmgw.db")
    keys = _tenancy(store)
    gw = Gateway(tmp_path, fake_engine[1], store=store, workers=workers, auth={"pricing": PRICE})
    try:
        _start(gw, workers)
        budget = asyncio.run(_burst(gw.url, [keys["budget"][0]]))
        org = asyncio.run(_burst(gw.url, [keys["p1"][0], keys["p2"][0]]))
        rpm = asyncio.run(_burst(gw.url, [keys["rpm"][0]]))
        tpm = asyncio.run(_burst(gw.url, [keys["tpm"][0]]))
        admitted = sum(s == 200 for s, _ in budget + org + rpm + tpm)
        _rows_written(lambda: _sqlite_sum(store, "select count(*) from usage where status = 200"), admitted, gw)
        _stop(gw)

        spent = _sqlite_sum(store, "select sum(cost_micros) from usage where key_id = ?", (keys["budget"][1],))
        _assert_budget(budget, spent, KEY_BUDGET, "the key's budget")
        org_spent = _sqlite_sum(
            store, "select sum(cost_micros) from usage where key_id in (?, ?)", (keys["p1"][1], keys["p2"][1])
        )
        _assert_budget(org, org_spent, ORG_BUDGET, "the organization's budget")

        assert sum(s == 200 for s, _ in rpm) == RPM, "requests per minute admitted exactly"
        assert {c for s, c in rpm if s != 200} == {"rate_limited"}
        tokens = _sqlite_sum(
            store,
            "select sum(prompt_tokens + completion_tokens) from usage where key_id = ? and status = 200",
            (keys["tpm"][1],),
        )
        assert tokens <= TPM, tokens
        assert sum(s == 200 for s, _ in tpm) >= TPM // EST_TOKENS  # at least what the estimates allow
        assert {c for s, c in tpm if s != 200} == {"tokens_limited"}
    finally:
        gw.kill()


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_budgets_hold_across_workers_while_the_sqlite_store_is_locked(tmp_path, fake_engine, workers):
    store = str(tmp_path / "llmgw.db")
    keys = _tenancy(store)
    gw = Gateway(tmp_path, fake_engine[1], store=store, workers=workers, auth={"pricing": PRICE})
    try:
        _start(gw, workers)
        lock = sqlite3.connect(store, timeout=30, isolation_level=None)
        lock.execute("BEGIN EXCLUSIVE")  # nothing can write (or, outside WAL, read) the store now
        try:
            budget = asyncio.run(_burst(gw.url, [keys["budget"][0]]))
            org = asyncio.run(_burst(gw.url, [keys["p1"][0], keys["p2"][0]]))
        finally:
            lock.execute("ROLLBACK")
            lock.close()
        admitted = sum(s == 200 for s, _ in budget + org)
        _rows_written(lambda: _sqlite_sum(store, "select count(*) from usage where status = 200"), admitted, gw)
        _stop(gw)
        spent = _sqlite_sum(store, "select sum(cost_micros) from usage where key_id = ?", (keys["budget"][1],))
        _assert_budget(budget, spent, KEY_BUDGET, "the key's budget, store locked")
        org_spent = _sqlite_sum(
            store, "select sum(cost_micros) from usage where key_id in (?, ?)", (keys["p1"][1], keys["p2"][1])
        )
        _assert_budget(org, org_spent, ORG_BUDGET, "the organization's budget, store locked")
    finally:
        gw.kill()


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_budgets_hold_across_workers_while_postgresql_is_cut_off(tmp_path, fake_engine, pg_address, workers):
    asyncpg = pytest.importorskip("asyncpg")
    keys = _tenancy(pg_address)
    relay = CuttableProxy(("127.0.0.1", 5432))
    relay.start()
    via_relay = pg_address.replace("127.0.0.1:5432", f"127.0.0.1:{relay.port}")
    gw = Gateway(tmp_path, fake_engine[1], store=via_relay, workers=workers, auth={"pricing": PRICE})
    try:
        _start(gw, workers)
        relay.cut()
        try:
            budget = asyncio.run(_burst(gw.url, [keys["budget"][0]]))
            org = asyncio.run(_burst(gw.url, [keys["p1"][0], keys["p2"][0]]))
        finally:
            relay.start()

        async def pg_sum(sql: str, *args: object) -> int:
            conn = await asyncpg.connect(pg_address.replace("postgres://", "postgresql://"), timeout=5)
            try:
                return int(await conn.fetchval(sql, *args) or 0)
            finally:
                await conn.close()

        admitted = sum(s == 200 for s, _ in budget + org)
        _rows_written(lambda: asyncio.run(pg_sum("select count(*) from usage where status = 200")), admitted, gw)
        _stop(gw)
        spent = asyncio.run(pg_sum("select sum(cost_micros) from usage where key_id = $1", keys["budget"][1]))
        _assert_budget(budget, spent, KEY_BUDGET, "the key's budget, PostgreSQL cut off")
        org_spent = asyncio.run(
            pg_sum("select sum(cost_micros) from usage where key_id in ($1, $2)", keys["p1"][1], keys["p2"][1])
        )
        _assert_budget(org, org_spent, ORG_BUDGET, "the organization's budget, PostgreSQL cut off")
    finally:
        gw.kill()
        relay.cut()
