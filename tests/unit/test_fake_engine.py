"""Unit tests for the fake OpenAI-compatible engine."""

from __future__ import annotations

import asyncio
import base64
import math
import re
import struct
import sys
from pathlib import Path

import aiohttp
import openai
import orjson
import pytest

from llmgw.testing.fake_engine import (
    FakeEngine,
    chat_prompt_tokens,
    count_text_tokens,
    fake_embedding,
)
from llmgw.testing.waiting import async_until

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "metrics"
MSG = [{"role": "user", "content": "Hello there, engine"}]


@pytest.fixture
async def fe():
    async with FakeEngine(port=0, model="m1", tokens=5) as engine:
        yield engine


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as s:
        yield s


def sse_events(raw: bytes) -> list[bytes]:
    """Split an SSE body into its data payloads, checking the framing on the way."""
    assert raw.endswith(b"\n\n")
    events = raw[:-2].split(b"\n\n")
    assert all(e.startswith(b"data: ") for e in events)
    return [e[len(b"data: ") :] for e in events]


# ------------------------------------------------------------------ helpers


def test_token_counting_is_deterministic():
    assert count_text_tokens("") == 0
    assert count_text_tokens("abcd") == 1
    assert count_text_tokens("abcde") == 2
    assert count_text_tokens("é") == 1  # counted in UTF-8 bytes
    assert chat_prompt_tokens(MSG) == 3 + 4 + count_text_tokens(MSG[0]["content"])
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello there, engine"}]}]
    assert chat_prompt_tokens(parts) == chat_prompt_tokens(MSG)
    assert chat_prompt_tokens("nonsense") == 0


def test_fake_embedding_is_unit_and_stable():
    a = fake_embedding("x", 32)
    assert len(a) == 32
    assert math.isclose(sum(v * v for v in a), 1.0, rel_tol=1e-9)
    assert a == fake_embedding("x", 32)
    assert a != fake_embedding("y", 32)


def test_the_fake_engine_refuses_an_unknown_metrics_flavour():
    with pytest.raises(ValueError):
        FakeEngine(metrics="sglang")


# ------------------------------------------------------------------ chat


async def test_the_fake_engine_url_and_base_url_name_its_loopback_port(fe):
    assert fe.port > 0
    assert fe.url == f"http://127.0.0.1:{fe.port}"
    assert fe.base_url == fe.url + "/v1"


async def test_chat_plain_with_openai_sdk(fe):
    async with openai.AsyncOpenAI(base_url=fe.base_url, api_key="k", max_retries=0) as c:
        r = await c.chat.completions.create(model="m1", messages=MSG)
    assert r.object == "chat.completion"
    assert r.model == "m1"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == " lorem ipsum dolor sit amet"
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 5
    assert r.usage.prompt_tokens == chat_prompt_tokens(MSG)
    assert r.usage.total_tokens == r.usage.prompt_tokens + 5


async def test_chat_max_tokens_limits(fe, http):
    for key in ("max_tokens", "max_completion_tokens"):
        async with http.post(fe.url + "/v1/chat/completions", json={"messages": MSG, key: 2}) as r:
            body = await r.json()
        assert body["usage"]["completion_tokens"] == 2
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["choices"][0]["message"]["content"] == " lorem ipsum"


async def test_chat_stream_include_usage_exact_shape(fe, http):
    req = {"model": "m1", "messages": MSG, "stream": True, "stream_options": {"include_usage": True}}
    async with http.post(fe.url + "/v1/chat/completions", json=req) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        raw = await r.read()
    events = sse_events(raw)
    assert events[-1] == b"[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert len(chunks) == 1 + 5 + 1 + 1  # role, tokens, finish, usage
    assert len({c["id"] for c in chunks}) == 1
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "m1" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"]["content"] for c in chunks[1:6]] == [" lorem", " ipsum", " dolor", " sit", " amet"]
    assert chunks[6]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    # Like OpenAI: usage null on every chunk but the last, which has no choices.
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {
        "prompt_tokens": chat_prompt_tokens(MSG),
        "completion_tokens": 5,
        "total_tokens": chat_prompt_tokens(MSG) + 5,
    }


async def test_chat_stream_without_usage(fe, http):
    async with http.post(fe.url + "/v1/chat/completions", json={"messages": MSG, "stream": True}) as r:
        events = sse_events(await r.read())
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert all("usage" not in c for c in chunks)
    assert all(c["choices"] for c in chunks)


async def test_paced_stream_matches_unpaced(fe, http):
    async def body() -> list[dict]:
        req = {"messages": MSG, "stream": True, "stream_options": {"include_usage": True}}
        async with http.post(fe.url + "/v1/chat/completions", json=req) as r:
            out = [orjson.loads(e) for e in sse_events(await r.read())[:-1]]
        for c in out:
            c.pop("id"), c.pop("created")
        return out

    fast = await body()
    fe.token_ms = 1
    assert await body() == fast


async def test_stream_with_openai_sdk(fe):
    fe.tokens = 3
    async with openai.AsyncOpenAI(base_url=fe.base_url, api_key="k", max_retries=0) as c:
        stream = await c.chat.completions.create(
            model="m1", messages=MSG, stream=True, stream_options={"include_usage": True}
        )
        chunks = [ch async for ch in stream]
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == " lorem ipsum dolor"
    assert chunks[-1].usage.completion_tokens == 3


async def test_the_fake_engine_delays_the_first_and_each_later_token_as_configured(http):
    async with FakeEngine(tokens=4, ttft_ms=60, token_ms=20) as fe:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        async with http.post(fe.url + "/v1/chat/completions", json={"messages": MSG, "stream": True}) as r:
            first = None
            async for line in r.content:
                if b'"content":" lorem"' in line and first is None:
                    first = loop.time() - t0
            total = loop.time() - t0
    assert first is not None and first >= 0.055
    assert total >= 0.055 + 3 * 0.018


async def test_the_fake_engine_answers_malformed_or_empty_chat_requests_with_400(fe, http):
    async with http.post(fe.url + "/v1/chat/completions", data=b"{nope") as r:
        assert r.status == 400
        assert "error" in await r.json()
    async with http.post(fe.url + "/v1/chat/completions", json={"messages": []}) as r:
        assert r.status == 400


# ------------------------------------------------------------------ completions, embeddings


async def test_completions_plain_and_stream(fe, http):
    async with http.post(fe.url + "/v1/completions", json={"prompt": ["abcd", "abcdefgh"], "max_tokens": 3}) as r:
        body = await r.json()
    assert body["object"] == "text_completion"
    # One choice for each prompt, as engines answer a list of prompts; usage counts both.
    assert [c["text"] for c in body["choices"]] == [" lorem ipsum dolor"] * 2
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}

    req = {"prompt": [1, 2, 3, 4], "stream": True, "stream_options": {"include_usage": True}}
    async with http.post(fe.url + "/v1/completions", json=req) as r:
        events = sse_events(await r.read())
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == " lorem ipsum dolor sit amet"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] == 4


async def test_fake_engine_embeddings_are_deterministic_in_float_and_base64(http):
    async with FakeEngine(embedding_dim=16) as fe:
        async with openai.AsyncOpenAI(base_url=fe.base_url, api_key="k", max_retries=0) as c:
            r = await c.embeddings.create(model="x", input=["hello", "hello world"], encoding_format="float")
        assert [d.index for d in r.data] == [0, 1]
        assert all(len(d.embedding) == 16 for d in r.data)
        assert r.data[0].embedding == pytest.approx(fake_embedding("hello", 16))
        assert r.usage.prompt_tokens == count_text_tokens("hello") + count_text_tokens("hello world")

        async with http.post(fe.url + "/v1/embeddings", json={"input": "hello", "encoding_format": "base64"}) as resp:
            b64 = (await resp.json())["data"][0]["embedding"]
        vals = struct.unpack("<16f", base64.b64decode(b64))
        assert vals == pytest.approx(fake_embedding("hello", 16), abs=1e-6)


# ------------------------------------------------------------------ models, health


async def test_models_and_health(fe, http):
    async with http.get(fe.url + "/v1/models") as r:
        body = await r.json()
    assert [m["id"] for m in body["data"]] == ["m1"]
    assert body["data"][0]["owned_by"] == "llamacpp"
    async with http.get(fe.url + "/health") as r:
        assert r.status == 200 and await r.json() == {"status": "ok"}
    fe.loading = True
    async with http.get(fe.url + "/health") as r:
        assert r.status == 503
        assert (await r.json())["error"]["message"] == "Loading model"
    async with http.post(fe.url + "/v1/chat/completions", json={"messages": MSG}) as r:
        assert r.status == 503


async def test_vllm_health_models_and_unknown_model(http):
    async with FakeEngine(metrics="vllm", model="org/m") as fe:
        async with http.get(fe.url + "/health") as r:
            assert r.status == 200 and await r.read() == b""
        async with http.get(fe.url + "/v1/models") as r:
            assert (await r.json())["data"][0]["owned_by"] == "vllm"
        async with http.post(fe.url + "/v1/chat/completions", json={"model": "other", "messages": MSG}) as r:
            assert r.status == 404
            assert (await r.json())["message"] == "The model `other` does not exist."


# ------------------------------------------------------------------ metrics


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")


def parse_metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        m = _SAMPLE.match(line)
        assert m, line
        out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def names(text: str, prefix: str) -> set[str]:
    return {re.split(r"[{ ]", line)[0] for line in text.splitlines() if line.startswith(prefix)}


async def test_llamacpp_metrics_match_real_names(fe, http):
    async with http.get(fe.url + "/metrics") as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = await r.text()
    fixture = (FIXTURES / "llamacpp.txt").read_text()
    assert names(text, "llamacpp:") == names(fixture, "llamacpp:")
    # Same HELP/TYPE lines, in the same order, as the captured llama-server.
    assert [ln for ln in text.splitlines() if ln.startswith("#")] == [
        ln for ln in fixture.splitlines() if ln.startswith("#")
    ]
    parse_metrics(text)


async def test_llamacpp_legacy_has_kv_gauges():
    async with FakeEngine(metrics="llamacpp-legacy") as fe:
        m = parse_metrics(fe.metrics_text())
    assert m["llamacpp:kv_cache_usage_ratio"] == 0
    assert "llamacpp:kv_cache_tokens" in m


async def test_metrics_reflect_in_flight_and_queue(http):
    async with FakeEngine(tokens=2, ttft_ms=300, slots=2) as fe:
        tasks = [
            asyncio.create_task(http.post(fe.url + "/v1/chat/completions", json={"messages": MSG})) for _ in range(3)
        ]
        await async_until(lambda: fe.in_flight == 3, what="all three requests in flight")
        m = parse_metrics(fe.metrics_text())
        assert m["llamacpp:requests_processing"] == 2
        assert m["llamacpp:requests_deferred"] == 1
        for resp in await asyncio.gather(*tasks):
            assert resp.status == 200
            resp.release()
        m = parse_metrics(fe.metrics_text())
        assert m["llamacpp:requests_processing"] == 0
        assert m["llamacpp:requests_deferred"] == 0
        assert m["llamacpp:tokens_predicted_total"] == 6
        assert m["llamacpp:prompt_tokens_total"] == 3 * chat_prompt_tokens(MSG)


async def test_fake_engine_vllm_metrics_follow_requests_and_exist_in_real_vllm(http):
    async with FakeEngine(metrics="vllm", model="org/m", tokens=3, ttft_ms=200, kv_capacity_tokens=100) as fe:
        task = asyncio.create_task(http.post(fe.url + "/v1/chat/completions", json={"messages": MSG}))
        await async_until(lambda: fe.processing, what="the request processing")
        async with http.get(fe.url + "/metrics") as r:
            text = await r.text()
        m = parse_metrics(text)
        lab = '{engine="0",model_name="org/m"}'
        assert m["vllm:num_requests_running" + lab] == 1
        assert m["vllm:num_requests_waiting" + lab] == 0
        kv = (chat_prompt_tokens(MSG) + 3) / 100
        assert m["vllm:kv_cache_usage_perc" + lab] == pytest.approx(kv)
        assert m["vllm:gpu_cache_usage_perc" + lab] == pytest.approx(kv)
        (await task).release()
        m = parse_metrics(fe.metrics_text())
        assert m["vllm:num_requests_running" + lab] == 0
        assert m["vllm:generation_tokens_total" + lab] == 3
        assert m['vllm:request_success_total{engine="0",finished_reason="stop",model_name="org/m"}'] == 1
        assert m["vllm:e2e_request_latency_seconds_count" + lab] == 1
        assert m['vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="org/m"}'] == 1
    # Every vllm: family we export exists in the (realistic) vLLM fixture.
    fixture = (FIXTURES / "vllm.txt").read_text()
    assert names(text, "vllm:") <= names(fixture, "vllm:")


# ------------------------------------------------------------------ failures


async def test_fail_next_status_fails_only_that_many_chat_requests_not_health(fe, http):
    fe.fail_next(2, status=503)
    statuses = []
    for _ in range(3):
        async with http.post(fe.url + "/v1/chat/completions", json={"messages": MSG}) as r:
            statuses.append(r.status)
            if r.status != 200:
                assert (await r.json())["error"]["code"] == 503
    assert statuses == [503, 503, 200]
    # Health and metrics are not affected by injected faults.
    fe.fail_next(1, status=500)
    async with http.get(fe.url + "/health") as r:
        assert r.status == 200
    fe.clear_faults()
    async with http.post(fe.url + "/v1/embeddings", json={"input": "x"}) as r:
        assert r.status == 200


async def test_fail_next_close_drops_one_connection_then_answers(fe, http):
    fe.fail_next(1, mode="close")
    with pytest.raises(aiohttp.ServerDisconnectedError):
        async with http.post(fe.url + "/v1/chat/completions", json={"messages": MSG}) as r:
            await r.read()
    async with http.post(fe.url + "/v1/chat/completions", json={"messages": MSG}) as r:
        assert r.status == 200


async def test_fail_next_midstream_cuts_a_stream_after_the_tokens_asked_for(fe, http):
    fe.fail_next(1, mode="midstream", after_tokens=2)
    got = []
    with pytest.raises(aiohttp.ClientPayloadError):
        async with http.post(fe.url + "/v1/chat/completions", json={"messages": MSG, "stream": True}) as r:
            assert r.status == 200
            async for line in r.content:
                if line.startswith(b"data: "):
                    got.append(line)  # noqa: PERF401  # a comprehension would lose the lines read before the cut
    assert len(got) == 3  # role chunk + 2 tokens, then the connection drops
    assert b"[DONE]" not in b"".join(got)
    assert fe.in_flight == 0


async def test_fail_next_hang_counts_as_processing(fe, http):
    fe.fail_next(1, mode="hang")
    with pytest.raises(asyncio.TimeoutError):
        async with http.post(
            fe.url + "/v1/chat/completions", json={"messages": MSG}, timeout=aiohttp.ClientTimeout(total=0.3)
        ) as r:
            await r.read()
    # It stays "processing" until it notices the client is gone.
    await async_until(lambda: fe.processing == 0, what="the hung request to stop counting as processing")
    assert fe.processing == 0


async def test_fail_next_bad_mode(fe):
    with pytest.raises(ValueError):
        fe.fail_next(mode="explode")


async def test_requests_are_recorded(fe, http):
    async with http.post(
        fe.url + "/v1/chat/completions", json={"messages": MSG, "user": "u1"}, headers={"X-Trace": "t1"}
    ) as r:
        assert r.status == 200
    rec = fe.requests[-1]
    assert rec.path == "/v1/chat/completions" and rec.body["user"] == "u1"
    assert rec.headers["X-Trace"] == "t1"


# ------------------------------------------------------------------ CLI


async def test_cli_prints_url_and_serves(http):
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "llmgw.testing.fake_engine",
        "--port",
        "0",
        "--model",
        "cli-m",
        "--tokens",
        "2",
        "--metrics",
        "vllm",
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 20)
        url = line.decode().strip()
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+", url)
        async with http.post(url + "/v1/chat/completions", json={"model": "cli-m", "messages": MSG}) as r:
            assert (await r.json())["usage"]["completion_tokens"] == 2
        async with http.get(url + "/metrics") as r:
            assert "vllm:num_requests_running" in await r.text()
    finally:
        proc.terminate()
        assert await asyncio.wait_for(proc.wait(), 10) == 0


async def test_n_choices_are_each_generated_in_full_and_counted_as_vllm_or_llama_server_counts_them(http):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": 4}
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with FakeEngine(tokens=8) as vllm, FakeEngine(tokens=8, usage="first") as llama:
        for fe, whole_usage, stream_usages in ((vllm, 12, [12]), (llama, 3, [3, 3, 3, 3])):
            async with http.post(fe.url + "/v1/chat/completions", json=body) as r:
                got = await r.json()
            assert [c["index"] for c in got["choices"]] == [0, 1, 2, 3]
            assert all(c["message"]["content"] == " lorem ipsum dolor" for c in got["choices"])
            assert got["usage"]["completion_tokens"] == whole_usage
            async with http.post(fe.url + "/v1/chat/completions", json=stream) as r:
                chunks = [orjson.loads(e) for e in sse_events(await r.read())[:-1]]
            texts: dict[int, str] = {}
            for c in chunks:
                for ch in c["choices"]:
                    texts[ch["index"]] = texts.get(ch["index"], "") + (ch["delta"].get("content") or "")
            assert texts == dict.fromkeys(range(4), " lorem ipsum dolor")
            assert [c["usage"]["completion_tokens"] for c in chunks if c.get("usage")] == stream_usages
            assert fe.tokens_generated == 24  # what a gateway should charge, either way
