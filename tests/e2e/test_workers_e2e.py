"""`workers: 2`: two processes serve one listener, a key's requests per minute hold across them,
every admitted request's usage row reaches the store once, and a worker killed is started again."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess

import aiohttp
import httpx
import pytest
from harness import Gateway

from llmgw.testing.waiting import until

pytestmark = pytest.mark.e2e

LIMIT, CONCURRENT = 100, 500


@pytest.fixture
def engine(fake_engine):
    return fake_engine[1]


def _worker_counts(gw: Gateway) -> dict[str, float]:
    text = httpx.get(gw.admin + "/metrics", headers=gw.admin_auth).text
    out = {}
    for line in text.splitlines():
        if line.startswith("llmgw_worker_requests_total{"):
            worker = line.split('worker="', 1)[1].split('"', 1)[0]
            out[worker] = float(line.rsplit(" ", 1)[1])
    return out


def _serving(gw: Gateway) -> int:
    """llmgw_workers: the processes listening now (a worker counts once it said it listens)."""
    text = httpx.get(gw.admin + "/metrics", headers=gw.admin_auth).text
    return int(float(next(line.split()[1] for line in text.splitlines() if line.startswith("llmgw_workers "))))


def _workers_of(gw: Gateway) -> list[int]:
    r = subprocess.run(["pgrep", "-P", str(gw.proc.pid)], capture_output=True, text=True)
    return [int(p) for p in r.stdout.split()]


async def _burst(url: str, key: str, n: int) -> list[int]:
    # A new connection each: the kernel spreads connections, not requests, across the workers.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True)) as s:

        async def one(i: int) -> int:
            async with s.post(
                url + "/v1/chat/completions",
                headers={"Authorization": f"Bearer {key}"},
                json={"model": "fake", "messages": [{"role": "user", "content": f"request {i}"}], "max_tokens": 4},
            ) as r:
                await r.read()
                return r.status

        return list(await asyncio.gather(*(one(i) for i in range(n))))


def test_a_keys_requests_per_minute_hold_across_two_workers_and_each_admitted_request_is_stored_once(tmp_path, engine):
    gw = Gateway(tmp_path, engine, workers=2)
    try:
        gw.wait_up()
        until(lambda: _serving(gw) == 2, 30, "the second worker to listen", [gw])
        key = gw.create_key("burst")
        r = gw.keys("list")
        key_id = next(line.split()[0] for line in r.stdout.splitlines() if line.startswith("key-"))
        r = gw.keys("limits", "--scope", "key", "--id", key_id, "--rpm", str(LIMIT))
        assert r.returncode == 0, r.stderr
        # Both processes poll the store for the limit: probes on new connections (either worker) until
        # ten in a row carry it. They count against the limit, so they count as admitted below.
        probes = {"sent": 0, "in_a_row": 0}

        def limit_seen_by_both() -> bool:
            r = httpx.post(
                gw.url + "/v1/chat/completions",
                headers={"Authorization": f"Bearer {key}", "Connection": "close"},
                json={"model": "fake", "messages": [{"role": "user", "content": "probe"}], "max_tokens": 4},
            )
            probes["sent"] += r.status_code == 200
            seen = r.headers.get("x-ratelimit-limit-requests") == str(LIMIT)
            probes["in_a_row"] = probes["in_a_row"] + 1 if seen else 0
            return probes["in_a_row"] >= 10

        until(limit_seen_by_both, 20, "both workers to hold the key's limit", [gw])
        until(lambda: "1" in _worker_counts(gw), 10, "the worker's metrics to reach the server", [gw])

        statuses = asyncio.run(_burst(gw.url, key, CONCURRENT))
        admitted = statuses.count(200) + probes["sent"]
        assert set(statuses) <= {200, 429}, statuses
        # One accountant, the server process's, answers both workers. A probe served by a worker
        # before its key cache held the limit was not counted, so the probes may add a few.
        assert LIMIT <= admitted <= LIMIT + 10, admitted

        counts: dict[str, float] = {}

        def both_served() -> bool:
            counts.update(_worker_counts(gw))
            return sum(counts.values()) >= CONCURRENT + probes["sent"]

        until(both_served, 10, "every request to be counted on the server's /metrics", [gw])
        assert counts["0"] > 0 and counts["1"] > 0, counts

        def stored() -> int:
            with sqlite3.connect(gw.store) as db:
                return db.execute("select count(*) from usage where status = 200").fetchone()[0]

        until(lambda: stored() >= admitted, 10, "the usage rows of every admitted request", [gw])
        gw.proc.send_signal(signal.SIGTERM)
        gw.proc.wait(60)
        assert stored() == admitted
        with sqlite3.connect(gw.store) as db:
            assert db.execute("select count(distinct request_id) from usage").fetchone()[0] == admitted
    finally:
        gw.kill()


def test_a_key_made_a_moment_ago_is_served_by_every_worker_on_its_first_request(tmp_path, engine):
    # The key cache polls the store once a second; a key it does not know is looked up before a 401.
    gw = Gateway(tmp_path, engine, workers=2)
    try:
        gw.wait_up()
        until(lambda: _serving(gw) == 2, 30, "the second worker to listen", [gw])
        before = _worker_counts(gw)
        r = gw.keys("create", "--name", "fresh")  # straight into the store, as another process would
        assert r.returncode == 0, r.stderr
        key = r.stdout.strip().splitlines()[-1]
        statuses = asyncio.run(_burst(gw.url, key, 40))
        assert statuses == [200] * 40, statuses
        until(lambda: sum(_worker_counts(gw).values()) >= sum(before.values()) + 40, 10, "the requests counted", [gw])
        after = _worker_counts(gw)
        assert after["0"] > before.get("0", 0) and after["1"] > before.get("1", 0), (before, after)
    finally:
        gw.kill()


def test_a_worker_killed_is_started_again_and_serving_goes_on(tmp_path, engine):
    gw = Gateway(tmp_path, engine, workers=2, auth={"enabled": False})
    try:
        gw.wait_up()
        until(lambda: len(_workers_of(gw)) == 1, 30, "the server to start its second worker", [gw])
        (first,) = _workers_of(gw)
        os.kill(first, signal.SIGKILL)

        def replaced() -> bool:
            now = _workers_of(gw)
            return len(now) == 1 and now[0] != first

        until(replaced, 30, "the server to start the worker again", [gw])
        until(lambda: _serving(gw) == 2, 30, "the new worker to listen", [gw])
        before = _worker_counts(gw).get("1", 0.0)

        def worker_serves() -> bool:
            asyncio.run(_burst(gw.url, "none", 20))
            return _worker_counts(gw).get("1", 0.0) > before

        until(worker_serves, 30, "the new worker to serve requests", [gw])
        text = httpx.get(gw.admin + "/metrics", headers=gw.admin_auth).text
        assert 'llmgw_worker_restarts_total{worker="1"} 1.0' in text
    finally:
        gw.kill()
