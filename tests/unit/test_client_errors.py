"""What an API client reads when an engine fails is about its request: never an engine's
address, a node's name or a mirror's URL (operators find those in the log and in ctl)."""

from __future__ import annotations

import logging

import httpx
import pytest

from llmgw.config import parse_server_config
from llmgw.server.app import Server
from llmgw.testing.fake_engine import FakeEngine
from llmgw.testing.ports import free_port as _port


@pytest.fixture
async def one_engine(tmp_path):
    engine = await FakeEngine(tokens=3).start()
    cfg = parse_server_config(
        {
            "listen": f"127.0.0.1:{_port()}",
            "admin_listen": f"127.0.0.1:{_port()}",
            "metrics_listen": None,
            "auth": {"enabled": False, "store": str(tmp_path / "gw.db")},
            "router": {"retries": 0, "breaker": {"failures": 100}},
            "models": [{"name": "m", "endpoints": [{"url": engine.url, "engine": "llamacpp"}]}],
        }
    )
    server = Server(cfg)
    await server.start()
    yield server, engine
    await server.stop()
    await engine.stop()


@pytest.mark.parametrize("mode", ["close", "status", "midstream"])
async def test_an_engine_failure_reaches_the_client_without_the_engines_address(one_engine, mode, caplog):
    server, engine = one_engine
    engine.fail_next(1, 502, mode=mode, message=f"upstream {engine.url} node gpu-7 exploded")
    caplog.set_level(logging.WARNING, "llmgw.gateway")
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.config.listen.port}") as http:
        r = await http.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 502, r.text
    message = r.json()["error"]["message"]
    assert "127.0.0.1" not in message and str(engine.port) not in message and "gpu-7" not in message, message
    assert "engine" in message
    # The operator's log has the address.
    assert engine.url in caplog.text
