"""A burst that arrives between two scrapes of the engine's metrics is held in the gateway's
queue, not piled into the engine's: the gateway counts its own requests in flight."""

from __future__ import annotations

import asyncio

import httpx

from llmgw.config import parse_server_config
from llmgw.server.app import Server
from llmgw.server.gateway.admission import pool_saturation
from llmgw.server.gateway.endpoints import Endpoint, EndpointSet
from llmgw.testing.fake_engine import FakeEngine
from llmgw.testing.ports import free_port as _port


def test_fresh_metrics_showing_an_idle_engine_do_not_hide_the_gateways_own_burst():
    now = 100.0
    ep = Endpoint("m", "http://e", "llamacpp", None)
    ep.healthy = True
    ep.apply_scrape("llamacpp:requests_processing 2\nllamacpp:requests_deferred 0\n", now - 0.5)
    ep.apply_scrape("llamacpp:requests_processing 0\nllamacpp:requests_deferred 0\n", now)
    assert ep.slots_seen == 2  # the most it was seen running at once
    eps = EndpointSet([ep], 1.0, 10.0, 1.0)
    ep.inflight = 6  # sent since the scrape that said "idle"
    assert pool_saturation(eps, "m", 8, 0.9, now=now) == 4 / 8
    ep.inflight = 100  # a burst: 98 of them must be waiting inside the engine
    assert pool_saturation(eps, "m", 8, 0.9, now=now) == 98 / 8


async def test_a_burst_of_100_at_an_engine_with_2_slots_queues_in_the_gateway(tmp_path):
    engine = await FakeEngine(tokens=2, ttft_ms=20, slots=2).start()
    cfg = parse_server_config(
        {
            "listen": f"127.0.0.1:{_port()}",
            "admin_listen": f"127.0.0.1:{_port()}",
            "metrics_listen": None,
            "auth": {"enabled": False, "store": str(tmp_path / "gw.db")},
            "router": {"scrape_interval": "1s"},
            "admission": {"healthy_waiting": 8, "queue_timeout": "60s"},
            "models": [{"name": "m", "endpoints": [{"url": engine.url, "engine": "llamacpp"}]}],
        }
    )
    server = Server(cfg)
    await server.start()
    try:
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{cfg.listen.port}", timeout=120, limits=limits
        ) as http:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            replies = await asyncio.gather(*(http.post("/v1/chat/completions", json=body) for _ in range(100)))
        assert [r.status_code for r in replies].count(200) == 100
        # Without the gateway's own count the engine's queue reached 98 (issue 10): now it holds
        # what admission calls healthy (8), plus what the engine's last scrape may not show yet:
        # admission reads the engine's queue from that scrape and adds its own sends since, so
        # on a loaded machine a slow scrape lets a few more through (14 seen once). Far from 98.
        assert engine.peak_waiting <= 20, engine.peak_waiting
    finally:
        await server.stop()
        await engine.stop()
