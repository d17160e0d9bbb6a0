"""Sign-in attempt limiting: per account and per address, over a sliding window, with
bounded memory. The clock is injected, so time passes without waiting."""

from __future__ import annotations

import pytest

from llmgw.signin_limit import SigninLimiter


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_an_account_waits_after_five_wrong_passwords_until_the_oldest_leaves_the_window(clock):
    lim = SigninLimiter(per_account=5, per_address=20, window_s=300, clock=clock)
    for i in range(5):
        assert lim.check("ann@example.com", f"10.0.0.{i}") is None
        lim.failed("ann@example.com", f"10.0.0.{i}")
        clock.t += 10
    # From any address, in any spelling of the email.
    assert lim.check(" Ann@Example.com ", "192.0.2.9") == pytest.approx(300 - 50)
    assert lim.check("bob@example.com", "10.0.0.1") is None  # other accounts are not held
    clock.t = 1000.0 + 299.9
    assert lim.check("ann@example.com", "192.0.2.9") == pytest.approx(0.1)
    clock.t = 1000.0 + 300
    # The first failure left the window: four remain, one more attempt is allowed.
    assert lim.check("ann@example.com", "192.0.2.9") is None
    lim.failed("ann@example.com", "192.0.2.9")
    assert lim.check("ann@example.com", "192.0.2.9") == pytest.approx(10)


def test_a_right_password_clears_the_accounts_count_but_not_the_addresss(clock):
    lim = SigninLimiter(per_account=3, per_address=4, window_s=60, clock=clock)
    for _ in range(3):
        lim.failed("ann@example.com", "10.0.0.1")
    assert lim.check("ann@example.com", "10.0.0.2") is not None
    lim.succeeded("ann@example.com", "10.0.0.2")
    assert lim.check("ann@example.com", "10.0.0.2") is None
    # The address made three failures; one more reaches its limit of four.
    lim.failed("bob@example.com", "10.0.0.1")
    assert lim.check("carol@example.com", "10.0.0.1") == pytest.approx(60)
    assert lim.check("carol@example.com", "10.0.0.2") is None


def test_an_address_guessing_many_accounts_waits(clock):
    lim = SigninLimiter(per_account=5, per_address=20, window_s=300, clock=clock)
    for i in range(20):
        assert lim.check(f"user{i}@example.com", "203.0.113.7") is None
        lim.failed(f"user{i}@example.com", "203.0.113.7")
    assert lim.check("user99@example.com", "203.0.113.7") == pytest.approx(300)
    assert lim.check("user99@example.com", "203.0.113.8") is None


def test_addresses_in_one_ipv6_64_count_together(clock):
    lim = SigninLimiter(per_account=100, per_address=2, window_s=60, clock=clock)
    lim.failed("a@example.com", "2001:db8:1:2::1")
    lim.failed("b@example.com", "2001:db8:1:2:ffff::9")
    assert lim.check("c@example.com", "2001:db8:1:2::abcd") == pytest.approx(60)
    assert lim.check("c@example.com", "2001:db8:1:3::1") is None
    # Anything that is not an address (a proxy's odd value) is counted as given.
    lim.failed("a@example.com", "unknown")
    lim.failed("b@example.com", "unknown")
    assert lim.check("c@example.com", "unknown") == pytest.approx(60)


def test_memory_stays_bounded_dropping_stale_keys_and_the_idlest_past_the_cap(clock):
    lim = SigninLimiter(per_account=3, per_address=3, window_s=60, max_keys=10, clock=clock)
    for i in range(25):
        lim.failed(f"u{i}@example.com", f"10.0.1.{i}")
    assert lim.tracked() == (10, 10)
    # The most recent keys are the ones kept.
    lim.failed("u24@example.com", "10.0.1.24")
    lim.failed("u24@example.com", "10.0.1.24")
    assert lim.check("u24@example.com", "10.9.9.9") == pytest.approx(60)
    # Many failures on one key keep only as many times as its limit needs.
    for _ in range(1000):
        lim.failed("u24@example.com", "10.0.1.24")
    assert len(lim._accounts.times["u24@example.com"]) == 3
    # Once the window has passed, the next failure sweeps every stale key away.
    clock.t += 61
    lim.failed("new@example.com", "10.0.2.1")
    assert lim.tracked() == (1, 1)
    assert lim.check("u24@example.com", "10.0.1.24") is None


def test_attempts_naming_no_account_count_against_their_address_alone(clock):
    lim = SigninLimiter(per_account=2, per_address=3, window_s=60, clock=clock)
    for i in range(10):  # sign-ups from ten addresses: no shared "" account fills up
        lim.failed("", f"10.0.3.{i}")
        assert lim.check("", f"10.0.4.{i}") is None
    assert lim.tracked() == (0, 10)
    for _ in range(2):
        lim.failed("  ", "10.0.3.0")
    assert lim.check("", "10.0.3.0") == pytest.approx(60)


def test_limits_must_be_above_zero():
    for kwargs in ({"per_account": 0}, {"per_address": 0}, {"window_s": 0}, {"max_keys": 0}):
        with pytest.raises(ValueError, match="above zero"):
            SigninLimiter(**kwargs)
