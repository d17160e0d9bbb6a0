"""Waking an on-demand model from the chat page (/chat/wake, /chat/model-status) against a real in-process
control plane, with a fake agent on the real agent stream whose shard moves only when the test says so:
waiting for a node, downloading, starting, ready (a fake engine then answers on the shard's port), or
failed; the refusals (an unknown model, one scaled to nothing, one the person may not use, a project
they are not in, no CSRF token); and a gateway without a control plane, whose models are always loaded."""

from __future__ import annotations

import re

import aiohttp
import httpx
import orjson
import pytest

from llmgw.config.server import parse_server_config
from llmgw.protocol import Ack, FetchProgress, ShardState, ShardStatus, StartShard, decode, encode
from llmgw.server.app import Server
from llmgw.testing.admin import admin_headers
from llmgw.testing.fake_engine import FakeEngine
from llmgw.testing.ports import free_port as _port
from llmgw.testing.waiting import async_until
from tests.unit.test_pages import PASSWORD, active_person, base, sign_in
from tests.unit.test_pages_admin import ADMIN, FakeAgent

MiB = 2**20


class StagedAgent(FakeAgent):
    """The Cluster page's fake agent (registers, beats), whose shards stay pending until the test reports
    each state; on READY a fake engine answers on the shard's port with the replica's key."""

    def __init__(self, srv: Server) -> None:
        super().__init__(srv)
        self.engine: FakeEngine | None = None

    async def _read(self) -> None:
        async for frame in self.ws:
            if frame.type not in (aiohttp.WSMsgType.BINARY, aiohttp.WSMsgType.TEXT):
                continue
            msg = decode(frame.data, sender="control")
            if isinstance(msg, StartShard):
                self.started.append(msg)
            if msg.id:
                await self.ws.send_bytes(encode(Ack(id=msg.id, ok=True)))

    async def report(self, state: ShardState, fetch: FetchProgress | None = None, reason: str | None = None) -> None:
        shard = self.started[-1]
        if state is ShardState.READY and self.engine is None:
            assert shard.http_port is not None
            self.engine = await FakeEngine(
                port=shard.http_port, model=shard.model or "tiny", tokens=6, api_key=shard.api_key
            ).start()
        status = ShardStatus(
            shard_id=shard.shard_id, replica_id=shard.replica_id, state=state, fetch=fetch, reason=reason, pid=4242
        )
        await self.ws.send_bytes(encode(status))

    async def stop(self) -> None:
        await super().stop()
        if self.engine is not None:
            await self.engine.stop()


def _config(tmp_path, engine_url: str, control: bool):
    models: list[dict] = [{"name": "m", "endpoints": [{"url": engine_url, "engine": "llamacpp"}]}]
    if control:
        models += [
            {
                "name": "tiny",
                "aliases": ["tiny-alias"],
                "source": str(tmp_path / "tiny.gguf"),
                "scaling": {"min": 0, "max": 1, "idle_timeout": "10m"},
                "max_output": 64,
                "profiles": [{"engine": "llamacpp"}],
            },
            {
                "name": "off",
                "source": str(tmp_path / "tiny.gguf"),
                "scaling": {"min": 0, "max": 0},
                "profiles": [{"engine": "llamacpp"}],
            },
        ]
    return parse_server_config(
        {
            "listen": f"127.0.0.1:{_port()}",
            "admin_listen": f"127.0.0.1:{_port()}",
            "metrics_listen": None,
            "agent_listen": f"127.0.0.1:{_port()}",
            "agent_tls": None,
            "control": {
                "enabled": control,
                "unreachable_after": "1s",
                "lost_after": "60s",
                "interval": "200ms",
                # A failed start is tried again only after the test has read the failure.
                "base_backoff": "10m",
                "max_backoff": "10m",
            },
            "auth": {"store": str(tmp_path / "gw.db")},
            "data_dir": str(tmp_path),
            "models": models,
        }
    )


@pytest.fixture
async def control(tmp_path):
    """A control plane with no node yet: the test starts the agent when it wants one."""
    (tmp_path / "tiny.gguf").write_bytes(b"GGUF")
    engine = await FakeEngine(model="m", tokens=6).start()
    srv = Server(_config(tmp_path, engine.url, control=True))
    await srv.start()
    agents: list[StagedAgent] = []

    async def agent() -> StagedAgent:
        agents.append(await StagedAgent(srv).start())
        return agents[-1]

    try:
        yield srv, agent
    finally:
        for a in agents:
            await a.stop()
        await srv.stop()
        await engine.stop()


@pytest.fixture
async def plain(tmp_path):
    engine = await FakeEngine(model="m", tokens=6).start()
    srv = Server(_config(tmp_path, engine.url, control=False))
    await srv.start()
    try:
        yield srv
    finally:
        await srv.stop()
        await engine.stop()


class Browser:
    """A signed-in person's side of the chat page: its CSRF token, wake, status and send."""

    def __init__(self, http: httpx.AsyncClient, csrf: str) -> None:
        self.http, self.csrf = http, csrf

    @classmethod
    async def signed_in(cls, http: httpx.AsyncClient, email: str) -> Browser:
        assert (await sign_in(http, email)).status_code == 303
        page = (await http.get("/chat")).text
        return cls(http, re.search(r'name="llmgw-csrf" content="([^"]+)"', page).group(1))

    async def wake(self, model: str, project: str | None = None) -> httpx.Response:
        return await self.http.post(
            "/chat/wake", json={"model": model, "project": project}, headers={"X-CSRF-Token": self.csrf}
        )

    async def status(self, model: str, project: str = "") -> httpx.Response:
        return await self.http.get("/chat/model-status", params={"model": model, "project": project})

    async def state(self, model: str = "tiny") -> dict:
        r = await self.status(model)
        assert r.status_code == 200, r.text
        return r.json()

    async def until_state(self, want: str, what: str, model: str = "tiny", **fields: object) -> dict:
        """The model's status once it is in state ``want`` with these field values."""
        seen: dict = {}

        async def reached() -> bool:
            seen.update(await self.state(model))
            return seen["state"] == want and all(seen[k] == v for k, v in fields.items())

        await async_until(reached, 20, what)
        return seen


def _target(srv: Server, model: str = "tiny") -> int | None:
    """The replicas the control plane wants for the model, as `llmgw ctl models` shows it."""
    return srv.reconciler.model_status(model)["target"]


async def test_waking_an_on_demand_model_starts_it_and_its_status_moves_through_waiting_downloading_and_starting_to_ready(
    control,
):
    srv, start_agent = control
    await active_person(srv)
    await srv.store.create_user(ADMIN, PASSWORD, admin=True)
    async with httpx.AsyncClient(base_url=base(srv)) as http, httpx.AsyncClient(base_url=base(srv)) as admin_http:
        ann = await Browser.signed_in(http, "ann@example.com")
        root = await Browser.signed_in(admin_http, ADMIN)
        page = (await http.get("/chat")).text
        assert 'value="tiny" data-on-demand="yes"' in page and 'value="off"' not in page

        # Not asked for yet: nothing is placed, and the status says a message loads it.
        before = await ann.state()
        assert before["state"] == "waiting for a node" and "sending a message loads it" in before["reason"]
        assert _target(srv) == 0 and not srv.reconciler.replicas

        # Wake answers at once, and the control plane now wants a replica: what a first request does.
        r = await ann.wake("tiny")
        assert r.status_code == 200 and r.json()["state"] == "waiting for a node" and r.json()["model"] == "tiny"
        assert _target(srv) == 1

        # No node can take it: the person reads that in words naming the command; an administrator, the reason.
        await async_until(lambda: srv.reconciler.problems.get("tiny"), 20, "tiny's placement to be refused")
        waiting = await ann.state()
        assert waiting["state"] == "waiting for a node"
        assert (
            "no node can take it now" in waiting["reason"] and "llmgw ctl explain-placement tiny" in waiting["reason"]
        )
        assert waiting["message"] == f"Waiting for a node to run tiny: {waiting['reason']}"
        assert (await root.state())["reason"] == srv.reconciler.problems["tiny"]

        # A node joins; the shard is placed, and is starting until the agent says more.
        agent = await start_agent()
        await async_until(lambda: agent.started, 20, "the control plane to start a shard of tiny")
        starting = await ann.until_state("starting", "the placed replica to show as starting")
        assert starting["message"] == "Starting the engine for tiny…" and starting["bytes_done"] is None

        # Its weights download: bytes and percent, from the same rows `llmgw ctl replicas` shows.
        await agent.report(ShardState.PENDING, FetchProgress(source="x", bytes_done=300 * MiB, bytes_total=1200 * MiB))
        down = await ann.until_state("downloading", "the download to show")
        assert (down["bytes_done"], down["bytes_total"], down["percent"]) == (300 * MiB, 1200 * MiB, 25.0)
        assert down["message"] == "Downloading tiny's weights: 300 MiB of 1.2 GiB (25%)"
        async with httpx.AsyncClient(headers=admin_headers(srv)) as api:
            r = await api.get(f"http://127.0.0.1:{srv.config.admin_listen.port}/api/v1/replicas")
        assert r.json()["replicas"][0]["shards"][0]["fetch"]["bytes_done"] == 300 * MiB
        await agent.report(ShardState.PENDING, FetchProgress(source="x", bytes_done=700 * MiB))
        unknown = await ann.until_state("downloading", "a download of unknown length", bytes_done=700 * MiB)
        assert unknown["bytes_total"] is None and unknown["percent"] is None
        assert unknown["message"] == "Downloading tiny's weights: 700 MiB so far"

        # The engine starts, loads, and serves.
        await agent.report(ShardState.STARTING)
        assert (await ann.until_state("starting", "the engine to be starting"))["bytes_done"] is None
        await agent.report(ShardState.LOADING)
        await agent.report(ShardState.READY)
        ready = await ann.until_state("ready", "the replica to be ready")
        assert ready["message"] == "tiny is loaded." and ready["reason"] is None
        assert (await ann.wake("tiny-alias")).json()["state"] == "ready"  # an alias names the same model

        # The message goes through the gateway to the replica's engine, as the person.
        r = await http.post(
            "/chat/send",
            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
            headers={"X-CSRF-Token": ann.csrf},
        )
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [orjson.loads(x[5:]) for x in r.text.splitlines() if x.startswith("data:") and "[DONE]" not in x]
        assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))
        assert agent.engine is not None and agent.engine.requests
        assert agent.engine.requests[-1].body["max_tokens"] == 64  # the page's 4096, lowered to max_output


async def test_a_model_whose_engine_fails_shows_the_failure_in_words_for_a_person_and_in_full_for_an_administrator(
    control,
):
    srv, start_agent = control
    await active_person(srv)
    await srv.store.create_user(ADMIN, PASSWORD, admin=True)
    agent = await start_agent()
    async with httpx.AsyncClient(base_url=base(srv)) as http, httpx.AsyncClient(base_url=base(srv)) as admin_http:
        ann = await Browser.signed_in(http, "ann@example.com")
        root = await Browser.signed_in(admin_http, ADMIN)
        assert (await ann.wake("tiny")).status_code == 200
        await async_until(lambda: agent.started, 20, "the control plane to start a shard of tiny")
        await agent.report(ShardState.FAILED, reason="llama-server exited with status 1")
        failed = await ann.until_state("failed", "the failure to show")
        assert "its engine did not start" in failed["reason"] and "llmgw ctl replicas tiny" in failed["reason"]
        assert "the next try is in" in failed["reason"] and "llama-server" not in failed["reason"]
        assert failed["message"] == f"tiny could not be started: {failed['reason']}"
        full = await root.state()
        assert full["state"] == "failed" and "llama-server exited with status 1" in full["reason"]


async def test_an_unknown_model_one_scaled_to_nothing_or_one_the_person_may_not_use_is_refused_and_nothing_is_woken(
    control,
):
    srv, _ = control
    ann = await active_person(srv)
    async with httpx.AsyncClient(base_url=base(srv)) as http:
        browser = await Browser.signed_in(http, "ann@example.com")
        for model in ("ghost", "off", "<script>"):
            r = await browser.wake(model)
            assert r.status_code == 404 and "choose one from the list" in r.json()["error"]["message"], model
            assert (await browser.status(model)).status_code == 404, model
        assert (await browser.wake("")).status_code == 400
        assert (await browser.wake("tiny", project="prj-nope")).status_code == 403
        assert (await browser.status("tiny", project="prj-nope")).status_code == 403
        # Without the session's token (or from another site) a wake is refused before it is read.
        r = await http.post("/chat/wake", json={"model": "tiny"})
        assert r.status_code == 403 and "security token" in r.json()["error"]["message"]
        r = await http.post(
            "/chat/wake",
            json={"model": "tiny"},
            headers={"X-CSRF-Token": browser.csrf, "Origin": "https://evil.example"},
        )
        assert r.status_code == 403
        # A person held to other models may neither wake tiny nor read its state.
        await srv.store.set_limits("user", ann.id, models=["m"])
        r = await browser.wake("tiny")
        assert r.status_code == 403 and r.json()["error"]["message"] == "you may not use tiny here; you may use: m"
        assert (await browser.status("tiny")).status_code == 403
        assert (await browser.status("m")).json()["state"] == "ready"
    assert _target(srv) == 0 and not srv.reconciler.replicas
    async with httpx.AsyncClient(base_url=base(srv)) as http:
        r = await http.post("/chat/wake", json={"model": "tiny"})
        assert r.status_code == 401  # no session at all
        r = await http.get("/chat/model-status", params={"model": "tiny"})
        assert r.status_code == 303 and r.headers["location"].startswith("/login")


async def test_a_model_the_control_plane_does_not_run_is_always_ready(control):
    srv, _ = control
    await active_person(srv)
    async with httpx.AsyncClient(base_url=base(srv)) as http:
        browser = await Browser.signed_in(http, "ann@example.com")
        r = await browser.wake("m")
        assert r.status_code == 200 and r.json()["state"] == "ready"
        assert r.json()["reason"] == "models on this gateway are always loaded"


async def test_without_a_control_plane_both_routes_answer_that_models_are_always_loaded(plain):
    srv = plain
    await active_person(srv)
    async with httpx.AsyncClient(base_url=base(srv)) as http:
        browser = await Browser.signed_in(http, "ann@example.com")
        for r in (await browser.wake("m"), await browser.status("m")):
            assert r.status_code == 200
            body = r.json()
            assert body["state"] == "ready" and body["reason"] == "models on this gateway are always loaded"
            assert body["message"] == "m is loaded." and body["bytes_done"] is None and body["percent"] is None
        assert (await browser.wake("tiny")).status_code == 404
