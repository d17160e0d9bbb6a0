"""The admin API behind `llmgw ctl status`, `ctl usage` and `ctl weights`.

* ``GET /api/v1/cluster``: nodes by state, models against their targets, what each fabric
  carries, and everything failing, from the same replies ``/api/v1/nodes``, ``/models`` and
  ``/replicas`` give (answered on a plain gateway too, saying it is not a control plane).
* ``GET /api/v1/usage``: requests, tokens and spend per organization, team, project or person
  since a time, read with the Usage page's query (``Store.usage_buckets``, one bucket), with
  the budget the level itself sets.
* ``GET /api/v1/weights`` and ``POST /api/v1/weights/collect``: the files in the nodes' weights
  caches and the models needing each; collecting sends ``RemoveWeights`` for those none needs,
  and each agent re-checks every path is one it fetched.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

from aiohttp import web

from llmgw import __version__
from llmgw.config.server import source_kind
from llmgw.protocol import Ack, ProvisionState, RemoveWeights
from llmgw.protocol.admin import (
    ClusterFabric,
    ClusterModel,
    ClusterStatus,
    ClusterTrouble,
    ModelsReply,
    NodeRow,
    NodeWeights,
    ReplicaRow,
    UsageGroup,
    UsageReply,
    WeightsAsked,
    WeightsCollectReply,
    WeightsFile,
    WeightsReply,
)
from llmgw.protocol.weights_names import cache_name_of, is_cache_name
from llmgw.server.admin.api import AdminRefused, NotControlPlane
from llmgw.server.control.agents import AgentServiceError, NodeState
from llmgw.server.control.reconciler import ReplicaState
from llmgw.server.gateway.limits import Pricing
from llmgw.server.pages.admin_usage import GROUPS, group_label

if TYPE_CHECKING:
    from llmgw.server.admin.api import AdminAPI

# Replicas whose shards hold their nodes (a failed or stopping one is on its way off).
_LIVE = {ReplicaState.STARTING.value, ReplicaState.LOADING.value, ReplicaState.READY.value}
# How long a node gets to answer a RemoveWeights (it deletes files, then acks).
REMOVE_TIMEOUT_S = 15.0
# The limit scope of each grouping word (a person's limits are the user's).
_SCOPE = {"org": "org", "team": "team", "project": "project", "person": "user"}
DEFAULT_WINDOW = timedelta(days=30)  # usage without ?since=


def _name_of(path: str) -> str:
    """The cache entry a reported path is: its last component (a set is a directory)."""
    return path.rstrip("/").rsplit("/", 1)[-1]


def _fetched_names(sources: Iterable[tuple[str, str]]) -> dict[str, list[str]]:
    """Cache name -> who needs it, for every (source, user) whose source a node fetches (a URL or
    hf:); a local path or a model id is never in a cache, so it needs nothing there."""
    out: dict[str, list[str]] = {}
    for source, user in sources:
        if source and source_kind(source) in ("url", "set", "hf"):
            users = out.setdefault(cache_name_of(source), [])
            if user not in users:
                users.append(user)
    return out


def parse_since(text: str, now: datetime) -> datetime:
    """?since= as an ISO 8601 time (UTC when it names no zone), before ``now``."""
    try:
        since = datetime.fromisoformat(text)
    except ValueError:
        raise AdminRefused(
            400,
            f"since={text!r} is not an ISO 8601 time; write it like 2025-03-01 or 2025-03-01T12:00:00Z",
            "bad_since",
        ) from None
    if since.tzinfo is None:
        since = since.replace(tzinfo=UTC)
    if since >= now:
        raise AdminRefused(400, f"since={text} is not in the past (it is now {now:%Y-%m-%d %H:%M:%S} UTC)", "bad_since")
    return since


class OpsAPI:
    """Routes on the admin API, answering from the running server's parts through ``AdminAPI``."""

    def __init__(self, api: AdminAPI) -> None:
        self.api = api
        self.s = api.s

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/api/v1/cluster", self._api_cluster)
        app.router.add_get("/api/v1/usage", self._api_usage)
        app.router.add_get("/api/v1/weights", self._api_weights)
        app.router.add_post("/api/v1/weights/collect", self._api_weights_collect)

    # -- status

    async def _api_cluster(self, request: web.Request) -> web.Response:
        return await self.api._reply(self.cluster())

    async def cluster(self) -> ClusterStatus:
        s = self.s
        now = time.monotonic()
        eps = s.endpoints.endpoints
        available: dict[str, int] = {}
        declared: dict[str, int] = {}
        for ep in eps:
            declared[ep.model] = declared.get(ep.model, 0) + 1
            if ep.available(now):
                available[ep.model] = available.get(ep.model, 0) + 1
        out = ClusterStatus(
            version=__version__,
            control_plane=s.reconciler is not None and s.agents is not None and s.catalog is not None,
            standby=s.standby_reason(),
            endpoints=len(eps),
            endpoints_available=sum(available.values()),
        )
        if not out.control_plane:
            # A plain gateway: its models are server.yaml's, each with the endpoints it routes to.
            out.models = [
                ClusterModel(
                    name=m.name,
                    managed=False,
                    ready=available.get(m.name, 0),
                    endpoints=declared.get(m.name, 0),
                )
                for m in s.config.models
            ]
            return out
        nodes = (await self.api.nodes()).nodes
        catalog = await self.api.models()
        replicas = (await self.api.replicas()).replicas
        # Assigned whole, not appended to: the reply leaves out what was never set.
        counts_by_state: dict[str, int] = {}
        for n in nodes:
            counts_by_state[n.state] = counts_by_state.get(n.state, 0) + 1
        out.nodes = counts_by_state
        models: list[ClusterModel] = []
        for m in catalog.models:
            st = m.status
            if m.managed and st is not None:
                counts = st.replicas or {}
                models.append(
                    ClusterModel(
                        name=m.name,
                        managed=True,
                        target=st.target,
                        ready=counts.get(ReplicaState.READY.value, 0),
                        replicas=counts,
                        scaling=m.scaling.state if m.scaling else None,
                    )
                )
            else:
                models.append(
                    ClusterModel(
                        name=m.name, managed=False, ready=available.get(m.name, 0), endpoints=declared.get(m.name, 0)
                    )
                )
        out.models = models
        out.fabrics = self._fabrics(nodes, replicas)
        out.failing = self._failing(nodes, catalog, replicas)
        return out

    @staticmethod
    def _fabrics(nodes: list[NodeRow], replicas: list[ReplicaRow]) -> list[ClusterFabric]:
        members: dict[str, set[str]] = {}
        for n in nodes:
            for f in n.fabrics or ():
                members.setdefault(f, set()).add(n.node_id)
        out = []
        for fabric in sorted(members):
            on = members[fabric]
            models: set[str] = set()
            used: set[str] = set()
            for r in replicas:
                if r.state not in _LIVE:
                    continue
                here = {sh.node for sh in r.shards or () if sh.node in on}
                if here:
                    models.add(r.model)
                    used |= here
            out.append(ClusterFabric(fabric=fabric, models=sorted(models), nodes_used=len(used), nodes_total=len(on)))
        return out

    @staticmethod
    def _failing(nodes: list[NodeRow], catalog: ModelsReply, replicas: list[ReplicaRow]) -> list[ClusterTrouble]:
        out = [
            ClusterTrouble(kind="replica", subject=r.id, message=r.reason or f"{r.model} failed")
            for r in replicas
            if r.state == ReplicaState.FAILED.value
        ]
        for n in nodes:
            if n.state in (NodeState.UNREACHABLE.value, NodeState.LOST.value):
                seen = f"; last seen {n.last_seen_ago_s:.0f}s ago" if n.last_seen_ago_s is not None else ""
                out.append(ClusterTrouble(kind="node", subject=n.node_id, message=f"{n.state}{seen}"))
            out.extend(ClusterTrouble(kind="node", subject=n.node_id, message=w) for w in n.warnings or ())
            for engine, ps in (n.provision or {}).items():
                if ps.state == ProvisionState.FAILED:
                    words = f"{engine} {ps.version or ''}".strip() + " failed to install"
                    out.append(
                        ClusterTrouble(
                            kind="engine", subject=n.node_id, message=words + (f": {ps.detail}" if ps.detail else "")
                        )
                    )
        for m in catalog.models:
            st = m.status
            if st is None:
                continue
            if st.backoff is not None:
                b = st.backoff
                out.append(
                    ClusterTrouble(
                        kind="model",
                        subject=m.name,
                        message=f"{b.failures} failed start(s) in a row, next attempt in {b.retry_in_s:.0f}s"
                        + (f"; last: {b.last_failure}" if b.last_failure else ""),
                    )
                )
            if st.problem:
                out.append(ClusterTrouble(kind="model", subject=m.name, message=st.problem))
        out.extend(ClusterTrouble(kind="catalog", message=problem) for problem in catalog.problems or ())
        return out

    # -- usage

    async def _api_usage(self, request: web.Request) -> web.Response:
        q = request.query
        return await self.api._reply(self.usage(q.get("by", ""), q.get("since") or None))

    async def usage(self, by: str, since_text: str | None) -> UsageReply:
        """Usage summed per group of the level ``by`` from ``since_text`` (default: DEFAULT_WINDOW ago)."""
        if by not in GROUPS:
            raise AdminRefused(400, f"by={by!r}: group usage by one of {', '.join(GROUPS)}", "bad_grouping")
        store = self.s.store
        assert store is not None  # opened before any listener
        now = datetime.now(UTC)
        since = parse_since(since_text, now) if since_text else now - DEFAULT_WINDOW
        tree = await store.tree(people=True, with_limits=True)
        # One bucket as wide as the window: the Usage page's query, summed.
        buckets = await store.usage_buckets(by, since, now, (now - since).total_seconds())
        groups: dict[str | None, UsageGroup] = {}
        for b in buckets:
            g = groups.get(b.group_id)
            if g is None:
                label, _ = group_label(tree, by, b.group_id)
                g = groups[b.group_id] = UsageGroup(
                    id=b.group_id, label=label, requests=0, tokens_in=0, tokens_out=0, spend_micros=0
                )
                limit = tree.limits.get((_SCOPE[by], b.group_id)) if b.group_id is not None else None
                if limit is not None and limit.budget_micros is not None:
                    g.budget_micros = limit.budget_micros
                    g.budget_period = limit.period
            g.requests += b.requests
            g.tokens_in += b.prompt_tokens
            g.tokens_out += b.completion_tokens
            g.spend_micros += b.cost_micros
        return UsageReply(
            by=by,
            since=since.isoformat(),
            until=now.isoformat(),
            priced=Pricing.from_config(self.s.config.auth).anything_priced(),
            groups=sorted(groups.values(), key=lambda g: (-g.requests, g.label)),
        )

    # -- weights

    def _needed(self) -> dict[str, list[str]]:
        """Cache name -> the catalog models (and replicas still running) whose weights it holds."""
        if self.s.catalog is None or self.s.reconciler is None:
            raise NotControlPlane()
        wanted = [(e.model.source or "", e.name) for e in self.s.catalog.models()]
        # A replica outliving its catalog entry (stopping, or of a source since changed) still reads its file.
        wanted.extend(
            (sh.spec.source or "", f"replica {r.id}")
            for r in self.s.reconciler.replicas.values()
            for sh in r.shards
            if not sh.gone
        )
        return _fetched_names(wanted)

    async def _api_weights(self, request: web.Request) -> web.Response:
        return await self.api._reply(self.weights())

    async def weights(self) -> WeightsReply:
        needed = self._needed()
        agents = self.s.agents
        assert agents is not None
        out = []
        for n in agents.nodes():
            files = [
                WeightsFile(
                    path=w.path, size_bytes=w.size_bytes, shared=w.shared, used_by=needed.get(_name_of(w.path), [])
                )
                for w in n.weights or ()
                # Only names the cache gives are llmgw's: anything else an agent lists is left alone.
                if is_cache_name(_name_of(w.path))
            ]
            out.append(NodeWeights(node=n.node_id, connected=n.connected, files=files))
        return WeightsReply(nodes=out)

    async def _api_weights_collect(self, request: web.Request) -> web.Response:
        return await self.api._reply(self.collect())

    async def collect(self) -> WeightsCollectReply:
        """Ask every node holding files no model needs to remove them; each agent decides."""
        agents = self.s.agents
        listing = await self.weights()  # worked out again now: a model may have been added since
        asked: list[WeightsAsked] = []
        seen_shared: set[str] = set()
        for n in listing.nodes:
            paths, size = [], 0
            for f in n.files:
                if f.used_by:
                    continue
                if f.shared:
                    # One node removes a file every node sees; the others would find it gone.
                    if f.path in seen_shared:
                        continue
                    seen_shared.add(f.path)
                paths.append(f.path)
                size += f.size_bytes or 0
            if paths:
                asked.append(WeightsAsked(node=n.node, paths=paths, size_bytes=size))

        async def ask(a: WeightsAsked) -> None:
            assert agents is not None
            try:
                reply = await agents.request(a.node, RemoveWeights(paths=a.paths), timeout=REMOVE_TIMEOUT_S)
            except AgentServiceError as exc:
                a.sent, a.error = False, str(exc)
                return
            a.sent = True
            if isinstance(reply, Ack) and not reply.ok:
                a.error = reply.error or "the agent refused without saying why"

        await asyncio.gather(*(ask(a) for a in asked))
        return WeightsCollectReply(nodes=asked)
