"""`llmgw ctl plan` end to end: `llmgw mirror serve`, a control plane and a CPU agent as processes.

A Llama-3-8B-shaped config.json is copied into the mirror by hand (as docs/mirror.md allows); the
agent registers this machine's memory; `ctl plan` reads the config through the mirror's byte port
and fits the model into that node, each figure checked against the hand calculation in
tests/unit/test_ctl_plan.py.
"""

from __future__ import annotations

import json
import math
import os

import httpx
import pytest
import yaml
from harness import Gateway, Proc, free_port, llmgw_cmd, wait_http, wait_until

from llmgw.mirror.api import default_token_file, ensure_token

pytestmark = pytest.mark.e2e

GiB = 1 << 30
LLAMA_3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "max_position_embeddings": 8192,
    "torch_dtype": "bfloat16",
}


def test_plan_reads_a_config_from_a_real_mirror_and_fits_it_into_a_real_agents_memory(tmp_path):
    mirror_dir = tmp_path / "models"
    (mirror_dir / "llama3-8b" / "v1").mkdir(parents=True)
    (mirror_dir / "llama3-8b" / "v1" / "config.json").write_text(json.dumps(LLAMA_3_8B))
    wport, aport, agent_port = free_port(), free_port(), free_port()
    base = f"http://127.0.0.1:{wport}"
    token_file = default_token_file(mirror_dir)
    ensure_token(token_file)  # made beforehand, as `llmgw mirror init` does
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    mirror = Proc(
        llmgw_cmd(
            "mirror",
            "--dir",
            str(mirror_dir),
            "serve",
            "--listen",
            f"127.0.0.1:{wport}",
            "--api-listen",
            f"127.0.0.1:{aport}",
            "--base",
            base,
        ),
        tmp_path / "mirror.log",
        env=env,
    )
    procs: list[Proc] = [mirror]
    try:
        wait_http(f"http://127.0.0.1:{aport}/v1/health", mirror.proc, 30, mirror.log)
        gw = Gateway(
            tmp_path,
            models=[],
            agent_listen=f"127.0.0.1:{agent_port}",
            agent_tls=None,
            control={"enabled": True},
            engines={"llamacpp": None},
            mirror={"api": f"http://127.0.0.1:{aport}", "token_file": str(token_file)},
        )
        procs.append(gw)
        gw.wait_up(ready=False)

        # Before any node: the figures alone.
        r = gw.ctl("plan", "llama3-8b/v1")
        assert r.returncode == 0, r.stdout + r.stderr
        assert r.stdout.startswith(
            "LlamaForCausalLM (llama), 8.03 billion parameters (8,030,261,248), read from config.json of "
            f"llama3-8b/v1 in the mirror ({base}/llama3-8b/v1/config.json)"
        )
        assert "note: no nodes have registered, so nothing is fitted; the figures are below" in r.stdout

        cfg = tmp_path / "agent.yaml"
        cfg.write_text(
            yaml.safe_dump(
                {
                    "server": f"127.0.0.1:{agent_port}",
                    "tls": None,
                    "node_id": "node-a",
                    "heartbeat_interval": "500ms",
                    "weights_cache": str(tmp_path / "weights"),
                    "engines_dir": str(tmp_path / "engines"),
                    "supervisor": {"work_dir": str(tmp_path / "state")},
                    "discovery": {"skip_gpus": True},
                }
            )
        )
        agent = Proc(llmgw_cmd("agent", "--config", str(cfg)), tmp_path / "agent.log", env=env)
        procs.append(agent)
        nodes = wait_until(
            lambda: [
                n
                for n in httpx.get(gw.admin + "/api/v1/nodes", headers=gw.admin_auth).json()["nodes"]
                if (n.get("memory") or {}).get("total_bytes")
            ],
            60,
            "the agent to register with its memory",
            procs,
        )
        memory = nodes[0]["memory"]["total_bytes"]
        pool = f"cpu-{round(memory / GiB)}g"

        r = gw.ctl("plan", "llama3-8b/v1", "--json")
        assert r.returncode == 0, r.stdout + r.stderr
        plan = json.loads(r.stdout)
        rows = {row["precision"]: row for row in plan["rows"]}
        assert set(rows) == {"f16", "q8_0", "q4_k_m"} and {row["pool"] for row in plan["rows"]} == {pool}
        q4 = rows["q4_k_m"]
        # 8,030,261,248 × 4.9 bits / 8 → 4,918,535,015; KV 2 × 32 × 8 × 128 × 8192 × 2 = 1 GiB;
        # headroom 10% of the node and 2 GiB.
        total = 4_918_535_015 + GiB + math.ceil(memory * 0.10) + 2 * GiB
        assert (q4["weights_bytes"], q4["kv_cache_bytes"], q4["total_bytes"]) == (4_918_535_015, GiB, total)
        assert q4["fits"] is (total <= memory)
        assert q4["free_bytes"] == (memory - total if total <= memory else None)

        r = gw.ctl("plan", "llama3-8b/v1")
        assert r.returncode == 0
        line = next(x for x in r.stdout.splitlines() if x.startswith("q4_k_m"))
        assert line.split()[1:2] == [pool]
    finally:
        for p in reversed(procs):
            if p.alive():
                p.stop()
