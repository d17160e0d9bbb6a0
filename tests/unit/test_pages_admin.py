"""The administrator's pages (Cluster, a node and its logs, People) against a real in-process control
plane, with a fake agent speaking the real protocol over the agent stream: what each page shows, that
only administrators see them, that every People action works or shows the store's refusal, escaping."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import aiohttp
import httpx
import pytest
from markupsafe import escape

from llmgw.config.server import parse_server_config
from llmgw.protocol import (
    PROTOCOL_VERSION,
    STREAM_PATH,
    Ack,
    FetchProgress,
    Heartbeat,
    LogsReply,
    LogsRequest,
    MemoryInfo,
    NodeInventory,
    NodeLoad,
    ProvisionState,
    ProvisionStatus,
    Register,
    ShardState,
    ShardStatus,
    StartShard,
    Storage,
    decode,
    encode,
)
from llmgw.protocol.inventory import Host
from llmgw.server.app import Server
from llmgw.server.pages.charts import Prometheus
from llmgw.store import UsageRow
from llmgw.testing.fake_engine import FakeEngine
from llmgw.testing.ports import free_port as _port
from llmgw.testing.waiting import async_until
from tests.unit.test_pages import PASSWORD, active_person, base, form_token, sign_in

GiB = 2**30
ADMIN = "root@example.com"
SCRIPT = "<script>alert(1)</script>"


HEARTBEAT_EVERY = 0.2  # seconds between the fake agent's heartbeats


class FakeAgent:
    """An agent on the real stream: registers with an inventory, beats, answers logs, takes shards
    (reporting a download under way) and reports a failed install with its next try."""

    def __init__(self, srv: Server, node_id: str = "node-a") -> None:
        self.url = f"http://127.0.0.1:{srv.config.agent_listen.port}{STREAM_PATH}"
        self.node_id = node_id
        self.started: list[StartShard] = []
        self.logs = {"agent": ["connected to the control plane", f"a line with {SCRIPT}"]}
        self._tasks: list[asyncio.Task] = []
        self._stopping = asyncio.Event()

    async def start(self) -> FakeAgent:
        self.http = aiohttp.ClientSession()
        self.ws = await self.http.ws_connect(self.url)
        inventory = NodeInventory(
            host=Host(hostname="a.example", arch="amd64", cpus=8, cpu_model="Test CPU", cpu_flags=["sse4_2"]),
            memory=MemoryInfo(total_bytes=32 * GiB, available_bytes=24 * GiB),
            storage=[Storage(mount_point="/var/lib/llmgw", total_bytes=100 * GiB, free_bytes=60 * GiB)],
            gpus=[],
        )
        await self.ws.send_bytes(
            encode(
                Register(
                    node_id=self.node_id,
                    protocol_version=PROTOCOL_VERSION,
                    agent_version="9.9.9",
                    features=["logs", "remove-weights", "drain"],
                    inventory=inventory,
                    engine_versions={"llamacpp": "b10991"},
                    labels={"zone": "a"},
                )
            )
        )
        self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._beat())]
        return self

    async def _beat(self) -> None:
        # A real agent's heartbeat cadence (agent.yaml heartbeat_interval), shortened; it ends with stop().
        while not self._stopping.is_set():
            await self.ws.send_bytes(
                encode(
                    Heartbeat(
                        node_id=self.node_id,
                        memory=MemoryInfo(total_bytes=32 * GiB, available_bytes=24 * GiB),
                        load=NodeLoad(cpu_percent=37.5, cpu_count=8),
                        provision=[
                            ProvisionStatus(
                                engine="vllm",
                                version="0.11.0",
                                state=ProvisionState.FAILED,
                                detail="no GPU for vLLM here",
                                retry_at=time.time() + 600,
                            )
                        ],
                    )
                )
            )
            try:
                await asyncio.wait_for(self._stopping.wait(), HEARTBEAT_EVERY)
            except TimeoutError:
                pass

    async def _read(self) -> None:
        async for frame in self.ws:
            if frame.type not in (aiohttp.WSMsgType.BINARY, aiohttp.WSMsgType.TEXT):
                continue
            msg = decode(frame.data, sender="control")
            if isinstance(msg, LogsRequest):
                source = msg.source or "agent"
                sources = ["agent", *(s.shard_id for s in self.started)]
                if source in self.logs:
                    reply = LogsReply(id=msg.id, source=source, lines=self.logs[source], sources=sources)
                else:
                    reply = LogsReply(id=msg.id, error=f"no log named {source} on {self.node_id}")
                await self.ws.send_bytes(encode(reply))
            elif isinstance(msg, StartShard):
                self.started.append(msg)
                self.logs[msg.shard_id] = ["llama-server: loading the model"]
                await self.ws.send_bytes(encode(Ack(id=msg.id, ok=True)))
                await self.ws.send_bytes(
                    encode(
                        ShardStatus(
                            shard_id=msg.shard_id,
                            replica_id=msg.replica_id,
                            state=ShardState.PENDING,
                            fetch=FetchProgress(source=msg.source, bytes_done=300 * 2**20, bytes_total=1200 * 2**20),
                        )
                    )
                )
            elif msg.id:
                await self.ws.send_bytes(encode(Ack(id=msg.id, ok=True)))

    async def stop(self) -> None:
        self._stopping.set()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.ws.close()
        await self.http.close()


def _config(tmp_path, engine_url: str, control: bool):
    models = [{"name": "m", "endpoints": [{"url": engine_url, "engine": "llamacpp"}]}]
    if control:
        models.append(
            {
                "name": "tiny",
                "description": f"a tiny model {SCRIPT}",
                "source": str(tmp_path / "tiny.gguf"),
                "scaling": {"min": 1},
                "profiles": [{"engine": "llamacpp"}],
            }
        )
    return parse_server_config(
        {
            "listen": f"127.0.0.1:{_port()}",
            "admin_listen": f"127.0.0.1:{_port()}",
            "metrics_listen": None,
            "agent_listen": f"127.0.0.1:{_port()}",
            "agent_tls": None,
            "control": {"enabled": control, "unreachable_after": "1s", "lost_after": "60s", "interval": "200ms"},
            "auth": {"store": str(tmp_path / "gw.db"), "signup_open": True},
            "data_dir": str(tmp_path),
            "models": models,
        }
    )


@pytest.fixture
async def cluster(tmp_path):
    """A control plane with one node (the fake agent) running a replica of `tiny` that is downloading."""
    (tmp_path / "tiny.gguf").write_bytes(b"GGUF")
    engine = await FakeEngine(model="m", tokens=6).start()
    srv = Server(_config(tmp_path, engine.url, control=True))
    await srv.start()
    agent = await FakeAgent(srv).start()
    try:
        await async_until(lambda: agent.started, 20, "the control plane to start a shard of tiny on node-a")
        await async_until(
            lambda: any(s.fetch for r in srv.reconciler.replicas.values() for s in r.shards),
            10,
            "the shard's download to be known",
        )
        yield srv, agent
    finally:
        await agent.stop()
        await srv.stop()
        await engine.stop()


@pytest.fixture
async def plain(tmp_path):
    """A gateway without a control plane: engines from server.yaml only."""
    engine = await FakeEngine(model="m", tokens=6).start()
    srv = Server(_config(tmp_path, engine.url, control=False))
    await srv.start()
    try:
        yield srv
    finally:
        await srv.stop()
        await engine.stop()


@contextlib.asynccontextmanager
async def admin_client(srv: Server) -> AsyncIterator[httpx.AsyncClient]:
    """A browser signed in as an administrator."""
    await srv.store.create_user(ADMIN, PASSWORD, admin=True)
    async with httpx.AsyncClient(base_url=base(srv)) as http:
        assert (await sign_in(http, ADMIN)).status_code == 303
        yield http


def shown(text: str) -> str:
    """A sentence as the page carries it: escaped."""
    return str(escape(text))


def _menu(page: str) -> str:
    return re.search(r'<nav class="menu".*?</nav>', page, re.S).group(0)


def _csrf(page: str) -> str:
    return form_token(page)


async def _post(http: httpx.AsyncClient, path: str, page: str, **data: str) -> httpx.Response:
    return await http.post(path, data={"csrf": _csrf(page), **data})


# -- the cluster page, the node page, logs ----------------------------------------------------------


async def test_the_cluster_page_shows_capacity_the_node_its_engines_the_replica_downloading_traffic_and_people(
    cluster,
):
    srv, _ = cluster
    await srv.store.sign_up("wants-in@example.com", PASSWORD)
    async with admin_client(srv) as http:
        r = await http.get("/admin")
    assert r.status_code == 200
    page = r.text
    # Capacity, for a fleet without GPUs: its CPUs.
    assert "1 of 1</strong> nodes ready" in page and "<strong>8</strong> CPUs" in page
    assert "24 GiB</strong> of 32 GiB memory available" in page and "60 GiB</strong> disk free" in page
    # The node: links to its page and logs, CPU and RAM as bars, "—" for no GPUs, engines and warnings.
    assert 'href="/admin/nodes/node-a"' in page and 'href="/admin/nodes/node-a/logs"' in page
    assert re.search(r'<meter min="0" max="100" high="90" value="37.5" title="CPU busy">', page)
    assert re.search(r'<meter[^>]*value="25.0" title="RAM in use">', page)
    assert '<td class="num">—</td>' in page
    assert "llamacpp b10991" in page and "vllm 0.11.0" in page and "no GPU for vLLM here; next try in" in page
    assert "no AVX2" in page
    # The model with its description (escaped), its replica and the download's bytes and percent.
    assert "a tiny model &lt;script&gt;alert(1)&lt;/script&gt;" in page and SCRIPT not in page
    replica = next(iter(srv.reconciler.replicas.values()))
    assert replica.id in page and "300 MiB of 1.2 GiB (25%)" in page and "<progress" in page
    # Traffic, people and usage.
    assert "Traffic" in page and srv.config.models[0].endpoints[0].url in page
    assert "wants-in@example.com" in page and 'href="/admin/users#pending"' in page
    assert "No requests in the last 24 hours." in page
    # It refreshes in place, pausing while hidden (admin.js), and reloads without script.
    assert 'hx-get="/admin"' in page and 'hx-trigger="every 5s, refresh"' in page and "data-refresh" in page
    assert '<noscript><meta http-equiv="refresh"' in page and "/static/admin." in page
    # No monitoring.prometheus: no chart panels, and the page says what would give them.
    assert "set <code>monitoring.prometheus</code> in server.yaml" in page and "h-chart" not in page


def _prometheus_answering(srv: Server, seen: list[str]) -> None:
    """The site reads history from a stand-in Prometheus: every query answers one rising series."""

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.params["query"])
        now = time.time()
        values = [[now - 60 * i, str(10 - i)] for i in range(10, 0, -1)]
        metric = {"model": "tiny", "state": "ready", "node": "node-a", "window": "1m", "shard": "x-0"}
        return httpx.Response(
            200,
            json={
                "status": "success",
                "data": {"resultType": "matrix", "result": [{"metric": metric, "values": values}]},
            },
        )

    srv.site.history = Prometheus("http://prometheus.test:9090", transport=httpx.MockTransport(handle))


async def test_the_cluster_page_charts_saturation_queues_cache_and_replicas_from_prometheus(cluster):
    srv, _ = cluster
    seen: list[str] = []
    _prometheus_answering(srv, seen)
    async with admin_client(srv) as http:
        page = (await http.get("/admin")).text
        day = (await http.get("/admin?window=1d")).text
    assert "What the cluster is doing" in page
    for title in ("Saturation", "Queue depth", "Cache occupancy", "Replicas"):
        assert f"<figcaption>{title}</figcaption>" in page
    assert page.count('<polyline class="h-line c1"') == 4
    assert any("llmgw_pool_saturation" in q for q in seen) and any("llmgw_replicas" in q for q in seen)
    # The charts come before the models table.
    assert page.index("What the cluster is doing") < page.index('id="h-models"')
    assert '<strong aria-current="true">the last day</strong>' in day and 'hx-get="/admin?window=1d"' in day


async def test_the_node_page_charts_its_hour_from_prometheus_by_node_and_by_its_replicas(cluster):
    srv, _ = cluster
    seen: list[str] = []
    _prometheus_answering(srv, seen)
    async with admin_client(srv) as http:
        page = (await http.get("/admin/nodes/node-a")).text
    for title in ("CPU", "Memory in use", "Load", "Cores by model", "Memory by model", "Queue depth"):
        assert f"<figcaption>{title}</figcaption>" in page
    assert all('node="node-a"' in q for q in seen if "llmgw_node" in q or "llmgw_shard" in q)
    replica = next(iter(srv.reconciler.replicas.values()))
    assert any(replica.id in q for q in seen if "llmgw_endpoint_waiting" in q)


async def test_the_history_panels_give_way_to_one_sentence_when_prometheus_is_unreachable(cluster):
    srv, _ = cluster

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    srv.site.history = Prometheus("http://prometheus.test:9090", transport=httpx.MockTransport(refuse))
    async with admin_client(srv) as http:
        r = await http.get("/admin")
    assert r.status_code == 200
    assert "Prometheus at http://prometheus.test:9090 could not be read" in r.text and "h-chart" not in r.text


async def test_htmx_gets_only_the_refreshing_part_of_the_cluster_page(cluster):
    srv, _ = cluster
    async with admin_client(srv) as http:
        r = await http.get("/admin", headers={"HX-Request": "true"})
    assert r.status_code == 200 and r.text.lstrip().startswith("{#") is False
    assert '<div id="cluster"' in r.text and "<nav" not in r.text and "<html" not in r.text


async def test_the_cluster_page_shows_the_last_days_usage_by_project_and_person(cluster):
    srv, _ = cluster
    team = await srv.store.add_team("platform", (await srv.store.add_org("Acme")).id)
    project = await srv.store.add_project("gateway", team.id)
    ann = await active_person(srv)
    now = datetime.now(UTC)
    await srv.store.insert_usage(
        [
            UsageRow(
                model="m",
                endpoint="e",
                status=200,
                latency_ms=5,
                prompt_tokens=10,
                completion_tokens=5,
                user_id=ann.id,
                project_id=project.id,
                team_id=team.id,
                org_id=team.org_id,
                cost_micros=1_500_000,
                at=now,
            ),
            UsageRow(model="m", endpoint="e", status=200, latency_ms=5, prompt_tokens=1, user_id=ann.id, at=now),
        ]
    )
    async with admin_client(srv) as http:
        page = (await http.get("/admin")).text
    usage = page[page.index("Usage in the last 24 hours") :]
    assert "Acme/platform/gateway" in usage and "personal" in usage and "ann@example.com" in usage
    assert '<td class="num">2</td><td class="num">16</td><td class="num">1.50</td>' in usage


async def test_the_node_page_shows_its_memory_disk_engines_shards_and_warnings(cluster):
    srv, agent = cluster
    async with admin_client(srv) as http:
        r = await http.get("/admin/nodes/node-a")
        fragment = await http.get("/admin/nodes/node-a", headers={"HX-Request": "true"})
    assert r.status_code == 200
    page = r.text
    assert "Node node-a" in page and "9.9.9" in page and "zone=a" in page and "Test CPU" in page
    assert "8.0 GiB in use of 32 GiB" in page and "/var/lib/llmgw" in page and "60 GiB free of 100 GiB" in page
    assert "— no GPU" in page and "no AVX2" in page
    assert "llamacpp b10991" in page and "no GPU for vLLM here" in page
    shard = agent.started[0].shard_id
    assert shard in page and f"logs?source={shard}" in page and "300 MiB of 1.2 GiB" in page
    assert 'hx-get="/admin/nodes/node-a"' in page
    assert '<div id="node"' in fragment.text and "<nav" not in fragment.text


async def test_the_logs_page_shows_the_agents_log_and_a_shards_and_follows_them(cluster):
    srv, agent = cluster
    shard = agent.started[0].shard_id
    async with admin_client(srv) as http:
        r = await http.get("/admin/nodes/node-a/logs")
        assert r.status_code == 200
        assert "connected to the control plane" in r.text and "a line with &lt;script&gt;" in r.text
        assert f'href="/admin/nodes/node-a/logs?source={shard}&amp;lines=200"' in r.text
        assert 'aria-current="page">the agent</a>' in r.text and "hx-get" not in r.text
        r = await http.get(f"/admin/nodes/node-a/logs?source={shard}&follow=1")
        assert r.status_code == 200 and "llama-server: loading the model" in r.text
        assert f'hx-get="/admin/nodes/node-a/logs?source={shard}&amp;lines=200&amp;follow=1"' in r.text
        assert 'hx-trigger="every 5s, refresh"' in r.text and '<noscript><meta http-equiv="refresh"' in r.text
        r = await http.get(f"/admin/nodes/node-a/logs?source={shard}&follow=1", headers={"HX-Request": "true"})
        assert r.status_code == 200 and '<div id="log-box"' in r.text and "<nav" not in r.text
        r = await http.get("/admin/nodes/node-a/logs?source=nope")
        assert r.status_code == 404 and "no log named nope on node-a" in r.text
        r = await http.get("/admin/nodes/node-a/logs?lines=many")
        assert r.status_code == 400 and "lines should be a whole number" in r.text


async def test_an_unknown_node_is_a_404_page(cluster):
    srv, _ = cluster
    async with admin_client(srv) as http:
        for path in ("/admin/nodes/ghost", "/admin/nodes/ghost/logs", "/admin/nodes/%3Cscript%3E"):
            r = await http.get(path)
            assert r.status_code == 404 and "No node" in r.text and "<script>" not in r.text, path


async def test_without_a_control_plane_the_cluster_page_says_so_and_shows_the_endpoints(plain):
    srv = plain
    async with admin_client(srv) as http:
        r = await http.get("/admin")
        assert r.status_code == 200 and "is not a control plane" in r.text
        assert srv.config.models[0].endpoints[0].url in r.text and "Capacity" not in r.text
        r = await http.get("/admin/nodes/any")
        assert r.status_code == 404 and "not a control plane" in r.text


# -- who may see them -------------------------------------------------------------------------


ADMIN_GETS = ("/admin", "/admin/nodes/node-a", "/admin/nodes/node-a/logs", "/admin/users")


async def test_a_person_who_is_not_an_administrator_is_refused_every_admin_page(cluster):
    srv, _ = cluster
    await active_person(srv)
    async with httpx.AsyncClient(base_url=base(srv)) as http:
        await sign_in(http, "ann@example.com")
        page = (await http.get("/chat")).text
        assert 'href="/admin"' not in _menu(page)
        for path in ADMIN_GETS:
            r = await http.get(path)
            assert r.status_code == 403 and "for administrators" in r.text, path
        for path in ("/admin/users/promote", "/admin/tree/add"):
            r = await http.post(path, data={"csrf": _csrf(page), "user": "ann@example.com", "kind": "org", "name": "x"})
            assert r.status_code == 403, path
    assert not (await srv.store.find_user("ann@example.com")).admin
    assert not (await srv.store.tree()).orgs


async def test_the_menu_is_the_same_on_every_admin_page_with_the_current_one_marked(cluster):
    srv, _ = cluster
    async with admin_client(srv) as http:
        menus = {}
        for path in ADMIN_GETS:
            r = await http.get(path)
            assert r.status_code == 200, path
            menus[path] = _menu(r.text)
    assert 'href="/admin" aria-current="page">Cluster' in menus["/admin"]
    assert 'href="/admin/users" aria-current="page">People' in menus["/admin/users"]
    unmarked = {p: m.replace(' aria-current="page"', "") for p, m in menus.items()}
    assert len(set(unmarked.values())) == 1
    assert 'href="/admin/users">People' in unmarked["/admin"] and 'href="/chat">Chat' in unmarked["/admin"]


async def test_a_people_form_without_its_token_changes_nothing(cluster):
    srv, _ = cluster
    pending = await srv.store.sign_up("wants-in@example.com", PASSWORD)
    async with admin_client(srv) as http:
        r = await http.post("/admin/users/approve", data={"user": pending.id})
        assert r.status_code == 403 and "security token" in r.text
        r = await http.post("/admin/tree/add", data={"csrf": "forged", "kind": "org", "name": "Acme"})
        assert r.status_code == 403
    assert (await srv.store.find_user(pending.id)).state == "pending"
    assert not (await srv.store.tree()).orgs


# -- People ------------------------------------------------------------------------------------


async def test_people_approves_a_sign_up_into_a_project_or_on_their_own_and_rejects_one(cluster):
    srv, _ = cluster
    team = await srv.store.add_team("platform", (await srv.store.add_org("Acme")).id)
    project = await srv.store.add_project("gateway", team.id)
    bob = await srv.store.sign_up("bob@example.com", PASSWORD)
    cat = await srv.store.sign_up("cat@example.com", PASSWORD)
    dan = await srv.store.sign_up("dan@example.com", PASSWORD)
    async with admin_client(srv) as http:
        page = (await http.get("/admin/users")).text
        assert (
            page.index("Waiting for approval")
            < page.index("bob@example.com")
            < page.index("Organizations, teams and projects")
        )
        assert f'<option value="{project.id}">Acme/platform/gateway</option>' in page
        r = await _post(http, "/admin/users/approve", page, user=bob.id, project=project.id, back="/admin/users")
        assert r.status_code == 303 and r.headers["location"] == "/admin/users"
        page = (await http.get("/admin/users")).text
        assert "Approved bob@example.com into Acme/platform/gateway." in page
        r = await _post(http, "/admin/users/approve", page, user=cat.id, project="")
        page = (await http.get(r.headers["location"])).text
        assert "Approved cat@example.com, on their own" in page
        r = await _post(http, "/admin/users/reject", page, user=dan.id)
        page = (await http.get(r.headers["location"])).text
        assert "Rejected the sign-up of dan@example.com" in page
        # Approving one that is not waiting shows the store's own sentence.
        r = await _post(http, "/admin/users/approve", page, user=bob.id)
        assert r.status_code == 409 and "bob@example.com is active, not a sign-up waiting for approval." in r.text
    tree = await srv.store.tree(people=True)
    assert tree.reaches(bob.id, project) and tree.users[bob.id].state == "active"
    assert tree.users[cat.id].state == "active" and not any(m.user_id == cat.id for m in tree.memberships)
    assert dan.id not in tree.users


async def test_people_suspends_reinstates_promotes_and_removes_an_account_but_not_ones_own(cluster):
    srv, _ = cluster
    ann = await active_person(srv)
    async with admin_client(srv) as http:
        page = (await http.get("/admin/users?q=ann")).text
        assert '<summary aria-label="More for ann@example.com">⋯</summary>' in page
        assert "root@example.com" not in page.split('id="accounts"')[1]  # the search narrowed the list
        r = await _post(http, "/admin/users/state", page, user=ann.id, state="suspended", back="/admin/users?q=ann")
        assert r.status_code == 303 and r.headers["location"] == "/admin/users?q=ann"
        page = (await http.get(r.headers["location"])).text
        assert "Suspended ann@example.com" in page and "Reinstate" in page
        assert (await srv.store.find_user(ann.id)).state == "suspended"
        r = await _post(http, "/admin/users/state", page, user=ann.id, state="active")
        page = (await http.get(r.headers["location"])).text
        assert "Reinstated ann@example.com." in page and (await srv.store.find_user(ann.id)).state == "active"
        r = await _post(http, "/admin/users/promote", page, user=ann.id)
        page = (await http.get(r.headers["location"])).text
        assert "ann@example.com is an administrator now." in page and (await srv.store.find_user(ann.id)).admin
        me = await srv.store.find_user(ADMIN)
        r = await _post(http, "/admin/users/state", page, user=me.id, state="suspended")
        assert r.status_code == 400 and "your own account" in r.text
        r = await _post(http, "/admin/users/remove", page, user=ann.id)
        page = (await http.get(r.headers["location"])).text
        assert "Removed ann@example.com" in page
        assert "ann@example.com" not in {u.email for u in (await srv.store.tree(people=True)).users.values()}


async def test_people_adds_renames_and_removes_at_every_level_and_shows_the_stores_refusals(cluster):
    srv, _ = cluster
    async with admin_client(srv) as http:
        page = (await http.get("/admin/users")).text

        async def act(path: str, **data: str) -> str:
            nonlocal page
            r = await _post(http, path, page, **data)
            page = (await http.get(r.headers["location"])).text if r.status_code == 303 else r.text
            return page

        assert "Added the organization Acme." in await act("/admin/tree/add", kind="org", name="Acme")
        org = next(iter((await srv.store.tree()).orgs.values()))
        assert "Added the team Acme/platform." in await act(
            "/admin/tree/add", kind="team", name="platform", parent=org.id
        )
        team = next(iter((await srv.store.tree()).teams.values()))
        got = await act("/admin/tree/add", kind="project", name="gateway", parent=team.id)
        assert "Added the project Acme/platform/gateway." in got
        project = next(iter((await srv.store.tree()).projects.values()))
        got = await act("/admin/tree/add", kind="project", name="gateway", parent=team.id)
        assert shown('Acme/platform has a project named "gateway" already.') in got
        assert "it is Acme/core now" in await act("/admin/tree/rename", kind="team", id=team.id, name="core")
        assert "it is Acme/core/api now" in await act("/admin/tree/rename", kind="project", id=project.id, name="api")
        assert "it is Initech now" in await act("/admin/tree/rename", kind="org", id=org.id, name="Initech")
        got = await act("/admin/tree/rename", kind="org", id=org.id, name="a/b")
        assert shown('name cannot contain "/"') in got
        # Only empty things are removed: the store says what is in the way.
        got = await act("/admin/tree/remove", kind="org", id=org.id)
        assert "Initech is not empty (Initech/core); remove or move what is in it first." in got
        got = await act("/admin/tree/remove", kind="team", id=team.id)
        assert "Initech/core is not empty (Initech/core/api)" in got
        await srv.store.issue_key("ci", project=project.id)
        got = await act("/admin/tree/remove", kind="project", id=project.id)
        assert "a project that ever had a key is never removed" in got
        spare = await srv.store.add_project("spare", team.id)
        assert "Removed the project Initech/core/spare." in await act("/admin/tree/remove", kind="project", id=spare.id)
        other = await srv.store.add_org("Other")
        assert "Removed the organization Other." in await act("/admin/tree/remove", kind="org", id=other.id)
    tree = await srv.store.tree()
    assert [o.name for o in tree.orgs.values()] == ["Initech"] and [p.path for p in tree.projects.values()] == [
        "Initech/core/api"
    ]


async def test_people_shows_members_and_keys_makes_a_manager_with_the_star_and_takes_people_out(cluster):
    srv, _ = cluster
    org = await srv.store.add_org("Acme")
    team = await srv.store.add_team("platform", org.id)
    project = await srv.store.add_project("gateway", team.id)
    ann = await active_person(srv)
    async with admin_client(srv) as http:
        page = (await http.get("/admin/users")).text
        r = await _post(http, "/admin/users/join", page, user=ann.id, where=f"project:{project.id}")
        page = (await http.get(r.headers["location"])).text
        assert "ann@example.com is a member of Acme/platform/gateway." in page
        await srv.store.issue_key("laptop", project=project.id, owner=ann.id)
        r = await _post(http, "/admin/users/join", page, user=ann.id, where=f"org:{org.id}", role="manager")
        page = (await http.get(r.headers["location"])).text
        assert "ann@example.com manages Acme now." in page
        assert 'aria-label="ann@example.com manages this organization; make them a member only">★' in page
        assert "laptop" in page and "1 member · 1 key" in page
        # A manager of a team is refused with the store's sentence.
        r = await _post(http, "/admin/users/join", page, user=ann.id, where=f"team:{team.id}", role="manager")
        assert r.status_code == 409 and "manager is a role in an organization" in r.text
        # The star again makes them a member only; opening a project keeps it open after an action.
        r = await _post(
            http,
            "/admin/users/join",
            page,
            user=ann.id,
            where=f"org:{org.id}",
            role="member",
            back=f"/admin/users?open={project.id}#project-{project.id}",
        )
        assert r.headers["location"] == f"/admin/users?open={project.id}#project-{project.id}"
        page = (await http.get(r.headers["location"])).text
        assert '<details class="admin-project" open>' in page
        assert 'aria-label="Make ann@example.com a manager of this organization">☆' in page
        key = next(k for k in await srv.store.list_keys() if k.name == "laptop")
        r = await _post(http, "/admin/users/revoke-key", page, key=key.id)
        page = (await http.get(r.headers["location"])).text
        assert "Revoked the key laptop" in page
        r = await _post(http, "/admin/users/leave", page, user=ann.id, where=f"project:{project.id}")
        page = (await http.get(r.headers["location"])).text
        assert "Took them out of Acme/platform/gateway" in page
        # A redirect back goes nowhere but this page.
        r = await _post(http, "/admin/users/leave", page, user=ann.id, where=f"org:{org.id}", back="//evil.example/")
        assert r.headers["location"] == "/admin/users"
    tree = await srv.store.tree(people=True)
    assert not any(m.user_id == ann.id for m in tree.memberships)


async def test_names_and_emails_typed_by_people_are_shown_escaped(cluster):
    srv, _ = cluster
    await srv.store.add_org("<img src=x onerror=alert(1)>")
    await srv.store.sign_up(f"{SCRIPT}@example.com", PASSWORD)
    async with admin_client(srv) as http:
        for path in ("/admin/users", "/admin/users?q=%3Cscript%3E", "/admin"):
            page = (await http.get(path)).text
            assert "<script>alert" not in page and "<img src=x" not in page, path
            assert "&lt;script&gt;alert(1)&lt;/script&gt;@example.com" in page, path
        page = (await http.get("/admin/users")).text
        assert "&lt;img src=x onerror=alert(1)&gt;" in page
