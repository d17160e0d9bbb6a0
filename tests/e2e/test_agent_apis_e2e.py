"""The agents' APIs against real llama-server processes behind a real `llmgw server`, driven by
the official clients: the openai Python and Node SDKs' Responses API, the anthropic SDK's Messages
API (the key both ways, count_tokens counted by the engine), a conversation of three turns through
x-llmgw-thread (its second turn to another model), memory notes over HTTP and through the mcp
SDK's client, and the usage rows and limits of every one of these routes.

The test model's weights are random, so no engine here chooses to call a tool: a call the model
makes is tested against fake engines (tests/unit/test_agent_apis.py); here the engine reads a
call and its output sent back, through its real chat template.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sqlite3
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from harness import Gateway, require

from llmgw.testing.mcp_client import official_client
from llmgw.testing.waiting import until

pytestmark = pytest.mark.e2e

NODE_DIR = Path(__file__).parent / "node"


def _store(path: str, op):
    from llmgw.store import Store

    async def run():
        s = await Store.open(path)
        try:
            return await op(s)
        finally:
            await s.close()

    return asyncio.run(run())


def _key(gw: Gateway, project: str) -> str:
    r = gw.keys("create", "--name", f"agent-{project.replace('/', '-')}", "--project", project)
    assert r.returncode == 0, r.stderr
    secret = r.stdout.strip().splitlines()[-1]
    until(
        lambda: httpx.get(gw.url + "/v1/models", headers={"Authorization": f"Bearer {secret}"}).status_code == 200,
        10,
        "the server to accept the new key",
        [gw],
    )
    return secret


def _rows(gw: Gateway, n: int):
    def read():
        rows = _store(gw.store, lambda s: s.list_usage(limit=1000))
        return rows if len(rows) >= n else None

    return until(read, 15, f"{n} usage rows", [gw])


@pytest.fixture
def agents(engines, tmp_path):
    first, second = engines("tiny", n=2)
    gw = Gateway(
        tmp_path,
        models=[
            {"name": "tiny", "max_output": 16, "endpoints": [{"url": first.url, "engine": "llamacpp"}]},
            {"name": "tiny-b", "endpoints": [{"url": second.url, "engine": "llamacpp", "model": "tiny"}]},
        ],
    ).wait_up()

    async def tenancy(s):
        await s.add_org("Acme")
        await s.add_team("platform", "Acme")
        await s.add_project("agents", "Acme/platform")
        await s.add_project("billing", "Acme/platform")

    _store(gw.store, tenancy)
    gw.project, gw.other = "Acme/platform/agents", "Acme/platform/billing"
    gw.secret = _key(gw, gw.project)
    gw.other_secret = _key(gw, gw.other)
    yield gw
    assert gw.stop() == 0, gw.text()


def _keep(gw: Gateway, kind: str, project: str, hours: int = 24) -> None:
    r = gw.keys(kind, "--project", project, "--retain-hours", str(hours))
    assert r.returncode == 0, r.stderr
    # The server reloads with the keys generation, within a second.
    probe = {"threads": "/v1/threads/thr_probe", "memory": "/v1/memory"}[kind]
    secret = gw.secret if project == gw.project else gw.other_secret
    until(
        lambda: httpx.get(gw.url + probe, headers={"Authorization": f"Bearer {secret}"}).status_code != 400,
        10,
        f"the server to keep {kind} for {project}",
        [gw],
    )


def test_the_openai_python_sdk_speaks_responses_to_llama_server_through_llmgw(agents):
    gw = agents
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=gw.secret, max_retries=0, timeout=60)
    resp = client.responses.create(model="tiny", instructions="Be brief.", input="hello", max_output_tokens=8)
    assert resp.status in ("completed", "incomplete") and resp.output_text
    assert resp.usage.input_tokens > 0 and 0 < resp.usage.output_tokens <= 8
    with client.responses.stream(model="tiny", input="hello again", max_output_tokens=8) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and "response.output_text.delta" in kinds
    # Random weights seldom stop by themselves: the stream ends incomplete at max_output_tokens,
    # as OpenAI's does (the SDK's get_final_response wants response.completed only).
    assert kinds[-1] in ("response.completed", "response.incomplete")
    final = events[-1].response
    assert final.output_text and final.usage.output_tokens > 0
    answered = client.responses.create(
        model="tiny",
        max_output_tokens=8,
        tools=[{"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}],
        input=[
            {"role": "user", "content": "weather in Paris?"},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"},
        ],
    )
    assert answered.output_text and answered.usage.input_tokens > resp.usage.input_tokens
    rows = _rows(gw, 3)
    by_tokens = {(r.prompt_tokens, r.completion_tokens) for r in rows}
    assert (resp.usage.input_tokens, resp.usage.output_tokens) in by_tokens
    assert (final.usage.input_tokens, final.usage.output_tokens) in by_tokens
    assert all(r.status == 200 and r.model == "tiny" for r in rows)


def test_the_openai_node_sdk_speaks_responses_through_llmgw(agents):
    gw = agents
    node = shutil.which("node")
    if node is None or not (NODE_DIR / "node_modules" / "openai").is_dir():
        require(
            "the openai Node SDK", "node or tests/e2e/node/node_modules missing: run npm ci --prefix tests/e2e/node"
        )
    env = {**os.environ, "LLMGW_URL": gw.url, "LLMGW_KEY": gw.secret, "LLMGW_MODEL": "tiny"}
    run = subprocess.run(
        [node, str(NODE_DIR / "responses.mjs")], capture_output=True, text=True, timeout=120, env=env, cwd=NODE_DIR
    )
    assert run.returncode == 0, run.stderr
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen["created"]["text"] and seen["created"]["usage"]["output_tokens"] > 0
    assert (
        seen["streamed"]["kinds"][0] == "response.created" and "response.output_text.delta" in seen["streamed"]["kinds"]
    )
    assert seen["streamed"]["text"] and seen["streamed"]["usage"]["output_tokens"] > 0
    assert seen["answered"]["text"]


@pytest.mark.parametrize("bearer", [False, True], ids=["x-api-key", "bearer"])
def test_the_anthropic_sdk_speaks_messages_to_llama_server_through_llmgw(agents, bearer):
    gw = agents
    kw = {"auth_token": gw.secret} if bearer else {"api_key": gw.secret}
    client = anthropic.Anthropic(base_url=gw.url, max_retries=0, timeout=60, **kw)
    # Claude Code's max_tokens, far above the model's 16: lowered and said so, not refused.
    raw = client.messages.with_raw_response.create(
        model="tiny", max_tokens=32000, system="Be brief.", messages=[{"role": "user", "content": "hello"}]
    )
    assert raw.headers["x-llmgw-max-tokens-clamped"] == "32000->16"
    msg = raw.parse()
    assert msg.content[0].type == "text" and msg.content[0].text
    assert msg.stop_reason in ("end_turn", "max_tokens") and 0 < msg.usage.output_tokens <= 16
    with client.messages.stream(model="tiny", max_tokens=8, messages=[{"role": "user", "content": "hi"}]) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text and final.usage.output_tokens > 0
    tool = {"name": "get_weather", "description": "weather", "input_schema": {"type": "object", "properties": {}}}
    answered = client.messages.create(
        model="tiny",
        max_tokens=8,
        tools=[tool],
        messages=[
            {"role": "user", "content": "weather in Paris?"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]},
        ],
    )
    assert answered.content and answered.usage.input_tokens > msg.usage.input_tokens
    # Counted by the engine's own template and tokenizer, not estimated: what the next request reads.
    counted = client.messages.with_raw_response.count_tokens(
        model="tiny", system="Be brief.", messages=[{"role": "user", "content": "hello"}]
    )
    assert "x-llmgw-tokens-estimated" not in counted.headers
    assert counted.parse().input_tokens == msg.usage.input_tokens
    rows = _rows(gw, 3)
    assert (msg.usage.input_tokens, msg.usage.output_tokens) in {(r.prompt_tokens, r.completion_tokens) for r in rows}


def test_a_rate_limited_key_gets_429_in_each_apis_own_shape(agents):
    gw = agents
    r = gw.keys("limits", "--scope", "project", "--id", gw.project, "--rpm", "1")
    assert r.returncode == 0, r.stderr
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=gw.secret, max_retries=0, timeout=60)

    def limited():
        try:
            client.responses.create(model="tiny", input="x", max_output_tokens=2)
        except openai.RateLimitError as exc:
            return exc
        return None

    refused = until(limited, 15, "the project's limit of 1 request a minute to apply", [gw])
    assert "request rate" in refused.message
    with pytest.raises(anthropic.RateLimitError) as a:
        anthropic.Anthropic(base_url=gw.url, api_key=gw.secret, max_retries=0).messages.create(
            model="tiny", max_tokens=2, messages=[{"role": "user", "content": "x"}]
        )
    assert a.value.body["type"] == "error" and a.value.body["error"]["type"] == "rate_limit_error"


def _turn(gw: Gateway, secret: str, thread: str, text: str, model: str = "tiny") -> httpx.Response:
    return httpx.post(
        gw.url + "/v1/chat/completions",
        headers={"Authorization": f"Bearer {secret}", "x-llmgw-thread": thread},
        json={"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": text}]},
        timeout=60,
    )


def test_a_conversation_of_three_turns_kept_by_llmgw_across_two_models(agents):
    gw = agents
    refused = _turn(gw, gw.secret, "new", "hi")
    assert refused.status_code == 400 and f"llmgw keys threads --project {gw.project}" in refused.text
    _keep(gw, "threads", gw.project, hours=1)
    one = _turn(gw, gw.secret, "new", "first")
    assert one.status_code == 200, one.text
    tid = one.headers["x-llmgw-thread"]
    two = _turn(gw, gw.secret, tid, "second", model="tiny-b")  # another model, the same conversation
    assert two.status_code == 200 and two.json()["model"] == "tiny-b"
    assert two.json()["usage"]["prompt_tokens"] > one.json()["usage"]["prompt_tokens"]
    three = _turn(gw, gw.secret, tid, "third")
    assert three.status_code == 200
    auth = {"Authorization": f"Bearer {gw.secret}"}

    def kept():
        r = httpx.get(gw.url + f"/v1/threads/{tid}", headers=auth)
        return r.json()["messages"] if r.status_code == 200 and len(r.json()["messages"]) == 6 else None

    messages = until(kept, 10, "the third turn stored", [gw])
    assert [m["content"] for m in messages[::2]] == ["first", "second", "third"]
    # Another project, even one that keeps conversations: as if there were none.
    _keep(gw, "threads", gw.other, hours=1)
    theirs = _turn(gw, gw.other_secret, tid, "tell me")
    assert theirs.status_code == 404
    assert (
        httpx.get(gw.url + f"/v1/threads/{tid}", headers={"Authorization": f"Bearer {gw.other_secret}"}).status_code
        == 404
    )
    assert httpx.delete(gw.url + f"/v1/threads/{tid}", headers=auth).json()["deleted"] is True
    assert httpx.get(gw.url + f"/v1/threads/{tid}", headers=auth).status_code == 404
    # A conversation whose last turn is older than its hour is gone.
    old = _turn(gw, gw.secret, "new", "old news").headers["x-llmgw-thread"]
    until(lambda: httpx.get(gw.url + f"/v1/threads/{old}", headers=auth).status_code == 200, 10, "stored", [gw])
    with sqlite3.connect(gw.store) as db:
        past = (datetime.now(UTC) - timedelta(hours=2)).strftime("%Y-%m-%d %H:%M:%S.%f")
        db.execute("UPDATE threads SET last_turn_at = ? WHERE thread_id = ?", (past, old))
    assert httpx.get(gw.url + f"/v1/threads/{old}", headers=auth).status_code == 404
    assert _turn(gw, gw.secret, old, "still there?").status_code == 404


def test_memory_notes_over_http_and_through_the_mcp_sdk(agents):
    gw = agents
    _keep(gw, "memory", gw.project)
    auth = {"Authorization": f"Bearer {gw.secret}"}
    made = httpx.post(
        gw.url + "/v1/memory", headers=auth, json={"title": "Deploys", "text": "Deploys go out on Tuesdays"}
    )
    assert made.status_code == 201, made.text
    note = made.json()
    found = httpx.get(gw.url + "/v1/memory", headers=auth, params={"q": "tuesdays"}).json()["data"]
    assert [n["id"] for n in found] == [note["id"]]

    async def through_mcp():
        async with official_client(gw.url + "/v1/mcp", gw.secret) as session:
            hit = await session.call_tool("memory_search", {"query": "deploys"})
            wrote = await session.call_tool("memory_write", {"text": "cmake 3.28 is needed"})
            gone = await session.call_tool("memory_delete", {"note_id": note["id"]})
            return hit, wrote, gone

    hit, wrote, gone = asyncio.run(through_mcp())
    assert not getattr(wrote, "is_error", getattr(wrote, "isError", False))
    structured = getattr(hit, "structured_content", None) or getattr(hit, "structuredContent", None)
    assert [n["id"] for n in structured["data"]] == [note["id"]]
    assert not getattr(gone, "is_error", getattr(gone, "isError", False))
    left = httpx.get(gw.url + "/v1/memory", headers=auth).json()["data"]
    assert [n["text"] for n in left] == ["cmake 3.28 is needed"]
    other = {"Authorization": f"Bearer {gw.other_secret}"}
    assert httpx.get(gw.url + "/v1/memory", headers=other).status_code == 400  # that project keeps none
