"""The catalog: models declared in server.yaml merged with models added at run time.

Declared models are re-read from server.yaml on every start, so a run-time change to one
would silently revert at the next start; remove and scale refuse them instead. Models
added at run time are kept in the store as the JSON of their validated spec and checked
again through the same pydantic model whenever they are loaded.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import quote

import httpx
from pydantic import ValidationError

from llmgw.config.errors import ConfigError, format_validation_error
from llmgw.config.loading import read_yaml
from llmgw.config.server import ModelConfig, source_kind
from llmgw.errors import LlmgwError
from llmgw.store.store import Store

log = logging.getLogger(__name__)

SourceCheck = Callable[[str], Awaitable["str | None"]]
HF_ENDPOINT = "https://huggingface.co"
SOURCE_CHECK_TIMEOUT_S = 10.0
MANIFEST_MAX_BYTES = 4 << 20


class CatalogError(LlmgwError):
    """A catalog change was refused; nothing was changed. The message says why."""


@dataclass(frozen=True, slots=True)
class CatalogEntry:
    model: ModelConfig
    declared: bool
    created_at: datetime | None = None  # run-time models only
    updated_at: datetime | None = None

    @property
    def name(self) -> str:
        return self.model.name

    @property
    def fingerprints(self) -> dict[str, str]:
        """Profile name -> fingerprint; a replica started from another is a stale profile."""
        return {p.name: p.fingerprint for p in self.model.profiles}

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, for the admin API and `ctl models --json`."""
        d = self.model.model_dump(mode="json", exclude_none=True)
        for p in d.get("profiles", []):
            p["fingerprint"] = self.fingerprints[p["name"]]
        d["declared"] = self.declared
        d["managed"] = self.model.managed
        if self.model.scaling is not None:
            d["scaling"]["state"] = self.model.scaling.state
        if self.created_at is not None:
            d["created_at"] = self.created_at.isoformat()
            d["updated_at"] = self.updated_at.isoformat() if self.updated_at else None
        return d


def _validate(data: Any, source: str) -> ModelConfig:
    if not isinstance(data, dict):
        raise CatalogError(
            f"{source}: a model should be a mapping of keys (name:, source:, profiles: ...), "
            f"not a {type(data).__name__}"
        )
    try:
        return ModelConfig.model_validate(data)
    except ValidationError as exc:
        raise CatalogError(format_validation_error(exc, source)) from None


def _spec_json(model: ModelConfig) -> str:
    return json.dumps(
        model.model_dump(mode="json", exclude_none=True), sort_keys=True, separators=(",", ":"), ensure_ascii=False
    )


def load_model_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read one model from YAML (`llmgw ctl model add -f model.yaml`), validated, as a
    JSON-ready mapping for the admin API. Raises ConfigError naming the file and key."""
    data = read_yaml(path, "model file")
    if isinstance(data, dict) and set(data) == {"models"}:
        raise ConfigError(
            f"{path}: holds a models: list; a model file holds one model's keys "
            "(name:, source:, profiles: ...) at the top level"
        )
    try:
        model = _validate(data, str(path))
    except CatalogError as exc:
        raise ConfigError(str(exc)) from None
    return model.model_dump(mode="json", exclude_unset=True)


class Catalog:
    """Declared models plus those in the store. Call `await load()` before use; every
    change is validated in full before anything is written."""

    def __init__(self, declared: Sequence[ModelConfig], store: Store | None = None):
        self._declared = {m.name: CatalogEntry(m, declared=True) for m in declared}
        self._stored: dict[str, CatalogEntry] = {}
        self._store = store
        self._lock = asyncio.Lock()
        # Stored models that could not be used at load, in words to log or show.
        self.problems: list[str] = []
        # Their names, so `ctl model remove` can still clear them out of the store.
        self._unusable: set[str] = set()

    async def load(self) -> None:
        """(Re)read the models added at run time."""
        if self._store is None:
            return
        stored: dict[str, CatalogEntry] = {}
        problems: list[str] = []
        unusable: set[str] = set()
        taken = self._names(self._declared.values())
        for row in await self._store.catalog_list():
            where = f"the stored model {row.name}"
            try:
                model = _validate(json.loads(row.spec), where)
            except (CatalogError, ValueError) as exc:
                problems.append(f"{exc}; it is left out of the catalog")
                unusable.add(row.name)
                continue
            clash = next((n for n in [model.name, *model.aliases] if n in taken), None)
            if clash is not None:
                # server.yaml was edited to declare a name a run-time model already had.
                problems.append(
                    f'{where}: "{clash}" is also {taken[clash]} in server.yaml, which wins; '
                    f"remove it with `llmgw ctl model remove {row.name}`"
                )
                unusable.add(row.name)
                continue
            stored[row.name] = CatalogEntry(model, declared=False, created_at=row.created_at, updated_at=row.updated_at)
        self._stored, self.problems, self._unusable = stored, problems, unusable
        for p in problems:
            log.warning("catalog: %s", p)

    @staticmethod
    def _names(entries) -> dict[str, str]:
        out: dict[str, str] = {}
        for e in entries:
            out[e.name] = f"the name of {e.name}"
            for a in e.model.aliases:
                out[a] = f"an alias of {e.name}"
        return out

    def models(self) -> list[CatalogEntry]:
        """Declared models in server.yaml order, then run-time models by name."""
        return [*self._declared.values(), *sorted(self._stored.values(), key=lambda e: e.name)]

    def get(self, name: str) -> CatalogEntry | None:
        """By name or alias."""
        for e in self.models():
            if e.name == name or name in e.model.aliases:
                return e
        return None

    def _writable(self, name: str, verb: str) -> CatalogEntry:
        if name in self._declared:
            raise CatalogError(
                f"{name} is declared in server.yaml; change it there "
                f"(server.yaml is re-read on every start, so a {verb} here would revert)"
            )
        entry = self._stored.get(name)
        if entry is None:
            aliased = self.get(name)
            if aliased is not None:
                raise CatalogError(f'"{name}" is an alias of {aliased.name}; give the model\'s name')
            raise CatalogError(f"no model named {name} in the catalog; `llmgw ctl models` lists them")
        return entry

    def _need_store(self) -> Store:
        if self._store is None:
            raise CatalogError(
                "this server has no store, so models cannot be added at run time; declare them in server.yaml"
            )
        return self._store

    async def add(self, data: dict[str, Any], source_check: SourceCheck | None = None) -> CatalogEntry:
        """Add a model at run time. `source_check` (e.g. check_source) is awaited with the
        model's source before anything is written; None skips it (--no-source-check)."""
        store = self._need_store()
        model = _validate(data, "model")
        if source_check is not None and model.source is not None:
            problem = await source_check(model.source)
            if problem:
                raise CatalogError(f"model: source: {problem} (--no-source-check skips this check)")
        async with self._lock:
            await self.load()  # another control plane may have added a model since
            taken = self._names(self.models())
            own = [model.name, *model.aliases]
            for i, n in enumerate(own):
                where = "name" if i == 0 else f"aliases[{i - 1}]"
                if n in taken:
                    raise CatalogError(
                        f'model: {where}: "{n}" is already {taken[n]}; every name and alias must be unique'
                    )
                if n in own[:i]:
                    raise CatalogError(f'model: {where}: "{n}" is given twice')
            row = await store.catalog_put(model.name, _spec_json(model))
            entry = CatalogEntry(model, declared=False, created_at=row.created_at, updated_at=row.updated_at)
            self._stored[model.name] = entry
        return entry

    async def remove(self, name: str) -> CatalogEntry | None:
        """Forget a run-time model; None when it was a stored model the catalog could not
        use (see `problems`), which is removed all the same."""
        store = self._need_store()
        async with self._lock:
            await self.load()
            if name in self._unusable:
                await store.catalog_delete(name)
                self._unusable.discard(name)
                return None
            entry = self._writable(name, "removal")
            await store.catalog_delete(name)
            self._stored.pop(name, None)
        return entry

    async def scale(self, name: str, min: int, max: int | None = None) -> CatalogEntry:
        """Change only the scaling block; `max` left out follows the scaling rules
        (the same as min, or 1 when min is 0). Returns the entry with the scaling in force."""
        store = self._need_store()
        async with self._lock:
            await self.load()
            entry = self._writable(name, "scale")
            if not entry.model.managed:
                raise CatalogError(
                    f"{name} has no profiles: its endpoints run outside llmgw, so there is nothing to scale"
                )
            data = entry.model.model_dump(mode="json", exclude_none=True)
            now = entry.model.scaling
            assert now is not None  # ModelConfig fills in the scaling of a model with profiles
            scaling: dict[str, Any] = {"min": min, "idle_timeout": now.idle_timeout}
            if max is not None:
                scaling["max"] = max
            data["scaling"] = scaling
            model = _validate(data, "scale")
            row = await store.catalog_put(name, _spec_json(model))
            new = CatalogEntry(model, declared=False, created_at=row.created_at, updated_at=row.updated_at)
            self._stored[name] = new
        return new


def hf_file_url(source: str, hf_endpoint: str = HF_ENDPOINT) -> str:
    """hf:ORG/REPO/FILE as the URL Hugging Face serves the file at (its main branch)."""
    repo_file = source[3:].split("/")
    return f"{hf_endpoint.rstrip('/')}/{'/'.join(repo_file[:2])}/resolve/main/{quote('/'.join(repo_file[2:]))}"


async def check_source(
    source: str,
    *,
    timeout: float = SOURCE_CHECK_TIMEOUT_S,
    hf_endpoint: str = HF_ENDPOINT,
    transport: httpx.AsyncBaseTransport | None = None,
) -> str | None:
    """None when the source looks servable, else why not. A URL gets a HEAD (a set URL
    ending in / a GET of its manifest), a local path must exist here, a bare model id is
    left to vLLM/SGLang."""
    kind = source_kind(source)
    if kind == "model_id":
        return None
    if kind == "path":
        path = os.path.expanduser(source)
        return None if os.path.exists(path) else f"{source}: no such file or directory on this machine"
    url = hf_file_url(source, hf_endpoint) if kind == "hf" else source
    try:
        async with httpx.AsyncClient(timeout=timeout, follow_redirects=True, transport=transport) as client:
            if kind == "set":
                return await _check_manifest(client, source)
            resp = await client.head(url)
            if resp.status_code == 405:
                # Some servers refuse HEAD; one byte by GET proves the file as well.
                resp = await client.get(url, headers={"Range": "bytes=0-0"})
    except httpx.TimeoutException:
        return f"{url} did not answer within {timeout:g}s"
    except httpx.HTTPError as exc:
        return f"{url} could not be reached ({type(exc).__name__}: {exc})"
    if resp.status_code >= 400:
        return f"{url} answered {resp.status_code} {resp.reason_phrase}; check the address"
    return None


async def _check_manifest(client: httpx.AsyncClient, source: str) -> str | None:
    async with client.stream("GET", source) as resp:
        if resp.status_code >= 400:
            return f"{source} answered {resp.status_code} {resp.reason_phrase} where a mirror manifest was expected"
        body = b""
        async for chunk in resp.aiter_bytes():
            body += chunk
            if len(body) > MANIFEST_MAX_BYTES:
                return f"{source} did not answer with a manifest: the answer is larger than {MANIFEST_MAX_BYTES} bytes"
    try:
        data = json.loads(body)
    except ValueError:
        return (
            f"{source} did not answer with a manifest; a source ending in / has to be a mirror "
            "version, not a directory listing"
        )
    if not isinstance(data, dict) or not isinstance(data.get("files"), list) or not data["files"]:
        return f'{source}: the manifest lists no files (expected {{"files": [{{"name": ..., "bytes": N}}]}})'
    return None
