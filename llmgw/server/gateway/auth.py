"""API keys resolved from memory; the store is polled in the background for changes."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from datetime import datetime, timezone
from typing import Protocol, Sequence

log = logging.getLogger("llmgw.gateway.auth")


from llmgw.server.gateway.principal import ANONYMOUS, Principal  # noqa: F401  (re-exported)


class KeySource(Protocol):
    async def keys_generation(self) -> int: ...
    async def active_keys(self) -> Sequence: ...
    async def revoked_key_hashes(self) -> Sequence[tuple[str, datetime]]: ...


class AuthError(Exception):
    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


class KeyCache:
    """Maps sha256(secret) to a principal; revoked keys are kept to say so."""

    def __init__(self, source: KeySource, poll_interval: float = 1.0) -> None:
        self._source = source
        self._poll = poll_interval
        self._active: dict[str, Principal] = {}
        self._revoked: dict[str, datetime] = {}
        self._generation: int | None = None
        self._task: asyncio.Task | None = None
        self.reload_failures = 0

    def __len__(self) -> int:
        return len(self._active)

    async def load(self) -> None:
        generation = await self._source.keys_generation()
        active = {k.hash: Principal(key_id=k.id, key_prefix=k.prefix, project=k.project, expires_at=k.expires_at)
                  for k in await self._source.active_keys()}
        revoked = dict(await self._source.revoked_key_hashes())
        # Swap whole dicts: a request never sees a half-built table.
        self._active, self._revoked, self._generation = active, revoked, generation

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
                if await self._source.keys_generation() != self._generation:
                    await self.load()
                    log.info("API keys reloaded: %d active", len(self._active))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # Serving goes on with the keys already known.
                self.reload_failures += 1
                log.warning("could not check the store for key changes: %s", exc)

    def authenticate(self, header: str | None) -> Principal:
        if not header:
            raise AuthError("no api key was provided; send it as 'Authorization: Bearer <key>'", "missing_api_key")
        scheme, _, secret = header.partition(" ")
        if scheme.lower() != "bearer" or not secret.strip():
            raise AuthError("the Authorization header should be 'Bearer <key>'", "invalid_api_key")
        digest = hashlib.sha256(secret.strip().encode()).hexdigest()
        p = self._active.get(digest)
        if p is None:
            when = self._revoked.get(digest)
            if when is not None:
                raise AuthError(f"this api key was revoked on {when:%Y-%m-%d %H:%M} UTC", "revoked_api_key")
            raise AuthError("the api key is not valid", "invalid_api_key")
        if p.expires_at is not None and p.expires_at <= datetime.now(timezone.utc):
            raise AuthError(f"this api key expired on {p.expires_at:%Y-%m-%d %H:%M} UTC", "expired_api_key")
        return p
