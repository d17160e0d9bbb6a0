"""Sign-in attempt limiting, counted in the store before a password is checked: per account and
per address over a sliding window, on SQLite and PostgreSQL. Time passes by moving the rows'
times back (the window is judged by the database's clock), so nothing waits.

The races run on two Store objects (two connection pools; on SQLite two handles on one file,
as two processes would have): 150 attempts sent together are counted exactly up to the limit."""

from __future__ import annotations

import asyncio

import pytest
from conftest import PG_ADMIN, pg_exec
from sqlalchemy import func, select, update

from llmgw.errors import LlmgwError
from llmgw.server.pages.signin_limit import (
    UNAVAILABLE,
    SigninLimiter,
    SigninUnavailable,
    account_key,
    address_group,
    wait_text,
)
from llmgw.store import AttemptLimit, Store, StoreError
from llmgw.store.schema import signin_attempts, signin_keys
from llmgw.store.signin import wait_after

ANN = "account:ann@example.com"


@pytest.fixture
async def store(address):
    s = await Store.open(address)
    yield s
    await s.close()


async def _age(store: Store, seconds: float, attempt: str | None = None) -> None:
    """Time passes for the attempts (one, or all): their rows move ``seconds`` into the past."""
    q = update(signin_attempts).values(at=signin_attempts.c.at - seconds)
    if attempt is not None:
        q = q.where(signin_attempts.c.attempt == attempt)
    async with store.engine.begin() as conn:
        await conn.execute(q)
        await conn.execute(update(signin_keys).values(seen_at=signin_keys.c.seen_at - seconds))


async def _rows(store: Store) -> tuple[int, int]:
    async with store.engine.connect() as conn:
        attempts = (await conn.execute(select(func.count()).select_from(signin_attempts))).scalar_one()
        keys = (await conn.execute(select(func.count()).select_from(signin_keys))).scalar_one()
    return attempts, keys


# -- the decisions alone ---------------------------------------------------------------


def test_one_more_attempt_fits_until_the_limit_and_then_when_the_oldest_of_the_last_limit_leaves():
    assert wait_after([], 5, 300, 1000) is None
    assert wait_after([990, 980, 970, 960], 5, 300, 1000) is None
    # Five in the window (newest first): the fifth newest, at 950, leaves at 1250.
    assert wait_after([990, 980, 970, 960, 950], 5, 300, 1000) == pytest.approx(250)
    assert wait_after([990, 980, 970, 960, 950, 940], 5, 300, 1000) == pytest.approx(250)
    assert wait_after([990, 980, 970, 960, 700], 5, 300, 1000) is None  # it has left


def test_addresses_in_one_ipv6_64_count_together_and_odd_values_count_as_given():
    assert address_group("2001:db8:1:2::1") == address_group("2001:db8:1:2:ffff::9") == "2001:db8:1:2::/64"
    assert address_group("2001:db8:1:3::1") != address_group("2001:db8:1:2::1")
    assert address_group(" 192.0.2.7 ") == "192.0.2.7"
    assert address_group("unknown") == "unknown"


def test_an_account_is_one_whatever_the_spelling_of_its_email_and_no_email_is_no_account():
    assert account_key(" Ann@Example.com ") == account_key("ann@example.com") == ANN
    assert account_key("  ") == ""


def test_limits_must_be_above_zero():
    for kwargs in ({"per_account": 0}, {"per_address": 0}, {"window_s": 0}):
        with pytest.raises(ValueError, match="above zero"):
            SigninLimiter(None, **kwargs)  # type: ignore[arg-type]  # refused before the store is used


def test_the_wait_a_refusal_gives_is_whole_seconds_and_never_zero():
    assert wait_text(0.2) == "1" and wait_text(249.9) == "250" and wait_text(250.0) == "251"


# -- counting in the store, on both backends --------------------------------------------


async def test_an_account_waits_after_five_attempts_until_the_oldest_leaves_the_window(store):
    lim = SigninLimiter(store, per_account=5, per_address=20, window_s=300)
    first = await lim.attempt("ann@example.com", "10.0.0.0")
    assert not first.refused
    for i in range(1, 5):
        assert not (await lim.attempt("ann@example.com", f"10.0.0.{i}")).refused
    # From any address, in any spelling of the email; the wait is the first attempt's time left.
    held = await lim.attempt(" Ann@Example.com ", "192.0.2.9")
    assert held.refused and 299 <= held.wait_s <= 300
    assert not (await lim.attempt("bob@example.com", "10.0.0.1")).refused  # other accounts are not held
    # A refused attempt is not counted: still five on the account.
    assert await store.attempts_counted(ANN, 300) == 5
    await _age(store, 299, first.attempt)
    assert 0 < (await lim.attempt("ann@example.com", "192.0.2.9")).wait_s <= 1
    await _age(store, 1.5, first.attempt)
    # The first attempt left the window: four remain, one more is counted, then the account waits again.
    assert not (await lim.attempt("ann@example.com", "192.0.2.9")).refused
    assert (await lim.attempt("ann@example.com", "192.0.2.9")).refused


async def test_a_right_password_withdraws_its_own_attempt_but_the_wrong_ones_before_it_stay(store):
    lim = SigninLimiter(store, per_account=3, per_address=4, window_s=60)
    for _ in range(2):
        assert not (await lim.attempt("ann@example.com", "10.0.0.1")).refused  # two wrong passwords
    right = await lim.attempt("ann@example.com", "10.0.0.2")
    assert not right.refused
    await lim.right(right)
    # Signing in cost nothing, on the account or the address; the two wrong ones still count.
    assert await store.attempts_counted(ANN, 60) == 2
    assert await store.attempts_counted("address:10.0.0.2", 60) == 0
    assert not (await lim.attempt("ann@example.com", "10.0.0.1")).refused  # a third wrong one
    assert (await lim.attempt("ann@example.com", "10.0.0.2")).refused  # the account's limit of three
    # The address 10.0.0.1 made three; one more, on any account, reaches its limit of four.
    assert not (await lim.attempt("bob@example.com", "10.0.0.1")).refused
    refused = await lim.attempt("carol@example.com", "10.0.0.1")
    assert refused.refused and 59 <= refused.wait_s <= 60
    assert not (await lim.attempt("carol@example.com", "10.0.0.3")).refused


async def test_an_address_guessing_many_accounts_waits(store):
    lim = SigninLimiter(store, per_account=5, per_address=20, window_s=300)
    for i in range(20):
        assert not (await lim.attempt(f"user{i}@example.com", "203.0.113.7")).refused
    assert (await lim.attempt("user99@example.com", "203.0.113.7")).refused
    assert not (await lim.attempt("user99@example.com", "203.0.113.8")).refused


async def test_addresses_in_one_ipv6_64_share_one_count_in_the_store(store):
    lim = SigninLimiter(store, per_account=100, per_address=2, window_s=60)
    await lim.attempt("a@example.com", "2001:db8:1:2::1")
    await lim.attempt("b@example.com", "2001:db8:1:2:ffff::9")
    assert (await lim.attempt("c@example.com", "2001:db8:1:2::abcd")).refused
    assert not (await lim.attempt("c@example.com", "2001:db8:1:3::1")).refused


async def test_attempts_naming_no_account_count_against_their_address_alone(store):
    lim = SigninLimiter(store, per_account=2, per_address=3, window_s=60)
    for i in range(10):  # sign-ups from ten addresses: no shared "" account fills up
        assert not (await lim.attempt("", f"10.0.3.{i}")).refused
    async with store.engine.connect() as conn:
        keys = set((await conn.execute(select(signin_attempts.c.key))).scalars())
    assert keys == {f"address:10.0.3.{i}" for i in range(10)}
    for _ in range(2):
        await lim.attempt("  ", "10.0.3.0")
    assert (await lim.attempt("", "10.0.3.0")).refused


async def test_rows_past_the_window_are_swept_by_the_next_count(store):
    lim = SigninLimiter(store, per_account=3, per_address=3, window_s=60)
    for i in range(25):
        await lim.attempt(f"u{i}@example.com", f"10.0.1.{i}")
    assert await _rows(store) == (50, 50)  # an account row and an address row each
    await _age(store, 61)
    await lim.attempt("new@example.com", "10.0.2.1")
    assert await _rows(store) == (2, 2)


async def test_limits_that_make_no_sense_are_refused_and_count_nothing(store):
    bad = [
        ([], 60, "at least one"),
        ([AttemptLimit("", 3)], 60, "1 to 400 characters"),
        ([AttemptLimit("a" * 401, 3)], 60, "1 to 400 characters"),
        ([AttemptLimit(ANN, 0)], 60, "above zero"),
        ([AttemptLimit(ANN, 3), AttemptLimit(ANN, 4)], 60, "given twice"),
        ([AttemptLimit(ANN, 3)], 0, "window"),
    ]
    for limits, window, needle in bad:
        with pytest.raises(StoreError, match=needle):
            await store.count_attempt(limits, window)
    assert await _rows(store) == (0, 0)


async def test_150_attempts_sent_together_on_one_account_are_counted_exactly_up_to_its_limit(address):
    async with await Store.open(address) as s1, await Store.open(address) as s2:
        limiters = [SigninLimiter(s, per_account=5, per_address=20, window_s=300) for s in (s1, s2)]
        got = await asyncio.gather(*(limiters[i % 2].attempt("ann@example.com", f"198.51.100.{i}") for i in range(150)))
        assert sum(not c.refused for c in got) == 5
        assert all(0 < c.wait_s <= 300 for c in got if c.refused)
        assert await s1.attempts_counted(ANN, 300) == 5


async def test_150_attempts_sent_together_from_one_address_are_counted_exactly_up_to_its_limit(address):
    async with await Store.open(address) as s1, await Store.open(address) as s2:
        limiters = [SigninLimiter(s, per_account=5, per_address=20, window_s=300) for s in (s1, s2)]
        got = await asyncio.gather(
            *(limiters[i % 2].attempt(f"user{i % 40}@example.com", "203.0.113.9") for i in range(150))
        )
        assert sum(not c.refused for c in got) == 20
        assert await s1.attempts_counted("address:203.0.113.9", 300) == 20


async def test_a_right_password_in_a_burst_frees_only_its_own_place_so_wrong_ones_never_pass_the_limit(address):
    async with await Store.open(address) as s1, await Store.open(address) as s2:
        limiters = [SigninLimiter(s, per_account=5, per_address=200, window_s=300) for s in (s1, s2)]

        async def one(i: int) -> str:
            lim = limiters[i % 2]
            counted = await lim.attempt("ann@example.com", "192.0.2.1")
            if counted.refused:
                return "refused"
            if i % 10 == 0:  # these carry the right password
                await lim.right(counted)
                return "right"
            return "wrong"

        got = await asyncio.gather(*(one(i) for i in range(150)))
        # Whichever order they were counted in: a right one in flight holds a place, and gives
        # back only its own when it is done.
        assert 1 <= got.count("wrong") <= 5 and got.count("wrong") + got.count("right") < 150
        assert await s1.attempts_counted(ANN, 300) == got.count("wrong")


async def test_a_store_that_cannot_be_reached_refuses_the_attempt_and_says_so(pg_database):
    # A database of its own, dropped while the store is open: every statement fails from then on.
    name = pg_database.rsplit("/", 1)[1] + "_gone"
    await pg_exec(PG_ADMIN, f'CREATE DATABASE "{name}"')
    store = await Store.open(pg_database.rsplit("/", 1)[0] + "/" + name)
    try:
        lim = SigninLimiter(store)
        assert not (await lim.attempt("ann@example.com", "10.0.0.1")).refused
        await pg_exec(PG_ADMIN, f'DROP DATABASE "{name}" WITH (FORCE)')
        with pytest.raises(SigninUnavailable) as exc:
            await lim.attempt("ann@example.com", "10.0.0.1")
        assert str(exc.value) == UNAVAILABLE and "no password was checked" in UNAVAILABLE
        assert isinstance(exc.value, LlmgwError)
    finally:
        await store.close()
        await pg_exec(PG_ADMIN, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
