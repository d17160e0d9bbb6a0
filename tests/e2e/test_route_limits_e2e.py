"""Every route that takes a key is held to its limits, on a real `llmgw server` with the fake engine:
notes, each MCP call (each of a batch), kept conversations; a spent budget refuses them all; MCP
sessions are bounded per key, so one key opening thousands never ends another key's.

The limits are checked with workers 1, 2 and 4: every worker asks the server process's one
accountant, so each request and each call is admitted at most once against the key's one limit.
Keys and limits are made in the store before the server starts, so every worker holds them from
its first request. MCP sessions live in the process that opened them, so a client keeps its
connection (as MCP clients do) and the session test runs on one process.
"""

from __future__ import annotations

import asyncio
import re
import subprocess

import aiohttp
import httpx
import pytest
from harness import Gateway, llmgw_cmd

from llmgw.testing.waiting import until

pytestmark = pytest.mark.e2e

WORKERS = [1, 2, 4]
PRICING = {"fake": {"prompt_per_1k": 1.0, "completion_per_1k": 1.0}}
PROJECT = "Acme/platform/agents"
INIT = {
    "jsonrpc": "2.0",
    "id": 0,
    "method": "initialize",
    "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t"}},
}
MCP_HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


@pytest.fixture
def gw(fake_engine, tmp_path):
    """One process, the project made and keeping notes and conversations."""
    _, models = fake_engine
    gw = Gateway(tmp_path, models, workers=1, auth={"pricing": PRICING}).wait_up()
    _tenancy(gw.store)
    for kind in ("threads", "memory"):
        r = gw.keys(kind, "--project", PROJECT, "--retain-hours", "24")
        assert r.returncode == 0, r.stderr
    yield gw
    assert gw.stop() == 0, gw.text()


@pytest.fixture(params=WORKERS, ids=lambda n: f"workers={n}")
def limited(request, fake_engine, tmp_path):
    """start(name=(limits...), ...): the project, keys of it with those limits, then the server with
    the fixture's workers, every one listening; returns the gateway and each key's headers."""
    _, models = fake_engine
    started: list[Gateway] = []

    def start(**keys: tuple[str, ...]) -> tuple[Gateway, dict[str, dict[str, str]]]:
        store = str(tmp_path / "llmgw.db")
        _tenancy(store)
        for kind in ("threads", "memory"):
            _store_cli(store, "keys", kind, "--project", PROJECT, "--retain-hours", "24")
        auth = {}
        for name, limits in keys.items():
            out = _store_cli(store, "keys", "create", "--name", name, "--project", PROJECT)
            key_id = re.search(r"^id (key-\S+)$", out.stderr, re.MULTILINE).group(1)
            if limits:
                _store_cli(store, "keys", "limits", "--scope", "key", "--id", key_id, *limits)
            auth[name] = {"Authorization": f"Bearer {out.stdout.strip().splitlines()[-1]}"}
        gw = Gateway(tmp_path, models, store=store, workers=request.param, auth={"pricing": PRICING}).wait_up()
        started.append(gw)
        if request.param > 1:
            until(lambda: _serving(gw) == request.param, 60, "every worker to listen", [gw])
        return gw, auth

    yield start
    for gw in started:
        assert gw.stop() == 0, gw.text()


def _store_cli(store: str, *args: str) -> subprocess.CompletedProcess:
    r = subprocess.run(llmgw_cmd(*args, "--store", store), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r


def _serving(gw: Gateway) -> int:
    text = httpx.get(gw.admin + "/metrics", headers=gw.admin_auth).text
    return int(float(next(line.split()[1] for line in text.splitlines() if line.startswith("llmgw_workers "))))


def _tenancy(store: str) -> None:
    from llmgw.store import Store

    async def run() -> None:
        s = await Store.open(store)
        try:
            await s.add_org("Acme")
            await s.add_team("platform", "Acme")
            await s.add_project("agents", "Acme/platform")
        finally:
            await s.close()

    asyncio.run(run())


def _project_key(gw: Gateway, name: str) -> tuple[str, str]:
    """A key of the project (notes and MCP are kept per project): its secret and its id."""
    made = gw.keys("create", "--name", name, "--project", PROJECT)
    assert made.returncode == 0, made.stderr
    key_id = re.search(r"^id (key-\S+)$", made.stderr, re.MULTILINE).group(1)
    return made.stdout.strip().splitlines()[-1], key_id


def _accepted(gw: Gateway, name: str) -> dict[str, str]:
    secret, _ = _project_key(gw, name)
    auth = {"Authorization": f"Bearer {secret}"}
    until(lambda: httpx.get(gw.url + "/v1/models", headers=auth).status_code == 200, 10, f"key {name}", [gw])
    return auth


def _assert_limit_refusal(r: httpx.Response, code: str) -> None:
    assert r.status_code == 429, r.text
    err = r.json()["error"]
    assert err["type"] == "rate_limit_error" and err["code"] == code
    assert int(r.headers["Retry-After"]) >= 1
    assert "x-ratelimit-limit-requests" in r.headers and "x-ratelimit-remaining-requests" in r.headers


def _notes(gw: Gateway, auth: dict[str, str]) -> int:
    r = httpx.get(gw.url + "/v1/memory", params={"limit": 200}, headers=auth, timeout=10)
    assert r.status_code == 200, r.text
    return len(r.json()["data"])


def test_a_key_at_two_requests_a_minute_writes_two_of_200_notes_and_is_refused_the_rest(limited):
    gw, keys = limited(notes=("--rpm", "2"), reader=())
    auth = keys["notes"]
    written = [
        httpx.post(gw.url + "/v1/memory", headers=auth, json={"text": "x" * 60_000}, timeout=10) for _ in range(200)
    ]
    statuses = [r.status_code for r in written]
    assert statuses.count(201) == 2 and statuses.count(429) == 198, statuses
    _assert_limit_refusal(written[-1], "rate_limited")
    assert "request rate of key" in written[-1].json()["error"]["message"]
    # Reading them back is refused too: this key's minute is spent. Another key of the project sees one note.
    _assert_limit_refusal(httpx.get(gw.url + "/v1/memory", headers=auth, timeout=10), "rate_limited")
    _assert_limit_refusal(httpx.get(gw.url + "/v1/threads/thr_x", headers=auth, timeout=10), "rate_limited")
    assert _notes(gw, keys["reader"]) == 2


def _mcp(
    gw: Gateway, auth: dict[str, str], body, sid: str | None = None, client: httpx.Client | None = None
) -> httpx.Response:
    headers = {**auth, **MCP_HEADERS}
    if sid is not None:
        headers["Mcp-Session-Id"] = sid
    return (client or httpx).post(gw.url + "/v1/mcp", headers=headers, json=body, timeout=60)


def test_a_500_call_mcp_batch_runs_only_as_many_calls_as_the_keys_minute_has_left(limited):
    gw, keys = limited(batch=("--rpm", "10"))
    auth = keys["batch"]
    # One connection, as an MCP client keeps: the session lives in the process that opened it.
    client = httpx.Client()
    init = _mcp(gw, auth, INIT, client=client)
    assert init.status_code == 200, init.text
    left = int(init.headers["x-ratelimit-remaining-requests"])
    assert left == 9  # initialize was the first of the 10
    batch = [
        {
            "jsonrpc": "2.0",
            "id": i,
            "method": "tools/call",
            "params": {"name": "memory_write", "arguments": {"text": f"note {i}"}},
        }
        for i in range(500)
    ]
    r = _mcp(gw, auth, batch, init.headers["Mcp-Session-Id"], client=client)
    client.close()
    assert r.status_code == 200, r.text
    replies = r.json()
    assert [m["id"] for m in replies] == list(range(500))
    ran = [m for m in replies if "result" in m]
    refused = [m for m in replies if "error" in m]
    assert len(ran) == left and [m["id"] for m in ran] == list(range(left))
    assert all(m["error"]["data"]["code"] == "rate_limited" for m in refused)
    assert "request rate of key" in refused[0]["error"]["message"]
    assert int(r.headers["Retry-After"]) >= 1 and r.headers["x-ratelimit-remaining-requests"] == "0"
    assert _stored_notes(gw) == left


def _stored_notes(gw: Gateway) -> int:
    import sqlite3

    with sqlite3.connect(gw.store) as db:
        return db.execute("SELECT count(*) FROM memory_notes").fetchone()[0]


def test_a_key_whose_budget_is_spent_is_refused_notes_mcp_and_conversations(limited):
    gw, keys = limited(spent=("--rpm", "1000", "--budget", "0.000001"))
    auth = keys["spent"]
    chat = httpx.post(
        gw.url + "/v1/chat/completions",
        headers=auth,
        json={"model": "fake", "messages": [{"role": "user", "content": "spend it"}], "max_tokens": 4},
        timeout=30,
    )
    assert chat.status_code == 200, chat.text
    refusals = [
        httpx.post(gw.url + "/v1/memory", headers=auth, json={"text": "after"}, timeout=10),
        httpx.get(gw.url + "/v1/memory", headers=auth, timeout=10),
        httpx.get(gw.url + "/v1/threads/thr_x", headers=auth, timeout=10),
        httpx.delete(gw.url + "/v1/threads/thr_x", headers=auth, timeout=10),
    ]
    for r in refusals:
        _assert_limit_refusal(r, "budget_spent")
        assert "budget of key" in r.json()["error"]["message"]
    init = _mcp(gw, auth, INIT)
    assert init.status_code == 429 and "Mcp-Session-Id" not in init.headers
    assert init.json()["error"]["data"]["code"] == "budget_spent"
    assert _stored_notes(gw) == 0


def test_10050_mcp_sessions_opened_by_one_key_end_none_of_another_keys(gw):
    other, busy = _accepted(gw, "quiet"), _accepted(gw, "busy")
    theirs = _mcp(gw, other, INIT)
    assert theirs.status_code == 200, theirs.text

    async def open_many(n: int) -> list[str]:
        sids: list[str] = []
        sem = asyncio.Semaphore(16)
        async with aiohttp.ClientSession(headers={**busy, **MCP_HEADERS}) as s:

            async def one() -> None:
                async with sem, s.post(gw.url + "/v1/mcp", json=INIT) as r:
                    assert r.status == 200, await r.text()
                    sids.append(r.headers["Mcp-Session-Id"])

            await asyncio.gather(*(one() for _ in range(n)))
        return sids

    mine = asyncio.run(open_many(10_050))
    ping = {"jsonrpc": "2.0", "id": 1, "method": "ping"}
    assert _mcp(gw, other, ping, theirs.headers["Mcp-Session-Id"]).status_code == 200
    # The busy key kept its newest sessions, up to its bound (agents.mcp_sessions_per_key, 100).
    assert _mcp(gw, busy, ping, mine[-1]).status_code == 200
    assert _mcp(gw, busy, ping, mine[0]).status_code == 404


def test_a_projects_storage_quota_refuses_notes_and_kept_conversations_naming_it(fake_engine, tmp_path):
    # One process: the quota is counted in the store, inside each write's transaction, which
    # tests/unit/test_store_agents.py shows exact with two stores writing at once.
    _, models = fake_engine
    gw = Gateway(tmp_path, models, workers=1, agents={"quota_items": 3, "quota_bytes": 100_000}).wait_up()
    try:
        _tenancy(gw.store)
        for kind in ("threads", "memory"):
            assert gw.keys(kind, "--project", PROJECT, "--retain-hours", "24").returncode == 0
        auth = _accepted(gw, "writer")
        until(lambda: httpx.get(gw.url + "/v1/memory", headers=auth).status_code == 200, 10, "notes to be kept", [gw])
        first = httpx.post(gw.url + "/v1/memory", headers=auth, json={"text": "x" * 60_000, "title": "y" * 10})
        assert first.status_code == 201  # 60 KB of the 100 KB
        big = httpx.post(gw.url + "/v1/memory", headers=auth, json={"text": "x" * 50_000})
        assert big.status_code == 429 and big.json()["error"]["code"] == "storage_quota_bytes"
        assert "(agents.quota_bytes)" in big.json()["error"]["message"]
        for i in range(2):
            assert httpx.post(gw.url + "/v1/memory", headers=auth, json={"text": f"n{i}"}).status_code == 201
        full = httpx.post(gw.url + "/v1/memory", headers=auth, json={"text": "four"})
        assert full.status_code == 429 and full.json()["error"]["code"] == "storage_quota_items"
        assert "keeps 3 of its 3" in full.json()["error"]["message"]
        # A kept conversation is refused before its model call: the client hears it, nothing is kept.
        turn = httpx.post(
            gw.url + "/v1/chat/completions",
            headers={**auth, "x-llmgw-thread": "new"},
            json={"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            timeout=30,
        )
        assert turn.status_code == 429 and turn.json()["error"]["code"] == "storage_quota_items"
        assert _stored_notes(gw) == 3
        # Deleting a note frees its place.
        note = httpx.get(gw.url + "/v1/memory", headers=auth).json()["data"][0]["id"]
        assert httpx.delete(gw.url + f"/v1/memory/{note}", headers=auth).status_code == 200
        assert httpx.post(gw.url + "/v1/memory", headers=auth, json={"text": "four"}).status_code == 201
    finally:
        assert gw.stop() == 0, gw.text()
