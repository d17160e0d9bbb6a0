"""The control plane's agent service, against a fake agent speaking the protocol over a real WebSocket."""

from __future__ import annotations

import asyncio
import functools
import logging
import tempfile
from pathlib import Path

import aiohttp
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from cryptography import x509

from llmgw.pki import init_ca, issue_client, load_cert
from llmgw.protocol import (
    PROTOCOL_VERSION,
    STREAM_PATH,
    Ack,
    EngineWant,
    FabricAttachment,
    FetchProgress,
    Heartbeat,
    LogsReply,
    LogsRequest,
    MemoryInfo,
    Pace,
    Provision,
    ProvisionState,
    ProvisionStatus,
    Register,
    ShardState,
    ShardStatus,
    StopShard,
    decode,
    encode,
)
from llmgw.server.control.agents import (
    REFUSAL_HEADER,
    AgentService,
    AgentServiceError,
    NodeState,
    NotConnected,
    RequestTimeout,
    ShardEvent,
)
from llmgw.testing.waiting import async_until


class Leader:
    def __init__(self, leading: bool) -> None:
        self.leading = leading

    def is_leader(self) -> bool:
        return self.leading


async def serve(svc: AgentService):
    app = web.Application()
    svc.add_routes(app)
    server = TestServer(app)
    await server.start_server()
    return server


@pytest.fixture
async def env(request):
    opts = getattr(request, "param", {})
    svc = AgentService(**opts)
    server = await serve(svc)
    http = aiohttp.ClientSession()
    yield svc, server, http
    await http.close()
    await server.close()


def reg(node: str = "n1", **kw) -> Register:
    return Register(
        node_id=node,
        protocol_version=PROTOCOL_VERSION,
        agent_version="t",
        features=["logs", "remove-weights", "drain"],
        **kw,
    )


async def connect(server: TestServer, http: aiohttp.ClientSession, register: Register | None = None):
    ws = await http.ws_connect(server.make_url(STREAM_PATH))
    if register is not None:
        await ws.send_bytes(encode(register))
    return ws


async def recv(ws) -> object:
    frame = await ws.receive(timeout=3)
    assert frame.type in (aiohttp.WSMsgType.BINARY, aiohttp.WSMsgType.TEXT), frame
    return decode(frame.data, sender="control")


async def test_register_then_heartbeat_keeps_the_node_current(env, caplog):
    svc, server, http = env
    caplog.set_level(logging.INFO, logger="llmgw.server.control.agents")
    ws = await connect(server, http, reg(labels={"zone": "a"}, mgmt_addr="10.0.0.5", engine_versions={}))
    await async_until(lambda: svc.is_connected("n1"))
    node = svc.get("n1")
    assert node.state == NodeState.READY and node.labels == {"zone": "a"} and node.mgmt_addr == "10.0.0.5"
    assert node.engine_versions == {} and node.ready_engines() == set()
    assert "node n1 is ready" in caplog.text

    await ws.send_bytes(
        encode(
            Heartbeat(
                node_id="n1",
                memory=MemoryInfo(total_bytes=8 << 30, available_bytes=4 << 30),
                provision=[ProvisionStatus(engine="llamacpp", state=ProvisionState.INSTALLING)],
            )
        )
    )
    await async_until(lambda: node.memory is not None)
    assert node.provision["llamacpp"].state == ProvisionState.INSTALLING
    # A partial heartbeat (one engine's provisioning) keeps the rest.
    await ws.send_bytes(
        encode(
            Heartbeat(
                node_id="n1", provision=[ProvisionStatus(engine="llamacpp", version="b1", state=ProvisionState.READY)]
            )
        )
    )
    await async_until(lambda: node.provision["llamacpp"].state == ProvisionState.READY)
    assert node.memory.total_bytes == 8 << 30
    assert "node n1 now has llamacpp b1 ready" in caplog.text
    await ws.close()
    await async_until(lambda: not svc.is_connected("n1"))
    assert svc.get("n1").connected is False


async def test_shard_status_listener_sees_transitions_and_progress(env):
    svc, server, http = env
    events: list[ShardEvent] = []
    svc.on_shard_change(events.append)
    ws = await connect(server, http, reg())
    await ws.send_bytes(encode(ShardStatus(shard_id="s1", state=ShardState.PENDING)))
    await ws.send_bytes(
        encode(
            ShardStatus(
                shard_id="s1", state=ShardState.PENDING, fetch=FetchProgress(source="u", bytes_done=5, bytes_total=10)
            )
        )
    )
    await async_until(lambda: len(events) == 2)
    assert [e.transition for e in events] == [True, False]
    assert svc.get("n1").shards["s1"].fetch.bytes_done == 5
    # A heartbeat without the still-fetching shard does not drop it.
    await ws.send_bytes(encode(Heartbeat(node_id="n1", shards=[])))
    await ws.send_bytes(encode(ShardStatus(shard_id="s1", state=ShardState.STARTING)))
    await async_until(lambda: len(events) == 3)
    assert events[2].transition and events[2].status.state == ShardState.STARTING
    # Once started, a heartbeat that no longer lists it means it is gone.
    await ws.send_bytes(encode(Heartbeat(node_id="n1", shards=[])))
    await async_until(lambda: len(events) == 4)
    assert events[3].status is None and "s1" not in svc.get("n1").shards
    await ws.close()


async def test_request_reply_correlates_ack_and_logs_reply(env):
    svc, server, http = env
    ws = await connect(server, http, reg())
    await async_until(lambda: svc.is_connected("n1"))

    async def agent():
        # Answers in reverse order, so correlation by id is what pairs them.
        a = await recv(ws)
        b = await recv(ws)
        assert isinstance(a, LogsRequest) and isinstance(b, StopShard) and a.id != b.id
        await ws.send_bytes(encode(Ack(id=b.id, ok=False, error="no shard s9 runs on this node")))
        await ws.send_bytes(encode(LogsReply(id=a.id, source="agent", lines=["hello"])))

    task = asyncio.create_task(agent())
    logs, ack = await asyncio.gather(
        svc.request("n1", LogsRequest(lines=5), timeout=3), svc.request("n1", StopShard(shard_id="s9"), timeout=3)
    )
    await task
    assert isinstance(logs, LogsReply) and logs.lines == ["hello"]
    assert isinstance(ack, Ack) and not ack.ok and "s9" in ack.error
    await ws.close()


async def test_send_is_fire_and_forget(env):
    svc, server, http = env
    ws = await connect(server, http, reg())
    await async_until(lambda: svc.is_connected("n1"))
    await svc.send("n1", Provision(engines=[EngineWant(engine="llamacpp", version="b1")]))
    msg = await recv(ws)
    assert isinstance(msg, Provision) and msg.id is None
    await ws.close()


async def test_request_times_out_and_not_connected_is_said(env):
    svc, server, http = env
    with pytest.raises(NotConnected, match="node ghost is not connected"):
        await svc.request("ghost", LogsRequest(), timeout=1)
    ws = await connect(server, http, reg())
    await async_until(lambda: svc.is_connected("n1"))
    with pytest.raises(RequestTimeout, match=r"node n1 did not answer logs_request .* within 0.2s"):
        await svc.request("n1", LogsRequest(), timeout=0.2)
    await ws.close()
    await async_until(lambda: not svc.is_connected("n1"))
    with pytest.raises(NotConnected, match="node n1 is not connected"):
        await svc.send("n1", LogsRequest(id="x"))


async def test_a_request_the_agent_did_not_list_is_not_sent(env):
    svc, server, http = env
    ws = await connect(server, http, Register(node_id="old", protocol_version=1))
    await async_until(lambda: svc.is_connected("old"))
    with pytest.raises(AgentServiceError, match="does not answer logs_request"):
        await svc.request("old", LogsRequest(), timeout=1)
    await ws.close()


async def test_the_stream_closing_fails_a_waiting_request(env):
    svc, server, http = env
    ws = await connect(server, http, reg())
    await async_until(lambda: svc.is_connected("n1"))
    pending = asyncio.create_task(svc.request("n1", LogsRequest(), timeout=5))
    await recv(ws)
    await ws.close()
    with pytest.raises(NotConnected, match="closed before it answered"):
        await pending


@pytest.mark.parametrize("env", [{"leadership": Leader(False)}], indirect=True)
async def test_a_standby_refuses_before_reading(env):
    svc, server, http = env
    with pytest.raises(aiohttp.WSServerHandshakeError) as info:
        await http.ws_connect(server.make_url(STREAM_PATH))
    assert info.value.status == 503 and "standby" in info.value.headers[REFUSAL_HEADER]
    async with http.get(server.make_url(STREAM_PATH)) as r:
        assert r.status == 503 and "standby" in await r.text()
    assert svc.nodes() == []


async def test_losing_leadership_closes_streams():
    leader = Leader(True)
    svc = AgentService(leadership=leader, check_interval=0.05)
    server = await serve(svc)
    async with aiohttp.ClientSession() as http:
        ws = await connect(server, http, reg())
        await async_until(lambda: svc.is_connected("n1"))
        leader.leading = False
        frame = await ws.receive(timeout=3)
        assert frame.type == aiohttp.WSMsgType.CLOSE and b"standby" in frame.extra.encode()
    await server.close()


@functools.cache
def _node_cert(node_id: str) -> x509.Certificate:
    """A node's certificate as `ctl cert issue-client` makes it, from an authority made once."""
    d = Path(tempfile.mkdtemp(prefix="llmgw-ca-"))
    init_ca(d)
    issued = issue_client(d, d, node_id, admin_names={"admin"})
    return load_cert(issued.cert)


@pytest.mark.parametrize("env", [{"identity": lambda req: _node_cert("node-b")}], indirect=True)
async def test_a_certificate_naming_another_node_is_refused_naming_both(env):
    svc, server, http = env
    ws = await connect(server, http, reg("node-a"))
    msg = await recv(ws)
    assert isinstance(msg, Ack) and not msg.ok
    assert "node-b" in msg.error and "node-a" in msg.error
    frame = await ws.receive(timeout=3)
    assert frame.type == aiohttp.WSMsgType.CLOSE
    assert svc.get("node-a") is None and svc.nodes() == []


@pytest.mark.parametrize("env", [{"identity": lambda req: _node_cert("n1")}], indirect=True)
async def test_a_matching_certificate_is_accepted(env):
    svc, server, http = env
    ws = await connect(server, http, reg("n1"))
    await async_until(lambda: svc.is_connected("n1"))
    await ws.close()


async def test_anything_but_register_first_is_refused(env):
    svc, server, http = env
    ws = await connect(server, http, None)
    await ws.send_bytes(encode(Heartbeat(node_id="n1")))
    msg = await recv(ws)
    assert isinstance(msg, Ack) and "first message must be register, not heartbeat" in msg.error
    assert (await ws.receive(timeout=3)).type == aiohttp.WSMsgType.CLOSE
    ws = await connect(server, http, None)
    await ws.send_str("not json")
    msg = await recv(ws)
    assert "not valid JSON" in msg.error
    assert svc.nodes() == []


@pytest.mark.parametrize("env", [{"unreachable_after": 0.2, "lost_after": 0.5, "check_interval": 0.05}], indirect=True)
async def test_unreachable_then_lost_and_remove(env):
    svc, server, http = env
    ws = await connect(server, http, reg())
    await async_until(lambda: svc.is_connected("n1"))
    with pytest.raises(AgentServiceError, match="agent is connected; drain it"):
        svc.remove("n1")
    await ws.close()
    await async_until(lambda: svc.get("n1").state == NodeState.UNREACHABLE)
    # Something placed on it: an unreachable node may come back to it, so it stays.
    with pytest.raises(AgentServiceError, match=r"is unreachable .* and r1 is placed on it; drain it .*lost_after"):
        svc.remove("n1", placed=["r1"])
    with pytest.raises(NotConnected, match=r"node n1 is not connected \(unreachable since .*UTC\)"):
        await svc.request("n1", LogsRequest(), timeout=1)
    await async_until(lambda: svc.get("n1").state == NodeState.LOST)
    assert svc.remove("n1", placed=["r1"]).node_id == "n1"  # lost: its work is placed elsewhere already
    assert svc.get("n1") is None
    with pytest.raises(AgentServiceError, match="no node named n1"):
        svc.remove("n1")


@pytest.mark.parametrize("env", [{"unreachable_after": 1.0, "lost_after": 600, "check_interval": 0.05}], indirect=True)
async def test_an_unreachable_node_with_nothing_placed_on_it_is_removed_but_a_ready_one_is_not(env):
    svc, server, http = env
    ws = await connect(server, http, reg())
    await async_until(lambda: svc.is_connected("n1"))
    await ws.close()
    await async_until(lambda: not svc.is_connected("n1"))
    # Its stream just closed: an agent restarting comes straight back, so it is not forgotten yet.
    with pytest.raises(AgentServiceError, match=r"is ready \(its stream closed at .*\); .*unreachable_after"):
        svc.remove("n1")
    await async_until(lambda: svc.get("n1").state == NodeState.UNREACHABLE)
    assert svc.remove("n1").node_id == "n1"  # long before it would be lost (600 s)
    assert svc.get("n1") is None


@pytest.mark.parametrize("env", [{"unreachable_after": 0.2, "lost_after": 0.5, "check_interval": 0.05}], indirect=True)
async def test_a_heartbeat_brings_an_unreachable_node_back(env):
    svc, server, http = env
    ws = await connect(server, http, reg())
    await async_until(lambda: svc.is_connected("n1"))
    await async_until(lambda: svc.get("n1").state == NodeState.UNREACHABLE)
    await ws.send_bytes(encode(Heartbeat(node_id="n1")))
    await async_until(lambda: svc.get("n1").state == NodeState.READY)
    assert svc.get("n1").unreachable_since is None
    await ws.close()


async def test_a_second_connection_replaces_the_first(env):
    svc, server, http = env
    first = await connect(server, http, reg())
    await async_until(lambda: svc.is_connected("n1"))
    pending = asyncio.create_task(svc.request("n1", LogsRequest(), timeout=5))
    await recv(first)
    second = await connect(server, http, reg())
    frame = await first.receive(timeout=3)
    assert frame.type == aiohttp.WSMsgType.CLOSE and b"replaced" in frame.extra.encode()
    with pytest.raises(NotConnected, match="connected again"):
        await pending
    # A pause, not a wait: the first stream's teardown must not take the node's new stream with it.
    await asyncio.sleep(0.05)
    assert svc.is_connected("n1")
    # Commands now go down the new stream.
    await svc.send("n1", Provision(engines=[]))
    assert isinstance(await recv(second), Provision)
    await second.close()


async def test_malformed_frames_are_answered_and_the_stream_kept(env):
    svc, server, http = env
    ws = await connect(server, http, reg())
    await async_until(lambda: svc.is_connected("n1"))
    # A wrong type in a field, with a readable id: an ack saying what is wrong.
    await ws.send_bytes(orjson.dumps({"type": "heartbeat", "id": "h1", "payload": {"memory": {"total_bytes": "x"}}}))
    msg = await recv(ws)
    assert isinstance(msg, Ack) and msg.id == "h1" and not msg.ok and "memory.total_bytes" in msg.error
    # A message only the control plane sends, coming up.
    await ws.send_bytes(orjson.dumps({"type": "stop_shard", "id": "s1", "payload": {"shard_id": "a"}}))
    msg = await recv(ws)
    assert msg.id == "s1" and "sent by the control plane" in msg.error
    # No id readable: nothing to answer, the stream stays.
    await ws.send_str("{broken")
    await ws.send_bytes(encode(Heartbeat(node_id="n1", id="h2")))
    msg = await recv(ws)
    assert msg.id == "h2" and msg.ok
    # A heartbeat for another node on this stream is refused and changes nothing.
    await ws.send_bytes(encode(Heartbeat(node_id="other", id="h3", memory=MemoryInfo(total_bytes=1))))
    msg = await recv(ws)
    assert msg.id == "h3" and not msg.ok and "other" in msg.error
    assert svc.get("n1").memory is None and svc.get("other") is None
    assert svc.is_connected("n1")
    await ws.close()


def test_bad_thresholds_are_refused():
    with pytest.raises(ValueError, match="below lost_after"):
        AgentService(unreachable_after=60, lost_after=15)


async def test_why_a_declared_fabric_is_not_advertised_follows_the_heartbeats(env):
    svc, server, http = env
    why = "fabric ib-a is not advertised: mlx5_0 has no ACTIVE port (mlx5_0: port 1 DOWN)"
    ws = await connect(server, http, reg(fabrics=[], fabric_problems=[why]))
    await async_until(lambda: svc.is_connected("n1"))
    assert svc.get("n1").fabric_problems == [why] and svc.get("n1").fabrics == []
    # A heartbeat without news leaves it; one that says the fabric is back replaces both.
    await ws.send_bytes(encode(Heartbeat(node_id="n1")))
    await ws.send_bytes(
        encode(Heartbeat(node_id="n1", fabrics=[FabricAttachment(fabric="ib-a", hcas=["mlx5_0"])], fabric_problems=[]))
    )
    await async_until(lambda: svc.get("n1").fabric_problems == [])
    assert [f.fabric for f in svc.get("n1").fabrics] == ["ib-a"]
    await ws.close()


def _paced(node: str) -> Register:
    return Register(node_id=node, protocol_version=PROTOCOL_VERSION, agent_version="t", features=["logs", "pace"])


@pytest.mark.parametrize(
    "env", [{"heartbeat_rate": 2.0, "unreachable_after": 1.0, "lost_after": 4.0, "check_interval": 3600}], indirect=True
)
async def test_a_growing_fleet_is_asked_to_heartbeat_less_often_and_given_as_much_longer_before_it_is_unreachable(env):
    svc, server, http = env
    # Two heartbeats a second for the fleet: one node reports as it likes (a pace under 1 s is not asked for).
    first = await connect(server, http, _paced("n1"))
    await async_until(lambda: svc.is_connected("n1"))
    old = await connect(server, http, reg("n2"))  # an agent that does not know Pace
    await async_until(lambda: svc.is_connected("n2"))
    third = await connect(server, http, _paced("n3"))
    got = await recv(third)  # three nodes: each is asked for one heartbeat every 1.5 s, at registration
    assert isinstance(got, Pace) and got.heartbeat_interval == 1.5
    # An agent registered before the fleet grew hears it with its next heartbeat.
    await first.send_bytes(encode(Heartbeat(node_id="n1")))
    got = await recv(first)
    assert isinstance(got, Pace) and got.heartbeat_interval == 1.5
    assert svc.get("n1").heartbeat_pace == 1.5
    for n in ("n4", "n5"):
        await connect(server, http, reg(n))
    await async_until(lambda: svc.get("n5") is not None)
    await third.send_bytes(encode(Heartbeat(node_id="n3")))
    got = await recv(third)
    assert isinstance(got, Pace) and got.heartbeat_interval == 2.5
    # One a fifth off what it keeps is not told again: n1 keeps 1.5 s against 2.5 s, so it is told.
    await first.send_bytes(encode(Heartbeat(node_id="n1")))
    got = await recv(first)
    assert isinstance(got, Pace) and got.heartbeat_interval == 2.5
    # The agent that does not list the feature was sent nothing: its first frame is the request sent now.
    await old.send_bytes(encode(Heartbeat(node_id="n2")))
    await svc.send("n2", Provision(engines=[EngineWant(engine="llamacpp", version="b1")]))
    assert isinstance(await recv(old), Provision)
    assert svc.get("n2").heartbeat_pace is None

    # Liveness: three paced heartbeats missed (7.5 s) before unreachable, and lost_after stretched as much.
    t = max(svc.get(n)._seen_mono for n in ("n1", "n2", "n3", "n4", "n5"))
    await svc.check(now=t + 1.5)
    assert svc.get("n2").state == NodeState.UNREACHABLE
    assert svc.get("n3").state == NodeState.READY and svc.get("n1").state == NodeState.READY
    assert svc.liveness_after(svc.get("n3")) == (7.5, 30.0)
    await svc.check(now=t + 8.0)
    assert svc.get("n3").state == NodeState.UNREACHABLE and svc.get("n2").state == NodeState.LOST  # 4 s, unpaced
    await svc.check(now=t + 31.0)
    assert svc.get("n3").state == NodeState.LOST
    # A paced node whose stream closed has no reports to wait for: the plain thresholds again.
    await first.close()
    await async_until(lambda: not svc.is_connected("n1"))
    assert svc.liveness_after(svc.get("n1")) == (1.0, 4.0)


@pytest.mark.parametrize("env", [{"heartbeat_rate": 1.0, "check_interval": 3600}], indirect=True)
async def test_a_shorter_pace_counts_for_liveness_only_once_the_agent_has_reported_since(env):
    svc, server, http = env
    ws = await connect(server, http, _paced("n1"))
    assert (await recv(ws)).heartbeat_interval == 1.0  # one heartbeat a second for the fleet: this one node's
    for n in ("n2", "n3", "n4"):
        await connect(server, http, reg(n))
    await async_until(lambda: svc.get("n4") is not None)
    await ws.send_bytes(encode(Heartbeat(node_id="n1")))
    assert (await recv(ws)).heartbeat_interval == 4.0
    node = svc.get("n1")
    assert svc.liveness_after(node) == (15.0, 60.0)  # 3 × 4 s is still under unreachable_after
    node._pace_hold = 40.0  # as if it had been asked for 40 s, and is now asked for 4 s
    assert svc.liveness_after(node) == (120.0, 480.0)
    await ws.send_bytes(encode(Heartbeat(node_id="n1")))
    await async_until(lambda: node._pace_hold == 4.0, what="the pace it keeps taken as the one it was asked for")
    assert svc.liveness_after(node) == (15.0, 60.0)


@pytest.mark.parametrize("env", [{"heartbeat_rate": 0.1, "check_interval": 3600}], indirect=True)
async def test_the_streams_own_pings_are_stretched_with_the_pace_of_a_large_fleet(env):
    svc, server, http = env
    streams = []
    for n in ("n1", "n2", "n3"):
        streams.append(await connect(server, http, reg(n)))
        await async_until(lambda n=n: svc.is_connected(n))
    assert svc._conns["n1"].ws._heartbeat == 20.0  # a fleet of none: the plain 20 s
    # Two nodes at a tenth of a heartbeat a second: a 20 s pace, and pings three paces apart.
    assert svc._conns["n3"].ws._heartbeat == 60.0


@pytest.mark.parametrize("env", [{"heartbeat_rate": 1.0, "check_interval": 3600}], indirect=True)
async def test_an_agent_that_reports_as_seldom_as_the_pace_already_is_sent_none(env):
    svc, server, http = env
    slow = Register(node_id="n1", protocol_version=PROTOCOL_VERSION, features=["pace"], heartbeat_interval=10.0)
    ws = await connect(server, http, slow)
    for n in ("n2", "n3"):
        await connect(server, http, reg(n))
    await async_until(lambda: svc.get("n3") is not None)
    # Three nodes at one heartbeat a second: a 3 s pace, shorter than the agent's own 10 s.
    await ws.send_bytes(encode(Heartbeat(node_id="n1")))
    await svc.send("n1", Provision(engines=[EngineWant(engine="llamacpp", version="b1")]))
    assert isinstance(await recv(ws), Provision)
    assert svc.get("n1").heartbeat_pace is None and svc.get("n1").own_heartbeat == 10.0


@pytest.mark.parametrize("env", [{"heartbeat_rate": 1.0, "check_interval": 3600}], indirect=True)
async def test_agents_coming_back_after_a_restart_are_paced_as_the_fleet_they_say_they_were_part_of(env):
    svc, server, http = env
    # The first agent back kept a 40 s pace with the control plane before this one: a fleet of 40.
    back = Register(
        node_id="n1", protocol_version=PROTOCOL_VERSION, features=["pace"], heartbeat_interval=5.0, heartbeat_pace=40.0
    )
    ws1 = await connect(server, http, back)
    got = await recv(ws1)
    assert isinstance(got, Pace) and got.heartbeat_interval == 40.0
    # One that says nothing, registering while they come back, is paced as the same fleet.
    ws2 = await connect(server, http, _paced("n2"))
    got = await recv(ws2)
    assert isinstance(got, Pace) and got.heartbeat_interval == 40.0
    assert svc.liveness_after(svc.get("n2")) == (120.0, 480.0)
    # Once nobody has said so for unreachable_after, the registry's count is the fleet again: two
    # nodes, a 2 s pace, told with the answer to the next heartbeat.
    svc._pace_said_until = 0.0
    await ws2.send_bytes(encode(Heartbeat(node_id="n2")))
    got = await recv(ws2)
    assert isinstance(got, Pace) and got.heartbeat_interval == 2.0
    # An agent's word is capped: it cannot leave the fleet silent for a day.
    wild = Register(node_id="n3", protocol_version=PROTOCOL_VERSION, features=["pace"], heartbeat_pace=86400.0)
    ws3 = await connect(server, http, wild)
    assert (await recv(ws3)).heartbeat_interval == 300.0


def test_a_heartbeat_rate_of_zero_is_refused():
    with pytest.raises(ValueError, match="heartbeat_rate must be above 0"):
        AgentService(heartbeat_rate=0)
