"""The catalog: declared vs run-time models, refusals, fingerprints, persistence, source checks."""

from __future__ import annotations

import http.server
import json
import threading

import pytest

from llmgw.config.errors import ConfigError
from llmgw.config.server import ModelConfig, parse_server_config
from llmgw.server.control.catalog import Catalog, CatalogError, check_source, load_model_file
from llmgw.store.store import Store


def _vllm(name="qwen", **kw):
    d = {
        "name": name,
        "source": "Qwen/Qwen2.5-7B-Instruct",
        "profiles": [{"engine": "vllm", "gpu_class": "h100-80g", "tp": 2}],
    }
    d.update(kw)
    return d


def _static(name="ext"):
    return {"name": name, "endpoints": [{"url": "http://127.0.0.1:8000", "engine": "vllm"}]}


async def _catalog(address, declared=()):
    store = await Store.open(address)
    cat = Catalog([ModelConfig.model_validate(d) for d in declared], store)
    await cat.load()
    return store, cat


# -- the model ------------------------------------------------------------------


def test_model_forms_and_refusals():
    assert ModelConfig.model_validate(_static()).managed is False
    m = ModelConfig.model_validate(_vllm(scaling={"min": 0}))
    assert m.managed and (m.scaling.min, m.scaling.max, m.scaling.state) == (0, 1, "on demand")
    assert ModelConfig.model_validate(_vllm(scaling={"min": 3})).scaling.max == 3
    assert ModelConfig.model_validate(_vllm()).scaling.min == 1  # left out: one always running
    cpu = ModelConfig.model_validate({"name": "c", "source": "./m.gguf", "profiles": [{"engine": "llamacpp"}]})
    assert cpu.profiles[0].name == "llamacpp-cpu" and cpu.profiles[0].gpu_class is None

    def err(d):
        with pytest.raises(ConfigError) as e:
            parse_server_config({"models": [d]})
        return str(e.value)

    assert "nothing serves it" in err({"name": "a"})
    assert "not both" in err({**_vllm(), **_static("qwen")})
    assert "models[0].profiles[0]: gpu_class is missing: vllm needs a GPU; only llamacpp runs on CPU" in err(
        _vllm(profiles=[{"engine": "vllm"}])
    )
    assert "models[0].profiles[0].engine:" in err(_vllm(profiles=[{"engine": "ollama"}]))
    assert "source is required" in err(_vllm(source=None))
    assert "llamacpp cannot load the model id" in err(_vllm(profiles=[{"engine": "llamacpp"}]))
    assert "models[0].scaling: max is 0 (stopped) but min is 2" in err(_vllm(scaling={"min": 2, "max": 0}))
    assert "models[0].scaling: max (1) is smaller than min (2)" in err(_vllm(scaling={"min": 2, "max": 1}))
    assert "models[0].source:" in err(_vllm(source="ftp://x/y"))
    assert "models[0].source:" in err(_vllm(source="model.gguf extra"))
    assert "tensor parallelism" in err(
        _vllm(source="/m.gguf", profiles=[{"engine": "llamacpp", "tp": 2, "gpu_class": "l4-22g"}])
    )
    assert "scaling applies only to a model with profiles" in err({**_static(), "scaling": {"min": 1}})
    assert "is used by another profile" in err(_vllm(profiles=[{"engine": "vllm", "gpu_class": "a"}] * 2))
    assert "models[0].profiles[0].env:" in err(
        _vllm(profiles=[{"engine": "vllm", "gpu_class": "a", "env": {"1X": "y"}}])
    )


def test_fingerprint_stable_and_changes_with_an_edit():
    a = ModelConfig.model_validate(_vllm()).profiles[0]
    b = ModelConfig.model_validate(
        _vllm(
            profiles=[
                {"gpu_class": "h100-80g", "tp": 2, "engine": "vllm", "nodes": 1, "weight": 1.0, "name": "vllm-h100-80g"}
            ]
        )
    ).profiles[0]
    assert a.fingerprint == b.fingerprint  # defaults written out or not, keys in any order
    assert len(a.fingerprint) == 64
    for edit in ({"tp": 4}, {"args": ["--no-jinja"]}, {"env": {"NCCL_DEBUG": "INFO"}}, {"name": "other"}):
        c = ModelConfig.model_validate(_vllm(profiles=[{"engine": "vllm", "gpu_class": "h100-80g", "tp": 2, **edit}]))
        assert c.profiles[0].fingerprint != a.fingerprint, edit


# -- the catalog ----------------------------------------------------------------


async def test_declared_and_stored_and_their_refusals(address):
    store, cat = await _catalog(address, [_vllm(aliases=["chat"]), _static()])
    try:
        e = await cat.add(
            _vllm("llama", source="http://mirror:8081/llama/v1/", aliases=["small"], profiles=[{"engine": "llamacpp"}])
        )
        assert not e.declared and e.created_at is not None
        names = [(x.name, x.declared) for x in cat.models()]
        assert names == [("qwen", True), ("ext", True), ("llama", False)]
        assert cat.get("small").name == "llama"
        d = cat.models()[0].to_dict()
        assert d["declared"] and d["profiles"][0]["fingerprint"] == cat.models()[0].fingerprints["vllm-h100-80g"]

        with pytest.raises(CatalogError, match=r"^qwen is declared in server.yaml; change it there"):
            await cat.remove("qwen")
        with pytest.raises(CatalogError, match=r"^qwen is declared in server.yaml; change it there"):
            await cat.scale("qwen", 0)
        with pytest.raises(CatalogError, match='"chat" is an alias of qwen'):
            await cat.remove("chat")
        with pytest.raises(CatalogError, match="no model named nope"):
            await cat.remove("nope")
        # collisions across both sources, name and alias
        with pytest.raises(CatalogError, match=r'model: name: "qwen" is already the name of qwen'):
            await cat.add(_vllm("qwen"))
        with pytest.raises(CatalogError, match=r'model: aliases\[0\]: "chat" is already an alias of qwen'):
            await cat.add(_vllm("q2", aliases=["chat"]))
        with pytest.raises(CatalogError, match=r'model: name: "small" is already an alias of llama'):
            await cat.add(_vllm("small"))
        with pytest.raises(
            CatalogError, match=r"model: the configuration is not valid:\n  profiles\[0\]: gpu_class is missing"
        ):
            await cat.add(_vllm("q3", profiles=[{"engine": "sglang"}]))
        with pytest.raises(CatalogError, match=r"should be a mapping of keys .*, not a str"):
            await cat.add("name: x")  # type: ignore[arg-type]
        assert [r.name for r in await store.catalog_list()] == ["llama"]

        # scale: only the scaling block changes; refusals leave it as it was
        s = await cat.scale("llama", 0)
        assert (s.model.scaling.min, s.model.scaling.max, s.model.scaling.state) == (0, 1, "on demand")
        assert (await cat.scale("llama", 0, 0)).model.scaling.state == "stopped"
        with pytest.raises(
            CatalogError,
            match=r"scale: the configuration is not valid:\n  scaling: max \(1\) is smaller than min \(3\)",
        ):
            await cat.scale("llama", 3, 1)
        with pytest.raises(CatalogError, match=r"scaling.min: Input should be greater than or equal to 0"):
            await cat.scale("llama", -1)
        assert cat.get("llama").model.scaling.state == "stopped"
        assert cat.get("llama").fingerprints == e.fingerprints  # scaling is not the profile
        await cat.add(_static("ext2"))
        with pytest.raises(CatalogError, match="ext2 has no profiles"):
            await cat.scale("ext2", 2)
        assert (await cat.remove("ext2")).name == "ext2"
    finally:
        await store.close()

    # persistence: a reopened store gives the same run-time models back
    store, cat = await _catalog(address, [_vllm(aliases=["chat"])])
    try:
        [llama] = [x for x in cat.models() if not x.declared]
        assert llama.name == "llama" and llama.model.scaling.state == "stopped"
        assert llama.fingerprints == e.fingerprints and llama.created_at == e.created_at
        await cat.remove("llama")
    finally:
        await store.close()
    store, cat = await _catalog(address)
    try:
        assert cat.models() == [] and await store.catalog_list() == []
    finally:
        await store.close()


async def test_declaring_a_stored_name_later_lets_server_yaml_win(address):
    store, cat = await _catalog(address)
    try:
        await cat.add(_vllm("qwen"))
    finally:
        await store.close()
    store, cat = await _catalog(address, [_vllm("qwen2", aliases=["qwen"])])
    try:
        assert [x.name for x in cat.models()] == ["qwen2"]
        assert "is also an alias of qwen2 in server.yaml" in cat.problems[0]
        assert await cat.remove("qwen") is None
        assert await store.catalog_list() == []
    finally:
        await store.close()


async def test_store_put_replaces_and_keeps_created_at(address):
    async with await Store.open(address) as store:
        a = await store.catalog_put("m", '{"a":1}')
        b = await store.catalog_put("m", '{"a":2}')
        assert b.spec == '{"a":2}' and b.created_at == a.created_at and b.updated_at >= a.updated_at
        assert await store.catalog_delete("m") is True
        assert await store.catalog_delete("m") is False


async def test_catalog_without_store_refuses_changes():
    cat = Catalog([ModelConfig.model_validate(_static())])
    await cat.load()
    with pytest.raises(CatalogError, match="no store"):
        await cat.add(_vllm())


def test_load_model_file(tmp_path):
    p = tmp_path / "m.yaml"
    p.write_text("name: q\nsource: Qwen/Qwen2.5-7B-Instruct\nprofiles:\n  - engine: vllm\n    gpu_class: h100-80g\n")
    assert load_model_file(p)["profiles"] == [{"engine": "vllm", "gpu_class": "h100-80g"}]
    p.write_text("name: q\nsource: Qwen/Qwen2.5-7B-Instruct\nprofiles:\n  - engine: vllm\n")
    with pytest.raises(
        ConfigError, match=r"m.yaml: the configuration is not valid:\n  profiles\[0\]: gpu_class is missing"
    ):
        load_model_file(p)
    p.write_text("models:\n  - name: q\n")
    with pytest.raises(ConfigError, match="holds a models: list"):
        load_model_file(p)
    with pytest.raises(ConfigError, match="no such file"):
        load_model_file(tmp_path / "absent.yaml")


# -- source check ---------------------------------------------------------------


class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def _answer(self, body: bool):
        if self.path == "/m.gguf":
            self.send_response(200)
            self.send_header("Content-Length", "4")
            self.end_headers()
            if body:
                self.wfile.write(b"GGUF")
        elif self.path == "/noh.gguf":
            if not body:
                self.send_response(405)
                self.end_headers()
                return
            self.send_response(206)
            self.send_header("Content-Length", "1")
            self.end_headers()
            self.wfile.write(b"G")
        elif self.path in ("/qwen/v1/", "/html/", "/empty/"):
            data = {
                "/qwen/v1/": json.dumps({"files": [{"name": "a.gguf", "bytes": 4}]}).encode(),
                "/html/": b"<html>listing</html>",
                "/empty/": b'{"files": []}',
            }[self.path]
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        elif self.path == "/org/repo/resolve/main/f.gguf":
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()
        else:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

    def do_HEAD(self):
        self._answer(False)

    def do_GET(self):
        self._answer(True)


@pytest.fixture
def http_base():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


async def test_check_source_accepts_reachable_sources_and_says_why_others_fail(http_base, tmp_path):
    assert await check_source(f"{http_base}/m.gguf") is None
    assert await check_source(f"{http_base}/noh.gguf") is None
    assert await check_source(f"{http_base}/qwen/v1/") is None
    assert await check_source("hf:org/repo/f.gguf", hf_endpoint=http_base) is None
    assert "answered 404 Not Found" in await check_source(f"{http_base}/missing.gguf")
    assert "404" in await check_source(f"{http_base}/missing/")
    assert "not a directory listing" in await check_source(f"{http_base}/html/")
    assert "lists no files" in await check_source(f"{http_base}/empty/")
    assert "could not be reached" in await check_source("http://127.0.0.1:9/x.gguf")
    assert await check_source("Qwen/Qwen2.5-7B-Instruct") is None
    (tmp_path / "w.gguf").write_bytes(b"x")
    assert await check_source(str(tmp_path / "w.gguf")) is None
    assert "no such file" in await check_source(str(tmp_path / "nope.gguf"))


async def test_add_runs_the_source_check_before_writing(address, http_base):
    store, cat = await _catalog(address)
    try:
        with pytest.raises(CatalogError, match=r"^model: source: .*answered 404.*--no-source-check"):
            await cat.add(
                _vllm(source=f"{http_base}/gone.gguf", profiles=[{"engine": "llamacpp"}]), source_check=check_source
            )
        assert await store.catalog_list() == []
        await cat.add(_vllm(source=f"{http_base}/m.gguf", profiles=[{"engine": "llamacpp"}]), source_check=check_source)
        await cat.add(_vllm("other", source=f"{http_base}/gone.gguf", profiles=[{"engine": "llamacpp"}]))  # skipped
        assert [r.name for r in await store.catalog_list()] == ["other", "qwen"]
    finally:
        await store.close()
