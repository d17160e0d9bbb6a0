"""What clients of an OpenAI-compatible server expect, through the real gateway in front of fake engines:
models.retrieve, the output limit read the same way under every name, the model name asked for in
every answer, and the rate-limit reset headers."""

from __future__ import annotations

import re
import socket

import httpx
import openai
import orjson
import pytest

from llmgw.config import parse_server_config
from llmgw.server.app import Server
from llmgw.server.gateway.limits import duration
from llmgw.server.gateway.request import _BadField, _output_limit
from llmgw.testing.fake_engine import FakeEngine


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
async def gw(tmp_path):
    engine = await FakeEngine(tokens=5).start()  # answers as "fake-model", whatever it was asked
    cfg = {
        "listen": f"127.0.0.1:{_port()}",
        "admin_listen": f"127.0.0.1:{_port()}",
        "metrics_listen": None,
        "auth": {"store": str(tmp_path / "gw.db")},
        "models": [
            {
                "name": "capped",
                "aliases": ["team/short"],
                "max_output": 200,
                "description": "capped",
                "endpoints": [{"url": engine.url, "engine": "llamacpp"}],
            },
            {"name": "open", "endpoints": [{"url": engine.url, "engine": "llamacpp"}]},
        ],
    }
    server = Server(parse_server_config(cfg))
    await server.start()
    secret, record = await server.store.create_key("t", project="proj")
    await server.keys.load()
    http = httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{server.config.listen.port}",
        timeout=30,
        headers={"Authorization": f"Bearer {secret}"},
    )
    yield server, engine, (secret, record.id), http
    await http.aclose()
    await server.stop()
    await engine.stop()


def _chat(model: str = "capped", **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}


# ------------------------------------------------------------------ models.retrieve


async def test_models_retrieve_by_name_and_alias_and_404_for_unknown(gw):
    server, _, (secret, _), _ = gw
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{server.config.listen.port}/v1", api_key=secret, max_retries=0
    )
    m = await client.models.retrieve("capped")
    assert (m.id, m.object, m.owned_by) == ("capped", "model", "llmgw")
    assert m.model_extra["max_output"] == 200
    alias = await client.models.retrieve("team/short")  # a name with a slash, sent as the SDK sends it
    assert alias.id == "team/short" and alias.model_extra["alias_of"] == "capped"
    with pytest.raises(openai.NotFoundError) as e:
        await client.models.retrieve("nope")
    err = e.value.body
    assert err["code"] == "model_not_found" and err["param"] == "model" and "'nope' does not exist" in err["message"]
    # The same key is needed as for the listing.
    bad = openai.AsyncOpenAI(base_url=client.base_url, api_key="llmgw-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await bad.models.retrieve("capped")
    async with httpx.AsyncClient() as plain:
        assert (await plain.get(f"{client.base_url}models/capped")).status_code == 401


# ------------------------------------------------------------------ the output limit


@pytest.mark.parametrize("value, read", [(200, 200), (200.0, 200), (0, 0), (None, None), (7.0, 7)])
def test_output_limit_reads_whole_numbers(value, read):
    for field in ("max_tokens", "max_completion_tokens", "n_predict"):
        body = {field: value}
        got, _, _ = _output_limit(body, None)
        assert got == read
        if value is not None:
            assert body[field] == read and type(body[field]) is int  # sent on as the gateway read it


@pytest.mark.parametrize(
    "value, says",
    [
        (200.5, "whole number of tokens, not 200.5"),
        (-1, "is -1; give a number of tokens of 0 or more"),
        ("200", 'whole number of tokens, not "200"'),
        (True, "whole number of tokens, not true"),
        ([5], "whole number of tokens, not [5]"),
        ({"n": 1}, "whole number of tokens"),
    ],
)
def test_output_limit_refuses_what_it_cannot_read_with_or_without_a_cap(value, says):
    for cap in (None, 500):
        for field in ("max_tokens", "max_completion_tokens", "n_predict"):
            body = {field: value}
            with pytest.raises(_BadField) as e:
                _output_limit(body, cap)
            assert e.value.field == field and says in e.value.message and field in e.value.message
            assert body == {field: value}  # nothing changed


def test_output_limit_with_a_cap_always_sends_max_tokens():
    body: dict = {}
    assert _output_limit(body, 200) == (200, True, None) and body == {"max_tokens": 200}
    body = {"n_predict": 50}  # an engine that does not read n_predict still stops at 50
    assert _output_limit(body, 200) == (50, True, None) and body == {"n_predict": 50, "max_tokens": 50}
    body = {"max_completion_tokens": 30}
    assert _output_limit(body, 200) == (30, False, None) and body == {"max_completion_tokens": 30}
    body = {"max_tokens": None}
    assert _output_limit(body, 200) == (200, True, None) and body == {"max_tokens": 200}
    body = {"max_tokens": 10, "n_predict": 150}  # the largest: whichever an engine obeys, no more
    assert _output_limit(body, 200)[0] == 150
    with pytest.raises(_BadField) as e:
        _output_limit({"max_tokens": 10, "n_predict": 201}, 200)
    assert e.value.field == "n_predict" and e.value.code == "max_tokens_too_large"
    body = {}
    assert _output_limit(body, None) == (None, False, None) and body == {}


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens", "n_predict"])
@pytest.mark.parametrize("value", [201, 200.5, -3, "100", False, 1e9])
async def test_gateway_refuses_an_output_limit_it_cannot_honour(gw, field, value):
    server, engine, _, http = gw
    before = len(engine.requests)
    r = await http.post("/v1/chat/completions", json=_chat(**{field: value}))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"] and err["type"] == "invalid_request_error"
    if value in (201, 1e9):
        assert err["code"] == "max_tokens_too_large" and "at most 200" in err["message"]
    assert len(engine.requests) == before  # nothing reached the engine
    await server.usage.flush()
    assert await server.store.list_usage(limit=10) == []


async def test_gateway_refuses_unreadable_limits_on_an_uncapped_model_too(gw):
    _, engine, _, http = gw
    for field in ("max_tokens", "max_completion_tokens", "n_predict"):
        for value in (2.5, -1, "10", True):
            r = await http.post("/v1/chat/completions", json=_chat("open", **{field: value}))
            assert r.status_code == 400 and r.json()["error"]["param"] == field
    r = await http.post("/v1/completions", json={"model": "open", "prompt": "x", "max_tokens": "5"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert not [q for q in engine.requests if q.path.startswith("/v1/")]


async def test_gateway_sends_the_engine_a_limit_it_reads(gw):
    _, engine, _, http = gw
    sent = []
    for extra in ({}, {"max_tokens": 200.0}, {"n_predict": 20}, {"stream": True}):
        r = await http.post("/v1/chat/completions", json=_chat(**extra))
        assert r.status_code == 200, r.text
        sent.append(engine.requests[-1].body)
    assert sent[0]["max_tokens"] == 200  # left out: the model's max_output
    assert sent[1]["max_tokens"] == 200 and type(sent[1]["max_tokens"]) is int
    assert (sent[2]["n_predict"], sent[2]["max_tokens"]) == (20, 20)
    assert sent[3]["max_tokens"] == 200
    r = await http.post("/v1/chat/completions", json=_chat("open"))
    assert "max_tokens" not in engine.requests[-1].body  # no cap: nothing added


# ------------------------------------------------------------------ the model name asked for


async def test_model_field_is_the_name_asked_for_whole_and_streamed(gw):
    _, engine, _, http = gw
    for asked in ("capped", "team/short"):
        r = await http.post("/v1/chat/completions", json=_chat(asked))
        assert r.json()["model"] == asked and r.json()["usage"]["completion_tokens"] == 5
        r = await http.post("/v1/completions", json={"model": asked, "prompt": "x"})
        assert r.json()["model"] == asked
        r = await http.post("/v1/embeddings", json={"model": asked, "input": ["a", "b"]})
        async with httpx.AsyncClient() as plain:
            direct = (
                await plain.post(engine.url + "/v1/embeddings", json={"model": "capped", "input": ["a", "b"]})
            ).content
        assert r.json()["model"] == asked  # the floats as the engine wrote them: only the name replaced
        assert r.content == direct.replace(b'"model":"fake-model"', b'"model":' + orjson.dumps(asked))
        body = (
            await http.post(
                "/v1/chat/completions", json=_chat(asked, stream=True, stream_options={"include_usage": True})
            )
        ).content
        events = [orjson.loads(e[6:]) for e in body.split(b"\n\n") if e.startswith(b"data: {")]
        assert len(events) == 8 and {e["model"] for e in events} == {asked}  # the usage event too
        assert events[-1]["usage"]["completion_tokens"] == 5
        body = (await http.post("/v1/completions", json={"model": asked, "prompt": "x", "stream": True})).content
        events = [orjson.loads(e[6:]) for e in body.split(b"\n\n") if e.startswith(b"data: {")]
        assert events and {e["model"] for e in events} == {asked}
    # Every engine answered as itself: the gateway rewrote it.
    assert all(q.body["model"] == "capped" for q in engine.requests if q.path.startswith("/v1/"))


async def test_model_rename_touches_only_the_model_field(gw):
    _, engine, _, http = gw
    engine.model = "capped"  # the engine's own name appears in the content, never replaced there
    engine._chat_deltas = [b'{"content":' + orjson.dumps('"model":"capped"') + b"}"]
    body = (await http.post("/v1/chat/completions", json=_chat("team/short", stream=True))).content
    events = [orjson.loads(e[6:]) for e in body.split(b"\n\n") if e.startswith(b"data: {")]
    assert {e["model"] for e in events} == {"team/short"}
    assert [e["choices"][0]["delta"].get("content") for e in events][1:-1] == ['"model":"capped"'] * 5


# ------------------------------------------------------------------ rate-limit reset headers


def test_duration_is_written_as_openai_does():
    assert [duration(s) for s in (0, 0.0004, 0.02, 0.999, 1, 1.5, 8.64, 59.9991, 60, 61.25, 360, 3600)] == [
        "0s",
        "1ms",
        "20ms",
        "999ms",
        "1s",
        "1.5s",
        "8.64s",
        "1m0s",
        "1m0s",
        "1m1.25s",
        "6m0s",
        "1h0m0s",
    ]


_DURATION = re.compile(r"^(\d+m)?(\d+(\.\d{1,3})?s|\d+ms)$")


async def test_reset_headers_beside_the_other_four(gw):
    server, _, (_, key_id), http = gw
    await server.store.set_limits("key", key_id, rpm=10, tpm=100_000)
    await server.keys.load()
    r = await http.post("/v1/chat/completions", json=_chat())
    h = r.headers
    assert h["x-ratelimit-limit-requests"] == "10" and h["x-ratelimit-remaining-requests"] == "9"
    for name in ("x-ratelimit-reset-requests", "x-ratelimit-reset-tokens"):
        assert _DURATION.match(h[name]), h[name]
        # Just charged: the window is full again when this request's second leaves it, within a minute.
        assert h[name] == "1m0s" or 58 <= float(h[name].rstrip("s")) <= 60
    for _ in range(9):
        await http.post("/v1/chat/completions", json=_chat())
    refused = await http.post("/v1/chat/completions", json=_chat(stream=True))
    assert refused.status_code == 429 and _DURATION.match(refused.headers["x-ratelimit-reset-requests"])
