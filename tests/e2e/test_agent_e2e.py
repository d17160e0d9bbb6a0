"""A real `llmgw agent` process against a stand-in control plane.

The stand-in speaks the protocol over the agent's WebSocket: it asks for
llama.cpp from a local release server (an archive of the locally built
llama-server with its sha256), then for a shard whose weights (the tiny
model) come over HTTP. The engine must answer a chat completion; the agent is
then killed with SIGKILL and started again, and must adopt the same engine
process while the engine never stops answering.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import signal
import tarfile
import threading
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from aiohttp import web
from harness import Proc, free_port, llmgw_cmd, release_archive, serve_files

from llmgw.protocol import (
    STREAM_PATH,
    Ack,
    DrainShard,
    EngineProfile,
    EngineWant,
    Heartbeat,
    Provision,
    Register,
    ShardStatus,
    StartShard,
    decode,
    encode,
)
from llmgw.testing.waiting import until

pytestmark = pytest.mark.e2e

TAG = "b9999"
ASSET = f"llama-{TAG}-bin-ubuntu-x64.tar.gz"


class StandIn:
    """The control plane's side of the stream, run on its own thread and loop."""

    def __init__(self, release_url: str, model_url: str, engine_port: int) -> None:
        self.release_url, self.model_url, self.engine_port = release_url, model_url, engine_port
        self.port = free_port()
        self.registers: list[Register] = []
        self.statuses: list[ShardStatus] = []
        self.provision: dict[str, str] = {}
        self.start_shard = True
        self.failure: str | None = None
        self.on_register: list[bytes] = []  # extra frames sent after each registration
        self.acks: list = []
        self.heartbeats = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()
        self._ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get(STREAM_PATH, self._stream)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)

    def send(self, msg) -> None:
        asyncio.run_coroutine_threadsafe(self._ws.send_bytes(encode(msg)), self._loop).result(10)

    async def _stream(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        self._ws = ws
        sent_start = False
        async for frame in ws:
            msg = decode(frame.data, sender="agent")
            if isinstance(msg, Register):
                self.registers.append(msg)
                for frame_out in self.on_register:
                    await ws.send_bytes(frame_out)
                await ws.send_bytes(
                    encode(Provision(engines=[EngineWant(engine="llamacpp", version=TAG, source_url=self.release_url)]))
                )
            elif isinstance(msg, Heartbeat):
                self.heartbeats += 1
                for p in msg.provision or ():
                    self.provision[p.engine] = p.state.value
                    if p.state.value == "failed":
                        self.failure = p.detail
                self.statuses.extend(msg.shards or ())
            elif isinstance(msg, ShardStatus):
                self.statuses.append(msg)
            elif isinstance(msg, Ack):
                self.acks.append(msg)
            running = (
                any(s.shard_id == "tiny-0" for s in (self.registers[-1].shards or ())) if self.registers else False
            )
            if self.start_shard and not sent_start and not running and self.provision.get("llamacpp") == "ready":
                sent_start = True
                await ws.send_bytes(
                    encode(
                        StartShard(
                            id="start-1",
                            shard_id="tiny-0",
                            replica_id="r1",
                            model="tiny",
                            engine="llamacpp",
                            source=self.model_url,
                            http_port=self.engine_port,
                            profile=EngineProfile(context_size=2048, parallel=2, args=["--threads", "1"]),
                        )
                    )
                )
        return ws

    def state(self, shard: str) -> str | None:
        for s in reversed(self.statuses):
            if s.shard_id == shard:
                return s.state.value
        return None


@pytest.mark.slow  # minutes on two cores
def test_agent_installs_fetches_starts_and_adopts_after_sigkill(llama_server_bin, tiny_model, tmp_path):
    archive = release_archive(llama_server_bin, TAG)
    digest = hashlib.sha256(archive).hexdigest()
    base, stop_files = serve_files(
        {
            f"/{TAG}/{ASSET}": archive,
            f"/{TAG}/{ASSET}.sha256": f"{digest}  {ASSET}\n".encode(),
            "/models/tiny.gguf": tiny_model.read_bytes(),
        }
    )
    engine_port = free_port()
    cp = StandIn(base, base + "/models/tiny.gguf", engine_port)
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "server": f"127.0.0.1:{cp.port}",
                "tls": None,
                "node_id": "node-a",
                "heartbeat_interval": "500ms",
                "reconnect_base": "200ms",
                "reconnect_max": "1s",
                "weights_cache": str(tmp_path / "weights"),
                "engines_dir": str(tmp_path / "engines"),
                "supervisor": {"work_dir": str(tmp_path / "state"), "health_interval": "250ms", "stop_timeout": "10s"},
                "discovery": {"skip_gpus": True},
            }
        )
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    agent = Proc(llmgw_cmd("agent", "--config", str(cfg)), tmp_path / "agent1.log", env=env)
    engine_pid = None
    try:
        until(lambda: cp.registers, 30, "the agent to register", alive=[agent])
        reg = cp.registers[0]
        assert reg.node_id == "node-a" and reg.protocol_version >= 1 and reg.inventory.memory.total_bytes > 0
        until(lambda: cp.provision.get("llamacpp") == "ready", 120, "llama.cpp to be installed", alive=[agent])
        installed = list((tmp_path / "engines").rglob("llama-server"))
        assert installed, "nothing was installed under engines_dir"
        until(lambda: cp.state("tiny-0") == "ready", 120, "the shard to be ready", alive=[agent])
        assert (tmp_path / "weights").exists() and any((tmp_path / "weights").iterdir())
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{engine_port}/v1", api_key="x", max_retries=0)
        reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert reply.usage.completion_tokens == 4
        engine_pid = next(s.pid for s in reversed(cp.statuses) if s.shard_id == "tiny-0" and s.pid)

        # Watch the engine through the agent's death and rebirth.
        failures: list[str] = []
        answered = [0]
        done = threading.Event()

        def watch() -> None:
            with httpx.Client(timeout=2) as h:
                # Probe every 20 ms until told to stop: a sampling rate, not a wait for anything.
                while not done.wait(0.02):
                    try:
                        if h.get(f"http://127.0.0.1:{engine_port}/health").status_code != 200:
                            failures.append("not 200")
                        else:
                            answered[0] += 1
                    except httpx.HTTPError as exc:
                        failures.append(repr(exc))

        watcher = threading.Thread(target=watch)
        watcher.start()
        agent.proc.send_signal(signal.SIGKILL)
        agent.proc.wait(10)
        cp.start_shard = False
        registered = len(cp.registers)
        agent = Proc(llmgw_cmd("agent", "--config", str(cfg)), tmp_path / "agent2.log", env=env)
        until(lambda: len(cp.registers) > registered, 30, "the restarted agent to register", alive=[agent])
        # The engine keeps answering under the new agent too: 25 more answers, well past its adoption.
        seen = answered[0]
        until(lambda: answered[0] >= seen + 25 or failures, 30, "the engine to answer under the new agent")
        done.set()
        watcher.join()
        assert failures == [], f"the engine stopped answering while the agent restarted: {failures[:5]}"
        shards = {s.shard_id: s for s in cp.registers[-1].shards or ()}
        assert shards["tiny-0"].pid == engine_pid, "the restarted agent did not adopt the same engine process"
        assert shards["tiny-0"].spec is not None and shards["tiny-0"].spec.replica_id == "r1"
        # A clean stop leaves the engine running for the next agent.
        assert agent.stop() == 0, agent.text()[-3000:]
        assert httpx.get(f"http://127.0.0.1:{engine_port}/health").status_code == 200
        # The next agent adopts it again and drains it on request: the engine is idle, so it stops at once.
        registered = len(cp.registers)
        agent = Proc(llmgw_cmd("agent", "--config", str(cfg)), tmp_path / "agent3.log", env=env)
        until(lambda: len(cp.registers) > registered, 30, "the third agent to register", alive=[agent])
        cp.send(DrainShard(id="drain-1", shard_id="tiny-0", timeout_s=30))
        until(lambda: any(a.id == "drain-1" for a in cp.acks), 30, "the drain to finish", alive=[agent])
        assert next(a for a in cp.acks if a.id == "drain-1").ok
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{engine_port}/health", timeout=2)
        assert agent.stop() == 0, agent.text()[-3000:]
    finally:
        if agent.alive():
            agent.kill()
        if engine_pid:
            try:
                os.killpg(engine_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        cp.close()
        stop_files()


def _tampered(binary: Path) -> bytes:
    good = bytearray(release_archive(binary, TAG))
    good[len(good) // 2] ^= 0xFF
    return bytes(good)


def _escaping(binary: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        tf.add(binary, arcname=f"llama-{TAG}/llama-server")
        evil = tarfile.TarInfo("../evil.sh")
        data = b"#!/bin/sh\necho pwned\n"
        evil.size = len(data)
        tf.addfile(evil, io.BytesIO(data))
    return buf.getvalue()


@pytest.mark.parametrize("kind", ["tampered", "wrong-checksum", "escaping-path"])
def test_bad_archives_are_refused_with_the_reason_and_nothing_installed(kind, llama_server_bin, tmp_path):
    good = release_archive(llama_server_bin, TAG)
    if kind == "tampered":
        body, digest = _tampered(llama_server_bin), hashlib.sha256(good).hexdigest()
        words = "sha256"
    elif kind == "wrong-checksum":
        body, digest = good, "0" * 64
        words = "sha256"
    else:
        body = _escaping(llama_server_bin)
        digest = hashlib.sha256(body).hexdigest()
        words = ".."
    base, stop_files = serve_files({f"/{TAG}/{ASSET}": body, f"/{TAG}/{ASSET}.sha256": f"{digest}  {ASSET}\n".encode()})
    cp = StandIn(base, base + "/none", free_port())
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "server": f"127.0.0.1:{cp.port}",
                "tls": None,
                "heartbeat_interval": "300ms",
                "weights_cache": str(tmp_path / "weights"),
                "engines_dir": str(tmp_path / "engines"),
                "supervisor": {"work_dir": str(tmp_path / "state")},
                "discovery": {"skip_gpus": True},
            }
        )
    )
    agent = Proc(llmgw_cmd("agent", "--config", str(cfg)), tmp_path / "agent.log")
    try:
        until(lambda: cp.provision.get("llamacpp") == "failed", 60, "the install to fail", alive=[agent])
        assert words in (cp.failure or ""), cp.failure
        assert not list((tmp_path / "engines").rglob("llama-server")), "something was installed"
        assert not (tmp_path / "evil.sh").exists() and not (tmp_path / "engines" / "evil.sh").exists()
        assert agent.alive()  # a failed install is reported, not fatal
    finally:
        assert agent.stop() == 0, agent.text()[-3000:]
        cp.close()
        stop_files()


def test_bad_requests_are_answered_with_reasons_and_the_agent_keeps_running(tmp_path):
    cp = StandIn("http://127.0.0.1:1", "http://127.0.0.1:1/none", free_port())
    cp.start_shard = False
    cp.on_register = [
        b'{"type": "start_shard", "id": "bad-1", "payload": {"shard_id": "s", "engine": "llamacpp", "gpus": ["zero"]}}',
        b"this is not json",
        encode(
            StartShard(
                id="start-2",
                shard_id="s2",
                engine="ollama",
                model="m",
                source="/nonexistent/m.gguf",
                http_port=free_port(),
            )
        ),
    ]
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "server": f"127.0.0.1:{cp.port}",
                "tls": None,
                "heartbeat_interval": "300ms",
                "weights_cache": str(tmp_path / "weights"),
                "engines_dir": str(tmp_path / "engines"),
                "supervisor": {"work_dir": str(tmp_path / "state")},
                "discovery": {"skip_gpus": True},
            }
        )
    )
    agent = Proc(llmgw_cmd("agent", "--config", str(cfg)), tmp_path / "agent.log")
    try:
        until(
            lambda: any(a.id == "bad-1" for a in cp.acks) and cp.state("s2") == "failed",
            30,
            "the refusals",
            alive=[agent],
        )
        bad = next(a for a in cp.acks if a.id == "bad-1")
        assert not bad.ok and "gpus[0]" in bad.error
        reason = next(s.reason for s in reversed(cp.statuses) if s.shard_id == "s2" and s.state.value == "failed")
        assert reason and 'unknown engine "ollama"' in reason, reason
        log = agent.text()
        assert "gpus[0]" in log and "json" in log.lower()
        # The refusals end neither the agent nor its connection: it goes on heartbeating on it.
        beats = cp.heartbeats
        until(lambda: cp.heartbeats >= beats + 2, 30, "two more heartbeats after the refusals", alive=[agent])
        assert agent.alive() and len(cp.registers) == 1  # still the same connection
    finally:
        assert agent.stop() == 0, agent.text()[-3000:]
        cp.close()
