"""Engines cannot be called around the gateway: a real control plane, a real agent and a real
llama-server, whose port answers nobody without the replica's key, while the gateway (keys,
limits, budgets) reaches it, before and after the control plane is killed and adopts it again."""

from __future__ import annotations

import os
import signal

import httpx
import openai
import orjson
import pytest
from harness import Gateway, Proc, free_port, llmgw_cmd, release_files, serve_files, start_agent
from test_fleet_e2e import TAG, Fleet, _alive, _ctl

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # a fleet of agents, placed and moved


def _shard_record(tmp_path, node: str) -> dict:
    (path,) = (tmp_path / node / "state" / "shards").glob("*.json")
    return orjson.loads(path.read_bytes())


def test_an_engine_refuses_anyone_but_the_gateway_and_keeps_its_key_when_adopted(
    llama_server_bin, tiny_model, tmp_path
):
    pki = tmp_path / "pki"
    _ctl("init-ca", "--dir", str(pki))
    _ctl("issue-server", "127.0.0.1", "localhost", "--dir", str(pki))
    _ctl("issue-client", "node-a", "--dir", str(pki))
    base, stop_files = serve_files(
        {**release_files(llama_server_bin, TAG), "/models/tiny.gguf": tiny_model.read_bytes()}
    )
    agent_port = free_port()
    tiny = {
        "name": "tiny",
        "source": base + "/models/tiny.gguf",
        "scaling": {"min": 1},
        "profiles": [{"engine": "llamacpp", "args": ["--ctx-size", "256"], "startup_timeout": "120s"}],
    }
    gw = Gateway(
        tmp_path,
        models=[tiny],
        agent_listen=f"127.0.0.1:{agent_port}",
        agent_tls={"ca": str(pki / "ca.pem"), "cert": str(pki / "server.pem"), "key": str(pki / "server-key.pem")},
        control={"enabled": True, "interval": "500ms"},
        engines={"llamacpp": TAG, "release_url": base},
    )
    gw.wait_up(ready=False)
    agent = start_agent(tmp_path, "node-a", agent_port, pki, supervisor={"health_interval": "250ms"})
    fleet = Fleet(gw, [gw, agent])
    restarted: Proc | None = None
    pid = 0
    try:
        (replica,) = fleet.wait(lambda: fleet.ready("tiny", 1), 180, "a ready replica of tiny")
        pid = replica["shards"][0]["pid"]
        engine = replica["endpoint"]
        rec = _shard_record(tmp_path, "node-a")
        key = rec["spec"]["api_key"]
        assert key.startswith("llmgw-engine-") and rec["spec"]["env"]["LLAMA_API_KEY"] == key

        # The engine's own port: nothing without the key, its health open to a load balancer's probe.
        chat = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        assert httpx.post(engine + "/v1/chat/completions", json=chat, timeout=30).status_code == 401
        assert httpx.get(engine + "/v1/models", timeout=10).status_code == 401
        assert httpx.get(engine + "/metrics", timeout=10).status_code == 401
        guess = {"Authorization": "Bearer llmgw-engine-guess"}
        assert httpx.get(engine + "/v1/models", headers=guess, timeout=10).status_code == 401
        assert httpx.get(engine + "/health", timeout=10).status_code == 200
        # The key is in the engine's environment (its owner's to read), not on its command line (everyone's).
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert key.encode() not in f.read()
        with open(f"/proc/{pid}/environ", "rb") as f:
            assert f"LLAMA_API_KEY={key}".encode() in f.read().split(b"\0")

        # Through the gateway, with an API key: served, and the engine's load is scraped.
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=gw.create_key(), max_retries=0, timeout=60)
        reply = client.chat.completions.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].message.content is not None
        (ep,) = fleet.wait(
            lambda: [
                e for e in fleet.api("/api/v1/endpoints")["endpoints"] if e["url"] == engine and not e["metrics_stale"]
            ],
            10,
            "the engine's metrics",
        )
        assert ep["healthy"]

        # The control plane dies and comes back: it adopts the engine with the key it was started with.
        gw.proc.send_signal(signal.SIGKILL)
        gw.proc.wait(10)
        restarted = Proc(llmgw_cmd("server", "--config", str(gw.config)), tmp_path / "gateway-restarted.log")
        fleet.procs.append(restarted)
        (again,) = fleet.wait(lambda: [r for r in fleet.ready("tiny", 1) if r["adopted"]], 60, "the replica adopted")
        assert again["shards"][0]["pid"] == pid and again["endpoint"] == engine
        fleet.wait(lambda: httpx.get(gw.url + "/ready").status_code == 200, 15, "the restarted gateway ready")
        reply = client.chat.completions.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].message.content is not None
        assert httpx.get(engine + "/v1/models", timeout=10).status_code == 401

        # The agent dies and comes back: it adopts the engine from its record and its probes still get in.
        agent.proc.send_signal(signal.SIGKILL)
        agent.proc.wait(10)
        agent = start_agent(tmp_path, "node-a", agent_port, pki, supervisor={"health_interval": "250ms"})
        fleet.procs.append(agent)
        fleet.wait(lambda: "adopted 1 running engine" in agent.text(), 30, "the agent to adopt its engine")
        # Ready only once its probe of /v1/models, which wants the key, is answered.
        # (Both agents write one log file: the first one's "ready" is in it too.)
        fleet.wait(lambda: agent.text().count("ready (serving tiny)") == 2, 30, "the adopted engine ready to the agent")
        fleet.wait(
            lambda: [r for r in fleet.ready("tiny", 1) if r["shards"][0]["pid"] == pid],
            30,
            "the replica ready on the adopted engine",
        )
        reply = client.chat.completions.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].message.content is not None

        # Nothing an operator reads holds the key: logs, ctl, the admin API.
        sid = rec["spec"]["shard_id"]
        ctl = [
            fleet.ctl("ctl", *args)
            for args in (
                ("replicas", "--json"),
                ("nodes", "--json"),
                ("logs", "node-a"),
                ("logs", "node-a", "--source", sid),
            )
        ]
        assert all(r.returncode == 0 for r in ctl), [r.stderr for r in ctl]
        assert "llmgw: starting shard" in ctl[3].stdout  # the engine's output, through the agent's stream
        engine_log = tmp_path / "node-a" / "state" / "logs" / f"{sid}.log"
        shown = [r.stdout + r.stderr for r in ctl]
        shown += [gw.text(), restarted.text(), agent.text(), engine_log.read_text(errors="replace")]
        shown += [
            httpx.get(gw.admin + p, headers=gw.admin_auth, timeout=10).text
            for p in ("/api/v1/replicas", "/api/v1/nodes", "/api/v1/endpoints", "/api/v1/models")
        ]
        assert not [i for i, text in enumerate(shown) if key in text]
    finally:
        for p in (agent, restarted, gw):
            if p is not None and p.alive():
                p.stop()
        if pid and _alive(pid):
            os.killpg(pid, signal.SIGKILL)  # agents leave engines running on purpose; a test must not
        stop_files()
