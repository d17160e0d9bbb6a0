"""Requests of several sequences (n choices, best_of, a list of prompts): read, estimated and held for
all of them, and settled for every one generated, also where the engine counts only one (llama.cpp).

The decisions are plain functions (read_request, _estimate, choices_output); the settlement runs
through the real gateway in front of fake engines that count usage as vLLM and as llama-server do."""

from __future__ import annotations

import asyncio
import socket

import httpx
import orjson
import pytest

from llmgw.config import parse_server_config
from llmgw.server.app import Server
from llmgw.server.gateway.choices import choices_output, recounts
from llmgw.server.gateway.proxy import _estimate
from llmgw.server.gateway.request import (
    CHAT,
    COMPLETIONS,
    EMBEDDINGS,
    MAX_SEQUENCES,
    Call,
    Refusal,
    ServedModel,
    read_request,
)
from llmgw.testing.fake_engine import FakeEngine
from llmgw.testing.waiting import async_until

M = ServedModel("m", (), None, None)
MODELS = {"m": M}
MESSAGES = [{"role": "user", "content": "hi"}]


def _read(route, body) -> Call:
    got = read_request(route, body, MODELS)
    assert isinstance(got, Call), got
    return got


# ------------------------------------------------------------------ reading what is asked for


@pytest.mark.parametrize(
    ("extra", "outputs"),
    [
        ({}, 1),
        ({"n": 50}, 50),
        ({"n": 4.0}, 4),
        ({"n": None}, 1),
        ({"n_cmpl": 3}, 3),  # llama.cpp's own name, which it reads before n
        ({"n": 2, "n_cmpl": 5}, 5),
        ({"n": 2, "best_of": 6}, 6),  # vLLM generates best_of and returns n
    ],
)
def test_every_field_that_asks_for_more_sequences_multiplies_the_outputs(extra, outputs):
    assert _read(CHAT, {"model": "m", "messages": MESSAGES, **extra}).outputs == outputs
    assert _read(COMPLETIONS, {"model": "m", "prompt": "once", **extra}).outputs == outputs


@pytest.mark.parametrize(
    ("prompt", "prompts", "ids"),
    [
        ("once", 1, 0),
        (["a", "b", "c"], 3, 0),
        ([1, 2, 3, 4], 1, 4),  # one prompt given as token ids
        ([[1, 2], [3, 4, 5]], 2, 5),
        ([], 1, 0),  # the engine refuses it; nothing to multiply
    ],
)
def test_a_list_of_prompts_gets_n_choices_of_each(prompt, prompts, ids):
    c = _read(COMPLETIONS, {"model": "m", "prompt": prompt, "n": 3})
    assert (c.outputs, c.prompts, c.prompt_ids) == (3 * prompts, prompts, ids)


def test_embeddings_count_token_ids_given_as_such_and_generate_one_output():
    c = _read(EMBEDDINGS, {"model": "m", "input": [[7] * 300, [8] * 200], "n": 9})
    assert (c.outputs, c.prompt_ids) == (1, 500)  # n means nothing to an embedding


@pytest.mark.parametrize("field", ["n", "n_cmpl", "best_of"])
@pytest.mark.parametrize("value", [0, -1, MAX_SEQUENCES + 1, 2.5, "2", True, [2]])
def test_a_number_of_choices_it_cannot_serve_is_refused_naming_the_field(field, value):
    got = read_request(CHAT, {"model": "m", "messages": MESSAGES, field: value}, MODELS)
    assert isinstance(got, Refusal)
    assert (got.status, got.param, got.code) == (400, field, "invalid_request")
    assert f"'{field}' is " in got.message and f"from 1 to {MAX_SEQUENCES}" in got.message


def test_min_tokens_is_read_as_output_limits_are_and_refused_when_it_cannot_be():
    assert _read(CHAT, {"model": "m", "messages": MESSAGES, "min_tokens": 600.0}).min_out == 600
    assert _read(CHAT, {"model": "m", "messages": MESSAGES}).min_out == 0
    for bad in (-1, 2.5, "600", True):
        got = read_request(CHAT, {"model": "m", "messages": MESSAGES, "min_tokens": bad}, MODELS)
        assert isinstance(got, Refusal) and (got.status, got.param) == (400, "min_tokens")
        assert "give a whole number of tokens of 0 or more" in got.message


def test_the_estimate_holds_every_sequence_and_at_least_the_token_ids_given():
    raw = b"x" * 400  # 100 tokens by the bytes
    assert _estimate(raw, 16, M) == (100, 16)
    assert _estimate(raw, 16, M, 50) == (100, 800)
    assert _estimate(raw, None, ServedModel("c", (), None, 32), 4) == (100, 128)
    assert _estimate(raw, 16, M, 1, prompt_ids=1000) == (1000, 16)
    # No limit given nor set by the model (256 assumed), but vLLM makes at least min_tokens of each.
    assert _estimate(raw, None, M, 2, min_out=600) == (100, 1200)


# ------------------------------------------------------------------ what a whole reply shows


def _llama_reply(finishes: list[str], texts: list[str], reported: int) -> dict:
    # llama-server's reply to n>1 (llama.cpp in llama-cpp-python 0.3.36): the first task's object,
    # every task's choice appended, and the first task's usage only.
    return {
        "choices": [
            {"finish_reason": f, "index": i, "message": {"role": "assistant", "content": t}}
            for i, (f, t) in enumerate(zip(finishes, texts, strict=True))
        ],
        "object": "chat.completion",
        "usage": {"completion_tokens": reported, "prompt_tokens": 9, "total_tokens": reported + 9},
    }


def test_choices_cut_by_the_limit_count_the_limit_and_the_others_their_text():
    reply = _llama_reply(["length"] * 4, ["x"] * 4, 16)
    assert choices_output(reply, 16) == 64
    stopped = _llama_reply(["length", "stop", "stop"], ["a", "b" * 40, ""], 16)
    assert choices_output(stopped, 16) == 16 + 10 + 1  # 40 bytes at 4 a token; the end token
    assert choices_output(_llama_reply(["stop"], ["b" * 400], 1), 16) == 16  # never above the limit
    assert choices_output(_llama_reply(["stop"], ["b" * 400], 1), None) == 100
    text = {"choices": [{"text": "abcdefgh", "finish_reason": "stop"}, {"text": "", "finish_reason": "length"}]}
    assert choices_output(text, 5) == 2 + 5
    tools = {
        "choices": [
            {
                "finish_reason": "tool_calls",
                "message": {"content": None, "tool_calls": [{"function": {"name": "abcd", "arguments": "{}" * 6}}]},
            }
        ]
    }
    assert choices_output(tools, None) == 4
    assert choices_output({"choices": "nonsense"}, 5) == 0


def test_only_engines_that_count_every_sequence_are_taken_at_their_word():
    assert not recounts("vllm", 4) and not recounts("sglang", 4)
    assert recounts("llamacpp", 4) and recounts("openai", 2)
    assert not recounts("llamacpp", 1)  # one sequence: every engine counts it


# ------------------------------------------------------------------ settled through the gateway


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
async def gateway(tmp_path):
    """A gateway in front of an engine counting as vLLM does (model "v", engine vllm) and one
    counting as llama-server does (model "l", engine llamacpp); a key limited to 10^8 tokens a minute."""
    vllm = await FakeEngine(tokens=100, metrics="vllm").start()
    llama = await FakeEngine(tokens=100, usage="first").start()
    cfg = {
        "listen": f"127.0.0.1:{_port()}",
        "admin_listen": f"127.0.0.1:{_port()}",
        "metrics_listen": None,
        "auth": {"store": str(tmp_path / "gw.db")},
        "router": {"scrape_interval": "100ms"},
        "models": [
            {"name": "v", "endpoints": [{"url": vllm.url, "engine": "vllm", "model": "fake-model"}]},
            {"name": "l", "endpoints": [{"url": llama.url, "engine": "llamacpp", "model": "fake-model"}]},
        ],
    }
    server = Server(parse_server_config(cfg))
    await server.start()
    await server.store.add_org("Acme")
    await server.store.add_team("platform", "Acme")
    await server.store.add_project("gateway", "Acme/platform")
    issued = await server.store.issue_key("n", project="Acme/platform/gateway")
    await server.store.set_limits("key", issued.key.id, tpm=10**8)
    await server.keys.load()
    http = httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{server.config.listen.port}",
        timeout=30,
        headers={"Authorization": f"Bearer {issued.secret}"},
    )
    yield server, http, {"v": vllm, "l": llama}
    await http.aclose()
    await server.stop()
    await vllm.stop()
    await llama.stop()


async def _rows(server: Server, n: int):
    async def got():
        await server.usage.flush()
        rows = await server.store.list_usage(limit=1000)
        return rows if len(rows) >= n else None

    return await async_until(got, 10, f"{n} usage rows")


def _body(model: str, n: int, stream: bool, route: str = "chat") -> dict:
    body: dict = {"model": model, "max_tokens": 16, "n": n, "stream": stream}
    if route == "chat":
        body["messages"] = MESSAGES
    else:
        body["prompt"] = ["one", "two"]
    return body


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("model", ["v", "l"])
async def test_n_choices_are_settled_for_every_choice_whether_the_engine_counts_them_all_or_one(gateway, model, stream):
    server, http, engines = gateway
    for n in (1, 4):
        r = await http.post("/v1/chat/completions", json=_body(model, n, stream))
        assert r.status_code == 200, r.text
    r = await http.post("/v1/completions", json=_body(model, 3, stream, "completions"))
    assert r.status_code == 200, r.text
    rows = sorted(await _rows(server, 3), key=lambda row: row.id)
    # 16 a choice: 1, 4, then 3 of each of 2 prompts; exactly what the engine generated.
    assert [row.completion_tokens for row in rows] == [16, 64, 96]
    assert engines[model].tokens_generated == 16 + 64 + 96
    assert all(row.prompt_tokens > 0 for row in rows)


async def test_the_tokens_held_while_a_stream_runs_are_every_choices_limit(gateway):
    _, http, _ = gateway
    body = _body("l", 50, True)
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        held = 10**8 - int(r.headers["x-ratelimit-remaining-tokens"])
        await r.aread()
    prompt = len(orjson.dumps(body)) // 4
    assert held == prompt + 50 * 16  # the headers leave with the estimate charged


@pytest.mark.parametrize("model", ["v", "l"])
async def test_a_stream_of_several_choices_cut_early_is_charged_for_every_choice_that_passed(gateway, model):
    server, http, engines = gateway
    engine = engines[model]
    engine.token_ms = 2.0  # one event a token per choice, paced as an engine makes them
    engine.fail_next(1, mode="stall", after_tokens=10)
    got = 0
    async with http.stream("POST", "/v1/chat/completions", json={**_body(model, 4, True), "max_tokens": 50}) as r:
        async for line in r.aiter_lines():
            if '"content":"' in line and '"content":""' not in line:
                got += 1
                if got == 40:
                    break  # 10 tokens of each of 4 choices: the client leaves
    (row,) = await _rows(server, 1)
    assert row.status == 499 and row.completion_tokens == 40 == engine.tokens_generated


async def test_a_burst_of_n_choices_holds_a_token_limit_to_what_the_engine_generates(gateway):
    server, http, engines = gateway
    issued = await server.store.issue_key("tight", project="Acme/platform/gateway")
    await server.store.set_limits("key", issued.key.id, tpm=2000)
    await server.keys.load()
    auth = {"Authorization": f"Bearer {issued.secret}"}
    replies = await asyncio.gather(
        *(http.post("/v1/chat/completions", json=_body("l", 50, False), headers=auth) for _ in range(100))
    )
    codes = [r.status_code for r in replies]
    # Each holds about 800 tokens: two fit in the minute's 2,000, the rest are refused.
    assert codes.count(200) == 2 and codes.count(429) == 98, codes
    rows = await _rows(server, 2)
    served = sum(row.prompt_tokens + row.completion_tokens for row in rows)
    assert served <= 2000 and engines["l"].tokens_generated == 2 * 800
