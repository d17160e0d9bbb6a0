"""Routing strategies through the real gateway in front of fake engines."""

from __future__ import annotations

import socket

import httpx

from llmgw.config import parse_server_config
from llmgw.server.app import Server
from llmgw.testing.admin import admin_headers
from llmgw.testing.fake_engine import FakeEngine

SYSTEM = "You answer questions about the Acme product catalogue, politely and briefly. " * 30


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _run(tmp_path, routing: dict, bodies: list[dict]):
    engines = [await FakeEngine(tokens=3).start() for _ in range(3)]
    cfg = {
        "listen": f"127.0.0.1:{_port()}",
        "admin_listen": f"127.0.0.1:{_port()}",
        "metrics_listen": None,
        "auth": {"enabled": False, "store": str(tmp_path / "gw.db")},
        "router": {"scrape_interval": "100ms", **routing.get("router", {})},
        "models": [
            {
                "name": "m",
                "endpoints": [{"url": e.url, "engine": "llamacpp"} for e in engines],
                **routing.get("model", {}),
            }
        ],
    }
    server = Server(parse_server_config(cfg))
    await server.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.config.listen.port}", timeout=30) as http:
            for body in bodies:
                r = await http.post("/v1/chat/completions", json={"model": "m", **body})
                assert r.status_code == 200, r.text
            metrics = (
                await http.get(
                    f"http://127.0.0.1:{server.config.admin_listen.port}/metrics", headers=admin_headers(server)
                )
            ).text
        order = [
            (q.body["messages"][-1]["content"], i)
            for i, e in enumerate(engines)
            for q in e.requests
            if q.path == "/v1/chat/completions"
        ]
        return dict(order), metrics
    finally:
        await server.stop()
        for e in engines:
            await e.stop()


def _conv(system: str, turn: int) -> dict:
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": f"question {turn}"}]}


async def test_prefix_keeps_a_shared_system_prompt_on_one_engine(tmp_path):
    bodies = [_conv(SYSTEM, t) for t in range(6)]
    where, metrics = await _run(tmp_path, {}, bodies)
    assert len(set(where.values())) == 1
    assert 'llmgw_router_prefix_hits_total{model="m"} 5.0' in metrics
    assert 'llmgw_router_choices_total{decided_by="prefix",model="m"} 5.0' in metrics


async def test_model_round_robin_overrides_router_default(tmp_path):
    bodies = [_conv(SYSTEM, t) for t in range(6)]
    where, _ = await _run(tmp_path, {"model": {"routing": "round_robin"}}, bodies)
    seq = [where[f"question {t}"] for t in range(6)]
    assert seq[:3] == seq[3:] and sorted(seq[:3]) == [0, 1, 2]


async def test_least_loaded_spreads_a_shared_prompt(tmp_path):
    bodies = [_conv(SYSTEM, t) for t in range(30)]
    where, metrics = await _run(tmp_path, {"router": {"routing": "least_loaded"}}, bodies)
    assert len(set(where.values())) > 1  # idle ties go to chance, not to the cache
    assert 'prefix_hits_total{model="m"}' not in metrics
    assert 'llmgw_router_choices_total{decided_by="least_loaded",model="m"} 30.0' in metrics
