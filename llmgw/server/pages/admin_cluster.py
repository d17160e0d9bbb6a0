"""The administrator's Cluster page (/admin), a page per node (/admin/nodes/{node}) and its logs.

What these pages show comes from the admin API's own methods (the rows `llmgw ctl
nodes`, `replicas`, `models`, `logs` and `/api/v1/endpoints` print), read through
:class:`AdminReads`, so the page and the CLI never disagree; the agents' records add
what the rows leave out (CPU load, the inventory's GPUs and ports, engine memory).

The pages are plain HTML: the cluster and node pages refresh in place with htmx
every five seconds (a fragment is answered to a request carrying ``HX-Request``),
paused while the tab is hidden (``static/admin.js``: htmx's ``[...]`` trigger
filters need ``eval``, which the pages' Content-Security-Policy forbids); without
script a ``<meta http-equiv="refresh">`` inside ``<noscript>`` reloads them.

On a gateway without a control plane the cluster page says so and shows the
endpoints, the people and the usage.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlencode

import orjson
from aiohttp import web
from pydantic import BaseModel, ValidationError

from llmgw.protocol import ProvisionState
from llmgw.protocol.admin import (
    CatalogModel,
    EndpointRow,
    EndpointsReply,
    ModelsReply,
    NodeLogs,
    NodeRow,
    NodesReply,
    ReplicaRow,
    ReplicasReply,
    ShardFetch,
)
from llmgw.server.admin.api import AdminAPI, AdminRefused, NotControlPlane
from llmgw.server.control.agents import Node
from llmgw.server.pages.admin_fabrics import FabricPages
from llmgw.server.pages.admin_format import FMT, ago, clock, duration, node_href, size
from llmgw.server.pages.admin_people import PeoplePage
from llmgw.server.pages.charts import DEFAULT_WINDOW, WINDOWS, cluster_panels, node_panels, window_of
from llmgw.server.pages.site import Site
from llmgw.store import Store, Tree

if TYPE_CHECKING:
    from llmgw.server.app import Server

REFRESH_S = 5  # htmx refreshes the cluster page, a node page and followed logs this often
NOSCRIPT_REFRESH_S = 15  # without script, a meta refresh reloads the cluster and node pages
LOG_LINES = (200, 1000, 2000)  # the agent keeps 2000 lines of its own log
USAGE_ROWS = 25


# -- reading the admin API's rows --------------------------------------------------------------

Shape = TypeVar("Shape", bound=BaseModel)


@dataclass(frozen=True)
class Refusal:
    """The admin API answered with an error: its status and sentence."""

    status: int
    message: str


def answer(resp: web.Response, shape: type[Shape]) -> Shape | Refusal:
    """An admin API handler's reply read as ``shape``, or its refusal (status and sentence); the Mirror
    page reads the API's answers to its forms with this too."""
    text = resp.text or ""
    if resp.status >= 300:
        try:
            message = str(orjson.loads(text)["error"]["message"])
        except (orjson.JSONDecodeError, KeyError, TypeError):
            message = text or f"the admin API answered {resp.status}"
        return Refusal(resp.status, message)
    try:
        return shape.model_validate_json(text)
    except ValidationError as exc:  # the admin API's own reply: a bug here, said in words
        return Refusal(500, f"the admin API's reply could not be read: {exc.errors()[0]['msg']}")


def fragment(request: web.Request) -> bool:
    """htmx asks for the part of the page it swaps (the refreshing region), not the whole page."""
    return request.headers.get("HX-Request") == "true"


class AdminReads:
    """The admin API's public methods, called in process: the same rows `llmgw ctl` reads. Each read
    takes the page's request so the pages call them alike; only ``logs`` reads it."""

    def __init__(self, server: Server) -> None:
        self.api = AdminAPI(server)

    @staticmethod
    async def _read(call: Awaitable[Shape]) -> Shape | Refusal | None:
        """None on a gateway that is not a control plane."""
        try:
            return await call
        except NotControlPlane:
            return None
        except AdminRefused as exc:
            return Refusal(exc.status, exc.message)

    async def nodes(self, request: web.Request) -> list[NodeRow] | None:
        got = await self._read(self.api.nodes())
        return got.nodes if isinstance(got, NodesReply) else None

    async def replicas(self, request: web.Request) -> list[ReplicaRow] | None:
        got = await self._read(self.api.replicas())
        return got.replicas if isinstance(got, ReplicasReply) else None

    async def models(self, request: web.Request) -> ModelsReply | None:
        got = await self._read(self.api.models())
        return got if isinstance(got, ModelsReply) else None

    async def endpoints(self, request: web.Request) -> list[EndpointRow]:
        got = await self._read(self.api.endpoints())
        return got.endpoints if isinstance(got, EndpointsReply) else []

    async def logs(self, request: web.Request) -> NodeLogs | Refusal | None:
        """The node's log named by the page's ?source= and ?lines=, exactly as /api/v1/nodes/{node}/logs answers."""
        return await self._read(self.api.node_logs(*self.api.logs_asked(request)))


# -- what the pages show -----------------------------------------------------------------------


@dataclass
class EngineLine:
    engine: str
    version: str  # installed, or the one being installed
    state: str  # ready, installing, failed, unsupported, skipped
    detail: str = ""  # the agent's words, download progress, the next try of a failed install
    percent: float | None = None


def engine_lines(row: NodeRow, now: float) -> list[EngineLine]:
    """Installed engines with their versions, then every other install with what is happening to it."""
    installed = row.engines or {}
    out = [EngineLine(e, v, "ready") for e, v in sorted(installed.items())]
    for engine, st in sorted((row.provision or {}).items()):
        if st.state == ProvisionState.READY and engine in installed:
            continue  # otherwise another version is on its way (or failing): said beside the one that runs
        detail = st.detail or ""
        pct = st.progress.percent if st.progress is not None else None
        if st.progress is not None and st.progress.bytes_total:
            detail += f" ({size(st.progress.bytes_done)} of {size(st.progress.bytes_total)})"
        if st.state == ProvisionState.FAILED and st.retry_at is not None:
            if st.retry_at > now:
                detail += f"; next try in {duration(st.retry_at - now)} ({clock(st.retry_at)})"
            else:
                detail += f"; next try was due at {clock(st.retry_at)}"
        variant = f" ({st.variant})" if st.variant else ""
        out.append(EngineLine(engine, (st.version or "") + variant, st.state.value, detail.strip(), pct))
    return out


def node_warnings(row: NodeRow, node: Node | None) -> list[str]:
    """The row's warnings (GPU problems, a stuck drain), the inventory's, and a CPU without AVX2."""
    out = list(row.warnings or ())
    inv = node.inventory if node is not None else None
    out += [w for w in (inv.warnings or ()) if w not in out] if inv is not None else []
    host = inv.host if inv is not None else None
    if host is not None and host.cpu_flags is not None and host.arch == "amd64" and "avx2" not in host.cpu_flags:
        out.append("the CPU reports no AVX2: llama.cpp on the CPU runs several times slower")
    if row.connected is False:
        out.append(f"the agent is not connected (last seen {ago(row.last_seen)})")
    return out


@dataclass
class NodeLine:
    row: NodeRow
    cpu_percent: float | None
    cpus: int | None
    memory_used: int | None
    memory_total: int | None
    engines: list[EngineLine]
    warnings: list[str]

    @property
    def memory_percent(self) -> float | None:
        if self.memory_used is None or not self.memory_total:
            return None
        return 100.0 * self.memory_used / self.memory_total


def node_line(row: NodeRow, node: Node | None, now: float) -> NodeLine:
    load = node.load if node is not None else None
    host = node.inventory.host if node is not None and node.inventory is not None else None
    cpus = (load.cpu_count if load is not None else None) or (host.cpus if host is not None else None)
    mem = row.memory
    return NodeLine(
        row=row,
        cpu_percent=load.cpu_percent if load is not None else None,
        cpus=cpus,
        memory_used=mem.used_bytes if mem is not None else None,
        memory_total=mem.total_bytes if mem is not None else None,
        engines=engine_lines(row, now),
        warnings=node_warnings(row, node),
    )


@dataclass
class Capacity:
    nodes: int = 0
    ready: int = 0
    gpus_total: int = 0
    gpus_free: int = 0
    memory_total: int = 0
    memory_available: int = 0
    disk_free: int = 0
    disk_known: bool = False
    cpus: int = 0
    cpu_busy: float | None = None  # the fleet's average, weighted by CPUs

    @property
    def gpu_less(self) -> bool:
        return self.nodes > 0 and self.gpus_total == 0


def capacity(lines: list[NodeLine]) -> Capacity:
    c = Capacity(nodes=len(lines))
    busy = weight = 0.0
    for n in lines:
        r = n.row
        c.ready += r.state == "ready"
        c.gpus_total += r.gpus_total or 0
        c.gpus_free += r.gpus_free or 0
        if r.memory is not None:
            c.memory_total += r.memory.total_bytes or 0
            c.memory_available += r.memory.available_bytes or 0
        if r.disk_free_bytes is not None:
            c.disk_free += r.disk_free_bytes
            c.disk_known = True
        c.cpus += n.cpus or 0
        if n.cpu_percent is not None and n.cpus:
            busy += n.cpu_percent * n.cpus
            weight += n.cpus
    c.cpu_busy = busy / weight if weight else None
    return c


@dataclass
class FetchLine:
    node: str | None
    source: str
    done: int
    total: int | None
    percent: float | None


def fetch_line(node: str | None, f: ShardFetch) -> FetchLine:
    done, total, pct = f.bytes_done or 0, f.bytes_total, f.percent
    if pct is None and total:
        pct = min(100.0, 100.0 * done / total)
    return FetchLine(node, f.source or "weights", done, total, pct)


@dataclass
class ReplicaLine:
    row: ReplicaRow
    nodes: list[str]
    fetches: list[FetchLine]


def replica_line(r: ReplicaRow) -> ReplicaLine:
    shards = r.shards or []
    return ReplicaLine(
        row=r,
        nodes=list(dict.fromkeys(s.node for s in shards if s.node)),
        fetches=[fetch_line(s.node, s.fetch) for s in shards if s.fetch is not None],
    )


@dataclass
class ModelLine:
    model: CatalogModel
    description: str
    replicas: list[ReplicaLine] = field(default_factory=list)

    @property
    def ready(self) -> str:
        st = self.model.status
        if st is None or st.target is None:
            return ""
        return f"{(st.replicas or {}).get('ready', 0)} of {st.target} ready"


def model_lines(models: ModelsReply | None, replicas: list[ReplicaRow]) -> list[ModelLine]:
    out: dict[str, ModelLine] = {}
    for m in models.models if models is not None else ():
        extra = m.model_extra or {}
        out[m.name] = ModelLine(m, str(extra.get("description") or ""))
    for r in replicas:
        if r.model not in out:  # a replica of a model the catalog no longer holds, still stopping
            out[r.model] = ModelLine(CatalogModel(name=r.model), "no longer in the catalog")
        out[r.model].replicas.append(replica_line(r))
    return list(out.values())


@dataclass
class UsageLine:
    who: str  # a project's path or "personal"; a person's email or what spent without one
    requests: int
    tokens: int
    cost_micros: int


@dataclass
class Usage:
    by_project: list[UsageLine]
    by_person: list[UsageLine]


def _project_label(tree: Tree, project_id: str | None) -> str:
    if project_id is None:
        return "personal"
    p = tree.projects.get(project_id)
    return p.path if p is not None else f"{project_id} (removed)"


def _person_label(tree: Tree, user_id: str | None) -> str:
    if user_id is None:
        return "no person (a project's key)"
    u = tree.users.get(user_id)
    return u.email if u is not None else f"{user_id} (removed)"


async def usage_last_day(store: Store, tree: Tree, now: datetime | None = None) -> Usage:
    """Requests, tokens and spend of the last 24 hours by project and by person, most requests first:
    the store's usage query (one bucket a day wide)."""
    until = (now or datetime.now(UTC)) + timedelta(seconds=1)
    since = until - timedelta(days=1)
    out = []
    for group, label in (("project", _project_label), ("person", _person_label)):
        rows = await store.usage_buckets(group, since, until, 86400.0)
        lines: dict[str, UsageLine] = {}
        for b in rows:
            line = lines.setdefault(b.group_id or "", UsageLine(label(tree, b.group_id), 0, 0, 0))
            line.requests += b.requests
            line.tokens += b.tokens
            line.cost_micros += b.cost_micros
        out.append(sorted(lines.values(), key=lambda u: (-u.requests, u.who))[:USAGE_ROWS])
    return Usage(*out)


@dataclass
class People:
    active: int = 0
    suspended: int = 0
    pending: int = 0
    admins: int = 0
    waiting: list[Any] = field(default_factory=list)  # the pending sign-ups (User), oldest first


def people(tree: Tree) -> People:
    p = People()
    for u in tree.users.values():
        if u.state == "active":
            p.active += 1
        elif u.state == "suspended":
            p.suspended += 1
        else:
            p.pending += 1
            p.waiting.append(u)
        p.admins += u.admin
    p.waiting.sort(key=lambda u: u.created_at)
    return p


# -- the pages -------------------------------------------------------------------------------


def _with_window(path: str, window: str) -> str:
    return path if window == DEFAULT_WINDOW else path + "?" + urlencode({"window": window})


class AdminPages:
    """The administrator's pages: Cluster and the node pages here, People in admin_people."""

    def __init__(self, site: Site, server: Server) -> None:
        self.site = site
        self.server = server
        self.reads = AdminReads(server)

    def add_routes(self) -> None:
        self.site.menu.add("Cluster", "/admin", "admin")
        self.site.route("GET", "/admin", "admin", self.cluster)
        self.site.route("GET", "/admin/nodes/{node}", "admin", self.node)
        self.site.route("GET", "/admin/nodes/{node}/logs", "admin", self.logs)
        PeoplePage(self.site).add_routes()
        FabricPages(self.site, self.reads.api).add_routes()

    # -- /admin ---------------------------------------------------------------------------

    async def cluster(self, request: web.Request) -> web.StreamResponse:
        now = time.time()
        rows = await self.reads.nodes(request)
        control = rows is not None
        agents = self.server.agents
        lines = [node_line(r, agents.get(r.node_id) if agents else None, now) for r in rows or ()]
        replicas = await self.reads.replicas(request) if control else None
        models = await self.reads.models(request) if control else None
        tree = await self.site.store.tree(people=True)
        window, seconds, words = window_of(request.query.get("window"))
        history = await self.site.history.charts(cluster_panels(), seconds, words) if control else None
        template = "admin_cluster_live.html" if fragment(request) else "admin_cluster.html"
        return self.site.render.page(
            request,
            template,
            fmt=FMT,
            control=control,
            nodes=lines,
            capacity=capacity(lines),
            models=model_lines(models, replicas or []),
            problems=list(models.problems or ()) if models is not None else [],
            endpoints=await self.reads.endpoints(request),
            people=people(tree),
            usage=await usage_last_day(self.site.store, tree),
            history=history,
            window=window,
            windows=WINDOWS,
            cluster_window=lambda w: _with_window("/admin", w),
            refresh_s=REFRESH_S,
            noscript_refresh_s=NOSCRIPT_REFRESH_S,
        )

    # -- /admin/nodes/{node} ------------------------------------------------------------------

    def _no_node(self, request: web.Request, node_id: str) -> web.StreamResponse:
        if self.server.agents is None:
            message = "This gateway is not a control plane (control.enabled is false in server.yaml): it has no nodes."
        else:
            message = f"No node {node_id} has joined this control plane; the Cluster page lists those that have."
        return self.site.refuse(request, 404, message)

    async def _node_row(self, request: web.Request, node_id: str) -> tuple[NodeRow, Node] | None:
        agents = self.server.agents
        node = agents.get(node_id) if agents is not None else None
        if node is None:
            return None
        row = next((r for r in await self.reads.nodes(request) or () if r.node_id == node_id), None)
        return (row, node) if row is not None else None

    async def node(self, request: web.Request) -> web.StreamResponse:
        node_id = request.match_info["node"]
        found = await self._node_row(request, node_id)
        if found is None:
            return self._no_node(request, node_id)
        row, node = found
        now = time.time()
        inv = node.inventory
        usage_by_gpu = {u.index: u for u in node.gpus or ()}
        shard_load = {s.shard_id: s for s in (node.load.shards or () if node.load is not None else ())}
        replicas = {
            r.id: replica_line(r) for r in await self.reads.replicas(request) or () if r.id in (row.replicas or ())
        }
        window, seconds, words = window_of(request.query.get("window"))
        history = await self.site.history.charts(
            node_panels(node_id, {rid: r.row.model for rid, r in replicas.items()}), seconds, words
        )
        template = "admin_node_live.html" if fragment(request) else "admin_node.html"
        return self.site.render.page(
            request,
            template,
            fmt=FMT,
            line=node_line(row, node, now),
            node=node,
            host=inv.host if inv is not None else None,
            gpus=[(g, usage_by_gpu.get(g.index)) for g in (inv.gpus if inv is not None else None) or ()],
            storage=node.storage or (inv.storage if inv is not None else None) or [],
            ports=node.ib_ports
            or [p for a in (inv.adapters if inv is not None else None) or () for p in a.ports or ()],
            shards=sorted(node.shards.values(), key=lambda s: s.shard_id),
            shard_load=shard_load,
            replicas=replicas,
            history=history,
            window=window,
            windows=WINDOWS,
            node_window=lambda w: _with_window(node_href(node_id), w),
            refresh_s=REFRESH_S,
            noscript_refresh_s=NOSCRIPT_REFRESH_S,
        )

    # -- /admin/nodes/{node}/logs -------------------------------------------------------------

    async def logs(self, request: web.Request) -> web.StreamResponse:
        node_id = request.match_info["node"]
        agents = self.server.agents
        node = agents.get(node_id) if agents is not None else None
        if node is None:
            return self._no_node(request, node_id)
        source = request.query.get("source") or "agent"
        lines = request.query.get("lines") or str(LOG_LINES[0])
        follow = request.query.get("follow") == "1"
        got = await self.reads.logs(request)
        status, problem, shown = 200, "", []
        sources = ["agent", *sorted(node.shards)]
        if isinstance(got, NodeLogs):
            shown = got.lines or []
            sources = got.sources or sources
            source = got.source or source
        elif isinstance(got, Refusal):
            status, problem = got.status, got.message

        def link(**change: str) -> str:
            q = {"source": source, "lines": lines, **({"follow": "1"} if follow else {})}
            q.update(change)
            return node_href(node_id) + "/logs?" + urlencode({k: v for k, v in q.items() if v})

        if fragment(request):
            # htmx swaps only a 2xx answer: a node that stopped answering is said in the part it swaps.
            return self.site.render.page(
                request,
                "admin_logs_live.html",
                lines=shown,
                problem=problem,
                follow=follow,
                link=link,
                refresh_s=REFRESH_S,
            )
        return self.site.render.page(
            request,
            "admin_logs.html",
            status,
            fmt=FMT,
            node_id=node_id,
            source=source,
            sources=sources,
            lines=shown,
            line_choices=LOG_LINES,
            lines_asked=lines,
            follow=follow,
            problem=problem,
            link=link,
            refresh_s=REFRESH_S,
        )
