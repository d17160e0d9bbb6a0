"""The mirror's byte listener and management API, served for real on loopback."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import ssl

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer, make_mocked_request
from test_mirror_serve_fake import FakeManager

from llmgw.agent.provision.fetch import parse_sha256_file
from llmgw.mirror.api import FORBIDDEN, ApiAccess, allow_list_middleware, api_app, references
from llmgw.mirror.layout import MirrorError
from llmgw.mirror.serve import manager_checksums, parse_allow, request_segments, weights_app
from llmgw.pki import init_ca, issue_client, issue_server
from llmgw.pki.tls import client_context, server_context
from llmgw.testing.waiting import async_until

DATA = bytes(range(256)) * 40  # 10240 bytes
TOKEN = "llmgw-mirror-test-token"
ACCESS = ApiAccess(token=TOKEN, token_file="/srv/models.api-token")
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SECRET = b"OUTSIDE-SECRET-BYTES"


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "models"
    root.mkdir()
    mgr = FakeManager(root)
    mgr.put("qwen", "2024-01-01", "q.gguf", DATA)
    mgr.put("qwen", "2024-01-01", "tok.json", b"{}", sha=False)
    mgr.put("llama.cpp", "b5000", "llama-b5000-bin-ubuntu-x64.zip", b"PK-archive")
    vdir = root / "qwen" / "2024-01-01"
    (vdir / ".q2.gguf.part").write_bytes(b"half")
    (vdir / ".llmgw.json").write_text("{}")
    outside = tmp_path / "secret.txt"
    outside.write_bytes(SECRET)
    (vdir / "link.gguf").symlink_to(outside)
    (root / "evil").symlink_to(tmp_path)  # a model directory pointing out of the root
    (tmp_path / "outdir").mkdir()
    (tmp_path / "outdir" / "secret.txt").write_bytes(SECRET)
    return root, mgr, outside


@pytest.fixture
async def weights(tree):
    root, mgr, _ = tree
    async with TestClient(TestServer(weights_app(root, manager_checksums(mgr)))) as client:
        yield client


async def raw_get(client: TestClient, target: str, method: str = "GET") -> tuple[int, bytes]:
    """Send the request line exactly as written: client libraries would normalise ../ away."""
    reader, writer = await asyncio.open_connection(client.host, client.port)
    writer.write(f"{method} {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    await writer.drain()
    data = await reader.read()
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


async def test_whole_file_and_head(weights):
    r = await weights.get("/qwen/2024-01-01/q.gguf")
    assert r.status == 200 and await r.read() == DATA
    assert r.headers.get("Accept-Ranges") == "bytes"
    h = await weights.head("/qwen/2024-01-01/q.gguf")
    assert h.status == 200 and h.headers["Content-Length"] == str(len(DATA)) and await h.read() == b""


async def test_range_206_and_416(weights):
    r = await weights.get("/qwen/2024-01-01/q.gguf", headers={"Range": "bytes=100-199"})
    assert r.status == 206 and await r.read() == DATA[100:200]
    assert r.headers["Content-Range"] == f"bytes 100-199/{len(DATA)}"
    r = await weights.get("/qwen/2024-01-01/q.gguf", headers={"Range": "bytes=10000-"})
    assert r.status == 206 and await r.read() == DATA[10000:]
    r = await weights.get("/qwen/2024-01-01/q.gguf", headers={"Range": f"bytes={len(DATA) + 5}-"})
    assert r.status == 416


async def test_no_compressed_sibling_is_swapped_in(weights, tree):
    root, _, _ = tree
    (root / "qwen" / "2024-01-01" / "q.gguf.gz").write_bytes(b"not the weights")
    r = await weights.get("/qwen/2024-01-01/q.gguf", headers={"Accept-Encoding": "gzip"}, auto_decompress=False)
    assert r.status == 200 and "Content-Encoding" not in r.headers and await r.read() == DATA


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH"])
async def test_the_weights_server_refuses_every_writing_method_as_read_only(weights, method):
    r = await weights.request(method, "/qwen/2024-01-01/q.gguf")
    assert r.status == 405 and (await r.text()).strip() == "the mirror is read-only"


async def test_manifest_get_and_head(weights):
    r = await weights.get("/qwen/2024-01-01/")
    assert r.status == 200 and r.content_type == "application/json"
    body = await r.json()
    assert body["model"] == "qwen" and body["version"] == "2024-01-01"
    # hidden bookkeeping, partial downloads and the link out of the root are not there
    assert [f["name"] for f in body["files"]] == ["q.gguf", "tok.json"]
    assert body["files"][0] == {"name": "q.gguf", "bytes": len(DATA), "sha256": hashlib.sha256(DATA).hexdigest()}
    assert "sha256" not in body["files"][1]
    assert body["bytes"] == len(DATA) + 2
    h = await weights.head("/qwen/2024-01-01/")
    assert h.status == 200 and h.content_type == "application/json"
    assert h.headers["Content-Length"] == r.headers["Content-Length"] and await h.read() == b""


@pytest.mark.parametrize(
    "path",
    [
        "/qwen/nope/",
        "/nope/2024-01-01/",
        "/qwen/",
        "/",
        "/qwen/2024-01-01/q.gguf/",
        "/qwen/2024-01-01",
        "/evil/secret.txt/",
        "/a/b/c/d",
    ],
)
async def test_unknown_is_404(weights, path):
    r = await weights.get(path)
    assert r.status == 404 and r.content_type == "text/plain"


@pytest.mark.parametrize(
    "target",
    [
        "/qwen/2024-01-01/.q2.gguf.part",
        "/qwen/2024-01-01/.llmgw.json",
        "/qwen/2024-01-01/%2Eq2.gguf.part",
        "/qwen/2024-01-01/../../secret.txt",
        "/../secret.txt",
        "/qwen/../../secret.txt",
        "/qwen/2024-01-01/%2e%2e/%2e%2e/%2e%2e/secret.txt",
        "/%2e%2e/secret.txt/x",
        "/qwen/%2e%2e%2f%2e%2e%2fsecret.txt/x",
        "/qwen/2024-01-01/..%2f..%2f..%2fsecret.txt",
        "/qwen/2024-01-01/%252e%252e/%252e%252e/secret.txt",
        "/qwen/2024-01-01/..%252f..%252fsecret.txt",
        "/qwen/2024-01-01/..\\..\\..\\secret.txt",
        "/qwen/2024-01-01/..%5c..%5c..%5csecret.txt",
        "/qwen/2024-01-01/link.gguf",
        "/qwen/2024-01-01/link.gguf.sha256",
        "/evil/outdir/secret.txt",
        "/evil/outdir/",
        "/qwen/2024-01-01/%2e%2e/%2e%2e/outdir/secret.txt",
        "//etc/passwd",
        "/qwen/2024-01-01/%00",
    ],
)
async def test_nothing_from_outside(weights, target):
    for method in ("GET", "HEAD"):
        status, body = await raw_get(weights, target, method)
        assert status == 404, target
        assert SECRET not in body and b"half" not in body


def test_request_segments_decode_paths_and_reject_traversal_and_odd_encodings():
    assert request_segments("/a/b/c?x=1") == ["a", "b", "c"]
    assert request_segments("/a/b/") == ["a", "b", ""]
    assert request_segments("/a%20b/v/f") == ["a b", "v", "f"]
    for bad in ("/a/../b", "/a/%2e%2e/b", "/a/%252e%252e/b", "/a\\b", "/a/.x", "//a", "/a/%ff/b"):
        assert request_segments(bad) is None, bad


async def test_the_weights_server_serves_a_sha256_sidecar_only_for_known_checksums(weights):
    r = await weights.get("/qwen/2024-01-01/q.gguf.sha256")
    text = await r.text()
    assert r.status == 200 and text == f"{hashlib.sha256(DATA).hexdigest()}  q.gguf\n"
    assert parse_sha256_file(text, "q.gguf") == hashlib.sha256(DATA).hexdigest()
    assert (await weights.get("/qwen/2024-01-01/tok.json.sha256")).status == 404  # checksum unknown
    assert (await weights.get("/qwen/2024-01-01/none.gguf.sha256")).status == 404


async def test_llama_cpp_release_base(weights):
    """An agent with release_url = <mirror>/llama.cpp fetches <base>/<tag>/<asset> and its .sha256."""
    base = "/llama.cpp"
    asset = "llama-b5000-bin-ubuntu-x64.zip"
    r = await weights.get(f"{base}/b5000/{asset}")
    assert r.status == 200 and await r.read() == b"PK-archive"
    r = await weights.get(f"{base}/b5000/{asset}.sha256")
    assert parse_sha256_file(await r.text(), asset) == hashlib.sha256(b"PK-archive").hexdigest()


# ---------------------------------------------------------------- the management API


@pytest.fixture
async def api(tmp_path):
    root = tmp_path / "models"
    root.mkdir()
    mgr = FakeManager(root)
    async with TestClient(TestServer(api_app(mgr, root, "http://mirror:8081", ACCESS)), headers=AUTH) as client:
        yield client, mgr


async def test_add_single_file_202(api):
    client, _mgr = api
    r = await client.post(
        "/v1/models", json={"source": "https://h/x/q.gguf?download=true", "model": "qwen", "version": "v1"}
    )
    body = await r.json()
    assert r.status == 202 and body["state"] == "fetching"
    assert body["bytes_done"] == 1 and body["bytes_total"] == 10
    assert body["url"] == "http://mirror:8081/qwen/v1/q.gguf"


async def test_add_as_and_anyway(api):
    client, mgr = api
    r = await client.post(
        "/v1/models",
        json={"source": "https://h/x/a.gguf", "model": "m", "version": "v", "as": "b.gguf", "anyway": True},
    )
    assert r.status == 202 and (await r.json())["url"] == "http://mirror:8081/m/v/b.gguf"
    assert mgr.fetched[-1] == ("https://h/x/a.gguf", "m", "v", "b.gguf", True)


async def test_add_several_files_url_is_the_version(api):
    client, _ = api
    r = await client.post(
        "/v1/models",
        json={
            "source": "https://h/a-00001-of-00002.gguf+https://h/a-00002-of-00002.gguf",
            "model": "big",
            "version": "v",
        },
    )
    body = await r.json()
    assert r.status == 202 and body["url"] == "http://mirror:8081/big/v/" and len(body["files"]) == 2


async def test_status_fetching_then_present_then_listed(api):
    client, mgr = api
    await client.post("/v1/models", json={"source": "https://h/q.gguf", "model": "qwen", "version": "v1"})
    r = await client.get("/v1/models/qwen/v1")
    assert (await r.json())["state"] == "fetching"
    mgr.finish("qwen", "v1")
    body = await (await client.get("/v1/models/qwen/v1")).json()
    assert body["state"] == "present" and body["bytes"] == 10 and body["files"][0]["sha256"]
    listing = await (await client.get("/v1/models")).json()
    assert listing["base"] == "http://mirror:8081" and [m["model"] for m in listing["models"]] == ["qwen"]


async def test_failed_keeps_reason(api):
    client, mgr = api
    await client.post("/v1/models", json={"source": "https://h/q.gguf", "model": "qwen", "version": "v1"})
    vs = mgr.versions[("qwen", "v1")]
    vs.state, vs.reason = "failed", "https://h/q.gguf answered 404 Not Found"
    body = await (await client.get("/v1/models/qwen/v1")).json()
    assert body["state"] == "failed" and "404" in body["reason"]


async def test_the_mirror_api_refuses_bad_or_overwriting_fetches_and_unknown_models_in_words(api):
    client, mgr = api
    r = await client.post("/v1/models", data=b"not json", headers={"Content-Type": "application/json"})
    assert r.status == 400 and "not JSON" in (await r.json())["error"]["message"]
    r = await client.post("/v1/models", json={"source": "https://h/q.gguf", "model": "qwen"})
    assert r.status == 400 and '"version" is required' in (await r.json())["error"]["message"]
    r = await client.post("/v1/models", json={"source": "https://h/q.gguf", "model": "../x", "version": "v"})
    assert r.status == 400 and "--model" in (await r.json())["error"]["message"]
    mgr.put("qwen", "v1", "q.gguf", b"abc")
    r = await client.post("/v1/models", json={"source": "https://h/q.gguf", "model": "qwen", "version": "v1"})
    assert r.status == 409 and "never overwritten" in (await r.json())["error"]["message"]
    r = await client.get("/v1/models/qwen/none")
    assert r.status == 404 and (await r.json())["error"]["message"] == "the mirror holds no qwen/none"


async def test_delete_refused_while_fetching(api):
    client, mgr = api
    await client.post("/v1/models", json={"source": "https://h/q.gguf", "model": "qwen", "version": "v1"})
    r = await client.delete("/v1/models/qwen/v1")
    assert r.status == 409 and "still downloading" in (await r.json())["error"]["message"]
    mgr.finish("qwen", "v1")
    assert (await client.delete("/v1/models/qwen/v1")).status == 200
    assert (await client.delete("/v1/models/qwen/v1")).status == 404


async def test_mirror_api_health_fails_when_the_mirror_directory_cannot_be_read(api, tmp_path):
    client, _ = api
    assert (await client.get("/v1/health")).status == 200
    gone = tmp_path / "gone"
    async with TestClient(TestServer(api_app(FakeManager(gone), gone, "http://m:8081", ACCESS))) as c2:
        r = await c2.get("/v1/health")
        assert r.status == 503 and "cannot read" in (await r.json())["error"]["message"]


async def test_the_api_allow_list_admits_loopback_and_listed_networks_and_refuses_the_rest():
    allow = parse_allow(["10.0.0.5", "192.168.1.0/24,fd00::/8"])
    mw = allow_list_middleware(allow)

    async def ok(request):
        return web.Response(text="ok")

    async def call(peer):
        transport = type("T", (), {"get_extra_info": lambda self, k, d=None: (peer, 1234) if k == "peername" else d})()
        return await mw(make_mocked_request("GET", "/v1/models", transport=transport), ok)

    for peer in ("127.0.0.1", "::1", "10.0.0.5", "192.168.1.77", "fd00::1", "::ffff:10.0.0.5"):
        assert (await call(peer)).status == 200, peer
    r = await call("10.0.0.6")
    assert r.status == 403 and json.loads(r.body)["error"]["message"] == FORBIDDEN
    r = await call("not-an-address")
    assert r.status == 403 and json.loads(r.body)["error"]["message"] == "forbidden"
    with pytest.raises(MirrorError, match='--api-allow "nope" is not an address or a network'):
        parse_allow(["10.0.0.1,nope"])


async def test_allow_list_lets_loopback_through_for_real(tmp_path):
    mgr = FakeManager(tmp_path)
    app = api_app(mgr, tmp_path, "http://m:8081", ACCESS, allow=parse_allow(["10.9.9.9"]))
    async with TestClient(TestServer(app, host="127.0.0.1"), headers=AUTH) as c:
        assert (await c.get("/v1/models")).status == 200


async def test_on_tls_a_control_plane_certificate_or_the_token_is_a_credential_and_a_node_certificate_is_not(tmp_path):
    pki = tmp_path / "pki"
    init_ca(pki)
    issue_server(pki, pki, ["127.0.0.1"])
    issue_client(pki, pki, "control-plane", admin_names={"admin"})
    issue_client(pki, pki, "node-a", admin_names={"admin"})
    ctx = server_context(pki / "ca.pem", pki / "server.pem", pki / "server-key.pem", require_client=False)
    access = ApiAccess(token=TOKEN, token_file="/t", tls_clients=("control-plane",))
    app = api_app(FakeManager(tmp_path), tmp_path, "http://m:8081", access)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ctx)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    url = f"https://127.0.0.1:{port}/v1/models"

    def cert(name):
        c = client_context(pki / "ca.pem", pki / f"{name}.pem", pki / f"{name}-key.pem")
        c.set_alpn_protocols(["http/1.1"])  # a client offering ALPN still gets through
        return c

    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(url, ssl=cert("control-plane")) as r:
                assert r.status == 200
            async with s.get(url, ssl=cert("node-a")) as r:
                assert r.status == 401 and "issued to control-plane" in (await r.json())["error"]["message"]
            async with s.get(url, ssl=client_context(pki / "ca.pem")) as r:
                assert r.status == 401
            async with s.get(url, ssl=client_context(pki / "ca.pem"), headers=AUTH) as r:
                assert r.status == 200
            other = tmp_path / "other"
            init_ca(other)
            issue_client(other, other, "control-plane", admin_names={"admin"})
            with pytest.raises((aiohttp.ClientError, ssl.SSLError, ConnectionError)):
                # A certificate from another authority fails the handshake itself.
                foreign = client_context(pki / "ca.pem", other / "control-plane.pem", other / "control-plane-key.pem")
                async with s.get(url, ssl=foreign) as r:
                    await r.read()
    finally:
        await runner.cleanup()


def test_references_compare_by_path():
    refs = references(
        [
            "https://mirror.internal/qwen/v1/q.gguf",
            "http://10.0.0.9:8081/big/v2",  # a version, without its slash
            "http://localhost:8081/big/v3/",  # a version
            "hf:Qwen/Qwen2.5/q.gguf",
            "/srv/local/x.gguf",
            "http://other/deep/a/b/c",
        ],
        "http://localhost:8081",
    )
    assert refs == {("qwen", "v1", "q.gguf"), ("big", "v2"), ("big", "v3")}
    assert references(["http://h/models/a/b/c", "http://h/a/b/c"], "http://x/models/") == {("a", "b", "c")}


async def test_api_with_the_real_fetcher(tmp_path):
    """POST → 202 fetching → present, against a source on loopback that holds the
    second half of the file back until the test lets it go; DELETE is refused meanwhile."""
    from llmgw.mirror.fetcher import Manager

    payload = os.urandom(200_000)
    release = asyncio.Event()

    async def source(request):
        resp = web.StreamResponse(headers={"Content-Length": str(len(payload))})
        await resp.prepare(request)
        await resp.write(payload[:1000])
        await release.wait()
        await resp.write(payload[1000:])
        await resp.write_eof()
        return resp

    src_app = web.Application()
    src_app.router.add_get("/files/tok.bin", source)
    root = tmp_path / "models"
    root.mkdir()
    mgr = Manager(root, allow_local_sources=True)  # the source is on loopback
    async with (
        TestClient(TestServer(src_app)) as src,
        TestClient(TestServer(api_app(mgr, root, "http://mirror:8081", ACCESS)), headers=AUTH) as client,
        TestClient(TestServer(weights_app(root, manager_checksums(mgr)))) as weights,
    ):
        url = str(src.make_url("/files/tok.bin"))
        r = await client.post("/v1/models", json={"source": url, "model": "tok", "version": "v1"})
        body = await r.json()
        assert r.status == 202 and body["state"] == "fetching" and body["url"] == "http://mirror:8081/tok/v1/tok.bin"

        async def sized():
            body = await (await client.get("/v1/models/tok/v1")).json()
            return body if body.get("bytes_total") is not None else None

        body = await async_until(sized, what="the fetch to learn the file's size")
        try:
            assert body["state"] == "fetching" and body["bytes_total"] == len(payload) and body["bytes_done"] <= 1000
            assert (await client.delete("/v1/models/tok/v1")).status == 409
            manifest = await weights.get("/tok/v1/")
            # nothing half-written is offered
            assert manifest.status == 404 or (await manifest.json())["files"] == []
            assert (await weights.get("/tok/v1/tok.bin")).status == 404
        finally:
            release.set()
        await mgr.wait("tok", "v1")
        body = await (await client.get("/v1/models/tok/v1")).json()
        assert body["state"] == "present" and body["files"][0]["sha256"] == hashlib.sha256(payload).hexdigest()
        r = await weights.get("/tok/v1/tok.bin.sha256")
        assert await r.text() == f"{hashlib.sha256(payload).hexdigest()}  tok.bin\n"
        assert await (await weights.get("/tok/v1/tok.bin")).read() == payload
        assert (await client.delete("/v1/models/tok/v1")).status == 200
        assert (await weights.get("/tok/v1/tok.bin")).status == 404
    await mgr.close()
