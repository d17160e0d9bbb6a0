"""Sign-in attempts on real `llmgw server` processes: 150 attempts on one account from one
address, sent together, have no more passwords checked than the same attempts sent one at a
time, with `workers` 1, 2 and 4 (every process serving the client port) and with two gateways
on one PostgreSQL store. A password was checked when the answer is 401 (wrong) or 303 (signed
in); a refusal (429, with Retry-After) checked nothing. The store's count is read as well."""

from __future__ import annotations

import asyncio
import re
import sqlite3
import subprocess
import time

import aiohttp
import httpx
import pytest
from harness import Gateway, llmgw_cmd

from llmgw.testing.waiting import until

pytestmark = pytest.mark.e2e

PASSWORD = "correct horse battery"
WRONG = "not the password"
PER_ACCOUNT = 5  # the sign-in limit per account (llmgw/server/pages/signin_limit.py)
BURST = 150


def _person(gw: Gateway, email: str) -> None:
    r = subprocess.run(
        llmgw_cmd("users", "create", email, "--password", PASSWORD, "--config", str(gw.config)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def _form(url: str) -> tuple[str, str]:
    """The sign-in form's token and the cookie it is kept in (a form before sign-in repeats it)."""
    r = httpx.get(url + "/login")
    token = re.search(r'name="csrf" value="([^"]+)"', r.text)
    assert r.status_code == 200 and token, r.text
    return token.group(1), r.cookies["llmgw_form"]


async def _burst(urls: list[str], email: str, passwords: list[str]) -> list[tuple[int, str, str, bool]]:
    """Every attempt at once, each on a connection of its own (the kernel spreads connections over
    the workers), spread over ``urls``: (status, Retry-After, body, whether a session was set)."""
    forms = [_form(u) for u in urls]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True)) as s:

        async def one(i: int, password: str) -> tuple[int, str, str, bool]:
            csrf, cookie = forms[i % len(urls)]
            async with s.post(
                urls[i % len(urls)] + "/login",
                data={"csrf": csrf, "email": email, "password": password},
                headers={"Cookie": f"llmgw_form={cookie}"},
                allow_redirects=False,
            ) as r:
                session = any(
                    "llmgw_session=" in v and "Max-Age=0" not in v for v in r.headers.getall("Set-Cookie", [])
                )
                return r.status, r.headers.get("Retry-After", ""), await r.text(), session

        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(passwords))))


def _check_refusals(got: list[tuple[int, str, str, bool]]) -> None:
    for status, retry_after, body, _ in got:
        if status == 429:
            assert 0 < int(retry_after) <= 300
            assert f"Too many sign-in attempts; try again in {retry_after} seconds." in body


def _counted_sqlite(path: str, email: str) -> int:
    with sqlite3.connect(path) as db:
        return db.execute("SELECT count(*) FROM signin_attempts WHERE key = ?", (f"account:{email}",)).fetchone()[0]


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_150_attempts_sent_together_have_no_more_passwords_checked_than_the_limit_whatever_the_workers(
    tmp_path, fake_engine, workers
):
    gw = Gateway(tmp_path, fake_engine[1], workers=workers)
    try:
        gw.wait_up()
        if workers > 1:  # one: the server process serves the client port itself
            until(
                lambda: f"llmgw_workers {workers}.0" in httpx.get(gw.admin + "/metrics", headers=gw.admin_auth).text,
                30,
                f"all {workers} workers to listen",
                [gw],
            )
        _person(gw, "ann@example.com")
        _person(gw, "bob@example.com")

        # 150 wrong passwords at once: five are checked, the rest refused unchecked.
        t0 = time.monotonic()
        got = asyncio.run(_burst([gw.url], "ann@example.com", [WRONG] * BURST))
        took = time.monotonic() - t0
        statuses = [g[0] for g in got]
        assert statuses.count(401) == PER_ACCOUNT and statuses.count(429) == BURST - PER_ACCOUNT, statuses
        _check_refusals(got)
        assert _counted_sqlite(gw.store, "ann@example.com") == PER_ACCOUNT
        print(f"workers={workers}: {BURST} wrong attempts answered in {took:.2f}s, {statuses.count(401)} checked")

        # Past the limit, a burst that carries the right password signs nobody in: nothing is checked.
        got = asyncio.run(_burst([gw.url], "ann@example.com", [PASSWORD] + [WRONG] * (BURST - 2) + [PASSWORD]))
        assert [g[0] for g in got] == [429] * BURST and not any(g[3] for g in got)
        _check_refusals(got)

        # A fresh account, the right password scattered through the burst: the wrong ones checked never
        # pass the limit (a right one in flight holds a place and gives back only its own).
        passwords = [PASSWORD if i % 15 == 7 else WRONG for i in range(BURST)]
        got = asyncio.run(_burst([gw.url], "bob@example.com", passwords))
        statuses = [g[0] for g in got]
        assert set(statuses) <= {303, 401, 429}, statuses
        assert 1 <= statuses.count(401) <= PER_ACCOUNT and statuses.count(401) + statuses.count(303) < BURST
        assert sum(g[3] for g in got) == statuses.count(303)  # each sign-in, and only those, got a session
        _check_refusals(got)
        assert _counted_sqlite(gw.store, "bob@example.com") == statuses.count(401)
        print(f"workers={workers}: mixed burst {statuses.count(401)} wrong checked, {statuses.count(303)} signed in")
    finally:
        gw.stop()


def test_two_gateways_on_one_postgresql_store_share_one_count(tmp_path, fake_engine, pg_address):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = Gateway(tmp_path / "a", fake_engine[1], store=pg_address)
    b = Gateway(tmp_path / "b", fake_engine[1], store=pg_address)
    try:
        a.wait_up()
        b.wait_up()
        _person(a, "ann@example.com")
        got = asyncio.run(_burst([a.url, b.url], "ann@example.com", [WRONG] * BURST))
        statuses = [g[0] for g in got]
        assert statuses.count(401) == PER_ACCOUNT and statuses.count(429) == BURST - PER_ACCOUNT, statuses
        _check_refusals(got)
        # Either gateway refuses the right password now, with the same count behind it.
        for gw in (a, b):
            got = asyncio.run(_burst([gw.url], "ann@example.com", [PASSWORD]))
            assert got[0][0] == 429 and not got[0][3]
    finally:
        a.stop()
        b.stop()
