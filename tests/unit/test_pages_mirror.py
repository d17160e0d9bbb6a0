"""The administrator's Mirror page against a real in-process control plane driving a real mirror (the
mirror's own management API and byte listener over the real fetcher, as `llmgw mirror serve` runs them)
and a stand-in Hugging Face registry answering the routes the page and the mirror read, in their real
JSON shapes: what the mirror holds by model, a fetch with its progress refreshed in place, refusals of
what the nodes cannot load, serving a version, removal warned while the catalog uses it, browsing a
repository, the guards, and names escaped."""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from markupsafe import escape
from test_pages import PASSWORD, active_person, base, form_token, sign_in

from llmgw.config.server import parse_server_config
from llmgw.files import write_secret_file
from llmgw.huggingface import TreeFile
from llmgw.mirror.api import ApiAccess, api_app
from llmgw.mirror.fetcher import Manager
from llmgw.mirror.serve import manager_checksums, weights_app
from llmgw.server.app import Server
from llmgw.server.pages.admin_mirror import default_model, not_a_model, quant_of, repo_files
from llmgw.testing.ports import free_port as _port
from llmgw.testing.waiting import async_until

ADMIN = "root@example.com"
TOKEN = "llmgw-mirror-pages-test"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO = "acme/Tiny-GGUF"
ODD = "odd/<img src=x onerror=alert(1)>-Q2_K.gguf"
BIG = os.urandom(200_000)


def gguf_bytes(tmp_path, arch: str) -> bytes:
    """A real GGUF file (header, metadata, one tensor) of the given architecture."""
    import gguf as gguf_lib
    import numpy as np

    path = tmp_path / f"{arch}-{os.urandom(4).hex()}.gguf"
    w = gguf_lib.GGUFWriter(str(path), arch)
    w.add_tensor("t", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


class Registry:
    """A stand-in for Hugging Face: ``/api/models/{org}/{repo}`` (the model's facts as huggingface.co
    answers them), ``/api/models/{org}/{repo}/tree/main`` (its files, three to a page, with the Link
    header to the next page), ``/{org}/{repo}/resolve/{rev}/{path}`` (the bytes, with Range), and
    ``/files/{name}`` (a plain file server that holds its answer back after the first 1000 bytes while
    ``hold`` is clear)."""

    def __init__(self, repos: dict[str, dict[str, bytes]], files: dict[str, bytes]) -> None:
        self.repos, self.files = repos, files
        self.asked: list[str] = []
        self.hold = asyncio.Event()
        self.hold.set()
        app = web.Application()
        app.router.add_get("/api/models/{org}/{repo}", self.info)
        app.router.add_get("/api/models/{org}/{repo}/tree/{rev}", self.tree)
        app.router.add_get("/files/{name}", self.file)
        app.router.add_get("/{org}/{repo}/resolve/{rev}/{path:.+}", self.resolve)
        self.server = TestServer(app, host="127.0.0.1")

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")

    def _repo(self, request: web.Request) -> tuple[str, dict[str, bytes]] | None:
        self.asked.append(request.path)
        repo = f"{request.match_info['org']}/{request.match_info['repo']}"
        return (repo, self.repos[repo]) if repo in self.repos else None

    async def info(self, request: web.Request) -> web.Response:
        found = self._repo(request)
        if found is None:
            return web.json_response({"error": "Repository not found"}, status=404)
        repo, files = found
        return web.json_response(
            {
                "_id": "6650c0ffee0000000000beef",
                "id": repo,
                "modelId": repo,
                "author": repo.split("/")[0],
                "sha": COMMIT,
                "lastModified": "2026-05-01T10:00:00.000Z",
                "private": False,
                "disabled": False,
                "gated": False,
                "downloads": 12345,
                "likes": 7,
                "library_name": "gguf",
                "tags": ["gguf", "llama", "text-generation"],
                "pipeline_tag": "text-generation",
                "createdAt": "2026-04-01T10:00:00.000Z",
                "cardData": {"license": "<script>alert(1)</script>", "base_model": "acme/Tiny"},
                "gguf": {"total": 1000, "architecture": "llama", "context_length": 4096},
                "siblings": [{"rfilename": p} for p in files],
                "spaces": [],
                "usedStorage": sum(len(b) for b in files.values()),
            }
        )

    async def tree(self, request: web.Request) -> web.Response:
        found = self._repo(request)
        if found is None:
            return web.json_response({"error": "Repository not found"}, status=404)
        _, files = found
        entries: list[dict] = [{"type": "directory", "oid": "d" * 40, "size": 0, "path": "odd"}]
        for path, data in files.items():
            e = {"type": "file", "oid": hashlib.sha1(data).hexdigest(), "size": len(data), "path": path}
            if path.endswith(".gguf"):
                e["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            entries.append(e)
        start = int(request.query.get("cursor", "0"))
        page = entries[start : start + 3]
        headers = {}
        if start + 3 < len(entries):
            nxt = request.url.update_query({"cursor": str(start + 3)})
            headers["Link"] = f'<{nxt}>; rel="next"'
        return web.json_response(page, headers=headers)

    async def _bytes(self, request: web.Request, data: bytes, hold: bool) -> web.StreamResponse:
        rng = request.headers.get("Range")
        if rng:
            first, _, last = rng.split("=", 1)[1].partition("-")
            start, end = int(first), min(int(last) if last else len(data) - 1, len(data) - 1)
            return web.Response(
                status=206,
                body=data[start : end + 1],
                headers={"Content-Range": f"bytes {start}-{end}/{len(data)}"},
            )
        resp = web.StreamResponse(headers={"Content-Length": str(len(data))})
        await resp.prepare(request)
        await resp.write(data[:1000])
        if hold:
            await self.hold.wait()
        await resp.write(data[1000:])
        await resp.write_eof()
        return resp

    async def resolve(self, request: web.Request) -> web.StreamResponse:
        found = self._repo(request)
        data = found[1].get(request.match_info["path"]) if found else None
        if data is None:
            return web.json_response({"error": "Entry not found"}, status=404)
        return await self._bytes(request, data, hold=False)

    async def file(self, request: web.Request) -> web.StreamResponse:
        data = self.files.get(request.match_info["name"])
        if data is None:
            return web.Response(status=404, text="no such file")
        return await self._bytes(request, data, hold=True)


@dataclass
class Stack:
    srv: Server
    registry: Registry
    manager: Manager
    root: object
    weights: str  # the byte listener's address, which catalog sources name


@asynccontextmanager
async def stack(tmp_path, *, mirror_api: str | None = None) -> AsyncIterator[Stack]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    tiny = gguf_bytes(tmp_path, "llama")
    repos = {
        REPO: {
            "tiny-q4_k_m.gguf": tiny,
            "foo-Q4_0.gguf": gguf_bytes(tmp_path, "foo"),
            "Q8_0/tiny-q8_0-00001-of-00002.gguf": tiny,
            "Q8_0/tiny-q8_0-00002-of-00002.gguf": b"second part" * 10,
            "mmproj-tiny-f16.gguf": tiny,
            ODD: tiny,
            "README.md": b"# Tiny\n",
        }
    }
    registry = Registry(repos, {"big.bin": BIG, "tiny.gguf": tiny})
    await registry.server.start_server()
    root = tmp_path / "models"
    root.mkdir()
    manager = Manager(root, hf_endpoint=registry.url, allow_local_sources=True)  # every source is on loopback
    weights = TestServer(weights_app(root, manager_checksums(manager)), host="127.0.0.1")
    await weights.start_server()
    weights_url = str(weights.make_url("")).rstrip("/")
    token_file = tmp_path / "mirror.api-token"
    write_secret_file(token_file, TOKEN)
    access = ApiAccess(token=TOKEN, token_file=str(token_file))
    api = TestServer(api_app(manager, root, weights_url, access), host="127.0.0.1")
    await api.start_server()
    cfg = parse_server_config(
        {
            "listen": f"127.0.0.1:{_port()}",
            "admin_listen": f"127.0.0.1:{_port()}",
            "metrics_listen": None,
            "agent_listen": f"127.0.0.1:{_port()}",
            "agent_tls": None,
            "control": {"enabled": True},
            "engines": {"llamacpp": None},
            "auth": {"store": str(tmp_path / "gw.db")},
            "data_dir": str(tmp_path),
            "mirror": {
                "api": mirror_api or str(api.make_url("")).rstrip("/"),
                "token_file": str(token_file),
                "registry": registry.url,
            },
            "models": [],
        }
    )
    srv = Server(cfg)
    await srv.start()
    await srv.store.create_user(ADMIN, PASSWORD, admin=True)
    try:
        yield Stack(srv, registry, manager, root, weights_url)
    finally:
        registry.hold.set()
        await srv.stop()
        await manager.close()
        await api.close()
        await weights.close()
        await registry.server.close()


@asynccontextmanager
async def admin(srv: Server) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=base(srv), timeout=30) as http:
        assert (await sign_in(http, ADMIN)).status_code == 303
        yield http


def put(root, model: str, version: str, name: str, data: bytes) -> None:
    """A file copied into the mirror by hand, as docs/mirror.md allows."""
    d = root / model / version
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data)


async def fetch(http: httpx.AsyncClient, **fields: str) -> httpx.Response:
    page = (await http.get("/admin/mirror")).text
    return await http.post("/admin/mirror/fetch", data={"csrf": form_token(page), **fields})


def version_row(page: str, model: str, version: str) -> str:
    anchor = "v-" + re.sub(r"[^A-Za-z0-9_-]", "-", f"{model}-{version}")
    m = re.search(rf'<tr id="{re.escape(anchor)}".*?</tr>', page, re.S)
    assert m, f"no row for {model}/{version}"
    return m.group(0)


async def present(http: httpx.AsyncClient, model: str, version: str) -> None:
    async def done() -> bool:
        page = (await http.get("/admin/mirror")).text
        return f'id="v-{model}-{version}"' in page and 'data-label="State">present' in version_row(page, model, version)

    await async_until(done, 20, f"{model}/{version} to be present on the Mirror page")


# -- holdings -------------------------------------------------------------------------------------


async def test_the_mirror_page_lists_what_the_mirror_holds_by_model_with_each_versions_files_size_and_state(
    tmp_path,
):
    async with stack(tmp_path) as st, admin(st.srv) as http:
        put(st.root, "qwen", "2026-01-01", "q.gguf", b"x" * 3000)
        put(st.root, "qwen", "2026-02-01", "q-00001-of-00002.gguf", b"a" * 2048)
        put(st.root, "qwen", "2026-02-01", "q-00002-of-00002.gguf", b"b" * 2048)
        put(st.root, "llama", "v1", "l.gguf", b"l" * 100)
        r = await http.get("/admin/mirror")
        assert r.status_code == 200
        page = r.text
        assert 'href="/admin/mirror" aria-current="page"' in page
        assert 'qwen <span class="muted">2 versions, 6.9 KiB</span>' in page
        assert page.index(">llama") < page.index(">qwen")  # by model
        one = version_row(page, "qwen", "2026-01-01")
        assert "q.gguf" in one and "2.9 KiB" in one and ">present<" in one
        assert f"<code>{st.weights}/qwen/2026-01-01/q.gguf</code>" in one
        sets = version_row(page, "qwen", "2026-02-01")
        assert "q-00001-of-00002.gguf" in sets and "q-00002-of-00002.gguf" in sets and "4.0 KiB" in sets
        assert f"<code>{st.weights}/qwen/2026-02-01/</code>" in sets  # several files: the version ending in /
        assert "Nothing is downloading." in page
        assert "hx-trigger" not in page  # nothing to refresh
        # A link cannot make the page say what did not happen.
        for said in ("said=fetching&m=nope&v=v1", "said=served&m=nope", "said=removed&m=qwen&v=2026-01-01"):
            assert 'class="done"' not in (await http.get(f"/admin/mirror?{said}")).text


async def test_an_empty_or_unreachable_mirror_is_said_outright(tmp_path):
    async with stack(tmp_path) as st, admin(st.srv) as http:
        page = (await http.get("/admin/mirror")).text
        assert "The mirror holds nothing yet" in page
    dead = f"http://127.0.0.1:{_port()}"
    async with stack(tmp_path / "dead", mirror_api=dead) as st, admin(st.srv) as http:
        r = await http.get("/admin/mirror")
        assert r.status_code == 200
        assert f"The mirror cannot be asked what it holds: the mirror at {dead} cannot be reached" in r.text
        assert "check mirror.api in server.yaml" in r.text


# -- fetching ---------------------------------------------------------------------------------------


async def test_a_fetch_shows_its_bytes_and_percent_refreshing_in_place_until_it_is_present(tmp_path):
    async with stack(tmp_path) as st, admin(st.srv) as http:
        st.registry.hold.clear()  # the source sends its first 1000 bytes, then waits
        r = await fetch(http, source=f"{st.registry.url}/files/big.bin", model="big", version="v1")
        assert r.status_code == 303 and r.headers["location"] == "/admin/mirror?said=fetching&m=big&v=v1#downloads"
        said = (await http.get(r.headers["location"])).text
        assert "Fetching big/v1: it is listed below as it arrives." in said

        async def sized() -> str | None:
            page = (await http.get("/admin/mirror")).text
            return page if "of 195 KiB" in page else None

        page = await async_until(sized, 20, "the download's size to show")
        downloads = page[page.index('id="downloads"') : page.index('id="holdings"')]
        assert "big/v1/big.bin" in downloads and f"from {st.registry.url}/files/big.bin" in downloads
        assert (
            re.search(r"<progress max=\"100\" value=\"0\.5\">", downloads) and "1000 B of 195 KiB (0.5%)" in downloads
        )
        # While it downloads, htmx asks for the live part again every five seconds, and gets only that part.
        assert 'hx-get="/admin/mirror" hx-trigger="every 5s, refresh" hx-select="#mirror-live"' in page
        assert '<meta http-equiv="refresh" content="15">' in page  # without script
        part = await http.get("/admin/mirror", headers={"HX-Request": "true"})
        assert part.text.lstrip().startswith('<div id="mirror-live"') and "<html" not in part.text
        assert "1000 B of 195 KiB" in part.text
        st.registry.hold.set()

        async def finished() -> str | None:
            part = (await http.get("/admin/mirror", headers={"HX-Request": "true"})).text
            return part if "hx-trigger" not in part else None

        part = await async_until(finished, 20, "the download to finish and the refreshing to stop")
        row = version_row(part, "big", "v1")
        assert ">present<" in row and "195 KiB" in row and "Nothing is downloading." in part
        assert f'title="sha256 {hashlib.sha256(BIG).hexdigest()}"' in row
        assert (st.root / "big" / "v1" / "big.bin").read_bytes() == BIG


async def test_a_gguf_the_nodes_cannot_load_is_refused_with_the_mirrors_sentence_and_fetched_when_asked_anyway(
    tmp_path,
):
    async with stack(tmp_path) as st, admin(st.srv) as http:
        source = f"hf:{REPO}/foo-Q4_0.gguf"
        r = await fetch(http, source=source, model="foo", version="v1")
        assert r.status_code == 400
        refused = re.search(r'<p class="problem" role="alert" id="fetch-refused">(.*?)</p>', r.text, re.S).group(1)
        assert "cannot load architecture &#39;foo&#39; (foo-Q4_0.gguf)" in refused
        assert f'name="source" value="{source}"' in r.text and 'name="model" value="foo"' in r.text  # kept
        assert not (st.root / "foo").exists()
        # A vision projector is not a model on its own.
        r = await fetch(http, source=f"hf:{REPO}/mmproj-tiny-f16.gguf", model="proj", version="v1")
        assert r.status_code == 400 and "is a vision projector (mmproj), not a model on its own" in r.text
        # Nothing to fetch from: the mirror's own words.
        r = await fetch(http, source="ftp://example.com/x.gguf", model="x", version="v1")
        assert r.status_code == 400 and "give an http(s):// URL or hf:ORG/REPO/FILE" in r.text
        r = await fetch(http, source="", model="x", version="v1")
        assert r.status_code == 400 and "Give the source" in r.text
        # Ticked, it is fetched all the same.
        r = await fetch(http, source=source, model="foo", version="v1", anyway="1")
        assert r.status_code == 303
        await present(http, "foo", "v1")
        # A version is never overwritten: asked again, the mirror says so.
        r = await fetch(http, source=source, model="foo", version="v1", anyway="1")
        assert r.status_code == 409 and "foo/v1 is already here; a version is never overwritten" in r.text


async def test_a_failed_download_shows_its_reason_and_a_retry(tmp_path):
    async with stack(tmp_path) as st, admin(st.srv) as http:
        r = await fetch(http, source=f"{st.registry.url}/files/gone.bin", model="gone", version="v1")
        assert r.status_code == 303

        async def failed() -> str | None:
            page = (await http.get("/admin/mirror")).text
            return page if 'class="m-failed"' in page else None

        page = await async_until(failed, 20, "the failed download to show")
        assert "answered 404 Not Found; check the address and fetch again." in page
        retry = re.search(r'<li class="m-failed">.*?</li>', page, re.S).group(0)
        assert f'name="source" value="{st.registry.url}/files/gone.bin"' in retry and ">Retry</button>" in retry


# -- serving and removing ------------------------------------------------------------------------------


async def test_a_version_fetched_from_the_repository_page_is_served_and_removing_it_warns_while_the_catalog_uses_it(
    tmp_path,
):
    async with stack(tmp_path) as st, admin(st.srv) as http:
        page = (await http.get("/admin/mirror/repo", params={"repo": REPO})).text
        form = re.search(
            r'<form[^>]*>(?:(?!</form>).)*value="hf:acme/Tiny-GGUF/tiny-q4_k_m\.gguf".*?</form>', page, re.S
        )
        fields = dict(re.findall(r'name="(\w+)" value="([^"]*)"', form.group(0)))
        assert fields["model"] == "tiny" and re.fullmatch(r"\d{4}-\d\d-\d\d-q4_k_m", fields["version"])
        assert (await http.post("/admin/mirror/fetch", data=fields)).status_code == 303
        version = fields["version"]
        await present(http, "tiny", version)
        page = (await http.get("/admin/mirror")).text
        serve = re.search(r'<details class="admin-more m-serve"[^>]*hx-preserve="true">.*?</details>', page, re.S)
        assert serve and f'value="{version}"' in serve.group(0)
        r = await http.post(
            "/admin/mirror/serve",
            data={"csrf": form_token(page), "model": "tiny", "version": version, "name": "", "mode": "on-demand"},
        )
        assert r.status_code == 303 and r.headers["location"] == "/admin/mirror?said=served&m=tiny"
        entry = st.srv.catalog.get("tiny")
        assert entry is not None and entry.model.source == f"{st.weights}/tiny/{version}/tiny-q4_k_m.gguf"
        assert entry.model.scaling.state == "on demand" and "tiny" in st.srv.gateway.models
        page = (await http.get(r.headers["location"])).text
        assert "Added tiny to the catalog" in page
        row = version_row(page, "tiny", version)
        assert 'tiny <span class="muted">on demand, stops after 15 minutes idle</span>' in row
        assert "in use by the catalog" in row
        # Served again under the same name: the catalog's refusal, shown.
        r = await http.post(
            "/admin/mirror/serve",
            data={"csrf": form_token(page), "model": "tiny", "version": version, "mode": "always"},
        )
        assert r.status_code == 400 and f"tiny/{version} was not served:" in r.text

        # Removing it is refused while the catalog uses it, with the API's sentence and a way on.
        r = await http.post(
            "/admin/mirror/remove", data={"csrf": form_token(page), "model": "tiny", "version": version}
        )
        assert r.status_code == 409
        assert f"tiny still refer(s) to tiny/{version}; retire the catalog entry first" in r.text
        assert f"Remove tiny/{version} anyway" in r.text and 'name="force" value="1"' in r.text
        assert (st.root / "tiny" / version / "tiny-q4_k_m.gguf").exists()
        r = await http.post(
            "/admin/mirror/remove",
            data={"csrf": form_token(page), "model": "tiny", "version": version, "force": "1"},
        )
        assert r.status_code == 303 and "said=removed" in r.headers["location"]
        assert not (st.root / "tiny" / version).exists()
        page = (await http.get(r.headers["location"])).text
        assert f"Removed tiny/{version} from the mirror." in page and f'id="v-tiny-{version}"' not in page
        # A version that is not there: the mirror's sentence.
        r = await http.post("/admin/mirror/remove", data={"csrf": form_token(page), "model": "no", "version": "v"})
        assert r.status_code == 404 and "the mirror holds no no/v" in r.text


async def test_a_version_still_downloading_cannot_be_served_or_removed_and_says_why(tmp_path):
    async with stack(tmp_path) as st, admin(st.srv) as http:
        st.registry.hold.clear()
        assert (
            await fetch(http, source=f"{st.registry.url}/files/big.bin", model="big", version="v1")
        ).status_code == 303
        page = (await http.get("/admin/mirror")).text
        assert "m-serve" not in version_row(page, "big", "v1")  # only a present version is offered
        r = await http.post(
            "/admin/mirror/serve", data={"csrf": form_token(page), "model": "big", "version": "v1", "mode": "always"}
        )
        assert r.status_code == 400 and "big/v1 is fetching; only a version that is present can be served" in r.text
        r = await http.post("/admin/mirror/remove", data={"csrf": form_token(page), "model": "big", "version": "v1"})
        assert r.status_code == 409 and "big/v1 was not removed:" in r.text and "still downloading" in r.text
        assert "Remove big/v1 anyway" not in r.text  # not in use by the catalog: nothing to force
        st.registry.hold.set()


# -- Hugging Face --------------------------------------------------------------------------------------


async def test_a_repository_lists_its_gguf_files_with_sizes_and_quantisations_and_a_fetch_button_each(tmp_path):
    async with stack(tmp_path) as st, admin(st.srv) as http:
        r = await http.get("/admin/mirror/repo", params={"repo": REPO})
        assert r.status_code == 200
        page = r.text
        # Through mirror.registry: the model's facts and every page of its tree.
        assert st.registry.asked[:2] == [f"/api/models/{REPO}", f"/api/models/{REPO}/tree/main"]
        assert st.registry.asked.count(f"/api/models/{REPO}/tree/main") == 3
        assert f"Read from {st.registry.url}" in page
        assert "llama" in page and "the nodes' llama.cpp loads it" in page and "4,096 tokens" in page
        assert '<code title="' + COMMIT + '">' + COMMIT[:12] + "</code>" in page
        rows = re.findall(r'<tr class="m-repo-file">.*?</tr>', page, re.S)
        assert len(rows) == 5  # the shard set is one row; README.md is not a GGUF
        by_name = {re.search(r'<td class="wrap">([^<]*)', row).group(1): row for row in rows}
        single = by_name["tiny-q4_k_m.gguf"]
        assert "Q4_K_M" in single and ">Fetch</button>" in single
        assert 'name="source" value="hf:acme/Tiny-GGUF/tiny-q4_k_m.gguf"' in single
        shards = by_name["Q8_0/tiny-q8_0-00001-of-00002.gguf (2 files)"]
        assert "Q8_0" in shards and 'value="hf:acme/Tiny-GGUF/Q8_0/tiny-q8_0-00001-of-00002.gguf"' in shards
        proj = by_name["mmproj-tiny-f16.gguf"]
        assert "a vision projector (mmproj): not a model on its own" in proj and "<button" not in proj
        assert "1 other file" in page and "README.md" in page
        # Names from the registry are text, never markup.
        assert str(escape(ODD)) in page and "<img src=x" not in page
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "<script>alert" not in page
        assert "Q2_K" in by_name[str(escape(ODD))]

        r = await http.get("/admin/mirror/repo", params={"repo": "acme/nothing"})
        assert r.status_code == 502 and f"hf:acme/nothing was not found on {st.registry.url}" in r.text
        r = await http.get("/admin/mirror/repo", params={"repo": "../../etc"})
        assert r.status_code == 400 and "A repository is named ORG/NAME" in r.text
        r = await http.get("/admin/mirror/repo")
        assert r.status_code == 200 and 'name="repo"' in r.text


def test_quantisations_are_read_from_file_names_and_shard_sets_are_one_file():
    assert [
        quant_of(n)
        for n in (
            "qwen2.5-0.5b-instruct-q4_k_m.gguf",
            "Llama-3.2-1B-Instruct-IQ2_XXS.gguf",
            "model-UD-Q4_K_XL-00001-of-00003.gguf",
            "phi-4-Q8_0.gguf",
            "gemma-bf16.gguf",
            "Q5_K_S/x.gguf",
            "tokenizer.gguf",
        )
    ] == ["Q4_K_M", "IQ2_XXS", "Q4_K_XL", "Q8_0", "BF16", "", ""]
    assert not_a_model("mmproj-model-f16.gguf") and not_a_model("imatrix.gguf") and not not_a_model("q4.gguf")
    assert default_model("Qwen/Qwen2.5-0.5B-Instruct-GGUF") == "qwen2.5-0.5b-instruct"
    listing = [
        TreeFile.read(e)
        for e in (
            {"path": "m-00002-of-00003.gguf", "size": 2},
            {"path": "m-00001-of-00003.gguf", "size": 1},
            {"path": "n.gguf", "lfs": {"size": 10}, "size": 130},
            {"path": "config.json", "size": 5},
        )
    ]
    ggufs, others = repo_files([f for f in listing if f is not None])
    assert [(f.path, f.label, f.size) for f in ggufs] == [
        ("m-00001-of-00003.gguf", "m-00001-of-00003.gguf (2 files of 3: some are missing)", 3),
        ("n.gguf", "n.gguf", 10),
    ]
    assert others == [("config.json", 5)]


# -- the guards and escaping -----------------------------------------------------------------------------


async def test_only_administrators_see_the_mirror_and_names_are_escaped(tmp_path):
    async with stack(tmp_path) as st:
        put(st.root, "<script>x", "v1", "<b>.gguf", b"z")
        await active_person(st.srv)
        async with httpx.AsyncClient(base_url=base(st.srv)) as http:
            assert (await sign_in(http, "ann@example.com")).status_code == 303
            r = await http.get("/admin/mirror")
            assert r.status_code == 403 and "This page is for administrators." in r.text
            assert 'href="/admin/mirror"' not in (await http.get("/profile")).text
            r = await http.get("/admin/mirror/repo", params={"repo": REPO})
            assert r.status_code == 403 and st.registry.asked == []
        async with admin(st.srv) as http:
            page = (await http.get("/admin/mirror")).text
            r = await http.post("/admin/mirror/fetch", data={"source": "x", "model": "y", "version": "z"})
            assert r.status_code == 403 and "security token" in r.text
        body = page.split("</head>")[1]
        assert "&lt;script&gt;x" in body and "&lt;b&gt;.gguf" in body
        assert "<script>x" not in body and "<b>.gguf" not in body


async def test_a_gateway_without_a_mirror_block_has_no_mirror_page(tmp_path):
    cfg = parse_server_config(
        {
            "listen": f"127.0.0.1:{_port()}",
            "admin_listen": f"127.0.0.1:{_port()}",
            "metrics_listen": None,
            "auth": {"store": str(tmp_path / "gw.db")},
            "data_dir": str(tmp_path),
            "models": [{"name": "m", "endpoints": [{"url": "http://127.0.0.1:9", "engine": "openai"}]}],
        }
    )
    srv = Server(cfg)
    await srv.start()
    try:
        await srv.store.create_user(ADMIN, PASSWORD, admin=True)
        async with admin(srv) as http:
            assert (await http.get("/admin/mirror")).status_code == 404
            assert 'href="/admin/mirror"' not in (await http.get("/admin")).text
    finally:
        await srv.stop()


@pytest.mark.parametrize("path", ["/admin/mirror", "/admin/mirror/repo"])
async def test_the_mirror_pages_send_a_visitor_without_a_session_to_sign_in(tmp_path, path):
    async with stack(tmp_path) as st, httpx.AsyncClient(base_url=base(st.srv)) as http:
        r = await http.get(path)
        assert r.status_code == 303 and r.headers["location"] == f"/login?next={path}"
