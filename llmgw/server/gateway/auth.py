"""API keys resolved from memory; the store is polled in the background for changes."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Protocol

from llmgw.errors import LlmgwError
from llmgw.server.gateway.principal import ANONYMOUS, DEFAULT_BAND, Pool, Principal  # noqa: F401  (re-exported)

if TYPE_CHECKING:
    from llmgw.store.records import LimitRecord

log = logging.getLogger("llmgw.gateway.auth")

# The levels of a key's chain, in the order its pools are listed; "owner" levels exist
# only when the key has an owner (a person).
CHAIN = ("key", "project-member", "project", "team-member", "team", "org-member", "org", "user")


class KeySource(Protocol):
    async def keys_generation(self) -> int: ...
    async def active_keys(self) -> Sequence: ...
    async def revoked_key_hashes(self) -> Sequence[tuple[str, datetime]]: ...

    # Optional: tenancy_snapshot() -> llmgw.store.Tree (with people and limits). A source
    # without it gives principals with no tree, only the cluster defaults.


def _chain(key, tree) -> list[tuple[str, LimitRecord | None]]:
    """(pool key, limits row or None) for every level of the key's chain."""
    owner = getattr(key, "user_id", None)
    proj = tree.projects.get(getattr(key, "project_id", None)) if tree is not None else None
    levels: list[tuple[str, str, str]] = [("key", key.id, f"key:{key.id}")]
    if proj is not None:
        for scope, sid in (("project", proj.id), ("team", proj.team_id), ("org", proj.org_id)):
            if owner:
                levels.append((f"{scope}-member", sid, f"{scope}-member:{sid}:{owner}"))
            levels.append((scope, sid, f"{scope}:{sid}"))
    if owner:
        levels.append(("user", owner, f"user:{owner}"))
    lims = tree.limits if tree is not None else {}
    return [(pool_key, lims.get((scope, sid))) for scope, sid, pool_key in levels]


def build_principal(key, tree=None, default_rpm: int | None = None, default_tpm: int | None = None) -> Principal:
    """A key's principal: its band (the key's, else the nearest level's up the tree, else
    normal), a pool for every level that sets a rate or a budget, the cluster defaults
    as the key's own `default:` pool for each kind no level limits, and the models the
    intersection of every allow-list on the chain allows."""
    chain = _chain(key, tree)
    proj = tree.projects.get(getattr(key, "project_id", None)) if tree is not None else None
    pools: list[Pool] = []
    models: frozenset[str] | None = None
    for pool_key, lim in chain:
        if lim is None:
            continue
        if lim.rpm is not None or lim.tpm is not None or lim.budget_micros is not None:
            pools.append(Pool(pool_key, lim.rpm, lim.tpm, lim.budget_micros, lim.period))
        if lim.models is not None:
            allowed = frozenset(lim.models)
            models = allowed if models is None else models & allowed
    default = Pool(
        f"default:{key.id}",
        default_rpm if not any(p.rpm is not None for p in pools) else None,
        default_tpm if not any(p.tpm is not None for p in pools) else None,
    )
    if default.rpm is not None or default.tpm is not None:
        # The defaults are the key's own: a key-level entry, right after the key's pool.
        at = 1 if pools and pools[0].scope == "key" else 0
        pools.insert(at, default)
    band = getattr(key, "band", None)
    if band is None and proj is not None:
        for scope, sid in (("project", proj.id), ("team", proj.team_id), ("org", proj.org_id)):
            lim = tree.limits.get((scope, sid))
            if lim is not None and lim.band is not None:
                band = lim.band
                break
    return Principal(
        key_id=key.id,
        key_prefix=key.prefix,
        project=proj.path if proj is not None else (None if getattr(key, "user_id", None) else key.project),
        expires_at=key.expires_at,
        project_id=proj.id if proj else None,
        team_id=proj.team_id if proj else None,
        org_id=proj.org_id if proj else None,
        user_id=getattr(key, "user_id", None),
        band=band or DEFAULT_BAND,
        pools=tuple(pools),
        models=models,
    )


def person_principal(
    user_id: str, project_id: str | None, tree, default_rpm: int | None = None, default_tpm: int | None = None
) -> Principal:
    """A signed-in person spending against one of their projects, or on their own (``project_id`` None):
    the pools a key of theirs there would have; usage is recorded as ``session:<user id>``."""
    key = SimpleNamespace(
        id=f"session:{user_id}",
        prefix=None,
        project_id=project_id,
        project=None,
        user_id=user_id,
        band=None,
        expires_at=None,
    )
    return build_principal(key, tree, default_rpm, default_tpm)


class AuthError(LlmgwError):
    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


MISS_RECHECK_S = 0.1  # an unknown key looks in the store at most this often


class KeyCache:
    """Maps sha256(secret) to a principal; revoked keys are kept to say so."""

    def __init__(
        self,
        source: KeySource,
        poll_interval: float = 1.0,
        *,
        default_rpm: int | None = None,
        default_tpm: int | None = None,
    ) -> None:
        self._source = source
        self._poll = poll_interval
        self.default_rpm = default_rpm
        self.default_tpm = default_tpm
        self._active: dict[str, Principal] = {}
        self._suspended: set[str] = set()  # hashes of keys whose owner is suspended
        self._revoked: dict[str, datetime] = {}
        self._generation: int | None = None
        # What each project keeps for agents (conversations, notes): set with the keys, reloaded with them.
        self._retention: dict[str, Any] = {}
        self._task: asyncio.Task | None = None
        self.reload_failures = 0
        self._recheck: asyncio.Task | None = None
        self._rechecked = -MISS_RECHECK_S

    def __len__(self) -> int:
        return len(self._active)

    async def load(self) -> None:
        generation = await self._source.keys_generation()
        snapshot = getattr(self._source, "tenancy_snapshot", None)
        tree = await snapshot() if snapshot is not None else None
        active: dict[str, Principal] = {}
        suspended: set[str] = set()
        for k in await self._source.active_keys():
            owner = tree.users.get(getattr(k, "user_id", None) or "") if tree is not None else None
            if owner is not None and owner.state != "active":
                suspended.add(k.hash)
                continue
            active[k.hash] = build_principal(k, tree, self.default_rpm, self.default_tpm)
        revoked = dict(await self._source.revoked_key_hashes())
        settings = getattr(self._source, "retention_settings", None)
        retention = {r.project_id: r for r in await settings()} if settings is not None else {}
        # Swap whole tables: a request never sees a half-built one.
        self._active, self._revoked, self._suspended, self._generation = active, revoked, suspended, generation
        self._retention = retention

    def retention(self, project_id: str | None) -> Any:
        """The project's store.Retention (threads_hours, memory_hours), or None when it keeps nothing."""
        return self._retention.get(project_id) if project_id is not None else None

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch(), name="key cache")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self._poll)
            try:
                await self._reload_if_changed()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # Serving goes on with the keys already known.
                self.reload_failures += 1
                log.warning("could not check the store for key changes: %s", exc)

    async def _reload_if_changed(self) -> None:
        if await self._source.keys_generation() != self._generation:
            await self.load()
            log.info("API keys reloaded: %d active", len(self._active))

    async def authenticate_current(self, header: str | None) -> Principal:
        """authenticate(), except that a key the cache does not know sends it to the store first
        when the keys there changed since it loaded: a key made a moment ago (by `llmgw up`, by
        another serving process or control plane) is served before the next poll.  A flood of
        unknown keys costs at most one generation check every MISS_RECHECK_S, shared by all
        (an unknown key waits for the next one, so it is answered within MISS_RECHECK_S)."""
        digest = self._digest(header)
        if digest in self._active or digest in self._revoked or digest in self._suspended:
            return self._lookup(digest)
        if self._recheck is None:
            wait = self._rechecked + MISS_RECHECK_S - time.monotonic()
            self._recheck = asyncio.create_task(self._check_now(max(wait, 0.0)), name="key cache: recheck")
        await asyncio.shield(self._recheck)
        return self._lookup(digest)

    async def _check_now(self, after: float) -> None:
        try:
            if after > 0:
                await asyncio.sleep(after)
            await self._reload_if_changed()
        except Exception as exc:
            self.reload_failures += 1
            log.warning("could not check the store for a key it does not know: %s", exc)
        finally:
            self._rechecked = time.monotonic()
            self._recheck = None

    def authenticate(self, header: str | None) -> Principal:
        return self._lookup(self._digest(header))

    @staticmethod
    def _digest(header: str | None) -> str:
        """The key's SHA-256 from an Authorization header, or the refusal of a malformed one."""
        if not header:
            raise AuthError("no api key was provided; send it as 'Authorization: Bearer <key>'", "missing_api_key")
        if not header.isascii():
            # aiohttp hands bytes above 0x7f through as surrogates, which no key holds (and
            # which would not even encode for hashing).
            raise AuthError(
                "the api key holds characters that are not ASCII; keys are ASCII letters, digits, '-' and '_'",
                "invalid_api_key",
            )
        scheme, _, secret = header.partition(" ")
        if scheme.lower() != "bearer" or not secret.strip():
            raise AuthError("the Authorization header should be 'Bearer <key>'", "invalid_api_key")
        return hashlib.sha256(secret.strip().encode()).hexdigest()

    def _lookup(self, digest: str) -> Principal:
        p = self._active.get(digest)
        if p is None:
            when = self._revoked.get(digest)
            if when is not None:
                raise AuthError(f"this api key was revoked on {when:%Y-%m-%d %H:%M} UTC", "revoked_api_key")
            if digest in self._suspended:
                raise AuthError("the account that owns this api key is suspended", "suspended_api_key")
            raise AuthError("the api key is not valid", "invalid_api_key")
        if p.expires_at is not None and p.expires_at <= datetime.now(UTC):
            raise AuthError(f"this api key expired on {p.expires_at:%Y-%m-%d %H:%M} UTC", "expired_api_key")
        return p
