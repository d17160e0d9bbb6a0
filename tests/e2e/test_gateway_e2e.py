"""`llmgw server` in its own process in front of real llama-server processes, driven by the openai SDK."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from harness import Gateway

from llmgw.testing.waiting import until

pytestmark = pytest.mark.e2e


def _usage_rows(store: str):
    from llmgw.store import Store

    async def run():
        s = await Store.open(store)
        try:
            return await s.list_usage(limit=1000)
        finally:
            await s.close()

    return asyncio.run(run())


def _wait_rows(store: str, n: int, timeout: float = 10.0):
    return until(lambda: rows if len(rows := _usage_rows(store)) >= n else None, timeout, f"{n} usage rows stored")


@pytest.fixture
def cluster(engines, tmp_path):
    chat = engines("tiny", n=2)
    embed = engines("tiny-embed", n=1, extra=("--embeddings", "--pooling", "mean"))
    gw = Gateway(
        tmp_path,
        models=[
            {
                "name": "tiny",
                "aliases": ["tiny-alias", "default"],
                "description": "random weights: replies are noise",
                "max_output": 64,
                "endpoints": [{"url": e.url, "engine": "llamacpp"} for e in chat],
            },
            {"name": "tiny-embed", "endpoints": [{"url": embed[0].url, "engine": "llamacpp"}]},
        ],
        router={"max_body_bytes": 65536},
    ).wait_up()
    key = gw.create_key("e2e")
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=60)
    yield gw, chat, key, client
    assert gw.stop() == 0, gw.text()


def test_chat_plain_and_usage_recorded(cluster):
    gw, _, _key, client = cluster
    r = client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=8
    )
    assert "gateway;dur=" in r.headers["server-timing"]
    reply = r.parse()
    assert reply.choices[0].message.content is not None
    assert reply.usage.prompt_tokens > 0 and reply.usage.completion_tokens > 0
    rows = _wait_rows(gw.store, 1)
    assert len(rows) == 1
    row = rows[0]
    assert (row.model, row.served_model, row.status, row.stream) == ("tiny", "tiny", 200, False)
    assert row.key_id and row.prompt_tokens == reply.usage.prompt_tokens
    assert row.completion_tokens == reply.usage.completion_tokens
    assert row.latency_ms > 0


def test_stream_with_usage_when_asked(cluster):
    gw, _, _, client = cluster
    chunks = list(
        client.chat.completions.create(
            model="tiny-alias",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert len(chunks) > 2
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    assert chunks[-1].choices == []
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    rows = _wait_rows(gw.store, 1)
    assert rows[0].stream and rows[0].model == "tiny-alias" and rows[0].served_model == "tiny"
    assert rows[0].completion_tokens == chunks[-1].usage.completion_tokens
    assert rows[0].ttft_ms is not None and rows[0].ttft_ms <= rows[0].latency_ms


def test_stream_without_usage_has_no_usage_chunk_but_usage_is_recorded(cluster):
    gw, _, _, client = cluster
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True
        )
    )
    assert chunks and all(c.usage is None for c in chunks)
    assert all(c.choices for c in chunks)
    rows = _wait_rows(gw.store, 1)
    assert rows[0].completion_tokens > 0 and rows[0].prompt_tokens > 0


def test_legacy_completions_through_the_gateway_reach_the_engine_by_alias(cluster):
    _, _, _, client = cluster
    r = client.completions.create(model="default", prompt="Once upon a time", max_tokens=8)
    assert r.choices[0].text is not None and r.usage.completion_tokens > 0


def test_embeddings_through_the_gateway_return_one_vector_per_input(cluster):
    _, _, _, client = cluster
    r = client.embeddings.create(model="tiny-embed", input=["hello world", "good night"])
    assert len(r.data) == 2 and len(r.data[0].embedding) > 0


def test_models_list_has_every_name_and_alias(cluster):
    _, _, _, client = cluster
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"tiny", "tiny-alias", "default", "tiny-embed"}
    assert models["tiny-alias"].model_extra["description"] == "random weights: replies are noise"
    assert "description" not in models["tiny-embed"].model_extra


def test_max_tokens_above_max_output_refused(cluster):
    _gw, _, _, client = cluster
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=100)
    assert "max_tokens is 100, but this model allows at most 64" in str(ei.value)


def test_refusals_in_openai_shape_and_nothing_recorded(cluster):
    gw, _, key, _client = cluster
    h = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    url = gw.url + "/v1/chat/completions"
    r = httpx.post(url, content=b"{not json", headers=h)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    assert set(r.json()["error"]) >= {"message", "type", "code"}
    r = httpx.post(url, json={"messages": [{"role": "user", "content": "x"}]}, headers=h)
    assert r.status_code == 400 and "'model' is required" in r.json()["error"]["message"]
    r = httpx.post(url, json={"model": "tiny"}, headers=h)
    assert r.status_code == 400 and "'messages' is required" in r.json()["error"]["message"]
    r = httpx.post(url, json={"model": "nope", "messages": []}, headers=h)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    big = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 70000}]}
    r = httpx.post(url, json=big, headers=h)
    assert r.status_code == 413 and "max_body_bytes" in r.json()["error"]["message"]
    r = httpx.post(url, json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 401 and "no api key was provided" in r.json()["error"]["message"]
    r = httpx.post(
        url,
        json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]},
        headers={"Authorization": "Bearer llmgw-wrong"},
    )
    assert r.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=gw.url + "/v1", api_key="nope", max_retries=0).models.list()
    time.sleep(0.6)  # not a wait: two flush intervals pass, and anything recorded would be written by now
    assert _usage_rows(gw.store) == []


def test_revoked_key_refused_within_two_seconds(cluster):
    gw, _, _, _ = cluster
    key = gw.create_key("to-revoke")
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
    assert client.models.list().data
    prefix = key[:14]
    r = gw.keys("revoke", prefix)
    assert r.returncode == 0, r.stderr

    def refusal() -> openai.AuthenticationError | None:
        try:
            client.models.list()
        except openai.AuthenticationError as exc:
            return exc
        return None

    # The two seconds are the promise under test, not a guess at how long it takes.
    exc = until(refusal, 2.0, "the revoked key to be refused", [gw])
    assert "revoked" in str(exc)


def test_metrics_and_endpoint_status(cluster):
    gw, chat, _, client = cluster
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4)
    text = httpx.get(gw.admin + "/metrics", headers=gw.admin_auth).text
    assert 'llmgw_requests_total{model="tiny",route="chat",status="200"} 1.0' in text
    assert "llmgw_request_duration_seconds_bucket" in text
    assert 'llmgw_tokens_total{direction="completion",model="tiny"}' in text
    for e in chat:
        assert f'llmgw_endpoint_healthy{{engine="llamacpp",model="tiny",replica="{e.url}"}} 1.0' in text
    assert "llmgw_endpoint_kv_cache_usage" in text or "llmgw_endpoint_running" in text
    status = httpx.get(gw.admin + "/api/v1/endpoints", headers=gw.admin_auth).json()["endpoints"]
    assert {s["url"] for s in status} >= {e.url for e in chat}
    assert all(s["healthy"] and not s["metrics_stale"] for s in status)


def test_one_engine_killed_traffic_continues(cluster):
    gw, chat, _, client = cluster
    chat[0].kill()
    for i in range(12):
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"n{i}"}], max_tokens=4)
        assert r.choices
    for _ in range(4):
        chunks = list(
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "s"}], max_tokens=4, stream=True
            )
        )
        assert chunks
    status = {s["url"]: s for s in httpx.get(gw.admin + "/api/v1/endpoints", headers=gw.admin_auth).json()["endpoints"]}
    assert not status[chat[0].url]["available"]
    chat[1].kill()
    with pytest.raises(openai.APIStatusError) as ei:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4)
    assert ei.value.status_code in (502, 503)
    # The embedding engine still answers, so the gateway as a whole stays ready.
    assert httpx.get(gw.url + "/ready").status_code == 200


def test_not_ready_until_an_endpoint_is_healthy(tmp_path):
    from harness import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    gw = Gateway(tmp_path, models=[{"name": "m", "endpoints": [{"url": dead, "engine": "vllm"}]}]).wait_up(ready=False)
    try:
        assert httpx.get(gw.url + "/health").status_code == 200
        r = httpx.get(gw.url + "/ready")
        assert r.status_code == 503
        key = gw.create_key()
        r = httpx.post(
            gw.url + "/v1/chat/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"model": "m", "messages": [{"role": "user", "content": "x"}]},
        )
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_endpoint"
    finally:
        assert gw.stop() == 0, gw.text()
