"""The accountant: allow-lists, budgets, requests and tokens per minute, settlement, status, restore."""

from __future__ import annotations

import asyncio
import random
from datetime import UTC, datetime, timedelta

import pytest

from llmgw.config.loading import ConfigError
from llmgw.config.server import AuthConfig, ServerConfig
from llmgw.server.gateway.limits import (
    Accountant,
    LimitError,
    Pricing,
    describe,
    to_micros,
)
from llmgw.server.gateway.principal import Pool, Principal


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


class Wall:
    def __init__(self, at: datetime):
        self.at = at

    def __call__(self) -> datetime:
        return self.at


NOON = datetime(2026, 9, 15, 12, 0, tzinfo=UTC)


def principal(
    *pools: Pool,
    models: frozenset[str] | None = None,
    key: str = "k1",
    user: str | None = "u1",
    project: str | None = "p1",
) -> Principal:
    return Principal(
        key_id=key,
        key_prefix="llmgw-abc",
        project="Acme/x",
        project_id=project,
        user_id=user,
        pools=tuple(pools),
        models=models,
    )


def accountant(pricing: Pricing | None = None, t: float = 1000.0, at: datetime = NOON):
    clock, wall = Clock(t), Wall(at)
    return Accountant(pricing or Pricing({"big": (1.0, 2.0)}), clock=clock, wall=wall), clock, wall


# ------------------------------------------------------------------ allow-list


def test_model_outside_allow_list_is_refused_403():
    acc, _, _ = accountant()
    p = principal(models=frozenset({"b", "a"}))
    with pytest.raises(LimitError) as e:
        acc.check(p, "c", 10)
    assert e.value.status == 403 and e.value.code == "model_not_allowed"
    assert e.value.message == "this key may not use c; it may use: a, b"
    acc.check(p, "a", 10)


def test_empty_allow_list_allows_no_models_and_none_allows_all():
    acc, _, _ = accountant()
    with pytest.raises(LimitError) as e:
        acc.check(principal(models=frozenset()), "a", 1)
    assert e.value.message == "this key may not use a; it may use no models"
    acc.check(principal(models=None), "anything", 1)


# ----------------------------------------------------------------------- prices


def test_pricing_cost_and_priced():
    pr = Pricing({"big": (1.0, 2.0), "free": (0.0, 0.0)}, default=(0.5, 0.5))
    assert pr.cost_micros("big", 1000, 1000) == 3_000_000
    assert pr.cost_micros("big", 1, 0) == 1000
    assert pr.priced("big") and not pr.priced("free")  # priced at zero: not priced, despite the fallback
    assert pr.priced("other") and pr.cost_micros("other", 2000, 0) == 1_000_000  # the fallback prices it
    assert pr.anything_priced()
    none = Pricing({"free": (0, 0)})
    assert not none.priced("x") and not none.anything_priced() and none.cost_micros("x", 10**6, 10**6) == 0
    assert not Pricing({}, default=(0, 0)).priced("x")


def test_pricing_from_config_and_negative_refused_with_path():
    auth = AuthConfig.model_validate(
        {
            "pricing": {"llama": {"prompt_per_1k": 0.001, "completion_per_1k": 0.002}},
            "default_price": {"prompt_per_1k": 0.01, "completion_per_1k": 0.01},
            "default_rpm": 60,
            "default_tpm": 200000,
        }
    )
    pr = Pricing.from_config(auth)
    assert pr.price("llama") == (1000, 2000) and pr.price("x") == (10_000, 10_000)
    assert to_micros(10) == 10_000_000 and to_micros(0.0000015) == 2
    from llmgw.config.loading import validate

    with pytest.raises(ConfigError) as e:
        validate(ServerConfig, {"auth": {"pricing": {"llama": {"prompt_per_1k": -1}}}}, "server.yaml", "listen")
    assert "auth.pricing.llama.prompt_per_1k" in str(e.value)
    with pytest.raises(ConfigError) as e:
        validate(ServerConfig, {"auth": {"default_rpm": 0}}, "server.yaml", "listen")
    assert "auth.default_rpm" in str(e.value)


# ---------------------------------------------------------------------- budgets


def test_budget_refuses_once_spent_with_message_and_retry_after():
    acc, _, _ = accountant()
    pool = Pool("project:p1", budget_micros=to_micros(1.0), period="month")
    p = principal(pool)
    r = acc.check(p, "big", 10)
    assert acc.settle(r, 1000, 0) == 1_000_000  # reaches the budget exactly
    with pytest.raises(LimitError) as e:
        acc.check(p, "big", 10)
    err = e.value
    assert err.status == 429 and err.code == "budget_spent"
    assert err.message == (
        "the budget of project p1 is spent for this month (1.00 of 1.00); it resets at 2026-10-01 00:00 UTC"
    )
    assert err.retry_after == (datetime(2026, 10, 1, tzinfo=UTC) - NOON).total_seconds()
    assert err.headers["retry-after"] == str(int(err.retry_after))


def test_budget_below_is_served_and_crossing_request_is_served():
    """A budget stops spending once reached rather than refusing the request that would cross it."""
    acc, _, _ = accountant()
    p = principal(Pool("key:k1", budget_micros=to_micros(1.0)))
    r = acc.check(p, "big", 10)
    acc.settle(r, 999, 0)
    r = acc.check(p, "big", 10)  # 0.999 spent: still under, served although it will cross
    acc.settle(r, 5000, 0)
    assert acc.spent("key:k1") == 5_999_000
    with pytest.raises(LimitError):
        acc.check(p, "big", 10)


def test_budget_refusal_charges_nothing():
    acc, _, _ = accountant()
    p = principal(Pool("key:k1", rpm=5, tpm=1000), Pool("project:p1", budget_micros=0))
    with pytest.raises(LimitError) as e:
        acc.check(p, "big", 100)
    assert e.value.code == "budget_spent"
    assert acc.headers(p) == {
        "x-ratelimit-limit-requests": "5",
        "x-ratelimit-remaining-requests": "5",
        "x-ratelimit-reset-requests": "0s",
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "1000",
        "x-ratelimit-reset-tokens": "0s",
    }


def test_zero_priced_model_is_exempt_from_budgets():
    acc, _, _ = accountant(Pricing({"big": (1.0, 1.0), "free": (0.0, 0.0)}, default=(1.0, 1.0)))
    p = principal(Pool("project:p1", budget_micros=0))
    with pytest.raises(LimitError):
        acc.check(p, "big", 1)
    r = acc.check(p, "free", 1)
    assert acc.settle(r, 10_000, 10_000) == 0


def test_fallback_price_makes_budget_bind_on_any_model():
    p = principal(Pool("project:p1", budget_micros=to_micros(0.5)))
    acc, _, _ = accountant(Pricing({}))
    acc.settle(acc.check(p, "anything", 1), 10**6, 10**6)
    acc.check(p, "anything", 1)  # no price: costs nothing, never binds
    acc, _, _ = accountant(Pricing({}, default=(1.0, 1.0)))
    assert acc.settle(acc.check(p, "anything", 1), 500, 0) == 500_000
    with pytest.raises(LimitError) as e:
        acc.check(p, "anything", 1)
    assert "(0.50 of 0.50)" in e.value.message


def test_daily_budget_resets_at_utc_midnight_and_monthly_at_month_start():
    wall_at = datetime(2026, 9, 30, 23, 59, 30, tzinfo=UTC)
    acc, _, wall = accountant(at=wall_at)
    day = principal(Pool("key:k1", budget_micros=to_micros(1.0), period="day"))
    month = principal(Pool("project:p1", budget_micros=to_micros(1.0), period="month"), key="k2")
    acc.settle(acc.check(day, "big", 1), 1000, 0)
    acc.settle(acc.check(month, "big", 1), 1000, 0)
    with pytest.raises(LimitError) as e:
        acc.check(day, "big", 1)
    assert e.value.retry_after == 30.0 and "for this day" in e.value.message
    assert "resets at 2026-10-01 00:00 UTC" in e.value.message
    wall.at = datetime(2026, 10, 1, 0, 0, 0, tzinfo=UTC)
    acc.check(day, "big", 1)
    acc.check(month, "big", 1)  # September's spend does not count in October
    # Within a month, a new day resets the daily budget but not the monthly one.
    acc.settle(acc.check(day, "big", 1), 1000, 0)
    acc.settle(acc.check(month, "big", 1), 1000, 0)
    wall.at = datetime(2026, 10, 2, 0, 0, 1, tzinfo=UTC)
    acc.check(day, "big", 1)
    with pytest.raises(LimitError) as e:
        acc.check(month, "big", 1)
    assert e.value.retry_after == (datetime(2026, 11, 1, tzinfo=UTC) - wall.at).total_seconds()


def test_december_rolls_into_january():
    acc, _, _ = accountant(at=datetime(2026, 12, 31, 12, tzinfo=UTC))
    p = principal(Pool("org:o1", budget_micros=0, period="month"))
    with pytest.raises(LimitError) as e:
        acc.check(p, "big", 1)
    assert "resets at 2027-01-01 00:00 UTC" in e.value.message and "org o1" in e.value.message


def test_budget_overspend_bounded_by_requests_in_flight():
    acc, _, _ = accountant(Pricing({"big": (1.0, 0.0)}))
    budget = to_micros(10.0)
    p = principal(Pool("team:t1", budget_micros=budget))
    inflight = [acc.check(p, "big", 1) for _ in range(50)]  # all admitted: nothing spent yet
    costs = 0
    for r in inflight:
        costs += acc.settle(r, random.randint(0, 2000), 0)
    assert acc.spent("team:t1") == costs
    # Spent may exceed the budget, but by no more than what was in flight when it was reached.
    assert acc.spent("team:t1") <= budget + costs
    if costs >= budget:
        with pytest.raises(LimitError):
            acc.check(p, "big", 1)
    # Once reached, nothing more is admitted, so the overspend cannot grow.
    acc2, _, _ = accountant(Pricing({"big": (1.0, 0.0)}))
    admitted, settled = [], 0
    for _ in range(200):
        try:
            admitted.append(acc2.check(p, "big", 1))
        except LimitError:
            break
        if len(admitted) % 3 == 0:  # some settle while others are in flight
            settled += acc2.settle(admitted[-3], 1000, 0)
    in_flight = [r for r in admitted if not r.done]
    for r in in_flight:
        settled += acc2.settle(r, 1000, 0)
    assert acc2.spent("team:t1") == settled
    assert settled <= budget + len(in_flight) * 1_000_000


def test_budget_holds_the_estimated_cost_of_requests_in_progress():
    acc, _, _ = accountant()  # big: 1.0 prompt, 2.0 completion per 1k tokens
    p = principal(Pool("key:k1", rpm=100), Pool("project:p1", budget_micros=to_micros(1.0), period="day"))
    r1 = acc.check(p, "big", 100, 200)  # holds 0.10 + 0.40
    assert (r1.held_micros, acc.held("project:p1"), acc.held("key:k1")) == (500_000, 500_000, 0)
    r2 = acc.check(p, "big", 100, 200)  # 0.50 held, under the budget: admitted, and may cross it
    assert acc.held("project:p1") == 1_000_000
    with pytest.raises(LimitError) as e:
        acc.check(p, "big", 1)
    err = e.value
    assert err.status == 429 and err.code == "budget_held" and err.retry_after == 1.0
    assert err.message == (
        "the budget of project p1 for this day is taken up by requests in progress "
        "(0.00 spent and up to 1.00 held of 1.00); retry in 1 s, when some have finished"
    )
    assert err.headers["retry-after"] == "1" and err.headers["x-ratelimit-remaining-requests"] == "98"
    assert acc.held("project:p1") == 1_000_000  # the refusal held nothing
    assert acc.settle(r1, 50, 50) == 150_000  # the hold gives way to the real cost
    assert (acc.spent("project:p1", "day"), acc.held("project:p1")) == (150_000, 500_000)
    r3 = acc.check(p, "big", 10)
    acc.cancel(r2)  # never reached an engine: its hold is released, nothing spent
    assert acc.held("project:p1") == 10_000 and acc.spent("project:p1", "day") == 150_000
    acc.settle(r3, 10, 0)
    assert acc.held("project:p1") == 0 and acc.counts()["spend"] == 2
    acc.settle(r3, 10, 0)  # twice: nothing more
    assert acc.held("project:p1") == 0 and acc.spent("project:p1", "day") == 160_000


def test_a_burst_overspends_a_budget_by_at_most_one_estimate():
    acc, _, _ = accountant()
    budget = to_micros(1.0)
    p = principal(Pool("team:t1", budget_micros=budget), Pool("key:k1", budget_micros=to_micros(100)))
    admitted = []
    for _ in range(500):  # all at once: nothing settles in between
        try:
            admitted.append(acc.check(p, "big", 30, 100))  # 0.03 + 0.2 held each
        except LimitError as e:
            assert e.code == "budget_held"
    assert len(admitted) == 5  # 0, 0.23, 0.46, 0.69, 0.92 held before each: under 1.0
    for r in admitted:
        acc.settle(r, 30, 100)  # each used all it could
    assert budget < acc.spent("team:t1") == 5 * 230_000 <= budget + 230_000
    assert acc.held("team:t1") == acc.held("key:k1") == 0
    with pytest.raises(LimitError) as e:
        acc.check(p, "big", 1)
    assert e.value.code == "budget_spent"


def test_a_rate_refusal_or_a_free_model_holds_nothing():
    acc, _, _ = accountant(Pricing({"big": (1.0, 1.0), "free": (0.0, 0.0)}))
    p = principal(Pool("key:k1", rpm=1, budget_micros=to_micros(10)))
    acc.check(p, "big", 100)
    with pytest.raises(LimitError) as e:
        acc.check(p, "big", 100)
    assert e.value.code == "rate_limited" and acc.held("key:k1") == 100_000
    q = principal(Pool("key:k2", budget_micros=to_micros(10)), key="k2")
    r = acc.check(q, "free", 10**6)
    assert r.held_micros == 0 and acc.held("key:k2") == 0


def test_concurrent_settle_sums_equal_recorded_costs():
    acc, _, _ = accountant(Pricing({"big": (0.3, 0.7)}))
    shared = Pool("project:p1", budget_micros=to_micros(1e6))
    principals = [
        principal(Pool(f"key:k{i}", budget_micros=to_micros(1e6)), shared, key=f"k{i}", user=f"u{i % 3}")
        for i in range(5)
    ]
    recorded: dict[str, int] = {}

    async def one(p: Principal) -> None:
        r = acc.check(p, "big", 50)
        await asyncio.sleep(random.random() / 1000)  # random interleaving is the point of the test
        cost = acc.settle(r, random.randint(0, 3000), random.randint(0, 3000))
        for pool in p.pools:
            recorded[pool.key] = recorded.get(pool.key, 0) + cost

    async def main() -> None:
        await asyncio.gather(*(one(random.choice(principals)) for _ in range(400)))

    asyncio.run(main())
    for key, total in recorded.items():
        assert acc.spent(key) == total, key
    assert acc.spent("project:p1") == sum(v for k, v in recorded.items() if k.startswith("key:"))


# ------------------------------------------------------------------- rate pools


def test_exactly_100_of_500_admitted_at_one_instant():
    acc, _clock, _ = accountant()
    p = principal(Pool("key:k1", rpm=100))
    ok = 0
    for _ in range(500):
        try:
            acc.check(p, "m", 1)
            ok += 1
        except LimitError as e:
            assert e.code == "rate_limited" and e.status == 429
    assert ok == 100


def test_exactly_100_of_500_with_gather():
    acc, _clock, _ = accountant()
    p = principal(Pool("key:k1", rpm=100), Pool("project:p1", rpm=1000))

    async def one() -> bool:
        await asyncio.sleep(0)  # a yield, so the 500 checks interleave
        try:
            acc.check(p, "m", 1)
            return True
        except LimitError:
            return False

    async def main() -> list[bool]:
        return await asyncio.gather(*(one() for _ in range(500)))

    results = asyncio.run(main())
    assert sum(results) == 100
    # The project pool was refunded on every refusal by the key pool.
    assert acc.status(p).requests_remaining == 0
    assert acc.headers(principal(Pool("project:p1", rpm=1000), key="k9"))["x-ratelimit-remaining-requests"] == "900"


def test_a_minute_later_admits_again_and_retry_after():
    # A sliding window of one-second slots: at most 60 in the last 60 seconds; a place
    # frees when the second its request was counted in is a minute old.
    acc, clock, _ = accountant()  # t = 1000.0
    p = principal(Pool("key:k1", rpm=60))
    acc.check(p, "m", 1)
    clock.t += 1.5
    for _ in range(59):
        acc.check(p, "m", 1)
    with pytest.raises(LimitError) as e:
        acc.check(p, "m", 1)
    assert e.value.retry_after == pytest.approx(58.5)  # the first request's second (1000) leaves at 1060
    assert e.value.headers["retry-after"] == "59"
    assert e.value.message == "the request rate of key k1 is at its limit of 60 a minute; retry in 59 s"
    clock.t = 1060.0
    acc.check(p, "m", 1)  # the first one left: exactly one place
    with pytest.raises(LimitError) as e:
        acc.check(p, "m", 1)
    assert e.value.retry_after == pytest.approx(1.0)  # the 59 of second 1001 leave at 1061
    clock.t += 60
    for _ in range(60):
        acc.check(p, "m", 1)
    with pytest.raises(LimitError):
        acc.check(p, "m", 1)


def test_a_minute_later_admits_exactly_the_limit_again():
    acc, clock, _ = accountant()
    p = principal(Pool("key:k1", rpm=100))
    assert sum(_try(acc, p) for _ in range(500)) == 100
    clock.t += 60
    assert sum(_try(acc, p) for _ in range(500)) == 100


def _try(acc: Accountant, p: Principal, model: str = "m", est: int = 1) -> bool:
    try:
        acc.check(p, model, est)
        return True
    except LimitError:
        return False


def test_later_rpm_refusal_refunds_earlier_pools():
    acc, _, _ = accountant()
    team_full = principal(Pool("team:t1", rpm=1), key="k0")
    acc.check(team_full, "m", 1)
    p = principal(Pool("key:k1", rpm=10), Pool("project:p1", rpm=10), Pool("team:t1", rpm=1))
    with pytest.raises(LimitError) as e:
        acc.check(p, "m", 1)
    assert "team t1" in e.value.message
    st = acc.status(principal(Pool("key:k1", rpm=10), Pool("project:p1", rpm=10), key="kx"))
    assert st.requests_remaining == 10  # the key's and project's charges were refunded
    # The refusal's headers describe the fullest pool after the refund: the team's.
    assert e.value.headers["x-ratelimit-limit-requests"] == "1"
    assert e.value.headers["x-ratelimit-remaining-requests"] == "0"


def test_later_tpm_refusal_refunds_requests_and_earlier_tokens():
    acc, _, _ = accountant()
    p = principal(Pool("key:k1", rpm=10, tpm=10_000), Pool("project:p1", rpm=10, tpm=1000))
    acc.check(p, "m", 900)
    with pytest.raises(LimitError) as e:
        acc.check(p, "m", 200)
    err = e.value
    assert err.code == "tokens_limited" and err.status == 429
    assert err.message == (
        "the token rate of project p1 is at its limit of 1000 a minute (this request needs about 200); retry in 60 s"
    )
    assert err.retry_after == pytest.approx(60.0)  # when the 900 leave the window
    key_only = principal(Pool("key:k1", rpm=10, tpm=10_000), key="kx")
    assert acc.headers(key_only) == {
        "x-ratelimit-limit-requests": "10",
        "x-ratelimit-remaining-requests": "9",
        "x-ratelimit-reset-requests": "1m0s",
        "x-ratelimit-limit-tokens": "10000",
        "x-ratelimit-remaining-tokens": "9100",
        "x-ratelimit-reset-tokens": "1m0s",
    }
    assert err.headers["x-ratelimit-remaining-tokens"] == "100"
    assert err.headers["x-ratelimit-limit-tokens"] == "1000"


def test_token_estimate_settled_both_ways():
    acc, _, _ = accountant()
    p = principal(Pool("key:k1", tpm=1000))
    r = acc.check(p, "m", 300)
    assert acc.status(p).tokens_remaining == 700
    acc.settle(r, 100, 400)  # 500 actual: 200 more
    assert acc.status(p).tokens_remaining == 500
    r = acc.check(p, "m", 300)
    acc.settle(r, 50, 50)  # 100 actual: 200 refunded
    assert acc.status(p).tokens_remaining == 400
    r = acc.check(p, "m", 100)
    acc.settle(r, 2000, 0)  # far more than estimated: the pool goes into debt
    assert acc.status(p).tokens_remaining == 0
    with pytest.raises(LimitError):
        acc.check(p, "m", 0)
    assert acc.settle(r, 1, 1) == 0  # a second settlement does nothing


def test_estimate_bigger_than_the_limit_goes_when_full():
    acc, clock, _ = accountant()
    p = principal(Pool("key:k1", tpm=1000))
    acc.check(p, "m", 5000)
    with pytest.raises(LimitError) as e:
        acc.check(p, "m", 5000)
    assert e.value.retry_after == pytest.approx(60.0)  # until the big one leaves the window
    clock.t += 60
    acc.check(p, "m", 5000)


def test_cancel_refunds_request_and_tokens():
    acc, _, _ = accountant()
    p = principal(Pool("key:k1", rpm=2, tpm=1000))
    r = acc.check(p, "m", 400)
    acc.check(p, "m", 400)
    with pytest.raises(LimitError):
        acc.check(p, "m", 1)
    acc.cancel(r)
    assert acc.headers(p)["x-ratelimit-remaining-requests"] == "1"
    assert acc.headers(p)["x-ratelimit-remaining-tokens"] == "600"
    acc.check(p, "m", 1)
    acc.cancel(r)  # twice: nothing more
    assert acc.headers(p)["x-ratelimit-remaining-requests"] == "0"


def test_pools_are_shared_by_pool_key_and_strictest_wins():
    acc, _, _ = accountant()
    a = principal(Pool("key:a", rpm=100), Pool("project:p1", rpm=3), key="a")
    b = principal(Pool("key:b", rpm=100), Pool("project:p1", rpm=3), key="b")
    assert [_try(acc, x) for x in (a, b, a, b)] == [True, True, True, False]
    c = principal(Pool("key:c", rpm=100), Pool("project:p2", rpm=3), key="c")
    assert _try(acc, c)


def test_default_pool_is_the_keys_own():
    acc, _, _ = accountant()
    a = principal(Pool("default:a", rpm=1), key="a")
    b = principal(Pool("default:b", rpm=1), key="b")
    assert _try(acc, a) and _try(acc, b) and not _try(acc, a)
    with pytest.raises(LimitError) as e:
        acc.check(a, "m", 1)
    assert "key a (cluster default)" in e.value.message


def test_member_pool_description():
    assert describe("project-member:p1:u2") == "project p1 for member u2"
    assert describe("user:u1") == "user u1"


# ------------------------------------------------------------------ status


def test_headers_describe_the_fullest_pool_and_omit_unlimited_kinds():
    acc, _, _ = accountant()
    p = principal(Pool("key:k1", rpm=100), Pool("project:p1", rpm=10), Pool("org:o1", rpm=1000))
    for _ in range(5):
        acc.check(p, "m", 1)
    assert acc.headers(p) == {
        "x-ratelimit-limit-requests": "10",
        "x-ratelimit-remaining-requests": "5",
        "x-ratelimit-reset-requests": "1m0s",
    }
    assert acc.headers(principal()) == {}
    st = acc.status(p)
    assert st.requests_pool == "project:p1" and st.tokens_limit is None


def test_status_reports_the_most_spent_budget():
    acc, _, _ = accountant()
    p = principal(
        Pool("key:k1", budget_micros=to_micros(100)), Pool("project:p1", budget_micros=to_micros(2), period="day")
    )
    acc.settle(acc.check(p, "big", 1), 1000, 0)
    st = acc.status(p)
    assert (st.budget_pool, st.spent_micros, st.budget_micros, st.period) == ("project:p1", 1_000_000, 2_000_000, "day")
    assert st.resets_at == datetime(2026, 9, 16, tzinfo=UTC)


# ------------------------------------------------------------------ restore


def test_restore_folds_rows_into_every_pool_for_month_and_day():
    acc, _, _ = accountant()
    today = NOON - timedelta(hours=2)
    earlier = datetime(2026, 9, 2, tzinfo=UTC)
    last_month = datetime(2026, 8, 31, 23, 59, tzinfo=UTC)
    acc.restore(
        [
            ("k1", "u1", "p1", "t1", "o1", 100, today),
            ("k1", "u1", "p1", "t1", "o1", 1000, earlier),
            ("k2", None, "p1", "t1", "o1", 10_000, today.replace(tzinfo=None)),  # naive: read as UTC
            ("k3", "u1", None, None, None, 7, earlier),  # a personal key
            ("k1", "u1", "p1", "t1", "o1", 99_999_999, last_month),
        ]
    )
    assert acc.spent("key:k1") == 1100 and acc.spent("key:k1", "day") == 100
    assert acc.spent("user:u1") == 1107 and acc.spent("user:u1", "day") == 100
    assert acc.spent("project:p1") == 11_100 and acc.spent("project:p1", "day") == 10_100
    assert acc.spent("team:t1") == 11_100 and acc.spent("org:o1") == 11_100
    for member in ("project-member:p1:u1", "team-member:t1:u1", "org-member:o1:u1"):
        assert acc.spent(member) == 1100 and acc.spent(member, "day") == 100
    assert acc.spent("key:k2") == 10_000 and acc.spent("key:k3", "day") == 0
    # The restored spend binds.
    p = principal(Pool("project-member:p1:u1", budget_micros=1100))
    with pytest.raises(LimitError) as e:
        acc.check(p, "big", 1)
    assert "project p1 for member u1" in e.value.message
    acc.check(principal(Pool("project-member:p1:u1", budget_micros=1100, period="day")), "big", 1)


# ------------------------------------------------------------------ memory


def test_idle_windows_are_dropped():
    acc, clock, _ = accountant()
    for i in range(1000):
        acc.check(principal(Pool(f"key:k{i}", rpm=10, tpm=1000), key=f"k{i}"), "m", 10)
    assert acc.counts()["rpm"] == 1000
    clock.t += 61
    acc.check(principal(Pool("key:x", rpm=10), key="x"), "m", 1)
    assert acc.counts()["rpm"] <= 1 and acc.counts()["tpm"] == 0


def test_reset_headers_say_when_the_fullest_pool_is_full_again():
    acc, clock, _ = accountant(t=1000.25)
    p = principal(Pool("key:k1", rpm=10, tpm=1000), Pool("project:p1", rpm=100))
    acc.check(p, "m", 100)
    h = acc.headers(p)
    # Charged in second 1000: it leaves the window at 1060, 59.75 s from now.
    assert (h["x-ratelimit-reset-requests"], h["x-ratelimit-reset-tokens"]) == ("59.75s", "59.75s")
    clock.t = 1030.0
    acc.check(p, "m", 0)  # a request counts, no tokens
    h = acc.headers(p)
    assert (h["x-ratelimit-reset-requests"], h["x-ratelimit-reset-tokens"]) == ("1m0s", "30s")
    clock.t = 1059.999
    assert acc.headers(p)["x-ratelimit-reset-tokens"] == "1ms"
    clock.t = 1060.0
    h = acc.headers(p)
    assert (h["x-ratelimit-remaining-tokens"], h["x-ratelimit-reset-tokens"]) == ("1000", "0s")
    assert acc.status(p).requests_reset == pytest.approx(30.0)


def test_status_and_headers_agree():
    acc, clock, _ = accountant()
    p = principal(Pool("key:k1", rpm=5, tpm=900), Pool("project:p1", rpm=7, tpm=1000), Pool("org:o1", tpm=300))
    for est in (100, 50, 100, 10):
        acc.check(p, "m", est)
        assert acc.status(p).headers() == acc.headers(p)
        clock.t += 0.7
    assert acc.headers(p)["x-ratelimit-limit-tokens"] == "300"


# ------------------------------------------------------- requests that call no model


def test_a_request_without_a_model_counts_one_request_on_every_rate_pool_and_no_tokens():
    acc, _, _ = accountant()
    p = principal(Pool("key:k1", rpm=2, tpm=100), Pool("project:p1", rpm=5, tpm=100))
    acc.settle(acc.check(p, None, 10_000), 0, 0)
    acc.settle(acc.check(p, None, 10_000), 0, 0)
    assert acc.status(p).requests_remaining == 0  # the key's 2 a minute, both taken
    assert acc.status(p).tokens_remaining == 100  # the estimate given counts for nothing
    with pytest.raises(LimitError) as e:
        acc.check(p, None, 0)
    assert e.value.status == 429 and e.value.code == "rate_limited"
    assert e.value.headers["retry-after"] == "60"
    assert e.value.headers["x-ratelimit-remaining-requests"] == "0"
    # The key's refusal gave back what the project's pool was charged before it.
    assert acc.status(principal(Pool("project:p1", rpm=5))).requests_remaining == 3


def test_a_request_without_a_model_ignores_the_allow_list_and_a_spent_token_pool():
    acc, _, _ = accountant()
    p = principal(Pool("key:k1", rpm=10, tpm=5), models=frozenset())
    r = acc.check(principal(Pool("key:k1", rpm=10, tpm=5)), "big", 5)
    acc.settle(r, 50, 0)  # the minute's tokens overspent by a reply longer than its estimate
    res = acc.check(p, None, 0)
    assert res.model is None and res.tpm_taken == [] and res.held_micros == 0


def test_a_request_without_a_model_is_refused_while_a_budget_is_spent_even_with_nothing_priced():
    acc, _, _ = accountant(Pricing())
    p = principal(Pool("project:p1", budget_micros=0))
    with pytest.raises(LimitError) as e:
        acc.check(p, None, 0)
    assert e.value.code == "budget_spent"


def test_a_request_without_a_model_is_refused_while_requests_in_progress_hold_the_budget_and_holds_nothing():
    acc, _, _ = accountant()
    p = principal(Pool("project:p1", budget_micros=to_micros(1.0)))
    pending = acc.check(p, "big", 1000)  # holds 1.00: the whole budget
    with pytest.raises(LimitError) as e:
        acc.check(p, None, 0)
    assert e.value.code == "budget_held"
    acc.settle(pending, 100, 0)  # spent 0.10
    free = acc.check(p, None, 0)
    assert acc.held("project:p1") == 0
    assert acc.settle(free, 0, 0) == 0
    assert acc.spent("project:p1") == 100_000  # the model-less request cost nothing


async def test_admit_with_no_model_is_check_with_no_model():
    acc, _, _ = accountant()
    p = principal(Pool("key:k1", rpm=1))
    await acc.admit(p, None, 0)
    with pytest.raises(LimitError):
        await acc.admit(p, None, 0)
