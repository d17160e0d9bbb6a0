"""Measured capacity, mixed into Store: what one replica of a model on one profile served
while it still met a latency target (`llmgw ctl bench --save`), read back by `ctl capacity`
and by the control plane, whose admission and routing use it.

Keyed by model and profile: the same model on a CPU and on a GPU are two numbers. The
conclusion of a run is kept, not the run; measuring again replaces it, since a second run
answers the same question better rather than adding a data point.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from datetime import datetime

from sqlalchemy import delete, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Row
from sqlalchemy.ext.asyncio import AsyncEngine

from .errors import StoreError
from .schema import model_capacity

MAX_NAME = 200  # model and profile names, as the catalog allows them
MAX_TEXT = 2000  # the target and who measured


@dataclass(frozen=True, slots=True)
class MeasuredCapacity:
    """One measurement. Times in seconds; ``concurrent`` 0 means not even one request at a
    time met the SLO, a real answer ("this cannot serve it at this target"), not a missing one."""

    model: str
    profile: str
    concurrent: int
    tokens_per_s: float
    ttft_p99: float | None
    tpot_p99: float | None
    wait: int | None  # the engine's own queue seen at that level; None: it publishes none
    kv: float | None  # its KV-cache use seen at that level, 0 to 1
    slo_ttft_p99: float
    slo_tpot_p99: float
    target: str
    measured_at: datetime
    measured_by: str | None = None


def _name(what: str, value: object) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_NAME:
        raise StoreError(f"A capacity's {what} is its name, 1 to {MAX_NAME} characters, not {value!r}.")
    return value


def _seconds(what: str, value: object, *, optional: bool, positive: bool = False) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise StoreError(f"A capacity's {what} is a number of seconds, 0 or more, not {value!r}.")
    if positive and value == 0:
        raise StoreError(f"A capacity's {what} is longer than 0 seconds.")
    return float(value)


def _check(c: MeasuredCapacity) -> MeasuredCapacity:
    _name("model", c.model)
    _name("profile", c.profile)
    if isinstance(c.concurrent, bool) or not isinstance(c.concurrent, int) or c.concurrent < 0:
        raise StoreError(f"A capacity's concurrency is a whole number, 0 or more, not {c.concurrent!r}.")
    tps = c.tokens_per_s
    if isinstance(tps, bool) or not isinstance(tps, (int, float)) or not math.isfinite(tps) or tps < 0:
        raise StoreError(f"A capacity's throughput is tokens per second, 0 or more, not {tps!r}.")
    if c.wait is not None and (isinstance(c.wait, bool) or not isinstance(c.wait, int) or c.wait < 0):
        raise StoreError(f"A capacity's queue depth is a whole number, 0 or more, not {c.wait!r}.")
    if c.kv is not None and (
        isinstance(c.kv, bool) or not isinstance(c.kv, (int, float)) or not math.isfinite(c.kv) or not 0 <= c.kv <= 1
    ):
        raise StoreError(f"A capacity's KV-cache use is a share from 0 to 1, not {c.kv!r}.")
    if not isinstance(c.target, str) or not c.target or len(c.target) > MAX_TEXT:
        raise StoreError(f"A capacity's target is the URL the load went to, 1 to {MAX_TEXT} characters.")
    if c.measured_by is not None and (not isinstance(c.measured_by, str) or len(c.measured_by) > MAX_TEXT):
        raise StoreError(f"Who measured a capacity is said in at most {MAX_TEXT} characters.")
    if not isinstance(c.measured_at, datetime) or c.measured_at.tzinfo is None:
        raise StoreError("A capacity's measured_at is a time with its time zone.")
    return replace(
        c,
        tokens_per_s=float(tps),
        ttft_p99=_seconds("TTFT p99", c.ttft_p99, optional=True),
        tpot_p99=_seconds("TPOT p99", c.tpot_p99, optional=True),
        kv=None if c.kv is None else float(c.kv),
        slo_ttft_p99=_seconds("TTFT target", c.slo_ttft_p99, optional=False, positive=True) or 0.0,
        slo_tpot_p99=_seconds("TPOT target", c.slo_tpot_p99, optional=False, positive=True) or 0.0,
    )


def _row(r: Row[tuple[object, ...]]) -> MeasuredCapacity:
    return MeasuredCapacity(**r._mapping)


class CapacityMixin:
    """Store methods for measured capacity."""

    _engine: AsyncEngine
    _writer: AsyncEngine

    async def capacity_put(self, capacity: MeasuredCapacity) -> MeasuredCapacity:
        """Keep a measurement, replacing the one of the same model and profile."""
        c = _check(capacity)
        values = {
            "model": c.model,
            "profile": c.profile,
            "concurrent": c.concurrent,
            "tokens_per_s": c.tokens_per_s,
            "ttft_p99": c.ttft_p99,
            "tpot_p99": c.tpot_p99,
            "wait": c.wait,
            "kv": c.kv,
            "slo_ttft_p99": c.slo_ttft_p99,
            "slo_tpot_p99": c.slo_tpot_p99,
            "target": c.target,
            "measured_at": c.measured_at,
            "measured_by": c.measured_by,
        }
        key = (model_capacity.c.model == c.model, model_capacity.c.profile == c.profile)
        async with self._writer.begin() as conn:
            # One statement on both backends: two control planes saving at once leave one row.
            ins = (postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert)(model_capacity)
            await conn.execute(
                ins.values(**values).on_conflict_do_update(
                    index_elements=[model_capacity.c.model, model_capacity.c.profile],
                    set_={k: v for k, v in values.items() if k not in ("model", "profile")},
                )
            )
            row = (await conn.execute(select(model_capacity).where(*key))).one()
        return _row(row)

    async def capacity_list(self) -> list[MeasuredCapacity]:
        """Every measurement, by model and profile."""
        q = select(model_capacity).order_by(model_capacity.c.model, model_capacity.c.profile)
        async with self._engine.connect() as conn:
            return [_row(r) for r in await conn.execute(q)]

    async def capacity_delete(self, model: str, profile: str | None = None) -> int:
        """Forget a model's measurement on one profile, or on every profile (None); how many went."""
        where = [model_capacity.c.model == model]
        if profile is not None:
            where.append(model_capacity.c.profile == profile)
        async with self._writer.begin() as conn:
            done = await conn.execute(delete(model_capacity).where(*where))
        return int(done.rowcount)
