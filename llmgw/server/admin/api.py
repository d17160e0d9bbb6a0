"""The admin API (/api/v1 on admin_listen): what llmgw ctl reads and changes.

It works on the running server's parts; it answers 404 for control-plane
routes when the server is not a control plane.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import orjson
from aiohttp import web

from llmgw import __version__
from llmgw.protocol import LogsReply, LogsRequest
from llmgw.server.control.agents import AgentServiceError
from llmgw.server.control.catalog import Catalog, CatalogError, check_source
from llmgw.server.control.placement import PlacementRequest, explain, node_view
from llmgw.server.gateway.errors import error_response

if TYPE_CHECKING:
    from llmgw.server.app import Server


class NotControlPlane(Exception):
    """An admin request that only a control plane can answer."""


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

    async def _api_nodes(self, request: web.Request) -> web.Response:
        if self.s.agents is None:
            raise NotControlPlane()
        out = []
        for n in self.s.agents.nodes():
            out.append({
                "node_id": n.node_id, "state": n.state.value, "connected": n.connected, "last_seen": n.last_seen,
                "agent_version": n.agent_version, "mgmt_addr": n.mgmt_addr, "mgmt_interface": n.mgmt_interface,
                "labels": n.labels, "engines": n.engine_versions,
                "provision": {k: v.model_dump(mode="json", exclude_none=True) for k, v in n.provision.items()},
                "memory": n.memory.model_dump(mode="json", exclude_none=True) if n.memory else None,
                "gpus": len(n.inventory.gpus or ()) if n.inventory else None,
                "shards": {k: v.model_dump(mode="json", exclude_none=True) for k, v in n.shards.items()},
            })
        return web.json_response({"nodes": out}, dumps=dumps)

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
        return web.json_response({"models": [e.to_dict() for e in catalog.models()],
                                  "problems": list(catalog.problems)}, dumps=dumps)

    async def _api_model_add(self, request: web.Request) -> web.Response:
        catalog = self._need_catalog()
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as exc:
            return error_response(400, f"the body is not valid JSON: {exc}", "invalid_json")
        if not isinstance(body, dict) or not isinstance(body.get("model"), dict):
            return error_response(400, 'the body should be {"model": {...}, "source_check": true}', "invalid_request")
        check = check_source if body.get("source_check", True) else None
        try:
            entry = await catalog.add(body["model"], source_check=check)
        except CatalogError as exc:
            return error_response(400, str(exc), "refused")
        return web.json_response({"model": entry.to_dict()}, status=201, dumps=dumps)

    async def _api_model_remove(self, request: web.Request) -> web.Response:
        catalog = self._need_catalog()
        try:
            await catalog.remove(request.match_info["name"])
        except CatalogError as exc:
            return error_response(400, str(exc), "refused")
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
        views = [node_view(n) for n in self.s.agents.nodes()]
        out = []
        for profile in entry.model.profiles:
            try:
                req = PlacementRequest(
                    model=entry.name, engine=profile.engine, gpu_class=profile.gpu_class,
                    tp=max(1, profile.tp // profile.nodes), nodes=profile.nodes, min_memory_gb=profile.min_memory_gb,
                    node_selector=dict(profile.node_selector), source=entry.model.source)
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
