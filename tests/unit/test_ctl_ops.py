"""`llmgw ctl status`, `ctl usage`, `ctl weights` and `ctl engine-check` against a real in-process
control plane (or plain gateway), with fake agents speaking the real protocol over the agent stream;
the command runs as typer runs it, in a thread so the server keeps answering."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import aiohttp
from typer.testing import CliRunner

from llmgw.cli.main import app
from llmgw.config.server import parse_server_config
from llmgw.protocol import (
    PROTOCOL_VERSION,
    STREAM_PATH,
    Ack,
    FabricAttachment,
    Heartbeat,
    LocalWeights,
    MemoryInfo,
    NodeInventory,
    ProvisionState,
    ProvisionStatus,
    Register,
    RemoveWeights,
    ShardState,
    ShardStatus,
    StartShard,
    StopShard,
    decode,
    encode,
)
from llmgw.protocol.inventory import Host
from llmgw.protocol.weights_names import cache_name_of
from llmgw.server.app import Server
from llmgw.store import UsageRow
from llmgw.testing.agent_process import AgentProcess, local_agent_config
from llmgw.testing.ports import free_port as _port
from llmgw.testing.waiting import async_until

GiB = 2**30
runner = CliRunner()
CACHE = "/var/lib/llmgw/models"  # where the fake agents say their weights cache is


class FleetAgent:
    """An agent on the real stream: registers with fabrics and weights, beats (its weights each time),
    runs shards as told (``fail`` makes every shard fail with that reason), and removes weights when
    asked (a path in ``keep`` is refused in the agent's words, as one it did not fetch would be)."""

    def __init__(
        self,
        srv: Server,
        node_id: str,
        *,
        fabrics: list[str] = (),
        weights: dict[str, int] | None = None,
        fail: str | None = None,
        failed_install: str | None = None,
        labels: dict[str, str] | None = None,
    ) -> None:
        self.url = f"http://127.0.0.1:{srv.config.agent_listen.port}{STREAM_PATH}"
        self.node_id = node_id
        self.fabrics = list(fabrics)
        self.weights = dict(weights or {})
        self.fail = fail
        self.failed_install = failed_install
        self.labels = labels or {}
        self.keep: set[str] = set()
        self.hold_stops = False  # True: its engines never finish stopping
        self.started: list[StartShard] = []
        self.asked_to_remove: list[list[str]] = []
        self._tasks: list[asyncio.Task] = []
        self._stopping = asyncio.Event()

    def _weights(self) -> list[LocalWeights]:
        return [LocalWeights(path=p, size_bytes=n) for p, n in sorted(self.weights.items())]

    async def start(self) -> FleetAgent:
        self.http = aiohttp.ClientSession()
        self.ws = await self.http.ws_connect(self.url)
        await self.ws.send_bytes(
            encode(
                Register(
                    node_id=self.node_id,
                    protocol_version=PROTOCOL_VERSION,
                    agent_version="9.9.9",
                    features=["logs", "remove-weights", "drain"],
                    inventory=NodeInventory(
                        host=Host(hostname=self.node_id, arch="amd64", cpus=8),
                        memory=MemoryInfo(total_bytes=64 * GiB, available_bytes=60 * GiB),
                        gpus=[],
                    ),
                    engine_versions={"llamacpp": "b10991"},
                    labels=self.labels,
                    fabrics=[FabricAttachment(fabric=f, hcas=["mlx5_0"]) for f in self.fabrics],
                    weights=self._weights(),
                )
            )
        )
        self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._beat())]
        return self

    async def _beat(self) -> None:
        while not self._stopping.is_set():
            provision = None
            if self.failed_install:
                provision = [
                    ProvisionStatus(
                        engine="vllm", version="0.11.0", state=ProvisionState.FAILED, detail=self.failed_install
                    )
                ]
            await self.ws.send_bytes(
                encode(Heartbeat(node_id=self.node_id, weights=self._weights(), provision=provision))
            )
            try:
                await asyncio.wait_for(self._stopping.wait(), 0.2)
            except TimeoutError:
                pass

    async def _read(self) -> None:
        async for frame in self.ws:
            if frame.type not in (aiohttp.WSMsgType.BINARY, aiohttp.WSMsgType.TEXT):
                continue
            msg = decode(frame.data, sender="control")
            if isinstance(msg, StartShard):
                self.started.append(msg)
                await self.ws.send_bytes(encode(Ack(id=msg.id, ok=True)))
                state, reason = (ShardState.FAILED, self.fail) if self.fail else (ShardState.LOADING, None)
                await self.ws.send_bytes(
                    encode(ShardStatus(shard_id=msg.shard_id, replica_id=msg.replica_id, state=state, reason=reason))
                )
            elif isinstance(msg, StopShard):
                # An agent acks a stop once its engine has stopped: a held stop is not acked (yet).
                if not self.hold_stops:
                    await self.ws.send_bytes(encode(Ack(id=msg.id, ok=True)))
                    await self.ws.send_bytes(encode(ShardStatus(shard_id=msg.shard_id, state=ShardState.STOPPED)))
            elif isinstance(msg, RemoveWeights):
                self.asked_to_remove.append(list(msg.paths))
                refused = [p for p in msg.paths if p in self.keep]
                for p in msg.paths:
                    if p not in self.keep:
                        self.weights.pop(p, None)
                error = "; ".join(f"{p} is not in the weights cache; nothing was removed" for p in refused)
                await self.ws.send_bytes(encode(Ack(id=msg.id, ok=not refused, error=error or None)))
            elif msg.id:
                await self.ws.send_bytes(encode(Ack(id=msg.id, ok=True)))

    async def stop(self) -> None:
        self._stopping.set()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.ws.close()
        await self.http.close()


def _config(tmp_path: Path, models: list[dict], *, control: bool = True, pricing: bool = False):
    auth: dict = {"store": str(tmp_path / "gw.db")}
    if pricing:
        auth["default_price"] = {"prompt_per_1k": 1.0, "completion_per_1k": 2.0}
    return parse_server_config(
        {
            "listen": f"127.0.0.1:{_port()}",
            "admin_listen": f"127.0.0.1:{_port()}",
            "metrics_listen": None,
            "agent_listen": f"127.0.0.1:{_port()}",
            "agent_tls": None,
            "control": {"enabled": control, "unreachable_after": "1s", "lost_after": "60s", "interval": "200ms"},
            "engines": {"llamacpp": None},
            "auth": auth,
            "data_dir": str(tmp_path),
            "models": models,
        }
    )


def _managed(name: str, source: str, min_: int = 1, on: str | None = None) -> dict:
    profile: dict = {"engine": "llamacpp"}
    if on:
        profile["node_selector"] = {"role": on}
    return {"name": name, "source": source, "scaling": {"min": min_}, "profiles": [profile]}


async def _server(tmp_path: Path, models: list[dict], **kw) -> Server:
    srv = Server(_config(tmp_path, models, **kw))
    await srv.start()
    return srv


async def ctl(srv: Server, *args: str):
    """`llmgw ctl ARGS` against the server's admin API with its first token."""
    admin = f"http://127.0.0.1:{srv.config.admin_listen.port}"
    argv = ["ctl", *args, "--server", admin, "--token-file", str(srv.admin_token_file)]
    return await asyncio.to_thread(runner.invoke, app, argv)


# -- ctl status


async def test_status_of_an_empty_cluster_says_how_to_add_a_node_and_a_model(tmp_path):
    srv = await _server(tmp_path, [])
    try:
        r = await ctl(srv, "status")
        assert r.exit_code == 0, r.output
        assert "control plane" in r.output.splitlines()[0]
        assert "no nodes have joined: run `llmgw node add HOST`" in r.output
        assert "no models: add one with `llmgw ctl model add -f model.yaml`" in r.output
        assert "failing" not in r.output
    finally:
        await srv.stop()


async def test_status_of_a_gateway_without_a_control_plane_says_so_and_counts_its_endpoints(tmp_path):
    models = [{"name": "m", "endpoints": [{"url": "http://127.0.0.1:9", "engine": "llamacpp"}]}]
    srv = await _server(tmp_path, models, control=False)
    try:
        r = await ctl(srv, "status")
        assert r.exit_code == 0, r.output
        assert "gateway without a control plane (control.enabled is false in server.yaml)" in r.output
        assert "  m: 0/1 endpoints available" in r.output
        got = json.loads((await ctl(srv, "status", "--json")).output)
        assert got["control_plane"] is False and got["endpoints"] == 1 and "nodes" not in got
    finally:
        await srv.stop()


async def test_status_shows_nodes_by_state_models_against_target_models_per_fabric_and_what_fails(tmp_path):
    models = [
        _managed("tiny", "http://mirror.example/tiny/1/tiny.gguf", on="a"),
        _managed("broken", "http://mirror.example/broken/1/broken.gguf", on="b"),
        _managed("later", "http://mirror.example/later/1/later.gguf", min_=0),
    ]
    srv = await _server(tmp_path, models)
    a = await FleetAgent(srv, "node-a", fabrics=["ib0"], labels={"role": "a"}).start()
    b = await FleetAgent(
        srv,
        "node-b",
        fabrics=["ib0"],
        labels={"role": "b"},
        fail="llama-server exited with status 1: cannot load the model",
        failed_install="no GPU for vLLM here",
    ).start()
    gone = await FleetAgent(srv, "node-c", fabrics=["ib0", "ib1"]).start()
    try:
        await async_until(lambda: len(srv.agents.nodes()) == 3, 10, "three nodes to register")
        await gone.stop()
        await async_until(
            lambda: srv.reconciler.node_state(srv.agents.get("node-c")).value == "unreachable",
            10,
            "node-c to be unreachable",
        )
        await async_until(lambda: a.started, 20, "tiny to be started on node-a")
        await async_until(
            lambda: (
                srv.reconciler.model_status("broken")["backoff"] is not None
                and any(r["state"] == "failed" for r in srv.reconciler.replica_rows("broken"))
            ),
            20,
            "broken to fail on node-b and back off",
        )
        assert (await ctl(srv, "cordon", "node-b")).exit_code == 0
        r = await ctl(srv, "status")
        assert r.exit_code == 0, r.output
        out = r.output
        assert "nodes: 3 (1 ready, 1 cordoned, 1 unreachable)" in out
        assert "  tiny    0/1 replicas ready (1 loading)" in out
        assert "  later   0/0 replicas ready; on demand" in out
        assert "fabric ib0: 1 model on 1/3 nodes (tiny)" in out
        assert "fabric ib1: 0 models on 0/1 nodes" in out
        failing = out.split("failing:\n", 1)[1]
        assert "node-b failed: llama-server exited with status 1: cannot load the model" in failing
        assert "  node node-c: unreachable; last seen" in failing
        assert "  engine node-b: vllm 0.11.0 failed to install: no GPU for vLLM here" in failing
        assert "  model broken: 1 failed start(s) in a row, next attempt in" in failing
        got = json.loads((await ctl(srv, "status", "--json")).output)
        assert got["nodes"] == {"ready": 1, "cordoned": 1, "unreachable": 1}
        assert {f["fabric"]: (f["models"], f["nodes_used"], f["nodes_total"]) for f in got["fabrics"]} == {
            "ib0": (["tiny"], 1, 3),
            "ib1": ([], 0, 1),
        }
        assert {t["kind"] for t in got["failing"]} == {"replica", "node", "engine", "model"}
    finally:
        await a.stop()
        await b.stop()
        await srv.stop()


# -- ctl usage


async def test_usage_by_team_is_the_sum_of_the_usage_rows_with_the_budget_the_team_itself_sets(tmp_path):
    srv = await _server(tmp_path, [], pricing=True)
    store = srv.store
    try:
        org = await store.add_org("acme")
        infra = await store.add_team("infra", org.id)
        research = await store.add_team("research", org.id)
        await store.set_limits("team", infra.id, budget_micros=50_000_000, period="month")
        await store.set_limits("org", org.id, budget_micros=900_000_000, period="day")  # not the team's own
        now = datetime.now(UTC)

        def row(team: str | None, prompt: int, completion: int, cost: int, ago: timedelta) -> UsageRow:
            return UsageRow(
                model="m",
                endpoint="e",
                status=200,
                latency_ms=1,
                at=now - ago,
                org_id=org.id if team else None,
                team_id=team,
                prompt_tokens=prompt,
                completion_tokens=completion,
                cost_micros=cost,
            )

        rows = [
            row(infra.id, 100, 10, 1_250_000, timedelta(hours=1)),
            row(infra.id, 200, 20, 2_500_000, timedelta(days=2)),
            row(research.id, 7, 3, 4_000, timedelta(minutes=5)),
            row(None, 50, 5, 0, timedelta(hours=3)),
            row(infra.id, 999, 999, 999_999, timedelta(days=10)),  # before --since 7d
        ]
        await store.insert_usage(rows)
        recent = [r for r in rows if r.at > now - timedelta(days=7)]

        def sums(team: str | None) -> tuple[int, int, int, int]:
            mine = [r for r in recent if r.team_id == team]
            return (
                len(mine),
                sum(r.prompt_tokens for r in mine),
                sum(r.completion_tokens for r in mine),
                sum(r.cost_micros for r in mine),
            )

        r = await ctl(srv, "usage", "--by", "team", "--since", "7d", "--json")
        assert r.exit_code == 0, r.output
        got = json.loads(r.output)
        by_id = {g["id"]: g for g in got["groups"]}
        assert set(by_id) == {infra.id, research.id, None}
        for team in (infra.id, research.id, None):
            g = by_id[team]
            assert (g["requests"], g["tokens_in"], g["tokens_out"], g["spend_micros"]) == sums(team)
        assert (by_id[infra.id]["budget_micros"], by_id[infra.id]["budget_period"]) == (50_000_000, "month")
        assert "budget_micros" not in by_id[research.id] and "budget_micros" not in by_id[None]
        assert [g["label"] for g in got["groups"]] == ["acme/infra", "acme/research", "no team"]

        table = (await ctl(srv, "usage", "--by", "team", "--since", "7d")).output.splitlines()
        assert table[0].startswith("usage by team since ")
        line = {cells.split()[0]: cells.split() for cells in table[2:]}
        assert line["acme/infra"] == ["acme/infra", "2", "300", "30", "3.75", "50.00", "a", "month"]
        assert line["acme/research"] == ["acme/research", "1", "7", "3", "0.004", "-"]
        assert line["total"] == ["total", "4", "357", "38", "3.75"]
        # The organization's own budget shows beside the organization.
        org_rows = json.loads((await ctl(srv, "usage", "--by", "org", "--since", "30d", "--json")).output)["groups"]
        acme = next(g for g in org_rows if g["id"] == org.id)
        assert (acme["requests"], acme["budget_micros"], acme["budget_period"]) == (4, 900_000_000, "day")
    finally:
        await srv.stop()


async def test_usage_refuses_an_unknown_level_and_a_since_it_cannot_read_saying_what_to_write(tmp_path):
    import httpx

    from llmgw.testing.admin import admin_headers

    srv = await _server(tmp_path, [])
    try:
        r = await ctl(srv, "usage", "--by", "model")
        assert r.exit_code == 1 and '--by "model": group usage by one of org, team, project, person' in r.output
        r = await ctl(srv, "usage", "--by", "team", "--since", "last tuesday")
        assert r.exit_code == 1 and "write how far back, like 30m, 24h, 7d or 2w" in r.output
        r = await ctl(srv, "usage", "--by", "team", "--since", "2999-01-01")
        assert r.exit_code == 1 and "is not in the past" in r.output
        r = await ctl(srv, "usage", "--by", "team", "--since", "2025-03-01")
        assert r.exit_code == 0 and r.output.startswith("no usage since 2025-03-01 00:00 UTC")
        admin = f"http://127.0.0.1:{srv.config.admin_listen.port}"
        async with httpx.AsyncClient(base_url=admin, headers=admin_headers(srv)) as http:
            got = await http.get("/api/v1/usage", params={"by": "key"})
            assert got.status_code == 400 and "group usage by one of org, team, project, person" in got.text
            got = await http.get("/api/v1/usage", params={"by": "team", "since": "soon"})
            assert got.status_code == 400 and "is not an ISO 8601 time" in got.text
    finally:
        await srv.stop()


# -- ctl weights


def _cached(source: str) -> str:
    return f"{CACHE}/{cache_name_of(source)}"


KEPT = "http://mirror.example/kept/1/kept.gguf"
DROPPED = "http://mirror.example/dropped/1/dropped.gguf"
OLD_SET = "http://mirror.example/old/2/"


async def test_weights_lists_per_node_the_fetched_files_no_model_needs_and_collect_asks_only_for_those(tmp_path):
    srv = await _server(tmp_path, [_managed("kept", KEPT, min_=0)])
    a = await FleetAgent(
        srv,
        "node-a",
        weights={_cached(KEPT): 4_000_000_000, _cached(DROPPED): 1_500_000_000, _cached(OLD_SET): 500_000_000},
    ).start()
    b = await FleetAgent(
        srv,
        "node-b",
        # A file an agent of another release might list outside the cache's names is never llmgw's.
        weights={_cached(DROPPED): 1_500_000_000, f"{CACHE}/my-own-model.gguf": 7},
    ).start()
    b.keep.add(_cached(DROPPED))  # node-b's agent refuses it (it decides)
    try:
        await async_until(lambda: len(srv.agents.nodes()) == 2, 10, "two nodes to register")
        r = await ctl(srv, "weights")
        assert r.exit_code == 0, r.output
        lines = r.output.splitlines()
        assert lines[0].split() == ["NODE", "SIZE", "FILE"]
        assert sorted(line.split() for line in lines[1:4]) == [
            ["node-a", "1.5", "GB", _cached(DROPPED)],
            ["node-a", "500", "MB", _cached(OLD_SET)],
            ["node-b", "1.5", "GB", _cached(DROPPED)],
        ]
        assert lines[4].startswith("3 files (3.5 GB) no model needs on 2 nodes; not shown: 1 file (4.0 GB) that models")
        assert "my-own-model" not in r.output
        got = json.loads((await ctl(srv, "weights", "--json")).output)
        files = {(n["node"], f["path"]): f["used_by"] for n in got["nodes"] for f in n["files"]}
        assert files[("node-a", _cached(KEPT))] == ["kept"]

        r = await ctl(srv, "weights", "--collect")
        assert r.exit_code == 0, r.output
        assert [sorted(paths) for paths in a.asked_to_remove] == [sorted([_cached(DROPPED), _cached(OLD_SET)])]
        assert b.asked_to_remove == [[_cached(DROPPED)]]
        assert "node-a: asked to remove 2 files (2.0 GB)" in r.output
        assert "node-b: kept some: " + _cached(DROPPED) + " is not in the weights cache" in r.output
        assert "asked to remove 3 files (3.5 GB) on 2 nodes; each node removes only what it fetched itself" in r.output
        # The nodes' next heartbeats say what is left: node-a kept only what a model needs.
        await async_until(
            lambda: [w.path for w in srv.agents.get("node-a").weights] == [_cached(KEPT)],
            10,
            "node-a's heartbeat without the removed files",
        )
        r = await ctl(srv, "weights")
        assert r.output.splitlines()[1].split() == ["node-b", "1.5", "GB", _cached(DROPPED)]
    finally:
        await a.stop()
        await b.stop()
        await srv.stop()


async def test_weights_a_replica_still_stopping_needs_is_kept_and_a_disconnected_node_is_not_asked(tmp_path):
    import yaml

    srv = await _server(tmp_path, [])
    a = await FleetAgent(srv, "node-a", labels={"role": "a"}, weights={_cached(KEPT): 10}).start()
    a.hold_stops = True  # its engine takes its time to stop
    c = await FleetAgent(srv, "node-c", weights={_cached(DROPPED): 20}).start()
    try:
        spec = tmp_path / "kept.yaml"
        spec.write_text(yaml.safe_dump(_managed("kept", KEPT, on="a")))
        assert (await ctl(srv, "model", "add", "-f", str(spec), "--no-source-check")).exit_code == 0
        await async_until(lambda: a.started, 20, "kept to be started on node-a")
        rid = a.started[0].replica_id
        assert (await ctl(srv, "model", "remove", "kept")).exit_code == 0
        await async_until(
            lambda: any(r["state"] == "stopping" for r in srv.reconciler.replica_rows()), 10, "the replica to stop"
        )
        await async_until(lambda: len(srv.agents.nodes()) == 2, 10, "both nodes to register")
        got = json.loads((await ctl(srv, "weights", "--json")).output)
        used = {f["path"]: f["used_by"] for n in got["nodes"] for f in n["files"]}
        assert used == {_cached(KEPT): [f"replica {rid}"], _cached(DROPPED): []}
        await c.stop()
        await async_until(lambda: not srv.agents.is_connected("node-c"), 10, "node-c's stream to close")
        r = await ctl(srv, "weights", "--collect")
        assert r.exit_code == 1
        assert "node-c: not asked: node node-c is not connected" in r.output
        assert "asked to remove 0 files (0 B) on 0 nodes" in r.output
        assert a.asked_to_remove == []
    finally:
        await a.stop()
        await srv.stop()


async def test_weights_on_a_gateway_without_a_control_plane_says_there_are_no_nodes(tmp_path):
    srv = await _server(tmp_path, [], control=False)
    try:
        r = await ctl(srv, "weights")
        assert r.exit_code == 1 and "this server is not a control plane; set control.enabled: true" in r.output
    finally:
        await srv.stop()


# -- ctl engine-check


def test_ctl_engine_check_is_the_agents_check_with_the_same_verdict_and_words(tmp_path):
    help_text = (Path(__file__).resolve().parents[1] / "fixtures" / "engines" / "llama-server-help.txt").read_text()
    good = tmp_path / "llama-server"
    good.write_text("#!/bin/sh\ncat <<'EOF'\n" + help_text + "\nEOF\n")
    good.chmod(0o755)
    cut = tmp_path / "old-llama-server"
    cut.write_text("#!/bin/sh\necho '--model FNAME  model path'\n")
    cut.chmod(0o755)
    for binary, code in ((good, 0), (cut, 1)):
        for extra in ((), ("--json",)):
            ours = runner.invoke(app, ["ctl", "engine-check", "llamacpp", "--bin", str(binary), *extra])
            agents = runner.invoke(app, ["agent", "engine-check", "llamacpp", "--bin", str(binary), *extra])
            assert ours.exit_code == agents.exit_code == code, ours.output
            assert ours.output == agents.output
    ok = runner.invoke(app, ["ctl", "engine-check", "llamacpp", "--bin", str(good)])
    assert "llamacpp: all 8 flags llmgw passes are in" in ok.output
    unknown = runner.invoke(app, ["ctl", "engine-check", "tgi", "--bin", str(good)])
    assert unknown.exit_code == 1 and "tgi" in unknown.output


async def test_weights_collect_on_a_real_agent_removes_a_removed_models_files_and_never_an_operators(tmp_path):
    """The real `llmgw agent` process: its cache holds a file a catalog model needs, a file and a set
    directory no model needs any more, and an operator's file beside them; a model directory holds
    another of the operator's. Collecting removes exactly the two unneeded entries."""

    from llmgw.agent.weights import COMPLETE_MARKER, cache_name

    cache, own_dir = tmp_path / "weights", tmp_path / "own-models"
    cache.mkdir()
    own_dir.mkdir()
    (cache / cache_name(KEPT)).write_bytes(b"GGUF kept")
    (cache / cache_name(DROPPED)).write_bytes(b"GGUF dropped" * 100)
    old_set = cache / cache_name(OLD_SET)
    old_set.mkdir()
    (old_set / "model-00001-of-00002.safetensors").write_bytes(b"x" * 300)
    (old_set / COMPLETE_MARKER).write_bytes(b"")
    operators = [cache / "my-finetune.gguf", own_dir / "their-own.gguf"]
    for path in operators:
        path.write_bytes(b"GGUF the operator's")

    srv = await _server(tmp_path, [_managed("kept", KEPT, min_=0)])
    agent = AgentProcess(
        tmp_path,
        local_agent_config(tmp_path, srv.config.agent_listen.port, weights_cache=str(cache), model_dirs=[str(own_dir)]),
    )
    proc = await agent.start()
    agent_log = agent.log

    try:
        await async_until(
            lambda: (n := srv.agents.get("real-a")) is not None and n.weights,
            30,
            "the agent to register with its weights",
            detail=agent_log,
            alive=[proc],
        )
        r = await ctl(srv, "weights")
        assert r.exit_code == 0, r.output
        listed = {line.split()[-1] for line in r.output.splitlines()[1:-1]}
        assert listed == {str(cache / cache_name(DROPPED)), str(old_set)}
        r = await ctl(srv, "weights", "--collect")
        assert r.exit_code == 0, r.output + agent_log()
        assert "real-a: asked to remove 2 files" in r.output and "kept some" not in r.output
        assert not (cache / cache_name(DROPPED)).exists() and not old_set.exists()
        assert (cache / cache_name(KEPT)).read_bytes() == b"GGUF kept"
        assert all(p.read_bytes() == b"GGUF the operator's" for p in operators)
        await async_until(
            lambda: [w.path for w in srv.agents.get("real-a").weights] == [str(cache / cache_name(KEPT))],
            10,
            "the agent's heartbeat to list only the kept file",
            detail=agent_log,
        )
    finally:
        await agent.stop()
        await srv.stop()
