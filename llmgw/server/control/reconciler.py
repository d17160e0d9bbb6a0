"""The reconciler: keeps what runs on the nodes equal to what the catalog asks for.

Every ``control.interval`` (and sooner, when a shard changes state) it compares
the catalog's targets with the replicas it knows of and acts through the agent
service: places and starts missing replicas, stops extra ones, fails replicas
that stay starting past their profile's ``startup_timeout`` (fetching the
weights does not reset that timer), retries a model whose starts fail after a
doubling backoff, replaces replicas on lost nodes, moves work off a draining
node one replica at a time, loads an on-demand model when a request arrives
and stops it after ``idle_timeout`` without requests.

It keeps no replica state of its own across a restart: agents describe every
shard they run when they register, with the start request they were given, and
the reconciler adopts what it can match to the catalog without restarting any
engine, lets go of shards an agent no longer reports, and tells an agent to
stop only what it cannot match.

Endpoints of ready replicas are published to the gateway's endpoint set.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
import secrets
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from llmgw.config.server import ProfileConfig, ServerConfig
from llmgw.errors import LlmgwError
from llmgw.files import new_token
from llmgw.protocol import (
    FEATURE_DRAIN,
    DrainShard,
    EngineProfile,
    EngineWant,
    FetchProgress,
    Provision,
    RunningShard,
    ShardState,
    StartShard,
    StopShard,
)
from llmgw.server.control.agents import AgentService, AgentServiceError, Node, NodeState, ShardEvent
from llmgw.server.control.capacity import Capacities
from llmgw.server.control.catalog import Catalog, CatalogEntry
from llmgw.server.control.placement import (
    Claims,
    Fleet,
    NodeFabricFacts,
    NodeView,
    NodeViewCache,
    Placement,
    PlacementRequest,
    Refusal,
    natural_key,
)
from llmgw.server.gateway.endpoints import Endpoint, EndpointSet
from llmgw.store import Store

log = logging.getLogger("llmgw.server.control.reconciler")


class ReplicaState(StrEnum):
    """A replica's state, from its shards' (in this order in listings and metrics)."""

    STARTING = "starting"
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"
    STOPPING = "stopping"


class NodeMark(StrEnum):
    """An operator's mark on a node, kept in the store."""

    CORDONED = "cordoned"  # nothing new is placed there
    DRAINING = "draining"  # cordoned, and its replicas move elsewhere one at a time


# A shard just sent may reach the agent after it registered on a new stream;
# it is not let go for missing from that registration within this window.
_DISPATCH_GRACE_S = 3.0
# A replica told to stop is forgotten after this long even if no node confirms it.
_STOP_GRACE_S = 120.0
# Time an engine gets to finish what it serves when a drained replica stops.
_DRAIN_TIMEOUT_S = 60.0
_REQUEST_TIMEOUT_S = 30.0
# Ticks woken by shard changes run at most this often.
_MIN_TICK_SPACING_S = 0.2
# Each replica's engine key says what it is wherever one turns up.
ENGINE_KEY_PREFIX = "llmgw-engine-"


class ControlError(LlmgwError):
    """An operator's request that was refused; the message says why."""


@dataclass
class Shard:
    node_id: str
    shard_id: str
    rank: int
    gpus: tuple[int, ...]
    spec: StartShard
    state: ShardState = ShardState.PENDING
    fetch: FetchProgress | None = None
    pid: int | None = None
    reason: str | None = None
    dispatched_at: float = 0.0  # monotonic; 0 for adopted shards
    gone: bool = False  # the node no longer runs it


@dataclass
class Replica:
    id: str
    model: str
    profile: str
    profile_fp: str | None
    engine: str
    pool: str
    memory_gb: float
    http_port: int | None
    nnodes: int
    created: float  # monotonic
    created_wall: float
    shards: list[Shard] = field(default_factory=list)
    adopted: bool = False
    stopping: bool = False
    stop_reason: str | None = None
    stopping_since: float | None = None
    failed_reason: str | None = None
    replaces: str | None = None  # drain: the replica this one takes over from
    replaced_by: str | None = None
    endpoint: Endpoint | None = None
    # What its engine requires and the gateway sends; None for an engine started without one.
    api_key: str | None = field(default=None, repr=False)

    @property
    def node_ids(self) -> list[str]:
        return [s.node_id for s in self.shards]

    @property
    def leader(self) -> Shard | None:
        return next((s for s in self.shards if s.rank == 0), None)

    @property
    def state(self) -> ReplicaState:
        if self.stopping:
            return ReplicaState.STOPPING
        if self.failed_reason is not None:
            return ReplicaState.FAILED
        if len(self.shards) < self.nnodes:
            return ReplicaState.STARTING
        states = {s.state for s in self.shards}
        if not all(st.running for st in states):
            return ReplicaState.FAILED
        if states == {ShardState.READY}:
            return ReplicaState.READY
        if states <= {ShardState.READY, ShardState.LOADING}:
            return ReplicaState.LOADING
        return ReplicaState.STARTING

    @property
    def live(self) -> bool:
        """Counts towards its model's target."""
        return not self.stopping and self.failed_reason is None and self.replaced_by is None


@dataclass
class _Backoff:
    failures: int = 0
    next_at: float = 0.0
    last_reason: str | None = None


@dataclass
class _StartPlan:
    entry: CatalogEntry
    profile: ProfileConfig
    placement: Placement
    replaces: str | None = None


class _PassFleet:
    """The node views one pass places on: built when its first placement needs them (most
    passes place nothing), then claimed from by each start it places."""

    def __init__(self, build: Callable[[], list[NodeView]], indexed: bool = True) -> None:
        self._build = build
        self._indexed = indexed
        self._fleet: Fleet | None = None

    def get(self) -> Fleet:
        if self._fleet is None:
            self._fleet = Fleet(self._build(), indexed=self._indexed)
        return self._fleet


def _slug(name: str) -> str:
    # Shard ids name files on the node; a model name may hold / : @ +.
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.")[:48] or "model"


def _words_fetch(f: FetchProgress | None) -> str:
    if f is None:
        return ""
    pct = f.percent
    if pct is not None:
        return f", fetching its weights ({pct:.0f}%)"
    return f", fetching its weights ({f.bytes_done / 1e6:.0f} MB so far)"


class Reconciler:
    def __init__(
        self,
        config: ServerConfig,
        catalog: Catalog,
        agents: AgentService,
        endpoints: EndpointSet,
        store: Store | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config
        self.catalog = catalog
        self.agents = agents
        self.endpoints = endpoints
        self.store = store
        # What the control plane knows of each node's physical fabrics (the fabric
        # service's), for multi-node placement; None: names from agent.yaml only.
        self.fabric_facts: Callable[[], Mapping[str, NodeFabricFacts]] | None = None
        # Measured capacity (`ctl bench --save`), which sets each published endpoint's admission
        # limit and routing weight (control/capacity.py); None: every endpoint keeps the defaults.
        self.capacity: Capacities | None = None
        self.clock = clock
        self.rng = rng or random.Random()
        c = config.control
        self.interval = c.interval
        self.base_backoff = c.base_backoff
        self.max_backoff = c.max_backoff
        self.port_lo, self.port_hi = c.port_range
        self.cold_start_wait = c.cold_start_wait
        self.engine_versions = {e: v for e, v, _ in config.engines.wanted()}
        self.provision = Provision(
            engines=[EngineWant(engine=e, version=v, source_url=u) for e, v, u in config.engines.wanted()]
        )
        # Node views kept between passes, built again only for nodes whose figures changed.
        self._view_cache = NodeViewCache()
        # False: place by checking every node (the exhaustive reference the index is tested
        # and benchmarked against); the answers are the same.
        self.indexed_placement = True
        self.replicas: dict[str, Replica] = {}
        self._shard_index: dict[str, str] = {}  # shard id -> replica id
        self.marks: dict[str, NodeMark] = {}  # node id -> its mark
        self.problems: dict[str, str] = {}  # model -> why it cannot be placed now
        self.node_warnings: dict[str, str] = {}  # node id -> e.g. why a drain is stuck
        self._backoff: dict[str, _Backoff] = {}
        # The last failed replica of each model, shown until one of the model's replicas
        # is ready again: a failure that vanished at once could not be read anywhere.
        self._failed_rows: dict[str, dict] = {}
        self._last_request: dict[str, float] = {}
        self._waiters: dict[str, int] = {}
        self._changed: dict[str, asyncio.Event] = {}  # per model: a replica became ready or a problem appeared
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._lock = asyncio.Lock()
        # After a start, agents take a moment to reconnect and describe what they
        # run; placing before then would start engines the fleet already has.
        self.settle = c.unreachable_after
        self._started_at: float | None = None
        # Once every node known to be out there is back there is nobody left to wait for.
        self.expected_nodes = frozenset(c.expected_nodes)
        self._back: set[str] = set()  # nodes registered since start()
        agents.on_shard_change(self._on_shard)
        agents.on_register(self._on_register)

    # -- lifetime -------------------------------------------------------------

    async def start(self) -> None:
        if self.store is not None:
            # The store holds only the marks it was given.
            self.marks = {n: NodeMark(m) for n, m in (await self.store.node_marks_list()).items()}
        self._started_at = self.clock()
        self._back = set()
        if self.expected_nodes:
            log.info(
                "waiting up to %gs for node(s) %s to reconnect before placing anything",
                self.settle,
                ", ".join(sorted(self.expected_nodes, key=natural_key)),
            )
        else:
            log.info("waiting %gs for agents to reconnect before placing anything", self.settle)
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="reconciler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def wake(self) -> None:
        self._wake.set()

    def forget(self) -> None:
        """Let go of every replica without touching its engines (this control plane stopped leading):
        their endpoints leave the gateway's set, and a standby serves what the leader publishes
        instead. If it leads again, agents describe their shards anew and they are adopted."""
        for r in self.replicas.values():
            self._unpublish(r)
        self.replicas.clear()
        self._shard_index.clear()

    async def _loop(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception:  # one bad pass must not end reconciling
                log.exception("a reconcile pass failed")
            try:
                await asyncio.wait_for(self._wake.wait(), self.interval)
            except TimeoutError:
                pass
            self._wake.clear()
            await asyncio.sleep(_MIN_TICK_SPACING_S)

    def _spawn(self, coro) -> None:
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    # -- the gateway's side -------------------------------------------------------

    def touch(self, model: str) -> None:
        """A request for ``model`` arrived: it keeps an on-demand model loaded."""
        self._last_request[model] = self.clock()

    async def wait_ready(self, model: str, timeout: float | None = None) -> str | None:
        """Wait until ``model`` has a ready replica (loading an on-demand one);
        None once it has, else why not, in words for the client."""
        entry = self.catalog.get(model)
        if entry is None or not entry.model.managed:
            return f"no endpoint of model '{model}' is ready"
        name = entry.name
        sc = entry.model.scaling
        if sc is not None and sc.max == 0:
            return f"model '{name}' is stopped (its scaling has max 0); an operator can start it with llmgw ctl scale"
        deadline = self.clock() + (self.cold_start_wait if timeout is None else timeout)
        self._last_request[name] = self.clock()
        self._waiters[name] = self._waiters.get(name, 0) + 1
        event = self._changed.setdefault(name, asyncio.Event())
        self.wake()
        try:
            while True:
                if self._has_ready(name):
                    return None
                problem = self.problems.get(name)
                if problem is not None and not self._any_live(name):
                    # The refusal names nodes and their memory: the operator's to read (log,
                    # ctl models, ctl explain-placement), not an API client's.
                    return (
                        f"model '{name}' cannot be started now: no node can take it; an operator can see "
                        f"why with llmgw ctl explain-placement {name}"
                    )
                left = deadline - self.clock()
                if left <= 0:
                    return (
                        f"model '{name}' is loading and was not ready within {self.cold_start_wait:g}s "
                        "(control.cold_start_wait); try again shortly"
                    )
                event.clear()
                try:
                    await asyncio.wait_for(event.wait(), min(left, 1.0))
                except TimeoutError:
                    pass
        finally:
            self._waiters[name] -= 1
            if not self._waiters[name]:
                del self._waiters[name]

    def _has_ready(self, model: str) -> bool:
        return any(
            r.model == model and r.endpoint is not None and r.state is ReplicaState.READY
            for r in self.replicas.values()
        )

    def _any_live(self, model: str) -> bool:
        return any(r.model == model and r.live for r in self.replicas.values())

    def _signal(self, model: str) -> None:
        ev = self._changed.get(model)
        if ev is not None:
            ev.set()

    # -- operators ------------------------------------------------------------------

    def _known_node(self, node_id: str) -> Node:
        node = self.agents.get(node_id)
        if node is None:
            raise ControlError(f"no node named {node_id} is known; llmgw ctl nodes lists them")
        return node

    async def _set_mark(self, node_id: str, mark: NodeMark | None) -> None:
        if self.store is not None:
            await self.store.node_mark_set(node_id, mark)
        if mark is None:
            self.marks.pop(node_id, None)
            self.node_warnings.pop(node_id, None)
        else:
            self.marks[node_id] = mark

    async def cordon(self, node_id: str) -> str:
        self._known_node(node_id)
        if self.marks.get(node_id) is NodeMark.DRAINING:
            return f"{node_id} is already draining (which cordons it); llmgw ctl uncordon {node_id} undoes both"
        await self._set_mark(node_id, NodeMark.CORDONED)
        log.info("node %s cordoned: nothing new is placed there", node_id)
        running = len(self._replicas_on(node_id))
        return (
            f"{node_id} is cordoned: nothing new is placed there; the {running} replica(s) running there keep running"
        )

    async def uncordon(self, node_id: str) -> str:
        self._known_node(node_id)
        was = self.marks.get(node_id)
        if was is None:
            return f"{node_id} was neither cordoned nor draining; nothing changed"
        await self._set_mark(node_id, None)
        log.info("node %s uncordoned (was %s): it takes new work again", node_id, was)
        self.wake()
        return f"{node_id} takes new work again (it was {was})"

    async def drain(self, node_id: str) -> str:
        self._known_node(node_id)
        await self._set_mark(node_id, NodeMark.DRAINING)
        n = len([r for r in self._replicas_on(node_id) if not r.stopping])
        log.info("draining node %s: moving %d replica(s) elsewhere, one at a time", node_id, n)
        self.wake()
        if not n:
            return f"{node_id} is draining: nothing runs there, and nothing new will be placed there"
        return (
            f"{node_id} is draining: its {n} replica(s) move elsewhere one at a time, each replacement "
            "ready before the old one stops; llmgw ctl replicas shows the progress"
        )

    def remove_node(self, node_id: str) -> Node:
        """`llmgw node remove`: forget a lost node, or an unreachable one with nothing placed on it
        (AgentService.remove says why not, raising AgentServiceError)."""
        return self.agents.remove(node_id, placed=self.placed_on(node_id))

    def placed_on(self, node_id: str) -> list[str]:
        """What is placed on the node: replicas with a shard there not known to have ended, then
        shards it last reported running that no replica holds (not adopted, or still being stopped)."""
        replicas = self._replicas_on(node_id)
        held = {s.shard_id for r in replicas for s in r.shards}
        out = sorted(
            (r.id for r in replicas if any(s.node_id == node_id and not s.gone for s in r.shards)), key=natural_key
        )
        node = self.agents.get(node_id)
        if node is not None:
            out += sorted(
                (sid for sid, st in node.shards.items() if st.state.running and sid not in held), key=natural_key
            )
        return out

    def _replicas_on(self, node_id: str) -> list[Replica]:
        return [r for r in self.replicas.values() if node_id in r.node_ids]

    # -- reports from agents -----------------------------------------------------------

    def _on_register(self, node: Node, shards: list[RunningShard]) -> None:
        self._back.add(node.node_id)
        if self.provision.engines:
            self._spawn(self._send_provision(node.node_id))
        now = self.clock()
        reported = {rs.shard_id: rs for rs in shards}
        # Letting go: what this node no longer runs was lost with its previous agent or stream.
        for r in list(self.replicas.values()):
            for s in r.shards:
                if s.node_id != node.node_id or s.gone or s.shard_id in reported:
                    continue
                if s.dispatched_at and now - s.dispatched_at < _DISPATCH_GRACE_S:
                    continue
                self._shard_gone(r, s, f"node {node.node_id} registered again without shard {s.shard_id}")
        for rs in shards:
            if rs.shard_id in self._shard_index:
                continue
            problem = self._adopt(node, rs)
            if problem is not None:
                log.warning("node %s runs shard %s, which is stopped: %s", node.node_id, rs.shard_id, problem)
                self._spawn(
                    self._send_stop(node.node_id, rs.shard_id, f"the control plane does not know this shard: {problem}")
                )
        self.wake()

    def _adopt(self, node: Node, rs: RunningShard) -> str | None:
        """Take a reported shard into a replica; None when adopted, else why not."""
        spec = rs.spec
        if spec is None:
            return "the agent kept no start request for it"
        if not spec.model or not spec.replica_id:
            return "its start request names no model or replica"
        entry = self.catalog.get(spec.model)
        if entry is None or entry.name != spec.model:
            return f"model {spec.model} is not in the catalog"
        pname = spec.profile.name if spec.profile else None
        profile = next((p for p in entry.model.profiles if p.name == pname), None)
        if profile is None:
            return f"model {spec.model} has no profile named {pname}"
        if rs.state is not None and not rs.state.running:
            return f"it is {rs.state}"
        r = self.replicas.get(spec.replica_id)
        now = self.clock()
        if r is None:
            r = Replica(
                id=spec.replica_id,
                model=entry.name,
                profile=profile.name,
                profile_fp=spec.profile_fp,
                engine=spec.engine,
                pool=spec.pool or _pool(profile, None),
                memory_gb=profile.min_memory_gb or 0.0,
                http_port=None,
                nnodes=spec.nnodes or 1,
                created=now,
                created_wall=time.time(),
                adopted=True,
            )
            self.replicas[r.id] = r
            log.info("adopted replica %s of %s (profile %s) from node %s", r.id, r.model, r.profile, node.node_id)
        rank = spec.rank or 0
        if rank == 0:
            r.http_port = spec.http_port
        if rank == 0 or r.api_key is None:
            # The key the engine was started with, as the agent kept it: the leader's is the one it checks.
            r.api_key = spec.api_key
        shard = Shard(
            node_id=node.node_id,
            shard_id=rs.shard_id,
            rank=rank,
            gpus=tuple(spec.gpus or ()),
            spec=spec,
            state=rs.state or ShardState.PENDING,
            pid=rs.pid,
        )
        r.shards.append(shard)
        r.shards.sort(key=lambda s: s.rank)
        self._shard_index[rs.shard_id] = r.id
        # An on-demand model adopted after a restart gets a full idle period.
        self._last_request.setdefault(r.model, now)
        # The agent reported the state with its registration; a status event for it
        # came before this adoption and was not seen.
        live = node.shards.get(rs.shard_id)
        if live is not None:
            shard.state, shard.fetch, shard.pid = live.state, live.fetch, live.pid or shard.pid
        self._after_change(r)
        return None

    def _on_shard(self, ev: ShardEvent) -> None:
        rid = self._shard_index.get(ev.shard_id)
        r = self.replicas.get(rid) if rid else None
        if r is None:
            return
        shard = next((s for s in r.shards if s.shard_id == ev.shard_id), None)
        if shard is None or shard.node_id != ev.node_id:
            return
        if ev.status is None:
            self._shard_gone(r, shard, f"node {ev.node_id} no longer reports shard {ev.shard_id}")
            return
        st = ev.status
        shard.state = st.state
        shard.fetch = st.fetch if st.state is ShardState.PENDING else None
        shard.pid = st.pid or shard.pid
        shard.reason = st.reason
        if not st.state.running:
            # A failed shard's record stays on the agent until it is told to stop it.
            shard.gone = st.state is ShardState.STOPPED
            if r.stopping:
                self._forget_if_stopped(r)
            else:
                words = st.reason or "no reason given"
                tail = [line for line in (st.output_tail or []) if line.strip()]
                if tail:
                    words += f" (last output: {tail[-1].strip()[:200]})"
                self._fail(r, f"shard {shard.shard_id} on node {shard.node_id} {st.state}: {words}", count=True)
            return
        self._after_change(r)
        if ev.transition:
            self.wake()

    def _shard_gone(self, r: Replica, s: Shard, why: str) -> None:
        s.gone = True
        if r.stopping:
            self._forget_if_stopped(r)
            return
        # Not the model's fault: no backoff, a new replica is placed at once.
        self._fail(r, why, count=False)

    def _after_change(self, r: Replica) -> None:
        if r.state is ReplicaState.READY and r.endpoint is None:
            self._publish(r)

    # -- endpoints -------------------------------------------------------------------

    def _publish(self, r: Replica) -> None:
        leader = r.leader
        if leader is None or r.http_port is None:
            return
        node = self.agents.get(leader.node_id)
        host = (node.mgmt_addr if node else None) or (node.remote if node else None) or "127.0.0.1"
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        b = self.config.router.breaker
        ep = Endpoint(
            r.model, f"http://{host}:{r.http_port}", r.engine, None, b.failures, b.cooldown, api_key=r.api_key
        )
        # The agent has seen the engine answer; the gateway's own probe keeps watching.
        ep.healthy = True
        ep.health_detail = f"ready (replica {r.id} on {leader.node_id})"
        if self.capacity is not None:
            self.capacity.fit(ep, r.model, r.profile)  # its measured capacity and weight, before it takes traffic
        r.endpoint = ep
        self.endpoints.add(ep)
        log.info("replica %s of %s is ready at %s; serving", r.id, r.model, ep.url)
        b_off = self._backoff.pop(r.model, None)
        if b_off is not None and b_off.failures:
            log.info("%s started after %d failed attempt(s)", r.model, b_off.failures)
        self.problems.pop(r.model, None)
        self._failed_rows.pop(r.model, None)
        self._signal(r.model)
        if r.replaces:
            old = self.replicas.get(r.replaces)
            if old is not None and not old.stopping:
                self._stop(old, f"drained: replica {r.id} took over", drain=True)
        self.wake()

    def _unpublish(self, r: Replica) -> None:
        if r.endpoint is not None:
            self.endpoints.remove(r.endpoint)
            r.endpoint = None

    # -- failing and stopping -------------------------------------------------------------

    def _fail(self, r: Replica, reason: str, *, count: bool) -> None:
        if r.failed_reason is not None or r.stopping:
            return
        r.failed_reason = reason
        log.warning("replica %s of %s failed: %s", r.id, r.model, reason)
        self._unpublish(r)
        if r.replaces:
            old = self.replicas.get(r.replaces)
            if old is not None and old.replaced_by == r.id:
                old.replaced_by = None
        if count:
            b = self._backoff.setdefault(r.model, _Backoff())
            b.failures += 1
            wait = min(self.base_backoff * 2 ** (b.failures - 1), self.max_backoff)
            b.next_at = self.clock() + wait
            b.last_reason = reason
            log.warning("%s: next start attempt in %.0fs (%d failure(s) in a row)", r.model, wait, b.failures)
        self._stop(r, f"failed: {reason}")
        self._signal(r.model)
        self.wake()

    def _stop(self, r: Replica, reason: str, *, drain: bool = False) -> None:
        if r.stopping:
            return
        r.stopping = True
        r.stop_reason = reason
        r.stopping_since = self.clock()
        self._unpublish(r)
        if r.replaced_by:
            new = self.replicas.get(r.replaced_by)
            if new is not None:
                new.replaces = None
        for s in r.shards:
            if s.gone:
                continue
            if not self.agents.is_connected(s.node_id):
                s.gone = True
                continue
            self._spawn(self._send_stop(s.node_id, s.shard_id, reason, drain=drain, replica=r, shard=s))
        self._forget_if_stopped(r)

    def _forget_if_stopped(self, r: Replica) -> None:
        if r.stopping and all(s.gone for s in r.shards):
            self._forget(r)

    def _forget(self, r: Replica) -> None:
        if r.failed_reason is not None:
            row = self._row(r, self.clock(), self.catalog.get(r.model))
            row["state"] = ReplicaState.FAILED
            self._failed_rows[r.model] = row
        self._unpublish(r)
        self.replicas.pop(r.id, None)
        for s in r.shards:
            if self._shard_index.get(s.shard_id) == r.id:
                del self._shard_index[s.shard_id]
        log.info("replica %s of %s is gone (%s)", r.id, r.model, r.stop_reason or r.failed_reason or "stopped")

    async def _send_stop(
        self,
        node_id: str,
        shard_id: str,
        reason: str,
        *,
        drain: bool = False,
        replica: Replica | None = None,
        shard: Shard | None = None,
    ) -> None:
        node = self.agents.get(node_id)
        use_drain = drain and node is not None and FEATURE_DRAIN in (node.features or [])
        msg = (
            DrainShard(shard_id=shard_id, reason=reason, timeout_s=_DRAIN_TIMEOUT_S)
            if use_drain
            else StopShard(shard_id=shard_id, reason=reason)
        )
        # The agent answers once the engine is stopped (after draining, for a drain).
        timeout = _REQUEST_TIMEOUT_S + (_DRAIN_TIMEOUT_S if use_drain else 0.0)
        try:
            ack = await self.agents.request(node_id, msg, timeout=timeout)
        except AgentServiceError as exc:
            log.warning("could not stop shard %s on node %s: %s", shard_id, node_id, exc)
            if shard is not None and not self.agents.is_connected(node_id):
                shard.gone = True
        else:
            if not getattr(ack, "ok", True):
                # "no shard X runs on this node": it is gone already.
                log.info("node %s: %s", node_id, getattr(ack, "error", ""))
            if shard is not None:
                shard.gone = True
        if replica is not None:
            self._forget_if_stopped(replica)

    async def _send_provision(self, node_id: str) -> None:
        try:
            await self.agents.send(node_id, self.provision)
        except AgentServiceError as exc:
            log.warning("could not tell node %s which engines to install: %s", node_id, exc)

    # -- the pass -------------------------------------------------------------------------

    def target(self, entry: CatalogEntry, now: float) -> int:
        sc = entry.model.scaling
        if sc is None:
            return 1
        if sc.max == 0:
            return 0
        if sc.min > 0:
            return sc.min
        # On demand: one replica while requests arrive or wait, none after idle_timeout.
        if self._waiters.get(entry.name):
            return 1
        last = self._last_request.get(entry.name)
        if last is not None and now - last < sc.idle_timeout:
            return 1
        if any(r.endpoint is not None and r.endpoint.inflight for r in self.replicas.values() if r.model == entry.name):
            return 1
        return 0

    async def tick(self) -> None:
        async with self._lock:
            starts = self.plan()
            if starts:
                await asyncio.gather(*(self._start(p) for p in starts))

    def plan(self) -> list[_StartPlan]:
        """One pass: fail, stop and release what must go; return the replicas to start.
        Synchronous, so it sees one consistent fleet."""
        now = self.clock()
        nodes = self.agents.node_map()
        entries = {e.name: e for e in self.catalog.models() if e.model.managed}
        for r in list(self.replicas.values()):
            if r.stopping:
                self._release_stopping(r, nodes, now)
            elif r.failed_reason is None:
                self._check_live(r, nodes, entries, now)
        if self._settling(now):
            return []
        fleet = _PassFleet(lambda: self.views(nodes), indexed=self.indexed_placement)
        return self._meet_targets(entries, fleet, now) + self._move_off_draining(entries, fleet, now)

    def _settling(self, now: float) -> bool:
        """Still waiting, after a start, for agents to come back and say what they run."""
        if self._started_at is None or now - self._started_at >= self.settle:
            return False
        if self.expected_nodes and self.expected_nodes <= self._back:
            log.info("every expected node has registered; placing without waiting out the settle time")
            self._started_at = None
            return False
        return True

    def _release_stopping(self, r: Replica, nodes: Mapping[str, Node], now: float) -> None:
        """Forget a stopping replica once its nodes confirmed, were lost, or never answered."""
        for s in r.shards:
            n = nodes.get(s.node_id)
            if n is None or n.state == NodeState.LOST:
                s.gone = True
        if all(s.gone for s in r.shards):
            self._forget(r)
        elif r.stopping_since is not None and now - r.stopping_since > _STOP_GRACE_S:
            log.warning("replica %s: no node confirmed it stopped within %.0fs; forgetting it", r.id, _STOP_GRACE_S)
            self._forget(r)

    def _check_live(self, r: Replica, nodes: Mapping[str, Node], entries: dict[str, CatalogEntry], now: float) -> None:
        """Fail a replica on a lost or removed node, or not ready past its startup_timeout; stop one
        the catalog no longer asks for."""
        # Lost or removed nodes: place the replica again elsewhere.
        for s in r.shards:
            n = nodes.get(s.node_id)
            if n is None or n.state == NodeState.LOST:
                s.gone = True
                why = "removed" if n is None else "lost"
                self._fail(r, f"node {s.node_id} is {why}; the replica is placed again", count=False)
                return
        entry = entries.get(r.model)
        if entry is None:
            self._stop(r, f"model {r.model} left the catalog")
            return
        profile = next((p for p in entry.model.profiles if p.name == r.profile), None)
        if profile is None:
            self._stop(r, f"profile {r.profile} left {r.model}'s catalog entry")
            return
        if r.state is not ReplicaState.READY and now - r.created > profile.startup_timeout:
            fetch = next((_words_fetch(s.fetch) for s in r.shards if s.fetch), "")
            self._fail(
                r,
                f"not ready {profile.startup_timeout:g}s after it was started "
                f"(startup_timeout; still {r.state}{fetch})",
                count=True,
            )

    def _meet_targets(self, entries: dict[str, CatalogEntry], fleet: _PassFleet, now: float) -> list[_StartPlan]:
        """Stop each model's extra replicas; place its missing ones, unless it is backing off."""
        starts: list[_StartPlan] = []
        for name, entry in entries.items():
            want = self.target(entry, now)
            live = [r for r in self.replicas.values() if r.model == name and r.live]
            if len(live) > want:
                marked = set(self.marks)
                order = sorted(
                    live, key=lambda r: (r.state is ReplicaState.READY, not (set(r.node_ids) & marked), -r.created)
                )
                for r in order[: len(live) - want]:
                    why = (
                        "idle" if want == 0 and entry.model.scaling and entry.model.scaling.min == 0 else "scaled down"
                    )
                    self._stop(r, f"{why} ({name} wants {want} replica(s))")
                continue
            if len(live) == want:
                if want:
                    self.problems.pop(name, None)
                continue
            if self._backing_off(name, now):
                continue
            for _ in range(want - len(live)):
                plan = self._place(entry, fleet)
                if isinstance(plan, str):
                    if self.problems.get(name) != plan:
                        log.warning("%s", plan)
                    self.problems[name] = plan
                    self._signal(name)
                    break
                self.problems.pop(name, None)
                starts.append(plan)
        return starts

    def _move_off_draining(self, entries: dict[str, CatalogEntry], fleet: _PassFleet, now: float) -> list[_StartPlan]:
        """One replica at a time per draining node, its replacement ready before it stops."""
        starts: list[_StartPlan] = []
        for node_id, mark in sorted(self.marks.items()):
            if mark is not NodeMark.DRAINING:
                continue
            on_node = sorted(
                (r for r in self._replicas_on(node_id) if not r.stopping and r.failed_reason is None),
                key=lambda r: natural_key(r.id),
            )
            if not on_node:
                self.node_warnings.pop(node_id, None)
                continue
            if any(r.replaced_by for r in on_node):
                continue  # a replacement is on its way
            old = on_node[0]
            entry = entries.get(old.model)
            if entry is None or self._backing_off(old.model, now):
                continue
            plan = self._place(entry, fleet)
            if isinstance(plan, str):
                self.node_warnings[node_id] = f"drain is waiting: cannot move replica {old.id} elsewhere: {plan}"
                continue
            self.node_warnings.pop(node_id, None)
            plan.replaces = old.id
            starts.append(plan)
        return starts

    def _backing_off(self, model: str, now: float) -> bool:
        b = self._backoff.get(model)
        return b is not None and now < b.next_at

    def views(self, nodes: Mapping[str, Node]) -> list[NodeView]:
        gpus: dict[str, set[int]] = {}
        mem: dict[str, float] = {}
        count: dict[str, int] = {}
        for r in self.replicas.values():
            for s in r.shards:
                if s.gone:
                    continue
                gpus.setdefault(s.node_id, set()).update(s.gpus)
                mem[s.node_id] = mem.get(s.node_id, 0.0) + r.memory_gb
                count[s.node_id] = count.get(s.node_id, 0) + 1
        facts = self.fabric_facts() if self.fabric_facts is not None else {}
        out = []
        for nid in sorted(nodes, key=natural_key):
            mark = self.marks.get(nid)
            out.append(
                self._view_cache.view(
                    nodes[nid],
                    cordoned=mark is NodeMark.CORDONED,
                    draining=mark is NodeMark.DRAINING,
                    claims=Claims(frozenset(gpus.get(nid, ())), mem.get(nid, 0.0), count.get(nid, 0)),
                    fabric_facts=facts.get(nid),
                )
            )
        self._view_cache.forget_except(nodes)
        return out

    def request_for(self, entry: CatalogEntry, profile: ProfileConfig) -> PlacementRequest:
        return PlacementRequest(
            model=entry.name,
            engine=profile.engine,
            gpu_class=profile.gpu_class,
            tp=max(1, profile.tp // profile.nodes),
            nodes=profile.nodes,
            min_memory_gb=profile.min_memory_gb,
            node_selector=dict(profile.node_selector),
            source=entry.model.source,
        )

    def _place(self, entry: CatalogEntry, fleet: _PassFleet) -> _StartPlan | str:
        """The first profile that fits, in catalog order, its nodes claimed in ``fleet``; else
        every profile's refusal."""
        refusals: list[str] = []
        for profile in entry.model.profiles:
            res = fleet.get().place(self.request_for(entry, profile))
            if isinstance(res, Placement):
                fleet.get().claim(res, profile.min_memory_gb)
                return _StartPlan(entry, profile, res)
            assert isinstance(res, Refusal)
            text = res.explanation
            if len(entry.model.profiles) > 1:
                text = f"profile {profile.name}: {text}"
            refusals.append(text)
        return "\n".join(refusals) if refusals else f"cannot place {entry.name}: it has no profiles"

    def _free_port(self, node_id: str, taken: Iterable[int] = ()) -> int:
        used = set(taken)
        for r in self.replicas.values():
            for s in r.shards:
                if s.node_id == node_id and not s.gone:
                    used.update(p for p in (s.spec.http_port, s.spec.leader_port) if p)
        node = self.agents.get(node_id)
        for rs in node.registered_shards if node else ():
            if rs.spec is not None:
                used.update(p for p in (rs.spec.http_port, rs.spec.leader_port) if p)
        span = self.port_hi - self.port_lo + 1
        # Random rather than lowest-free: a port a foreign process holds would
        # otherwise fail every retry the same way.
        for _ in range(64):
            port = self.port_lo + self.rng.randrange(span)
            if port not in used:
                return port
        for port in range(self.port_lo, self.port_hi + 1):
            if port not in used:
                return port
        raise ControlError(
            f"node {node_id} has no free port left in control.engine_ports ({self.port_lo}-{self.port_hi})"
        )

    async def _start(self, p: _StartPlan) -> None:
        entry, profile = p.entry, p.profile
        now = self.clock()
        rid = f"{_slug(entry.name)}-{secrets.token_hex(3)}"
        while rid in self.replicas:
            rid = f"{_slug(entry.name)}-{secrets.token_hex(3)}"
        placed = p.placement.nodes
        nnodes = len(placed)
        leader_id = placed[0][0]
        leader = self.agents.get(leader_id)
        try:
            port = self._free_port(leader_id)
            leader_port = self._free_port(leader_id, (port,)) if nnodes > 1 else None
        except ControlError as exc:
            self.problems[entry.name] = str(exc)
            return
        pl = p.placement
        # As StartShard carries it: the declared fabric, or "nvl:<domain>" inside an NVLink domain.
        fabric = f"nvl:{pl.nvlink_domain}" if pl.nvlink_domain else pl.fabric
        pool = _pool(profile, fabric)
        r = Replica(
            id=rid,
            model=entry.name,
            profile=profile.name,
            profile_fp=profile.fingerprint,
            engine=profile.engine,
            pool=pool,
            memory_gb=profile.min_memory_gb or 0.0,
            http_port=port,
            nnodes=nnodes,
            created=now,
            created_wall=time.time(),
            replaces=p.replaces,
            api_key=new_token(ENGINE_KEY_PREFIX),
        )
        eprofile = EngineProfile(
            name=profile.name,
            tensor_parallel=profile.tp if profile.gpu_class else None,
            args=list(profile.args) or None,
            env=dict(profile.env) or None,
        )
        for rank, (nid, gpus) in enumerate(placed):
            spec = StartShard(
                shard_id=f"{rid}-{rank}",
                replica_id=rid,
                model=entry.name,
                engine=profile.engine,
                engine_version=self.engine_versions.get(profile.engine),
                source=entry.model.source,
                gpus=list(gpus) or None,
                http_port=port if rank == 0 else None,
                rank=rank if nnodes > 1 else None,
                nnodes=nnodes if nnodes > 1 else None,
                leader_addr=(leader.mgmt_addr if leader else None) if nnodes > 1 else None,
                leader_port=leader_port,
                profile=eprofile,
                pool=pool,
                profile_fp=profile.fingerprint,
                # NCCL is given the chosen fabric's adapters on this node and no others.
                hcas=list(pl.adapters.get(nid, ())) or None,
                fabric=fabric,
                api_key=r.api_key,
            )  # every shard the same: one replica, one key
            r.shards.append(
                Shard(node_id=nid, shard_id=spec.shard_id, rank=rank, gpus=tuple(gpus), spec=spec, dispatched_at=now)
            )
            self._shard_index[spec.shard_id] = rid
        self.replicas[rid] = r
        if p.replaces:
            old = self.replicas.get(p.replaces)
            if old is not None:
                old.replaced_by = rid
        where = ", ".join(f"{nid}" + (f" GPU {','.join(map(str, g))}" if g else "") for nid, g in placed)
        log.info(
            "starting replica %s of %s (profile %s) on %s%s",
            rid,
            entry.name,
            profile.name,
            where,
            f", to replace {p.replaces}" if p.replaces else "",
        )
        # The leader first: workers rendezvous with it.
        for s in r.shards:
            if r.failed_reason is not None or r.stopping:
                return
            try:
                ack = await self.agents.request(s.node_id, s.spec, timeout=_REQUEST_TIMEOUT_S)
            except AgentServiceError as exc:
                s.gone = not self.agents.is_connected(s.node_id)
                self._fail(r, f"could not start shard {s.shard_id} on node {s.node_id}: {exc}", count=True)
                return
            if not getattr(ack, "ok", False):
                s.gone = True
                self._fail(r, f"node {s.node_id} refused shard {s.shard_id}: {getattr(ack, 'error', None)}", count=True)
                return

    # -- views for the admin API, ctl and metrics ---------------------------------------------

    def replica_rows(self, model: str | None = None) -> list[dict]:
        """Every replica, then the last failed one of each model that has not served since."""
        now = self.clock()
        entries = {e.name: e for e in self.catalog.models()}
        rows = [
            self._row(r, now, entries.get(r.model))
            for r in sorted(self.replicas.values(), key=lambda r: (r.model, r.created, r.id))
            if model is None or r.model == model
        ]
        rows += [
            row
            for m, row in sorted(self._failed_rows.items())
            if (model is None or m == model) and row["id"] not in self.replicas
        ]
        return rows

    def _row(self, r: Replica, now: float, entry: CatalogEntry | None) -> dict:
        current = entry.fingerprints.get(r.profile) if entry else None
        stale = bool(r.profile_fp) and current is not None and current != r.profile_fp
        last = self._last_request.get(r.model)
        return {
            "id": r.id,
            "model": r.model,
            "profile": r.profile,
            "state": r.state,
            "pool": r.pool,
            "stale": stale,
            "adopted": r.adopted,
            "age_s": round(now - r.created, 1),
            "idle_s": round(now - last, 1) if last is not None else None,
            "endpoint": r.endpoint.url if r.endpoint else None,
            "reason": r.failed_reason or (r.stop_reason if r.stopping else None),
            "replaces": r.replaces,
            "replaced_by": r.replaced_by,
            "shards": [
                {
                    "node": s.node_id,
                    "shard_id": s.shard_id,
                    "rank": s.rank,
                    "gpus": list(s.gpus),
                    "state": s.state,
                    "pid": s.pid,
                    "fetch": None
                    if s.fetch is None
                    else {
                        "source": s.fetch.source,
                        "bytes_done": s.fetch.bytes_done,
                        "bytes_total": s.fetch.bytes_total,
                        "percent": None if s.fetch.percent is None else round(s.fetch.percent, 1),
                    },
                }
                for s in r.shards
            ],
        }

    def model_status(self, name: str) -> dict:
        entry = self.catalog.get(name)
        now = self.clock()
        rs = [r for r in self.replicas.values() if r.model == name]
        b = self._backoff.get(name)
        return {
            "target": self.target(entry, now) if entry is not None and entry.model.managed else None,
            # orjson takes only plain str keys.
            "replicas": {s.value: n for s in ReplicaState if (n := sum(1 for r in rs if r.state is s))},
            "problem": self.problems.get(name),
            "backoff": None
            if b is None or now >= b.next_at
            else {"failures": b.failures, "retry_in_s": round(b.next_at - now, 1), "last_failure": b.last_reason},
        }

    def node_state(self, node: Node) -> NodeState | NodeMark:
        mark = self.marks.get(node.node_id)
        if node.state is not NodeState.READY or mark is None:
            return node.state
        return mark


def _pool(profile: ProfileConfig, fabric: str | None) -> str:
    return f"{fabric or 'none'}/{profile.gpu_class or 'cpu'}"
