"""The admin API (/api/v1 on admin_listen): what llmgw ctl reads and changes.

It works on the running server's parts; it answers 404 for control-plane
routes when the server is not a control plane.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import quote, urlsplit

import orjson
from aiohttp import web
from pydantic import BaseModel, ValidationError

from llmgw import __version__
from llmgw.errors import LlmgwError
from llmgw.protocol import LogsReply, LogsRequest
from llmgw.protocol.admin import (
    CatalogModel,
    EndpointRow,
    EndpointsReply,
    FabricsReply,
    FabricTestRun,
    FabricTestView,
    MirrorServeRequest,
    ModelAddRequest,
    ModelReply,
    ModelsReply,
    ModelStatus,
    NodeAction,
    NodeLogs,
    NodeRow,
    NodesReply,
    NodeVerdict,
    PlacementReply,
    ProfilePlacement,
    Removed,
    ReplicaRow,
    ReplicasReply,
    ScaleRequest,
    StatusReply,
    UsageCounts,
)
from llmgw.protocol.mirror_api import MirrorFetchRequest, MirrorListing, MirrorVersion
from llmgw.server.control.agents import AgentServiceError
from llmgw.server.control.catalog import Catalog, CatalogEntry, CatalogError
from llmgw.server.control.fabrics import FabricService, FabricTestRefused, UnknownFabric
from llmgw.server.control.mirror_client import MirrorClient, MirrorRefused, MirrorUnavailable, entry_from_version
from llmgw.server.control.placement import explain, gpu_class_of, node_view
from llmgw.server.control.reconciler import ControlError, Reconciler
from llmgw.server.gateway.errors import error_response

if TYPE_CHECKING:
    from llmgw.server.app import Server


class NotControlPlane(LlmgwError):
    """An admin request that only a control plane can answer."""


class NoMirror(LlmgwError):
    """A mirror request on a control plane with no mirror: configured."""


class AdminRefused(LlmgwError):
    """An admin request refused: the status, sentence and code its route answers with."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code

    def response(self) -> web.Response:
        return error_response(self.status, self.message, self.code)


def dumps(obj: object) -> str:
    return orjson.dumps(obj).decode()


def json_reply(body: BaseModel, status: int = 200) -> web.Response:
    """A reply body as protocol.admin defines it: a field the handler did not set is absent."""
    return web.json_response(body.model_dump(mode="json", exclude_unset=True), status=status, dumps=dumps)


def catalog_model(entry: CatalogEntry) -> CatalogModel:
    return CatalogModel.model_validate(entry.to_dict())


def _first_error(exc: ValidationError) -> str:
    e = exc.errors()[0]
    return f"{'.'.join(map(str, e['loc'])) or 'the body'}: {e['msg']}"


Shape = TypeVar("Shape", bound=BaseModel)


class AdminAPI:
    def __init__(self, server: Server) -> None:
        self.s = server

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/api/v1/endpoints", self._api_endpoints)
        app.router.add_get("/api/v1/status", self._api_status)
        app.router.add_get("/api/v1/nodes", self._api_nodes)
        app.router.add_delete("/api/v1/nodes/{node}", self._api_node_remove)
        app.router.add_get("/api/v1/nodes/{node}/logs", self._api_node_logs)
        app.router.add_post("/api/v1/nodes/{node}/cordon", self._api_node_cordon)
        app.router.add_post("/api/v1/nodes/{node}/uncordon", self._api_node_uncordon)
        app.router.add_post("/api/v1/nodes/{node}/drain", self._api_node_drain)
        app.router.add_get("/api/v1/replicas", self._api_replicas)
        app.router.add_get("/api/v1/mirror", self._api_mirror_list)
        app.router.add_post("/api/v1/mirror/fetch", self._api_mirror_fetch)
        app.router.add_get("/api/v1/mirror/{model}/{version}", self._api_mirror_status)
        app.router.add_delete("/api/v1/mirror/{model}/{version}", self._api_mirror_remove)
        app.router.add_post("/api/v1/mirror/{model}/{version}/serve", self._api_mirror_serve)
        app.router.add_get("/api/v1/models", self._api_models)
        app.router.add_post("/api/v1/models", self._api_model_add)
        app.router.add_delete("/api/v1/models/{name}", self._api_model_remove)
        app.router.add_put("/api/v1/models/{name}/scale", self._api_model_scale)
        app.router.add_get("/api/v1/models/{name}/placement", self._api_model_placement)
        app.router.add_get("/api/v1/fabrics", self._api_fabrics)
        app.router.add_get("/api/v1/fabrics/{fabric}/topology", self._api_fabric_topology)
        app.router.add_post("/api/v1/fabric-test", self._api_fabric_test)
        app.router.add_get("/api/v1/nvlink", self._api_nvlink)
        from llmgw.server.admin.ops import OpsAPI  # it imports this module, so not at the top

        OpsAPI(self).add_routes(app)  # cluster, usage, weights (ctl status, usage, weights)
        from llmgw.server.admin.plan import PlanAPI  # it imports this module too

        PlanAPI(self).add_routes(app)  # does a model fit (ctl plan)
        from llmgw.server.admin.capacity_api import add_capacity_routes  # it imports this module too

        add_capacity_routes(self, app)  # measured capacity (ctl bench --save, ctl capacity)

    # The public methods answer the reply models (the pages call them in process); each route
    # reads its request, calls one, and answers its model as JSON or its refusal.

    async def _reply(self, call: Awaitable[BaseModel], status: int = 200) -> web.Response:
        try:
            return json_reply(await call, status)
        except AdminRefused as exc:
            return exc.response()

    async def _api_endpoints(self, request: web.Request) -> web.Response:
        return await self._reply(self.endpoints())

    async def endpoints(self) -> EndpointsReply:
        now = time.monotonic()
        stale_after = self.s.endpoints.stale_after
        out = []
        for ep in self.s.endpoints.endpoints:
            stale = ep.metrics_stale(now, stale_after)
            out.append(
                EndpointRow(
                    model=ep.model,
                    url=ep.url,
                    engine=ep.engine,
                    healthy=ep.healthy,
                    health=ep.health_detail,
                    available=ep.available(now),
                    breaker_open=ep.breaker_open,
                    consecutive_failures=ep.failures,
                    inflight=ep.inflight,
                    waiting=None if stale else ep.waiting,
                    running=None if stale else ep.running,
                    kv_cache_usage=None if stale else ep.kv_usage,
                    metrics_stale=stale,
                    capacity=ep.capacity,  # from ctl bench --save (control/capacity.py)
                    weight=ep.weight,
                )
            )
        return EndpointsReply(endpoints=out)

    def _need_reconciler(self) -> Reconciler:
        if self.s.reconciler is None or self.s.agents is None:
            raise NotControlPlane()
        return self.s.reconciler

    async def _api_nodes(self, request: web.Request) -> web.Response:
        return await self._reply(self.nodes())

    async def nodes(self) -> NodesReply:
        rec = self._need_reconciler()
        assert self.s.agents is not None
        now = time.time()
        by_node: dict[str, list[str]] = {}
        claimed_by_node: dict[str, set[int]] = {}
        for r in rec.replicas.values():
            for nid in dict.fromkeys(r.node_ids):
                by_node.setdefault(nid, []).append(r.id)
            for sh in r.shards:
                if not sh.gone:
                    claimed_by_node.setdefault(sh.node_id, set()).update(sh.gpus)
        out = []
        for n in self.s.agents.nodes():
            view = node_view(n)
            gpus = n.inventory.gpus if n.inventory and n.inventory.gpus else []
            claimed = claimed_by_node.get(n.node_id, set())
            storage = n.storage or (n.inventory.storage if n.inventory else None) or []
            disk = next((st for st in storage if not st.shared), None)
            warnings = [f"GPU {g.index}: {'; '.join(g.problems)}" for g in view.gpus if g.problems]
            if n.node_id in rec.node_warnings:
                warnings.append(rec.node_warnings[n.node_id])
            warnings.extend(n.fabric_problems or ())
            out.append(
                NodeRow(
                    node_id=n.node_id,
                    state=rec.node_state(n),
                    connected=n.connected,
                    last_seen=n.last_seen,
                    last_seen_ago_s=round(now - n.last_seen, 1) if n.last_seen else None,
                    heartbeat_pace_s=n.heartbeat_pace,
                    agent_version=n.agent_version,
                    mgmt_addr=n.mgmt_addr,
                    mgmt_interface=n.mgmt_interface,
                    labels=n.labels or {},
                    engines=n.engine_versions or {},
                    provision=dict(n.provision),
                    memory=n.memory,
                    gpus_total=len(gpus),
                    gpus_free=sum(1 for g in view.gpus if g.healthy and g.index not in claimed),
                    classes=sorted({gpu_class_of(g) for g in gpus}),
                    fabrics=sorted(view.fabrics),
                    disk_free_bytes=disk.free_bytes if disk else None,
                    disk_total_bytes=disk.total_bytes if disk else None,
                    replicas=sorted(by_node.get(n.node_id, [])),
                    warnings=warnings,
                    shards=dict(n.shards),
                )
            )
        return NodesReply(nodes=out)

    async def _node_op(self, request: web.Request, op: str) -> web.Response:
        rec = self._need_reconciler()
        node = request.match_info["node"]
        try:
            message = await getattr(rec, op)(node)
        except ControlError as exc:
            return error_response(404, str(exc), "node_not_found")
        n = self.s.agents.get(node) if self.s.agents else None
        return json_reply(NodeAction(node=node, state=rec.node_state(n) if n else None, message=message))

    async def _api_node_cordon(self, request: web.Request) -> web.Response:
        return await self._node_op(request, "cordon")

    async def _api_node_uncordon(self, request: web.Request) -> web.Response:
        return await self._node_op(request, "uncordon")

    async def _api_node_drain(self, request: web.Request) -> web.Response:
        return await self._node_op(request, "drain")

    async def _api_replicas(self, request: web.Request) -> web.Response:
        return await self._reply(self.replicas(request.query.get("model") or None))

    async def replicas(self, model: str | None = None) -> ReplicasReply:
        """Every replica, or one model's (by its name or an alias)."""
        rec = self._need_reconciler()
        if model is not None:
            entry = self._need_catalog().get(model)
            if entry is None:
                raise AdminRefused(
                    404, f"no model {model} in the catalog; llmgw ctl models lists them", "model_not_found"
                )
            model = entry.name
        # The reconciler's rows are dicts; they take the wire's shape here.
        return ReplicasReply(replicas=[ReplicaRow.model_validate(r) for r in rec.replica_rows(model)])

    async def _api_node_remove(self, request: web.Request) -> web.Response:
        rec = self._need_reconciler()  # it knows what is placed on the node
        try:
            rec.remove_node(request.match_info["node"])
        except AgentServiceError as exc:
            return error_response(400, str(exc), "refused")
        return json_reply(Removed(removed=request.match_info["node"]))

    async def _api_node_logs(self, request: web.Request) -> web.Response:
        return await self._reply(self.node_logs(*self.logs_asked(request)))

    @staticmethod
    def logs_asked(request: web.Request) -> tuple[str, str | None, int]:
        """The node, ?source= and ?lines= of a logs request (the route's, or a page's of the same shape).
        Lines that are not a whole number are 0, which node_logs refuses in the same words."""
        q = request.query
        try:
            lines = int(q.get("lines", "200"))
        except ValueError:
            lines = 0
        return request.match_info["node"], q.get("source") or None, lines

    async def node_logs(self, node: str, source: str | None = None, lines: int = 200) -> NodeLogs:
        """A node's own log or a shard's output, fetched through the agent's stream."""
        if self.s.agents is None:
            raise NotControlPlane()
        if not 0 < lines <= 100_000:
            raise AdminRefused(400, "lines should be a whole number from 1 to 100000", "invalid_request")
        try:
            reply = await self.s.agents.request(node, LogsRequest(source=source, lines=lines), timeout=15)
        except AgentServiceError as exc:
            raise AdminRefused(503, str(exc), "node_unavailable") from None
        if isinstance(reply, LogsReply) and not reply.error:
            return NodeLogs(source=reply.source, lines=reply.lines or [], sources=reply.sources)
        raise AdminRefused(404, reply.error if reply.error else "the agent answered without logs", "no_such_log")

    # -- fabrics

    def need_fabrics(self) -> FabricService:
        if self.s.fabrics is None or self.s.reconciler is None:
            raise NotControlPlane()
        return self.s.fabrics

    async def _api_fabrics(self, request: web.Request) -> web.Response:
        return await self._reply(self.fabrics())

    async def fabrics(self) -> FabricsReply:
        return self.need_fabrics().reply()

    async def _api_fabric_topology(self, request: web.Request) -> web.Response:
        try:
            body = self.fabric_topology(request.match_info["fabric"])
        except AdminRefused as exc:
            return exc.response()
        return web.json_response(body, dumps=dumps)

    def fabric_topology(self, fabric_id: str) -> dict[str, Any]:
        try:
            return self.need_fabrics().topology(fabric_id)
        except UnknownFabric as exc:
            raise AdminRefused(404, str(exc), "no_such_fabric") from None

    async def _api_fabric_test(self, request: web.Request) -> web.Response:
        try:
            run = FabricTestRun.model_validate(orjson.loads(await request.read()))
        except (orjson.JSONDecodeError, ValidationError):
            return error_response(
                400,
                'the body should be {"a": NODE, "b": NODE, "fabric": NAME, "seconds": N} '
                "(fabric and seconds may be left out)",
                "invalid_request",
            )
        return await self._reply(self.fabric_test(run))

    async def fabric_test(self, run: FabricTestRun) -> FabricTestView:
        try:
            return await self.need_fabrics().fabric_test(run.a, run.b, run.fabric, run.seconds)
        except FabricTestRefused as exc:
            raise AdminRefused(exc.status, str(exc), "fabric_test_refused") from None

    async def _api_nvlink(self, request: web.Request) -> web.Response:
        return web.json_response(self.nvlink(), dumps=dumps)

    def nvlink(self) -> dict[str, Any]:
        return self.need_fabrics().nvlink()

    def _need_catalog(self) -> Catalog:
        if self.s.catalog is None:
            raise NotControlPlane()
        return self.s.catalog

    async def _api_models(self, request: web.Request) -> web.Response:
        return await self._reply(self.models())

    async def models(self) -> ModelsReply:
        catalog = self._need_catalog()
        rec = self.s.reconciler
        models = []
        for e in catalog.models():
            m = catalog_model(e)
            if rec is not None and e.model.managed:
                m.status = ModelStatus.model_validate(rec.model_status(e.name))
            models.append(m)
        return ModelsReply(models=models, problems=list(catalog.problems))

    async def _api_model_add(self, request: web.Request) -> web.Response:
        catalog = self._need_catalog()
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as exc:
            return error_response(400, f"the body is not valid JSON: {exc}", "invalid_json")
        try:
            req = ModelAddRequest.model_validate(body)
        except ValidationError:
            return error_response(400, 'the body should be {"model": {...}, "source_check": true}', "invalid_request")
        check = self.s.model_check(req.model.get("profiles") or []) if req.source_check else None
        try:
            entry = await catalog.add(req.model, source_check=check)
        except CatalogError as exc:
            return error_response(400, str(exc), "refused")
        self.s.models_changed()
        return json_reply(ModelReply(model=catalog_model(entry)), status=201)

    async def _api_model_remove(self, request: web.Request) -> web.Response:
        catalog = self._need_catalog()
        try:
            await catalog.remove(request.match_info["name"])
        except CatalogError as exc:
            return error_response(400, str(exc), "refused")
        self.s.models_changed()
        return json_reply(Removed(removed=request.match_info["name"]))

    async def _api_model_scale(self, request: web.Request) -> web.Response:
        catalog = self._need_catalog()
        try:
            req = ScaleRequest.model_validate(orjson.loads(await request.read()))
        except (orjson.JSONDecodeError, ValidationError):
            return error_response(
                400,
                'the body should be {"min": N, "max": M} with whole numbers (max may be left out)',
                "invalid_request",
            )
        try:
            entry = await catalog.scale(request.match_info["name"], req.min, req.max)
        except CatalogError as exc:
            return error_response(400, str(exc), "refused")
        self.s.models_changed()
        return json_reply(ModelReply(model=catalog_model(entry)))

    async def _api_model_placement(self, request: web.Request) -> web.Response:
        """Where each profile of a model would go, and why every node was or was not chosen."""
        catalog = self._need_catalog()
        assert self.s.agents is not None
        entry = catalog.get(request.match_info["name"])
        if entry is None:
            return error_response(
                404,
                f"no model {request.match_info['name']} in the catalog; llmgw ctl models lists them",
                "model_not_found",
            )
        if not entry.model.profiles:
            return error_response(
                400, f"{entry.name} is served from static endpoints; nothing is placed", "not_managed"
            )
        rec = self._need_reconciler()
        views = rec.views({n.node_id: n for n in self.s.agents.nodes()})
        out = []
        for profile in entry.model.profiles:
            try:
                req = rec.request_for(entry, profile)
            except ValueError as exc:
                out.append(ProfilePlacement(profile=profile.name, error=str(exc), nodes=[]))
                continue
            verdicts = explain(req, views)
            out.append(
                ProfilePlacement(
                    profile=profile.name,
                    nodes=[NodeVerdict(node=v.node_id, chosen=v.chosen, reasons=v.reasons) for v in verdicts],
                    # What a replica of this profile was measured to serve (ctl bench --save), if anything.
                    capacity=self.s.capacity.words(entry.name, profile.name) if self.s.capacity else None,
                )
            )
        return json_reply(PlacementReply(model=entry.name, profiles=out))

    async def _api_status(self, request: web.Request) -> web.Response:
        usage = self.s.usage
        return json_reply(
            StatusReply(
                version=__version__,
                uptime_seconds=round(time.time() - self.s.started_at, 1),
                models=len(self.s.config.models),
                endpoints=len(self.s.endpoints.endpoints),
                ready=self.s.endpoints.any_ready(),
                api_keys=len(self.s.keys) if self.s.keys else 0,
                auth_enabled=self.s.config.auth.enabled,
                usage=UsageCounts(pending=usage.pending, written=usage.written, dropped=usage.dropped)
                if usage
                else None,
            )
        )

    # -- the mirror ----------------------------------------------------------------

    def _need_mirror(self) -> MirrorClient:
        if self.s.mirror is None:
            raise NoMirror()
        return self.s.mirror

    async def _mirror(self, call: Awaitable[dict[str, Any]]) -> dict[str, Any]:
        try:
            return await call
        except MirrorRefused as exc:
            status = exc.status if exc.status in (400, 403, 404, 409) else 502
            raise AdminRefused(status, str(exc), "mirror_refused") from None
        except MirrorUnavailable as exc:
            raise AdminRefused(503, str(exc), "mirror_unavailable") from None

    async def _mirror_as(self, call: Awaitable[dict[str, Any]], shape: type[Shape]) -> Shape:
        """The mirror's answer read as ``shape``; one it cannot be read as is the mirror's fault, like no JSON."""
        got = await self._mirror(call)
        try:
            return shape.model_validate(got)
        except ValidationError as exc:
            raise AdminRefused(
                503,
                f"the mirror at {self._need_mirror().api} answered in a shape this control "
                f"plane does not read ({_first_error(exc)})",
                "mirror_unavailable",
            ) from None

    def users_of(self, model: str, version: str) -> list[str]:
        """Catalog models whose source lies in this mirror version, compared by path."""
        if self.s.catalog is None:
            return []
        root = f"/{quote(model, safe='')}/{quote(version, safe='')}/"
        out = []
        for e in self.s.catalog.models():
            src = e.model.source
            if src and src.startswith(("http://", "https://")):
                path = urlsplit(src).path
                if path == root.rstrip("/") or path.startswith(root):
                    out.append(e.name)
        return out

    async def _api_mirror_list(self, request: web.Request) -> web.Response:
        return await self._reply(self.mirror_list())

    async def mirror_list(self) -> MirrorListing:
        """What the mirror holds, each version with the catalog models that use it."""
        got = await self._mirror_as(self._need_mirror().list(), MirrorListing)
        for v in got.models or ():
            if v.model and v.version:
                v.used_by = self.users_of(v.model, v.version)
        return got

    async def _api_mirror_fetch(self, request: web.Request) -> web.Response:
        self._need_mirror()  # no mirror: said before the body is read
        try:
            req = MirrorFetchRequest.model_validate(orjson.loads(await request.read()))
        except (orjson.JSONDecodeError, ValidationError):
            return error_response(
                400,
                'the body should be {"source": URL, "model": NAME, "version": VERSION} '
                '(and optionally "as": FILE NAME, "anyway": true)',
                "invalid_request",
            )
        return await self.mirror_fetch(req)

    async def mirror_fetch(self, req: MirrorFetchRequest) -> web.Response:
        """The fetch itself, as the route and the Mirror page ask it."""
        mirror = self._need_mirror()
        got = self._mirror_as(
            mirror.fetch(req.source, req.model, req.version, as_name=req.as_ or None, anyway=req.anyway), MirrorVersion
        )
        return await self._reply(got, status=202)

    async def _api_mirror_status(self, request: web.Request) -> web.Response:
        return await self._reply(self.mirror_status(request.match_info["model"], request.match_info["version"]))

    async def mirror_status(self, m: str, v: str) -> MirrorVersion:
        got = await self._mirror_as(self._need_mirror().status(m, v), MirrorVersion)
        got.used_by = self.users_of(m, v)
        return got

    async def _api_mirror_remove(self, request: web.Request) -> web.Response:
        m, v = request.match_info["model"], request.match_info["version"]
        return await self.mirror_remove(m, v, force=request.query.get("force") in ("1", "true", "yes"))

    async def mirror_remove(self, m: str, v: str, *, force: bool = False) -> web.Response:
        """Remove a version, refused while a catalog model's source lies in it (unless forced)."""
        mirror = self._need_mirror()
        users = self.users_of(m, v)
        if users and not force:
            return error_response(
                409,
                f"{', '.join(users)} still refer(s) to {m}/{v}; retire the catalog entry first "
                "(llmgw ctl model remove), or pass --force",
                "in_use",
            )
        try:
            await self._mirror(mirror.remove(m, v))
        except AdminRefused as exc:
            return exc.response()
        return json_reply(Removed(removed=f"{m}/{v}"))

    async def _api_mirror_serve(self, request: web.Request) -> web.Response:
        """Add a catalog model from a present mirror version in one step."""
        self._need_mirror()
        self._need_catalog()
        m, v = request.match_info["model"], request.match_info["version"]
        try:
            req = MirrorServeRequest.model_validate(orjson.loads(await request.read() or b"{}"))
        except (orjson.JSONDecodeError, ValidationError):
            return error_response(
                400,
                "the body should be a JSON object (name, gpu_class, engine, scaling, description)",
                "invalid_request",
            )
        return await self.mirror_serve(m, v, req)

    async def mirror_serve(self, m: str, v: str, req: MirrorServeRequest) -> web.Response:
        """The catalog model made from a present version, as the route and the Mirror page ask it."""
        mirror = self._need_mirror()
        catalog = self._need_catalog()
        try:
            listing = await self._mirror_as(mirror.list(), MirrorListing)
            status = await self._mirror_as(mirror.status(m, v), MirrorVersion)
        except AdminRefused as exc:
            return exc.response()
        try:
            entry = entry_from_version(
                status,
                listing.base or "",
                name=req.name,
                gpu_class=req.gpu_class,
                engine=req.engine,
                scaling=req.scaling,
                description=req.description,
            )
        except ValueError as exc:
            return error_response(400, str(exc), "refused")
        check = self.s.model_check(entry["profiles"]) if req.source_check else None
        try:
            added = await catalog.add(entry, source_check=check)
        except CatalogError as exc:
            return error_response(400, str(exc), "refused")
        self.s.models_changed()
        return json_reply(ModelReply(model=catalog_model(added)), status=201)
