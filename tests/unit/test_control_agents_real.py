"""The real `llmgw agent` process connecting to the control plane's agent service."""

from __future__ import annotations

import itertools
import time

from aiohttp import web
from aiohttp.test_utils import TestServer

from llmgw.protocol import LogsReply, LogsRequest
from llmgw.server.control.agents import AgentService, NodeState
from llmgw.testing.agent_process import AgentProcess, local_agent_config
from llmgw.testing.waiting import async_until


async def _serve(svc: AgentService) -> TestServer:
    app = web.Application()
    svc.add_routes(app)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server


async def test_the_real_agent_registers_heartbeats_and_answers_a_request(tmp_path):
    svc = AgentService(check_interval=0.1)
    server = await _serve(svc)
    agent = AgentProcess(tmp_path, local_agent_config(tmp_path, server.port))
    proc = await agent.start()
    try:
        await async_until(
            lambda: svc.is_connected("real-a"), 30, "the agent to register", detail=agent.log, alive=[proc]
        )
        node = svc.get("real-a")
        assert node.state == NodeState.READY and node.protocol_version >= 1
        assert node.inventory is not None and node.inventory.memory.total_bytes > 0
        assert "logs" in (node.features or [])
        await async_until(lambda: node.load is not None, 30, "a heartbeat", detail=agent.log, alive=[proc])
        reply = await svc.request("real-a", LogsRequest(source="agent", lines=50), timeout=10)
        assert isinstance(reply, LogsReply) and reply.error is None and "agent" in (reply.sources or [])
    finally:
        await agent.stop()
        await server.close()


async def test_the_real_agent_heartbeats_at_the_pace_the_control_plane_asks_for(tmp_path):
    # One heartbeat a second for a fleet of one: the agent, at 200 ms of its own, is asked for 1 s.
    svc = AgentService(check_interval=0.1, heartbeat_rate=1.0)
    server = await _serve(svc)
    beats: list[float] = []
    svc.on_report(lambda node: beats.append(time.monotonic()))
    agent = AgentProcess(tmp_path, local_agent_config(tmp_path, server.port))
    proc = await agent.start()
    try:
        await async_until(lambda: len(beats) >= 5, 60, "five reports", detail=agent.log, alive=[proc])
        assert svc.get("real-a").heartbeat_pace == 1.0
        # From the registration on, a report a second: the pace, which came with the answer to the
        # registration, moved the first heartbeat too (a wait never ends early; 0.2 s for the way here).
        gaps = [b - a for a, b in itertools.pairwise(beats)]
        assert gaps and min(gaps) >= 0.8, gaps
        assert "asks for a heartbeat every 1s; reporting every 1s" in agent.log_path.read_text()
        # Its stream dropped (as when a control plane restarts), it says at once the pace it kept.
        await svc._conns["real-a"].ws.close()
        await async_until(lambda: svc._pace_said == 1.0, 30, "the kept pace said again", detail=agent.log)
    finally:
        await agent.stop()
        await server.close()
