"""Measured capacity in the store (`ctl bench --save`), on both backends."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta

import pytest
from alembic import command
from sqlalchemy import inspect

from llmgw.store import MeasuredCapacity, Store, StoreError
from llmgw.store.migrate import _alembic_config


@pytest.fixture
async def store(address):
    s = await Store.open(address)
    yield s
    await s.close()


def measured(model: str = "qwen", profile: str = "llamacpp-cpu", **kw) -> MeasuredCapacity:
    base = dict(
        model=model,
        profile=profile,
        concurrent=4,
        tokens_per_s=182.5,
        ttft_p99=0.31,
        tpot_p99=0.022,
        wait=2,
        kv=0.41,
        slo_ttft_p99=2.0,
        slo_tpot_p99=0.1,
        target="http://10.0.0.5:20001",
        measured_at=datetime(2026, 3, 1, 12, 30, tzinfo=UTC),
        measured_by="token adm-0123456789ab",
    )
    base.update(kw)
    return MeasuredCapacity(**base)


async def test_a_measurement_is_kept_per_model_and_profile_and_measuring_again_replaces_it(store):
    assert await store.capacity_list() == []
    first = await store.capacity_put(measured())
    assert first == measured()
    # The same model on another profile is another number; another model too.
    await store.capacity_put(measured(profile="vllm-h100-80g", concurrent=48, tokens_per_s=5200.0))
    await store.capacity_put(measured(model="embed", profile="llamacpp-cpu", wait=None, kv=None))
    later = measured(concurrent=6, tokens_per_s=240.0, measured_at=datetime(2026, 3, 2, tzinfo=UTC), measured_by=None)
    assert await store.capacity_put(later) == later
    got = await store.capacity_list()
    assert [(c.model, c.profile, c.concurrent) for c in got] == [
        ("embed", "llamacpp-cpu", 4),
        ("qwen", "llamacpp-cpu", 6),
        ("qwen", "vllm-h100-80g", 48),
    ]
    assert got[1] == later and got[0].wait is None and got[0].kv is None
    assert got[1].measured_at.tzinfo is not None and got[1].measured_at == datetime(2026, 3, 2, tzinfo=UTC)

    assert await store.capacity_delete("qwen", "vllm-h100-80g") == 1
    assert await store.capacity_delete("qwen", "vllm-h100-80g") == 0
    assert await store.capacity_delete("embed") == 1
    assert [(c.model, c.profile) for c in await store.capacity_list()] == [("qwen", "llamacpp-cpu")]


async def test_none_at_the_slo_is_kept_as_a_real_answer(store):
    zero = measured(concurrent=0, tokens_per_s=0.0, ttft_p99=None, tpot_p99=None, wait=None, kv=None)
    assert await store.capacity_put(zero) == zero
    assert (await store.capacity_list())[0].concurrent == 0


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"model": ""}, "model is its name"),
        ({"profile": "p" * 201}, "profile is its name"),
        ({"concurrent": -1}, "concurrency is a whole number"),
        ({"concurrent": 2.5}, "concurrency is a whole number"),
        ({"tokens_per_s": float("nan")}, "throughput is tokens per second"),
        ({"ttft_p99": -0.1}, "TTFT p99 is a number of seconds"),
        ({"kv": 1.5}, "KV-cache use is a share from 0 to 1"),
        ({"wait": -2}, "queue depth is a whole number"),
        ({"slo_tpot_p99": 0.0}, "TPOT target is longer than 0 seconds"),
        ({"target": ""}, "target is the URL the load went to"),
        ({"measured_at": datetime(2026, 3, 1)}, "measured_at is a time with its time zone"),
    ],
)
async def test_a_measurement_that_cannot_be_one_is_refused_in_words(store, change, words):
    with pytest.raises(StoreError, match=words):
        await store.capacity_put(dataclasses.replace(measured(), **change))
    assert await store.capacity_list() == []


async def test_the_migration_makes_the_table_and_its_downgrade_removes_it(store):
    def tables(sync_conn):
        return set(inspect(sync_conn).get_table_names())

    async with store.engine.connect() as conn:
        assert "model_capacity" in await conn.run_sync(tables)
    async with store.engine.begin() as conn:
        await conn.run_sync(lambda c: command.downgrade(_alembic_config(c), "0010"))
    async with store.engine.connect() as conn:
        assert "model_capacity" not in await conn.run_sync(tables)
    async with store.engine.begin() as conn:
        await conn.run_sync(lambda c: command.upgrade(_alembic_config(c), "head"))
    await store.capacity_put(measured(measured_at=datetime.now(UTC) - timedelta(hours=3)))
    assert len(await store.capacity_list()) == 1
