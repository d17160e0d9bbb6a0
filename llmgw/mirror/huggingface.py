"""Resolving ``hf:ORG/REPO/PATH`` into files to download, pinned to a commit.

The repository's current commit is looked up once and every file URL names
it (``{endpoint}/{org}/{repo}/resolve/{commit}/{path}``, the shape
catalog.check_source uses with ``main``), so a version in the mirror is
exactly one upstream revision even if the repository moves while the
download runs. Checksums come from the tree listing's ``lfs.oid``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import quote

import httpx

from llmgw.mirror.layout import MirrorError, check_segment

DEFAULT_ENDPOINT = "https://huggingface.co"
SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")
GATED_HINT = "gated: accept its terms on huggingface.co and set HF_TOKEN"
_MAX_TREE_PAGES = 100  # a repository listing spread over more pages than this is not a model repo


@dataclass
class HFFile:
    name: str  # where it lands in the version: the file's own name
    path: str  # its path inside the repository
    url: str  # pinned to the commit
    size: int | None
    sha256: str | None  # the LFS oid, when the file is in LFS


@dataclass
class HFSource:
    org: str
    repo: str
    path: str
    commit: str
    gated: bool
    files: list[HFFile]


def parse_source(source: str) -> tuple[str, str, str]:
    """``hf:ORG/REPO/PATH`` → (org, repo, path); MirrorError for anything else."""
    rest = source[3:] if source.startswith("hf:") else source
    parts = rest.split("/")
    if len(parts) < 3 or not all(parts):
        raise MirrorError(
            f"{source!r} is not a Hugging Face file; write it as hf:ORG/REPO/FILE, "
            "e.g. hf:Qwen/Qwen2.5-0.5B-Instruct-GGUF/qwen2.5-0.5b-instruct-q4_k_m.gguf."
        )
    if any(p in (".", "..") for p in parts):
        raise MirrorError(f"{source!r} has '.' or '..' in its path; name the file plainly.")
    return parts[0], parts[1], "/".join(parts[2:])


def is_gated(value: object) -> bool:
    """HF's ``gated`` is False, True, or a string such as "auto" or "manual"."""
    if isinstance(value, str):
        return value.strip().lower() not in ("", "false", "no", "0")
    return bool(value)


def auth_headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def file_url(endpoint: str, org: str, repo: str, commit: str, path: str) -> str:
    return f"{endpoint.rstrip('/')}/{org}/{repo}/resolve/{commit}/{quote(path)}"


async def _get_json(client: httpx.AsyncClient, url: str, token: str | None, what: str) -> httpx.Response:
    try:
        resp = await client.get(url, headers=auth_headers(token))
    except httpx.HTTPError as exc:
        raise MirrorError(
            f"{url} could not be reached ({type(exc).__name__}: {exc}); "
            "check the Hugging Face endpoint (mirror.registry) and the network."
        ) from None
    if resp.status_code in (401, 403):
        raise MirrorError(f"{what} is {GATED_HINT} (or private: check the name).")
    if resp.status_code == 404:
        raise MirrorError(f"{what} was not found on {url.split('/api/')[0]}; check the name.")
    if resp.status_code >= 400:
        raise MirrorError(f"{url} answered {resp.status_code} {resp.reason_phrase}; try again later.")
    return resp


async def resolve(
    source: str, client: httpx.AsyncClient, *, endpoint: str = DEFAULT_ENDPOINT, token: str | None = None
) -> HFSource:
    """Look up ``source`` on Hugging Face: its commit, and the file or shard set it names."""
    org, repo, path = parse_source(source)
    base = endpoint.rstrip("/")
    what = f"hf:{org}/{repo}"
    info = (await _get_json(client, f"{base}/api/models/{org}/{repo}", token, what)).json()
    commit = info.get("sha") if isinstance(info, dict) else None
    if not isinstance(commit, str) or not commit:
        raise MirrorError(f"{base} gave no commit for {what}; it may not be a Hugging Face API.")
    gated = is_gated(info.get("gated"))
    if gated and not token:
        raise MirrorError(f"{what} is {GATED_HINT}.")
    tree = await _tree(client, f"{base}/api/models/{org}/{repo}/tree/{commit}?recursive=1", token, what)

    m = SHARD.search(path)
    if m:
        # A GGUF split into parts is one model: take every part of this set.
        stem, count = path[: m.start()], m.group(2)
        wanted = [f"{stem}-{i:05d}-of-{count}.gguf" for i in range(1, int(count) + 1)]
    else:
        wanted = [path]
    missing = [w for w in wanted if w not in tree]
    if missing:
        raise MirrorError(f"{what} at {commit[:12]} has no {', '.join(missing)}; check the file name.")
    files = []
    for p in wanted:
        entry = tree[p]
        lfs = entry.get("lfs")
        if not isinstance(lfs, dict):
            lfs = {}
        size = lfs.get("size", entry.get("size"))
        name = check_segment(p.rsplit("/", 1)[-1], "file name")
        files.append(
            HFFile(
                name=name,
                path=p,
                url=file_url(base, org, repo, commit, p),
                size=size if isinstance(size, int) and not isinstance(size, bool) else None,
                sha256=lfs.get("oid") if isinstance(lfs.get("oid"), str) else None,
            )
        )
    return HFSource(org=org, repo=repo, path=path, commit=commit, gated=gated, files=files)


async def _tree(client: httpx.AsyncClient, url: str, token: str | None, what: str) -> dict[str, dict]:
    """Every file in the tree listing by path, following the API's Link pagination."""
    out: dict[str, dict] = {}
    next_url: str | None = url
    for _ in range(_MAX_TREE_PAGES):
        if next_url is None:
            return out
        resp = await _get_json(client, next_url, token, what)
        entries = resp.json()
        if not isinstance(entries, list):
            raise MirrorError(f"{next_url} did not answer with a file listing.")
        for e in entries:
            if isinstance(e, dict) and e.get("type", "file") == "file" and isinstance(e.get("path"), str):
                out[e["path"]] = e
        nxt = resp.links.get("next", {}).get("url")
        next_url = str(resp.url.join(nxt)) if nxt else None
    raise MirrorError(f"the listing of {what} runs past {_MAX_TREE_PAGES} pages; name a smaller repository.")
