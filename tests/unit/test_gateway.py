"""The gateway in-process in front of fake engines: retries, breaker, timeouts, streaming, usage."""

from __future__ import annotations

import socket

import httpx
import orjson
import pytest

from llmgw.config import parse_server_config
from llmgw.server.app import Server
from llmgw.testing.admin import admin_headers
from llmgw.testing.fake_engine import FakeEngine
from llmgw.testing.waiting import async_until


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Env:
    def __init__(self, server: Server, engines: list[FakeEngine], key: str) -> None:
        self.server = server
        self.engines = engines
        self.key = key
        self.url = f"http://127.0.0.1:{server.config.listen.port}"
        self.admin = f"http://127.0.0.1:{server.config.admin_listen.port}"
        self.http = httpx.AsyncClient(base_url=self.url, headers={"Authorization": f"Bearer {key}"}, timeout=30)
        self.admin_auth = admin_headers(server)

    async def chat(self, model: str = "m", **body) -> httpx.Response:
        return await self.http.post(
            "/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": "hi there"}], **body}
        )

    async def rows(self):
        await self.server.usage.flush()
        return await self.server.store.list_usage(limit=1000)


async def _env(tmp_path, n: int = 2, endpoint_extra: dict | None = None, **overrides):
    engines = [await FakeEngine(tokens=5).start() for _ in range(n)]
    cfg = {
        "listen": f"127.0.0.1:{_port()}",
        "admin_listen": f"127.0.0.1:{_port()}",
        "metrics_listen": None,
        "auth": {"store": str(tmp_path / "gw.db")},
        "router": {"scrape_interval": "100ms", "breaker": {"failures": 2, "cooldown": "30s"}},
        "models": [
            {
                "name": "m",
                "aliases": ["alias"],
                "endpoints": [{"url": e.url, "engine": "llamacpp", **(endpoint_extra or {})} for e in engines],
            }
        ],
    }
    for k, v in overrides.items():
        cfg[k] = {**cfg.get(k, {}), **v} if isinstance(v, dict) else v
    server = Server(parse_server_config(cfg))
    await server.start()
    secret, _ = await server.store.create_key("t", project="proj")
    await server.keys.load()
    return Env(server, engines, secret)


@pytest.fixture
async def env(tmp_path):
    e = await _env(tmp_path)
    yield e
    await e.http.aclose()
    await e.server.stop()
    for fe in e.engines:
        await fe.stop()


async def test_plain_request_usage_and_timing(env):
    r = await env.chat()
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == 5
    timing = r.headers["server-timing"]
    assert timing.startswith("gateway;dur=") and "upstream;dur=" in timing
    (row,) = await env.rows()
    assert (row.project, row.completion_tokens, row.status, row.model, row.served_model) == ("proj", 5, 200, "m", "m")
    assert row.endpoint in {e.url for e in env.engines}


async def test_client_key_is_not_sent_to_the_engine(env):
    await env.chat()
    seen = [r for e in env.engines for r in e.requests if r.path == "/v1/chat/completions"]
    assert seen and all("authorization" not in {k.lower() for k in r.headers} for r in seen)


async def test_retry_on_another_endpoint_before_first_byte(env):
    a, b = env.engines
    a.fail_next(50, 503)
    b.waiting = 5  # b's engine reports a queue, so a is chosen first while it is in
    await async_until(
        lambda: {ep.url: ep.waiting for ep in env.server.endpoints.endpoints}.get(b.url) == 5,
        what="a scrape to see b's queue",
    )
    for _ in range(6):
        r = await env.chat()
        assert r.status_code == 200, r.text
    # Two failures opened a's breaker; after that it was not tried at all.
    assert sum(1 for r in a.requests if r.path.startswith("/v1/")) == 2
    status = {
        s["url"]: s
        for s in (await env.http.get(env.admin + "/api/v1/endpoints", headers=env.admin_auth)).json()["endpoints"]
    }
    assert status[a.url]["breaker_open"] and not status[a.url]["available"]


async def test_connection_dropped_is_retried(env):
    a, b = env.engines
    a.fail_next(1, mode="close")
    b.fail_next(1, mode="close")
    r = await env.chat()
    # Both endpoints dropped the first try; the third attempt (retries: 2) lands on one that answers.
    assert r.status_code == 200, r.text


async def test_all_endpoints_failing_is_502_and_recorded(env):
    for e in env.engines:
        e.fail_next(10, mode="close")
    r = await env.chat()
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "upstream_unavailable"
    rows = await env.rows()
    assert [row.status for row in rows] == [502]


async def test_engine_error_passed_through_not_retried(env):
    a, b = env.engines
    a.fail_next(1, 400, message="bad grammar")
    b.fail_next(1, 400, message="bad grammar")
    r = await env.chat()
    assert r.status_code == 400 and "bad grammar" in r.text
    assert sum(1 for e in env.engines for q in e.requests if q.path.startswith("/v1/")) == 1


async def test_stream_passes_events_and_strips_usage_unless_asked(env):
    async with env.http.stream(
        "POST",
        "/v1/chat/completions",
        json={"model": "alias", "stream": True, "messages": [{"role": "user", "content": "x"}]},
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        body = b"".join([c async for c in r.aiter_raw()])
    events = [e for e in body.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    assert not any(b'"usage":{' in e for e in events)
    sent = [q for e in env.engines for q in e.requests if q.path == "/v1/chat/completions"][-1]
    assert sent.body["stream_options"] == {"include_usage": True}
    assert sent.body["model"] == "m"  # the alias resolved to the catalog name
    (row,) = await env.rows()
    assert row.completion_tokens == 5 and row.stream and row.ttft_ms is not None and row.model == "alias"

    async with env.http.stream(
        "POST",
        "/v1/chat/completions",
        json={
            "model": "m",
            "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "x"}],
        },
    ) as r:
        body = b"".join([c async for c in r.aiter_raw()])
    usage_events = [e for e in body.split(b"\n\n") if b'"usage":{' in e]
    assert len(usage_events) == 1 and orjson.loads(usage_events[0][5:])["choices"] == []


async def test_stream_cut_midway_is_recorded_as_502(env):
    for e in env.engines:
        e.fail_next(1, mode="midstream", after_tokens=2)
    async with env.http.stream(
        "POST",
        "/v1/chat/completions",
        json={"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]},
    ) as r:
        try:
            body = b"".join([c async for c in r.aiter_raw()])
        except httpx.HTTPError:
            body = b""
    assert b"[DONE]" not in body
    rows = await env.rows()
    assert [row.status for row in rows] == [502]


async def test_generation_timeout_is_504(tmp_path):
    env = await _env(tmp_path, n=1, timeouts={"generation": "300ms"})
    try:
        env.engines[0].fail_next(1, mode="hang")
        r = await env.chat()
        assert r.status_code == 504 and "timeouts.generation" in r.json()["error"]["message"]
        assert [row.status for row in await env.rows()] == [504]
    finally:
        await env.http.aclose()
        await env.server.stop()
        await env.engines[0].stop()


async def test_upstream_model_name_is_sent(tmp_path):
    env = await _env(tmp_path, n=1, endpoint_extra={"model": "org/served-name"})
    try:
        r = await env.chat(model="alias")
        assert r.status_code == 200
        assert env.engines[0].requests[-1].body["model"] == "org/served-name"
    finally:
        await env.http.aclose()
        await env.server.stop()
        await env.engines[0].stop()


async def test_load_from_scraped_metrics_steers_traffic(env):
    a, _b = env.engines
    a.waiting = 10  # a's engine reports a queue (say, from another gateway)
    await async_until(
        lambda: {ep.url: ep.waiting for ep in env.server.endpoints.endpoints}.get(a.url) == 10,
        what="a scrape to see a's queue",
    )
    for _ in range(5):
        assert (await env.chat()).status_code == 200
    assert not [q for q in a.requests if q.path.startswith("/v1/")]


async def test_refusals_carry_server_timing(env):
    r = await env.http.post("/v1/chat/completions", content=b"[")
    assert r.status_code == 400 and r.headers["server-timing"].startswith("gateway;dur=")
    r = await env.http.get("/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = await env.http.get("/v1/chat/completions")
    assert r.status_code == 405


async def test_admin_metrics_count_requests_and_show_overhead_load_and_pending_usage(env):
    await env.chat()
    text = (await env.http.get(env.admin + "/metrics", headers=env.admin_auth)).text
    assert 'llmgw_requests_total{model="m",route="chat",status="200"} 1.0' in text
    assert "llmgw_gateway_overhead_seconds_bucket" in text
    assert "llmgw_endpoint_waiting" in text and "llmgw_usage_pending" in text
