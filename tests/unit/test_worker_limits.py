"""Workers ask the server process's accountant (gateway/worker_limits.py): over a real socket
pair, several workers' accountants admit exactly what one accountant alone would."""

from __future__ import annotations

import asyncio
import socket

import pytest

from llmgw.server.gateway.limits import MICROS, Accountant, LimitError, Pricing
from llmgw.server.gateway.principal import Pool, Principal
from llmgw.server.gateway.worker_limits import MAX_MESSAGE, AccountantLink, WorkerAccountant, serve_accountant
from llmgw.testing.waiting import async_until

PRICING = Pricing({"m": (1.0, 1.0)})  # 1.00 per 1,000 tokens either way


def _principal(*pools: Pool, models: frozenset[str] | None = None, key: str = "k1") -> Principal:
    return Principal(key_id=key, key_prefix="sk-x", project=None, pools=pools, models=models)


async def _workers(acc: Accountant, n: int) -> tuple[list[WorkerAccountant], list[AccountantLink]]:
    workers, links = [], []
    for i in range(n):
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        links.append(await serve_accountant(acc, a, i + 1))
        workers.append(await WorkerAccountant.connect(PRICING, b))
    return workers, links


async def _admit_all(workers: list[WorkerAccountant], principal: Principal, n: int, prompt: int, completion: int):
    async def one(i: int):
        try:
            return await workers[i % len(workers)].admit(principal, "m", prompt, completion)
        except LimitError as exc:
            return exc

    return await asyncio.gather(*(one(i) for i in range(n)))


@pytest.mark.parametrize("n_workers", [1, 2, 4])
async def test_requests_per_minute_are_admitted_exactly_across_workers_as_by_one_accountant(n_workers):
    acc = Accountant(PRICING)
    workers, _ = await _workers(acc, n_workers)
    principal = _principal(Pool("key:k1", rpm=100))
    out = await _admit_all(workers, principal, 500, 10, 10)
    admitted = [r for r in out if not isinstance(r, LimitError)]
    refused = [r for r in out if isinstance(r, LimitError)]
    assert len(admitted) == 100
    assert {r.status for r in refused} == {429} and {r.code for r in refused} == {"rate_limited"}
    assert all("retry-after" in r.headers for r in refused)
    for w in workers:
        await w.aclose()


@pytest.mark.parametrize("n_workers", [2, 4])
async def test_a_burst_at_a_budget_across_workers_overspends_by_at_most_one_estimate(n_workers):
    acc = Accountant(PRICING)
    workers, links = await _workers(acc, n_workers)
    # 1.00 a month; each request is estimated at 100 tokens (0.10) and really uses 100.
    principal = _principal(Pool("key:k1", budget_micros=1 * MICROS))
    spent = 0
    for _ in range(3):  # bursts until the budget refuses everything
        out = await _admit_all(workers, principal, 200, 50, 50)
        for i, r in enumerate(out):
            if not isinstance(r, LimitError):
                spent += workers[i % n_workers].settle(r, 50, 50)
        await async_until(lambda: sum(link.in_progress for link in links) == 0, 5, "every settlement to arrive")
    assert acc.spent("key:k1") == spent
    assert MICROS <= spent <= MICROS + 100_000  # the budget plus one request's estimate
    for w in workers:
        await w.aclose()


async def test_a_refusal_from_the_server_reaches_the_worker_whole_and_charges_nothing():
    acc = Accountant(PRICING)
    (w,), (link,) = await _workers(acc, 1)
    principal = _principal(Pool("project:p1", tpm=100))
    first = await w.admit(principal, "m", 40, 40)
    assert w.headers(principal)["x-ratelimit-remaining-tokens"] == "20"
    with pytest.raises(LimitError) as e:
        await w.admit(principal, "m", 20, 20)
    assert e.value.status == 429 and e.value.code == "tokens_limited"
    assert "project p1" in e.value.message and e.value.retry_after is not None
    assert e.value.headers["x-ratelimit-limit-tokens"] == "100"
    assert e.value.headers["x-ratelimit-remaining-tokens"] == "20"
    w.cancel(first)
    await async_until(lambda: link.in_progress == 0, 5, "the cancellation to arrive")
    assert acc.status(principal).tokens_remaining == 100
    await w.aclose()


async def test_the_allow_list_is_checked_by_the_worker_without_asking():
    acc = Accountant(PRICING)
    (w,), _ = await _workers(acc, 1)
    with pytest.raises(LimitError) as e:
        await w.admit(_principal(Pool("key:k1", rpm=5), models=frozenset({"other"})), "m", 1, 1)
    assert e.value.status == 403 and e.value.code == "model_not_allowed"
    assert acc.counts()["rpm"] == 0
    await w.aclose()


async def test_settling_prices_the_real_tokens_in_both_processes_alike():
    acc = Accountant(PRICING)
    (w,), (link,) = await _workers(acc, 1)
    principal = _principal(Pool("key:k1", budget_micros=10 * MICROS, tpm=10_000))
    res = await w.admit(principal, "m", 100, 400)
    assert acc.held("key:k1") == 500_000
    cost = w.settle(res, 120, 30)
    assert cost == 150_000
    assert w.settle(res, 120, 30) == 0  # a second settlement does nothing
    await async_until(lambda: link.in_progress == 0, 5, "the settlement to arrive")
    assert acc.spent("key:k1") == cost and acc.held("key:k1") == 0
    assert acc.status(principal).tokens_remaining == 10_000 - 150
    await w.aclose()


async def test_a_worker_that_goes_away_has_what_it_held_charged_as_estimated():
    acc = Accountant(PRICING)
    (w,), (link,) = await _workers(acc, 1)
    principal = _principal(Pool("key:k1", budget_micros=10 * MICROS))
    await w.admit(principal, "m", 100, 100)
    await w.admit(principal, "m", 100, 100)
    assert acc.held("key:k1") == 400_000
    await w.aclose()
    await async_until(lambda: link.closed.done(), 5, "the server to see the worker gone")
    assert acc.held("key:k1") == 0 and acc.spent("key:k1") == 400_000


async def test_a_worker_whose_server_is_gone_refuses_with_a_503_instead_of_waiting():
    acc = Accountant(PRICING)
    (w,), (link,) = await _workers(acc, 1)
    principal = _principal(Pool("key:k1", rpm=5))
    link.close()
    await async_until(lambda: w.closed.done(), 5, "the worker to see the server gone")
    with pytest.raises(LimitError) as e:
        await w.admit(principal, "m", 1, 1)
    assert e.value.status == 503


async def test_a_message_larger_than_the_bound_closes_the_channel_instead_of_buffering_it():
    acc = Accountant(PRICING)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    link = await serve_accountant(acc, a, 1)
    _reader, writer = await asyncio.open_unix_connection(sock=b)
    writer.write((MAX_MESSAGE + 1).to_bytes(4, "big") + b"[")
    await writer.drain()
    await async_until(lambda: link.closed.done(), 5, "the channel to close")
    writer.close()


async def test_pools_travel_once_per_principal_and_new_limits_travel_as_new_pools():
    acc = Accountant(PRICING)
    (w,), _ = await _workers(acc, 1)
    p1 = _principal(Pool("key:k1", rpm=2))
    for _ in range(2):
        await w.admit(p1, "m", 1, 1)
    with pytest.raises(LimitError):
        await w.admit(p1, "m", 1, 1)
    # The limit raised (the key cache built new pools): the same counter, the new limit.
    p2 = _principal(Pool("key:k1", rpm=3))
    await w.admit(p2, "m", 1, 1)
    with pytest.raises(LimitError):
        await w.admit(p2, "m", 1, 1)
    assert len(w._ids) == 2
    await w.aclose()


async def test_a_request_that_calls_no_model_counts_one_request_through_the_worker_and_costs_nothing():
    acc = Accountant(PRICING)
    (w,), (link,) = await _workers(acc, 1)
    principal = _principal(Pool("key:k1", rpm=2, tpm=100), models=frozenset({"other"}))
    first = await w.admit(principal, None, 0)
    await w.admit(principal, None, 0)
    with pytest.raises(LimitError) as e:
        await w.admit(principal, None, 0)
    assert e.value.code == "rate_limited"
    assert w.settle(first, 0, 0) == 0
    await async_until(lambda: link.in_progress == 1, 5, "the settlement to arrive")
    assert acc.status(principal).tokens_remaining == 100
    await w.aclose()
