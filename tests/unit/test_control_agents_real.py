"""The real `llmgw agent` process connecting to the control plane's agent service."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import yaml
from aiohttp import web
from aiohttp.test_utils import TestServer

from llmgw.protocol import LogsReply, LogsRequest
from llmgw.server.control.agents import AgentService, NodeState
from llmgw.testing.waiting import async_until


async def test_the_real_agent_registers_heartbeats_and_answers_a_request(tmp_path):
    svc = AgentService(check_interval=0.1)
    app = web.Application()
    svc.add_routes(app)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "server": f"127.0.0.1:{server.port}",
                "tls": None,
                "node_id": "real-a",
                "heartbeat_interval": "200ms",
                "reconnect_base": "200ms",
                "reconnect_max": "1s",
                "weights_cache": str(tmp_path / "weights"),
                "engines_dir": str(tmp_path / "engines"),
                "supervisor": {"work_dir": str(tmp_path / "state")},
                "discovery": {"skip_gpus": True},
            }
        )
    )
    log_path = tmp_path / "agent.log"
    with open(log_path, "wb") as out:  # noqa: ASYNC230  # a local log file for the child's stdout: nothing to wait on
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "llmgw.cli.main",
            "agent",
            "--config",
            str(cfg),
            stdout=out,
            stderr=asyncio.subprocess.STDOUT,
            stdin=asyncio.subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    try:

        def agent_log() -> str:
            return "agent log:\n" + log_path.read_text()[-4000:]

        await async_until(
            lambda: svc.is_connected("real-a"), 30, "the agent to register", detail=agent_log, alive=[proc]
        )
        node = svc.get("real-a")
        assert node.state == NodeState.READY and node.protocol_version >= 1
        assert node.inventory is not None and node.inventory.memory.total_bytes > 0
        assert "logs" in (node.features or [])
        await async_until(lambda: node.load is not None, 30, "a heartbeat", detail=agent_log, alive=[proc])
        reply = await svc.request("real-a", LogsRequest(source="agent", lines=50), timeout=10)
        assert isinstance(reply, LogsReply) and reply.error is None and "agent" in (reply.sources or [])
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 15)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        await server.close()
