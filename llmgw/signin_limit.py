"""Limiting sign-in attempts: too many wrong passwords for one account, or from one
address, within a sliding window make the next attempt wait.

In memory, per process: it slows guessing down, it is not a record. Memory is bounded:
each key keeps at most its limit's worth of failure times, keys whose failures have all
left the window are dropped, and past max_keys the key idle longest is forgotten.
"""

from __future__ import annotations

import ipaddress
import time
from collections import OrderedDict, deque
from collections.abc import Callable


def _address_key(address: str) -> str:
    # One IPv6 host usually holds a whole /64: counting each address alone would give it
    # billions of fresh counters.
    try:
        ip = ipaddress.ip_address(address.strip())
    except ValueError:
        return address
    if ip.version == 6:
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


class _Window:
    """Failure times per key, keeping the last `limit` of each (enough to decide)."""

    def __init__(self, limit: int, window_s: float, max_keys: int):
        self.limit, self.window_s, self.max_keys = limit, window_s, max_keys
        # Least recently failed first, so stale keys are found at the front.
        self.times: OrderedDict[str, deque[float]] = OrderedDict()

    def wait(self, key: str, now: float) -> float | None:
        ts = self.times.get(key)
        if ts is None or len(ts) < self.limit:
            return None
        # The limit is reached while the oldest of the last `limit` failures is in the window.
        left = ts[0] + self.window_s - now
        return left if left > 0 else None

    def fail(self, key: str, now: float) -> None:
        self._drop_stale(now)
        ts = self.times.pop(key, None)
        if ts is None:
            ts = deque(maxlen=self.limit)
            while len(self.times) >= self.max_keys:
                self.times.popitem(last=False)
        ts.append(now)
        self.times[key] = ts

    def clear(self, key: str) -> None:
        self.times.pop(key, None)

    def _drop_stale(self, now: float) -> None:
        # Ordered by last failure: the front is stale first, so this stops at the first live one.
        while self.times:
            key, ts = next(iter(self.times.items()))
            if ts[-1] > now - self.window_s:
                return
            del self.times[key]


class SigninLimiter:
    """check() before verifying a password; failed() after a wrong one; succeeded()
    after a right one (it clears the account's count, not the address's). An empty email
    counts against the address alone (an attempt that names no account, such as a
    sign-up), so one shared "" account cannot hold everyone back."""

    def __init__(
        self,
        per_account: int = 5,
        per_address: int = 20,
        window_s: float = 300,
        max_keys: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ):
        if per_account < 1 or per_address < 1 or window_s <= 0 or max_keys < 1:
            raise ValueError("sign-in limits, their window and max_keys must be above zero")
        self._clock = clock
        self._accounts = _Window(per_account, window_s, max_keys)
        self._addresses = _Window(per_address, window_s, max_keys)

    @staticmethod
    def _account(email: str) -> str:
        return email.strip().lower()

    def check(self, email: str, address: str) -> float | None:
        """Seconds to wait before this attempt may be made, or None when it may now."""
        now = self._clock()
        account = self._account(email)
        waits = [
            w
            for w in (
                self._accounts.wait(account, now) if account else None,
                self._addresses.wait(_address_key(address), now),
            )
            if w is not None
        ]
        return max(waits) if waits else None

    def failed(self, email: str, address: str) -> None:
        now = self._clock()
        account = self._account(email)
        if account:
            self._accounts.fail(account, now)
        self._addresses.fail(_address_key(address), now)

    def succeeded(self, email: str, address: str) -> None:
        # The address keeps its count: one right password must not buy a guesser a
        # fresh allowance for every other account.
        self._accounts.clear(self._account(email))

    def tracked(self) -> tuple[int, int]:
        """How many accounts and addresses have failures remembered (for tests, metrics)."""
        return len(self._accounts.times), len(self._addresses.times)
