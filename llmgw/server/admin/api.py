"""The admin API (/api/v1 on admin_listen): what llmgw ctl reads and changes.

It works on the running server's parts; it answers 404 for control-plane
routes when the server is not a control plane.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING
from urllib.parse import quote, urlsplit

import orjson
from aiohttp import web

from llmgw import __version__
from llmgw.protocol import LogsReply, LogsRequest
from llmgw.server.control.agents import AgentServiceError
from llmgw.server.control.catalog import Catalog, CatalogError
from llmgw.server.control.placement import explain, gpu_class_of, node_view
from llmgw.server.control.mirror_client import (MirrorClient, MirrorRefused, MirrorUnavailable,
                                               entry_from_version)
from llmgw.server.control.reconciler import ControlError, Reconciler
from llmgw.server.gateway.errors import error_response

if TYPE_CHECKING:
    from llmgw.server.app import Server


class NotControlPlane(Exception):
    """An admin request that only a control plane can answer."""


class NoMirror(Exception):
    """A mirror request on a control plane with no mirror: configured."""


def dumps(obj: object) -> str:
    return orjson.dumps(obj).decode()



class AdminAPI:
    def __init__(self, server: "Server") -> None:
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

    async def _api_endpoints(self, request: web.Request) -> web.Response:
        now = time.monotonic()
        stale_after = self.s.endpoints.stale_after
        out = []
        for ep in self.s.endpoints.endpoints:
            stale = ep.metrics_stale(now, stale_after)
            out.append({
                "model": ep.model, "url": ep.url, "engine": ep.engine,
                "healthy": ep.healthy, "health": ep.health_detail, "available": ep.available(now),
                "breaker_open": ep.breaker_open, "consecutive_failures": ep.failures,
                "inflight": ep.inflight,
                "waiting": None if stale else ep.waiting, "running": None if stale else ep.running,
                "kv_cache_usage": None if stale else ep.kv_usage, "metrics_stale": stale,
            })
        return web.json_response({"endpoints": out}, dumps=dumps)

    def _need_reconciler(self) -> Reconciler:
        if self.s.reconciler is None or self.s.agents is None:
            raise NotControlPlane()
        return self.s.reconciler

    async def _api_nodes(self, request: web.Request) -> web.Response:
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
            out.append({
                "node_id": n.node_id, "state": rec.node_state(n), "connected": n.connected, "last_seen": n.last_seen,
                "last_seen_ago_s": round(now - n.last_seen, 1) if n.last_seen else None,
                "agent_version": n.agent_version, "mgmt_addr": n.mgmt_addr, "mgmt_interface": n.mgmt_interface,
                "labels": n.labels or {}, "engines": n.engine_versions or {},
                "provision": {k: v.model_dump(mode="json", exclude_none=True) for k, v in n.provision.items()},
                "memory": n.memory.model_dump(mode="json", exclude_none=True) if n.memory else None,
                "gpus_total": len(gpus),
                "gpus_free": sum(1 for g in view.gpus if g.healthy and g.index not in claimed),
                "classes": sorted({gpu_class_of(g) for g in gpus}),
                "fabrics": sorted(view.fabrics),
                "disk_free_bytes": disk.free_bytes if disk else None,
                "disk_total_bytes": disk.total_bytes if disk else None,
                "replicas": sorted(by_node.get(n.node_id, [])),
                "warnings": warnings,
                "shards": {k: v.model_dump(mode="json", exclude_none=True) for k, v in n.shards.items()},
            })
        return web.json_response({"nodes": out}, dumps=dumps)

    async def _node_op(self, request: web.Request, op: str) -> web.Response:
        rec = self._need_reconciler()
        node = request.match_info["node"]
        try:
            message = await getattr(rec, op)(node)
        except ControlError as exc:
            return error_response(404, str(exc), "node_not_found")
        n = self.s.agents.get(node) if self.s.agents else None
        return web.json_response({"node": node, "state": rec.node_state(n) if n else None, "message": message},
                                 dumps=dumps)

    async def _api_node_cordon(self, request: web.Request) -> web.Response:
        return await self._node_op(request, "cordon")

    async def _api_node_uncordon(self, request: web.Request) -> web.Response:
        return await self._node_op(request, "uncordon")

    async def _api_node_drain(self, request: web.Request) -> web.Response:
        return await self._node_op(request, "drain")

    async def _api_replicas(self, request: web.Request) -> web.Response:
        rec = self._need_reconciler()
        model = request.query.get("model") or None
        if model is not None:
            entry = self._need_catalog().get(model)
            if entry is None:
                return error_response(404, f"no model {model} in the catalog; llmgw ctl models lists them",
                                      "model_not_found")
            model = entry.name
        return web.json_response({"replicas": rec.replica_rows(model)}, dumps=dumps)

    async def _api_node_remove(self, request: web.Request) -> web.Response:
        if self.s.agents is None:
            raise NotControlPlane()
        try:
            self.s.agents.remove(request.match_info["node"])
        except AgentServiceError as exc:
            return error_response(400, str(exc), "refused")
        return web.json_response({"removed": request.match_info["node"]}, dumps=dumps)

    async def _api_node_logs(self, request: web.Request) -> web.Response:
        """A node's own log or a shard's output, fetched through the agent's stream."""
        if self.s.agents is None:
            raise NotControlPlane()
        q = request.query
        try:
            lines = int(q.get("lines", "200"))
            if not 0 < lines <= 100_000:
                raise ValueError
        except ValueError:
            return error_response(400, "lines should be a whole number from 1 to 100000", "invalid_request")
        try:
            reply = await self.s.agents.request(request.match_info["node"],
                                              LogsRequest(source=q.get("source") or None, lines=lines), timeout=15)
        except AgentServiceError as exc:
            return error_response(503, str(exc), "node_unavailable")
        if isinstance(reply, LogsReply) and not reply.error:
            return web.json_response({"source": reply.source, "lines": reply.lines or [], "sources": reply.sources},
                                     dumps=dumps)
        error = reply.error if reply.error else "the agent answered without logs"
        return error_response(404, error, "no_such_log")

    def _need_catalog(self) -> Catalog:
        if self.s.catalog is None:
            raise NotControlPlane()
        return self.s.catalog

    async def _api_models(self, request: web.Request) -> web.Response:
        catalog = self._need_catalog()
        rec = self.s.reconciler
        models = []
        for e in catalog.models():
            d = e.to_dict()
            if rec is not None and e.model.managed:
                d["status"] = rec.model_status(e.name)
            models.append(d)
        return web.json_response({"models": models,
                                  "problems": list(catalog.problems)}, dumps=dumps)

    async def _api_model_add(self, request: web.Request) -> web.Response:
        catalog = self._need_catalog()
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as exc:
            return error_response(400, f"the body is not valid JSON: {exc}", "invalid_json")
        if not isinstance(body, dict) or not isinstance(body.get("model"), dict):
            return error_response(400, 'the body should be {"model": {...}, "source_check": true}', "invalid_request")
        check = self.s.model_check(body["model"].get("profiles")) if body.get("source_check", True) else None
        try:
            entry = await catalog.add(body["model"], source_check=check)
        except CatalogError as exc:
            return error_response(400, str(exc), "refused")
        self.s.models_changed()
        return web.json_response({"model": entry.to_dict()}, status=201, dumps=dumps)

    async def _api_model_remove(self, request: web.Request) -> web.Response:
        catalog = self._need_catalog()
        try:
            await catalog.remove(request.match_info["name"])
        except CatalogError as exc:
            return error_response(400, str(exc), "refused")
        self.s.models_changed()
        return web.json_response({"removed": request.match_info["name"]}, dumps=dumps)

    async def _api_model_scale(self, request: web.Request) -> web.Response:
        catalog = self._need_catalog()
        try:
            body = orjson.loads(await request.read())
            lo, hi = body["min"], body.get("max")
            if not isinstance(lo, int) or (hi is not None and not isinstance(hi, int)):
                raise TypeError
        except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
            return error_response(400, 'the body should be {"min": N, "max": M} with whole numbers (max may be left out)',
                                  "invalid_request")
        try:
            entry = await catalog.scale(request.match_info["name"], lo, hi)
        except CatalogError as exc:
            return error_response(400, str(exc), "refused")
        self.s.models_changed()
        return web.json_response({"model": entry.to_dict()}, dumps=dumps)

    async def _api_model_placement(self, request: web.Request) -> web.Response:
        """Where each profile of a model would go, and why every node was or was not chosen."""
        catalog = self._need_catalog()
        assert self.s.agents is not None
        entry = catalog.get(request.match_info["name"])
        if entry is None:
            return error_response(404, f"no model {request.match_info['name']} in the catalog; llmgw ctl models lists them",
                                  "model_not_found")
        if not entry.model.profiles:
            return error_response(400, f"{entry.name} is served from static endpoints; nothing is placed",
                                  "not_managed")
        rec = self._need_reconciler()
        views = rec.views({n.node_id: n for n in self.s.agents.nodes()})
        out = []
        for profile in entry.model.profiles:
            try:
                req = rec.request_for(entry, profile)
            except ValueError as exc:
                out.append({"profile": profile.name, "error": str(exc), "nodes": []})
                continue
            verdicts = explain(req, views)
            out.append({"profile": profile.name, "nodes": [
                {"node": v.node_id, "chosen": v.chosen, "reasons": v.reasons} for v in verdicts]})
        return web.json_response({"model": entry.name, "profiles": out}, dumps=dumps)

    async def _api_status(self, request: web.Request) -> web.Response:
        usage = self.s.usage
        return web.json_response({
            "version": __version__, "uptime_seconds": round(time.time() - self.s.started_at, 1),
            "models": len(self.s.config.models), "endpoints": len(self.s.endpoints.endpoints),
            "ready": self.s.endpoints.any_ready(), "api_keys": len(self.s.keys) if self.s.keys else 0,
            "auth_enabled": self.s.config.auth.enabled,
            "usage": {"pending": usage.pending, "written": usage.written, "dropped": usage.dropped} if usage else None,
        }, dumps=dumps)

    # -- the mirror ----------------------------------------------------------------

    def _need_mirror(self) -> MirrorClient:
        if self.s.mirror is None:
            raise NoMirror()
        return self.s.mirror

    async def _mirror(self, call) -> web.Response | dict:
        try:
            return await call
        except MirrorRefused as exc:
            return error_response(exc.status if exc.status in (400, 403, 404, 409) else 502, str(exc), "mirror_refused")
        except MirrorUnavailable as exc:
            return error_response(503, str(exc), "mirror_unavailable")

    def _users_of(self, model: str, version: str) -> list[str]:
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
        got = await self._mirror(self._need_mirror().list())
        if isinstance(got, web.Response):
            return got
        for v in got.get("models") or ():
            if isinstance(v, dict) and v.get("model") and v.get("version"):
                v["used_by"] = self._users_of(v["model"], v["version"])
        return web.json_response(got, dumps=dumps)

    async def _api_mirror_fetch(self, request: web.Request) -> web.Response:
        mirror = self._need_mirror()
        try:
            body = orjson.loads(await request.read())
            source, model, version = body["source"], body["model"], body["version"]
            if not all(isinstance(x, str) and x for x in (source, model, version)):
                raise TypeError
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return error_response(400, 'the body should be {"source": URL, "model": NAME, "version": VERSION} '
                                  '(and optionally "as": FILE NAME, "anyway": true)', "invalid_request")
        got = await self._mirror(mirror.fetch(source, model, version, as_name=body.get("as") or None,
                                              anyway=bool(body.get("anyway"))))
        if isinstance(got, web.Response):
            return got
        return web.json_response(got, status=202, dumps=dumps)

    async def _api_mirror_status(self, request: web.Request) -> web.Response:
        m, v = request.match_info["model"], request.match_info["version"]
        got = await self._mirror(self._need_mirror().status(m, v))
        if isinstance(got, web.Response):
            return got
        got["used_by"] = self._users_of(m, v)
        return web.json_response(got, dumps=dumps)

    async def _api_mirror_remove(self, request: web.Request) -> web.Response:
        mirror = self._need_mirror()
        m, v = request.match_info["model"], request.match_info["version"]
        users = self._users_of(m, v)
        if users and request.query.get("force") not in ("1", "true", "yes"):
            return error_response(409, f"{', '.join(users)} still refer(s) to {m}/{v}; retire the catalog entry first "
                                  "(llmgw ctl model remove), or pass --force", "in_use")
        got = await self._mirror(mirror.remove(m, v))
        if isinstance(got, web.Response):
            return got
        return web.json_response({"removed": f"{m}/{v}"}, dumps=dumps)

    async def _api_mirror_serve(self, request: web.Request) -> web.Response:
        """Add a catalog model from a present mirror version in one step."""
        mirror = self._need_mirror()
        catalog = self._need_catalog()
        m, v = request.match_info["model"], request.match_info["version"]
        try:
            body = orjson.loads(await request.read() or b"{}")
            if not isinstance(body, dict):
                raise TypeError
        except (orjson.JSONDecodeError, TypeError):
            return error_response(400, "the body should be a JSON object (name, gpu_class, engine, scaling, description)",
                                  "invalid_request")
        listing = await self._mirror(mirror.list())
        if isinstance(listing, web.Response):
            return listing
        status = await self._mirror(mirror.status(m, v))
        if isinstance(status, web.Response):
            return status
        try:
            entry = entry_from_version(status, listing.get("base") or "", name=body.get("name"),
                                       gpu_class=body.get("gpu_class"), engine=body.get("engine"),
                                       scaling=body.get("scaling"), description=body.get("description"))
        except ValueError as exc:
            return error_response(400, str(exc), "refused")
        check = self.s.model_check(entry["profiles"]) if body.get("source_check", True) else None
        try:
            added = await catalog.add(entry, source_check=check)
        except CatalogError as exc:
            return error_response(400, str(exc), "refused")
        self.s.models_changed()
        return web.json_response({"model": added.to_dict()}, status=201, dumps=dumps)
