import asyncio
import socket
import time

from aiohttp import web

from llmgw.agent.client import ControlPlaneLink, next_delay
from llmgw.config.agent import parse_agent_config
from llmgw.protocol import STREAM_PATH


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _serve(handler):
    app = web.Application()
    app.router.add_get(STREAM_PATH, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = _port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"127.0.0.1:{port}"


async def test_standby_and_dead_addresses_are_skipped_without_waiting():
    hits = []

    async def standby(request):
        hits.append("standby")
        return web.Response(
            status=503,
            text="this control plane is a standby; try the leader",
            headers={"X-Llmgw-Refusal": "this control plane is a standby; try the leader"},
        )

    async def leader(request):
        hits.append("leader")
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.send_str("hello")
        await ws.receive()  # until the agent closes
        return ws

    r1, standby_addr = await _serve(standby)
    r2, leader_addr = await _serve(leader)
    dead = f"127.0.0.1:{_port()}"
    cfg = parse_agent_config({"servers": [dead, standby_addr, leader_addr], "tls": None, "reconnect_base": "5s"})
    got = []
    stop = asyncio.Event()

    async def session(ws, addr):
        got.append((addr, (await ws.receive()).data))
        stop.set()

    link = ControlPlaneLink(cfg, session)
    t = time.monotonic()
    await asyncio.wait_for(link.run(stop), 10)
    # Both failures were passed over at once: no 5 s backoff before the third address.
    assert time.monotonic() - t < 3
    assert got == [(f"http://{leader_addr}", "hello")]
    assert hits == ["standby", "leader"]
    assert "standby" in (link.last_error or "")
    await r1.cleanup()
    await r2.cleanup()


async def test_backs_off_when_every_address_failed_and_stops_promptly():
    cfg = parse_agent_config(
        {"servers": [f"127.0.0.1:{_port()}"], "tls": None, "reconnect_base": "10s", "reconnect_max": "10s"}
    )

    async def session(ws, addr):
        raise AssertionError("nothing should connect")

    stop = asyncio.Event()
    link = ControlPlaneLink(cfg, session)
    task = asyncio.create_task(link.run(stop))
    await asyncio.sleep(0.3)  # time passes to show the link stays in its backoff
    assert not task.done()  # waiting in backoff
    stop.set()
    await asyncio.wait_for(task, 1.0)  # the stop interrupts the wait


def test_jittered_backoff_grows_to_the_cap():
    ceiling = 0.0
    for _ in range(10):
        delay, ceiling = next_delay(ceiling, 1.0, 30.0)
        assert 0.1 <= delay <= ceiling <= 30.0
    assert ceiling == 30.0


async def test_after_a_lasting_session_ends_the_first_redial_waits_a_jittered_moment(monkeypatch):
    # A restarted control plane drops every agent at once; without a jittered first
    # redial they would all handshake again in the same instant.
    import llmgw.agent.client as client

    async def leader(request):
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        await ws.close()  # the control plane goes away
        return ws

    runner, addr = await _serve(leader)
    cfg = parse_agent_config({"servers": [addr], "tls": None, "reconnect_base": "2s"})
    monkeypatch.setattr(client, "_HEALTHY_SESSION", 0.0)

    def no_backoff(*a):
        raise AssertionError("a session that lasted is not a failure to back off from")

    monkeypatch.setattr(client, "next_delay", no_backoff)
    waits = []
    monkeypatch.setattr(client.random, "uniform", lambda lo, hi: waits.append((lo, hi)) or 0.0)
    sessions = []
    stop = asyncio.Event()

    async def session(ws, a):
        sessions.append(a)
        await ws.receive()
        if len(sessions) == 2:
            stop.set()

    await asyncio.wait_for(ControlPlaneLink(cfg, session).run(stop), 10)
    assert len(sessions) == 2
    assert waits == [(0, 2.0)]  # one jittered wait, within reconnect_base, between the two
    await runner.cleanup()
