"""A control plane and two agents, all separate processes, serving real llama-servers.

The agents install llama.cpp from a local stand-in for the release server (the
archive holds the llama-server this project built), fetch the tiny model over
HTTP, and run it; the control plane places, adopts and replaces replicas.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import httpx
import openai
import pytest
import yaml
from harness import Gateway, Proc, free_port, llmgw_cmd, release_files, serve_files, start_agent, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # a fleet of agents, placed, adopted and moved

TAG = "b9999"


def _ctl(*args: str) -> None:
    r = subprocess.run(llmgw_cmd("ctl", "cert", *args), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


class Fleet:
    def __init__(self, gw: Gateway, procs: list[Proc]) -> None:
        self.gw = gw
        self.procs = procs  # everything whose log explains a failure

    def api(self, path: str) -> dict:
        return httpx.get(self.gw.admin + path, headers=self.gw.admin_auth, timeout=10).json()

    def replicas(self, model: str | None = None) -> list[dict]:
        return self.api("/api/v1/replicas" + (f"?model={model}" if model else ""))["replicas"]

    def nodes(self) -> dict[str, dict]:
        try:
            return {n["node_id"]: n for n in self.api("/api/v1/nodes")["nodes"]}
        except httpx.HTTPError:
            return {}

    def wait(self, cond, timeout: float, what: str):
        return wait_until(cond, timeout, what, self.procs, lambda: f"replicas: {self._safe_replicas()}")

    def _safe_replicas(self):
        try:
            return self.replicas()
        except Exception as exc:  # the control plane may be the thing that is down
            return repr(exc)

    def ready(self, model: str, n: int) -> list[dict]:
        rs = [r for r in self.replicas(model) if r["state"] == "ready"]
        return rs if len(rs) == n and len(self.replicas(model)) == n else []

    def ctl(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            llmgw_cmd(*args, "--server", self.gw.admin, "--token-file", str(self.gw.token_file)),
            capture_output=True,
            text=True,
            timeout=60,
        )


def _pids(replicas: list[dict]) -> dict[str, int]:
    return {s["shard_id"]: s["pid"] for r in replicas for s in r["shards"]}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def test_two_agents_serve_adopt_scale_and_replace(llama_server_bin, tiny_model, tmp_path):
    pki = tmp_path / "pki"
    _ctl("init-ca", "--dir", str(pki))
    _ctl("issue-server", "127.0.0.1", "localhost", "--dir", str(pki))
    for node in ("node-a", "node-b"):
        _ctl("issue-client", node, "--dir", str(pki))
    base, stop_files = serve_files(
        {**release_files(llama_server_bin, TAG), "/models/tiny.gguf": tiny_model.read_bytes()}
    )
    agent_port = free_port()
    source = base + "/models/tiny.gguf"
    tiny = {
        "name": "tiny",
        "source": source,
        "scaling": {"min": 2},
        "profiles": [{"engine": "llamacpp", "args": ["--ctx-size", "256"], "startup_timeout": "120s"}],
    }
    gw = Gateway(
        tmp_path,
        models=[tiny],
        agent_listen=f"127.0.0.1:{agent_port}",
        agent_tls={"ca": str(pki / "ca.pem"), "cert": str(pki / "server.pem"), "key": str(pki / "server-key.pem")},
        # unreachable_after is also the settle window before the first placement: long
        # enough for both agents (started with the server, and retrying until it listens)
        # to register on a loaded machine, or both replicas would go to the first one.
        control={
            "enabled": True,
            "unreachable_after": "5s",
            "lost_after": "8s",
            "interval": "500ms",
            "base_backoff": "1s",
        },
        engines={"llamacpp": TAG, "release_url": base},
    )
    agents = {
        n: start_agent(tmp_path, n, agent_port, pki, supervisor={"health_interval": "250ms"})
        for n in ("node-a", "node-b")
    }
    gw.wait_up(ready=False)
    fleet = Fleet(gw, [gw, *agents.values()])
    engine_pids: set[int] = set()
    restarted: Proc | None = None
    try:
        # Both nodes install llama.cpp, fetch the model and serve one replica each.
        two = fleet.wait(lambda: fleet.ready("tiny", 2), 180, "two ready replicas of tiny")
        assert sorted(r["shards"][0]["node"] for r in two) == ["node-a", "node-b"]
        engine_pids |= set(_pids(two).values())
        nodes = fleet.nodes()
        assert nodes["node-a"]["engines"] == {"llamacpp": TAG} and nodes["node-a"]["replicas"]
        wait_ready = fleet.wait(lambda: httpx.get(gw.url + "/ready").status_code == 200, 10, "/ready")
        assert wait_ready
        key = gw.create_key()
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=60)
        for _ in range(4):
            reply = client.chat.completions.create(
                model="tiny", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
            )
            assert reply.choices[0].message.content is not None
        listing = fleet.ctl("ctl", "replicas")
        assert listing.returncode == 0 and listing.stdout.count("ready") >= 2, listing.stdout + listing.stderr

        # An on-demand model added at run time is loaded by its first request, which waits for it.
        spec = tmp_path / "ondemand.yaml"
        spec.write_text(
            yaml.safe_dump(
                {
                    "name": "tiny-od",
                    "source": source,
                    "scaling": {"min": 0},
                    "profiles": [{"engine": "llamacpp", "args": ["--ctx-size", "256"]}],
                }
            )
        )
        r = fleet.ctl("ctl", "model", "add", "-f", str(spec))
        assert r.returncode == 0, r.stderr
        assert fleet.replicas("tiny-od") == []
        t0 = time.monotonic()
        reply = client.chat.completions.create(
            model="tiny-od", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
        assert reply.choices[0].message.content is not None and time.monotonic() - t0 < 120
        od = fleet.ready("tiny-od", 1)
        assert od, fleet.replicas("tiny-od")
        od_pid = od[0]["shards"][0]["pid"]
        engine_pids.add(od_pid)

        # Scaled to 0 (stopped), its engine goes; scaled back, it comes back.
        r = fleet.ctl("ctl", "scale", "tiny-od", "--min", "0", "--max", "0")
        assert r.returncode == 0, r.stderr
        fleet.wait(lambda: fleet.replicas("tiny-od") == [], 30, "tiny-od to stop")
        fleet.wait(lambda: not _alive(od_pid), 15, "tiny-od's engine to exit")
        with pytest.raises(openai.APIStatusError) as err:
            client.chat.completions.create(model="tiny-od", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
        assert err.value.status_code == 503 and "stopped" in str(err.value)
        r = fleet.ctl("ctl", "scale", "tiny-od", "--min", "1")
        assert r.returncode == 0, r.stderr
        od = fleet.wait(lambda: fleet.ready("tiny-od", 1), 60, "tiny-od back at one replica")
        engine_pids.add(od[0]["shards"][0]["pid"])

        # The control plane dies and comes back: every replica is adopted, no engine restarted.
        before = {r["id"]: r for r in fleet.replicas()}
        pids_before = _pids(list(before.values()))
        gw.proc.send_signal(signal.SIGKILL)
        gw.proc.wait(10)
        restarted = Proc(llmgw_cmd("server", "--config", str(gw.config)), tmp_path / "gateway-restarted.log")
        fleet.procs.append(restarted)
        fleet.wait(
            lambda: {r["id"] for r in fleet.replicas() if r["state"] == "ready"} == set(before),
            60,
            "the replicas to be adopted",
        )
        after = fleet.replicas()
        assert _pids(after) == pids_before
        assert all(r["adopted"] for r in after)
        assert all(_alive(p) for p in pids_before.values())
        reply = client.chat.completions.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].message.content is not None
        time.sleep(2)  # a few passes: nothing extra started, nothing stopped
        assert {r["id"] for r in fleet.replicas()} == set(before)

        # node-b's agent dies: its node goes unreachable, then lost, and its replica moves to node-a.
        agents["node-b"].proc.send_signal(signal.SIGKILL)
        agents["node-b"].proc.wait(10)
        fleet.wait(lambda: fleet.nodes().get("node-b", {}).get("state") == "unreachable", 15, "node-b unreachable")
        fleet.wait(lambda: fleet.nodes().get("node-b", {}).get("state") == "lost", 15, "node-b lost")
        moved = fleet.wait(
            lambda: (
                [r for r in fleet.ready("tiny", 2) if all(s["node"] == "node-a" for s in r["shards"])]
                and all(s["node"] == "node-a" for r in fleet.ready("tiny", 2) for s in r["shards"])
            ),
            90,
            "tiny placed again on node-a",
        )
        assert moved
        engine_pids |= set(_pids(fleet.replicas()).values())
        reply = client.chat.completions.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].message.content is not None
        r = fleet.ctl("node", "remove", "node-b")
        assert r.returncode == 0, r.stderr
        assert "node-b" not in fleet.nodes()
    finally:
        for p in [*agents.values(), restarted, gw]:
            if p is not None and p.alive():
                p.stop()
        # Agents leave engines running on purpose (a restart adopts them); a test must not.
        for pid in engine_pids:
            if pid:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        stop_files()
