"""The mirror's Manager against a plain file server stand-in (Range, cut-short answers).

The stand-in is on loopback, so these Managers are made with allow_local_sources."""

from __future__ import annotations

import asyncio
import hashlib
import json

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from test_mirror_gguf import gguf_bytes

from llmgw.mirror.fetcher import Manager
from llmgw.mirror.layout import MirrorError
from llmgw.testing.waiting import async_until

KNOWN = frozenset({"llama"})
MODEL = gguf_bytes(3, tail=300_000)


class Upstream:
    """Serves ``files`` with Range; ``cut[name]`` ends the body after that many bytes;
    ``gate`` holds bodies until set; ``gets`` records each GET's Range header."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {"model.gguf": MODEL, "page.gguf": b"<!DOCTYPE html><html>no</html>"}
        self.types: dict[str, str] = {}
        self.cut: dict[str, int] = {}
        self.gate: asyncio.Event | None = None
        self.gets: list[tuple[str, str | None]] = []
        self.srv: TestServer | None = None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        body = self.files.get(name)
        if body is None:
            return web.Response(status=404)
        rng = request.headers.get("Range")
        # The GGUF check's small ranges are not downloads; keep them out of the count.
        check = bool(rng and rng.startswith("bytes=0-") and not rng.endswith("-"))
        if not check:
            self.gets.append((name, rng))
        start, status, headers = 0, 200, {}
        if rng:
            a, b = rng.split("=")[1].split("-")
            start = int(a)
            end = min(int(b), len(body) - 1) if b else len(body) - 1
            status, headers["Content-Range"] = 206, f"bytes {start}-{end}/{len(body)}"
            body = body[start : end + 1]
        resp = web.StreamResponse(status=status, headers=headers)
        resp.content_type = self.types.get(name, "application/octet-stream")
        resp.content_length = len(body)
        await resp.prepare(request)
        if self.gate is not None and not check:
            await self.gate.wait()
        cut = None if check else self.cut.pop(name, None)
        if cut is not None:
            await resp.write(body[:cut])
            await asyncio.sleep(0.1)  # let the bytes leave before the drop
            request.transport.close()  # the connection drops mid-body
            return resp
        await resp.write(body)
        await resp.write_eof()
        return resp

    async def __aenter__(self) -> Upstream:
        app = web.Application()
        app.router.add_get("/files/{name}", self.handle)
        self.srv = TestServer(app)
        await self.srv.start_server()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.srv.close()

    def url(self, name: str) -> str:
        return str(self.srv.make_url(f"/files/{name}"))


@pytest.fixture
async def up():
    async with Upstream() as u:
        yield u


@pytest.fixture
async def mgr(tmp_path):
    m = Manager(tmp_path / "root", architectures=KNOWN, hf_token="", allow_local_sources=True)
    yield m
    await m.close()


async def test_download_lands_renamed_with_its_sha256(up, mgr, tmp_path):
    st = await mgr.fetch(up.url("model.gguf"), "tiny", "v1")
    assert st.state == "fetching"
    st = await mgr.wait("tiny", "v1")
    assert st.state == "present" and st.size == len(MODEL)
    f = st.files[0]
    assert f.name == "model.gguf" and f.sha256 == hashlib.sha256(MODEL).hexdigest() and f.source == up.url("model.gguf")
    vdir = tmp_path / "root" / "tiny" / "v1"
    assert (vdir / "model.gguf").read_bytes() == MODEL
    assert sorted(p.name for p in vdir.iterdir()) == [".llmgw.json", "model.gguf"]
    assert mgr.path_of("tiny", "v1", "model.gguf") == (vdir / "model.gguf").resolve()
    assert [(s.model, s.version) for s in mgr.list()] == [("tiny", "v1")]


async def test_interrupted_then_resumed_from_the_partial(up, mgr, tmp_path):
    up.cut["model.gguf"] = 100_000
    await mgr.fetch(up.url("model.gguf"), "tiny", "v1")
    st = await mgr.wait("tiny", "v1")
    assert st.state == "failed" and st.reason.startswith(f"the download ended at 100000 of {len(MODEL)} bytes")
    assert mgr.path_of("tiny", "v1", "model.gguf") is None
    assert (tmp_path / "root" / "tiny" / "v1" / ".model.gguf.part").stat().st_size == 100_000
    up.gets.clear()
    await mgr.fetch(up.url("model.gguf"), "tiny", "v1")
    st = await mgr.wait("tiny", "v1")
    assert st.state == "present" and st.files[0].sha256 == hashlib.sha256(MODEL).hexdigest()
    assert up.gets == [("model.gguf", "bytes=100000-")]


async def test_a_server_that_ignores_range_restarts_from_zero(mgr, tmp_path):
    vdir = tmp_path / "root" / "tiny" / "v1"
    vdir.mkdir(parents=True)
    (vdir / ".model.gguf.part").write_bytes(b"garbage that is not a prefix")
    gets = []

    async def no_range(request):  # answers 200 with the whole file whatever was asked
        gets.append(request.headers.get("Range"))
        return web.Response(body=MODEL)

    app = web.Application()
    app.router.add_get("/files/{name}", no_range)
    srv = TestServer(app)
    await srv.start_server()
    try:
        await mgr.fetch(str(srv.make_url("/files/model.gguf")), "tiny", "v1", anyway=True)
        st = await mgr.wait("tiny", "v1")
    finally:
        await srv.close()
    assert gets == ["bytes=28-"]
    assert st.state == "present" and st.files[0].sha256 == hashlib.sha256(MODEL).hexdigest()


async def test_truncated_answer_fails_with_the_reason_and_nothing_present(up, mgr):
    up.cut["model.gguf"] = 10
    await mgr.fetch(up.url("model.gguf"), "tiny", "v1", anyway=True)
    st = await mgr.wait("tiny", "v1")
    assert st.state == "failed" and "ended at 10 of" in st.reason
    assert [f.state for f in st.files] == ["failed"] and st.size == 0


async def test_html_is_refused(up, mgr):
    await mgr.fetch(up.url("page.gguf"), "tiny", "v1", anyway=True)
    st = await mgr.wait("tiny", "v1")
    assert st.state == "failed" and "web page" in st.reason
    up.types["page.gguf"] = "text/html"
    await mgr.fetch(up.url("page.gguf"), "tiny", "v2", anyway=True)
    st = await mgr.wait("tiny", "v2")
    assert st.state == "failed" and "text/html" in st.reason
    assert mgr.path_of("tiny", "v2", "page.gguf") is None


async def test_single_flight_and_no_removal_while_fetching(up, mgr):
    up.gate = asyncio.Event()
    a = await mgr.fetch(up.url("model.gguf"), "tiny", "v1")
    b = await mgr.fetch(up.url("model.gguf"), "tiny", "v1")
    assert a.state == b.state == "fetching"
    with pytest.raises(MirrorError, match="still downloading"):
        await mgr.remove("tiny", "v1")
    with pytest.raises(MirrorError, match="still downloading"):
        await mgr.remove_file("tiny", "v1", "model.gguf")
    assert mgr.path_of("tiny", "v1", "model.gguf") is None
    up.gate.set()
    st = await mgr.wait("tiny", "v1")
    assert st.state == "present"
    assert up.gets == [("model.gguf", None)]


async def test_a_version_is_never_overwritten(up, mgr):
    await mgr.fetch(up.url("model.gguf"), "tiny", "v1")
    await mgr.wait("tiny", "v1")
    with pytest.raises(MirrorError, match="already here; a version is never overwritten"):
        await mgr.fetch(up.url("model.gguf"), "tiny", "v1")
    with pytest.raises(MirrorError, match="already here"):
        await mgr.fetch(up.url("page.gguf"), "tiny", "v1", anyway=True)


async def test_restart_rebuilds_state_from_disk(up, mgr, tmp_path):
    root = tmp_path / "root"
    await mgr.fetch(up.url("model.gguf"), "good", "v1")
    await mgr.fetch(up.url("page.gguf"), "bad", "v1", anyway=True)
    await mgr.wait("good", "v1")
    await mgr.wait("bad", "v1")
    up.gate = asyncio.Event()
    await mgr.fetch(up.url("model.gguf"), "half", "v1")
    await async_until(
        lambda: mgr.status("half", "v1").files[0].bytes_done or (root / "half" / "v1" / ".model.gguf.part").exists(),
        what="the download to begin",
    )
    await mgr.close()  # cancels the download; its partial stays
    (root / "half" / "v1" / ".model.gguf.part").write_bytes(MODEL[:5000])

    again = Manager(root, architectures=KNOWN, allow_local_sources=True)
    try:
        by = {s.model: s for s in again.list()}
        assert by["good"].state == "present" and by["good"].files[0].sha256 == hashlib.sha256(MODEL).hexdigest()
        assert by["bad"].state == "failed" and "web page" in by["bad"].reason
        assert by["half"].state == "failed" and by["half"].reason == "interrupted at 5000 bytes; fetch again to resume"
        book = json.loads((root / "good" / "v1" / ".llmgw.json").read_text())
        assert book["files"]["model.gguf"]["source"] == up.url("model.gguf")
        up.gate.set()
        up.gets.clear()
        await again.fetch(up.url("model.gguf"), "half", "v1")
        assert (await again.wait("half", "v1")).state == "present"
        assert up.gets == [("model.gguf", "bytes=5000-")]
    finally:
        await again.close()


async def test_names_that_leave_their_level_are_refused(up, mgr):
    for model, version, as_name in [
        ("..", "v1", None),
        ("a/b", "v1", None),
        (".hidden", "v1", None),
        ("m", "..", None),
        ("m", "v1", "../x"),
        ("m", "v1", ".x"),
    ]:
        with pytest.raises(MirrorError):
            await mgr.fetch(up.url("model.gguf"), model, version, as_name=as_name)
    with pytest.raises(MirrorError, match="not a source"):
        await mgr.fetch("ftp://x/y", "m", "v1")
    assert mgr.status("..", "v1") is None and mgr.path_of("m", "v1", "../../etc/passwd") is None
    assert mgr.list() == []


async def test_hand_copied_files_are_listed_and_removed(tmp_path, mgr):
    vdir = tmp_path / "root" / "copied" / "2026-03"
    vdir.mkdir(parents=True)
    (vdir / "a.gguf").write_bytes(b"aaaa")
    (vdir / "b.gguf").write_bytes(b"bb")
    (vdir / ".scratch").write_bytes(b"hidden")
    (st,) = mgr.list()
    assert (st.model, st.version, st.state, st.size) == ("copied", "2026-03", "present", 6)
    assert [f.name for f in st.files] == ["a.gguf", "b.gguf"] and st.files[0].sha256 is None
    assert mgr.path_of("copied", "2026-03", ".scratch") is None
    await mgr.remove_file("copied", "2026-03", "a.gguf")
    assert [f.name for f in mgr.status("copied", "2026-03").files] == ["b.gguf"]
    await mgr.remove_file("copied", "2026-03", "b.gguf")
    assert not (tmp_path / "root" / "copied").exists()
    with pytest.raises(MirrorError, match="not in this mirror"):
        await mgr.remove("copied", "2026-03")


async def test_gguf_check_before_fetching_and_anyway(up, tmp_path):
    up.files["odd.gguf"] = gguf_bytes(3, [("general.architecture", "ggmlc")], tail=1000)
    up.files["mmproj-f16.gguf"] = gguf_bytes(3, [("general.architecture", "clip")], tail=1000)
    mgr = Manager(tmp_path / "root", architectures=KNOWN, allow_local_sources=True)
    try:
        with pytest.raises(MirrorError, match="cannot load architecture 'ggmlc'.*--anyway"):
            await mgr.fetch(up.url("odd.gguf"), "odd", "v1")
        with pytest.raises(MirrorError, match="--mmproj"):
            await mgr.fetch(up.url("mmproj-f16.gguf"), "vis", "v1")
        assert mgr.list() == [] and up.gets == []
        await mgr.fetch(up.url("odd.gguf"), "odd", "v1", anyway=True)
        assert (await mgr.wait("odd", "v1")).state == "present"
        # An unreadable header refuses nothing.
        up.files["junk.gguf"] = b"\x00" * 5000
        await mgr.fetch(up.url("junk.gguf"), "junk", "v1")
        assert (await mgr.wait("junk", "v1")).state == "present"
    finally:
        await mgr.close()
    unknown = Manager(tmp_path / "root2", architectures=frozenset(), allow_local_sources=True)
    try:
        await unknown.fetch(up.url("odd.gguf"), "odd", "v1")
        assert (await unknown.wait("odd", "v1")).state == "present"
    finally:
        await unknown.close()
