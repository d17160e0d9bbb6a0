"""What the mirror holds and brings in: ``<root>/<model>/<version>/<file>``.

State lives on disk so a restart loses nothing: files present are the
directory's plain files (hand-copied ones included); a download in progress
is ``.<name>.part`` beside its target, renamed only when whole and checked;
``.llmgw.json`` per version keeps each file's sha256 and source and each
failure's reason. The only in-memory state is the downloads running now.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import hashlib
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlsplit

import httpx
import orjson

from llmgw import download, gguf
from llmgw.download import Step
from llmgw.files import replace_durably, write_atomic
from llmgw.huggingface import DEFAULT_ENDPOINT, auth_headers
from llmgw.mirror import huggingface
from llmgw.mirror.layout import MirrorError, check_segment, is_hidden
from llmgw.mirror.sources import GuardedTransport, SourcePolicy
from llmgw.paths import resolve_inside

log = logging.getLogger(__name__)

BOOK = ".llmgw.json"
_RANK = {"present": 0, "fetching": 1, "failed": 2}


@dataclass
class FileStatus:
    name: str
    state: str  # "fetching" | "present" | "failed"
    size: int | None = None  # bytes on disk when present
    bytes_done: int = 0
    bytes_total: int | None = None
    sha256: str | None = None
    reason: str | None = None
    source: str | None = None


@dataclass
class VersionStatus:
    model: str
    version: str
    state: str  # worst of its files: failed > fetching > present
    files: list[FileStatus] = field(default_factory=list)
    reason: str | None = None  # the first failed file's reason

    @property
    def size(self) -> int:
        return sum(f.size or 0 for f in self.files if f.state == "present")


@dataclass
class _Want:
    name: str
    url: str
    source: str
    size: int | None = None
    sha256: str | None = None
    hf: bool = False  # sends the token (httpx drops it on a redirect to another host)


@dataclass
class _Flight:
    want: _Want
    task: asyncio.Task | None = None
    done: int = 0
    total: int | None = None
    hasher: hashlib._Hash | None = None  # sha256 of what is in the .part so far


class _Failed(MirrorError):
    """A download failed for the reason in the message; remembered on disk."""


def _book_read(vdir: Path) -> dict:
    try:
        data = orjson.loads((vdir / BOOK).read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return {"files": {}, "failures": {}}
    if not isinstance(data, dict):
        return {"files": {}, "failures": {}}
    for key in ("files", "failures"):
        if not isinstance(data.get(key), dict):
            data[key] = {}
    return data


def _book_write(vdir: Path, data: dict) -> None:
    # A crash leaves the old book or the new, never half.
    write_atomic(vdir / BOOK, orjson.dumps(data, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS))


def _part(vdir: Path, name: str) -> Path:
    # Hidden: a dot-name is never listed or served.
    return download.part_path(vdir / name, hidden=True)


def _name_from_url(url: str) -> str:
    return unquote(urlsplit(url).path.rstrip("/").rsplit("/", 1)[-1])


def _looks_html(head: bytes) -> bool:
    start = head.lstrip()[:15].lower()
    return start.startswith((b"<!doctype", b"<html"))


class Manager:
    def __init__(
        self,
        root: Path,
        *,
        hf_endpoint: str = DEFAULT_ENDPOINT,
        hf_token: str | None = None,
        architectures: frozenset[str] | None = None,
        timeout: float = 30.0,
        allow_local_sources: bool = False,
    ) -> None:
        self.root = Path(root)
        self.hf_endpoint = hf_endpoint.rstrip("/")
        # The Hugging Face endpoint is the operator's own setting, so it is fetched from even on loopback.
        self.sources = SourcePolicy(allow_local=allow_local_sources, trusted=[self.hf_endpoint])
        self.hf_token = hf_token or os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN") or None
        self.architectures = gguf.pinned_architectures() if architectures is None else architectures
        self.timeout = timeout
        self._flights: dict[tuple[str, str, str], _Flight] = {}
        self._client: httpx.AsyncClient | None = None

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            # httpx drops Authorization when a redirect leaves the host, so
            # the HF token never reaches the CDN HF redirects to. Every connection,
            # each redirect's too, goes only where the source policy allows.
            self._client = httpx.AsyncClient(
                timeout=self.timeout, follow_redirects=True, transport=GuardedTransport(self.sources)
            )
        return self._client

    async def close(self) -> None:
        """Cancel downloads; their partial files stay, to resume."""
        tasks = [f.task for f in self._flights.values() if f.task is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    # ------------------------------------------------------------ reading state

    def _vdir(self, model: str, version: str) -> Path | None:
        vdir = resolve_inside(self.root, model, version)
        if vdir is None or vdir == Path(os.path.realpath(self.root)):
            return None
        return vdir

    def status(self, model: str, version: str) -> VersionStatus | None:
        """A version's state from disk and the downloads running; None if nothing is there.
        Names that could not be in the mirror are simply not there."""
        try:
            check_segment(model, "model")
            check_segment(version, "version")
        except MirrorError:
            return None
        files: dict[str, FileStatus] = {}
        vdir = self._vdir(model, version)
        if vdir is not None and vdir.is_dir():
            book = _book_read(vdir)
            parts: dict[str, int] = {}
            with contextlib.suppress(OSError):
                for entry in os.scandir(vdir):
                    if is_hidden(entry.name):
                        suffix = len(download.PART_SUFFIX)  # ".<name>.part", see _part
                        if entry.name.endswith(download.PART_SUFFIX) and len(entry.name) > suffix + 1:
                            with contextlib.suppress(OSError):
                                parts[entry.name[1:-suffix]] = entry.stat().st_size
                        continue
                    # A link may point anywhere; only what stays inside the root is ours to list.
                    if resolve_inside(self.root, model, version, entry.name) is None:
                        continue
                    with contextlib.suppress(OSError):
                        if entry.is_file():
                            size = entry.stat().st_size
                            kept = book["files"].get(entry.name, {})
                            sha = kept.get("sha256") if kept.get("size") == size else None
                            files[entry.name] = FileStatus(
                                entry.name,
                                "present",
                                size=size,
                                bytes_done=size,
                                bytes_total=size,
                                sha256=sha,
                                source=kept.get("source"),
                            )
            for name, fail in book["failures"].items():
                if name not in files and isinstance(fail, dict):
                    files[name] = FileStatus(
                        name,
                        "failed",
                        bytes_done=parts.get(name, 0),
                        reason=fail.get("reason"),
                        source=fail.get("source"),
                    )
            for name, have in parts.items():
                if name not in files:
                    files[name] = FileStatus(
                        name, "failed", bytes_done=have, reason=f"interrupted at {have} bytes; fetch again to resume"
                    )
        for (m, v, name), fl in self._flights.items():
            if (m, v) == (model, version):
                files[name] = FileStatus(
                    name, "fetching", bytes_done=fl.done, bytes_total=fl.total, source=fl.want.source
                )
        if not files:
            return None
        ordered = [files[n] for n in sorted(files)]
        state = max((f.state for f in ordered), key=_RANK.__getitem__)
        reason = next((f.reason for f in ordered if f.state == "failed"), None)
        return VersionStatus(model, version, state, ordered, reason)

    def list(self) -> list[VersionStatus]:
        """Held (rescanned from disk) and arriving versions, by model then version."""
        keys = {(m, v) for (m, v, _) in self._flights}
        with contextlib.suppress(OSError):
            for mdir in os.scandir(self.root):
                if is_hidden(mdir.name) or not mdir.is_dir():
                    continue
                with contextlib.suppress(OSError):
                    for vdir in os.scandir(mdir.path):
                        if not is_hidden(vdir.name) and vdir.is_dir():
                            keys.add((mdir.name, vdir.name))
        out = [s for k in sorted(keys) if (s := self.status(*k)) is not None]
        return out

    def path_of(self, model: str, version: str, name: str) -> Path | None:
        """A present file's real path, for serving; None for anything else."""
        try:
            for seg, what in ((model, "model"), (version, "version"), (name, "file name")):
                check_segment(seg, what)
        except MirrorError:
            return None
        if (model, version, name) in self._flights:
            return None
        p = resolve_inside(self.root, model, version, name)
        return p if p is not None and p.is_file() else None

    # ------------------------------------------------------------ fetching

    async def fetch(
        self, source: str, model: str, version: str, *, as_name: str | None = None, anyway: bool = False
    ) -> VersionStatus:
        """Start bringing ``source`` into ``model/version``; returns at once (state fetching)."""
        check_segment(model, "--model")
        check_segment(version, "--version")
        if as_name is not None:
            check_segment(as_name, "--as")
        wants = await self._resolve(source, as_name)
        current = self.status(model, version)
        if current is not None and current.state == "present":
            raise MirrorError(
                f"{model}/{version} is already here; a version is never overwritten: add a new one beside it."
            )
        vdir = self._vdir(model, version)
        if vdir is None:
            raise MirrorError(
                f"{model}/{version} leads outside the mirror's directory (a link?); "
                "remove the link or choose another name."
            )
        present = {f.name for f in current.files if f.state == "present"} if current else set()
        todo = [w for w in wants if w.name not in present]
        if not anyway:
            first = next((w for w in todo if w.name.lower().endswith(".gguf")), None)
            if first is not None and (model, version, first.name) not in self._flights:
                headers = auth_headers(self.hf_token) if first.hf else None
                refusal = await gguf.check_gguf_url(first.url, self._http(), self.architectures, headers=headers)
                if refusal:
                    raise MirrorError(refusal)
        await asyncio.to_thread(vdir.mkdir, parents=True, exist_ok=True)
        if self._vdir(model, version) != vdir:
            raise MirrorError(f"{model}/{version} leads outside the mirror's directory; choose another name.")
        for w in todo:
            key = (model, version, w.name)
            if key in self._flights:
                continue  # single flight: the running download serves this ask too
            fl = _Flight(want=w, total=w.size)
            self._flights[key] = fl
            fl.task = asyncio.create_task(self._run(key, vdir, fl), name=f"mirror {model}/{version}/{w.name}")
        st = self.status(model, version)
        assert st is not None
        return st

    async def _resolve(self, source: str, as_name: str | None) -> builtins.list[_Want]:  # list: the method above
        if source.startswith("hf:"):
            hf = await huggingface.resolve(source, self._http(), endpoint=self.hf_endpoint, token=self.hf_token)
            if as_name is not None and len(hf.files) > 1:
                raise MirrorError(
                    "--as names one file, but this is a set of shards whose names llama.cpp relies on; leave --as out."
                )
            return [
                _Want(
                    name=as_name or f.name,
                    url=f.url,
                    source=f"hf:{hf.org}/{hf.repo}/{f.path}@{hf.commit}",
                    size=f.size,
                    sha256=f.sha256,
                    hf=True,
                )
                for f in hf.files
            ]
        if source.startswith(("http://", "https://")):
            # Refused now rather than as a failed download; each connection is checked again when made.
            await self.sources.check(source)
            name = as_name or _name_from_url(source)
            check_segment(name, "file name (from the URL; pass --as to choose one)")
            return [_Want(name=name, url=source, source=source)]
        raise MirrorError(
            f"{source!r} is not a source the mirror can fetch; give an http(s):// URL or hf:ORG/REPO/FILE."
        )

    async def _run(self, key: tuple[str, str, str], vdir: Path, fl: _Flight) -> None:
        name = key[2]
        try:
            sha, size = await self._download(vdir, fl)
            book = _book_read(vdir)
            book["files"][name] = {"sha256": sha, "size": size, "source": fl.want.source}
            book["failures"].pop(name, None)
            _book_write(vdir, book)
            log.info("mirror: %s/%s/%s is here (%d bytes, sha256 %s)", *key, size, sha)
        except asyncio.CancelledError:
            raise  # closing: the partial file stays and says "interrupted" after a restart
        except Exception as exc:
            reason = (
                str(exc)
                if isinstance(exc, MirrorError)
                else (
                    f"the download of {fl.want.url} stopped at {fl.done} bytes "
                    f"({type(exc).__name__}: {exc}); fetch again to resume"
                )
            )
            log.warning("mirror: %s/%s/%s failed: %s", *key, reason)
            with contextlib.suppress(OSError):
                book = _book_read(vdir)
                book["failures"][name] = {"reason": reason, "source": fl.want.source}
                _book_write(vdir, book)
        finally:
            self._flights.pop(key, None)

    async def _download(self, vdir: Path, fl: _Flight) -> tuple[str, int]:
        """Bring the file whole into place; returns (sha256, size)."""
        w = fl.want
        part, target = _part(vdir, w.name), vdir / w.name
        for _ in range(2):  # a second pass only when a resume had to start again from 0
            restart = await self._attempt(part, fl)
            if not restart:
                break
        else:
            raise _Failed(f"{w.url} could not be resumed or restarted; fetch again.")
        if fl.hasher is None:  # the partial was already whole: nothing streamed through a hasher
            fl.hasher = await asyncio.to_thread(_sha256_prefix, part)
        digest = fl.hasher.hexdigest()
        size = part.stat().st_size
        if w.sha256 and digest != w.sha256.lower():
            part.unlink(missing_ok=True)
            raise _Failed(
                f"{w.name} has sha256 {digest} but Hugging Face lists {w.sha256}; nothing was kept: fetch again."
            )
        if target.exists():
            raise _Failed(
                f"{target} appeared while downloading; a file is never overwritten, "
                "the download stays as its .part file."
            )
        await asyncio.to_thread(replace_durably, part, target)
        return digest, size

    async def _attempt(self, part: Path, fl: _Flight) -> bool:
        """One GET, appending to ``part``. Returns True when it must start again from 0."""
        w = fl.want
        have = download.resume_from(part, w.size)
        headers = download.request_headers(have)
        if w.hf:
            headers.update(auth_headers(self.hf_token))
        async with self._http().stream("GET", w.url, headers=headers) as resp:
            code = resp.status_code
            answer = download.read_answer(
                code, have, resp.headers.get("Content-Range"), resp.headers.get("Content-Length"), w.size
            )
            if code == 416 and answer.step is Step.WHOLE:
                fl.done = fl.total = have
                return False  # the partial was already the whole file
            if code == 416 and answer.step is Step.RESTART:
                part.unlink(missing_ok=True)
                return True
            if w.hf and code in (401, 403):
                raise _Failed(f"{w.source.split('@')[0]} is {huggingface.GATED_HINT}.")
            if code >= 400 or answer.step is Step.OTHER:
                raise _Failed(f"{w.url} answered {code} {resp.reason_phrase}; check the address and fetch again.")
            ctype = resp.headers.get("Content-Type", "").split(";")[0].strip().lower()
            if ctype == "text/html":
                raise _Failed(
                    f"{w.url} answered with a web page (text/html), not a model file; "
                    "check the address (a Hugging Face page needs /resolve/, not /blob/)."
                )
            if answer.step is Step.RESTART:
                # The server sent some other range: what we hold cannot be extended by it.
                log.info("mirror: %s %s; starting again", w.url, answer.why)
                part.unlink(missing_ok=True)
                return True
            if answer.step is Step.WRONG_LENGTH:
                raise _Failed(f"{w.url} is {answer.total} bytes but Hugging Face lists {w.size}; fetch again.")
            total, have = answer.total, answer.have
            mode = "ab" if answer.step is Step.APPEND else "wb"
            fl.done, fl.total = have, total
            if total is not None:
                free = download.lacking_space(part.parent, total - have)
                if free is not None:
                    raise _Failed(
                        f"{w.name} needs {(total - have) / 1e9:.1f} GB more but {part.parent} has "
                        f"{free / 1e9:.1f} GB free; free some space and fetch again."
                    )
            # Hashed while written; a resumed file hashes its prefix first, once.
            fl.hasher = await asyncio.to_thread(_sha256_prefix, part) if mode == "ab" else hashlib.sha256()
            f = await asyncio.to_thread(open, part, mode)
            try:
                first = mode == "wb"
                async for chunk in _body(resp):
                    if first:
                        first = False
                        if _looks_html(chunk):
                            raise _Failed(f"{w.url} answered with a web page, not a model file; check the address.")
                    if download.overruns(fl.done, len(chunk), total):
                        raise _Failed(f"{w.url} sent more than the {total} bytes it promised; fetch again.")
                    await asyncio.to_thread(f.write, chunk)
                    fl.hasher.update(chunk)
                    fl.done += len(chunk)
            except _Failed:
                f.close()
                part.unlink(missing_ok=True)  # nothing of a refused answer is kept
                raise
            finally:
                if not f.closed:
                    await asyncio.to_thread(f.close)
        if total is not None and fl.done < total:
            raise _Failed(f"the download ended at {fl.done} of {total} bytes; fetch again to resume.")
        return False

    async def wait(self, model: str, version: str) -> VersionStatus:
        """Until nothing of the version is fetching."""
        while True:
            tasks = [
                f.task for (m, v, _), f in self._flights.items() if (m, v) == (model, version) and f.task is not None
            ]
            if not tasks:
                break
            await asyncio.wait(tasks)
        st = self.status(model, version)
        if st is None:
            raise MirrorError(f"{model}/{version} is not in this mirror.")
        return st

    # ------------------------------------------------------------ removing

    def _busy(self, model: str, version: str, name: str | None = None) -> bool:
        return any((m, v) == (model, version) and (name is None or n == name) for (m, v, n) in self._flights)

    async def remove(self, model: str, version: str) -> None:
        """Delete a whole version (its bookkeeping and partial files too)."""
        check_segment(model, "--model")
        check_segment(version, "--version")
        if self._busy(model, version):
            raise MirrorError(
                f"{model}/{version} is still downloading; wait for it to finish (or fail) before removing it."
            )
        vdir = self._vdir(model, version)
        if vdir is None or not vdir.is_dir():
            raise MirrorError(f"{model}/{version} is not in this mirror; `llmgw mirror list` shows what is.")
        await asyncio.to_thread(shutil.rmtree, vdir)
        self._prune(vdir.parent)

    async def remove_file(self, model: str, version: str, name: str) -> None:
        """Delete one file of a version; a version left with nothing goes too."""
        check_segment(model, "--model")
        check_segment(version, "--version")
        check_segment(name, "--file")
        if self._busy(model, version, name):
            raise MirrorError(
                f"{model}/{version}/{name} is still downloading; wait for it to finish (or fail) before removing it."
            )
        vdir = self._vdir(model, version)
        target = resolve_inside(self.root, model, version, name)
        part = _part(vdir, name) if vdir else None
        book = _book_read(vdir) if vdir else {"files": {}, "failures": {}}
        known = name in book["files"] or name in book["failures"]
        if vdir is None or target is None or not (target.is_file() or (part and part.exists()) or known):
            raise MirrorError(f"{model}/{version}/{name} is not in this mirror; `llmgw mirror list` shows what is.")
        with contextlib.suppress(FileNotFoundError):
            target.unlink()
        if part is not None:
            part.unlink(missing_ok=True)
        if known:
            book["files"].pop(name, None)
            book["failures"].pop(name, None)
            _book_write(vdir, book)
        if self.status(model, version) is None and not self._busy(model, version):
            await asyncio.to_thread(shutil.rmtree, vdir, True)
            self._prune(vdir.parent)

    def _prune(self, mdir: Path) -> None:
        # A model directory with no versions left is noise in the listing.
        with contextlib.suppress(OSError):
            if mdir != Path(os.path.realpath(self.root)) and not any(mdir.iterdir()):
                mdir.rmdir()


def _sha256_prefix(path: Path) -> hashlib._Hash:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(download.CHUNK), b""):
            h.update(block)
    return h


async def _body(resp: httpx.Response):
    """The body's chunks; a connection that drops ends it quietly, so the length
    check after it says how far it got (and the partial stays, to resume)."""
    try:
        # No chunk size: httpx would hold bytes back to fill one, and lose them if the connection drops.
        async for chunk in resp.aiter_raw():
            yield chunk
    except httpx.TransportError as exc:
        log.info("mirror: %s ended early: %s", resp.url, exc)
