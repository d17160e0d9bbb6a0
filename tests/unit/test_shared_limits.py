"""Limits that hold across gateways on one store (shared_limits.py, store/allowance.py).

The arithmetic of shares and credits on its own; the store's claim statement on SQLite and
PostgreSQL, raced; then two real gateways in this process on one PostgreSQL store, where
500 concurrent requests at a key limited to 100 a minute admit at most 100 plus one chunk
per gateway, tokens likewise, and a budget spent through one gateway is seen by the other.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from itertools import cycle

import httpx
import pytest
from conftest import pg_exec

from llmgw.config import parse_server_config
from llmgw.server.app import Server
from llmgw.server.gateway.limits import (
    REFILL_WAIT_S,
    Accountant,
    AllowancePending,
    LimitError,
    _Leased,
    chunk_of,
    period_keys,
    to_micros,
)
from llmgw.server.gateway.principal import Pool, Principal
from llmgw.server.gateway.shared_limits import IDLE_RETURN_S, SharedLimits, SpendTally, plan_window
from llmgw.store import Store, UsageRow
from llmgw.store.allowance import TAIL_S, ShareAsk, SpendRow, share_after
from llmgw.testing.fake_engine import FakeEngine
from llmgw.testing.waiting import async_until

# -- the arithmetic ------------------------------------------------------------------


class _Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class _Refills:
    """Stands in for the refill task: counts wakes, hands out the round future."""

    def __init__(self) -> None:
        self.reachable = True
        self.wakes = 0
        self.fut: asyncio.Future[None] | None = None

    def wake(self) -> None:
        self.wakes += 1

    def next_round(self) -> asyncio.Future[None]:
        if self.fut is None:
            self.fut = asyncio.get_running_loop().create_future()
        return self.fut


def _principal(*pools: Pool) -> Principal:
    return Principal(key_id="k1", key_prefix="llmgw-k1", project=None, pools=pools)


def test_a_claim_gets_what_the_pool_has_free_but_never_less_than_it_holds():
    assert share_after(ShareAsk("key:k", "rpm", 100, 30, 10), others=50) == 30
    assert share_after(ShareAsk("key:k", "rpm", 100, 30, 10), others=80) == 20
    assert share_after(ShareAsk("key:k", "rpm", 100, 30, 10), others=95) == 10  # keeps its own
    assert share_after(ShareAsk("key:k", "rpm", 100, 30, 0), others=120) == 0  # never negative


def test_a_chunk_is_a_tenth_of_the_limit_and_at_least_one():
    assert chunk_of(100) == 10 and chunk_of(5) == 1 and chunk_of(1) == 1 and chunk_of(20_000) == 2000


async def test_a_fresh_shared_pool_admits_one_chunk_at_once_then_asks_for_a_refill_instead_of_its_limit():
    clock = _Clock()
    acc = Accountant(clock=clock)
    refills = _Refills()
    acc.share(refills)
    p = _principal(Pool("key:k1", rpm=100))
    for _ in range(10):  # the credit: one chunk, without the store
        acc.check(p, "m", 1)
    assert refills.wakes >= 1  # below a chunk to go: a refill was asked for before the credit ran out
    with pytest.raises(AllowancePending) as got:
        acc.check(p, "m", 1)
    assert got.value.status == 429 and got.value.ready is refills.fut
    w = acc._rpm["key:k1"]
    assert isinstance(w, _Leased) and w.short == 1.0
    # The store granted 30 in all: the credit is gone, the share is what counts.
    w.end_credit()
    w.set_share(30)
    for _ in range(20):
        acc.check(p, "m", 1)
    with pytest.raises(AllowancePending):
        acc.check(p, "m", 1)


async def test_a_shared_pool_the_store_had_no_more_for_or_cannot_reach_is_refused_without_a_wait():
    clock = _Clock()
    acc = Accountant(clock=clock)
    refills = _Refills()
    acc.share(refills)
    p = _principal(Pool("key:k1", rpm=100))
    for _ in range(10):
        acc.check(p, "m", 1)
    w = acc._rpm["key:k1"]
    w.end_credit()
    w.set_share(10)
    w.exhausted_until = clock.t + 1
    with pytest.raises(LimitError) as got:
        acc.check(p, "m", 1)
    assert not isinstance(got.value, AllowancePending)
    assert "the request rate of key k1 is at its limit of 100 a minute" in got.value.message
    clock.t += 1
    refills.reachable = False
    with pytest.raises(LimitError) as got:
        acc.check(p, "m", 1)
    assert not isinstance(got.value, AllowancePending)


async def test_a_request_waiting_for_a_refill_is_admitted_when_it_lands_and_refused_when_the_wait_ends():
    acc = Accountant()
    refills = _Refills()
    acc.share(refills)
    p = _principal(Pool("key:k1", rpm=10))
    acc.check(p, "m", 1)  # chunk 1: the credit is one request
    with pytest.raises(AllowancePending) as got:
        acc.check(p, "m", 1)
    w = acc._rpm["key:k1"]

    async def refill() -> None:
        w.end_credit()
        w.set_share(3)
        assert refills.fut is not None
        refills.fut.set_result(None)
        refills.fut = None

    asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(refill()))
    res = await acc.refilled(got.value, p, "m", 1)
    assert not res.done and acc._rpm["key:k1"].used == 2
    acc.check(p, "m", 1)
    with pytest.raises(AllowancePending) as got:
        acc.check(p, "m", 1)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(LimitError):
        await acc.refilled(got.value, p, "m", 1)  # nobody refills
    assert REFILL_WAIT_S - 0.05 <= loop.time() - t0 < REFILL_WAIT_S + 1


def test_a_window_running_low_claims_what_it_counts_plus_two_chunks():
    w = _Leased(100, now=0.0)
    for _ in range(9):
        w.take(0.0, 1.0)
    ask = plan_window(w, "rpm", "key:k", 0.5)
    assert ask is not None and ask.claim and ask.floor == 0 and ask.want == 9 + 20 and ask.limit == 100
    # A burst claims what the last two seconds used, when that is more.
    w.end_credit()
    w.set_share(10)
    for _ in range(40):
        w.take(1.0, 1.0)
    ask = plan_window(w, "rpm", "key:k", 1.5)
    assert ask is not None and ask.want == 49 + 49 and ask.floor == 10
    # Never more than the limit.
    w.set_share(60)
    for _ in range(45):
        w.take(1.5, 1.0)
    ask = plan_window(w, "rpm", "key:k", 1.6)
    assert ask is not None and ask.want == 100


def test_a_window_the_store_had_no_more_for_does_not_claim_again_until_its_retry():
    w = _Leased(100, now=0.0)
    w.end_credit()
    w.set_share(10)
    for _ in range(10):
        w.take(0.0, 1.0)
    w.exhausted_until = 1.0
    assert plan_window(w, "rpm", "key:k", 0.5) is None
    ask = plan_window(w, "rpm", "key:k", 1.0)
    assert ask is not None and ask.claim


def test_a_quiet_window_returns_all_but_what_it_still_counts_and_a_busy_one_keeps_two_chunks_spare():
    w = _Leased(100, now=0.0)
    w.end_credit()
    w.set_share(80)
    for _ in range(12):
        w.take(0.0, 1.0)
    ask = plan_window(w, "rpm", "key:k", 1.0)  # 68 spare, more than four chunks: down to two spare
    assert ask is not None and not ask.claim and ask.want == 12 + 20
    w.set_share(32)
    assert plan_window(w, "rpm", "key:k", 2.0) is None  # in use, two chunks spare: kept
    ask = plan_window(w, "rpm", "key:k", IDLE_RETURN_S)  # unused for IDLE_RETURN_S: what it counts
    assert ask is not None and ask.want == 12 and ask.floor == 12
    # At stop only what the window counts stays leased; a window past its minute keeps nothing.
    ask = plan_window(w, "rpm", "key:k", 30.0, final=True)
    assert ask is not None and ask.want == 12
    w.set_share(12)
    ask = plan_window(w, "rpm", "key:k", 61.0)
    assert ask is not None and ask.want == 0


def test_a_share_above_a_lowered_limit_is_given_back_down_to_what_is_free():
    w = _Leased(100, now=0.0)
    w.end_credit()
    w.set_share(50)
    for _ in range(40):
        w.take(0.0, 1.0)
    w.others = 40
    w.relimit(60)
    ask = plan_window(w, "rpm", "key:k", 3.0)
    assert ask is not None and not ask.claim and ask.want == 40  # never below what it counts
    w.adjust(0, 3.0, -30.0)  # (refunds)
    ask = plan_window(w, "rpm", "key:k", 3.5)
    assert ask is not None and ask.want == 20


# -- the store -----------------------------------------------------------------------


async def test_claims_of_two_gateways_never_hold_more_than_the_limit_and_a_return_frees_allowance(address):
    async with await Store.open(address) as s:
        a = await s.allowance_round("gw-a", [ShareAsk("key:k1", "rpm", 100, 70, 0)], 30)
        assert [(g.share, g.others) for g in a.grants] == [(70, 0)]
        b = await s.allowance_round("gw-b", [ShareAsk("key:k1", "rpm", 100, 50, 0)], 30)
        assert [(g.share, g.others) for g in b.grants] == [(30, 70)]
        assert await s.rate_shares_held("key:k1", "rpm") == {"gw-a": 70, "gw-b": 30}
        # Another kind and another pool are counted apart.
        c = await s.allowance_round(
            "gw-b", [ShareAsk("key:k1", "tpm", 1000, 500, 0), ShareAsk("key:k2", "rpm", 5, 9, 0)], 30
        )
        assert sorted((g.pool_key, g.kind, g.share) for g in c.grants) == [
            ("key:k1", "tpm", 500),
            ("key:k2", "rpm", 5),
        ]
        await s.allowance_round("gw-a", [ShareAsk("key:k1", "rpm", 100, 20, 20)], 30)  # a return
        b = await s.allowance_round("gw-b", [ShareAsk("key:k1", "rpm", 100, 100, 30)], 30)
        assert b.grants[0].share == 80
        await s.allowance_round("gw-a", [ShareAsk("key:k1", "rpm", 100, 0, 0)], 30)  # nothing: no row
        assert await s.rate_shares_held("key:k1", "rpm") == {"gw-b": 80}


async def test_a_share_whose_lease_ended_counts_for_one_more_minute_and_then_not_at_all(address):
    async with await Store.open(address) as s:
        await s.allowance_round("gw-a", [ShareAsk("key:k1", "rpm", 100, 60, 0)], 0.0)  # ends now
        b = await s.allowance_round("gw-b", [ShareAsk("key:k1", "rpm", 100, 100, 0)], 30)
        assert b.grants[0].share == 40  # gw-a's minute is not over
        # A lease that ended more than a minute ago counts for nothing, and a sweep removes it.
        await s.allowance_round("gw-c", [ShareAsk("key:k2", "rpm", 100, 60, 0)], -TAIL_S - 1)
        d = await s.allowance_round("gw-d", [ShareAsk("key:k2", "rpm", 100, 100, 0)], 30)
        assert d.grants[0].share == 100
        assert await s.allowance_sweep(0) == 1
        assert await s.rate_shares_held("key:k2", "rpm") == {"gw-d": 100}
        # Every round renews all of a gateway's shares, asked about or not.
        await s.allowance_round("gw-b", [], 0.0)
        e = await s.allowance_round("gw-e", [ShareAsk("key:k1", "rpm", 100, 100, 0)], 30)
        assert e.grants[0].share == 0  # gw-a's 60 and gw-b's 40, both in their last minute


async def test_many_gateways_claiming_one_pool_at_once_are_granted_exactly_its_limit(address):
    """Two connections' worth of racing rounds (two Store objects: on SQLite two handles on one
    file, as two processes would have): the lock makes claims take turns."""
    async with await Store.open(address) as s1, await Store.open(address) as s2:

        async def claim(store: Store, gw: str) -> int:
            r = await store.allowance_round(gw, [ShareAsk("project:p1", "rpm", 100, 13, 0)], 30)
            return r.grants[0].share if r.grants else 0

        got = await asyncio.gather(*(claim(s1 if i % 2 else s2, f"gw-{i}") for i in range(16)))
        assert sum(got) == 100 and max(got) == 13
        assert sum((await s1.rate_shares_held("project:p1", "rpm")).values()) == 100


def _row(cost: int, key: str = "k1", at: datetime | None = None, **kw) -> UsageRow:
    extra = {"at": at} if at is not None else {}
    return UsageRow(model="m", endpoint="e", status=200, latency_ms=1.0, key_id=key, cost_micros=cost, **kw, **extra)


async def test_spend_totals_are_written_with_their_usage_rows_and_read_by_the_others_since_a_time(address):
    async with await Store.open(address) as s:
        tally = SpendTally(s, "gw-a")
        r0 = await s.allowance_round("gw-b", [], 30)
        await tally.insert_usage([_row(100), _row(50, project_id="p1"), _row(0, key="k2")])
        mine = await s.allowance_round("gw-a", [], 30, read_spend=True)
        assert mine.spend == ()  # a gateway does not read its own
        theirs = await s.allowance_round("gw-b", [], 30, read_spend=True)
        day, month = period_keys(datetime.now(UTC))
        assert sorted(theirs.spend, key=lambda r: r.pool_key) == [
            SpendRow("gw-a", "key:k1", day, 150, month, 150),
            SpendRow("gw-a", "project:p1", day, 50, month, 50),
        ]
        # The totals are whole, and count only what the usage table took.
        assert sum(r.cost_micros for r in await s.list_usage()) == 150
        await tally.insert_usage([_row(7)])
        # Read by the database's clock after the write, so the test does not hang on how fast it ran.
        after = await s.allowance_round("gw-b", [], 30)
        later = await s.allowance_round("gw-b", [], 30, read_spend=True, spend_since=after.now + 0.001)
        assert [(r.pool_key, r.day_micros) for r in later.spend] == []  # (written before that time)
        since = await s.allowance_round("gw-b", [], 30, read_spend=True, spend_since=r0.now)
        assert sorted((r.pool_key, r.day_micros, r.month_micros) for r in since.spend) == [
            ("key:k1", 157, 157),
            ("project:p1", 50, 50),
        ]
        # A row of an earlier day counts toward its month only (a journal replayed after midnight).
        yesterday = datetime.now(UTC) - timedelta(days=1)
        if period_keys(yesterday)[1] == month:
            await tally.insert_usage([_row(1000, at=yesterday)])
            got = await s.allowance_round("gw-b", [], 30, read_spend=True)
            k1 = next(r for r in got.spend if r.pool_key == "key:k1")
            assert (k1.day_micros, k1.month_micros) == (157, 1157)
        await s.allowance_sweep(month + 1)  # spend of months before the given one goes
        gone = await s.allowance_round("gw-b", [], 30, read_spend=True)
        assert gone.spend == ()


async def test_a_usage_batch_the_store_refuses_leaves_the_spend_totals_as_they_were(tmp_path):
    async with await Store.open(str(tmp_path / "s.db")) as s:
        tally = SpendTally(s, "gw-a")
        await tally.insert_usage([_row(100)])
        dup = _row(5)
        await tally.insert_usage([dup])

        async def refuse(*_a, **_k):
            raise OSError("disk full")

        real = s.insert_usage
        s.insert_usage = refuse  # type: ignore[method-assign]
        with pytest.raises(OSError):
            await tally.insert_usage([_row(40)])
        s.insert_usage = real  # type: ignore[method-assign]
        await tally.insert_usage([_row(1)])
        got = await s.allowance_round("gw-b", [], 30, read_spend=True)
        assert [r.month_micros for r in got.spend] == [106]


# -- a gateway that loses the store ----------------------------------------------------------


async def test_a_gateway_that_loses_the_store_enforces_its_shares_until_its_lease_ends_and_logs_once(tmp_path, caplog):
    async with await Store.open(str(tmp_path / "s.db")) as store:
        acc = Accountant()
        shared = SharedLimits(store, lease_s=2.0, tick_s=0.05)
        await shared.start(acc)
        try:
            p = _principal(Pool("key:k1", rpm=100))
            acc.check(p, "m", 1)
            await async_until(lambda: acc._rpm["key:k1"].share >= 21, what="a first claim")
            first_id = shared.gateway

            async def unreachable(*_a, **_k):
                raise OSError("connection refused")

            store.allowance_round = unreachable  # type: ignore[method-assign]
            caplog.set_level(logging.ERROR, "llmgw.gateway.shared_limits")
            await async_until(lambda: not shared.reachable, what="a failed round")
            w = acc._rpm["key:k1"]
            held = w.share
            while w.room(0) >= 1 and w.used < held:  # it keeps admitting on what it holds...
                acc.check(p, "m", 1)
            with pytest.raises(LimitError) as got:  # ...and then refuses at once: no refill can come
                acc.check(p, "m", 1)
            assert not isinstance(got.value, AllowancePending)
            assert w.used == held
            await async_until(lambda: w.share == 0, what="the lease to run out")
            assert shared.gateway != first_id  # the old rows are never renewed again
            assert shared.stats.failures >= 2
            logged = [r.getMessage() for r in caplog.records]
            assert sum("did not answer" in m for m in logged) == 1, logged
            assert sum("ran out" in m for m in logged) == 1, logged
        finally:
            await shared.stop()


# -- two gateways on one PostgreSQL store --------------------------------------------------


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def pg_store(pg_database):
    asyncio.run(pg_exec(pg_database, "DROP SCHEMA public CASCADE", "CREATE SCHEMA public"))
    return pg_database


@asynccontextmanager
async def _gateways(tmp_path, store: str, n: int = 2, tokens: int = 5, **auth):
    engine = await FakeEngine(model="m", tokens=tokens).start()
    servers: list[Server] = []
    try:
        for i in range(n):
            cfg = {
                "listen": f"127.0.0.1:{_port()}",
                "admin_listen": f"127.0.0.1:{_port()}",
                "metrics_listen": None,
                "data_dir": str(tmp_path / f"gw{i}"),
                "auth": {"store": store, "pricing": {"m": {"prompt_per_1k": 1.0, "completion_per_1k": 2.0}}, **auth},
                "usage": {"flush_interval": "100ms"},
                # The engine shares the test's loop with 500 requests at once: a probe timing out behind
                # them (2 s at the default interval) would take the engine out and answer 503s that are
                # no part of what is tested. The probe's timeout is twice the interval.
                "router": {"scrape_interval": "10s"},
                "models": [{"name": "m", "endpoints": [{"url": engine.url, "engine": "llamacpp"}]}],
            }
            srv = Server(parse_server_config(cfg))
            await srv.start()
            servers.append(srv)
        yield servers, engine
    finally:
        for srv in servers:
            await srv.stop()
        await engine.stop()


def _client(srv: Server, secret: str) -> httpx.AsyncClient:
    # As test_gateway_limits: at most 100 connections keep the listen backlog from overflowing.
    return httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{srv.config.listen.port}",
        timeout=60,
        limits=httpx.Limits(max_connections=100, max_keepalive_connections=100),
        headers={"Authorization": f"Bearer {secret}"},
    )


def _chat(max_tokens: int = 5) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": max_tokens}


async def _key(servers: list[Server], **limits):
    store = servers[0].store
    assert store is not None
    if not (await store.tree()).projects:
        await store.add_org("Acme")
        await store.add_team("platform", "Acme")
        await store.add_project("gateway", "Acme/platform")
    issued = await store.issue_key("load", project="Acme/platform/gateway")
    await store.set_limits("key", issued.key.id, **limits)
    for srv in servers:
        assert srv.keys is not None
        await srv.keys.load()
    return issued


async def _usage_rows(servers: list[Server], key_id: str, n: int) -> list[UsageRow]:
    """The key's usage rows once all n are in the store (a batch being written is not waited for by flush())."""
    store = servers[0].store
    assert store is not None

    async def rows() -> list[UsageRow] | None:
        got = [r for r in await store.list_usage(limit=10_000) if r.key_id == key_id]
        return got if len(got) == n else None

    return await async_until(rows, what=f"{n} usage rows")


async def _spread(servers: list[Server], secret: str, n: int, body: dict | None = None) -> list[httpx.Response]:
    """n requests at once, taking the gateways in turn."""
    clients = [_client(s, secret) for s in servers]
    body = body or _chat()
    try:
        return await asyncio.gather(
            *(c.post("/v1/chat/completions", json=body) for c, _ in zip(cycle(clients), range(n), strict=False))
        )
    finally:
        for c in clients:
            await c.aclose()


async def test_500_concurrent_requests_over_two_gateways_at_100_a_minute_admit_100_within_one_chunk_each(
    tmp_path, pg_store
):
    async with _gateways(tmp_path, pg_store) as (servers, engine):
        assert all(s.shared_limits is not None for s in servers)  # on by default on PostgreSQL
        issued = await _key(servers, rpm=100)
        replies = await _spread(servers, issued.secret, 500)
        codes = [r.status_code for r in replies]
        bound = 2 * chunk_of(100)  # one chunk per gateway (shared_limits.py)
        admitted = codes.count(200)
        assert 100 - bound <= admitted <= 100 + bound, admitted
        assert codes.count(429) == 500 - admitted
        assert engine.requests_total == admitted
        refused = next(r for r in replies if r.status_code == 429)
        assert "the request rate of key" in refused.json()["error"]["message"]
        assert int(refused.headers["retry-after"]) >= 1
        # Both gateways served, and the store never granted more than the limit.
        per_gateway = [
            sum(1 for r, s in zip(replies, cycle(servers)) if r.status_code == 200 and s is g) for g in servers
        ]
        assert all(n > 0 for n in per_gateway), per_gateway
        store = servers[0].store
        assert store is not None
        assert sum((await store.rate_shares_held(f"key:{issued.key.id}", "rpm")).values()) <= 100
        metrics = servers[0].metrics.render().decode()
        assert 'llmgw_shared_limit_claimed_total{kind="rpm"}' in metrics


async def test_the_tokens_of_concurrent_requests_over_two_gateways_stay_within_the_limit_and_one_chunk_each(
    tmp_path, pg_store
):
    async with _gateways(tmp_path, pg_store, tokens=100) as (servers, _engine):
        issued = await _key(servers, tpm=3000)
        replies = await _spread(servers, issued.secret, 300, _chat(max_tokens=100))
        codes = [r.status_code for r in replies]
        assert codes.count(200) > 0 and codes.count(429) > 0
        rows = await _usage_rows(servers, issued.key.id, codes.count(200))
        used = sum(r.prompt_tokens + r.completion_tokens for r in rows)
        bound = 2 * chunk_of(3000)
        # Each request's estimate (its prompt at four bytes a token, and max_tokens) is at least
        # what it used, so no window ever counted more than its share and its credit.
        assert used <= 3000 + bound, used
        # Not refusing everything: what settlement gave back may go unused at the end of the burst.
        assert used >= 3000 // 2, used


async def test_a_budget_spent_through_one_gateway_is_spent_on_the_other_too(tmp_path, pg_store):
    async with _gateways(tmp_path, pg_store) as (servers, _engine):
        a, b = servers
        # A request costs about 0.02 at these prices: the budget covers a few.
        issued = await _key(servers, budget_micros=to_micros(0.05))
        pool = f"key:{issued.key.id}"
        async with _client(a, issued.secret) as http:
            for _ in range(50):
                r = await http.post("/v1/chat/completions", json=_chat())
                if r.status_code == 429:
                    break
            assert r.status_code == 429 and r.json()["error"]["code"] == "budget_spent"
        assert a.gateway is not None and b.gateway is not None
        acc_a, acc_b = a.gateway.accountant, b.gateway.accountant
        assert acc_a is not None and acc_b is not None
        spent = acc_a.spent(pool)
        await async_until(lambda: acc_b.spent(pool) == spent, what="gateway b to see gateway a's spend")
        async with _client(b, issued.secret) as http:
            r = await http.post("/v1/chat/completions", json=_chat())
        assert r.status_code == 429 and r.json()["error"]["code"] == "budget_spent"


async def test_spend_through_both_gateways_is_the_sum_of_the_usage_rows_on_each(tmp_path, pg_store):
    """No gateway's spend is counted twice or missed: after traffic on both, each one's pools
    hold what the usage rows of both say."""
    async with _gateways(tmp_path, pg_store) as (servers, _engine):
        issued = await _key(servers, budget_micros=to_micros(1000))
        replies = await _spread(servers, issued.secret, 60)
        assert [r.status_code for r in replies].count(200) == 60
        pool = f"key:{issued.key.id}"
        rows = await _usage_rows(servers, issued.key.id, 60)
        total = sum(r.cost_micros for r in rows)
        assert total > 0
        for srv in servers:
            acc = srv.gateway.accountant if srv.gateway else None
            assert acc is not None
            await async_until(
                lambda acc=acc: acc.spent(pool) == total,
                what="both gateways to agree with usage",
                detail=lambda acc=acc: (acc.spent(pool), total),
            )


async def test_a_gateway_started_after_another_spent_counts_that_spend_once(tmp_path, pg_store):
    async with _gateways(tmp_path, pg_store, n=1) as (servers, _engine):
        (a,) = servers
        issued = await _key(servers, budget_micros=to_micros(1000))
        await _spread([a], issued.secret, 10)
        assert a.usage is not None
        await a.usage.flush()
        pool = f"key:{issued.key.id}"
        async with _gateways(tmp_path / "later", pg_store, n=1) as (later, _):
            (b,) = later
            acc_a = a.gateway.accountant if a.gateway else None
            acc_b = b.gateway.accountant if b.gateway else None
            assert acc_a is not None and acc_b is not None
            spent = acc_a.spent(pool)
            assert acc_b.spent(pool) == spent > 0  # restored from the usage rows
            shared = b.shared_limits
            assert shared is not None
            # Rounds later it is still counted once: the rows read at start were the baseline.
            since = shared._spend_since
            await async_until(lambda: shared._spend_since != since, what="another round")
            assert acc_b.spent(pool) == spent


async def test_a_gateway_that_stops_keeps_only_what_its_window_counts_and_returns_the_rest(tmp_path, pg_store):
    async with _gateways(tmp_path, pg_store, n=1) as (servers, _engine):
        (a,) = servers
        issued = await _key(servers, rpm=1000)
        await _spread([a], issued.secret, 5)
        store = a.store
        assert store is not None and a.shared_limits is not None
        pool = f"key:{issued.key.id}"
        await async_until(
            lambda: a.shared_limits is not None and a.shared_limits.held()["rpm"] >= 5 + 2 * chunk_of(1000),
            what="a claim",
        )
        assert list((await store.rate_shares_held(pool, "rpm")).values()) == [a.shared_limits.held()["rpm"]]
        await a.shared_limits.stop()
        # What the window counts stays leased for its minute; the rest is back in the pool.
        assert list((await store.rate_shares_held(pool, "rpm")).values()) == [5]
        other = await store.allowance_round("gw-other", [ShareAsk(pool, "rpm", 1000, 1000, 0)], 30)
        assert other.grants[0].share == 995


async def test_shared_limits_are_off_on_sqlite_unless_asked_for_and_off_on_postgresql_when_turned_off(
    tmp_path, pg_store
):
    async with _gateways(tmp_path / "lite", str(tmp_path / "gw.db"), n=1) as (servers, _):
        assert servers[0].shared_limits is None
        acc = servers[0].gateway.accountant if servers[0].gateway else None
        assert acc is not None and acc.shared is None
    async with _gateways(tmp_path / "lite2", str(tmp_path / "gw2.db"), n=1, shared_limits=True) as (servers, _):
        assert servers[0].shared_limits is not None
    async with _gateways(tmp_path / "pg", pg_store, n=2, shared_limits=False) as (servers, _engine):
        assert all(s.shared_limits is None for s in servers)
        issued = await _key(servers, rpm=20)
        replies = await _spread(servers, issued.secret, 100)
        # Each counts alone: twice the limit (what shared limits exist to prevent).
        assert [r.status_code for r in replies].count(200) == 40
