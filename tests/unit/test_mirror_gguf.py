"""GGUF header reading and the architecture check, against headers built here."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import socket
import struct
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from llmgw import gguf

REPO = Path(__file__).resolve().parents[2]


def gguf_bytes(version: int = 3, kv: list[tuple[str, object]] | None = None, tail: int = 0) -> bytes:
    """A GGUF header: strings, uint32s and string arrays are enough for these tests."""
    n = "<I" if version == 1 else "<Q"

    def s(text: str) -> bytes:
        b = text.encode()
        return struct.pack(n, len(b)) + b

    kv = kv if kv is not None else [("general.architecture", "llama"), ("general.name", "tiny")]
    out = b"GGUF" + struct.pack("<I", version) + struct.pack(n, 0) + struct.pack(n, len(kv))
    for key, value in kv:
        out += s(key)
        if isinstance(value, str):
            out += struct.pack("<I", 8) + s(value)
        elif isinstance(value, int):
            out += struct.pack("<I", 4) + struct.pack("<I", value)
        elif isinstance(value, list):
            out += struct.pack("<I", 9) + struct.pack("<I", 8) + struct.pack(n, len(value))
            out += b"".join(s(v) for v in value)
    return out + b"\0" * tail


@pytest.mark.parametrize("version", [1, 2, 3])
def test_headers_of_every_version_are_read(version):
    h = gguf.parse_header(
        gguf_bytes(version, [("general.architecture", "qwen2"), ("x.count", 7), ("tokenizer.tokens", ["a", "b"])])
    )
    assert h["version"] == version and h["kv_count"] == 3 and h["complete"]
    assert h["metadata"] == {"general.architecture": "qwen2", "x.count": 7, "tokenizer.tokens": ["a", "b"]}


def test_reading_stops_cleanly_once_the_architecture_is_seen():
    data = gguf_bytes(3, [("general.architecture", "llama"), ("tokenizer.tokens", ["x" * 100] * 50)])
    h = gguf.parse_header(data[:200])
    assert h["metadata"]["general.architecture"] == "llama" and not h["complete"]


def test_what_is_not_gguf_is_an_error():
    with pytest.raises(gguf.GGUFError, match="not a GGUF"):
        gguf.parse_header(b"<!doctype html><html>")
    with pytest.raises(gguf.GGUFError, match="version 9"):
        gguf.parse_header(b"GGUF" + struct.pack("<I", 9) + b"\0" * 16)
    with pytest.raises(gguf.GGUFError):  # cut before the architecture
        gguf.parse_header(gguf_bytes(3)[:30])


def test_gguf_judge_refuses_unknown_architectures_and_projector_files_with_the_way_out():
    known = frozenset({"llama", "qwen2"})
    ok = {"metadata": {"general.architecture": "llama"}}
    assert gguf.judge(ok, "http://h/m.gguf", known) is None
    why = gguf.judge({"metadata": {"general.architecture": "ggmlc"}}, "http://h/m.gguf", known)
    assert "cannot load architecture 'ggmlc'" in why and "--anyway" in why
    assert gguf.judge({"metadata": {"general.architecture": "ggmlc"}}, "http://h/m.gguf", frozenset()) is None
    for header, url in [
        ({"metadata": {"general.architecture": "clip"}}, "http://h/m.gguf"),
        ({"metadata": {"general.architecture": "llama", "general.type": "mmproj"}}, "http://h/m.gguf"),
        (ok, "http://h/mmproj-model-f16.gguf"),
    ]:
        assert "not a model on its own; it goes with a model as --mmproj" in gguf.judge(header, url, known)


def test_the_pinned_list_is_loaded():
    names = gguf.pinned_architectures()
    assert {"llama", "qwen2", "bert"} <= names and len(names) > 100
    assert "(unknown)" not in names
    assert "llama-cpp-python" in gguf.pinned_build()


def test_arch_names_are_parsed_from_llama_arch_cpp():
    src = """static const std::map<llm_arch, const char *> LLM_ARCH_NAMES = {
    { LLM_ARCH_CLIP,             "clip"             }, // dummy
    { LLM_ARCH_LLAMA,            "llama"            },
    { LLM_ARCH_UNKNOWN,          "(unknown)"        },
};
static const std::map<llm_kv, const char *> LLM_KV_NAMES = {
    { LLM_KV_GENERAL_TYPE, "general.type" },
};"""
    assert gguf.parse_arch_names(src) == ["clip", "llama"]


async def _server(routes: dict[str, bytes], hits: list | None = None) -> TestServer:
    async def handle(request: web.Request) -> web.StreamResponse:
        if hits is not None:
            hits.append(request.headers.get("Range"))
        body = routes.get(request.path)
        if body is None:
            return web.Response(status=404)
        rng = request.headers.get("Range")
        if rng:
            start, end = rng.split("=")[1].split("-")
            start, end = int(start), min(int(end), len(body) - 1)
            return web.Response(
                status=206, body=body[start : end + 1], headers={"Content-Range": f"bytes {start}-{end}/{len(body)}"}
            )
        return web.Response(body=body)

    app = web.Application()
    app.router.add_get("/{tail:.*}", handle)
    srv = TestServer(app)
    await srv.start_server()
    return srv


async def test_check_gguf_url_reads_only_the_head_and_grows_the_range():
    big = gguf_bytes(3, [("tokenizer.tokens", ["t" * 1000] * 400), ("general.architecture", "ggmlc")])
    hits: list = []
    srv = await _server(
        {"/ok.gguf": gguf_bytes(3, tail=10 << 20), "/big.gguf": big, "/junk.gguf": b"nothing like a header" * 10}, hits
    )
    try:
        assert await gguf.check_gguf_url(str(srv.make_url("/ok.gguf")), None, frozenset({"llama"})) is None
        assert hits == ["bytes=0-262143"]  # one small range, not the 10 MB file
        why = await gguf.check_gguf_url(str(srv.make_url("/big.gguf")), None, frozenset({"llama"}))
        assert "cannot load architecture 'ggmlc'" in why and len(hits) == 3
        # Unreadable or unreachable headers refuse nothing.
        assert await gguf.check_gguf_url(str(srv.make_url("/junk.gguf")), None, frozenset({"llama"})) is None
        assert await gguf.check_gguf_url(str(srv.make_url("/missing.gguf")), None, frozenset({"llama"})) is None
    finally:
        await srv.close()
    assert await gguf.check_gguf_url("http://127.0.0.1:1/x.gguf", None, frozenset({"llama"})) is None


def _pypi_reachable() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
        return True
    except OSError:
        return False


def test_the_committed_list_matches_the_pinned_sdist():
    """The list is derived from llama.cpp's source, never typed: re-derive and compare."""
    loader = importlib.machinery.SourceFileLoader(
        "gen_gguf_architectures", str(REPO / "scripts" / "gen-gguf-architectures")
    )
    spec = importlib.util.spec_from_loader(loader.name, loader)
    gen = importlib.util.module_from_spec(spec)
    loader.exec_module(gen)
    from llmgw.agent.provision import llamacpp_source as src

    cached = src.cache_dir() / "sdist" / src.SDIST_FILENAME
    if not cached.is_file() and not _pypi_reachable():
        pytest.skip("PyPI is unreachable and the sdist is not cached")
    text = gen.render(gen.derive(gen.obtain_sdist()))
    assert (REPO / "llmgw" / "gguf_architectures.txt").read_text(encoding="utf-8") == text
