"""Admission: the fast path, the queue's order (bands, tenants in turn), shedding,
timeouts, cancellation, metrics, and measuring a pool from its endpoints."""

from __future__ import annotations

import asyncio

import pytest

from llmgw.config.server import AdmissionConfig, ServerConfig
from llmgw.server.gateway.admission import (
    Admission,
    AdmissionRejected,
    effective_band,
    pool_capacity,
    pool_saturation,
)
from llmgw.server.gateway.endpoints import Endpoint, EndpointSet


class Load:
    """A saturation reading the test sets by hand."""

    def __init__(self, value: float = 0.0) -> None:
        self.value = value

    def __call__(self, model: str) -> float:
        return self.value


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(sat: float = 0.0, **cfg) -> tuple[Admission, Load, Clock]:
    load, clock = Load(sat), Clock()
    return Admission(AdmissionConfig(**cfg), load, capacity=lambda m: 8.0, clock=clock), load, clock


async def settle() -> None:
    # Yields to the loop, so woken tasks run; no clock is involved, so load cannot make it flake.
    for _ in range(5):
        await asyncio.sleep(0)


async def enqueue(adm: Admission, model: str, band: str, tenant: str, tag: str, order: list[str]) -> asyncio.Task:
    async def go():
        ticket = await adm.wait(model, band, tenant)
        order.append(tag)
        return ticket

    t = asyncio.create_task(go())
    await settle()
    return t


def test_config_defaults_and_server_block():
    c = ServerConfig().admission
    assert (c.enabled, c.queue_timeout, c.max_queue, c.healthy_waiting, c.kv_ceiling, c.retry_after) == (
        True,
        30.0,
        1000,
        8.0,
        0.9,
        5.0,
    )
    assert AdmissionConfig.model_validate({"queue_timeout": "2m"}).queue_timeout == 120.0
    with pytest.raises(ValueError):
        AdmissionConfig.model_validate({"kv_ceiling": 1.5})
    with pytest.raises(ValueError):
        AdmissionConfig.model_validate({"max_queue": 0})


def test_fast_path_does_not_queue():
    adm, _, _ = make(0.5)
    t = adm.try_admit("m", "normal", "A")  # synchronous: no event loop needed
    assert t is not None and t.waited == 0.0
    assert adm.queue_depth("m") == 0
    assert adm.stats().inflight == {"m": 1}
    adm.release(t)
    adm.release(t)  # twice is harmless
    assert adm.stats().inflight == {}


def test_disabled_always_passes():
    adm, _, _ = make(5.0, enabled=False)
    assert adm.try_admit("m", "low", "A") is not None


async def test_saturated_queues_and_poke_admits():
    adm, load, _ = make(1.0)
    assert adm.try_admit("m", "normal", "A") is None
    order: list[str] = []
    t = await enqueue(adm, "m", "normal", "A", "a1", order)
    assert adm.queue_depth("m") == 1 and not t.done()
    assert adm.poke("m") == 0  # still saturated
    load.value = 0.5
    assert adm.poke("m") == 1
    ticket = await t
    assert ticket.model == "m" and ticket.band == "normal" and order == ["a1"]
    assert adm.queue_depth("m") == 0


async def test_nobody_jumps_the_queue():
    """Waiters exist: a newcomer queues even when the pool reads unsaturated, and its
    arrival lets the head of the queue go, not itself."""
    adm, load, _ = make(1.0)
    order: list[str] = []
    first = await enqueue(adm, "m", "normal", "A", "first", order)
    load.value = 0.2
    assert adm.try_admit("m", "high", "B") is None
    second = await enqueue(adm, "m", "normal", "B", "second", order)
    assert order == ["first"] and first.done() and not second.done()
    assert adm.queue_depth("m") == 1
    adm.release(await first)  # unsaturated: the finished request's place passes on
    await settle()
    assert order == ["first", "second"]
    adm.release(await second)
    assert adm.stats().inflight == {}


async def test_highest_band_first():
    adm, load, _ = make(1.0)
    order: list[str] = []
    tasks = [await enqueue(adm, "m", band, "T" + band, band, order) for band in ("low", "normal", "high")]
    load.value = 0.9  # headroom (1 - 0.9) x 8 rounds down to 0: one at least
    for _ in range(3):
        assert adm.poke("m") == 1
        await settle()
    assert order == ["high", "normal", "low"]
    await asyncio.gather(*tasks)


async def test_release_admits_one_per_finished_request_while_unsaturated():
    adm, load, _ = make(0.0)
    running = [adm.try_admit("m", "normal", "A") for _ in range(2)]
    load.value = 1.0
    order: list[str] = []
    tasks = [await enqueue(adm, "m", "normal", "A", f"a{i}", order) for i in range(3)]
    adm.release(running[0])  # saturated: the place is not passed on
    await settle()
    assert order == [] and adm.queue_depth("m") == 3
    load.value = 0.5  # (the scrape has not been poked yet)
    adm.release(running[1])  # one finished request, one waiter in
    await settle()
    assert order == ["a0"] and adm.queue_depth("m") == 2
    for t in tasks[1:]:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    adm.release(tasks[0].result())
    assert adm.stats().inflight == {} and adm.queue_depth() == 0


async def test_poke_budget_follows_headroom():
    adm, load, _ = make(2.0)
    order: list[str] = []
    tasks = [await enqueue(adm, "m", "normal", f"T{i}", f"t{i}", order) for i in range(10)]
    load.value = 0.5  # half of 8 healthy waiting is free: 4 go now, not all ten
    assert adm.poke("m") == 4
    await settle()
    assert len(order) == 4 and adm.queue_depth("m") == 6
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert adm.queue_depth("m") == 0


async def test_tenants_take_turns_within_a_band():
    adm, load, _ = make(1.0)
    order: list[str] = []
    tasks = [await enqueue(adm, "m", "normal", "A", f"A{i}", order) for i in range(10)]
    tasks.append(await enqueue(adm, "m", "normal", "B", "B0", order))
    load.value = 0.9
    for _ in range(11):
        adm.poke("m")
        await settle()
    assert order[:2] == ["A0", "B0"]
    assert order[2:] == [f"A{i}" for i in range(1, 10)]
    await asyncio.gather(*tasks)


async def test_round_robin_over_three_tenants():
    adm, load, _ = make(1.0)
    order: list[str] = []
    tasks = []
    for tenant, n in (("A", 3), ("B", 2), ("C", 1)):
        tasks += [await enqueue(adm, "m", "normal", tenant, f"{tenant}{i}", order) for i in range(n)]
    load.value = 0.0
    assert adm.poke("m") == 6
    await settle()
    assert order == ["A0", "B0", "C0", "A1", "B1", "A2"]
    await asyncio.gather(*tasks)


async def test_full_queue_sheds_lowest_band_first():
    adm, _, _ = make(1.0, max_queue=3)
    order: list[str] = []
    low_a = [await enqueue(adm, "m", "low", "A", f"lowA{i}", order) for i in range(2)]
    low_b = await enqueue(adm, "m", "low", "B", "lowB", order)
    # A high newcomer pushes out the newest low waiter of the busiest low tenant (A).
    high = await enqueue(adm, "m", "high", "C", "high", order)
    await settle()
    assert low_a[1].done()
    with pytest.raises(AdmissionRejected) as e:
        low_a[1].result()
    assert e.value.status == 503 and e.value.code == "overloaded" and e.value.reason == "shed"
    assert "'low'" in e.value.message and "retry after 5 seconds" in e.value.message
    assert e.value.headers() == {"Retry-After": "5"}
    assert not low_a[0].done() and not low_b.done() and not high.done()
    # A low newcomer is no higher than anyone waiting: it is the one refused.
    with pytest.raises(AdmissionRejected) as e2:
        await adm.wait("m", "low", "D")
    assert e2.value.reason == "queue_full"
    assert adm.stats().rejected == {"low": 2, "normal": 0, "high": 0}
    assert adm.queue_depth("m") == 3
    for t in (low_a[0], low_b, high):
        t.cancel()
    await asyncio.gather(low_a[0], low_b, high, return_exceptions=True)


async def test_queue_full_of_high_refuses_high_newcomer():
    adm, _, _ = make(1.0, max_queue=1)
    order: list[str] = []
    t = await enqueue(adm, "m", "high", "A", "a", order)
    with pytest.raises(AdmissionRejected):
        await adm.wait("m", "high", "B")
    assert adm.stats().rejected["high"] == 1
    t.cancel()
    await asyncio.gather(t, return_exceptions=True)


async def test_timeout_is_503_with_retry_after():
    adm, _, clock = make(1.0, queue_timeout=0.01, retry_after=2.5)

    async def go():
        clock.now += 0.01
        return await adm.wait("m", "normal", "A")

    with pytest.raises(AdmissionRejected) as e:
        await go()
    assert e.value.status == 503 and e.value.reason == "timeout" and e.value.band == "normal"
    assert e.value.headers() == {"Retry-After": "3"}
    assert "'normal'" in e.value.message and "'m'" in e.value.message
    assert adm.queue_depth("m") == 0
    assert adm.stats().rejected["normal"] == 1


async def test_cancelled_waiter_leaves_and_takes_no_place():
    adm, load, _ = make(1.0)
    order: list[str] = []
    gone = await enqueue(adm, "m", "normal", "A", "gone", order)
    stays = await enqueue(adm, "m", "normal", "B", "stays", order)
    assert adm.queue_depth("m") == 2
    gone.cancel()
    await settle()
    assert gone.cancelled() and adm.queue_depth("m") == 1
    load.value = 0.9
    assert adm.poke("m") == 1  # the one place goes to the waiter still there
    await settle()
    assert order == ["stays"]
    assert adm.stats().inflight == {"m": 1}
    assert adm.stats().rejected == {"low": 0, "normal": 0, "high": 0}  # leaving is no rejection
    adm.release(await stays)
    assert adm.stats().inflight == {}


async def test_cancelled_as_it_was_admitted_hands_the_place_on():
    adm, load, _ = make(1.0)
    order: list[str] = []
    first = await enqueue(adm, "m", "normal", "A", "first", order)
    second = await enqueue(adm, "m", "normal", "B", "second", order)
    load.value = 0.9
    assert adm.poke("m") == 1  # first's future now holds a ticket...
    first.cancel()  # ...but its client left before it ran
    await settle()
    assert first.cancelled()
    assert order == ["second"]  # the place passed on, not lost
    assert adm.stats().inflight == {"m": 1}
    adm.release(await second)


async def test_admit_combines_fast_and_slow_path():
    adm, load, _ = make(0.0)
    t1 = await adm.admit("m", "normal", "A")
    load.value = 1.0
    task = asyncio.create_task(adm.admit("m", "normal", "A"))
    await settle()
    assert not task.done()
    load.value = 0.0
    adm.release(t1)
    t2 = await task
    assert t2.waited >= 0.0
    adm.release(t2)


async def test_admission_stats_report_queue_depth_by_band_saturation_and_rejections():
    adm, _load, _ = make(1.5)
    order: list[str] = []
    tasks = [await enqueue(adm, "m", band, "A", band, order) for band in ("low", "high", "high")]
    s = adm.stats(["m", "other"])
    assert s.queue_depth == {"m": 3, "other": 0}
    assert s.queue_depth_by_band[("m", "high")] == 2 and s.queue_depth_by_band[("m", "low")] == 1
    assert s.queue_depth_by_band[("other", "normal")] == 0
    assert s.saturation == {"m": 1.5, "other": 1.5}
    assert s.rejected == {"low": 0, "normal": 0, "high": 0}
    assert adm.queue_depth() == 3 and adm.saturation("m") == 1.5
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def test_unknown_band_counts_as_normal_and_header_can_only_lower():
    adm, _, _ = make(0.0)
    assert adm.try_admit("m", "urgent", "A").band == "normal"
    assert effective_band("normal", "high") == "normal"
    assert effective_band("normal", "low") == "low"
    assert effective_band("high", None) == "high"
    assert effective_band("low", "bogus") == "low"


# --- pool_saturation ---------------------------------------------------------


def pool(*eps: Endpoint, stale_after: float = 10.0) -> EndpointSet:
    for ep in eps:
        ep.healthy = True
    return EndpointSet(list(eps), scrape_interval=1.0, stale_after=stale_after, connect_timeout=1.0)


def scraped(engine: str, now: float, *, waiting=None, running=None, kv=None) -> Endpoint:
    ep = Endpoint("m", f"http://{id(object())}", engine, None)
    ep.waiting, ep.running, ep.kv_usage, ep.scraped_at = waiting, running, kv, now
    return ep


def test_pool_saturation_from_waiting():
    now = 500.0
    s = pool(scraped("vllm", now, waiting=4, kv=0.1), scraped("vllm", now, waiting=12, kv=0.1))
    # 16 waiting over 2 x 8 healthy: exactly the limit.
    assert pool_saturation(s, "m", 8, 0.9, now=now) == pytest.approx(1.0)
    assert pool_capacity(s, "m", 8, now=now) == 16
    assert pool_saturation(s, "nothing", 8, 0.9, now=now) == 0.0


def test_pool_saturation_from_kv_mean():
    now = 500.0
    s = pool(scraped("vllm", now, waiting=0, kv=0.99), scraped("vllm", now, waiting=0, kv=0.45))
    assert pool_saturation(s, "m", 8, 0.9, now=now) == pytest.approx(0.72 / 0.9)
    s2 = pool(scraped("sglang", now, waiting=0, kv=0.95))
    assert pool_saturation(s2, "m", 8, 0.9, now=now) > 1.0


def test_pool_saturation_falls_back_to_inflight_when_stale():
    now = 500.0
    ep = scraped("vllm", now - 60, waiting=0, running=2, kv=0.99)  # a minute old
    ep.inflight = 10
    s = pool(ep)
    # Stale: KV is not trusted; 10 in flight, the engine last ran 2 at once: 8 taken to wait.
    assert pool_saturation(s, "m", 8, 0.9, now=now) == pytest.approx(1.0)
    fresh = scraped("llamacpp", now, waiting=None, running=None, kv=None)  # a build that publishes little
    fresh.inflight = 4
    assert pool_saturation(pool(fresh), "m", 8, 0.9, now=now) == pytest.approx(0.5)


def test_pool_saturation_leaves_out_unmeasured_and_unavailable():
    now = 500.0
    opaque = scraped("openai", 0.0)
    opaque.inflight = 1000
    assert pool_saturation(pool(opaque), "m", 8, 0.9, now=now) == 0.0
    assert pool_capacity(pool(opaque), "m", 8, now=now) == 0
    down = scraped("vllm", now, waiting=100)
    busy_ok = scraped("vllm", now, waiting=4)
    s = pool(down, busy_ok)
    down.healthy = False
    assert pool_saturation(s, "m", 8, 0.9, now=now) == pytest.approx(0.5)
    busy_ok.healthy = False
    assert pool_saturation(s, "m", 8, 0.9, now=now) == 0.0  # nothing ready: the proxy answers
