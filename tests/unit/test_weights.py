"""Weights on a node (llmgw.agent.weights) against a local aiohttp server.

Reproduces the original's weights tests (spec/data.md §5.11) and adds the
single-file fetch: single flight, Range resume, a server ignoring Range,
length checks, progress, and what removal may touch.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
from pathlib import Path

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from llmgw.agent import weights as w
from llmgw.agent.weights import COMPLETE_MARKER, SourceKind, WeightsCache, WeightsError
from llmgw.testing.waiting import async_until

BLOB = bytes(range(256)) * 4096  # 1 MiB, every byte position distinguishable


class Origin:
    """A file server whose misbehaviour each test chooses."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.manifests: dict[str, object] = {}  # path -> JSON body (or raw bytes)
        self.html: set[str] = set()
        self.requests: list[tuple[str, str | None]] = []
        self.cut_after: dict[str, list[int]] = {}  # close after N body bytes, one entry per request
        self.ignore_range: set[str] = set()
        self.no_length: set[str] = set()
        self.promise: dict[str, int] = {}  # a Content-Length other than the truth
        self.gate: asyncio.Event | None = None
        self.status: dict[str, int] = {}
        self.cache_root = Path("/nonexistent")  # where the client's .part files appear

    async def handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        rng = request.headers.get("Range")
        self.requests.append((path, rng))
        if self.gate is not None:
            await self.gate.wait()
        if path in self.status:
            return web.Response(status=self.status[path], text="no")
        if path in self.html:
            return web.Response(text="<html><body><a href='x.gguf'>x.gguf</a></body></html>", content_type="text/html")
        if path in self.manifests:
            body = self.manifests[path]
            raw = body if isinstance(body, bytes) else orjson.dumps(body)
            return web.Response(body=raw, content_type="application/json")
        if path not in self.files:
            return web.Response(status=404, text="404: Not Found")
        data = self.files[path]
        start = 0
        resp = web.StreamResponse()
        if rng and path not in self.ignore_range:
            start = int(re.fullmatch(r"bytes=(\d+)-", rng).group(1))
            if start >= len(data):
                resp.set_status(416)
                resp.headers["Content-Range"] = f"bytes */{len(data)}"
                resp.content_length = 0
                await resp.prepare(request)
                return resp
            resp.set_status(206)
            resp.headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        body = data[start:]
        if path in self.no_length:
            resp.enable_chunked_encoding()
        else:
            resp.content_length = self.promise.get(path, len(body))
        await resp.prepare(request)
        cuts = self.cut_after.get(path)
        if cuts:
            n = cuts.pop(0)
            await resp.write(body[:n])
            await self.until_received(start + n)
            request.transport.close()  # the connection drops mid-body
            return resp
        for i in range(0, len(body), 65536):
            await resp.write(body[i : i + 65536])
        if path in self.promise and self.promise[path] > len(body):
            await self.until_received(start + len(body))
            request.transport.close()  # promised more than it had
            return resp
        await resp.write_eof()
        return resp

    async def until_received(self, n: int) -> None:
        # aiohttp's client drops bytes still in its buffer when the connection
        # breaks; a real cut comes after the client has written what it read.
        await async_until(
            lambda: any(p.stat().st_size >= n for p in self.cache_root.rglob("*.part")),
            what=f"the client to have written {n} bytes",
        )

    def count(self, path: str) -> int:
        return sum(1 for p, _ in self.requests if p == path)


@pytest.fixture
async def origin():
    o = Origin()
    app = web.Application()
    app.router.add_route("GET", "/{tail:.*}", o.handle)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    o.base = f"http://127.0.0.1:{server.port}"
    try:
        yield o
    finally:
        if o.gate is not None:
            o.gate.set()
        await server.close()


@pytest.fixture
async def cache(tmp_path, origin):
    c = WeightsCache(tmp_path / "weights", retry_delay=0, attempts=3)
    origin.cache_root = c.root
    try:
        yield c
    finally:
        await c.aclose()


def listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


# ---------------------------------------------------------------- sources


def test_only_a_trailing_slash_means_a_set(tmp_path):
    assert w.classify("http://mirror:8081/m/v/") is SourceKind.SET_URL
    assert w.classify("http://mirror:8081/m/v/file.gguf") is SourceKind.FILE_URL
    assert w.classify("https://models.internal/x.gguf") is SourceKind.FILE_URL
    assert w.classify(str(tmp_path) + "/") is SourceKind.LOCAL_PATH
    assert w.classify("./models/x.gguf") is SourceKind.LOCAL_PATH
    assert w.classify("~/models/x.gguf") is SourceKind.LOCAL_PATH
    assert w.classify("Qwen/Qwen2.5-7B-Instruct") is SourceKind.MODEL_ID
    assert w.classify("hf:Qwen/Qwen2.5-0.5B-Instruct-GGUF/q4.gguf") is SourceKind.FILE_URL
    assert not w.is_set("Qwen/Qwen2.5-7B-Instruct")


@pytest.mark.parametrize(
    ("source", "words"),
    [
        ("", "empty"),
        (" http://m/x.gguf", "spaces"),
        ("ftp://m/x.gguf", "cannot fetch"),
        ("s3://bucket/x.gguf", "cannot fetch"),
        ("http:///x.gguf", "no host"),
        ("http://m:99999/x.gguf", "port"),
        ("http://mirror:8081/", "names no file"),
        ("hf:Qwen/only-a-repo", "hf:ORG/REPO/FILE"),
        ("hf:Qwen/repo/../x.gguf", "hf:ORG/REPO/FILE"),
        ("hf:Qwen/repo/", "mirror"),
    ],
)
def test_a_malformed_source_is_refused_with_its_reason(source, words):
    with pytest.raises(WeightsError, match=re.escape(words)):
        w.classify(source)


def test_cache_names_are_stable_safe_and_distinct():
    a = w.cache_name("http://mirror:8081/qwen/2026-03/model-q4.gguf")
    assert a == w.cache_name("http://mirror:8081/qwen/2026-03/model-q4.gguf")
    assert a.endswith("-mirror_8081_qwen_2026-03_model-q4.gguf")
    assert re.fullmatch(r"[0-9a-f]{16}-[A-Za-z0-9._-]+", a)
    # Same sanitised text, different sources: the hash keeps them apart.
    b = w.cache_name("http://mirror:8081/qwen/2026-03/model q4.gguf")
    c = w.cache_name("http://mirror:8081/qwen_2026-03/model_q4.gguf")
    assert len({a, b, c}) == 3
    # A file and the version holding it never share a name.
    assert w.cache_name("http://m/q/v/") != w.cache_name("http://m/q/v")
    weird = w.cache_name("http://m/" + "../" * 5 + "é/" + "x" * 400 + ".gguf?a=/b")
    assert "/" not in weird and ".." not in weird and len(weird) < 200 and weird.endswith(".gguf")
    with pytest.raises(WeightsError, match="not a URL"):
        w.cache_name("Qwen/Qwen2.5-7B-Instruct")


async def test_a_model_id_and_a_local_path_pass_through(cache, tmp_path):
    assert await cache.resolve("Qwen/Qwen2.5-7B-Instruct") == "Qwen/Qwen2.5-7B-Instruct"
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    assert await cache.resolve(str(model)) == str(model)
    with pytest.raises(WeightsError, match="does not exist on this node"):
        await cache.resolve(str(tmp_path / "missing.gguf"))
    assert not cache.root.exists()  # nothing fetched, nothing made
    with pytest.raises(WeightsError, match="not a URL"):
        await cache.fetch("Qwen/Qwen2.5-7B-Instruct")


def test_hf_sources_are_fetched_from_the_hub(tmp_path):
    c = WeightsCache(tmp_path, hf_endpoint="http://hub.internal/")
    assert (
        c.url_for("hf:Qwen/Qwen2.5-GGUF/sub/q 4.gguf")
        == "http://hub.internal/Qwen/Qwen2.5-GGUF/resolve/main/sub/q%204.gguf"
    )
    assert c.url_for("http://m/x.gguf") == "http://m/x.gguf"


# ---------------------------------------------------------------- one file


async def test_a_file_is_fetched_into_the_cache_and_not_again(origin, cache):
    origin.files["/m/v/model.gguf"] = BLOB
    src = origin.base + "/m/v/model.gguf"
    path = await cache.fetch(src)
    assert path == cache.path_for(src) and path.parent == cache.root
    assert path.read_bytes() == BLOB
    assert not path.with_name(path.name + ".part").exists()
    assert await cache.resolve(src) == str(path)
    assert origin.count("/m/v/model.gguf") == 1
    [held] = cache.fetched()
    assert (held.source, held.bytes, held.complete, held.is_set) == (src, len(BLOB), True, False)


async def test_concurrent_fetches_of_one_source_make_one_download(origin, cache):
    origin.files["/big.gguf"] = BLOB
    origin.gate = asyncio.Event()
    src = origin.base + "/big.gguf"
    seen: list[list[tuple[int, int | None]]] = [[] for _ in range(8)]
    waiters = [asyncio.create_task(cache.fetch(src, lambda d, t, i=i: seen[i].append((d, t)))) for i in range(8)]
    await async_until(lambda: origin.requests, what="the origin to be asked")
    await asyncio.sleep(0.05)  # a pause in which a second download would start, were it let
    assert cache.is_fetching(src)
    origin.gate.set()
    paths = await asyncio.gather(*waiters)
    assert len(set(paths)) == 1 and paths[0].read_bytes() == BLOB
    assert origin.count("/big.gguf") == 1
    for reports in seen:  # every shard sees the one download finish
        assert reports[-1] == (len(BLOB), len(BLOB))
    assert not cache.is_fetching(src)


async def test_concurrent_waiters_share_one_error(origin, cache):
    origin.gate = asyncio.Event()
    src = origin.base + "/absent.gguf"
    waiters = [asyncio.create_task(cache.fetch(src)) for _ in range(4)]
    await async_until(lambda: origin.requests, what="the origin to be asked")
    origin.gate.set()
    results = await asyncio.gather(*waiters, return_exceptions=True)
    assert all(isinstance(r, WeightsError) and "404" in str(r) for r in results)
    assert origin.count("/absent.gguf") == 1
    assert listing(cache.root) == []


async def test_an_interrupted_download_resumes_with_range(origin, cache):
    origin.files["/f.gguf"] = BLOB
    origin.cut_after["/f.gguf"] = [300_000, 200_000]
    path = await cache.fetch(origin.base + "/f.gguf")
    assert path.read_bytes() == BLOB
    assert [r for p, r in origin.requests] == [None, "bytes=300000-", "bytes=500000-"]


async def test_a_part_left_by_an_earlier_fetch_is_resumed(origin, tmp_path):
    origin.cache_root = tmp_path
    origin.files["/f.gguf"] = BLOB
    origin.cut_after["/f.gguf"] = [400_000, 0]  # then no progress at all
    src = origin.base + "/f.gguf"
    async with WeightsCache(tmp_path, retry_delay=0, attempts=1) as first:
        with pytest.raises(WeightsError, match="next fetch resumes"):
            await first.fetch(src)
        target = first.path_for(src)
        assert not target.exists()  # a partial file is never visible under the name
        assert target.with_name(target.name + ".part").stat().st_size == 400_000
    async with WeightsCache(tmp_path, retry_delay=0) as second:
        assert (await second.fetch(src)).read_bytes() == BLOB
    assert origin.requests[-1] == ("/f.gguf", "bytes=400000-")


async def test_a_server_ignoring_range_restarts_the_file(origin, cache):
    origin.files["/f.gguf"] = BLOB
    origin.ignore_range.add("/f.gguf")
    origin.cut_after["/f.gguf"] = [250_000]
    path = await cache.fetch(origin.base + "/f.gguf")
    assert path.read_bytes() == BLOB  # not the first 250 kB twice
    assert [r for _, r in origin.requests] == [None, "bytes=250000-"]


async def test_416_means_the_part_was_already_whole(origin, cache):
    origin.files["/f.gguf"] = BLOB
    src = origin.base + "/f.gguf"
    part = cache.path_for(src).with_name(cache.path_for(src).name + ".part")
    cache.root.mkdir(parents=True)
    part.write_bytes(BLOB)
    path = await cache.fetch(src)
    assert path.read_bytes() == BLOB and not part.exists()
    assert origin.requests == [("/f.gguf", f"bytes={len(BLOB)}-")]


async def test_a_short_body_is_refused_and_nothing_is_left_as_the_target(origin, cache):
    origin.files["/f.gguf"] = BLOB
    origin.promise["/f.gguf"] = len(BLOB) + 1000  # promises more than it sends
    origin.ignore_range.add("/f.gguf")  # and starts again every time
    src = origin.base + "/f.gguf"
    with pytest.raises(WeightsError, match="did not recover after 3 attempts"):
        await cache.fetch(src)
    assert not cache.path_for(src).exists()
    assert [h.complete for h in cache.fetched()] == [False]
    # Three attempts in a row without a byte more than before; how many came
    # first depends on how much of each body the client had read at the cut.
    assert origin.count("/f.gguf") >= 4


async def test_a_plain_refusal_is_not_retried(origin, cache):
    origin.status["/f.gguf"] = 403
    with pytest.raises(WeightsError, match="403"):
        await cache.fetch(origin.base + "/f.gguf")
    assert origin.count("/f.gguf") == 1
    assert listing(cache.root) == []


async def test_progress_counts_bytes_against_the_promised_length(origin, cache):
    origin.files["/f.gguf"] = BLOB
    reports: list[tuple[int, int | None]] = []
    await cache.fetch(origin.base + "/f.gguf", lambda d, t: reports.append((d, t)))
    assert reports[0] == (0, len(BLOB)) and reports[-1] == (len(BLOB), len(BLOB))
    assert all(t == len(BLOB) for _, t in reports)
    assert [d for d, _ in reports] == sorted(d for d, _ in reports)


async def test_progress_without_a_length_invents_no_total(origin, cache):
    origin.files["/f.gguf"] = BLOB
    origin.no_length.add("/f.gguf")
    reports: list[tuple[int, int | None]] = []
    path = await cache.fetch(origin.base + "/f.gguf", lambda d, t: reports.append((d, t)))
    assert path.read_bytes() == BLOB
    assert all(t is None for _, t in reports) and reports[-1] == (len(BLOB), None)


async def test_a_broken_progress_callback_does_not_break_the_download(origin, cache):
    origin.files["/f.gguf"] = BLOB

    def explode(done, total):
        raise RuntimeError("boom")

    assert (await cache.fetch(origin.base + "/f.gguf", explode)).read_bytes() == BLOB


async def test_the_last_waiter_leaving_stops_the_download_and_keeps_the_part(origin, cache):
    origin.files["/f.gguf"] = BLOB
    origin.gate = asyncio.Event()
    src = origin.base + "/f.gguf"
    task = asyncio.create_task(cache.fetch(src))
    await async_until(lambda: origin.requests, what="the origin to be asked")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await async_until(lambda: not cache.is_fetching(src), what="the download to stop")
    assert not cache.is_fetching(src)
    origin.gate.set()
    assert (await cache.fetch(src)).read_bytes() == BLOB


# ---------------------------------------------------------------- sets


def manifest(files: dict[str, bytes]) -> dict:
    return {
        "model": "m",
        "version": "v",
        "files": [{"name": n, "bytes": len(b)} for n, b in files.items()],
        "bytes": sum(len(b) for b in files.values()),
    }


SET = {
    "model-00001-of-00002.gguf": BLOB[:400_000],
    "model-00002-of-00002.gguf": BLOB[400_000:],
    "config.json": b'{"architectures": ["LlamaForCausalLM"]}',
}


def serve_set(origin: Origin, files: dict[str, bytes] = SET) -> str:
    origin.manifests["/m/v/"] = manifest(files)
    for name, body in files.items():
        origin.files[f"/m/v/{name}"] = body
    return origin.base + "/m/v/"


async def test_a_set_is_fetched_into_one_directory(origin, cache, monkeypatch):
    src = serve_set(origin)
    order: list[str] = []
    real_replace = os.replace
    monkeypatch.setattr(w.os, "replace", lambda a, b: (order.append(Path(b).name), real_replace(a, b)))
    reports: list[tuple[int, int | None]] = []
    directory = await cache.fetch(src, lambda d, t: reports.append((d, t)))
    assert directory == cache.path_for(src) and directory.is_dir()
    for name, body in SET.items():
        assert (directory / name).read_bytes() == body
    assert order.index(COMPLETE_MARKER) == len(order) - 2  # the marker last, then only the index
    assert order[-1] == w.SOURCES_INDEX
    marker = orjson.loads((directory / COMPLETE_MARKER).read_bytes())
    assert marker["source"] == src and len(marker["files"]) == 3
    total = sum(len(b) for b in SET.values())
    assert reports[-1] == (total, total) and all(t == total for _, t in reports)
    assert w.first_gguf(directory).name == "model-00001-of-00002.gguf"
    [held] = cache.fetched()
    assert held.is_set and held.complete and held.source == src and held.bytes >= total


async def test_a_finished_set_is_not_fetched_again(origin, cache):
    src = serve_set(origin)
    await cache.fetch(src)
    before = len(origin.requests)
    assert await cache.resolve(src) == str(cache.path_for(src))
    assert len(origin.requests) == before


async def test_a_half_fetched_set_is_not_treated_as_finished(origin, cache):
    src = serve_set(origin)
    origin.status["/m/v/model-00002-of-00002.gguf"] = 503
    with pytest.raises(WeightsError, match="503"):
        await cache.fetch(src)
    directory = cache.path_for(src)
    assert not (directory / COMPLETE_MARKER).exists()
    assert [h.complete for h in cache.fetched()] == [False]
    del origin.status["/m/v/model-00002-of-00002.gguf"]
    origin.requests.clear()
    await cache.fetch(src)
    assert (directory / COMPLETE_MARKER).exists()
    # The file already there whole was not fetched again; the missing ones were.
    assert sorted(p for p, _ in origin.requests) == ["/m/v/", "/m/v/config.json", "/m/v/model-00002-of-00002.gguf"]


async def test_a_file_already_there_at_the_right_size_is_not_refetched(origin, cache):
    src = serve_set(origin)
    directory = cache.path_for(src)
    directory.mkdir(parents=True)
    (directory / "config.json").write_bytes(SET["config.json"])
    (directory / "model-00001-of-00002.gguf").write_bytes(b"short")  # wrong size: fetched again
    await cache.fetch(src)
    assert origin.count("/m/v/config.json") == 0
    assert origin.count("/m/v/model-00001-of-00002.gguf") == 1
    assert (directory / "model-00001-of-00002.gguf").read_bytes() == SET["model-00001-of-00002.gguf"]


async def test_a_set_file_is_resumed_after_an_interruption(origin, cache):
    src = serve_set(origin)
    origin.cut_after["/m/v/model-00002-of-00002.gguf"] = [100_000]
    directory = await cache.fetch(src)
    assert (directory / "model-00002-of-00002.gguf").read_bytes() == SET["model-00002-of-00002.gguf"]
    assert ("/m/v/model-00002-of-00002.gguf", "bytes=100000-") in origin.requests


@pytest.mark.parametrize(
    "name", ["../evil.gguf", "sub/x.gguf", "..\\x.gguf", "/etc/passwd", "..", ".", "", COMPLETE_MARKER, "x.gguf.part"]
)
async def test_a_filename_that_escapes_the_directory_is_refused(origin, cache, name):
    origin.manifests["/m/v/"] = {"files": [{"name": "ok.gguf", "bytes": 4}, {"name": name, "bytes": 4}]}
    origin.files["/m/v/ok.gguf"] = b"GGUF"
    with pytest.raises(WeightsError, match="refused and nothing was fetched"):
        await cache.fetch(origin.base + "/m/v/")
    assert listing(cache.root) == []  # refused before anything was written
    assert [p for p, _ in origin.requests] == ["/m/v/"]


async def test_a_directory_listing_is_not_a_manifest(origin, cache):
    origin.html.add("/m/v/")
    with pytest.raises(WeightsError, match=r"answered an HTML page, not a manifest.*byte port \(:8081\)"):
        await cache.fetch(origin.base + "/m/v/")
    assert listing(cache.root) == []


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (b"not json", "did not answer with a manifest"),
        ([1, 2], "did not answer with a manifest"),
        ({"files": [{"name": "a.gguf"}]}, "no size in bytes"),
        ({"files": [{"name": "a.gguf", "size": 3}]}, "no size in bytes"),
        ({"files": [{"name": "a.gguf", "bytes": 1}, {"name": "a.gguf", "bytes": 1}]}, "twice"),
        ({"files": []}, "lists no files"),
    ],
)
async def test_a_malformed_manifest_is_refused(origin, cache, body, words):
    origin.manifests["/m/v/"] = body
    with pytest.raises(WeightsError, match=words):
        await cache.fetch(origin.base + "/m/v/")
    assert listing(cache.root) == []


async def test_a_missing_version_says_so(origin, cache):
    with pytest.raises(WeightsError, match="404.*no such version"):
        await cache.fetch(origin.base + "/m/nope/")


async def test_a_file_whose_size_disagrees_with_the_manifest_is_refused(origin, cache):
    files = {"a.gguf": BLOB[:1000]}
    src = serve_set(origin, files)
    origin.files["/m/v/a.gguf"] = BLOB[:900]
    with pytest.raises(WeightsError, match="manifest promises 1000"):
        await cache.fetch(src)
    directory = cache.path_for(src)
    assert not (directory / "a.gguf").exists() and not (directory / "a.gguf.part").exists()
    assert not (directory / COMPLETE_MARKER).exists()


# ---------------------------------------------------------------- removal


async def test_remove_deletes_what_was_fetched(origin, cache):
    origin.files["/f.gguf"] = BLOB
    file_src = origin.base + "/f.gguf"
    set_src = serve_set(origin)
    await cache.fetch(file_src)
    await cache.fetch(set_src)
    assert len(cache.fetched()) == 2
    removed = cache.remove(set_src)
    assert cache.path_for(set_src) in removed and not cache.path_for(set_src).exists()
    assert cache.remove(file_src) == [cache.path_for(file_src)]
    assert cache.fetched() == [] and cache.remove(file_src) == []  # asking twice is harmless


async def test_remove_by_reported_path(origin, cache, tmp_path):
    origin.files["/f.gguf"] = BLOB
    src = origin.base + "/f.gguf"
    await cache.fetch(src)
    [held] = cache.fetched()
    elsewhere = tmp_path / held.name
    elsewhere.write_bytes(b"not in the cache")
    for bad in (elsewhere, "relative/" + held.name, cache.root / "sub" / held.name, cache.root / ".." / held.name):
        with pytest.raises(WeightsError, match="not in the weights cache"):
            cache.remove_path(bad)
    assert elsewhere.exists() and held.path.exists()
    assert cache.remove_path(str(held.path)) == [held.path]


async def test_remove_touches_nothing_it_did_not_fetch(cache, tmp_path):
    with pytest.raises(WeightsError, match="never fetched it"):
        cache.remove("Qwen/Qwen2.5-7B-Instruct")
    with pytest.raises(WeightsError, match="never fetched it"):
        cache.remove(str(tmp_path))
    for bad in ("../etc", "x/../../y", "/etc/passwd", "0123456789abcdef-../x"):
        with pytest.raises(WeightsError, match="not a name this cache gives"):
            cache.remove_name(bad)


async def test_remove_refuses_links_out_of_the_cache(cache, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    precious = outside / "precious.gguf"
    precious.write_bytes(b"keep me")
    cache.root.mkdir(parents=True)
    src_file = "http://m/f.gguf"
    cache.path_for(src_file).symlink_to(precious)
    with pytest.raises(WeightsError, match="symbolic link"):
        cache.remove(src_file)
    src_set = "http://m/q/v/"
    cache.path_for(src_set).symlink_to(outside, target_is_directory=True)
    with pytest.raises(WeightsError, match="symbolic link"):
        cache.remove(src_set)
    # A link planted inside a fetched set stops the whole removal.
    src_set2 = "http://m/q/v2/"
    directory = cache.path_for(src_set2)
    directory.mkdir()
    (directory / "a.gguf").write_bytes(b"x")
    (directory / "b.gguf").symlink_to(precious)
    with pytest.raises(WeightsError, match="nothing was removed"):
        cache.remove(src_set2)
    assert (directory / "a.gguf").exists()  # a refusal changes nothing
    assert precious.read_bytes() == b"keep me" and outside.is_dir()


async def test_remove_refuses_while_a_fetch_is_running(origin, cache):
    origin.files["/f.gguf"] = BLOB
    origin.gate = asyncio.Event()
    src = origin.base + "/f.gguf"
    task = asyncio.create_task(cache.fetch(src))
    await async_until(lambda: origin.requests, what="the origin to be asked")
    with pytest.raises(WeightsError, match="being fetched"):
        cache.remove(src)
    origin.gate.set()
    await task


async def test_fetched_reports_only_its_own_names(cache):
    cache.root.mkdir(parents=True)
    (cache.root / "by-hand.gguf").write_bytes(b"mine")
    assert cache.fetched() == []


def test_source_hash_is_of_the_source_as_written():
    src = "http://mirror:8081/m/v/x.gguf"
    assert w.cache_name(src).startswith(hashlib.sha256(src.encode()).hexdigest()[:16])
