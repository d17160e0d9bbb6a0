"""`llmgw ctl bench --save` against a real llama-server replica: a control plane and an agent as
processes, the tiny model served by the llama-server this project builds. The ramp finds a
level, saves it under the replica's profile, `ctl capacity` shows it, explain-placement says
it, and a pool driven past it through the gateway queues in admission."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading

import httpx
import openai
import orjson
import pytest
from harness import Gateway, free_port, llmgw_cmd, release_files, serve_files, start_agent
from test_fleet_e2e import TAG, Fleet, _alive, _ctl

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # a control plane, an agent and an engine it installs


def _engine_key(tmp_path, node: str) -> str:
    (path,) = (tmp_path / node / "state" / "shards").glob("*.json")
    return orjson.loads(path.read_bytes())["spec"]["api_key"]


def _gauge(text: str, name: str, model: str) -> float | None:
    m = re.search(rf'^{name}{{model="{model}"}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else None


def test_ctl_bench_saves_what_a_real_replica_carries_and_the_gateway_admits_by_it(
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
        "profiles": [{"engine": "llamacpp", "args": ["--ctx-size", "8192"], "startup_timeout": "120s"}],
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
    pid = 0
    try:
        (replica,) = fleet.wait(lambda: fleet.ready("tiny", 1), 180, "a ready replica of tiny")
        pid = replica["shards"][0]["pid"]
        endpoint = replica["endpoint"]
        assert replica["profile"] == "llamacpp-cpu"

        shown = gw.ctl("capacity")
        assert (shown.returncode, shown.stdout) == (
            0,
            "Nothing has been measured. Run `llmgw ctl bench <model> --target <replica> --save`.\n",
        )

        # The engine's key is its node's to read (root there, here the test): given in the environment.
        env = {**os.environ, "LLMGW_BENCH_KEY": _engine_key(tmp_path, "node-a")}
        args = ["--steps", "1,2", "--requests-per-step", "4", "--max-tokens", "16", "--ttft-p99", "20s"]
        bench = subprocess.run(
            llmgw_cmd(
                "ctl", "bench", "tiny", "--target", endpoint + "/", *args, "--tpot-p99", "2s", "--save",
                "--server", gw.admin, "--token-file", str(gw.token_file),
            ),
            capture_output=True, text=True, timeout=300, env=env,
        )  # fmt: skip
        assert bench.returncode == 0, bench.stdout + bench.stderr
        assert "last level that held: 2 concurrent" in bench.stdout, bench.stdout
        assert "\nweight: 2  " in bench.stdout
        assert bench.stderr.strip().splitlines()[-1] == "saved: tiny on profile llamacpp-cpu, 2 concurrent at the SLO"

        shown = gw.ctl("capacity")
        assert shown.returncode == 0, shown.stderr
        header, row = shown.stdout.splitlines()
        assert re.split(r"\s{2,}", header.strip()) == [
            "MODEL", "PROFILE", "CONCURRENT", "TOK/S", "TTFT p99", "TPOT p99", "WAIT", "KV", "MEASURED", "BY"
        ]  # fmt: skip
        cells = re.split(r"\s{2,}", row.strip())
        assert (
            cells[:3] == ["tiny", "llamacpp-cpu", "2"]
            and cells[-2].endswith("s ago")
            and cells[-1].startswith("token ")
        )

        # The replica's endpoint took it: admission's limit and routing's weight; explain-placement says it.
        eps = [e for e in fleet.api("/api/v1/endpoints")["endpoints"] if e["url"] == endpoint]
        assert [(e["capacity"], e["weight"]) for e in eps] == [(2, 2.0)]
        explained = gw.ctl("explain-placement", "tiny")
        assert "  capacity measured " in explained.stdout and "2 concurrent at the SLO" in explained.stdout

        # Six clients sending back to back through the gateway: two at the replica, the rest held.
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=gw.create_key(), max_retries=0, timeout=120)
        stop = threading.Event()
        statuses: list[int] = []

        def send() -> None:
            while not stop.is_set():
                reply = client.chat.completions.with_raw_response.create(
                    model="tiny", max_tokens=64, messages=[{"role": "user", "content": "count to a hundred"}]
                )
                statuses.append(reply.status_code)

        threads = [threading.Thread(target=send) for _ in range(6)]
        for t in threads:
            t.start()
        try:

            def held() -> bool:
                text = httpx.get(gw.admin + "/metrics", headers=gw.admin_auth, timeout=10).text
                depth = _gauge(text, "llmgw_admission_queue_depth", "tiny")
                saturation = _gauge(text, "llmgw_pool_saturation", "tiny")
                return depth is not None and depth >= 1 and saturation is not None and saturation >= 1.0

            fleet.wait(held, 60, "tiny's pool saturated at its measured 2 and requests held in admission's queue")
        finally:
            stop.set()
            for t in threads:
                t.join(120)
        assert statuses and set(statuses) == {200}
    finally:
        for p in (agent, gw):
            if p.alive():
                p.stop()
        if pid and _alive(pid):
            os.killpg(pid, signal.SIGKILL)  # agents leave engines running on purpose; a test must not
        stop_files()
