"""`llmgw agent` as a child process of a test, with its output in a file for failure messages."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import Any

import yaml


def local_agent_config(tmp_path: Path, server_port: int, **overrides: Any) -> dict[str, Any]:
    """An agent.yaml for one local agent (node real-a, plaintext, no GPUs probed) dialling
    127.0.0.1:``server_port``, heartbeating every 200 ms; ``overrides`` replace or add keys."""
    return {
        "server": f"127.0.0.1:{server_port}",
        "tls": None,
        "node_id": "real-a",
        "heartbeat_interval": "200ms",
        "reconnect_base": "200ms",
        "reconnect_max": "1s",
        "weights_cache": str(tmp_path / "weights"),
        "engines_dir": str(tmp_path / "engines"),
        "supervisor": {"work_dir": str(tmp_path / "state")},
        "discovery": {"skip_gpus": True},
        **overrides,
    }


class AgentProcess:
    """Started with the agent.yaml it is given; stopped with SIGTERM, killed after 15 s."""

    def __init__(self, tmp_path: Path, config: dict[str, Any]) -> None:
        self.config_path = tmp_path / "agent.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = tmp_path / "agent.log"
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> asyncio.subprocess.Process:
        with open(self.log_path, "wb") as out:  # noqa: ASYNC230  # a local log file for the child's stdout
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "llmgw.cli.main",
                "agent",
                "--config",
                str(self.config_path),
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                stdin=asyncio.subprocess.DEVNULL,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        return self.proc

    def log(self) -> str:
        """The tail of its output, for a failed wait to show."""
        return "agent log:\n" + self.log_path.read_text()[-4000:]

    async def stop(self) -> None:
        proc = self.proc
        if proc is not None and proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 15)
            except TimeoutError:
                proc.kill()
                await proc.wait()
