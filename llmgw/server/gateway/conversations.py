"""What the gateway keeps for agents: conversations (x-llmgw-thread, and the Responses API's
stored responses) and memory notes, each kept only for a project that turned it on.

A turn is read on the request path (its history must be sent), but written after the reply,
in the background: the client never waits for the store's write. The cost of that choice is
that a turn whose reply was sent may be lost if the process dies before its write lands (a
second or so); the client still has the reply. Turns of one conversation are written in the
order they ended, and a turn that follows reads only after the one before it is stored, so a
client that sends its next turn at once still sees its last one.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

from llmgw.config.server import ThreadsConfig
from llmgw.server.gateway.checks import check_id
from llmgw.server.gateway.principal import Principal
from llmgw.store.agents import Quota
from llmgw.store.errors import QuotaFull

log = logging.getLogger("llmgw.gateway.conversations")

THREAD_HEADER = "x-llmgw-thread"
NEW_THREAD = "new"  # the header's value that starts a conversation; the reply's header names it
SWEEP_INTERVAL = 3600.0  # what expired is removed hourly; reads already treat it as gone

Kind = Literal["threads", "memory"]

_WHAT = {"threads": "conversations", "memory": "agent notes"}
_COMMAND = {"threads": "llmgw keys threads", "memory": "llmgw keys memory"}


def new_thread_id() -> str:
    return "thr_" + secrets.token_hex(16)


@dataclass(frozen=True, slots=True)
class Scope:
    """Where a principal's conversations or notes live, and for how long."""

    project_id: str | None  # None: the shared pool of a gateway without authentication
    hours: int


@dataclass(frozen=True, slots=True)
class NotKept:
    """Why this principal has nowhere to keep it: refused with the reason, never pooled."""

    message: str
    code: str = "not_kept"


class Conversations:
    def __init__(
        self, store: Any, keys: Any, threads: ThreadsConfig, auth_enabled: bool, quota: Quota | None = None
    ) -> None:
        self.store = store
        self.keys = keys
        self.config = threads
        self.auth_enabled = auth_enabled
        # What each project may keep (agents.quota_*): every write of its threads, stored
        # responses and notes is counted and refused against it in the store's transaction.
        self.quota = quota
        self._pending: dict[str, asyncio.Future] = {}  # a conversation's last write not yet stored
        self._writes: set[asyncio.Future] = set()
        self._sweeper: asyncio.Task | None = None
        self.write_failures = 0

    # -- who keeps what ---------------------------------------------------------------

    def scope(self, principal: Principal, kind: Kind) -> Scope | NotKept:
        what = _WHAT[kind]
        if not self.auth_enabled:
            if self.config.store and self.config.retain_hours is not None:
                return Scope(None, self.config.retain_hours)
            return NotKept(
                f"this gateway keeps no {what}: without authentication, set threads.store and "
                "threads.retain_hours in server.yaml (one trusted machine only)"
            )
        if principal.project_id is None:
            return NotKept(
                f"{what} are kept per project, and this is a personal key, which belongs to none; use a key "
                "made in a project (llmgw keys create NAME --project P) whose project keeps them"
            )
        r = self.keys.retention(principal.project_id) if self.keys is not None else None
        hours = None if r is None else (r.threads_hours if kind == "threads" else r.memory_hours)
        if hours is None:
            return NotKept(
                f"the project {principal.project or principal.project_id} keeps no {what}; an administrator "
                f"turns them on with: {_COMMAND[kind]} --project {principal.project or 'PATH'} --retain-hours N"
            )
        return Scope(principal.project_id, hours)

    # -- conversations ----------------------------------------------------------------

    async def history(self, scope: Scope, thread_id: str) -> list[dict] | None:
        """A conversation's messages, after any write of its own still under way; None when the
        project has no such conversation (another project's reads exactly the same). An id
        that no conversation can have (a control character, too long) is BadInput."""
        check_id("thread", thread_id)
        await self._settled(thread_id)
        return await self.store.thread_messages(scope.project_id, thread_id, scope.hours)

    def remember(self, scope: Scope, thread_id: str, messages: list[dict], model: str) -> None:
        """Append a finished turn, after the reply, in this conversation's order."""
        self._behind(
            thread_id, lambda: self.store.append_thread(scope.project_id, thread_id, messages, model, self.quota)
        )

    async def full(self, scope: Scope, new_item: bool) -> QuotaFull | None:
        """Why a turn to be kept would be refused now (the project's quota is full), asked before the
        model is called so that the client hears it rather than a reply that is then not kept; the
        write itself is still counted exactly, in the store."""
        q = self.quota
        if q is None:
            return None
        items, size = await self.store.agent_storage_used(scope.project_id)
        where = f"project {scope.project_id}" if scope.project_id else "the shared pool"
        free = (
            "; delete what is no longer needed (DELETE /v1/memory/ID, DELETE /v1/threads/ID) or wait until older "
            "ones expire"
        )
        if new_item and items >= q.items:
            return QuotaFull(
                f"the storage quota of {where} is full: it keeps {items:,} of its {q.items:,} conversations, "
                f"stored responses and notes (agents.quota_items){free}",
                429,
                "storage_quota_items",
            )
        if size >= q.bytes:
            return QuotaFull(
                f"the storage quota of {where} is full: it keeps {size:,} of its {q.bytes:,} bytes "
                f"(agents.quota_bytes){free}",
                429,
                "storage_quota_bytes",
            )
        return None

    async def forget(self, scope: Scope, thread_id: str) -> bool:
        check_id("thread", thread_id)
        await self._settled(thread_id)
        return await self.store.delete_thread(scope.project_id, thread_id)

    async def response_history(self, scope: Scope, response_id: str) -> list[dict] | None:
        check_id("response", response_id, "previous_response_id")
        await self._settled(response_id)
        return await self.store.response_history(scope.project_id, response_id, scope.hours)

    def remember_response(self, scope: Scope, response_id: str, previous: str | None, messages: list[dict]) -> None:
        self._behind(
            response_id,
            lambda: self.store.store_response(scope.project_id, response_id, previous, messages, self.quota),
        )

    # -- the writes behind the replies -------------------------------------------------

    def _behind(self, name: str, write: Callable[[], Awaitable[None]]) -> None:
        before = self._pending.get(name)

        async def run() -> None:
            if before is not None:
                await asyncio.gather(before, return_exceptions=True)
            try:
                await write()
            except Exception as exc:
                self.write_failures += 1
                log.error("a conversation turn of %s could not be stored: %s", name, exc)

        task = asyncio.ensure_future(run())
        self._pending[name] = task
        self._writes.add(task)

        def done(t: asyncio.Future) -> None:
            self._writes.discard(t)
            if self._pending.get(name) is t:
                del self._pending[name]

        task.add_done_callback(done)

    async def _settled(self, name: str) -> None:
        pending = self._pending.get(name)
        if pending is not None:
            await asyncio.gather(asyncio.shield(pending), return_exceptions=True)

    async def settled(self) -> None:
        """Every write under way has landed (or failed and been logged)."""
        while self._writes:
            await asyncio.gather(*list(self._writes), return_exceptions=True)

    # -- the hourly sweep ---------------------------------------------------------------

    async def sweep(self) -> Any:
        pool = self.config.retain_hours if (not self.auth_enabled and self.config.store) else None
        swept = await self.store.sweep_agent_data(pool, pool)
        if swept.threads or swept.responses or swept.notes:
            log.info(
                "removed what expired: %d conversations, %d stored responses, %d notes",
                swept.threads,
                swept.responses,
                swept.notes,
            )
        return swept

    def start(self) -> None:
        self._sweeper = asyncio.create_task(self._sweep_hourly(), name="agent data sweep")

    async def _sweep_hourly(self) -> None:
        while True:
            try:
                await self.sweep()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("removing expired conversations and notes failed (will try in an hour): %s", exc)
            await asyncio.sleep(SWEEP_INTERVAL)

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
            self._sweeper = None
        await self.settled()
