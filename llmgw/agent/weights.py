"""Weights on a node: what an engine is given for a model's ``source``.

A source is one of:

* an ``http(s)://`` URL of one file: fetched once into the cache directory;
* an ``http(s)://`` URL ending in ``/``: a mirror *version*, a set of files
  listed by the manifest the mirror serves at that address, fetched whole
  into one directory with a ``.complete`` marker written last;
* a local path (absolute, ``./``, ``../`` or ``~``): given as is, after
  checking it exists, since shared filesystems need no fetching;
* anything else, a model id such as ``Qwen/Qwen2.5-7B-Instruct``: given as
  is, for vLLM and SGLang to resolve themselves.

Downloads are single-flight per target (eight shards starting together make
one download and all eight see its progress and its outcome), resumed from a
``.part`` file beside the target with a Range request, length-checked, and
renamed into place only when whole, so an engine is never handed half a file.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, urlsplit

import aiohttp
import orjson

from llmgw import download
from llmgw.config.agent import DEFAULT_WEIGHTS_CACHE
from llmgw.download import PART_SUFFIX, Step
from llmgw.errors import LlmgwError
from llmgw.files import replace_durably, write_atomic
from llmgw.paths import segment_problem
from llmgw.protocol.weights_names import CACHE_NAME, cache_name_of

log = logging.getLogger(__name__)

DEFAULT_ROOT = Path(DEFAULT_WEIGHTS_CACHE)

Progress = Callable[[int, "int | None"], None]

# Written inside a set's directory after its last file; until then the set is
# unfinished and is never handed to an engine.
COMPLETE_MARKER = ".complete"
# Which source each cache entry came from, so `fetched()` can say so and the
# control plane can compare sources rather than re-deriving names.
SOURCES_INDEX = ".sources.json"


MANIFEST_MAX_BYTES = 4 << 20  # a manifest is a few KB; a bigger answer is not one


class WeightsError(LlmgwError):
    """Weights could not be provided; the message says what and what to do."""


class SourceKind(enum.Enum):
    FILE_URL = "file_url"
    SET_URL = "set_url"
    LOCAL_PATH = "local_path"
    MODEL_ID = "model_id"


@dataclass(frozen=True)
class HeldWeights:
    """One entry in the cache directory."""

    name: str
    path: Path
    bytes: int
    source: str | None  # None when the index lost track of it
    is_set: bool
    complete: bool  # False: a .part file or a set without its marker


class _Discarded(WeightsError):
    """What arrived is wrong, not short: the .part is deleted, not resumed."""


class _Transient(LlmgwError):
    """A failure worth another attempt (connection lost, 5xx, short body)."""


# ---------------------------------------------------------------- sources


def classify(source: str) -> SourceKind:
    """What kind of source this is; only a trailing slash on a URL makes a set."""
    if not isinstance(source, str) or not source.strip():
        raise WeightsError("the model source is empty: give a URL, a local path or a model id")
    if source != source.strip() or any(ord(c) < 32 for c in source):
        raise WeightsError(f"the model source {source!r} has surrounding spaces or control characters; remove them")
    if source.startswith(("/", "./", "../", "~")) or source in (".", ".."):
        return SourceKind.LOCAL_PATH
    if source.startswith("hf:"):
        _hf_parts(source)  # refuses a malformed one here, before anything is fetched
        return SourceKind.FILE_URL
    if "://" in source:
        parts = urlsplit(source)
        if parts.scheme.lower() not in ("http", "https"):
            raise WeightsError(
                f"the model source {source!r} uses {parts.scheme + '://'!r}, which a node cannot fetch: "
                "use an http(s):// address (the mirror's), hf:ORG/REPO/FILE, a local path or a model id"
            )
        if not parts.hostname:
            raise WeightsError(f"the model source {source!r} has no host; write it as http://HOST[:PORT]/PATH")
        try:
            parts.port  # noqa: B018 - raises on a malformed port
        except ValueError:
            raise WeightsError(f"the model source {source!r} has a malformed port") from None
        if parts.path in ("", "/"):
            raise WeightsError(f"the model source {source!r} names no file or version; add its path")
        return SourceKind.SET_URL if parts.path.endswith("/") else SourceKind.FILE_URL
    return SourceKind.MODEL_ID


def _hf_parts(source: str) -> tuple[str, str]:
    """``hf:ORG/REPO/FILE`` as (``ORG/REPO``, ``FILE``)."""
    rest = source[len("hf:") :]
    segments = rest.split("/")
    if len(segments) < 3 or any(segment_problem(seg) for seg in segments):
        how = "a set of files comes from the mirror (a URL ending in /)" if rest.endswith("/") else "name one file"
        raise WeightsError(
            f"the model source {source!r} is not hf:ORG/REPO/FILE "
            f"(e.g. hf:Qwen/Qwen2.5-0.5B-Instruct-GGUF/qwen2.5-0.5b-instruct-q4_k_m.gguf): {how}"
        )
    return "/".join(segments[:2]), "/".join(segments[2:])


def is_set(source: str) -> bool:
    return classify(source) is SourceKind.SET_URL


def cache_name(source: str) -> str:
    """The name a URL source is kept under in the cache directory (``weights_names.cache_name_of``)."""
    if classify(source) not in (SourceKind.FILE_URL, SourceKind.SET_URL):
        raise WeightsError(f"{source!r} is not a URL, so it is never fetched and has no cache name")
    return cache_name_of(source)


def first_gguf(directory: Path) -> Path:
    """The file llama.cpp is given for a set: the first .gguf in sorted order,
    which is part 1 of a split model (llama.cpp finds the others beside it)."""
    ggufs = sorted(p for p in Path(directory).iterdir() if p.name.endswith(".gguf") and p.is_file())
    if not ggufs:
        raise WeightsError(
            f"{directory} holds no .gguf file; llama.cpp needs a GGUF model, vLLM or SGLang take this set"
        )
    return ggufs[0]


# ---------------------------------------------------------------- the cache


class _Flight:
    """One download in progress and everybody waiting on it."""

    def __init__(self) -> None:
        self.task: asyncio.Task[Path]  # set as soon as the flight is made, before anyone sees it
        self.watchers: list[Progress] = []
        self.waiters = 0
        self.last: tuple[int, int | None] | None = None
        self.abandoned = False

    def report(self, done: int, total: int | None) -> None:
        self.last = (done, total)
        for watch in list(self.watchers):
            _call(watch, done, total)


def _call(watch: Progress, done: int, total: int | None) -> None:
    # A broken progress consumer must not break a download others wait on.
    try:
        watch(done, total)
    except Exception:
        log.exception("a weights progress callback failed; the download goes on")


class WeightsCache:
    """Fetched weights under one directory, plus the rules for other sources."""

    def __init__(
        self,
        root: Path = DEFAULT_ROOT,
        *,
        session: aiohttp.ClientSession | None = None,
        connect_timeout: float = 30.0,
        read_timeout: float = 120.0,
        attempts: int = 5,
        retry_delay: float = 1.0,
        hf_endpoint: str | None = None,
    ) -> None:
        if attempts < 1:
            raise ValueError("attempts must be at least 1")
        self.root = Path(root).expanduser().absolute()
        self._session = session
        self._own_session = session is None
        self._timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout, sock_read=read_timeout)
        self._attempts = attempts
        self._retry_delay = retry_delay
        self._flights: dict[str, _Flight] = {}
        self.hf_endpoint = (hf_endpoint or os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")

    async def aclose(self) -> None:
        """Stop downloads in progress (their .part files stay) and close the client."""
        tasks = [f.task for f in self._flights.values() if f.task and not f.task.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> WeightsCache:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        return self._session

    # ------------------------------------------------------------ public

    def path_for(self, source: str) -> Path:
        """Where a URL source is (or will be) held; a set's is a directory."""
        return self.root / cache_name(source)

    def url_for(self, source: str) -> str:
        """The address a fetchable source is downloaded from."""
        if source.startswith("hf:"):
            repo, file = _hf_parts(source)
            return f"{self.hf_endpoint}/{repo}/resolve/main/{quote(file)}"
        return source

    def is_fetching(self, source: str) -> bool:
        return str(self.path_for(source)) in self._flights

    async def resolve(self, source: str, progress: Progress | None = None) -> str:
        """What the engine is given for ``source``: the fetched file or set
        directory for a URL, the path itself for a local path, the id itself
        for a model id."""
        kind = classify(source)
        if kind in (SourceKind.FILE_URL, SourceKind.SET_URL):
            return str(await self.fetch(source, progress))
        if kind is SourceKind.LOCAL_PATH:
            # Engines get argv without a shell, so "~" would reach them literally.
            path = Path(source).expanduser()
            if not path.exists():
                raise WeightsError(
                    f"the model path {source} does not exist on this node: copy the weights there, "
                    "mount the shared filesystem that holds them, or use a URL the node can fetch"
                )
            return str(path) if source.startswith("~") else source
        return source

    async def fetch(self, source: str, progress: Progress | None = None) -> Path:
        """Fetch a URL source (once) and return where it is held.

        Concurrent calls for one source share one download: each gets the same
        path or the same error, and every progress callback sees every report.
        Cancelling one caller leaves the download to the others; when the last
        one goes, the download stops and its ``.part`` stays for a later resume.
        """
        kind = classify(source)
        if kind not in (SourceKind.FILE_URL, SourceKind.SET_URL):
            raise WeightsError(
                f"{source!r} is not a URL; only http(s):// and hf: sources are fetched (resolve() passes others through)"
            )
        target = self.path_for(source)
        key = str(target)
        while True:
            if kind is SourceKind.FILE_URL and target.is_file() and not target.is_symlink():
                return target
            if kind is SourceKind.SET_URL and (target / COMPLETE_MARKER).is_file():
                return target
            flight = self._flights.get(key)
            if flight is None or not flight.abandoned:
                break
            # Everybody left this one and it is winding down; wait for it to
            # stop writing the .part, then look again (it may have finished).
            await asyncio.wait([flight.task])
        if flight is None:
            flight = _Flight()
            job = (
                self._fetch_set(source, target, flight)
                if kind is SourceKind.SET_URL
                else self._fetch_file(source, target, flight)
            )
            flight.task = asyncio.get_running_loop().create_task(job, name=f"weights {source}")
            self._flights[key] = flight
            flight.task.add_done_callback(lambda _t: self._landed(key, flight))
        flight.waiters += 1
        if progress is not None:
            flight.watchers.append(progress)
            if flight.last is not None:  # a late joiner learns where it stands at once
                _call(progress, *flight.last)
        try:
            return await asyncio.shield(flight.task)
        except asyncio.CancelledError:
            flight.waiters -= 1
            if flight.waiters == 0 and not flight.task.done():
                flight.abandoned = True
                flight.task.cancel()
            raise
        finally:
            if progress is not None and progress in flight.watchers:
                flight.watchers.remove(progress)

    def _landed(self, key: str, flight: _Flight) -> None:
        if self._flights.get(key) is flight:
            del self._flights[key]
        # Retrieve the outcome so a download nobody waits on any more does not
        # end as "exception was never retrieved".
        if not flight.task.cancelled():
            flight.task.exception()

    def fetched(self) -> list[HeldWeights]:
        """Everything this agent holds in its cache, finished or not, with sizes."""
        if not self.root.is_dir():
            return []
        sources = self._read_index()
        held: list[HeldWeights] = []
        for entry in sorted(self.root.iterdir()):
            name = entry.name
            partial = name.endswith(PART_SUFFIX)
            base = name[: -len(PART_SUFFIX)] if partial else name
            if not CACHE_NAME.match(base):
                continue  # not a name this cache gives; not ours to report
            try:
                st = entry.lstat()
            except FileNotFoundError:
                continue
            if stat.S_ISDIR(st.st_mode) and not partial:
                held.append(
                    HeldWeights(
                        base, entry, _dir_bytes(entry), sources.get(base), True, (entry / COMPLETE_MARKER).is_file()
                    )
                )
            elif stat.S_ISREG(st.st_mode):
                held.append(HeldWeights(base, entry, st.st_size, sources.get(base), False, not partial))
        return held

    def remove(self, source: str) -> list[Path]:
        """Delete what was fetched for ``source``; returns the paths removed.

        Only URL sources were ever fetched, so nothing else is touched. Every
        path is checked before anything is deleted, so a refusal leaves the
        cache exactly as it was.
        """
        kind = classify(source)
        if kind not in (SourceKind.FILE_URL, SourceKind.SET_URL):
            raise WeightsError(f"{source!r} is not a URL, so this agent never fetched it and will not delete it")
        return self.remove_name(cache_name(source))

    def remove_path(self, path: str | Path) -> list[Path]:
        """Delete a cache entry by the path ``fetched()`` reported (what
        ``RemoveWeights.paths`` carries); a path anywhere else is refused."""
        p = Path(path)
        if not p.is_absolute() or os.path.realpath(p.parent) != os.path.realpath(self.root):
            raise WeightsError(
                f"{path} is not in the weights cache {self.root}; only fetched weights are removed, nothing was"
            )
        name = p.name[: -len(PART_SUFFIX)] if p.name.endswith(PART_SUFFIX) else p.name
        return self.remove_name(name)

    def remove_name(self, name: str) -> list[Path]:
        """Delete a cache entry by the name ``fetched()`` reported."""
        if not isinstance(name, str) or not CACHE_NAME.match(name):
            raise WeightsError(f"{name!r} is not a name this cache gives to what it fetches; nothing was removed")
        if str(self.root / name) in self._flights:
            raise WeightsError(f"{name} is being fetched right now; stop the shards waiting on it, then remove it")
        root = Path(os.path.realpath(self.root))
        doomed: list[Path] = []
        for candidate in (self.root / name, self.root / (name + PART_SUFFIX)):
            doomed.extend(self._check_removable(root, candidate))
        for path in doomed:
            if path.is_dir() and not path.is_symlink():
                continue  # directories go after their contents, below
            path.unlink(missing_ok=True)
        for path in doomed:
            if path.is_dir() and not path.is_symlink():
                path.rmdir()
        if doomed:
            self._update_index(name, None)
        return doomed

    # ------------------------------------------------------------ removal checks

    def _check_removable(self, root: Path, path: Path) -> list[Path]:
        try:
            st = path.lstat()
        except FileNotFoundError:
            return []
        if stat.S_ISLNK(st.st_mode):
            raise WeightsError(
                f"{path} is a symbolic link; this agent never makes links, so it did not fetch this: remove it by hand"
            )
        if Path(os.path.realpath(path.parent)) != root:
            raise WeightsError(f"{path} is not inside the weights cache {root}; nothing was removed")
        if stat.S_ISREG(st.st_mode):
            return [path]
        if not stat.S_ISDIR(st.st_mode):
            raise WeightsError(f"{path} is not a file or a directory; remove it by hand")
        # A set directory holds only flat files this agent wrote (manifest
        # names are refused if they hold a separator): anything else was put
        # there by someone else, and is not ours to delete.
        inner: list[Path] = []
        real_dir = Path(os.path.realpath(path))
        if real_dir.parent != root:
            raise WeightsError(f"{path} resolves to {real_dir}, outside the weights cache {root}; nothing was removed")
        for child in path.iterdir():
            cst = child.lstat()
            if not stat.S_ISREG(cst.st_mode):
                what = "a symbolic link" if stat.S_ISLNK(cst.st_mode) else "not a plain file"
                raise WeightsError(
                    f"{child} is {what}, which this agent never writes into a fetched set; "
                    "nothing was removed: remove it by hand, then ask again"
                )
            if Path(os.path.realpath(child.parent)) != real_dir:
                raise WeightsError(f"{child} is not inside {path}; nothing was removed")
            inner.append(child)
        return inner + [path]

    # ------------------------------------------------------------ index

    def _read_index(self) -> dict[str, str]:
        try:
            data = orjson.loads((self.root / SOURCES_INDEX).read_bytes())
        except FileNotFoundError:
            return {}
        except (OSError, orjson.JSONDecodeError) as exc:
            log.warning(
                "the weights index %s is unreadable (%s); sources will show as unknown", self.root / SOURCES_INDEX, exc
            )
            return {}
        return (
            {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)}
            if isinstance(data, dict)
            else {}
        )

    def _update_index(self, name: str, source: str | None) -> None:
        index = self._read_index()
        if source is None:
            index.pop(name, None)
        else:
            index[name] = source
        write_atomic(self.root / SOURCES_INDEX, orjson.dumps(index, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS))

    # ------------------------------------------------------------ one file

    async def _fetch_file(self, source: str, target: Path, flight: _Flight) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        part = download.part_path(target)
        await self._download(self.url_for(source), part, None, flight.report)
        await asyncio.to_thread(replace_durably, part, target)
        self._update_index(target.name, source)
        return target

    # ------------------------------------------------------------ a set

    async def _fetch_set(self, source: str, target: Path, flight: _Flight) -> Path:
        files = await self._manifest(source)  # refused names stop us before anything is written
        self.root.mkdir(parents=True, exist_ok=True)
        if target.is_symlink() or (target.exists() and not target.is_dir()):
            raise WeightsError(
                f"{target} is in the way of the set from {source} and is not a directory; remove it by hand"
            )
        target.mkdir(exist_ok=True)
        total = sum(size for _, size in files)
        done_before = 0
        for name, size in files:
            dest = target / name
            if dest.is_file() and not dest.is_symlink() and dest.stat().st_size == size:
                done_before += size  # already here whole: not fetched twice
                flight.report(done_before, total)
                continue
            base = done_before

            def report(done: int, _total: int | None, base: int = base) -> None:
                # Progress is the version's, not the file's: the shards asked for the version.
                flight.report(base + done, total)

            part = download.part_path(dest)
            await self._download(source + quote(name, safe=""), part, size, report)
            await asyncio.to_thread(replace_durably, part, dest)
            done_before += size
        marker = {
            "source": source,
            "files": [{"name": n, "bytes": b} for n, b in files],
            "bytes": total,
            "fetched_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        # Last: only now is the set usable.
        write_atomic(target / COMPLETE_MARKER, orjson.dumps(marker, option=orjson.OPT_INDENT_2))
        self._update_index(target.name, source)
        return target

    async def _manifest(self, source: str) -> list[tuple[str, int]]:
        try:
            async with self._http().get(source, headers={"Accept": "application/json"}) as resp:
                if resp.status != 200:
                    hint = ": no such version on the mirror" if resp.status == 404 else ""
                    raise WeightsError(
                        f"{source} answered {resp.status} {resp.reason} where a manifest was expected{hint}"
                    )
                body = await resp.content.read(MANIFEST_MAX_BYTES + 1)
                ctype = resp.content_type
        except aiohttp.ClientError as exc:
            raise WeightsError(f"the manifest at {source} could not be read ({_describe(exc)})") from exc
        except TimeoutError as exc:
            raise WeightsError(f"the manifest at {source} did not arrive in time") from exc
        if ctype == "text/html" or body.lstrip()[:1] == b"<":
            raise WeightsError(
                f"{source} answered an HTML page, not a manifest: a source ending in / has to be a mirror "
                "version (http://MIRROR:8081/MODEL/VERSION/), not a directory listing; "
                "is this the mirror's byte port (:8081)?"
            )
        if len(body) > MANIFEST_MAX_BYTES:
            raise WeightsError(
                f"{source} did not answer with a manifest: the answer is larger than {MANIFEST_MAX_BYTES} bytes"
            )
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise WeightsError(f"{source} did not answer with a manifest: it is not JSON ({exc})") from exc
        return parse_manifest(data, source)

    # ------------------------------------------------------------ bytes

    async def _download(self, url: str, part: Path, expected: int | None, report: Progress) -> None:
        """Bring ``part`` to the whole of ``url``, resuming what is already there."""
        failures = 0
        while True:
            have = part.stat().st_size if part.exists() else 0
            try:
                await self._attempt(url, part, expected, report)
                return
            except _Transient as exc:
                now = part.stat().st_size if part.exists() else 0
                failures = 0 if now > have else failures + 1  # progress buys more attempts
                if failures >= self._attempts:
                    got = f" at {now} bytes" if now else ""
                    raise WeightsError(
                        f"the download of {url} stopped{got} ({exc}) and did not recover after "
                        f"{self._attempts} attempts; what arrived is kept and the next fetch resumes from there"
                    ) from None
                log.info("weights download of %s interrupted (%s); resuming from byte %d", url, exc, now)
                await asyncio.sleep(self._retry_delay * min(failures, 5))

    async def _attempt(self, url: str, part: Path, expected: int | None, report: Progress) -> None:
        have = download.resume_from(part, expected)
        try:
            async with self._http().get(url, headers=download.request_headers(have)) as resp:
                answer = download.read_answer(
                    resp.status, have, resp.headers.get("Content-Range"), resp.headers.get("Content-Length"), expected
                )
                if answer.step is Step.WHOLE:
                    report(have, have)
                    return  # the .part was already whole
                if answer.step is Step.RESTART:
                    part.unlink(missing_ok=True)  # what we hold cannot be extended by this answer
                    raise _Transient(f"{url} {answer.why}; starting again")
                if answer.step is Step.WRONG_LENGTH:
                    raise _Discarded(
                        f"{url} is {answer.total} bytes but the manifest promises {expected}; "
                        "the mirror's file and its manifest disagree, so nothing was kept"
                    )
                if answer.step is Step.OTHER:
                    if resp.status >= 500 or resp.status in (408, 429):
                        raise _Transient(f"{url} answered {resp.status} {resp.reason}")
                    raise WeightsError(_status_error(url, resp.status, resp.reason))
                total, done = answer.total, answer.have
                if total is not None:
                    _check_space(part.parent, total - done, url)
                report(done, total)
                f = await asyncio.to_thread(open, part, "ab" if answer.step is Step.APPEND else "wb")
                try:
                    async for chunk in resp.content.iter_chunked(download.CHUNK):
                        if download.overruns(done, len(chunk), total):
                            raise _Discarded(f"{url} sent more than the {total} bytes it promised; nothing was kept")
                        await asyncio.to_thread(f.write, chunk)
                        done += len(chunk)
                        report(done, total)
                finally:
                    await asyncio.to_thread(f.close)
        except _Discarded:
            with contextlib.suppress(FileNotFoundError):
                part.unlink()
            raise
        except (TimeoutError, aiohttp.ClientError, ConnectionError) as exc:
            raise _Transient(_describe(exc)) from exc
        if total is not None and done < total:
            raise _Transient(f"the connection ended after {done} of {total} bytes")


# ---------------------------------------------------------------- helpers


def parse_manifest(data: object, source: str) -> list[tuple[str, int]]:
    """The files a mirror manifest lists, as (name, bytes); every name checked
    before any is used, since an operator copies files into the mirror by hand
    and what it reports is not automatically safe to join onto a path."""
    shape = 'expected {"files": [{"name": "...", "bytes": N}, ...]}'
    if not isinstance(data, dict) or not isinstance(data.get("files"), list):
        raise WeightsError(f"{source} did not answer with a manifest: {shape}")
    files: list[tuple[str, int]] = []
    seen: set[str] = set()
    for i, entry in enumerate(data["files"]):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise WeightsError(f"{source} did not answer with a manifest: entry {i} has no name; {shape}")
        name, size = entry["name"], entry.get("bytes")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise WeightsError(f"{source}: the manifest gives {name!r} no size in bytes; {shape}")
        check_member_name(name, source)
        if name in seen:
            raise WeightsError(f"{source}: the manifest lists {name!r} twice; fix the mirror's version")
        seen.add(name)
        files.append((name, size))
    if not files:
        raise WeightsError(f"{source}: the manifest lists no files; a version with nothing in it cannot be served")
    return files


def check_member_name(name: str, source: str) -> None:
    """Refuse a manifest filename that is not one plain name inside the set."""
    # Room for the suffix it is downloaded under.
    why = segment_problem(name, room=len(PART_SUFFIX))
    if why is None and (name == COMPLETE_MARKER or name.startswith(COMPLETE_MARKER + ".")):
        why = f"is the name of this cache's completion marker ({COMPLETE_MARKER})"
    elif why is None and name.endswith(PART_SUFFIX):
        why = f"ends in {PART_SUFFIX}, which this cache uses for unfinished downloads"
    if why:
        raise WeightsError(f"{source}: the manifest's file name {name!r} {why}; it was refused and nothing was fetched")


def _status_error(url: str, status: int, reason: str | None) -> str:
    hints = {
        404: "the file is not there: check the source against the mirror's listing",
        401: "the server wants credentials; the mirror's byte port needs none",
        403: "the server refused access; the mirror's byte port (:8081) is open to nodes",
    }
    hint = hints.get(status, "the server refused the download")
    return f"{url} answered {status} {reason or ''}".rstrip() + f": {hint}"


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _check_space(directory: Path, needed: int, url: str) -> None:
    free = download.lacking_space(directory, needed)
    if free is not None:
        raise WeightsError(
            f"{url} needs {needed / 1e9:.1f} GB more but {directory} has {free / 1e9:.1f} GB free; "
            "free space there (llmgw ctl weights --collect removes weights nothing uses) and try again"
        )


def _dir_bytes(directory: Path) -> int:
    total = 0
    with contextlib.suppress(FileNotFoundError):
        for child in directory.iterdir():
            with contextlib.suppress(FileNotFoundError):
                st = child.lstat()
                if stat.S_ISREG(st.st_mode):
                    total += st.st_size
    return total
