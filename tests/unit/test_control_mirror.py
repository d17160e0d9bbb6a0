"""The control plane's side of the mirror: its client, the admin API routes, entries from versions."""

from __future__ import annotations

import socket

import httpx
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from llmgw.config.server import MirrorConfig, ServerConfig
from llmgw.files import write_secret_file
from llmgw.protocol.mirror_api import MirrorVersion
from llmgw.server.app import Server
from llmgw.server.control.mirror_client import MirrorClient, MirrorRefused, MirrorUnavailable, entry_from_version
from llmgw.testing.admin import admin_headers

GiB = 1 << 30
BASE = "http://models.internal:8081"


def version(model="qwen", ver="2026-11-01", state="present", files=None, reason=None) -> dict:
    return {
        "model": model,
        "version": ver,
        "state": state,
        "reason": reason,
        "files": files if files is not None else [{"name": "q.gguf", "state": "present", "bytes": 4 * GiB}],
    }


def mirrored(**kw) -> MirrorVersion:
    """A version as the admin API reads it from the mirror."""
    return MirrorVersion.model_validate(version(**kw))


def test_entry_from_a_single_gguf():
    e = entry_from_version(mirrored(), BASE)
    assert e == {
        "name": "qwen",
        "source": f"{BASE}/qwen/2026-11-01/q.gguf",
        "profiles": [{"engine": "llamacpp", "min_memory_gb": 8.0}],
    }


def test_entry_from_a_shard_set_points_at_the_version():
    files = [{"name": f"q-0000{i}-of-00002.gguf", "state": "present", "bytes": 2 * GiB} for i in (1, 2)]
    e = entry_from_version(mirrored(files=files), BASE, name="qwen-big", scaling={"min": 0})
    assert e["source"] == f"{BASE}/qwen/2026-11-01/" and e["name"] == "qwen-big" and e["scaling"] == {"min": 0}
    assert e["profiles"][0]["min_memory_gb"] == 8.0


def test_entry_refusals_say_why():
    with pytest.raises(ValueError, match="is fetching; only a version that is present can be served"):
        entry_from_version(mirrored(state="fetching"), BASE)
    with pytest.raises(ValueError, match="failed: truncated"):
        entry_from_version(mirrored(state="failed", reason="truncated"), BASE)
    st = mirrored(
        files=[
            {"name": "model.safetensors", "state": "present", "bytes": GiB},
            {"name": "config.json", "state": "present", "bytes": 100},
        ]
    )
    with pytest.raises(ValueError, match="give the GPU class"):
        entry_from_version(st, BASE)
    e = entry_from_version(st, BASE, gpu_class="h100-80g")
    assert e["profiles"][0] == {"engine": "vllm", "gpu_class": "h100-80g", "min_memory_gb": 3.5}
    with pytest.raises(ValueError, match="holds no model weights"):
        entry_from_version(mirrored(files=[{"name": "README.md", "state": "present", "bytes": 1}]), BASE)


def test_entry_counts_a_file_without_a_state_as_present():
    e = entry_from_version(mirrored(files=[{"name": "q.gguf", "bytes": 4 * GiB}]), BASE)
    assert e["source"] == f"{BASE}/qwen/2026-11-01/q.gguf"
    with pytest.raises(ValueError, match="holds no model weights"):
        entry_from_version(mirrored(files=[{"name": "q.gguf", "state": None, "bytes": 4 * GiB}]), BASE)


class FakeMirror:
    """The mirror's management API as docs/mirror.md gives it, with its token."""

    TOKEN = "llmgw-mirror-fake"

    def __init__(self, token_file) -> None:
        self.versions: dict[tuple[str, str], dict] = {}
        self.fetches: list[dict] = []
        self.token_file = token_file
        write_secret_file(token_file, self.TOKEN)

        @web.middleware
        async def need_token(request, handler):
            if request.headers.get("Authorization") != f"Bearer {self.TOKEN}":
                return web.json_response(
                    {"error": {"message": "the mirror's management API needs a credential"}}, status=401
                )
            return await handler(request)

        app = web.Application(middlewares=[need_token])
        app.router.add_get("/v1/models", self.list)
        app.router.add_post("/v1/models", self.fetch)
        app.router.add_get("/v1/models/{m}/{v}", self.status)
        app.router.add_delete("/v1/models/{m}/{v}", self.remove)
        self.server = TestServer(app)

    async def list(self, request):
        return web.json_response({"base": BASE, "models": list(self.versions.values())})

    async def fetch(self, request):
        body = await request.json()
        self.fetches.append(body)
        if body["source"].endswith(".html"):
            return web.json_response({"error": {"message": "the source answered HTML, not a model file"}}, status=400)
        v = version(body["model"], body["version"], state="fetching")
        self.versions[(body["model"], body["version"])] = v
        return web.json_response({**v, "url": f"{BASE}/{body['model']}/{body['version']}/q.gguf"}, status=202)

    async def status(self, request):
        v = self.versions.get((request.match_info["m"], request.match_info["v"]))
        if v is None:
            return web.json_response({"error": {"message": "no such version"}}, status=404)
        return web.json_response(v)

    async def remove(self, request):
        self.versions.pop((request.match_info["m"], request.match_info["v"]), None)
        return web.json_response({})


@pytest.fixture
async def mirror(tmp_path):
    fake = FakeMirror(tmp_path / "mirror-token")
    await fake.server.start_server()
    yield fake
    await fake.server.close()


async def test_client_sends_the_token_from_its_file_and_passes_the_mirrors_own_words(mirror, tmp_path):
    api = str(mirror.server.make_url("/"))
    client = MirrorClient(MirrorConfig(api=api, token_file=str(mirror.token_file)))
    got = await client.fetch("https://x/q.gguf", "qwen", "v1")
    assert got["state"] == "fetching" and got["url"].endswith("/qwen/v1/q.gguf")
    with pytest.raises(MirrorRefused, match="answered HTML") as err:
        await client.fetch("https://x/page.html", "qwen", "v2")
    assert err.value.status == 400
    with pytest.raises(MirrorRefused, match="no such version"):
        await client.status("nope", "v")
    dead = MirrorClient(MirrorConfig(api="http://127.0.0.1:9", token_file=str(mirror.token_file)))
    with pytest.raises(MirrorUnavailable, match=r"cannot be reached: .*; check mirror.api in server.yaml"):
        await dead.list()
    wrong = tmp_path / "wrong-token"
    write_secret_file(wrong, "llmgw-mirror-other")
    with pytest.raises(MirrorRefused, match="needs a credential") as err:
        await MirrorClient(MirrorConfig(api=api, token_file=str(wrong))).list()
    assert err.value.status == 401


def test_a_mirror_block_without_a_credential_or_with_an_unreadable_token_is_refused_in_words(tmp_path):
    with pytest.raises(ValueError, match="needs a credential: set token_file"):
        MirrorConfig(api="http://models.internal:8082")
    with pytest.raises(MirrorUnavailable, match=r"mirror.token_file: .*no such file"):
        MirrorClient(MirrorConfig(api="http://models.internal:8082", token_file=str(tmp_path / "none")))
    exposed = tmp_path / "exposed"
    exposed.write_text("llmgw-mirror-x\n")
    exposed.chmod(0o644)
    with pytest.raises(MirrorUnavailable, match="others can read it"):
        MirrorClient(MirrorConfig(api="http://models.internal:8082", token_file=str(exposed)))


def test_a_mirror_block_with_a_client_certificate_over_plain_http_is_refused_with_the_https_address():
    tls = {"ca": "/etc/llmgw/ca.pem", "cert": "/etc/llmgw/cp.pem", "key": "/etc/llmgw/cp-key.pem"}
    with pytest.raises(ValueError, match="write it as https://models.internal:8082"):
        MirrorConfig(api="http://models.internal:8082", tls=tls)
    assert MirrorConfig(api="https://models.internal:8082", tls=tls).tls is not None


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
async def server(mirror, tmp_path):
    cfg = ServerConfig.model_validate(
        {
            "listen": f"127.0.0.1:{_port()}",
            "admin_listen": f"127.0.0.1:{_port()}",
            "metrics_listen": None,
            "agent_listen": f"127.0.0.1:{_port()}",
            "agent_tls": None,
            "control": {"enabled": True},
            "engines": {"llamacpp": None},
            "auth": {"store": str(tmp_path / "db.sqlite")},
            "mirror": {"api": str(mirror.server.make_url("/")), "token_file": str(mirror.token_file)},
            "models": [
                {
                    "name": "uses-it",
                    "source": f"{BASE}/old/v1/",
                    "scaling": {"min": 0},
                    "profiles": [{"engine": "llamacpp"}],
                }
            ],
        }
    )
    s = Server(cfg)
    await s.start()
    yield s, f"http://{cfg.admin_listen.bind_host}:{cfg.admin_listen.port}"
    await s.stop()


async def test_admin_routes_fetch_serve_and_guard_removal(server, mirror):
    s, admin = server
    async with httpx.AsyncClient(base_url=admin, headers=admin_headers(s)) as http:
        r = await http.post(
            "/api/v1/mirror/fetch", json={"source": "https://x/q.gguf", "model": "qwen", "version": "v1"}
        )
        assert r.status_code == 202 and r.json()["state"] == "fetching"
        r = await http.post("/api/v1/mirror/fetch", json={"source": "https://x/q.gguf"})
        assert r.status_code == 400 and '"model": NAME' in r.json()["error"]["message"]
        # Not yet present: it cannot be served.
        r = await http.post("/api/v1/mirror/qwen/v1/serve", json={})
        assert r.status_code == 400 and "is fetching" in r.json()["error"]["message"]
        mirror.versions[("qwen", "v1")]["state"] = "present"
        r = await http.post("/api/v1/mirror/qwen/v1/serve", json={"scaling": {"min": 0}, "source_check": False})
        assert r.status_code == 201, r.text
        m = r.json()["model"]
        assert m["source"] == f"{BASE}/qwen/v1/q.gguf" and m["profiles"][0]["min_memory_gb"] == 8.0
        assert s.catalog.get("qwen") is not None and "qwen" in s.gateway.models
        # Listing says who uses what; removal of a version in use is refused.
        mirror.versions[("old", "v1")] = version("old", "v1")
        r = await http.get("/api/v1/mirror")
        used = {(v["model"], v["version"]): v["used_by"] for v in r.json()["models"]}
        assert used == {("qwen", "v1"): ["qwen"], ("old", "v1"): ["uses-it"]}
        r = await http.delete("/api/v1/mirror/old/v1")
        assert r.status_code == 409 and "uses-it still refer(s) to old/v1" in r.json()["error"]["message"]
        assert ("old", "v1") in mirror.versions
        r = await http.delete("/api/v1/mirror/old/v1?force=1")
        assert r.status_code == 200 and ("old", "v1") not in mirror.versions


async def test_no_mirror_configured_is_said(tmp_path):
    cfg = ServerConfig.model_validate(
        {
            "listen": f"127.0.0.1:{_port()}",
            "admin_listen": f"127.0.0.1:{_port()}",
            "metrics_listen": None,
            "auth": {"store": str(tmp_path / "db.sqlite")},
            "models": [{"name": "m", "endpoints": [{"url": "http://127.0.0.1:9", "engine": "openai"}]}],
        }
    )
    s = Server(cfg)
    await s.start()
    try:
        async with httpx.AsyncClient(headers=admin_headers(s)) as http:
            r = await http.get(f"http://127.0.0.1:{cfg.admin_listen.port}/api/v1/mirror")
        assert r.status_code == 404 and "set mirror.api in server.yaml" in r.json()["error"]["message"]
    finally:
        await s.stop()


def _gguf(path, arch: str) -> bytes:
    import gguf as gguf_lib
    import numpy as np

    w = gguf_lib.GGUFWriter(str(path), arch)
    w.add_tensor("t", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


async def test_model_add_refuses_a_gguf_the_pinned_llamacpp_cannot_load(server, tmp_path):
    s, admin = server
    files = {"/foo.gguf": _gguf(tmp_path / "foo.gguf", "foo"), "/llama.gguf": _gguf(tmp_path / "llama.gguf", "llama")}

    async def handle(request):
        body = files.get(request.path)
        if body is None:
            return web.Response(status=404)
        rng = request.headers.get("Range")
        if rng:
            start, end = (int(x) for x in rng.split("=")[1].split("-"))
            end = min(end, len(body) - 1)
            return web.Response(
                status=206, body=body[start : end + 1], headers={"Content-Range": f"bytes {start}-{end}/{len(body)}"}
            )
        return web.Response(body=body)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    files_srv = TestServer(app)
    await files_srv.start_server()
    try:

        def model(name, path):
            return {
                "model": {
                    "name": name,
                    "source": str(files_srv.make_url(path)),
                    "scaling": {"min": 0},
                    "profiles": [{"engine": "llamacpp"}],
                }
            }

        async with httpx.AsyncClient(base_url=admin, headers=admin_headers(s)) as http:
            r = await http.post("/api/v1/models", json=model("foo", "/foo.gguf"))
            assert r.status_code == 400
            msg = r.json()["error"]["message"]
            assert "cannot load architecture 'foo'" in msg and "--no-source-check skips this check" in msg
            assert s.catalog.get("foo") is None
            r = await http.post("/api/v1/models", json=model("ok", "/llama.gguf"))
            assert r.status_code == 201, r.text
            r = await http.post("/api/v1/models", json={**model("foo", "/foo.gguf"), "source_check": False})
            assert r.status_code == 201, r.text
    finally:
        await files_srv.close()
