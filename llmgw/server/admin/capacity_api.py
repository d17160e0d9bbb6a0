"""The admin API's measured capacity: PUT /api/v1/models/{model}/capacity (what
`llmgw ctl bench --save` sends) and GET /api/v1/capacity (what `llmgw ctl capacity` shows).

A measurement is filed under a model of the catalog and one of its profiles: capacity
belongs to the hardware and the engine's arguments as much as to the weights. Measuring
again replaces it. The control plane applies it at once (control/capacity.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import orjson
from aiohttp import web
from pydantic import ValidationError

from llmgw.protocol.admin import Capacity, CapacityReply, CapacitySLO, CapacityView
from llmgw.server.admin.api import AdminRefused, NotControlPlane
from llmgw.server.control.capacity import Capacities
from llmgw.store import MeasuredCapacity, StoreError
from llmgw.webguard import CALLER

if TYPE_CHECKING:
    from llmgw.server.admin.api import AdminAPI


def add_capacity_routes(api: AdminAPI, app: web.Application) -> None:
    routes = CapacityAPI(api)
    app.router.add_get("/api/v1/capacity", routes._api_capacity)
    app.router.add_put("/api/v1/models/{model}/capacity", routes._api_capacity_put)


def capacity_view(c: MeasuredCapacity) -> CapacityView:
    return CapacityView(
        model=c.model,
        profile=c.profile,
        max_concurrency_at_slo=c.concurrent,
        throughput_tok_per_sec=c.tokens_per_s,
        ttft_p99=c.ttft_p99,
        tpot_p99=c.tpot_p99,
        suggested_target_waiting=c.wait,
        suggested_kv_ceiling=c.kv,
        slo=CapacitySLO(ttft_p99=c.slo_ttft_p99, tpot_p99=c.slo_tpot_p99),
        target=c.target,
        measured_at=c.measured_at,
        measured_by=c.measured_by,
    )


def _first_error(exc: ValidationError) -> str:
    e = exc.errors()[0]
    return f"{'.'.join(map(str, e['loc'])) or 'the body'}: {e['msg']}"


class CapacityAPI:
    def __init__(self, api: AdminAPI) -> None:
        self.api = api

    def _need(self) -> Capacities:
        caps = self.api.s.capacity
        if caps is None:
            raise NotControlPlane()
        return caps

    async def _api_capacity(self, request: web.Request) -> web.Response:
        return await self.api._reply(self.capacity())

    async def capacity(self) -> CapacityReply:
        """Every measurement, read from the store itself: another control plane may have saved one."""
        caps = self._need()
        try:
            rows = await caps.store.capacity_list()
        except Exception as exc:  # the store away: said, not a traceback
            raise AdminRefused(503, f"the store could not be read: {exc}", "store_unavailable") from None
        return CapacityReply(capacity=[capacity_view(c) for c in rows])

    async def _api_capacity_put(self, request: web.Request) -> web.Response:
        self._need()
        try:
            body = Capacity.model_validate(orjson.loads(await request.read()))
        except orjson.JSONDecodeError as exc:
            return AdminRefused(400, f"the body is not valid JSON: {exc}", "invalid_json").response()
        except ValidationError as exc:
            return AdminRefused(
                400,
                f"the body should be a capacity as `llmgw ctl bench --save` sends it ({_first_error(exc)})",
                "invalid_request",
            ).response()
        return await self.api._reply(self.save(request.match_info["model"], body, request.get(CALLER)))

    async def save(self, model: str, body: Capacity, measured_by: str | None = None) -> CapacityView:
        """File a measurement under a catalog model (its name or an alias) and one of its profiles."""
        caps = self._need()
        entry = self.api._need_catalog().get(model)
        if entry is None:
            raise AdminRefused(404, f"no model {model} in the catalog; llmgw ctl models lists them", "model_not_found")
        if body.model not in (entry.name, *entry.model.aliases):
            raise AdminRefused(
                400, f"the body is a capacity of {body.model}, sent to the path of {entry.name}", "invalid_request"
            )
        names = [p.name for p in entry.model.profiles]
        if not names:
            raise AdminRefused(
                400,
                f"{entry.name} is served from static endpoints; capacity is kept per profile of a model "
                "the control plane places",
                "not_managed",
            )
        if body.profile not in names:
            raise AdminRefused(
                404,
                f"{entry.name} has no profile {body.profile}; its profiles are {', '.join(names)}",
                "profile_not_found",
            )
        measured = MeasuredCapacity(
            model=entry.name,
            profile=body.profile,
            concurrent=body.max_concurrency_at_slo,
            tokens_per_s=body.throughput_tok_per_sec,
            ttft_p99=body.ttft_p99,
            tpot_p99=body.tpot_p99,
            wait=body.suggested_target_waiting,
            kv=body.suggested_kv_ceiling,
            slo_ttft_p99=body.slo.ttft_p99,
            slo_tpot_p99=body.slo.tpot_p99,
            target=body.target,
            measured_at=body.measured_at,
            measured_by=measured_by,
        )
        try:
            return capacity_view(await caps.save(measured))
        except StoreError as exc:
            raise AdminRefused(400, str(exc), "refused") from None
        except Exception as exc:  # the store away: said, not a traceback
            raise AdminRefused(503, f"the store could not be written: {exc}", "store_unavailable") from None
