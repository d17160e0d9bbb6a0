"""Limiting sign-in attempts: at most ``per_account`` attempts on one account and
``per_address`` from one address (an IPv6 /64 counts as one) within a sliding window.

An attempt is counted in the store before its password is checked (Store.count_attempt,
atomic per account and address), so every worker and every gateway on one store shares
the count, and attempts sent together are counted one after another: a burst gets no
more password checks than the same attempts sent one at a time.

A right password withdraws its own attempt (from the account and the address alike), so
signing in costs its owner nothing; the wrong ones before it stay counted until they leave
the window. Hence, whatever arrives together and in whatever order, an account never has
more wrong passwords checked within one window than ``per_account``. An attempt naming no
account (a sign-up) counts against its address alone, and is never withdrawn.

When the store cannot be reached nothing is counted, so nothing is checked: the caller
gets SigninUnavailable and refuses the attempt.
"""

from __future__ import annotations

import ipaddress
import logging

from sqlalchemy.exc import SQLAlchemyError

from llmgw.server.pages import PageError
from llmgw.store import AttemptLimit, CountedAttempt, Store

log = logging.getLogger(__name__)

PER_ACCOUNT = 5
PER_ADDRESS = 20
WINDOW_S = 300.0

UNAVAILABLE = (
    "Signing in is not possible right now: the account store cannot be reached, so no password was checked. "
    "Try again in a minute."
)


class SigninUnavailable(PageError):
    """The store could not count the attempt (or take a right one back): refuse it, check nothing."""


def address_group(address: str) -> str:
    """What an attempt from ``address`` counts against: the address itself, or its IPv6 /64."""
    # One IPv6 host usually holds a whole /64: counting each address alone would give it
    # billions of fresh counters.
    try:
        ip = ipaddress.ip_address(address.strip())
    except ValueError:
        return address
    if ip.version == 6:
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


def account_key(email: str) -> str:
    """What an attempt on ``email`` counts against, whatever its spelling ("" for no account)."""
    account = email.strip().lower()
    return f"account:{account}" if account else ""


class SigninLimiter:
    """attempt() before checking a password (it refuses with the wait, or counts); right()
    after a right one."""

    def __init__(
        self,
        store: Store,
        per_account: int = PER_ACCOUNT,
        per_address: int = PER_ADDRESS,
        window_s: float = WINDOW_S,
    ) -> None:
        if per_account < 1 or per_address < 1 or window_s <= 0:
            raise ValueError("sign-in limits and their window must be above zero")
        self.store = store
        self.per_account, self.per_address, self.window_s = per_account, per_address, window_s

    def limits(self, email: str, address: str) -> list[AttemptLimit]:
        out = [AttemptLimit("address:" + address_group(address), self.per_address)]
        account = account_key(email)
        if account:
            out.append(AttemptLimit(account, self.per_account))
        return out

    async def attempt(self, email: str, address: str) -> CountedAttempt:
        """Count an attempt on ``email`` from ``address`` now, or refuse it with the seconds to
        wait. Raises SigninUnavailable when the store cannot count it."""
        try:
            return await self.store.count_attempt(self.limits(email, address), self.window_s)
        except (SQLAlchemyError, OSError) as exc:
            log.warning("could not count a sign-in attempt, so it was refused: %s", exc)
            raise SigninUnavailable(UNAVAILABLE) from exc

    async def right(self, counted: CountedAttempt) -> None:
        """The attempt's password was right: it no longer counts against anything."""
        if counted.attempt is None:
            return
        try:
            await self.store.withdraw_attempt(counted.attempt)
        except (SQLAlchemyError, OSError) as exc:
            log.warning("could not take back a right sign-in attempt: %s", exc)
            raise SigninUnavailable(UNAVAILABLE) from exc


def wait_text(wait_s: float) -> str:
    """The seconds a refused attempt is told to wait (and its Retry-After): whole, never 0."""
    return str(int(wait_s) + 1)
