"""`llmgw ctl status` and `ctl weights --collect` on a real fleet: a control plane and an agent as
processes, serving the tiny model with a real llama-server; a model served and then removed leaves its
file in the agent's weights cache, which collecting removes, while the operator's files stay."""

from __future__ import annotations

import json
import subprocess

import httpx
import openai
import pytest
import yaml
from harness import Gateway, free_port, kill_engines, llmgw_cmd, release_files, serve_files, start_agent, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # an agent installs llama.cpp and runs two engines

TAG = "b9999"


def _cert(*args: str) -> None:
    r = subprocess.run(llmgw_cmd("ctl", "cert", *args), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_weights_collect_removes_a_removed_models_file_and_leaves_the_operators(llama_server_bin, tiny_model, tmp_path):
    pki = tmp_path / "pki"
    _cert("init-ca", "--dir", str(pki))
    _cert("issue-server", "127.0.0.1", "localhost", "--dir", str(pki))
    _cert("issue-client", "node-a", "--dir", str(pki))
    weights = tiny_model.read_bytes()
    base, stop_files = serve_files(
        {**release_files(llama_server_bin, TAG), "/models/keep.gguf": weights, "/models/gone.gguf": weights}
    )
    profile = {"engine": "llamacpp", "args": ["--ctx-size", "256"], "startup_timeout": "120s"}
    keep = {"name": "keep", "source": base + "/models/keep.gguf", "scaling": {"min": 1}, "profiles": [profile]}
    agent_port = free_port()
    gw = Gateway(
        tmp_path,
        models=[keep],
        agent_listen=f"127.0.0.1:{agent_port}",
        agent_tls={"ca": str(pki / "ca.pem"), "cert": str(pki / "server.pem"), "key": str(pki / "server-key.pem")},
        control={"enabled": True, "unreachable_after": "3s", "lost_after": "8s", "interval": "500ms"},
        engines={"llamacpp": TAG, "release_url": base},
    )
    own = tmp_path / "own-models"
    own.mkdir()
    cache = tmp_path / "node-a" / "weights"
    cache.mkdir(parents=True)
    operators = [own / "their-finetune.gguf", cache / "placed-by-hand.gguf"]
    for path in operators:
        path.write_bytes(b"GGUF the operator's")
    agent = start_agent(
        tmp_path, "node-a", agent_port, pki, supervisor={"health_interval": "250ms"}, extra={"model_dirs": [str(own)]}
    )
    procs = [gw, agent]

    def replicas(model: str) -> list[dict]:
        got = httpx.get(f"{gw.admin}/api/v1/replicas?model={model}", headers=gw.admin_auth, timeout=10).json()
        return got.get("replicas", [])

    def ready(model: str) -> bool:
        return any(r["state"] == "ready" for r in replicas(model))

    def ctl(*args: str) -> subprocess.CompletedProcess:
        return gw.ctl(*args)

    try:
        gw.wait_up(ready=False)
        wait_until(lambda: ready("keep"), 180, "keep to be ready on node-a", procs)
        spec = tmp_path / "gone.yaml"
        spec.write_text(
            yaml.safe_dump(
                {"name": "gone", "source": base + "/models/gone.gguf", "scaling": {"min": 1}, "profiles": [profile]}
            )
        )
        r = ctl("model", "add", "-f", str(spec))
        assert r.returncode == 0, r.stderr
        wait_until(lambda: ready("gone"), 120, "gone to be ready on node-a", procs)

        status = ctl("status")
        assert status.returncode == 0, status.stderr
        assert "nodes: 1 (1 ready)" in status.stdout
        assert "  keep  1/1 replicas ready" in status.stdout and "  gone  1/1 replicas ready" in status.stdout
        assert "nothing is failing" in status.stdout, status.stdout

        held = {p.name for p in cache.iterdir()}
        gone_file = next(cache / n for n in held if n.endswith("models_gone.gguf"))
        keep_file = next(cache / n for n in held if n.endswith("models_keep.gguf"))
        assert ctl("weights").stdout.startswith("no model-less files in the nodes' weights caches")

        r = ctl("model", "remove", "gone")
        assert r.returncode == 0, r.stderr
        wait_until(lambda: replicas("gone") == [], 60, "gone's replica to stop", procs)

        def listed() -> str:
            out = ctl("weights").stdout
            return out if str(gone_file) in out else ""

        listing = wait_until(listed, 30, "ctl weights to list the removed model's file", procs)
        assert str(keep_file) not in listing and "placed-by-hand" not in listing
        assert "1 file (" in listing and ") no model needs on 1 node" in listing

        r = ctl("weights", "--collect")
        assert r.returncode == 0, r.stdout + r.stderr
        assert "node-a: asked to remove 1 file" in r.stdout
        assert "asked to remove 1 file" in r.stdout and "on 1 node" in r.stdout
        assert not gone_file.exists()
        assert keep_file.read_bytes() == weights
        assert all(p.read_bytes() == b"GGUF the operator's" for p in operators)
        wait_until(
            lambda: "no model-less files" in ctl("weights").stdout, 30, "the agent to report the file gone", procs
        )
        got = json.loads(ctl("weights", "--json").stdout)
        assert [f["path"] for n in got["nodes"] for f in n["files"]] == [str(keep_file)]

        # The model still needing its file still serves.
        key = gw.create_key()
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=60)
        reply = client.chat.completions.create(model="keep", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].message.content is not None
    finally:
        pids = [s["pid"] for m in ("keep", "gone") for r in _safe(replicas, m) for s in r["shards"] if s.get("pid")]
        agent.stop()
        gw.stop()
        stop_files()
        kill_engines(pids)


def _safe(fn, *args):
    try:
        return fn(*args)
    except Exception:  # the control plane may be what failed
        return []
