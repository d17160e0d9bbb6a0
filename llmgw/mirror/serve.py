"""The mirror's byte listener (:8081): read-only, Range, manifests, checksum sidecars.

Nodes fetch weights and engine archives from here without credentials, so
everything it answers is decided by this module rather than by aiohttp's
static handler: a request path is split from the raw request line, every
segment is checked as one plain, visible name, and the file is resolved with
its symlinks before anything is opened; a path that leaves the root, in any
spelling, is a 404 like any other file that is not there.

``/<model>/<version>/`` answers a JSON manifest of the version's files (what
an agent reads for a source ending in ``/``); ``<file>.sha256`` answers
``"<hex>  <file>\\n"`` for a file whose checksum the mirror knows, so a
version holding llama.cpp release archives (``llama.cpp/<tag>/<asset>``) is a
``release_url`` base agents can install from.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import os
import ssl
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote

import orjson
from aiohttp import hdrs, web
from multidict import CIMultiDict

from llmgw.config.types import ListenAddress
from llmgw.httpserve import Runner, drain
from llmgw.mirror.api import ApiAccess, Network, api_app, error_body
from llmgw.mirror.layout import MirrorError, check_segment
from llmgw.paths import resolve_inside

if TYPE_CHECKING:
    from llmgw.mirror.fetcher import Manager

READ_ONLY = "the mirror is read-only"
NOT_HERE = "nothing here: the mirror serves /<model>/<version>/<file> and /<model>/<version>/ (a manifest)"
SIDECAR = ".sha256"

# (model, version) -> {file name: sha256} for the files whose checksum is known.
ChecksumsOf = Callable[[str, str], dict[str, str]]


def manager_checksums(manager) -> ChecksumsOf:
    """The checksums a fetcher Manager recorded for a version's present files."""

    def lookup(model: str, version: str) -> dict[str, str]:
        vs = manager.status(model, version)
        if vs is None:
            return {}
        return {f.name: f.sha256 for f in vs.files if f.state == "present" and f.sha256}

    return lookup


def request_segments(raw_path: str) -> list[str] | None:
    """The decoded segments of a request path, or None when any of them is not
    one plain, visible name (``..``, a separator, a leading dot, a control
    character, in plain, percent- or double-percent-encoded form).

    A path ending in ``/`` keeps a final empty segment.
    """
    path = raw_path.split("?", 1)[0].split("#", 1)[0]
    if not path.startswith("/") or "\\" in path:
        return None
    raw = path[1:].split("/")
    out: list[str] = []
    for i, seg in enumerate(raw):
        if seg == "" and i == len(raw) - 1 and i > 0:
            out.append("")
            break
        try:
            name = unquote(seg, errors="strict")
            # A layer that decodes once more (a proxy, a client library) must not find a path in it either.
            again = unquote(name, errors="strict")
            check_segment(name, "path segment")
            if again != name:
                check_segment(again, "path segment")
        except (MirrorError, UnicodeDecodeError):
            return None
        out.append(name)
    return out


def _regular_file(path: Path | None) -> os.stat_result | None:
    if path is None:
        return None
    try:
        st = path.stat()
    except OSError:
        return None
    return st if stat.S_ISREG(st.st_mode) else None


def version_files(root: Path, model: str, version: str) -> list[tuple[str, int]] | None:
    """(name, bytes) of the visible regular files of a version, sorted; None when
    the version is not a directory inside the root. Files that are symlinks
    leaving the root are left out."""
    vdir = resolve_inside(root, model, version)
    if vdir is None or not vdir.is_dir():
        return None
    files = []
    for name in sorted(os.listdir(vdir)):
        if name.startswith("."):
            continue
        st = _regular_file(resolve_inside(root, model, version, name))
        if st is not None:
            files.append((name, st.st_size))
    return files


class _RawFileResponse(web.FileResponse):
    """A FileResponse that never swaps in a compressed sibling (``x.gz`` for ``x``):
    weights are fetched by byte ranges, and a Content-Encoding would break them."""

    async def prepare(self, request: web.BaseRequest):
        headers = CIMultiDict(request.headers)
        headers.popall(hdrs.ACCEPT_ENCODING, None)
        return await super().prepare(request.clone(headers=headers))


def _not_found() -> web.Response:
    return web.Response(status=404, text=NOT_HERE + "\n")


def _json(status: int, data: object) -> web.Response:
    # To HEAD, aiohttp sends the same headers (Content-Length included) and no body.
    return web.Response(
        status=status, body=orjson.dumps(data, option=orjson.OPT_INDENT_2) + b"\n", content_type="application/json"
    )


def weights_app(root: str | os.PathLike[str], checksums: ChecksumsOf | None = None) -> web.Application:
    """The byte listener's application, serving ``root``."""
    root = Path(root)
    sums: ChecksumsOf = checksums or (lambda m, v: {})

    async def handle(request: web.Request) -> web.StreamResponse:
        if request.method not in (hdrs.METH_GET, hdrs.METH_HEAD):
            return web.Response(status=405, text=READ_ONLY + "\n", headers={"Allow": "GET, HEAD"})
        segs = request_segments(request.raw_path)
        if segs is None:
            return _not_found()
        if len(segs) == 3 and segs[2] == "":
            model, version = segs[0], segs[1]
            files = await asyncio.to_thread(version_files, root, model, version)
            if files is None:
                return _not_found()
            known = sums(model, version)
            entries = []
            for name, size in files:
                e: dict[str, object] = {"name": name, "bytes": size}
                if name in known:
                    e["sha256"] = known[name]
                entries.append(e)
            return _json(200, {"model": model, "version": version, "files": entries, "bytes": sum(s for _, s in files)})
        if len(segs) != 3:
            return _not_found()
        model, version, name = segs
        path = resolve_inside(root, model, version, name)
        if path is not None and _regular_file(path) is not None:
            return _RawFileResponse(path, chunk_size=1 << 20)
        if name.endswith(SIDECAR) and len(name) > len(SIDECAR):
            of = name[: -len(SIDECAR)]
            if _regular_file(resolve_inside(root, model, version, of)) is not None:
                sha = sums(model, version).get(of)
                if sha:
                    return web.Response(status=200, text=f"{sha}  {of}\n", content_type="text/plain")
        return _not_found()

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    return app


# ---------------------------------------------------------------- running both listeners


class ListenError(MirrorError):
    """A listener could not start; the message says which and why."""


def parse_allow(values: Iterable[str]) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    """Networks from --api-allow values (repeatable, comma lists allowed)."""
    nets = []
    for value in values:
        for item in value.split(","):
            item = item.strip()
            if not item:
                continue
            try:
                nets.append(ipaddress.ip_network(item, strict=False))
            except ValueError:
                raise MirrorError(f'--api-allow "{item}" is not an address or a network') from None
    return nets


@dataclass
class Running:
    runners: list[Runner]

    async def close(self) -> None:
        # Both listeners at once; responses finishing meanwhile say `Connection: close`.
        await drain(self.runners)


async def _start(
    app: web.Application, addr: ListenAddress, ssl_context: ssl.SSLContext | None, what: str, runners: list[Runner]
) -> None:
    runner = Runner(app, error_body)
    await runner.setup()
    runners.append(runner)
    site = web.TCPSite(runner, addr.bind_host, addr.port, reuse_address=True, ssl_context=ssl_context)
    try:
        await site.start()
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            why = f"{addr} is already in use by another process"
        elif exc.errno in (errno.EACCES, errno.EPERM):
            why = f"{addr}: permission denied; ports below 1024 need root"
        else:
            why = f"{addr}: {exc.strerror or exc}"
        raise ListenError(f"{what}: {why}") from None


def describe_api_access(
    addr: ListenAddress, allow: list[str], token_file: str, ca: str | None = None, tls_clients: Iterable[str] = ()
) -> str:
    """The startup line saying who reaches the API (the network filter) and with what (the credential)."""
    where = f"for {', '.join(allow)} and this machine only" if allow else "from any address"
    cred = f"the token in {token_file}"
    if ca:
        cred = f"TLS; {cred}, or a certificate from {ca} issued to {' or '.join(tls_clients)}"
    return f"management API on {addr}, {where}; credential: {cred}"


async def start_listeners(
    root: Path,
    weights: web.Application,
    listen: ListenAddress,
    api: web.Application,
    api_listen: ListenAddress,
    api_ssl: ssl.SSLContext | None,
    say: Callable[[str], None],
    api_line: str,
) -> Running:
    """Start the byte listener, then the API; the first that fails stops both and
    raises ListenError worded "serving weights: …" / "serving the API: …"."""
    runners: list[Runner] = []
    running = Running(runners)
    try:
        await _start(weights, listen, None, "serving weights", runners)
        say(f"serving {root} on {listen}")
        await _start(api, api_listen, api_ssl, "serving the API", runners)
        say(api_line)
    except BaseException:
        await running.close()
        raise
    return running


async def serve_until_stopped(
    manager: Manager,
    root: Path,
    base: str,
    access: ApiAccess,
    listen: ListenAddress,
    api_listen: ListenAddress,
    stop: asyncio.Event,
    *,
    api_line: str,
    say: Callable[[str], None],
    allow: list[Network] | None = None,
    api_ssl: ssl.SSLContext | None = None,
    allow_local_sources: bool = False,
) -> None:
    """`llmgw mirror serve`: both listeners over ``root`` until ``stop`` is set, then they drain and
    ``manager`` (the fetcher) closes. ListenError when a listener cannot start."""
    running = None
    try:
        api = api_app(manager, root, base, access, allow=allow or None)
        running = await start_listeners(
            root, weights_app(root, manager_checksums(manager)), listen, api, api_listen, api_ssl, say, api_line
        )
        say(f"catalog sources should point at {base}")
        if allow_local_sources:
            say("fetching from this machine's loopback and link-local addresses is allowed (--allow-local-sources)")
        await stop.wait()
    finally:
        if running is not None:
            await running.close()
        await manager.close()
