"""The agents' routes through the real gateway, in front of fake engines, driven by the official
SDKs: the Responses API, Anthropic's Messages API, conversations kept by the gateway, memory
notes over HTTP and MCP; their usage rows, limits in each API's own error shape, max_tokens
clamped on the agents' routes, and what /v1/models tells a client to size its requests to.

The same against a real llama-server is tests/e2e/test_agent_apis_e2e.py.
"""

from __future__ import annotations

from datetime import timedelta

import anthropic
import httpx
import openai
import orjson
import pytest

from llmgw.config import parse_server_config
from llmgw.server.app import Server
from llmgw.server.gateway.conversations import THREAD_HEADER
from llmgw.server.gateway.request import OUTPUT_CLAMPED_HEADER
from llmgw.store.records import utcnow
from llmgw.testing.fake_engine import FakeEngine, chat_prompt_tokens
from llmgw.testing.mcp_client import official_client
from llmgw.testing.ports import free_port

PROJECT = "Acme/platform/gateway"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris"]}},
        "required": ["city"],
    },
}


@pytest.fixture
async def gw(tmp_path):
    engine = await FakeEngine(tokens=6).start()
    cfg = {
        "listen": f"127.0.0.1:{free_port()}",
        "admin_listen": f"127.0.0.1:{free_port()}",
        "metrics_listen": None,
        "auth": {"store": str(tmp_path / "gw.db"), "pricing": {"m": {"prompt_per_1k": 1.0, "completion_per_1k": 2.0}}},
        "router": {"scrape_interval": "100ms"},
        "models": [
            {
                "name": "m",
                "max_output": 64,
                "context_length": 4096,
                "endpoints": [{"url": engine.url, "engine": "llamacpp"}],
            },
            {"name": "other", "endpoints": [{"url": engine.url, "engine": "llamacpp", "model": "m"}]},
        ],
    }
    server = Server(parse_server_config(cfg))
    await server.start()
    store = server.store
    await store.add_org("Acme")
    await store.add_team("platform", "Acme")
    await store.add_project("gateway", "Acme/platform")
    await store.add_project("billing", "Acme/platform")
    server.secret = (await store.issue_key("agent", project=PROJECT)).secret
    server.other_secret = (await store.issue_key("elsewhere", project="Acme/platform/billing")).secret
    await server.keys.load()
    server.url = f"http://127.0.0.1:{server.config.listen.port}"
    server.engine = engine
    yield server
    await server.stop()
    await engine.stop()


async def _keep(server, kind: str = "threads", hours: int = 24) -> None:
    await server.store.set_retention(PROJECT, kind, hours)
    await server.keys.load()


def _openai(server, secret: str | None = None) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=secret or server.secret, max_retries=0)


def _anthropic(server, secret: str | None = None, bearer: bool = False) -> anthropic.AsyncAnthropic:
    key = secret or server.secret
    if bearer:  # Claude Code with ANTHROPIC_AUTH_TOKEN
        return anthropic.AsyncAnthropic(base_url=server.url, auth_token=key, max_retries=0)
    return anthropic.AsyncAnthropic(base_url=server.url, api_key=key, max_retries=0)


async def _rows(server):
    await server.usage.flush()
    return await server.store.list_usage(limit=100)


# -- the Responses API ---------------------------------------------------------------------


async def test_responses_create_answers_a_response_whose_usage_matches_the_engine_and_its_usage_row(gw):
    client = _openai(gw)
    resp = await client.responses.create(model="m", instructions="Be brief.", input="hello there")
    assert resp.status == "completed" and resp.output_text.strip()
    prompt = chat_prompt_tokens(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}]
    )
    assert resp.usage.input_tokens == prompt and resp.usage.output_tokens == 6
    [row] = await _rows(gw)
    assert (row.model, row.prompt_tokens, row.completion_tokens, row.status) == ("m", prompt, 6, 200)
    assert row.cost_micros > 0


async def test_responses_stream_gives_the_sdk_its_typed_events_and_a_completed_response(gw):
    client = _openai(gw)
    async with client.responses.stream(model="m", input="hello") as stream:
        kinds = [e.type async for e in stream]
        final = await stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds and final.output_text.strip()
    assert final.usage.output_tokens == 6
    [row] = await _rows(gw)
    assert row.stream and row.completion_tokens == 6


async def test_a_function_call_comes_back_as_a_call_item_and_its_output_is_answered(gw):
    client = _openai(gw)
    first = await client.responses.create(model="m", input="weather in Paris?", tools=[WEATHER], tool_choice="required")
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and orjson.loads(call.arguments) == {"city": "Paris"}
    second = await client.responses.create(
        model="m",
        tools=[WEATHER],
        input=[
            {"role": "user", "content": "weather in Paris?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"},
        ],
    )
    assert second.output_text.strip()
    # The tool's output reached the engine: the prompt holds it.
    assert second.usage.input_tokens > first.usage.input_tokens


async def test_a_streamed_function_call_arrives_whole_through_the_sdk(gw):
    client = _openai(gw)
    async with client.responses.stream(model="m", input="weather?", tools=[WEATHER], tool_choice="required") as s:
        final = await s.get_final_response()
    [call] = [item for item in final.output if item.type == "function_call"]
    assert orjson.loads(call.arguments) == {"city": "Paris"}


async def test_a_codex_custom_tool_call_comes_back_with_its_free_form_input(gw):
    client = _openai(gw)
    tool = {"type": "custom", "name": "apply_patch", "description": "Apply a patch"}
    resp = await client.responses.create(
        model="m", input="patch it", tools=[tool], tool_choice={"type": "custom", "name": "apply_patch"}
    )
    [call] = [item for item in resp.output if item.type == "custom_tool_call"]
    assert call.name == "apply_patch" and call.input == "fake"


async def test_a_server_side_tool_is_refused_with_what_to_do_instead(gw):
    client = _openai(gw)
    with pytest.raises(openai.BadRequestError) as e:
        await client.responses.create(model="m", input="news?", tools=[{"type": "web_search"}])
    assert "web_search" in str(e.value) and "function" in str(e.value)
    assert await _rows(gw) == []


async def test_store_and_previous_response_id_are_refused_with_the_reason_where_the_project_keeps_nothing(gw):
    client = _openai(gw)
    with pytest.raises(openai.BadRequestError) as e:
        await client.responses.create(model="m", input="hi", store=True)
    assert "llmgw keys threads --project Acme/platform/gateway" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        await client.responses.create(model="m", input="hi", previous_response_id="resp_" + "0" * 32)
    # Left out, store is the API's default: answered, and kept nowhere.
    assert (await client.responses.create(model="m", input="hi")).status == "completed"


async def test_previous_response_id_continues_a_stored_response_where_the_project_keeps_conversations(gw):
    await _keep(gw)
    client = _openai(gw)
    first = await client.responses.create(model="m", input="my name is Ann")
    await gw.conversations.settled()
    second = await client.responses.create(model="other", input="what is my name?", previous_response_id=first.id)
    history = [
        {"role": "user", "content": "my name is Ann"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "what is my name?"},
    ]
    assert second.usage.input_tokens == chat_prompt_tokens(history)
    other = _openai(gw, gw.other_secret)
    with pytest.raises(openai.BadRequestError):  # that project keeps none at all
        await other.responses.create(model="m", input="x", previous_response_id=first.id)
    await gw.store.set_retention("Acme/platform/billing", "threads", 5)
    await gw.keys.load()
    with pytest.raises(openai.NotFoundError):  # kept elsewhere: as if it did not exist
        await other.responses.create(model="m", input="x", previous_response_id=first.id)


async def test_a_rate_limited_key_gets_429_in_each_apis_own_error_shape(gw):
    key = (await gw.store.list_keys())[0]
    await gw.store.set_limits("key", key.id, rpm=1)
    await gw.keys.load()
    client = _openai(gw)
    await client.responses.create(model="m", input="one")
    with pytest.raises(openai.RateLimitError) as e:
        await client.responses.create(model="m", input="two")
    assert "request rate" in e.value.message
    with pytest.raises(anthropic.RateLimitError) as a:
        await _anthropic(gw).messages.create(model="m", max_tokens=10, messages=[{"role": "user", "content": "x"}])
    assert a.value.body["error"]["type"] == "rate_limit_error" and "request rate" in a.value.message


# -- Anthropic's Messages API ----------------------------------------------------------------


@pytest.mark.parametrize("bearer", [False, True], ids=["x-api-key", "bearer"])
async def test_messages_create_answers_a_message_with_the_key_either_way(gw, bearer):
    client = _anthropic(gw, bearer=bearer)
    msg = await client.messages.create(
        model="m", max_tokens=20, system="Be brief.", messages=[{"role": "user", "content": "hello"}]
    )
    assert msg.role == "assistant" and msg.content[0].type == "text" and msg.content[0].text.strip()
    assert msg.stop_reason == "end_turn" and msg.usage.output_tokens == 6
    [row] = await _rows(gw)
    assert row.completion_tokens == 6 and row.prompt_tokens == msg.usage.input_tokens


async def test_messages_stream_gives_the_sdk_its_events_and_the_final_message(gw):
    client = _anthropic(gw)
    async with client.messages.stream(model="m", max_tokens=20, messages=[{"role": "user", "content": "hi"}]) as s:
        text = "".join([t async for t in s.text_stream])
        final = await s.get_final_message()
    assert text.strip() and final.content[0].text == text and final.usage.output_tokens == 6


async def test_a_tool_use_and_its_result_go_round_through_messages(gw):
    client = _anthropic(gw)
    tool = {"name": "get_weather", "description": "weather", "input_schema": WEATHER["parameters"]}
    msg = await client.messages.create(
        model="m",
        max_tokens=50,
        tools=[tool],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "weather in Paris?"}],
    )
    [use] = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and use.input == {"city": "Paris"}
    answer = await client.messages.create(
        model="m",
        max_tokens=50,
        tools=[tool],
        messages=[
            {"role": "user", "content": "weather in Paris?"},
            {"role": "assistant", "content": [use.model_dump()]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]},
        ],
    )
    assert answer.content[0].type == "text" and answer.usage.input_tokens > msg.usage.input_tokens


async def test_count_tokens_answers_the_gateways_estimate_when_the_engine_cannot_count(gw):
    client = _anthropic(gw)
    raw = await client.messages.with_raw_response.count_tokens(
        model="m", messages=[{"role": "user", "content": "how many tokens is this?"}]
    )
    assert raw.headers.get("x-llmgw-tokens-estimated") == "true"
    assert (await raw.parse()).input_tokens > 0
    with pytest.raises(anthropic.NotFoundError):
        await client.messages.count_tokens(model="nope", messages=[{"role": "user", "content": "x"}])


async def test_errors_on_the_messages_route_are_in_anthropics_shape(gw):
    async with httpx.AsyncClient(base_url=gw.url) as http:
        r = await http.post("/v1/messages", json={"model": "m", "max_tokens": 5, "messages": []})
        assert r.status_code == 401 and r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "authentication_error"
        r = await http.post(
            "/v1/messages",
            headers={"x-api-key": gw.secret},
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        assert "max_tokens" in r.json()["error"]["message"]


# -- what a client is told, and max_tokens on each route -----------------------------------


async def test_agents_routes_lower_a_max_tokens_above_the_models_limit_and_say_so_where_chat_refuses(gw):
    # An explicit timeout, as Claude Code's streaming makes moot: else the SDK itself refuses
    # a 32,000-token request that is not streamed.
    client = _anthropic(gw).with_options(timeout=60)
    raw = await client.messages.with_raw_response.create(
        model="m", max_tokens=32000, messages=[{"role": "user", "content": "hi"}]
    )
    assert raw.headers[OUTPUT_CLAMPED_HEADER] == "32000->64"
    assert (await raw.parse()).usage.output_tokens == 6
    resp = await _openai(gw).responses.with_raw_response.create(model="m", input="hi", max_output_tokens=32000)
    assert resp.headers[OUTPUT_CLAMPED_HEADER] == "32000->64"
    with pytest.raises(openai.BadRequestError) as e:
        await _openai(gw).chat.completions.create(
            model="m", max_tokens=32000, messages=[{"role": "user", "content": "hi"}]
        )
    assert "at most 64" in str(e.value)


async def test_models_tell_a_client_the_context_length_and_output_limit_in_both_apis(gw):
    listed = {m.id: m for m in (await _openai(gw).models.list()).data}
    assert listed["m"].model_extra["context_length"] == 4096 and listed["m"].model_extra["max_output"] == 64
    page = await _anthropic(gw).models.list()
    info = {m.id: m for m in page.data}["m"]
    assert (
        info.type == "model"
        and info.model_extra.get("max_input_tokens", getattr(info, "max_input_tokens", None)) == 4096
    )


# -- conversations kept by the gateway --------------------------------------------------------


async def _chat(http: httpx.AsyncClient, secret: str, thread: str, text: str, model: str = "m") -> httpx.Response:
    return await http.post(
        "/v1/chat/completions",
        headers={"Authorization": f"Bearer {secret}", THREAD_HEADER: thread},
        json={"model": model, "messages": [{"role": "user", "content": text}]},
    )


async def test_a_conversation_of_three_turns_replays_its_history_even_to_another_model(gw):
    await _keep(gw)
    async with httpx.AsyncClient(base_url=gw.url) as http:
        one = await _chat(http, gw.secret, "new", "first")
        assert one.status_code == 200
        tid = one.headers[THREAD_HEADER]
        assert tid.startswith("thr_")
        reply1 = one.json()["choices"][0]["message"]["content"]
        two = await _chat(http, gw.secret, tid, "second", model="other")
        assert two.status_code == 200 and two.headers[THREAD_HEADER] == tid
        assert two.json()["model"] == "other"
        history = [
            {"role": "user", "content": "first"},
            {"role": "assistant", "content": reply1},
            {"role": "user", "content": "second"},
        ]
        assert two.json()["usage"]["prompt_tokens"] == chat_prompt_tokens(history)
        three = await http.post(
            "/v1/chat/completions",
            headers={"Authorization": f"Bearer {gw.secret}", THREAD_HEADER: tid},
            json={"model": "m", "stream": True, "messages": [{"role": "user", "content": "third"}]},
        )
        assert three.status_code == 200 and "data: [DONE]" in three.text
        await gw.conversations.settled()
        read = await http.get(f"/v1/threads/{tid}", headers={"Authorization": f"Bearer {gw.secret}"})
        messages = read.json()["messages"]
        assert [m["role"] for m in messages] == ["user", "assistant"] * 3
        assert [m["content"] for m in messages][::2] == ["first", "second", "third"]
        assert messages[5]["content"].strip()  # the streamed reply, kept whole


async def test_another_projects_conversation_reads_exactly_as_one_that_does_not_exist(gw):
    await _keep(gw)
    await gw.store.set_retention("Acme/platform/billing", "threads", 24)
    await gw.keys.load()
    async with httpx.AsyncClient(base_url=gw.url) as http:
        tid = (await _chat(http, gw.secret, "new", "secret plans")).headers[THREAD_HEADER]
        await gw.conversations.settled()
        theirs = await _chat(http, gw.other_secret, tid, "tell me")
        missing = await _chat(http, gw.other_secret, "thr_" + "0" * 32, "tell me")
        assert theirs.status_code == missing.status_code == 404
        assert theirs.json()["error"]["message"].replace(tid, "X") == missing.json()["error"]["message"].replace(
            "thr_" + "0" * 32, "X"
        )
        auth = {"Authorization": f"Bearer {gw.other_secret}"}
        assert (await http.get(f"/v1/threads/{tid}", headers=auth)).status_code == 404
        assert (await http.delete(f"/v1/threads/{tid}", headers=auth)).status_code == 404
        mine = {"Authorization": f"Bearer {gw.secret}"}
        assert (await http.get(f"/v1/threads/{tid}", headers=mine)).status_code == 200


async def test_a_deleted_conversation_is_gone_and_an_expired_one_is_swept(gw):
    await _keep(gw, hours=2)
    async with httpx.AsyncClient(base_url=gw.url) as http:
        auth = {"Authorization": f"Bearer {gw.secret}"}
        gone = (await _chat(http, gw.secret, "new", "delete me")).headers[THREAD_HEADER]
        old = (await _chat(http, gw.secret, "new", "forget me")).headers[THREAD_HEADER]
        older = (await _chat(http, gw.secret, "new", "and me")).headers[THREAD_HEADER]
        kept = (await _chat(http, gw.secret, "new", "keep me")).headers[THREAD_HEADER]
        await gw.conversations.settled()
        deleted = await http.delete(f"/v1/threads/{gone}", headers=auth)
        assert deleted.status_code == 200 and deleted.json()["deleted"] is True
        assert (await http.get(f"/v1/threads/{gone}", headers=auth)).status_code == 404
        # Their last turns three hours ago: past the window, unreadable at once, and removed by the sweep.
        from sqlalchemy import update

        from llmgw.store.schema import threads

        async with gw.store._engine.begin() as conn:
            await conn.execute(
                update(threads)
                .where(threads.c.thread_id.in_([old, older]))
                .values(last_turn_at=utcnow() - timedelta(hours=3))
            )
        assert (await http.get(f"/v1/threads/{old}", headers=auth)).status_code == 404
        swept = await gw.conversations.sweep()
        assert swept.threads == 1  # older: old went when it was read
        assert (await http.get(f"/v1/threads/{older}", headers=auth)).status_code == 404
        assert (await http.get(f"/v1/threads/{kept}", headers=auth)).status_code == 200


async def test_conversations_are_refused_with_the_reason_for_a_project_that_keeps_none_and_a_personal_key(gw):
    user = await gw.store.create_user("ann@example.com", "correct horse")
    personal = (await gw.store.issue_key("mine", owner=user.id)).secret
    await gw.keys.load()
    async with httpx.AsyncClient(base_url=gw.url) as http:
        off = await _chat(http, gw.secret, "new", "hi")
        assert off.status_code == 400 and "llmgw keys threads --project Acme/platform/gateway" in off.text
        await _keep(gw)
        own = await _chat(http, personal, "new", "hi")
        assert own.status_code == 400 and "personal key" in own.text
    assert [r.status for r in await _rows(gw)] == []  # refused before any engine


async def test_a_conversation_continues_through_the_messages_api_with_the_thread_header(gw):
    await _keep(gw)
    client = _anthropic(gw)
    first = await client.messages.with_raw_response.create(
        model="m",
        max_tokens=20,
        messages=[{"role": "user", "content": "remember 42"}],
        extra_headers={THREAD_HEADER: "new"},
    )
    tid = first.headers[THREAD_HEADER]
    await gw.conversations.settled()
    second = await client.messages.create(
        model="m",
        max_tokens=20,
        messages=[{"role": "user", "content": "which number?"}],
        extra_headers={THREAD_HEADER: tid},
    )
    assert second.usage.input_tokens > (await first.parse()).usage.input_tokens


# -- memory notes ----------------------------------------------------------------------------


async def test_memory_notes_are_written_searched_updated_and_deleted_over_http_per_project(gw):
    async with httpx.AsyncClient(base_url=gw.url, headers={"Authorization": f"Bearer {gw.secret}"}) as http:
        off = await http.post("/v1/memory", json={"text": "x"})
        assert off.status_code == 400 and "llmgw keys memory --project Acme/platform/gateway" in off.text
        await _keep(gw, "memory")
        made = await http.post("/v1/memory", json={"title": "Deploys", "text": "Deploys go out on Tuesdays"})
        assert made.status_code == 201
        note = made.json()
        await http.post("/v1/memory", json={"text": "The staging database is small"})
        found = (await http.get("/v1/memory", params={"q": "tuesdays deploys"})).json()["data"]
        assert [n["id"] for n in found] == [note["id"]]
        assert len((await http.get("/v1/memory")).json()["data"]) == 2
        changed = await http.patch(f"/v1/memory/{note['id']}", json={"text": "Deploys go out on Thursdays"})
        assert changed.json()["text"] == "Deploys go out on Thursdays"
        assert (await http.get("/v1/memory", params={"q": "tuesdays"})).json()["data"] == []
        other = {"Authorization": f"Bearer {gw.other_secret}"}
        await gw.store.set_retention("Acme/platform/billing", "memory", 24)
        await gw.keys.load()
        assert (await http.get(f"/v1/memory/{note['id']}", headers=other)).status_code == 404
        assert (await http.get("/v1/memory", params={"q": "deploys"}, headers=other)).json()["data"] == []
        assert (await http.delete(f"/v1/memory/{note['id']}")).json()["deleted"] is True
        assert (await http.get(f"/v1/memory/{note['id']}")).status_code == 404
        bad = await http.post("/v1/memory", json={"text": ""})
        assert bad.status_code == 400


async def test_memory_notes_through_the_official_mcp_client(gw):
    await _keep(gw, "memory")
    async with official_client(gw.url + "/v1/mcp", gw.secret) as session:
        tools = {t.name for t in (await session.list_tools()).tools}
        assert {"memory_write", "memory_search", "memory_read", "memory_update", "memory_delete"} <= tools
        wrote = await session.call_tool("memory_write", {"text": "The build needs cmake 3.28", "title": "Build"})
        assert not _failed(wrote)
        note_id = _structured(wrote)["id"]
        found = await session.call_tool("memory_search", {"query": "cmake"})
        assert [n["id"] for n in _structured(found)["data"]] == [note_id]
        assert not _failed(await session.call_tool("memory_delete", {"note_id": note_id}))
        gone = await session.call_tool("memory_read", {"note_id": note_id})
        assert _failed(gone) and "no note" in gone.content[0].text
    # The same notes over HTTP: one store, two ways in.
    async with httpx.AsyncClient(base_url=gw.url, headers={"Authorization": f"Bearer {gw.secret}"}) as http:
        assert (await http.get("/v1/memory")).json()["data"] == []


def _failed(result) -> bool:
    """A tool result's error flag, under mcp 2's name or mcp 1's."""
    return bool(getattr(result, "is_error", None) if hasattr(result, "is_error") else result.isError)


def _structured(result) -> dict:
    return (
        getattr(result, "structured_content", None)
        if hasattr(result, "structured_content")
        else result.structuredContent
    )


async def test_without_authentication_threads_store_keeps_one_shared_pool(tmp_path):
    engine = await FakeEngine(tokens=3).start()
    cfg = {
        "listen": f"127.0.0.1:{free_port()}",
        "admin_listen": f"127.0.0.1:{free_port()}",
        "metrics_listen": None,
        "auth": {"enabled": False, "store": str(tmp_path / "gw.db")},
        "threads": {"store": True, "retain_hours": 1},
        "models": [{"name": "m", "endpoints": [{"url": engine.url, "engine": "llamacpp"}]}],
    }
    server = Server(parse_server_config(cfg))
    await server.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.config.listen.port}") as http:
            one = await http.post(
                "/v1/chat/completions",
                headers={THREAD_HEADER: "new"},
                json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            )
            tid = one.headers[THREAD_HEADER]
            await server.conversations.settled()
            assert len((await http.get(f"/v1/threads/{tid}")).json()["messages"]) == 2
            made = await http.post("/v1/memory", json={"text": "the pool keeps notes too"})
            assert made.status_code == 201
    finally:
        await server.stop()
        await engine.stop()


def test_threads_store_is_refused_where_keys_are_on_saying_what_to_run_instead():
    from llmgw.config.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        parse_server_config({"auth": {"store": "/tmp/x.db"}, "threads": {"store": True, "retain_hours": 5}})
    assert "llmgw keys threads --project P --retain-hours N" in str(e.value)
    with pytest.raises(ConfigError) as e:
        parse_server_config({"auth": {"enabled": False}, "threads": {"store": True}})
    assert "threads.retain_hours is required" in str(e.value)
