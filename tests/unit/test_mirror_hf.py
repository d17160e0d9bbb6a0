"""hf: sources against a Hugging Face stand-in: API shapes, a 302 to a CDN, a gated repo, shards, LFS oids."""

from __future__ import annotations

import hashlib

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from test_mirror_gguf import gguf_bytes

from llmgw.huggingface import is_gated
from llmgw.mirror.fetcher import Manager
from llmgw.mirror.layout import MirrorError

COMMIT = "c0ffee" * 6 + "abcd"
TOKEN = "hf_secret"
ONE = gguf_bytes(3, tail=5000)
SHARDS = {f"q4/m-{i:05d}-of-00003.gguf": gguf_bytes(3, tail=1000 + i) for i in (1, 2, 3)}


class HF:
    def __init__(self) -> None:
        self.files = {"model.gguf": ONE, "bad.gguf": ONE + b"x", **SHARDS}
        self.oids = {p: hashlib.sha256(b).hexdigest() for p, b in self.files.items()}
        self.oids["bad.gguf"] = "0" * 64  # listed checksum the bytes will not match
        self.cdn_auth: list[str | None] = []
        self.hub_auth: list[str | None] = []

    def gated(self, repo: str) -> bool:
        return repo == "gated"

    async def info(self, request: web.Request) -> web.Response:
        repo = request.match_info["repo"]
        if repo == "missing":
            return web.json_response({"error": "Repository not found"}, status=404)
        return web.json_response({"id": f"org/{repo}", "sha": COMMIT, "gated": "manual" if self.gated(repo) else False})

    async def tree(self, request: web.Request) -> web.Response:
        assert request.match_info["rev"] == COMMIT and request.query.get("recursive") == "1"
        return web.json_response(
            [{"type": "directory", "path": "q4"}]
            + [
                {"type": "file", "path": p, "size": 134, "lfs": {"oid": self.oids[p], "size": len(b)}}
                for p, b in self.files.items()
            ]
        )

    async def resolve(self, request: web.Request) -> web.Response:
        repo, rev, path = request.match_info["repo"], request.match_info["rev"], request.match_info["path"]
        auth = request.headers.get("Authorization")
        self.hub_auth.append(auth)
        if rev != COMMIT:
            return web.Response(status=404)
        if self.gated(repo) and auth != f"Bearer {TOKEN}":
            return web.Response(status=401, text="Access to this model is restricted")
        raise web.HTTPFound(str(self.cdn.make_url(f"/blobs/{path}")))

    async def blob(self, request: web.Request) -> web.Response:
        self.cdn_auth.append(request.headers.get("Authorization"))
        body = self.files[request.match_info["path"]]
        rng = request.headers.get("Range")
        if rng:
            a, b = rng.split("=")[1].split("-")
            end = min(int(b), len(body) - 1) if b else len(body) - 1
            return web.Response(
                status=206, body=body[int(a) : end + 1], headers={"Content-Range": f"bytes {a}-{end}/{len(body)}"}
            )
        return web.Response(body=body)

    async def __aenter__(self) -> HF:
        cdn = web.Application()
        cdn.router.add_get("/blobs/{path:.+}", self.blob)
        self.cdn = TestServer(cdn)
        await self.cdn.start_server()
        hub = web.Application()
        hub.router.add_get("/api/models/{org}/{repo}", self.info)
        hub.router.add_get("/api/models/{org}/{repo}/tree/{rev}", self.tree)
        hub.router.add_get("/{org}/{repo}/resolve/{rev}/{path:.+}", self.resolve)
        self.hub = TestServer(hub)
        await self.hub.start_server()
        # The CDN must be a different host for the token test to mean anything.
        assert self.cdn.port != self.hub.port
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.hub.close()
        await self.cdn.close()

    @property
    def endpoint(self) -> str:
        return str(self.hub.make_url("")).rstrip("/")


@pytest.fixture
async def hf():
    async with HF() as h:
        yield h


def manager(tmp_path, hf: HF, token: str | None = "") -> Manager:
    # The hub is the configured endpoint (fetched from on loopback), its CDN another loopback port.
    return Manager(
        tmp_path / "root",
        hf_endpoint=hf.endpoint,
        hf_token=token,
        architectures=frozenset({"llama"}),
        allow_local_sources=True,
    )


async def test_one_file_pinned_to_the_commit_through_the_redirect(hf, tmp_path):
    m = manager(tmp_path, hf)
    try:
        await m.fetch("hf:org/repo/model.gguf", "tiny", "v1")
        st = await m.wait("tiny", "v1")
    finally:
        await m.close()
    assert st.state == "present" and st.files[0].sha256 == hashlib.sha256(ONE).hexdigest()
    assert st.files[0].source == f"hf:org/repo/model.gguf@{COMMIT}"


async def test_a_shard_set_is_one_version(hf, tmp_path):
    m = manager(tmp_path, hf)
    try:
        await m.fetch("hf:org/repo/q4/m-00002-of-00003.gguf", "big", "v1")
        st = await m.wait("big", "v1")
        with pytest.raises(MirrorError, match="--as"):
            await m.fetch("hf:org/repo/q4/m-00001-of-00003.gguf", "big", "v2", as_name="x.gguf")
    finally:
        await m.close()
    assert st.state == "present"
    assert [f.name for f in st.files] == [f"m-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]
    assert st.size == sum(len(b) for b in SHARDS.values())


async def test_wrong_lfs_checksum_is_refused_and_not_kept(hf, tmp_path):
    m = manager(tmp_path, hf)
    try:
        await m.fetch("hf:org/repo/bad.gguf", "bad", "v1")
        st = await m.wait("bad", "v1")
    finally:
        await m.close()
    assert st.state == "failed" and "0" * 64 in st.reason and hashlib.sha256(ONE + b"x").hexdigest() in st.reason
    assert [p.name for p in (tmp_path / "root" / "bad" / "v1").iterdir()] == [".llmgw.json"]


async def test_gated_repo_needs_the_token_which_never_reaches_the_cdn(hf, tmp_path):
    m = manager(tmp_path, hf, token="")
    try:
        with pytest.raises(MirrorError, match="gated: accept its terms on huggingface.co and set HF_TOKEN"):
            await m.fetch("hf:org/gated/model.gguf", "g", "v1")
    finally:
        await m.close()
    m = manager(tmp_path, hf, token=TOKEN)
    try:
        await m.fetch("hf:org/gated/model.gguf", "g", "v1")
        assert (await m.wait("g", "v1")).state == "present"
    finally:
        await m.close()
    assert f"Bearer {TOKEN}" in hf.hub_auth
    assert hf.cdn_auth and all(a is None for a in hf.cdn_auth)


async def test_the_token_comes_from_the_environment(monkeypatch, hf, tmp_path):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HUGGING_FACE_HUB_TOKEN", TOKEN)
    assert Manager(tmp_path, hf_token=None).hf_token == TOKEN
    monkeypatch.setenv("HF_TOKEN", "other")
    assert Manager(tmp_path, hf_token=None).hf_token == "other"


async def test_unknown_repo_and_file_and_bad_sources(hf, tmp_path):
    m = manager(tmp_path, hf)
    try:
        with pytest.raises(MirrorError, match="not found"):
            await m.fetch("hf:org/missing/model.gguf", "x", "v1")
        with pytest.raises(MirrorError, match="has no nope.gguf"):
            await m.fetch("hf:org/repo/nope.gguf", "x", "v1")
        with pytest.raises(MirrorError, match="hf:ORG/REPO/FILE"):
            await m.fetch("hf:org/repo", "x", "v1")
        with pytest.raises(MirrorError, match="has no .*m-00002-of-00003"):
            hf.files.pop("q4/m-00002-of-00003.gguf")
            await m.fetch("hf:org/repo/q4/m-00001-of-00003.gguf", "x", "v1")
    finally:
        await m.close()
    assert m.list() == []


@pytest.mark.parametrize(
    "value,want",
    [(False, False), (True, True), ("auto", True), ("manual", True), ("", False), ("false", False), (None, False)],
)
def test_gated_is_read_from_bool_or_string(value, want):
    assert is_gated(value) is want
