"""Resolving ``hf:ORG/REPO/PATH`` into files to download, pinned to a commit.

The repository's current commit is looked up once and every file URL names
it (``{endpoint}/{org}/{repo}/resolve/{commit}/{path}``, the shape
catalog.check_source uses with ``main``), so a version in the mirror is
exactly one upstream revision even if the repository moves while the
download runs. Checksums come from the tree listing's ``lfs.oid``. The Hub's
API itself is ``llmgw.huggingface``; this module words its failures for the
mirror's users.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from llmgw import huggingface as hub
from llmgw.mirror.layout import MirrorError, check_segment

GATED_HINT = "gated: accept its terms on huggingface.co and set HF_TOKEN"


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


# The Hub's failures in the mirror's words: what to check is HF_TOKEN and the mirror's endpoint.
_WORDING: dict[hub.Kind, str] = {
    "unreachable": "{url} could not be reached ({error}); "
    "check the Hugging Face endpoint (mirror.registry) and the network.",
    "denied": "{what} is " + GATED_HINT + " (or private: check the name).",
    "missing": "{what} was not found on {endpoint}; check the name.",
    "status": "{url} answered {status} {reason}; try again later.",
    "not-json": "{url} did not answer with JSON; it may not be a Hugging Face API.",
    "not-described": "{endpoint} gave no commit for {what}; it may not be a Hugging Face API.",
    "not-listing": "{url} did not answer with a file listing.",
    "too-long": "the listing of {what} runs past {pages} pages; name a smaller repository.",
}


def _wanted(path: str) -> list[str]:
    """The file, or every part of the shard set it is one of: a GGUF split into parts is one model."""
    m = hub.SHARD.search(path)
    if not m:
        return [path]
    # The parts are named as this one is, but for their number.
    stem, between, count, tail = path[: m.start()], path[m.end(1) : m.start(2)], m.group(2), path[m.end(2) :]
    return [f"{stem}-{i:05d}{between}{count}{tail}" for i in range(1, int(count) + 1)]


async def resolve(
    source: str, client: httpx.AsyncClient, *, endpoint: str = hub.DEFAULT_ENDPOINT, token: str | None = None
) -> HFSource:
    """Look up ``source`` on Hugging Face: its commit, and the file or shard set it names."""
    org, repo, path = parse_source(source)
    base = endpoint.rstrip("/")
    what = f"hf:{org}/{repo}"
    try:
        info = await hub.model_info(client, base, f"{org}/{repo}", token=token)
        commit = info.get("sha")
        if not isinstance(commit, str) or not commit:  # said as a Hub that does not describe the model
            raise hub.HFError("not-described", f"{base}/api/models/{org}/{repo}", base)
        gated = hub.is_gated(info.get("gated"))
        if gated and not token:
            raise MirrorError(f"{what} is {GATED_HINT}.")
        listing = await hub.tree(client, base, f"{org}/{repo}", commit, token=token)
    except hub.HFError as exc:
        raise MirrorError(exc.worded(_WORDING, what=what, pages=hub.MAX_TREE_PAGES)) from None
    tree = {f.path: f for f in listing}
    wanted = _wanted(path)
    missing = [w for w in wanted if w not in tree]
    if missing:
        raise MirrorError(f"{what} at {commit[:12]} has no {', '.join(missing)}; check the file name.")
    files = [
        HFFile(
            name=check_segment(p.rsplit("/", 1)[-1], "file name"),
            path=p,
            url=hub.file_url(base, f"{org}/{repo}", commit, p),
            size=tree[p].size,
            sha256=tree[p].sha256,
        )
        for p in wanted
    ]
    return HFSource(org=org, repo=repo, path=path, commit=commit, gated=gated, files=files)
