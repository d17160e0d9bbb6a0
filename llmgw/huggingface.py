"""The Hugging Face Hub's API as llmgw reads it: a model's facts and its file listing.

The mirror resolves ``hf:`` sources with it and the admin Mirror page browses repositories with
it. A failure is an :class:`HFError` whose ``kind`` says what went wrong; each caller puts it in
its own words, because what to change differs (HF_TOKEN and the mirror's endpoint for the one,
``mirror.registry`` in server.yaml for the other).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import quote

import httpx

from llmgw.errors import LlmgwError

DEFAULT_ENDPOINT = "https://huggingface.co"
# A GGUF split into parts (llama.cpp's gguf-split names): NAME-0000K-of-0000N.gguf.
SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.I)
MAX_TREE_PAGES = 100  # a listing spread over more pages than this is not a model repository

Kind = Literal[
    "unreachable",  # no answer at all: ``cause`` is httpx's error
    "denied",  # 401 or 403: gated or private
    "missing",  # 404
    "status",  # any other error status: ``status`` and ``reason``
    "not-json",  # an answer that is not JSON
    "not-described",  # the model's facts are not a JSON object
    "not-listing",  # a page of the file listing is not a JSON list
    "too-long",  # the listing runs past ``max_pages`` pages
]


class HFError(LlmgwError):
    """The Hub could not be read, or answered in a shape its API does not have.

    ``url`` is what was asked, ``endpoint`` the Hub it belongs to; the message is plain enough
    to log, and callers word ``kind`` for their readers."""

    def __init__(
        self,
        kind: Kind,
        url: str,
        endpoint: str,
        *,
        status: int = 0,
        reason: str = "",
        cause: Exception | None = None,
    ) -> None:
        detail = f" ({status} {reason})" if status else f" ({type(cause).__name__}: {cause})" if cause else ""
        super().__init__(f"{url}: {kind}{detail}")
        self.kind: Kind = kind
        self.url = url
        self.endpoint = endpoint
        self.status = status
        self.reason = reason
        self.cause = cause

    def worded(self, wording: Mapping[Kind, str], **names: object) -> str:
        """This failure in a caller's words: ``wording`` holds a sentence for each kind, which may
        name {url}, {endpoint}, {status}, {reason}, {error} (httpx's, as "Type: text") and ``names``."""
        error = f"{type(self.cause).__name__}: {self.cause}" if self.cause is not None else ""
        fields = dict(url=self.url, endpoint=self.endpoint, status=self.status, reason=self.reason, error=error)
        return wording[self.kind].format(**fields, **names)


@dataclass(frozen=True)
class TreeFile:
    """A file in a repository's tree listing."""

    path: str
    size: int | None  # the LFS object's size where the file is in LFS (the entry's own is the pointer's)
    sha256: str | None  # the LFS oid, when the file is in LFS

    @classmethod
    def read(cls, entry: object) -> TreeFile | None:
        """A listing entry as a file; None for a directory or an entry without a path."""
        if not isinstance(entry, dict) or entry.get("type", "file") != "file":
            return None
        path = entry.get("path")
        if not isinstance(path, str):
            return None
        lfs = entry.get("lfs")
        if not isinstance(lfs, dict):
            lfs = {}
        size = lfs.get("size", entry.get("size"))
        oid = lfs.get("oid")
        return cls(
            path=path,
            size=size if isinstance(size, int) and not isinstance(size, bool) else None,
            sha256=oid if isinstance(oid, str) else None,
        )


def is_gated(value: object) -> bool:
    """HF's ``gated`` is False, True, or a string such as "auto" or "manual"."""
    if isinstance(value, str):
        return value.strip().lower() not in ("", "false", "no", "0")
    return bool(value)


def auth_headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def file_url(endpoint: str, repo: str, revision: str, path: str) -> str:
    """Where a file's bytes are (``repo`` is ORG/NAME); a commit as ``revision`` pins them."""
    return f"{endpoint.rstrip('/')}/{repo}/resolve/{revision}/{quote(path)}"


async def _get(client: httpx.AsyncClient, url: str, endpoint: str, token: str | None) -> httpx.Response:
    try:
        resp = await client.get(url, headers=auth_headers(token))
    except httpx.HTTPError as exc:
        raise HFError("unreachable", url, endpoint, cause=exc) from None
    if resp.status_code in (401, 403):
        raise HFError("denied", url, endpoint, status=resp.status_code, reason=resp.reason_phrase)
    if resp.status_code == 404:
        raise HFError("missing", url, endpoint, status=404, reason=resp.reason_phrase)
    if resp.status_code >= 400:
        raise HFError("status", url, endpoint, status=resp.status_code, reason=resp.reason_phrase)
    return resp


def _json(resp: httpx.Response, endpoint: str) -> Any:
    try:
        return resp.json()
    except ValueError:
        raise HFError("not-json", str(resp.url), endpoint) from None


async def model_info(
    client: httpx.AsyncClient, endpoint: str, repo: str, *, token: str | None = None
) -> dict[str, Any]:
    """``/api/models/ORG/NAME``: the commit (``sha``), ``gated``, the card and GGUF facts…"""
    base = endpoint.rstrip("/")
    url = f"{base}/api/models/{repo}"
    info = _json(await _get(client, url, base, token), base)
    if not isinstance(info, dict):
        raise HFError("not-described", url, base)
    return info


async def tree(
    client: httpx.AsyncClient,
    endpoint: str,
    repo: str,
    revision: str,
    *,
    token: str | None = None,
    max_pages: int = MAX_TREE_PAGES,
) -> list[TreeFile]:
    """Every file of the repository at ``revision``, following the API's Link pagination."""
    base = endpoint.rstrip("/")
    out: list[TreeFile] = []
    url: str | None = f"{base}/api/models/{repo}/tree/{revision}?recursive=1"
    for _ in range(max_pages):
        if url is None:
            return out
        resp = await _get(client, url, base, token)
        entries = _json(resp, base)
        if not isinstance(entries, list):
            raise HFError("not-listing", url, base)
        out += [f for f in map(TreeFile.read, entries) if f is not None]
        nxt = resp.links.get("next", {}).get("url")
        url = str(resp.url.join(nxt)) if nxt else None
    if url is None:
        return out
    raise HFError("too-long", url, base)


async def json_file(
    client: httpx.AsyncClient, endpoint: str, repo: str, revision: str, path: str, *, token: str | None = None
) -> Any:
    """A JSON file of the repository (``config.json``…) at ``revision``, read whole: one for
    reading, not a model's weights."""
    base = endpoint.rstrip("/")
    return _json(await _get(client, file_url(base, repo, revision, path), base, token), base)
