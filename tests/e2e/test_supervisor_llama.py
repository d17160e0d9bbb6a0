"""A real llama-server under the supervisor, surviving the death of the process that supervises it.

The agent's promise: killing the agent (SIGKILL, no chance to clean up) and
starting it again costs a serving engine nothing. The new agent adopts the
same process, and /health never stops answering in between.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from harness import REPO, free_port

from llmgw.agent.supervisor import ShardSpec, Supervisor, alive
from llmgw.protocol import ShardState
from llmgw.testing.waiting import until

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only"),
]

# The "agent": owns a Supervisor, adopts what an earlier one left, asks for the
# shard (as the control plane repeats start_shard after a reconnect), reports
# once it is ready and then keeps supervising until it is killed.
AGENT = r"""
import asyncio, json, sys
from llmgw.agent.supervisor import Supervisor, ShardSpec
from llmgw.protocol import ShardState

async def main():
    sup = Supervisor(sys.argv[1], health_interval=0.1, poll_interval=0.1)
    report = await sup.adopt()
    spec = ShardSpec.model_validate_json(sys.argv[2])
    await sup.start(spec)
    st = await sup.wait(spec.shard_id, ShardState.READY, timeout=120)
    print(json.dumps({"adopted": report.adopted, "killed": [k.pid for k in report.killed],
                      "state": st.state.value, "pid": st.pid, "was_adopted": st.adopted,
                      "detail": st.detail}), flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


class HealthPoller(threading.Thread):
    """GET /health in a tight loop, keeping every failure."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.ok = 0
        self.failures: list[str] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            try:
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                c.request("GET", "/health")
                r = c.getresponse()
                r.read()
                c.close()
                if r.status == 200:
                    self.ok += 1
                else:
                    self.failures.append(f"{time.monotonic():.3f} HTTP {r.status}")
            except OSError as exc:
                self.failures.append(f"{time.monotonic():.3f} {exc!r}")
            time.sleep(0.002)  # a sampling rate: the poller watches the whole handover


def start_agent(tmp_path: Path, state_dir: Path, spec: ShardSpec, name: str) -> tuple[subprocess.Popen, dict]:
    script = tmp_path / "agent.py"
    script.write_text(AGENT)
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with open(tmp_path / f"{name}.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, str(script), str(state_dir), spec.model_dump_json()],
            stdout=subprocess.PIPE,
            stderr=log,
            env=env,
            cwd=tmp_path,
        )
    line = [b""]
    reader = threading.Thread(target=lambda: line.__setitem__(0, proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(150)
    if not line[0]:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        raise AssertionError(f"{name} never reported ready:\n{(tmp_path / f'{name}.log').read_text()[-3000:]}")
    return proc, json.loads(line[0])


def test_a_killed_agent_is_replaced_without_the_engine_noticing(llama_server_bin, tiny_model, tmp_path):
    state_dir = tmp_path / "agent-state"
    port = free_port()
    spec = ShardSpec(
        shard_id="tiny-0",
        argv=[
            str(llama_server_bin),
            "--model",
            str(tiny_model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--ctx-size",
            "512",
            "--parallel",
            "1",
            "--alias",
            "tiny",
            "--threads",
            "1",
            "--metrics",
        ],
        base_url=f"http://127.0.0.1:{port}",
        model="tiny",
        stop_timeout=20,
    )
    agents: list[subprocess.Popen] = []
    engine_pid = None
    try:
        first, said = start_agent(tmp_path, state_dir, spec, "agent-1")
        agents.append(first)
        assert said["state"] == "ready" and said["adopted"] == [] and not said["was_adopted"], said
        engine_pid = said["pid"]
        assert os.getpgid(engine_pid) == engine_pid  # its own group, not the agent's

        poller = HealthPoller(port)
        poller.start()
        time.sleep(0.5)  # the engine answers under its first agent for a while
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        time.sleep(1.0)  # the engine, alone (time passing is the test: it must keep answering)
        assert alive(engine_pid)

        second, said = start_agent(tmp_path, state_dir, spec, "agent-2")
        agents.append(second)
        time.sleep(0.5)  # and for a while under the agent that adopted it
        poller.halt.set()
        poller.join(5)

        assert said["adopted"] == ["tiny-0"] and said["was_adopted"] and said["killed"] == [], said
        assert said["pid"] == engine_pid and said["state"] == "ready", said
        assert poller.failures == [], poller.failures[:10]
        assert poller.ok > 100, poller.ok
        print(f"health answered {poller.ok} times across the restart")

        # A clean agent exit leaves the engine too; this test's own supervisor
        # adopts it once more and stops it.
        second.send_signal(signal.SIGTERM)
        second.wait(10)
        assert alive(engine_pid)

        async def adopt_and_stop() -> tuple[ShardState, ShardState]:
            async with Supervisor(state_dir, health_interval=0.1, poll_interval=0.1) as sup:
                report = await sup.adopt()
                assert report.adopted == ["tiny-0"]
                ready = await sup.wait("tiny-0", ShardState.READY, timeout=30)
                stopped = await sup.stop("tiny-0")
                return ready.state, stopped.state

        ready, stopped = asyncio.run(adopt_and_stop())
        assert (ready, stopped) == (ShardState.READY, ShardState.STOPPED)
        until(lambda: not alive(engine_pid), 10, "the stopped engine to be gone")
        assert not alive(engine_pid)
        assert not (state_dir / "shards" / "tiny-0.json").exists()
        assert "llama" in (state_dir / "logs" / "tiny-0.log").read_text(errors="replace").lower()
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
                a.wait()
            a.stdout.close()
        if engine_pid is not None and alive(engine_pid):
            os.killpg(engine_pid, signal.SIGKILL)
