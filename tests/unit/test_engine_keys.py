"""Engines cannot be called around the gateway: each replica's engine requires a secret of its own,
made by the control plane, carried to the agent, given to the engine, and sent only by the gateway.
Nothing shows it: logs, command lines shown, engine output tails, the replicas listing."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import stat
import sys
from pathlib import Path

import aiohttp
import pytest

from llmgw.agent.engines import (
    GPU,
    EngineSettings,
    Group,
    LaunchRefused,
    NodeFacts,
    Profile,
    ShardLaunch,
    adapter_for,
    engine_check,
    plan_shard,
    probe,
)
from llmgw.agent.supervisor import ShardSpec, Supervisor, _quote
from llmgw.config import parse_server_config
from llmgw.config.errors import ConfigError
from llmgw.config.server import ModelConfig, ServerConfig
from llmgw.files import write_secret_file
from llmgw.protocol import (
    PROTOCOL_VERSION,
    Ack,
    EngineProfile,
    MemoryInfo,
    NodeInventory,
    Register,
    RunningShard,
    ShardState,
    ShardStatus,
    StartShard,
)
from llmgw.protocol.codec import decode, encode
from llmgw.server.app import Server, StartError
from llmgw.server.control.agents import AgentService
from llmgw.server.control.catalog import Catalog
from llmgw.server.control.reconciler import ENGINE_KEY_PREFIX, Reconciler
from llmgw.server.gateway.endpoints import Endpoint, EndpointSet
from llmgw.testing.fake_engine import FakeEngine
from llmgw.testing.waiting import async_until

KEY = "llmgw-engine-0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJ"
FIX = Path(__file__).resolve().parents[1] / "fixtures" / "engines"
H100 = "NVIDIA H100 80GB HBM3"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def no_key_in(records: list[logging.LogRecord], key: str = KEY) -> None:
    leaked = [r.getMessage() for r in records if key in r.getMessage()]
    assert not leaked, leaked


# ------------------------------------------------------------------ adapters


def launch(engine: str, *, rank: int = 0, nodes: int = 1, api_key: str | None = KEY, **profile) -> ShardLaunch:
    gpu, multi = engine != "llamacpp", nodes > 1
    return ShardLaunch(
        shard_id="s1",
        engine=engine,
        model="/models/m" if gpu else "/w/m.gguf",
        served_name="m",
        port=8001,
        profile=Profile(tp=4 * nodes if gpu else 1, nodes=nodes, gpu_ids=[0, 1, 2, 3] if gpu else [], **profile),
        group=Group(rank=rank, leader_addr="10.0.0.10" if multi else None, leader_port=20001 if multi else None),
        node=NodeFacts(gpus=[GPU(index=i, name=H100, compute_capability="9.0") for i in range(8)], interface="ens3"),
        api_key=api_key,
    )


def test_llama_server_gets_its_key_in_the_environment_and_not_on_its_command_line():
    plan = plan_shard(launch("llamacpp"))
    assert plan.main.env["LLAMA_API_KEY"] == KEY
    assert not any(KEY in a for a in plan.main.argv) and "--api-key" not in plan.main.argv
    # The agent's readiness probe sends it too: llama-server wants it for /v1/models.
    assert plan.health is not None and plan.health.api_key == KEY
    assert KEY not in repr(plan) and KEY not in repr(launch("llamacpp"))


def test_vllm_gets_its_key_in_the_environment_of_the_process_that_serves_http():
    plan = plan_shard(launch("vllm"))
    assert plan.main.env["VLLM_API_KEY"] == KEY and not any(KEY in a for a in plan.main.argv)
    mp_settings = EngineSettings(vllm_launch_mode="mp")
    leader = plan_shard(launch("vllm", nodes=2, rank=0), mp_settings).main
    worker = plan_shard(launch("vllm", nodes=2, rank=1), mp_settings).main
    assert leader.env["VLLM_API_KEY"] == KEY
    assert "VLLM_API_KEY" not in worker.env and "--headless" in worker.argv  # a headless rank serves nothing
    ray = EngineSettings(vllm_launch_mode="ray")
    head, serve = plan_shard(launch("vllm", nodes=2, rank=0), ray).commands
    assert serve.env["VLLM_API_KEY"] == KEY and "VLLM_API_KEY" not in head.env
    assert "VLLM_API_KEY" not in plan_shard(launch("vllm", nodes=2, rank=1), ray).main.env


def test_sglang_reads_no_key_variable_so_its_leader_gets_the_flag():
    argv = plan_shard(launch("sglang")).main.argv
    assert argv[argv.index("--api-key") + 1] == KEY
    assert "--api-key" not in plan_shard(launch("sglang", nodes=2, rank=1)).main.argv
    assert "--api-key" in plan_shard(launch("sglang", nodes=2, rank=0)).main.argv


def test_a_shard_started_without_a_key_gives_its_engine_none():
    for engine in ("llamacpp", "vllm", "sglang"):
        main = plan_shard(launch(engine, api_key=None)).main
        assert "--api-key" not in main.argv
        assert not {"LLAMA_API_KEY", "VLLM_API_KEY"} & set(main.env)


@pytest.mark.parametrize(
    "engine, args, env",
    [
        ("llamacpp", ["--api-key", "mine"], {}),
        ("llamacpp", ["--api-key-file=/etc/k"], {}),
        ("llamacpp", [], {"LLAMA_API_KEY": "mine"}),
        ("vllm", ["--api-key", "mine"], {}),
        ("vllm", [], {"VLLM_API_KEY": "mine"}),
        ("sglang", ["--api-key=mine"], {}),
    ],
)
def test_a_profile_cannot_give_the_engine_another_key(engine, args, env):
    with pytest.raises(LaunchRefused) as exc:
        plan_shard(launch(engine, extra_args=args, env=env))
    assert "the replica's own key, which only the gateway sends" in str(exc.value)


def test_engine_check_proves_the_key_reaches_each_engine():
    # SGLang takes it as a flag, which its help must still list.
    assert "--api-key" in adapter_for("sglang").check_flags()
    text = (FIX / "llama-server-help.txt").read_text()
    assert engine_check("llamacpp", text).ok
    # A build that stopped reading LLAMA_API_KEY would start and serve anyone.
    gone = engine_check("llamacpp", text.replace("(env: LLAMA_API_KEY)", "(env: LLAMA_ARG_API_KEY_X)"))
    assert gone.missing == ["LLAMA_API_KEY"]
    assert "so this build would serve anyone without one" in gone.problems[0]


async def test_the_agents_readiness_probe_sends_the_key():
    async with FakeEngine(model="m", api_key=KEY) as fe, aiohttp.ClientSession() as http:
        check = plan_shard(launch("llamacpp").model_copy(update={"port": fe.port, "host": "127.0.0.1"})).health
        assert check is not None
        assert (await probe(check, http)).ready
        without = await probe(type(check)(check.host, check.port, check.model), http)
        assert not without.ready and "401" in without.detail


# ------------------------------------------------------------------ supervisor

# Prints its command line (as SGLang prints its server arguments) and serves as the fake engine.
CHATTY = (
    "import sys; print('args:', sys.argv[1:], flush=True); "
    "from llmgw.testing.fake_engine import main; main(sys.argv[1:])"
)


@pytest.fixture
async def sup(tmp_path):
    made: list[Supervisor] = []

    def make() -> Supervisor:
        s = Supervisor(
            tmp_path / "state",
            health_interval=0.05,
            poll_interval=0.05,
            log_interval=0.05,
            stop_timeout=5.0,
            http_timeout=2.0,
        )
        made.append(s)
        return s

    yield make
    for s in made:
        for st in s.statuses():
            if st.state.running:
                await s.stop(st.shard_id, timeout=2)
        await s.close()


def keyed_spec(port: int) -> ShardSpec:
    return ShardSpec(
        shard_id="k1",
        argv=[sys.executable, "-c", CHATTY, "--port", str(port), "--model", "m", "--api-key", KEY],
        env={"LLAMA_API_KEY": KEY},
        base_url=f"http://127.0.0.1:{port}",
        model="m",
        api_key=KEY,
    )


async def test_a_keyed_engine_is_ready_and_adopted_and_its_key_is_never_shown(sup, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    spec = keyed_spec(_port())
    s1 = sup()
    await s1.start(spec)
    st = await s1.wait("k1", ShardState.READY, timeout=30)
    assert st.state is ShardState.READY, st
    await async_until(lambda: any("args:" in line for line in s1.tail("k1")), what="the engine's own output")
    tail = "\n".join(s1.tail("k1"))
    # The supervisor's own line and the engine printing its arguments are both masked.
    assert "--api-key [hidden]" in tail and "'--api-key', '[hidden]'" in tail and KEY not in tail
    log_file = (tmp_path / "state" / "logs" / "k1.log").read_text()
    assert "llmgw: starting shard k1:" in log_file and f"--api-key {KEY}" not in log_file
    record = tmp_path / "state" / "shards" / "k1.json"
    assert stat.S_IMODE(record.stat().st_mode) == 0o600  # it holds the key, for adoption
    assert KEY not in repr(spec) and KEY not in repr(st)

    # A restarted agent adopts the engine and its probes still get through.
    await s1.close()
    s2 = sup()
    report = await s2.adopt()
    assert report.adopted == ["k1"]
    st2 = await s2.wait("k1", ShardState.READY, timeout=30)
    assert st2.state is ShardState.READY and st2.adopted and st2.pid == st.pid
    assert KEY not in "\n".join(s2.tail("k1"))
    no_key_in(caplog.records)


def test_a_command_line_is_shown_without_its_key():
    argv = ["python3", "-m", "sglang.launch_server", "--api-key", KEY, f"--api-key={KEY}", f"x{KEY}y"]
    shown = _quote(argv, [KEY])
    assert KEY not in shown
    assert shown == "python3 -m sglang.launch_server --api-key [hidden] --api-key=[hidden] 'x[hidden]y'"
    # Read from /proc (the sweep), whose key nobody told it: the flag's values are still hidden.
    assert KEY not in _quote(argv[:-1])


# ------------------------------------------------------------------ control plane


class Fleet:
    def __init__(self) -> None:
        self.svc = AgentService()
        self.sent: list[tuple[str, object]] = []
        self.svc.request = self._request  # type: ignore[method-assign]
        self.svc.send = self._send  # type: ignore[method-assign]
        self.svc.is_connected = lambda nid: True  # type: ignore[method-assign]
        self.n = 0

    async def _request(self, node_id, msg, timeout=30.0):
        self.sent.append((node_id, msg))
        return Ack(id="x", ok=True)

    async def _send(self, node_id, msg):
        self.sent.append((node_id, msg))

    def add(self, node_id: str, *, gpus: int = 0, shards: list[RunningShard] | None = None) -> None:
        from llmgw.protocol import GPU as WireGPU
        from llmgw.protocol import FabricAttachment

        self.n += 1
        inv = NodeInventory(
            memory=MemoryInfo(total_bytes=64 << 30),
            gpus=[WireGPU(index=i, name=H100, memory_total_bytes=81559 << 20) for i in range(gpus)],
        )
        self.svc._apply_register(
            Register(
                node_id=node_id,
                protocol_version=PROTOCOL_VERSION,
                agent_version="t",
                features=["logs", "remove-weights", "drain"],
                inventory=inv,
                engine_versions={"llamacpp": "1", "vllm": "1"},
                mgmt_addr=f"10.0.0.{self.n}",
                shards=shards or [],
                fabrics=[FabricAttachment(fabric="ib-a", hcas=[f"mlx5_{self.n}"])] if gpus else None,
            ),
            "10.9.9.9",
        )

    def ready(self, node_id: str, shard_id: str) -> None:
        self.svc._apply_shard(self.svc.get(node_id), ShardStatus(shard_id=shard_id, state=ShardState.READY, pid=7))

    def starts(self) -> list[tuple[str, StartShard]]:
        return [(n, m) for n, m in self.sent if isinstance(m, StartShard)]


def reconciler(fleet: Fleet, models: list[ModelConfig]) -> Reconciler:
    cfg = ServerConfig.model_validate({"control": {"enabled": True}})
    return Reconciler(
        cfg, Catalog(models), fleet.svc, EndpointSet([], 1.0, 10.0, 1.0), clock=lambda: 1000.0, rng=random.Random(3)
    )


def cpu_model(name: str = "m", n: int = 2) -> ModelConfig:
    return ModelConfig.model_validate(
        {
            "name": name,
            "source": "https://example.com/m.gguf",
            "scaling": {"min": n},
            "profiles": [{"engine": "llamacpp"}],
        }
    )


async def settle() -> None:
    # Yields to the loop, so woken tasks run; no clock is involved, so load cannot make it flake.
    for _ in range(5):
        await asyncio.sleep(0)


async def test_each_replica_gets_a_key_of_its_own_that_its_endpoint_sends_and_nothing_shows(caplog):
    caplog.set_level(logging.DEBUG)
    fleet = Fleet()
    fleet.add("n1")
    fleet.add("n2")
    rec = reconciler(fleet, [cpu_model()])
    await rec.tick()
    await settle()
    starts = fleet.starts()
    keys = [m.api_key for _, m in starts]
    assert len(keys) == 2 and len(set(keys)) == 2
    assert all(k and k.startswith(ENGINE_KEY_PREFIX) and len(k) > len(ENGINE_KEY_PREFIX) + 30 for k in keys)
    # It travels on the wire (the protocol only gained a field) and no repr shows it.
    assert decode(encode(starts[0][1])).api_key == keys[0] and keys[0] not in repr(starts[0][1])
    for n, m in starts:
        fleet.ready(n, m.shard_id)
    by_replica = {r.id: r for r in rec.replicas.values()}
    for _, m in starts:
        ep = by_replica[m.replica_id].endpoint
        assert ep is not None and ep.api_key == m.api_key
        assert ep.post_headers == {"Content-Type": "application/json", "Authorization": f"Bearer {m.api_key}"}
    shown = repr(rec.replica_rows()) + repr(list(rec.replicas.values())) + repr(rec.model_status("m"))
    for k in keys:
        assert k not in shown
        no_key_in(caplog.records, k)


async def test_every_shard_of_a_multi_node_replica_carries_the_same_key():
    fleet = Fleet()
    fleet.add("g1", gpus=8)
    fleet.add("g2", gpus=8)
    big = ModelConfig.model_validate(
        {
            "name": "big",
            "source": "org/big",
            "scaling": {"min": 1},
            "profiles": [{"engine": "vllm", "gpu_class": "h100-80g", "tp": 16, "nodes": 2}],
        }
    )
    rec = reconciler(fleet, [big])
    await rec.tick()
    await settle()
    (_, s0), (_, s1) = fleet.starts()
    assert s0.api_key and s0.api_key == s1.api_key


async def test_an_adopted_replica_keeps_the_key_its_engine_was_started_with():
    fleet = Fleet()
    m = cpu_model(n=1)
    rec = reconciler(fleet, [m])
    profile = m.profiles[0]
    spec = StartShard(
        shard_id="m-abc-0",
        replica_id="m-abc",
        model="m",
        engine="llamacpp",
        source=m.source,
        http_port=20500,
        profile=EngineProfile(name=profile.name),
        profile_fp=profile.fingerprint,
        pool="none/cpu",
        api_key=KEY,
    )
    old = spec.model_copy(update={"shard_id": "m-old-0", "replica_id": "m-old", "http_port": 20501, "api_key": None})
    # As the agent sends it: the start request it kept, through the wire.
    reg = RunningShard(shard_id="m-abc-0", replica_id="m-abc", state=ShardState.READY, pid=11, spec=spec)
    reg = decode(encode(Register(node_id="n1", protocol_version=PROTOCOL_VERSION, shards=[reg]))).shards[0]
    fleet.add(
        "n1",
        shards=[reg, RunningShard(shard_id="m-old-0", replica_id="m-old", state=ShardState.READY, pid=12, spec=old)],
    )
    await settle()
    eps = {ep.url: ep for ep in rec.endpoints.endpoints}
    assert eps["http://10.0.0.1:20500"].api_key == KEY
    # An engine from before keys had none and is still reached without one.
    assert eps["http://10.0.0.1:20501"].api_key is None and eps["http://10.0.0.1:20501"].auth_headers is None
    assert rec.replicas["m-abc"].api_key == KEY


async def test_a_multi_node_replica_adopted_worker_first_takes_its_leaders_key():
    fleet = Fleet()
    big = ModelConfig.model_validate(
        {
            "name": "big",
            "source": "org/big",
            "scaling": {"min": 1},
            "profiles": [{"engine": "vllm", "gpu_class": "h100-80g", "tp": 16, "nodes": 2}],
        }
    )
    rec = reconciler(fleet, [big])
    p = big.profiles[0]
    base = dict(
        replica_id="big-1",
        model="big",
        engine="vllm",
        source="org/big",
        nnodes=2,
        leader_port=29500,
        profile=EngineProfile(name=p.name),
        profile_fp=p.fingerprint,
        api_key=KEY,
    )
    leader = StartShard(shard_id="big-1-0", rank=0, http_port=20500, gpus=list(range(8)), **base)
    worker = StartShard(shard_id="big-1-1", rank=1, gpus=list(range(8)), **base)
    fleet.add(
        "g2", gpus=8, shards=[RunningShard(shard_id="big-1-1", replica_id="big-1", state=ShardState.READY, spec=worker)]
    )
    fleet.add(
        "g1", gpus=8, shards=[RunningShard(shard_id="big-1-0", replica_id="big-1", state=ShardState.READY, spec=leader)]
    )
    await settle()
    (ep,) = rec.endpoints.endpoints
    assert ep.api_key == KEY


# ------------------------------------------------------------------ gateway


async def test_scrapes_and_health_checks_send_the_key_and_a_refused_one_takes_the_endpoint_out(caplog):
    caplog.set_level(logging.DEBUG)
    async with FakeEngine(api_key=KEY) as fe:
        good = Endpoint("m", fe.url, "llamacpp", None, api_key=KEY)
        keyless = Endpoint("m", fe.url, "llamacpp", None)
        wrong = Endpoint("m", fe.url, "openai", None, api_key="llmgw-engine-wrong")
        s = EndpointSet([good, keyless, wrong], 0.05, 5.0, 1.0)
        fe.processing = 3
        await s.start()
        try:
            assert good.healthy and good.running == 3.0  # /metrics answered with the key
            # /health is open (llama-server's rule), /metrics is not: the endpoint is out, and says why.
            assert not keyless.healthy and "/metrics answered 401" in keyless.health_detail
            assert "key" in keyless.health_detail
            assert not wrong.healthy and "answered 401" in wrong.health_detail
        finally:
            await s.stop()
    no_key_in(caplog.records)


def _port_cfg(tmp_path: Path, endpoints: list[dict]) -> dict:
    return {
        "listen": f"127.0.0.1:{_port()}",
        "admin_listen": f"127.0.0.1:{_port()}",
        "metrics_listen": None,
        "auth": {"store": str(tmp_path / "gw.db")},
        "data_dir": str(tmp_path / "data"),
        "router": {"scrape_interval": "100ms"},
        "models": [{"name": "m", "endpoints": endpoints}],
    }


async def test_the_gateway_sends_an_operators_engine_its_key_from_a_file(tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    key_file = tmp_path / "engine.key"
    write_secret_file(key_file, KEY)
    async with FakeEngine(api_key=KEY, tokens=3, model="m") as fe:
        server = Server(
            parse_server_config(_port_cfg(tmp_path, [{"url": fe.url, "engine": "llamacpp", "api_key": f"@{key_file}"}]))
        )
        await server.start()
        try:
            secret, _ = await server.store.create_key("t")
            await server.keys.load()
            url = f"http://127.0.0.1:{server.config.listen.port}/v1/chat/completions"
            async with aiohttp.ClientSession() as http:
                async with http.post(
                    url,
                    json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                    headers={"Authorization": f"Bearer {secret}"},
                ) as r:
                    assert r.status == 200, await r.text()
                # The engine on its own answers nobody without the key.
                async with http.get(fe.url + "/v1/models") as r:
                    assert r.status == 401
            chats = [q for q in fe.requests if q.path == "/v1/chat/completions"]
            assert chats and all(q.headers.get("Authorization") == f"Bearer {KEY}" for q in chats)
            # The client's own key never reaches the engine.
            assert all(secret not in str(q.headers) for q in chats)
            assert fe.unauthorized == 1
        finally:
            await server.stop()
    no_key_in(caplog.records)


def test_an_endpoint_key_is_a_file_never_the_key_itself():
    with pytest.raises(ConfigError) as exc:
        parse_server_config(
            {
                "models": [
                    {"name": "m", "endpoints": [{"url": "http://127.0.0.1:8000", "engine": "vllm", "api_key": KEY}]}
                ]
            }
        )
    assert "api_key: must be @/path/to/file" in str(exc.value) and KEY not in str(exc.value)
    cfg = parse_server_config(
        {
            "models": [
                {
                    "name": "m",
                    "endpoints": [
                        {"url": "http://127.0.0.1:8000", "engine": "vllm", "api_key": "@ /etc/llmgw/engine.key"}
                    ],
                }
            ]
        }
    )
    assert cfg.models[0].endpoints[0].api_key == "@/etc/llmgw/engine.key"


def test_a_key_file_others_can_read_or_that_is_missing_stops_the_start(tmp_path):
    key_file = tmp_path / "engine.key"
    key_file.write_text(KEY + "\n")
    os.chmod(key_file, 0o644)
    cfg = _port_cfg(tmp_path, [{"url": "http://127.0.0.1:1", "engine": "llamacpp", "api_key": f"@{key_file}"}])
    with pytest.raises(StartError) as exc:
        Server(parse_server_config(cfg))
    assert f"model m, endpoint http://127.0.0.1:1: api_key: {key_file}: others can read it" in str(exc.value)
    assert KEY not in str(exc.value)
    cfg["models"][0]["endpoints"][0]["api_key"] = f"@{tmp_path / 'missing'}"
    with pytest.raises(StartError, match="no such file"):
        Server(parse_server_config(cfg))


async def test_the_fake_engine_wants_the_key_everywhere_but_health():
    async with FakeEngine(api_key=KEY) as fe, aiohttp.ClientSession() as http:
        async with http.get(fe.url + "/health") as r:
            assert r.status == 200
        for path in ("/metrics", "/v1/models"):
            async with http.get(fe.url + path) as r:
                assert r.status == 401
            async with http.get(fe.url + path, headers={"Authorization": f"Bearer {KEY}"}) as r:
                assert r.status == 200
        async with http.post(
            fe.url + "/v1/chat/completions", json={"messages": []}, headers={"Authorization": "Bearer nope"}
        ) as r:
            assert r.status == 401 and (await r.json())["error"]["type"] == "authentication_error"
