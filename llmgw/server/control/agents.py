"""The control plane's side of the agent stream: one WebSocket per node.

Agents dial in and register; this service keeps a ``Node`` record per node id
from their registrations and heartbeats, decides liveness (unreachable, then
lost, when heartbeats stop), and is the only way commands reach nodes:
``send`` for fire-and-forget messages, ``request`` for those answered by an
``ack`` or a ``logs_reply`` carrying the same envelope id.

A standby refuses the stream before reading anything: commands travel down
the stream the agent opened, so a standby holding it would leave the leader
with "no agent connected". Node records are not stored: after a restart the
fleet registers again and says everything.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import itertools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Protocol

import aiohttp
from aiohttp import web
from cryptography import x509

from llmgw.errors import LlmgwError
from llmgw.gcfreeze import GcFreezer
from llmgw.pki import check_node_certificate, client_kind
from llmgw.protocol import (
    FEATURE_DRAIN,
    FEATURE_FABRIC_SCAN,
    FEATURE_FABRIC_TEST,
    FEATURE_LOGS,
    FEATURE_PACE,
    FEATURE_REMOVE_WEIGHTS,
    IMEX,
    STREAM_PATH,
    Ack,
    DrainShard,
    FabricAttachment,
    FabricScanReply,
    FabricScanRequest,
    FabricTestReply,
    FabricTestRequest,
    GPUUsage,
    Heartbeat,
    IBPort,
    LocalWeights,
    LogsReply,
    LogsRequest,
    MemoryInfo,
    Message,
    NodeInventory,
    NodeLoad,
    Pace,
    ProtocolError,
    ProvisionState,
    ProvisionStatus,
    Register,
    RemoveWeights,
    RunningShard,
    ShardState,
    ShardStatus,
    Storage,
    decode,
    encode,
)
from llmgw.protocol.doctor import SubnetManagers

log = logging.getLogger("llmgw.server.control.agents")

# Carries the reason of a stream refused before the upgrade (a standby).
REFUSAL_HEADER = "X-Llmgw-Refusal"

# Requests an agent answers only when it listed the feature at registration.
_FEATURE_OF: dict[type[Message], str] = {
    LogsRequest: FEATURE_LOGS,
    RemoveWeights: FEATURE_REMOVE_WEIGHTS,
    DrainShard: FEATURE_DRAIN,
    FabricScanRequest: FEATURE_FABRIC_SCAN,
    FabricTestRequest: FEATURE_FABRIC_TEST,
}

# What a request is answered with (besides an ack refusing it).
Reply = Ack | LogsReply | FabricScanReply | FabricTestReply
_REPLIES = (Ack, LogsReply, FabricScanReply, FabricTestReply)

# WebSocket close codes: 1008 policy violation (refused), 1001 going away.
_CLOSE_REFUSED = 1008
_CLOSE_GOING_AWAY = 1001


PACE_FLOOR_S = 1.0  # a pace shorter than this is not asked for: every agent's own interval is longer
PACE_SLACK = 1.2  # a pace within this factor of the one an agent keeps is not sent again
PACE_MISSED = 3  # paced heartbeats missed before a node is unreachable (15 s at the default 5 s)
MAX_SAID_PACE_S = 300.0  # the longest pace a reconnecting agent's word can set for the fleet
WS_PING_S = 20.0  # the stream's own keepalive ping, at least this far apart


class NodeState(StrEnum):
    READY = "ready"
    UNREACHABLE = "unreachable"  # no heartbeat for unreachable_after: nothing new is placed there
    LOST = "lost"  # no heartbeat for lost_after: its replicas are placed elsewhere


class AgentServiceError(LlmgwError):
    """A command that cannot reach a node, or a node operation refused; the message says why."""


class NotConnected(AgentServiceError):
    pass


class RequestTimeout(AgentServiceError, TimeoutError):
    pass


class Leadership(Protocol):
    def is_leader(self) -> bool: ...


# The client certificate the stream's TLS handshake verified, or None when the agent presented none.
Identity = Callable[[web.Request], "x509.Certificate | None"]


def _utc(ts: float | None) -> str:
    if ts is None:
        return "never"
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


@dataclass
class Node:
    """What the control plane knows of a node, from its registration and heartbeats.

    None means "not reported" (an older agent, or nothing said yet), never zero.
    """

    node_id: str
    state: NodeState = NodeState.READY
    connected: bool = False
    registered_at: float | None = None  # wall clock, for people
    last_seen: float | None = None  # wall clock of the last message
    unreachable_since: float | None = None
    disconnected_at: float | None = None
    remote: str | None = None  # the peer address of the stream
    protocol_version: int | None = None
    agent_version: str | None = None
    features: list[str] | None = None
    inventory: NodeInventory | None = None
    installable_engines: list[str] | None = None
    engine_versions: dict[str, str] | None = None
    provision: dict[str, ProvisionStatus] = field(default_factory=dict)  # by engine
    labels: dict[str, str] | None = None
    mgmt_addr: str | None = None
    mgmt_interface: str | None = None
    fabrics: list[FabricAttachment] | None = None
    fabric_problems: list[str] | None = None  # why a fabric agent.yaml declares is not advertised
    declared_fabrics: list[FabricAttachment] | None = None  # agent.yaml's, usable or not
    # The agent's last read of its ports' subnet managers (about once a minute),
    # or why it could not read them.
    subnet_managers: SubnetManagers | None = None
    subnet_managers_error: str | None = None
    memory: MemoryInfo | None = None
    load: NodeLoad | None = None
    storage: list[Storage] | None = None
    gpus: list[GPUUsage] | None = None
    ib_ports: list[IBPort] | None = None
    imex: IMEX | None = None
    weights: list[LocalWeights] | None = None
    # Latest status per shard (fetch progress included); the shards described at
    # the last registration, with their specs, are for adopting after a restart.
    shards: dict[str, ShardStatus] = field(default_factory=dict)
    registered_shards: list[RunningShard] = field(default_factory=list)
    _seen_mono: float = 0.0  # monotonic clock of last_seen, for liveness
    # The heartbeat interval this control plane asked of the agent (Pace); None: its own,
    # which it said at registration (own_heartbeat; None from agents before protocol 3).
    heartbeat_pace: float | None = None
    own_heartbeat: float | None = None
    # The longest interval the agent may still be keeping since its last message: a
    # shorter pace asked for counts only once a message shows it was taken.
    _pace_hold: float | None = None
    # Bumped on every applied registration, heartbeat and state change, so a reader
    # (the reconciler's node views) can tell an unchanged record without reading it.
    version: int = 0

    def ready_engines(self) -> set[str]:
        """Engines proved installed: reported in engine_versions or provisioned ready."""
        out = set(self.engine_versions or ())
        out.update(e for e, st in self.provision.items() if st.state == ProvisionState.READY)
        return out


@dataclass(frozen=True)
class ShardEvent:
    """A shard's status changed on a node. ``status`` None: the agent no longer
    reports the shard. ``transition`` False: the same state again with new fetch
    progress, which must not reset a startup timer."""

    node_id: str
    shard_id: str
    status: ShardStatus | None
    previous: ShardStatus | None
    transition: bool


ShardListener = Callable[[ShardEvent], None]
# Called after every registration with the node and the shards it reported.
RegisterListener = Callable[[Node, list[RunningShard]], None]
ReportListener = Callable[[Node], None]


class _Conn:
    def __init__(self, node_id: str, ws: web.WebSocketResponse) -> None:
        self.node_id = node_id
        self.ws = ws
        self.lock = asyncio.Lock()  # one frame at a time on the socket
        self.pending: dict[str, asyncio.Future] = {}

    async def write(self, msg: Message) -> None:
        data = encode(msg)
        async with self.lock:
            await self.ws.send_bytes(data)


class AgentService:
    def __init__(
        self,
        *,
        leadership: Leadership | None = None,
        identity: Identity | None = None,
        require_identity: bool = False,
        require_node_mark: bool = False,
        unreachable_after: float = 15.0,
        lost_after: float = 60.0,
        heartbeat_rate: float | None = 200.0,
        check_interval: float = 1.0,
        register_timeout: float = 10.0,
        max_msg_size: int = 64 << 20,
        freezer: GcFreezer | None = None,
    ) -> None:
        if not 0 < unreachable_after < lost_after:
            raise ValueError(
                f"unreachable_after ({unreachable_after}s) must be above 0 and below lost_after ({lost_after}s)"
            )
        if check_interval <= 0:
            raise ValueError(f"check_interval must be above 0, not {check_interval}")
        if heartbeat_rate is not None and heartbeat_rate <= 0:
            raise ValueError(f"heartbeat_rate must be above 0, not {heartbeat_rate}")
        self.leadership = leadership
        self.identity = identity
        self.require_identity = require_identity
        self.require_node_mark = require_node_mark
        self._unmarked_said: set[str] = set()  # nodes already told to reissue: once each, not per reconnect
        self.unreachable_after = unreachable_after
        self.lost_after = lost_after
        self.heartbeat_rate = heartbeat_rate
        self.check_interval = check_interval
        self.register_timeout = register_timeout
        self.max_msg_size = max_msg_size
        # The process's collector, kept off the registry as it grows (llmgw.gcfreeze): the server
        # hands one in; tests and in-process benchmarks leave the collector alone.
        self.freezer = freezer
        self._nodes: dict[str, Node] = {}
        self._conns: dict[str, _Conn] = {}
        self._ids = itertools.count(1)
        self._listeners: list[ShardListener] = []
        self._register_listeners: list[RegisterListener] = []
        self._report_listeners: list[ReportListener] = []
        self._timer: asyncio.Task | None = None
        # After a restart the registry fills one registration at a time, but the agents coming
        # back say the pace they kept: the fleet they were part of. The longest said counts for
        # the pace while such registrations keep coming (and unreachable_after after the last).
        self._pace_said = 0.0
        self._pace_said_until = 0.0

    # -- wiring ---------------------------------------------------------------

    def add_routes(self, app: web.Application) -> None:
        """The stream route, and the liveness timer tied to the app's lifetime."""
        app.router.add_get(STREAM_PATH, self.handle)
        app.on_startup.append(lambda _app: self.start())
        app.on_shutdown.append(lambda _app: self.close())

    async def start(self) -> None:
        if self._timer is None:
            self._timer = asyncio.create_task(self._liveness_loop(), name="agent liveness")
        if self.freezer is not None:
            await self.freezer.start()

    async def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            await asyncio.gather(self._timer, return_exceptions=True)
            self._timer = None
        if self.freezer is not None:
            await self.freezer.close()
        for conn in list(self._conns.values()):
            await conn.ws.close(code=_CLOSE_GOING_AWAY, message=b"the control plane is shutting down")

    def on_shard_change(self, listener: ShardListener) -> None:
        """Call ``listener`` on every shard status change (the reconciler's hook).
        A listener that raises is logged and does not stop the others."""
        self._listeners.append(listener)

    def on_register(self, listener: RegisterListener) -> None:
        """Call ``listener`` after each registration (adoption and letting go
        happen there); one that raises is logged and does not stop the others."""
        self._register_listeners.append(listener)

    def on_report(self, listener: ReportListener) -> None:
        """Call ``listener`` with the node after each registration and heartbeat has been
        applied (the fabric registry's hook); one that raises is logged and does not stop the others."""
        self._report_listeners.append(listener)

    def _reported(self, node: Node) -> None:
        node.version += 1
        for fn in self._report_listeners:
            try:
                fn(node)
            except Exception:
                log.exception("a report listener failed on node %s", node.node_id)

    # -- reading --------------------------------------------------------------

    def get(self, node_id: str) -> Node | None:
        return self._nodes.get(node_id)

    def nodes(self) -> list[Node]:
        return [self._nodes[k] for k in sorted(self._nodes)]

    def node_map(self) -> Mapping[str, Node]:
        """Every node by id, unsorted and not copied (a read-only view of the registry): for a
        reader that looks nodes up, such as the reconciler's pass, which at 10,000 nodes would
        otherwise sort and copy them on every pass."""
        return MappingProxyType(self._nodes)

    def is_connected(self, node_id: str) -> bool:
        return node_id in self._conns

    # -- commands -------------------------------------------------------------

    async def send(self, node_id: str, msg: Message) -> None:
        """Send ``msg`` down ``node_id``'s stream, expecting no answer."""
        conn = self._conn_for(node_id, msg)
        try:
            await conn.write(msg)
        except (ConnectionError, RuntimeError) as exc:
            raise NotConnected(f"node {node_id}: the stream broke while sending {msg.TYPE}: {exc}") from None

    async def request(
        self, node_id: str, msg: Message, timeout: float = 30.0, *, sent: asyncio.Event | None = None
    ) -> Reply:
        """Send ``msg`` with a fresh envelope id and wait for the reply carrying
        it. An ack with ok=False is returned, not raised: the caller knows what
        the refusal means for it. ``sent`` is set once the request is on the stream
        (or could not be), for a caller that must order it before another."""
        conn = self._conn_for(node_id, msg)
        rid = f"cp-{next(self._ids)}"
        out = msg.model_copy(update={"id": rid})
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        conn.pending[rid] = fut
        try:
            try:
                await conn.write(out)
            except (ConnectionError, RuntimeError) as exc:
                raise NotConnected(f"node {node_id}: the stream broke while sending {msg.TYPE}: {exc}") from None
            finally:
                if sent is not None:
                    sent.set()
            try:
                return await asyncio.wait_for(fut, timeout)
            except TimeoutError:
                raise RequestTimeout(
                    f"node {node_id} did not answer {msg.TYPE} (id {rid}) within {timeout:g}s"
                ) from None
        finally:
            conn.pending.pop(rid, None)

    def remove(self, node_id: str, placed: Sequence[str] = ()) -> Node:
        """Forget a node gone for good: a lost one, or an unreachable one with nothing placed
        on it (``placed``: what the reconciler has there, Reconciler.placed_on). Anything else
        is refused, saying the node's state and what to do."""
        node = self._nodes.get(node_id)
        if node is None:
            raise AgentServiceError(f"no node named {node_id} is known")
        drain = f"drain it (llmgw ctl drain {node_id}) and stop its agent"
        lost = f"it is lost after {self.lost_after:g}s without a heartbeat (control.lost_after)"
        if node_id in self._conns:
            raise AgentServiceError(
                f"node {node_id} is {node.state.value} and its agent is connected; "
                f"{drain}, then remove it once it is unreachable, or stop its agent and remove it once {lost}"
            )
        if node.state == NodeState.LOST:
            pass  # its replicas are placed elsewhere already
        elif node.state == NodeState.UNREACHABLE:
            if placed:
                raise AgentServiceError(
                    f"node {node_id} is unreachable (last heartbeat {_utc(node.last_seen)}) and "
                    f"{', '.join(placed)} {'is' if len(placed) == 1 else 'are'} placed on it; "
                    f"{drain}, or wait until {lost}, then remove it"
                )
        else:
            # Ready, its stream closed moments ago: an agent restarting comes straight back.
            raise AgentServiceError(
                f"node {node_id} is {node.state.value} (its stream closed at {_utc(node.disconnected_at)}); "
                f"once its agent is stopped it is unreachable after {self.unreachable_after:g}s "
                "(control.unreachable_after) and can be removed if nothing is placed on it, "
                f"or {drain} first"
            )
        del self._nodes[node_id]
        log.info("node %s removed (it was %s)", node_id, node.state.value)
        return node

    def _conn_for(self, node_id: str, msg: Message) -> _Conn:
        if self.leadership is not None and not self.leadership.is_leader():
            # Checked at every send, not only by the reconciler: a command already on its way
            # when leadership ended must not reach a node the new leader now drives.
            raise AgentServiceError("this control plane is a standby: it sends nothing to agents")
        conn = self._conns.get(node_id)
        if conn is None:
            node = self._nodes.get(node_id)
            if node is None:
                raise NotConnected(f"node {node_id} is not connected (no agent with this id has registered)")
            if node.state != NodeState.READY:
                raise NotConnected(
                    f"node {node_id} is not connected ({node.state.value} since {_utc(node.unreachable_since)})"
                )
            raise NotConnected(f"node {node_id} is not connected (its stream closed at {_utc(node.disconnected_at)})")
        feature = _FEATURE_OF.get(type(msg))
        if feature is not None:
            features = self._nodes[node_id].features or []
            if feature not in features:
                agent = self._nodes[node_id].agent_version or "unknown"
                raise AgentServiceError(
                    f"node {node_id}'s agent (version {agent}) does not answer {msg.TYPE}; upgrade it"
                )
        return conn

    # -- heartbeat pace ---------------------------------------------------------

    def pace(self) -> float | None:
        """The heartbeat interval the fleet is asked for now: one heartbeat a second per
        heartbeat_rate nodes, so the heartbeats taken each second stay at about heartbeat_rate
        however large the fleet grows (None while the fleet is small enough for every agent's own
        interval, below PACE_FLOOR_S)."""
        if self.heartbeat_rate is None:
            return None
        interval = len(self._nodes) / self.heartbeat_rate
        if self._pace_said > interval and time.monotonic() < self._pace_said_until:
            interval = self._pace_said  # a fleet reconnecting: as large as its agents say it was
        return round(interval, 1) if interval >= PACE_FLOOR_S else None

    def _said_pace(self, reg: Register) -> None:
        said = reg.heartbeat_pace
        if said is None or self.heartbeat_rate is None:
            return
        now = time.monotonic()
        if now >= self._pace_said_until:
            self._pace_said = 0.0
        # Capped: an agent's word must not leave the fleet silent for longer than a fleet of
        # MAX_SAID_PACE_S × heartbeat_rate nodes would be.
        self._pace_said = max(self._pace_said, min(said, MAX_SAID_PACE_S))
        self._pace_said_until = now + self.unreachable_after

    def liveness_after(self, node: Node) -> tuple[float, float]:
        """unreachable_after and lost_after for one node: stretched by the pace it was asked to
        keep, so a node reporting every 40 s is not unreachable after 15 s of silence."""
        hold = node._pace_hold
        if hold is None:
            return self.unreachable_after, self.lost_after
        stretch = max(1.0, PACE_MISSED * hold / self.unreachable_after)
        return self.unreachable_after * stretch, self.lost_after * stretch

    async def _send_pace(self, conn: _Conn, node: Node) -> None:
        """Tell an agent the pace when it is not the one it keeps (within a fifth either way):
        at registration, and on a heartbeat after the fleet grew or shrank."""
        if FEATURE_PACE not in (node.features or ()):
            return
        want = self.pace()
        if want is not None and node.own_heartbeat is not None and want <= node.own_heartbeat:
            want = None  # the agent reports at least this seldom already
        have = node.heartbeat_pace
        if want == have or (want is not None and have is not None and have / PACE_SLACK <= want <= have * PACE_SLACK):
            return
        node.heartbeat_pace = want
        node._pace_hold = max(node._pace_hold or 0.0, want or 0.0) or None
        try:
            await conn.write(Pace(heartbeat_interval=want))
        except (ConnectionError, RuntimeError) as exc:
            log.debug("could not send the pace to node %s: %s", node.node_id, exc)

    # -- the stream -----------------------------------------------------------

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if self.leadership is not None and not self.leadership.is_leader():
            # Refused before the upgrade, so nothing is read. aiohttp's client hides
            # the body of a failed handshake but keeps the headers, so the sentence
            # travels in a header as well, for the agent to log.
            text = "this control plane is a standby and does not take agent streams; connect to the leader"
            return web.Response(status=503, reason=text, text=text + "\n", headers={REFUSAL_HEADER: text})
        # WebSocket pings find a stream whose other end vanished; a paced fleet's agents report
        # seldom, and their pings are stretched with them, or at 10,000 nodes they would be 500
        # a second, more than the heartbeats.
        pace = self.pace()
        ping = max(WS_PING_S, PACE_MISSED * pace) if pace is not None else WS_PING_S
        ws = web.WebSocketResponse(max_msg_size=self.max_msg_size, heartbeat=ping)
        await ws.prepare(request)
        reg = await self._read_register(ws)
        if reg is None:
            return ws
        claimed = reg.node_id
        refusal = self._check_identity(request, claimed)
        if refusal is not None:
            log.warning("refused the stream from %s: %s", request.remote, refusal)
            await self._refuse(ws, reg.id, refusal)
            return ws

        conn = _Conn(claimed, ws)
        old = self._conns.get(claimed)
        self._conns[claimed] = conn
        if old is not None:
            log.warning("node %s connected again from %s; closing its previous stream", claimed, request.remote)
            self._fail_pending(old, f"node {claimed} connected again; the stream this request went down was closed")
            await old.ws.close(code=_CLOSE_GOING_AWAY, message=b"replaced by a newer connection from the same node")
        self._apply_register(reg, request.remote)
        if self.freezer is not None:
            self.freezer.grew(len(self._nodes))
        self._said_pace(reg)
        registered = self._nodes[claimed]
        registered.heartbeat_pace = registered._pace_hold = None  # a new session starts at the agent's own interval
        await self._send_pace(conn, registered)
        try:
            async for frame in ws:
                if frame.type in (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY):
                    await self._on_frame(conn, frame.data)
                elif frame.type == aiohttp.WSMsgType.ERROR:
                    log.warning("the stream from node %s broke: %s", claimed, ws.exception())
        finally:
            if self._conns.get(claimed) is conn:
                del self._conns[claimed]
                node = self._nodes.get(claimed)
                if node is not None:
                    node.connected = False
                    node.disconnected_at = time.time()
                    # No stream, no paced reports to wait for: the plain thresholds from its last message.
                    node._pace_hold = None
                log.warning("the stream from node %s closed", claimed)
            self._fail_pending(conn, f"the stream to node {claimed} closed before it answered")
            if self.freezer is not None:
                self.freezer.released()  # its connection's cycles may be frozen
        return ws

    async def _read_register(self, ws: web.WebSocketResponse) -> Register | None:
        try:
            frame = await ws.receive(timeout=self.register_timeout)
        except TimeoutError:
            await self._refuse(ws, None, f"no register message within {self.register_timeout:g}s")
            return None
        if frame.type not in (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY):
            if not ws.closed:
                await ws.close(code=_CLOSE_REFUSED, message=b"expected a register message first")
            return None
        try:
            msg = decode(frame.data, sender="agent")
        except ProtocolError as exc:
            await self._refuse(ws, exc.msg_id, f"the first message must be a valid register: {exc}")
            return None
        if not isinstance(msg, Register):
            await self._refuse(ws, msg.id, f"the first message must be register, not {msg.TYPE}")
            return None
        return msg

    def _check_identity(self, request: web.Request, claimed: str) -> str | None:
        if self.identity is None:
            return None
        try:
            cert = self.identity(request)
        except Exception as exc:  # a broken callback refuses rather than admits
            log.exception("the identity check failed")
            return f"the client certificate could not be read: {exc}"
        if cert is None and not self.require_identity:
            return None
        refusal = check_node_certificate(cert, claimed, require_mark=self.require_node_mark)
        if refusal is None and cert is not None and client_kind(cert) is None and claimed not in self._unmarked_said:
            self._unmarked_said.add(claimed)
            log.warning(
                "node %s joined with a certificate that has no node mark (issued before llmgw marked node "
                "certificates); issue it again with `llmgw ctl cert issue-client %s` (or run `llmgw node add` "
                "for it again), then set agent_tls.require_node_mark: true once every node's has been",
                claimed,
                claimed,
            )
        return refusal

    async def _refuse(self, ws: web.WebSocketResponse, msg_id: str | None, reason: str) -> None:
        # The agent logs an ack with ok=false; a register carries no id, so the
        # ack answers "register".
        try:
            await ws.send_bytes(encode(Ack(id=msg_id or "register", ok=False, error=reason)))
        except (ConnectionError, RuntimeError):
            pass
        # A close reason is limited to 123 bytes; the ack above has the whole sentence.
        await ws.close(code=_CLOSE_REFUSED, message=reason.encode()[:123])

    async def _on_frame(self, conn: _Conn, data: str | bytes) -> None:
        try:
            msg = decode(data, sender="agent")
        except ProtocolError as exc:
            log.warning("node %s sent a message that was refused: %s", conn.node_id, exc)
            if exc.msg_id:
                await self._reply_error(conn, exc.msg_id, str(exc))
            return
        node = self._nodes.get(conn.node_id)
        if node is None:  # removed while connected cannot happen (remove refuses), but stay safe
            return
        if isinstance(msg, _REPLIES):
            self._resolve(conn, msg)
            return
        if isinstance(msg, Heartbeat):
            if msg.node_id is not None and msg.node_id != conn.node_id:
                err = f"heartbeat for node {msg.node_id} on the stream of node {conn.node_id}; ignored"
                log.warning("%s", err)
                if msg.id:
                    await self._reply_error(conn, msg.id, err)
                return
            self._apply_heartbeat(node, msg)
            node._pace_hold = node.heartbeat_pace
            await self._send_pace(conn, node)
        elif isinstance(msg, ShardStatus):
            self._seen(node)
            self._apply_shard(node, msg)
        elif isinstance(msg, Register):
            if msg.node_id != conn.node_id:
                err = f"register for node {msg.node_id} on the stream of node {conn.node_id}; ignored"
                log.warning("%s", err)
                if msg.id:
                    await self._reply_error(conn, msg.id, err)
                return
            self._apply_register(msg, node.remote)
        if msg.id:
            await self._reply(conn, Ack(id=msg.id, ok=True))

    async def _reply_error(self, conn: _Conn, msg_id: str, error: str) -> None:
        await self._reply(conn, Ack(id=msg_id, ok=False, error=error))

    async def _reply(self, conn: _Conn, ack: Ack) -> None:
        try:
            await conn.write(ack)
        except (ConnectionError, RuntimeError):
            pass  # the stream is closing; its end is handled by the reader

    def _resolve(self, conn: _Conn, msg: Reply) -> None:
        fut = conn.pending.get(msg.id or "")
        if fut is None or fut.done():
            if isinstance(msg, Ack) and not msg.ok:
                log.warning("node %s refused message %s: %s", conn.node_id, msg.id, msg.error)
            else:
                log.debug("node %s answered %s, which nothing is waiting for", conn.node_id, msg.id)
            return
        fut.set_result(msg)

    @staticmethod
    def _fail_pending(conn: _Conn, reason: str) -> None:
        for fut in conn.pending.values():
            if not fut.done():
                fut.set_exception(NotConnected(reason))
        conn.pending.clear()

    # -- applying reports -----------------------------------------------------

    def _seen(self, node: Node) -> None:
        node.last_seen = time.time()
        node._seen_mono = time.monotonic()
        if node.state != NodeState.READY:
            was = node.state
            node.state = NodeState.READY
            node.unreachable_since = None
            log.info("node %s is ready again (was %s); it can take new work", node.node_id, was.value)

    def _apply_register(self, reg: Register, remote: str | None) -> None:
        node = self._nodes.get(reg.node_id)
        new = node is None
        if node is None:
            node = self._nodes[reg.node_id] = Node(node_id=reg.node_id)
        before_engines = node.ready_engines()
        before_mem = _total_mem(node)
        was_ready = not new and node.state == NodeState.READY and node.connected
        node.connected = True
        node.remote = remote
        node.registered_at = time.time()
        node.disconnected_at = None
        node.protocol_version = reg.protocol_version
        node.agent_version = reg.agent_version
        node.features = reg.features
        node.inventory = reg.inventory
        node.installable_engines = reg.installable_engines
        node.engine_versions = reg.engine_versions
        node.labels = reg.labels
        node.mgmt_addr = reg.mgmt_addr
        node.mgmt_interface = reg.mgmt_interface
        node.fabrics = reg.fabrics
        node.fabric_problems = reg.fabric_problems
        node.declared_fabrics = reg.declared_fabrics
        node.weights = reg.weights
        node.own_heartbeat = reg.heartbeat_interval
        if reg.inventory is not None:
            node.memory = reg.inventory.memory or node.memory
            node.storage = reg.inventory.storage or node.storage
            node.imex = reg.inventory.imex or node.imex
        node.registered_shards = list(reg.shards or ())
        # The registration lists every shard: any other one is gone.
        reported = {s.shard_id: s for s in node.registered_shards}
        for sid in [s for s in node.shards if s not in reported]:
            if node.shards[sid].state != ShardState.PENDING:
                self._drop_shard(node, sid)
        for rs in reported.values():
            if rs.state is not None:
                self._apply_shard(
                    node, ShardStatus(shard_id=rs.shard_id, replica_id=rs.replica_id, state=rs.state, pid=rs.pid)
                )
        state_before = node.state
        self._seen(node)
        gpus = len(reg.inventory.gpus or ()) if reg.inventory else 0
        log.info(
            "node %s registered from %s (agent %s, protocol %s, %d GPU(s), %d shard(s) running)",
            reg.node_id,
            remote,
            reg.agent_version or "unknown",
            reg.protocol_version,
            gpus,
            len(reported),
        )
        if not was_ready and state_before == NodeState.READY:
            log.info("node %s is ready; it can take new work", reg.node_id)
        self._log_gains(node, before_engines, before_mem)
        for fn in self._register_listeners:
            try:
                fn(node, node.registered_shards)
            except Exception:
                log.exception("a registration listener failed on node %s", node.node_id)
        self._reported(node)

    def _apply_heartbeat(self, node: Node, hb: Heartbeat) -> None:
        before_engines = node.ready_engines()
        before_mem = _total_mem(node)
        self._seen(node)
        # Re-read every time; None is "not reported this time", so the last value stays.
        for name in (
            "memory",
            "load",
            "storage",
            "gpus",
            "ib_ports",
            "imex",
            "fabrics",
            "fabric_problems",
            "weights",
            "engine_versions",
        ):
            value = getattr(hb, name)
            if value is not None:
                setattr(node, name, value)
        if hb.subnet_managers is not None or hb.subnet_managers_error is not None:
            # One read: what it found and why it could not go further travel together.
            node.subnet_managers = hb.subnet_managers
            node.subnet_managers_error = hb.subnet_managers_error
        for ps in hb.provision or ():
            # Merged by engine: the agent sends one engine's status when only it changed.
            node.provision[ps.engine] = ps
        if hb.shards is not None:
            listed = {s.shard_id for s in hb.shards}
            for sid in [s for s in node.shards if s not in listed]:
                # A shard still fetching its weights is reported only by shard_status,
                # not in heartbeats; anything else missing is gone.
                if node.shards[sid].state != ShardState.PENDING:
                    self._drop_shard(node, sid)
            for st in hb.shards:
                self._apply_shard(node, st)
        self._log_gains(node, before_engines, before_mem)
        self._reported(node)

    def _apply_shard(self, node: Node, st: ShardStatus) -> None:
        prev = node.shards.get(st.shard_id)
        if prev is not None and prev.state == st.state:
            # The same state again is progress or a repeat, not a transition. A
            # heartbeat repeats states without fetch progress or output, so what
            # the repeat leaves out is kept.
            keep = {
                k: getattr(prev, k)
                for k in ("replica_id", "output_tail", "fetch", "reason", "pid")
                if getattr(st, k) is None and getattr(prev, k) is not None
            }
            merged = st.model_copy(update=keep) if keep else st
            node.shards[st.shard_id] = merged
            if merged.model_dump() != prev.model_dump():
                self._notify(ShardEvent(node.node_id, st.shard_id, merged, prev, transition=False))
            return
        node.shards[st.shard_id] = st
        if st.state == ShardState.READY:
            log.info("shard %s on node %s is ready", st.shard_id, node.node_id)
        elif st.state == ShardState.FAILED:
            log.warning("shard %s on node %s failed: %s", st.shard_id, node.node_id, st.reason or "no reason given")
        self._notify(ShardEvent(node.node_id, st.shard_id, st, prev, transition=True))

    def _drop_shard(self, node: Node, sid: str) -> None:
        prev = node.shards.pop(sid)
        self._notify(ShardEvent(node.node_id, sid, None, prev, transition=True))

    def _notify(self, ev: ShardEvent) -> None:
        for fn in self._listeners:
            try:
                fn(ev)
            except Exception:
                log.exception("a shard listener failed on %s/%s", ev.node_id, ev.shard_id)

    def _log_gains(self, node: Node, before_engines: set[str], before_mem: int | None) -> None:
        # "The node now qualifies" explains a placement that happens late.
        for engine in sorted(node.ready_engines() - before_engines):
            version = (node.engine_versions or {}).get(engine) or (
                node.provision[engine].version if engine in node.provision else None
            )
            log.info(
                "node %s now has %s%s ready; it qualifies for models that need it",
                node.node_id,
                engine,
                f" {version}" if version else "",
            )
        after_mem = _total_mem(node)
        if before_mem is not None and after_mem is not None and after_mem > before_mem:
            log.info(
                "node %s now has %.1f GiB of memory (was %.1f GiB)", node.node_id, after_mem / 2**30, before_mem / 2**30
            )

    # -- liveness ---------------------------------------------------------------

    async def _liveness_loop(self) -> None:
        while True:
            await asyncio.sleep(self.check_interval)
            try:
                await self.check()
            except Exception:  # the timer must outlive one bad pass
                log.exception("the liveness check failed")

    async def check(self, now: float | None = None) -> None:
        """Mark nodes unreachable or lost by the time since their last message;
        drop every stream when this control plane has stopped leading."""
        if self.leadership is not None and self._conns and not self.leadership.is_leader():
            log.warning("no longer the leader; closing %d agent stream(s)", len(self._conns))
            for conn in list(self._conns.values()):
                await conn.ws.close(
                    code=_CLOSE_GOING_AWAY, message=b"this control plane is now a standby; connect to the leader"
                )
        now = time.monotonic() if now is None else now
        for node in self._nodes.values():
            age = now - node._seen_mono
            unreachable_after, lost_after = self.liveness_after(node)
            if age >= lost_after and node.state != NodeState.LOST:
                if node.unreachable_since is None:
                    node.unreachable_since = time.time()
                node.state = NodeState.LOST
                node.version += 1
                log.warning(
                    "node %s is lost: no heartbeat for %.0fs (last %s); its work is placed elsewhere",
                    node.node_id,
                    age,
                    _utc(node.last_seen),
                )
            elif unreachable_after <= age < lost_after and node.state == NodeState.READY:
                node.state = NodeState.UNREACHABLE
                node.version += 1
                node.unreachable_since = time.time()
                log.warning(
                    "node %s is unreachable: no heartbeat for %.0fs (last %s); nothing new is placed there",
                    node.node_id,
                    age,
                    _utc(node.last_seen),
                )


def _total_mem(node: Node) -> int | None:
    return node.memory.total_bytes if node.memory is not None else None
