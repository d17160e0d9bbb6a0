"""Downloading release files and the checksums their publishers give for them.

A checksum comes from one of three places, and one is required: a file
without a published checksum is refused rather than installed unchecked,
because it is a program that will run as root on every node.

* an explicit sha256 given by the operator (agent configuration);
* GitHub's release API, which publishes ``assets[].digest`` = ``sha256:<hex>``;
* a sidecar ``<asset>.sha256`` next to the asset (what a mirror serves, in the
  ``sha256sum`` format or as the bare hex).
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp

from llmgw.download import CHUNK, lacking_space, overruns, parse_length, part_path, request_headers
from llmgw.files import replace_durably

from .status import ProvisionError, Unreachable

_HEX64 = re.compile(r"[0-9a-f]{64}")
Progress = Callable[[int, "int | None"], None]

USER_AGENT = "llmgw-agent"


def make_session() -> aiohttp.ClientSession:
    # No overall limit (archives are hundreds of MB on slow links), but a
    # connection that stalls is given up on. trust_env: nodes behind an
    # HTTPS proxy reach GitHub through it.
    timeout = aiohttp.ClientTimeout(total=None, connect=30, sock_connect=30, sock_read=120)
    return aiohttp.ClientSession(timeout=timeout, trust_env=True, headers={"User-Agent": USER_AGENT})


def normalise_sha256(value: str, what: str) -> str:
    """``<hex>`` or ``sha256:<hex>`` as lower-case hex, or a clear refusal."""
    v = value.strip().lower()
    v = v.removeprefix("sha256:")
    if not _HEX64.fullmatch(v):
        raise ProvisionError(
            f"the sha256 given for {what} ({value!r}) is not 64 hexadecimal digits; "
            "copy it from the release page or from `sha256sum FILE`"
        )
    return v


def parse_sha256_file(text: str, asset: str) -> str | None:
    """The checksum for ``asset`` in a sidecar or SHA256SUMS-style file.

    Accepts a bare hex digest, ``<hex>  <name>`` / ``<hex> *<name>`` lines
    (sha256sum) and ``SHA256 (<name>) = <hex>`` (BSD). A line naming another
    file is ignored; an unnamed digest is taken to be for ``asset``.
    """
    unnamed = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r"SHA256 \((.+)\) = ([0-9a-fA-F]{64})", line)
        if m:
            if m.group(1) == asset:
                return m.group(2).lower()
            continue
        parts = line.split(None, 1)
        if not _HEX64.fullmatch(parts[0].lower()):
            continue
        if len(parts) == 1:
            unnamed = unnamed or parts[0].lower()
            continue
        name = parts[1].strip().lstrip("*")
        if name == asset or name.rsplit("/", 1)[-1] == asset:
            return parts[0].lower()
    return unnamed


def _host(url: str) -> str:
    return urlsplit(url).netloc or url


async def http_get(session: aiohttp.ClientSession, url: str, **kw) -> aiohttp.ClientResponse:
    try:
        return await session.get(url, **kw)
    except (TimeoutError, aiohttp.ClientConnectionError) as e:
        raise Unreachable(f"cannot reach {_host(url)}: {e.__class__.__name__}: {e}".rstrip(": ")) from None
    except aiohttp.InvalidURL:
        raise ProvisionError(f"{url!r} is not a URL; check the release base URL in the agent configuration") from None


def status_error(resp: aiohttp.ClientResponse, what: str) -> ProvisionError:
    s = resp.status
    if s in (403, 429) and "github" in _host(str(resp.url)):
        # Unauthenticated callers get sixty API requests an hour per address,
        # and a fleet behind one NAT shares them.
        return ProvisionError(
            f"GitHub is rate-limiting this address ({s} {resp.reason}); "
            "it is tried again later, or point the agent at a mirror"
        )
    if s >= 500:
        return Unreachable(f"{_host(str(resp.url))} answered {s} {resp.reason} for {what}")
    return ProvisionError(f"{_host(str(resp.url))} answered {s} {resp.reason} for {what}")


async def github_release_digests(session: aiohttp.ClientSession, api_url: str, what: str) -> dict[str, str]:
    """``{asset name: sha256}`` from a GitHub release API answer at ``api_url``."""
    resp = await http_get(session, api_url, headers={"Accept": "application/vnd.github+json"})
    async with resp:
        if resp.status == 404:
            raise ProvisionError(f"{what} does not exist on GitHub ({api_url} answered 404)")
        if resp.status != 200:
            raise status_error(resp, what)
        try:
            body = await resp.json(content_type=None)
        except (ValueError, aiohttp.ClientPayloadError) as e:
            raise ProvisionError(f"GitHub's answer for {what} is not JSON: {e}") from None
    out: dict[str, str] = {}
    for a in body.get("assets", []) if isinstance(body, dict) else []:
        if not isinstance(a, dict):
            continue
        digest = str(a.get("digest") or "").lower()
        if digest.startswith("sha256:") and _HEX64.fullmatch(digest[7:]):
            out[str(a.get("name"))] = digest[7:]
    return out


async def fetch_sidecar(session: aiohttp.ClientSession, url: str, asset: str) -> str | None:
    """The checksum published at ``url`` for ``asset``; None when there is none (404)."""
    resp = await http_get(session, url)
    async with resp:
        if resp.status == 404:
            return None
        if resp.status != 200:
            raise status_error(resp, url.rsplit("/", 1)[-1])
        text = (await resp.read())[: 64 << 10].decode("utf-8", errors="replace")
    sha = parse_sha256_file(text, asset)
    if sha is None:
        raise ProvisionError(f"{url} holds no sha256 for {asset}")
    return sha


async def download(
    session: aiohttp.ClientSession,
    url: str,
    dest: Path,
    expected_sha256: str,
    on_progress: Progress | None = None,
    *,
    label: str | None = None,
) -> None:
    """Fetch ``url`` into ``dest``, refusing it unless its sha256 is ``expected_sha256``.

    The bytes arrive beside ``dest`` under a temporary name, removed again
    when the download fails or does not match: ``dest`` appears only whole
    and checked.
    """
    label = label or url.rsplit("/", 1)[-1]
    part = part_path(dest)
    resp = await http_get(session, url, headers=request_headers(0))
    try:
        async with resp:
            if resp.status == 404:
                raise ProvisionError(f"{label} is not at {url} (404)")
            if resp.status != 200:
                raise status_error(resp, label)
            total = parse_length(resp.headers.get("Content-Length"))
            free = lacking_space(dest.parent, total) if total is not None else None
            if total is not None and free is not None:
                raise ProvisionError(
                    f"{label} needs {total / 1e9:.1f} GB but {dest.parent} has "
                    f"{free / 1e9:.1f} GB free; free some space there"
                )
            done = 0
            h = hashlib.sha256()
            if on_progress:
                on_progress(0, total)
            f = await asyncio.to_thread(open, part, "wb")
            try:
                async for chunk in resp.content.iter_chunked(CHUNK):
                    if overruns(done, len(chunk), total):
                        raise ProvisionError(f"the download of {label} sent more than the {total} bytes it promised")
                    await asyncio.to_thread(f.write, chunk)
                    h.update(chunk)
                    done += len(chunk)
                    if on_progress:
                        on_progress(done, total)
            except (TimeoutError, aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as e:
                # The server was reached: a retry later, not a build from source.
                raise ProvisionError(
                    f"the download of {label} was cut short after "
                    f"{done} bytes ({e or e.__class__.__name__}); it is tried "
                    "again later"
                ) from None
            finally:
                await asyncio.to_thread(f.close)
            if total is not None and done != total:
                raise ProvisionError(f"the download of {label} ended after {done} of {total} bytes")
        got = h.hexdigest()
        if got != expected_sha256:
            raise ProvisionError(
                f"{label} does not match the checksum its publisher gave "
                f"(got sha256 {got[:16]}…, expected {expected_sha256[:16]}…); it was not installed"
            )
        await asyncio.to_thread(replace_durably, part, dest)
    except BaseException:
        part.unlink(missing_ok=True)
        raise
