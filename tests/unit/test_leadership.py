"""Leadership between control planes: the lease statement on both stores, a standby taking over,
a leader cut off from its store stepping down before anyone else could lead, and a standby
control plane refusing agents, admin writes and /ready."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from llmgw.config import ConfigError
from llmgw.config.server import parse_server_config
from llmgw.protocol import STREAM_PATH
from llmgw.server.app import Server
from llmgw.server.control.leadership import LEASE, Leadership
from llmgw.server.control.shared_endpoints import SharedEndpoints
from llmgw.server.gateway.endpoints import EndpointSet
from llmgw.store import PublishedEndpoint, Store
from llmgw.testing.ports import free_port
from llmgw.testing.waiting import async_until


async def test_one_statement_takes_renews_and_refuses_a_live_lease_and_gives_up_an_expired_one(address):
    store = await Store.open(address)
    try:
        assert await store.lease_claim("leader", "a", "host a", 60)
        assert not await store.lease_claim("leader", "b", "host b", 60)  # a's lease is live
        assert await store.lease_claim("leader", "a", "host a", 60)  # a renews
        lease = await store.lease_read("leader")
        assert lease is not None and lease.owner == "a" and lease.holder == "host a" and lease.live
        assert 59 < lease.expires_at - lease.now <= 60
        assert not await store.lease_release("leader", "b")  # only the owner releases
        assert await store.lease_release("leader", "a")
        assert await store.lease_read("leader") is None
        assert await store.lease_claim("leader", "b", "host b", 0.2)

        async def expired() -> bool:
            got = await store.lease_read("leader")
            return got is not None and not got.live

        await async_until(expired, 10, "b's short lease to run out by the database's clock")
        assert await store.lease_claim("leader", "a", "host a", 60)  # an expired lease is taken
        assert (await store.lease_read("leader")).owner == "a"
    finally:
        await store.close()


async def test_processes_racing_for_the_lease_on_postgresql_never_both_win(pg_database):
    stores = [await Store.open(pg_database) for _ in range(8)]
    try:
        for _ in range(5):
            await stores[0].lease_release("leader", (await stores[0].lease_read("leader") or _Nobody).owner)
            won = await asyncio.gather(*(s.lease_claim("leader", f"o{i}", f"h{i}", 30) for i, s in enumerate(stores)))
            assert sum(won) == 1, won
    finally:
        for s in stores:
            await s.close()


class _Nobody:
    owner = ""


class Cuttable:
    """A store whose lease statements can be made to fail, as a cut connection does."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.cut = False

    async def lease_claim(self, *args):
        if self.cut:
            raise OSError("connection refused")
        return await self.store.lease_claim(*args)

    async def lease_read(self, *args):
        if self.cut:
            raise OSError("connection refused")
        return await self.store.lease_read(*args)

    async def lease_release(self, *args):
        if self.cut:
            raise OSError("connection refused")
        return await self.store.lease_release(*args)


async def test_a_leader_cut_off_from_its_store_stops_leading_before_a_standby_can_take_over(address):
    ttl = 2.0
    store = await Store.open(address)
    cut = Cuttable(store)
    leader = Leadership(cut, ttl, "a")  # type: ignore[arg-type]
    standby = Leadership(store, ttl, "b")
    await leader.start()
    await standby.start()
    both: list[float] = []
    stepped_down: list[float] = []
    took_over: list[float] = []

    def standby_changed(leading: bool) -> None:
        # Leading starts only here, so this is the one moment the two could overlap: the old
        # leader's is_leader() (its own deadline, read from memory) must already be false.
        if leading:
            took_over.append(time.monotonic())
            if leader.is_leader():
                both.append(time.monotonic())

    leader.on_change(lambda leading: stepped_down.append(time.monotonic()) if not leading else None)
    standby.on_change(standby_changed)

    try:
        assert leader.is_leader() and not standby.is_leader()
        assert standby.leader_holder == "a"
        cut.cut = True
        cut_at = time.monotonic()
        await async_until(lambda: took_over, 3 * ttl, "the standby to take the lease once it ran out")
        assert stepped_down and stepped_down[0] < took_over[0]
        assert stepped_down[0] - cut_at <= ttl  # it never kept a claim it could not prove
        assert both == []
        assert leader.failures >= 1
    finally:
        cut.cut = False
        await leader.stop()
        await standby.stop()
        await store.close()


async def test_a_leader_that_stops_cleanly_hands_over_within_a_third_of_the_ttl(address):
    ttl = 3.0
    store = await Store.open(address)
    first, second = Leadership(store, ttl, "a"), Leadership(store, ttl, "b")
    try:
        await first.start()
        await second.start()
        assert first.is_leader() and not second.is_leader()
        stopped = time.monotonic()
        await first.stop()
        await async_until(second.is_leader, ttl, "the standby to lead after a clean stop")
        assert time.monotonic() - stopped < ttl / 3 + 1.0
        assert (await store.lease_read(LEASE)).holder == "b"
    finally:
        await second.stop()
        await store.close()


def test_without_a_lease_ttl_a_control_plane_always_leads():
    lead = Leadership(None, None, "alone")
    assert lead.is_leader() and not lead.enabled


def test_a_lease_shorter_than_the_store_could_renew_is_refused_in_words():
    with pytest.raises(ConfigError, match="lease_ttl"):
        parse_server_config({"control": {"enabled": True, "lease_ttl": "1s"}})


def _control_plane(tmp_path, store: str, name: str) -> Server:
    return Server(
        parse_server_config(
            {
                "listen": f"127.0.0.1:{free_port()}",
                "admin_listen": f"127.0.0.1:{free_port()}",
                "metrics_listen": None,
                "agent_listen": f"127.0.0.1:{free_port()}",
                "agent_tls": None,
                "data_dir": str(tmp_path / name),
                "auth": {"store": store},
                "control": {"enabled": True, "lease_ttl": "3s", "unreachable_after": "2s", "lost_after": "10s"},
                "models": [],
            }
        )
    )


async def test_a_standby_control_plane_refuses_agents_admin_writes_and_ready_until_it_leads(tmp_path, pg_database):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, b = _control_plane(tmp_path, pg_database, "a"), _control_plane(tmp_path, pg_database, "b")
    await a.start()
    await b.start()
    try:
        assert a.leadership.is_leader() and not b.leadership.is_leader()
        token = (tmp_path / "b" / "admin-token").read_text().strip()
        admin = {"Authorization": f"Bearer {token}"}
        async with httpx.AsyncClient() as http:
            ready = await http.get(f"http://127.0.0.1:{b.config.listen.port}/ready")
            assert ready.status_code == 503 and ready.json()["status"] == "standby"
            assert "standby" in ready.json()["reason"] and a.leadership.holder in ready.json()["reason"]
            health = await http.get(f"http://127.0.0.1:{b.config.admin_listen.port}/health")
            assert health.status_code == 200
            # An agent's stream is refused before it is read, saying why.
            stream = await http.get(
                f"http://127.0.0.1:{b.config.agent_listen.port}{STREAM_PATH}",
                headers={
                    "Connection": "Upgrade",
                    "Upgrade": "websocket",
                    "Sec-WebSocket-Version": "13",
                    "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
                },
            )
            assert stream.status_code == 503 and "standby" in stream.headers["X-Llmgw-Refusal"]
            # Admin writes are refused naming the leader; reads still answer.
            base = f"http://127.0.0.1:{b.config.admin_listen.port}"
            write = await http.post(base + "/api/v1/nodes/n1/cordon", headers=admin, json={})
            assert write.status_code == 503 and "standby" in write.json()["error"]["message"]
            assert a.leadership.holder in write.json()["error"]["message"]
            assert (await http.get(base + "/api/v1/nodes", headers=admin)).status_code == 200
            metrics = (await http.get(base + "/metrics", headers=admin)).text
            assert "llmgw_leader 0.0" in metrics
            leader_metrics = (
                await http.get(
                    f"http://127.0.0.1:{a.config.admin_listen.port}/metrics",
                    headers={"Authorization": "Bearer " + (tmp_path / "a" / "admin-token").read_text().strip()},
                )
            ).text
            assert "llmgw_leader 1.0" in leader_metrics and "llmgw_leader_lease_renewals_total" in leader_metrics
        # The leader stops cleanly: the standby leads and takes agents again.
        await a.stop()
        await async_until(b.leadership.is_leader, 5, "the standby to lead once the leader stopped")
        async with httpx.AsyncClient() as http:
            ready = await http.get(f"http://127.0.0.1:{b.config.listen.port}/ready")
            assert ready.json()["status"] != "standby"
        assert b.gateway.demand is b.reconciler
    finally:
        await b.stop()
        await a.stop()


async def test_a_standby_serves_the_replicas_the_leader_publishes_and_only_while_it_follows(address):
    store = await Store.open(address)
    lead_a, lead_b = Leadership(store, 3.0, "a"), Leadership(store, 3.0, "b")
    await lead_a.start()
    await lead_b.start()
    ready = [PublishedEndpoint("r1", "m", "http://10.0.0.5:20001", "llamacpp", "engine-key-1")]
    set_a, set_b = EndpointSet([], 1.0, 5.0, 1.0), EndpointSet([], 1.0, 5.0, 1.0)
    a = SharedEndpoints(store, lead_a, set_a, lambda: list(ready), settle=0.0, breaker=(3, 10.0))
    b = SharedEndpoints(store, lead_b, set_b, list, settle=0.0, breaker=(3, 10.0))
    try:
        await a.step()  # the leader publishes
        await b.step()  # the standby follows
        (ep,) = set_b.by_model["m"]
        assert ep.url == "http://10.0.0.5:20001" and ep.api_key == "engine-key-1" and ep.healthy
        ready.clear()
        await a.step()
        await b.step()
        assert "m" not in set_b.by_model  # the leader stopped it: the standby stops routing there
        # A leader that lost its lease cannot overwrite its successor's list.
        ready.append(PublishedEndpoint("r2", "m", "http://10.0.0.6:20002", "llamacpp", None))
        await a.step()
        await b.step()
        assert [e.url for e in set_b.by_model["m"]] == ["http://10.0.0.6:20002"]
        await lead_a.stop()
        await async_until(lead_b.is_leader, 5, "b to lead once a stopped")
        assert not await store.endpoints_publish([], LEASE, lead_a.owner)
        await b.step()  # b leads: what it followed gives way to its own reconciler's endpoints
        assert "m" not in set_b.by_model
        assert await store.endpoints_published() == []  # and it published its own (empty) list
    finally:
        await lead_b.stop()
        await store.close()
