"""Limits, budgets and admission through the real gateway, in front of fake engines.

Exactness under load: 500 concurrent requests at a key limited to 100 a minute
admit exactly 100; a burst on a small budget overspends it by at most one
request's estimate; settled spend equals the sum of the usage rows; streams cut
by the client or the engine are charged what passed through.
"""

from __future__ import annotations

import asyncio
import socket

import httpx
import orjson
import pytest

from llmgw.config import parse_server_config
from llmgw.server.app import Server
from llmgw.server.gateway.proxy import _estimate
from llmgw.testing.admin import admin_headers
from llmgw.testing.fake_engine import FakeEngine, chat_prompt_tokens
from llmgw.testing.waiting import async_until


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _server(tmp_path, engines: list[FakeEngine], **overrides) -> Server:
    cfg = {
        "listen": f"127.0.0.1:{_port()}",
        "admin_listen": f"127.0.0.1:{_port()}",
        "metrics_listen": None,
        "auth": {"store": str(tmp_path / "gw.db"), "pricing": {"m": {"prompt_per_1k": 1.0, "completion_per_1k": 2.0}}},
        "router": {"scrape_interval": "100ms"},
        "models": [
            {"name": "m", "endpoints": [{"url": e.url, "engine": "llamacpp"} for e in engines]},
            {"name": "free", "endpoints": [{"url": e.url, "engine": "llamacpp", "model": "m"} for e in engines]},
        ],
    }
    for k, v in overrides.items():
        cfg[k] = {**cfg.get(k, {}), **v} if isinstance(v, dict) else v
    server = Server(parse_server_config(cfg))
    await server.start()
    return server


@pytest.fixture
async def fleet(tmp_path):
    engines = [await FakeEngine(tokens=5).start() for _ in range(2)]
    server = await _server(tmp_path, engines)
    store = server.store
    await store.add_org("Acme")
    await store.add_team("platform", "Acme")
    await store.add_project("gateway", "Acme/platform")
    issued = await store.issue_key("load", project="Acme/platform/gateway")
    server.test_dir = tmp_path
    yield server, engines, issued
    await server.stop()
    for e in engines:
        await e.stop()


def _client(server: Server, secret: str) -> httpx.AsyncClient:
    # All 500 are sent at once; at most 100 connections keep the listen backlog (128) from
    # overflowing on a small machine, which resets connections instead of answering.
    limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
    return httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{server.config.listen.port}",
        timeout=60,
        limits=limits,
        headers={"Authorization": f"Bearer {secret}"},
    )


def _chat(model: str = "m") -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 5}


async def test_500_concurrent_requests_at_100_a_minute_admit_exactly_100(fleet):
    server, engines, issued = fleet
    await server.store.set_limits("key", issued.key.id, rpm=100)
    await server.keys.load()
    async with _client(server, issued.secret) as http:
        replies = await asyncio.gather(*(http.post("/v1/chat/completions", json=_chat()) for _ in range(500)))
    codes = [r.status_code for r in replies]
    assert codes.count(200) == 100 and codes.count(429) == 400
    refused = next(r for r in replies if r.status_code == 429)
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.headers["x-ratelimit-limit-requests"] == "100"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert "the request rate of key" in refused.json()["error"]["message"]
    ok = next(r for r in replies if r.status_code == 200)
    assert ok.headers["x-ratelimit-limit-requests"] == "100"
    assert sum(e.requests_total for e in engines) == 100
    # A stream carries them too, in the headers that leave before its first event.
    async with _client(server, issued.secret) as http:
        streamed = await http.post("/v1/chat/completions", json={**_chat(), "stream": True})
    assert streamed.status_code == 429  # the minute's 100 are spent
    await server.store.set_limits("key", issued.key.id, rpm=1000)
    await server.keys.load()
    async with _client(server, issued.secret) as http:
        streamed = await http.post("/v1/chat/completions", json={**_chat(), "stream": True})
    assert streamed.status_code == 200 and streamed.headers["x-ratelimit-limit-requests"] == "1000"
    assert streamed.headers["x-ratelimit-remaining-requests"] == "899"


async def _rows(server: Server):
    await server.usage.flush()
    return await server.store.list_usage(limit=10_000)


async def test_concurrent_settlement_leaves_every_pool_equal_to_its_usage_rows(fleet):
    server, engines, issued = fleet
    user = await server.store.create_user("ann@example.com", "correct horse")
    await server.store.join(user.id, "team", "Acme/platform")
    own = await server.store.issue_key("ann", project="Acme/platform/gateway", owner=user.id)
    await server.store.set_limits("org", "Acme", budget_micros=10**12)
    await server.store.set_limits("team", "Acme/platform", tpm=10**7)
    await server.store.set_limits("project", "Acme/platform/gateway", per_member=True, rpm=10**6)
    await server.store.set_limits("user", user.id, budget_micros=10**12, period="day")
    await server.keys.load()
    async with _client(server, issued.secret) as a, _client(server, own.secret) as b:
        await asyncio.gather(*(c.post("/v1/chat/completions", json=_chat()) for c in [a, b] * 150))
    rows = await _rows(server)
    acct = server.gateway.accountant
    principal_b = server.keys.authenticate(f"Bearer {own.secret}")
    org = principal_b.org_id
    assert acct.spent(f"org:{org}") == sum(r.cost_micros for r in rows if r.org_id == org) > 0
    assert acct.spent(f"user:{user.id}", "day") == sum(r.cost_micros for r in rows if r.user_id == user.id) > 0
    assert all(r.project_id == issued.key.project_id and r.team_id == principal_b.team_id for r in rows)
    # A restart restores the budgets from those rows.
    spent_before = acct.spent(f"org:{org}")
    await server.stop()
    again = await _server(server.test_dir, engines)
    try:
        assert again.gateway.accountant.spent(f"org:{org}") == spent_before
        assert again.gateway.accountant.spent(f"user:{user.id}", "day") == acct.spent(f"user:{user.id}", "day")
    finally:
        await again.stop()
        await server.start()  # the fixture stops it again


async def test_a_key_may_use_only_its_allowed_models(fleet):
    server, _engines, issued = fleet
    await server.store.set_limits("team", "Acme/platform", models=["m"])
    await server.keys.load()
    async with _client(server, issued.secret) as http:
        assert (await http.post("/v1/chat/completions", json=_chat("m"))).status_code == 200
        r = await http.post("/v1/chat/completions", json=_chat("free"))
    assert r.status_code == 403 and "may not use free" in r.json()["error"]["message"]


async def test_saturated_pool_queues_then_sheds_with_retry_after(tmp_path):
    engines = [await FakeEngine(tokens=5).start()]
    server = await _server(tmp_path, engines, admission={"queue_timeout": "300ms", "healthy_waiting": 1})
    try:
        issued = await server.store.create_key("k")
        secret = issued[0]
        await server.keys.load()
        # The engine reports a long queue: the pool is saturated, requests wait and time out.
        engines[0].waiting = 50
        await async_until(lambda: server.gateway.admission.saturation("m") >= 1.0, what="a scrape to see the queue")
        async with _client(server, secret) as http:
            r = await http.post("/v1/chat/completions", json=_chat())
        assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded"
        assert int(r.headers["retry-after"]) >= 1
        async with httpx.AsyncClient(headers=admin_headers(server)) as plain:
            metrics = (await plain.get(f"http://127.0.0.1:{server.config.admin_listen.port}/metrics")).text
        assert 'llmgw_admission_rejected_total{band="normal"} 1.0' in metrics
        # A client may yield to a lower band, never climb above its key's.
        async with _client(server, secret) as http:
            for band in ("high", "low"):
                r = await http.post("/v1/chat/completions", json=_chat(), headers={"X-Llmgw-Band": band})
                assert r.status_code == 503
        async with httpx.AsyncClient(headers=admin_headers(server)) as plain:
            metrics = (await plain.get(f"http://127.0.0.1:{server.config.admin_listen.port}/metrics")).text
        assert 'llmgw_admission_rejected_total{band="normal"} 2.0' in metrics
        assert 'llmgw_admission_rejected_total{band="low"} 1.0' in metrics
        assert 'llmgw_admission_rejected_total{band="high"} 0.0' in metrics
        assert 'llmgw_pool_saturation{model="m"}' in metrics
        engines[0].waiting = 0
        await async_until(lambda: server.gateway.admission.saturation("m") < 1.0, what="a scrape to see the queue gone")
        async with _client(server, secret) as http:
            assert (await http.post("/v1/chat/completions", json=_chat())).status_code == 200
    finally:
        await server.stop()
        for e in engines:
            await e.stop()


async def test_a_claim_link_shows_its_key_once(fleet):
    server, _engines, _ = fleet
    issued = await server.store.issue_key("for-ann", project="Acme/platform/gateway", claim=True)
    assert issued.claim_token
    base = f"http://127.0.0.1:{server.config.listen.port}"
    async with httpx.AsyncClient(base_url=base) as http:
        # Opening the link (as a chat tool's preview would) spends nothing.
        page = await http.get(f"/claim/{issued.claim_token}")
        assert page.status_code == 200 and "Show my key" in page.text and page.headers["cache-control"] == "no-store"
        r = await http.post(f"/claim/{issued.claim_token}", headers={"Accept": "application/json"})
        assert r.status_code == 200
        secret = r.json()["key"]
        await server.keys.load()
        ok = await http.post("/v1/chat/completions", json=_chat(), headers={"Authorization": f"Bearer {secret}"})
        assert ok.status_code == 200
        again = await http.post(f"/claim/{issued.claim_token}")
        assert again.status_code == 410 and "it works once" in again.text and secret not in again.text
        assert (await http.post("/claim/not-a-token")).status_code == 404


async def test_a_burst_on_a_small_budget_overspends_at_most_one_estimate(fleet):
    server, engines, issued = fleet
    budget = 100_000  # 0.10: about five requests of ~0.02 each
    await server.store.set_limits("project", "Acme/platform/gateway", budget_micros=budget, period="day")
    await server.keys.load()
    acct = server.gateway.accountant
    pool = f"project:{issued.key.project_id}"
    raw = orjson.dumps(_chat())
    # What the gateway holds for each request: its prompt guess and max_tokens, priced.
    estimate = acct.pricing.cost_micros("m", *_estimate(raw, 5, server.gateway.models["m"]))
    headers = {"Content-Type": "application/json"}
    codes: list[str] = []
    async with _client(server, issued.secret) as http:
        for _ in range(10):
            # Everything at once: without a hold on the budget, all 300 would be served.
            replies = await asyncio.gather(
                *(http.post("/v1/chat/completions", content=raw, headers=headers) for _ in range(300))
            )
            codes += [(r.status_code == 200 and "ok") or r.json()["error"]["code"] for r in replies]
            if "budget_spent" in codes:
                break
        held = next(r for r in replies if r.status_code == 429)
        # A model priced at nothing is still served with the budget spent.
        assert (await http.post("/v1/chat/completions", json=_chat("free"))).status_code == 200
    assert "budget_spent" in codes and "budget_held" in codes
    spent = acct.spent(pool, "day")
    rows = [r for r in await _rows(server) if r.status == 200 and r.model == "m"]
    assert len(rows) == codes.count("ok") and spent == sum(r.cost_micros for r in rows)
    # The last request admitted under the budget may cross it, by no more than what it was held at.
    assert budget <= spent <= budget + estimate
    assert acct.held(pool) == 0  # every hold released
    assert sum(e.requests_total for e in engines) == len(rows) + 1
    msg = held.json()["error"]["message"]
    assert "budget of project" in msg and ("spent for this day" in msg or "requests in progress" in msg)


async def test_50_streams_cut_at_99_percent_are_charged_what_the_engine_generated(fleet):
    server, engines, issued = fleet
    for e in engines:
        e.tokens, e.token_ms = 100, 1.0  # 100 events a stream, one a token, paced as an engine would
        # Token 100 is still being made when the client cuts at 99 (unstalled, a loaded machine's
        # client lags so far behind that the engine has finished and counted before it cuts).
        e.fail_next(50, mode="stall", after_tokens=99)
    await server.store.set_limits("key", issued.key.id, tpm=10**8)
    await server.store.set_limits("project", "Acme/platform/gateway", budget_micros=10**12)
    await server.keys.load()
    acct = server.gateway.accountant
    principal = server.keys.authenticate(f"Bearer {issued.secret}")
    messages = [{"role": "user", "content": "a long enough prompt " * 100}]
    body = {"model": "m", "messages": messages, "max_tokens": 100, "stream": True}

    async def cut(http: httpx.AsyncClient) -> int:
        got = 0
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if '"content":"' in line and '"content":""' not in line:
                    got += 1
                    if got == 99:
                        break  # leaving the block closes the connection: the client is gone
        return got

    async with _client(server, issued.secret) as http:
        received = await asyncio.gather(*(cut(http) for _ in range(50)))
        assert received == [99] * 50
        # And engines that die mid-stream: charged the 30 tokens that passed.
        for e in engines:
            e.clear_faults()
            e.fail_next(4, mode="midstream", after_tokens=30)
        for _ in range(4):
            async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                with pytest.raises(httpx.HTTPError):
                    async for _ in r.aiter_raw():
                        pass

    async def all_rows():  # a cut stream is recorded as soon as the gateway sees its client gone
        rows = await _rows(server)
        return rows if len(rows) >= 54 else None

    rows = await async_until(all_rows, 10, "the usage rows of the 50 cut and 4 died streams")
    cut_rows = [r for r in rows if r.status == 499]
    died = [r for r in rows if r.status == 502]
    assert len(cut_rows) == 50 and len(died) == 4
    assert [r.completion_tokens for r in died] == [30] * 4
    generated = sum(e.tokens_generated for e in engines) - 4 * 30
    charged = sum(r.completion_tokens for r in cut_rows)
    assert all(r.completion_tokens >= 99 for r in cut_rows)
    assert abs(charged - generated) <= 0.1 * generated, (charged, generated)
    # The token pool was charged the same, prompts as estimated (the engine's own count is near).
    prompt_truth = chat_prompt_tokens(messages)
    assert all(abs(r.prompt_tokens - prompt_truth) <= 0.1 * prompt_truth for r in rows)
    tpm_charged = 10**8 - acct.status(principal).tokens_remaining
    truth = generated + 30 * 4 + prompt_truth * 54
    assert abs(tpm_charged - truth) <= 0.1 * truth, (tpm_charged, truth)
    spent = acct.spent(f"project:{issued.key.project_id}")
    assert spent == sum(r.cost_micros for r in rows)
    true_cost = acct.pricing.cost_micros("m", prompt_truth * 54, generated + 30 * 4)
    assert abs(spent - true_cost) <= 0.1 * true_cost


async def test_a_key_with_no_limit_anywhere_still_has_its_use_priced_in_its_usage_rows(fleet):
    server, _, issued = fleet
    # No limit on the key, its project, team or organization: nothing is reserved for it.
    await server.keys.load()
    async with _client(server, issued.secret) as http:
        assert (await http.post("/v1/chat/completions", json=_chat())).status_code == 200
        assert (await http.post("/v1/chat/completions", json=_chat("free"))).status_code == 200
    rows = await _rows(server)
    priced = {r.model: r.cost_micros for r in rows}
    want = server.gateway.accountant.pricing.cost_micros("m", rows[0].prompt_tokens, rows[0].completion_tokens)
    assert priced["m"] == want > 0
    assert priced["free"] == 0  # served by the same engine, but the model asked for has no price
