"""The one Hugging Face client (llmgw/huggingface.py) that the mirror and the Mirror page share: what each
failure is called, the tree listing's pages, and a listing entry read as a file."""

from __future__ import annotations

import httpx
import pytest

from llmgw import huggingface as hub

BASE = "http://hub.test"


def client(answer) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.MockTransport(answer))


@pytest.mark.parametrize(
    "answer,kind",
    [
        (lambda r: httpx.Response(401), "denied"),
        (lambda r: httpx.Response(403), "denied"),
        (lambda r: httpx.Response(404), "missing"),
        (lambda r: httpx.Response(503), "status"),
        (lambda r: httpx.Response(200, text="<html>"), "not-json"),
        (lambda r: httpx.Response(200, json=[1]), "not-described"),
    ],
)
async def test_each_failure_of_the_model_facts_has_its_kind(answer, kind):
    async with client(answer) as c:
        with pytest.raises(hub.HFError) as ei:
            await hub.model_info(c, BASE + "/", "org/name")
    assert ei.value.kind == kind and ei.value.url == f"{BASE}/api/models/org/name" and ei.value.endpoint == BASE


async def test_an_unreachable_hub_carries_httpx_error_and_callers_word_it():
    def answer(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    async with client(answer) as c:
        with pytest.raises(hub.HFError) as ei:
            await hub.model_info(c, BASE, "org/name")
    words = {"unreachable": "{endpoint} ({error}) for {what}"}
    assert ei.value.worded(words, what="hf:org/name") == f"{BASE} (ConnectError: refused) for hf:org/name"


async def test_the_listing_follows_its_pages_and_stops_at_the_limit():
    asked: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        asked.append(str(request.url))
        n = int(request.url.params.get("cursor", "0"))
        more = {"Link": f'<{request.url.copy_set_param("cursor", n + 1)}>; rel="next"'} if n < 2 else {}
        return httpx.Response(200, json=[{"type": "directory", "path": "d"}, {"path": f"f{n}"}], headers=more)

    async with client(answer) as c:
        files = await hub.tree(c, BASE, "org/name", "abc", max_pages=3)
        assert [f.path for f in files] == ["f0", "f1", "f2"]
        assert asked[0] == f"{BASE}/api/models/org/name/tree/abc?recursive=1"
        with pytest.raises(hub.HFError) as ei:
            await hub.tree(c, BASE, "org/name", "abc", max_pages=2)
    assert ei.value.kind == "too-long"


async def test_a_listing_page_that_is_not_a_list_is_said():
    async with client(lambda r: httpx.Response(200, json={"error": "no"})) as c:
        with pytest.raises(hub.HFError) as ei:
            await hub.tree(c, BASE, "org/name", "main")
    assert ei.value.kind == "not-listing"


def test_an_entry_is_read_with_its_lfs_size_and_oid():
    assert hub.TreeFile.read({"path": "m.gguf", "size": 134, "lfs": {"size": 9, "oid": "ab"}}) == hub.TreeFile(
        "m.gguf", 9, "ab"
    )
    assert hub.TreeFile.read({"type": "file", "path": "c.json", "size": 5}) == hub.TreeFile("c.json", 5, None)
    assert hub.TreeFile.read({"path": "x", "size": True}) == hub.TreeFile("x", None, None)
    assert hub.TreeFile.read({"type": "directory", "path": "d"}) is None
    assert hub.TreeFile.read({"type": "file"}) is None
    assert hub.TreeFile.read("m.gguf") is None


def test_a_shard_set_is_named_alike_in_either_case():
    assert hub.SHARD.search("q4/m-00002-of-00003.gguf") and hub.SHARD.search("M-00001-OF-00002.GGUF")
    assert not hub.SHARD.search("m-1-of-3.gguf")
