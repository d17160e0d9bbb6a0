"""Readiness: /health first, then /v1/models must list the served name."""

from __future__ import annotations

import json
import socket
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from llmgw.agent.engines import HealthCheck, listed_models, lists_model, probe, probe_host

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "engines"


def test_llama_server_models_answer_lists_its_alias():
    payload = json.loads((FIX / "llama-server-v1-models.json").read_text())
    assert listed_models(payload) == ["tiny"]
    assert lists_model(payload, "tiny") and not lists_model(payload, "other")


def test_openai_shaped_answers_and_junk():
    vllm = {"object": "list", "data": [{"id": "llama-70b", "object": "model", "owned_by": "vllm", "root": "/m"}]}
    assert listed_models(vllm) == ["llama-70b"]
    assert listed_models([]) == [] and listed_models({"data": "x"}) == [] and listed_models(None) == []


def test_wildcard_binds_are_probed_on_loopback():
    assert probe_host("0.0.0.0") == "127.0.0.1"
    assert probe_host("::") == "::1"
    assert probe_host("10.0.0.5") == "10.0.0.5"
    assert HealthCheck("::1", 8000, "m").url("/health") == "http://[::1]:8000/health"


class Engine:
    def __init__(self):
        self.health = 503
        self.models: list[str] = []

    def app(self) -> web.Application:
        app = web.Application()

        async def health(_):
            return web.json_response({"status": "loading"}, status=self.health)

        async def models(_):
            return web.json_response({"object": "list", "data": [{"id": m} for m in self.models]})

        app.router.add_get("/health", health)
        app.router.add_get("/v1/models", models)
        return app


@asynccontextmanager
async def serving(app: web.Application):
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    finally:
        await runner.cleanup()


async def test_states_follow_the_two_questions():
    engine = Engine()
    async with serving(engine.app()) as port:
        check = HealthCheck("127.0.0.1", port, "llama-70b")
        async with aiohttp.ClientSession() as session:
            r = await probe(check, session)
            assert (r.state, r.detail) == ("loading", "/health answered 503")
            engine.health = 200
            r = await probe(check, session)
            assert (r.state, r.detail) == ("loading", "/v1/models does not list llama-70b yet (it lists: nothing)")
            engine.models = ["other"]
            assert (await probe(check, session)).detail == "/v1/models does not list llama-70b yet (it lists: other)"
            engine.models = ["llama-70b"]
            r = await probe(check, session)
            assert r.ready and r.detail == "llama-70b is listed"


async def test_nothing_listening_is_starting():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with aiohttp.ClientSession() as session:
        r = await probe(HealthCheck("127.0.0.1", port, "m"), session, timeout=2)
    assert r.state == "starting" and r.detail == f"nothing answers on 127.0.0.1:{port} yet"
    assert not r.ready


@pytest.mark.parametrize("status", [500, 404])
async def test_models_route_failing_is_still_loading(status: int):
    async def health(_):
        return web.json_response({})

    async def models(_):
        return web.Response(status=status)

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    async with serving(app) as port, aiohttp.ClientSession() as session:
        r = await probe(HealthCheck("127.0.0.1", port, "m"), session)
    assert (r.state, r.detail) == ("loading", f"/v1/models answered {status}")
