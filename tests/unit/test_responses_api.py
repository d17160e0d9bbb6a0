"""The Responses API translation, proven with the openai SDK itself: it sends the request, the
translation answers it as llmgw would from a chat engine's reply, and the SDK parses (and pydantic
validates) what comes back, whole or as a stream of typed events."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx2
import openai
import orjson
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from llmgw.server.gateway.responses_api import (
    ResponsesRefusal,
    ResponsesRequest,
    ResponseStream,
    error_event,
    render_response,
    translate_request,
    with_history,
)

_EVENT = TypeAdapter(ResponseStreamEvent)
_TAIL = ',"created":1760000000,"id":"chatcmpl-x1","model":"qwen3","system_fingerprint":"b6000","object":"chat.completion.chunk"}'


def _chunk(delta: str, finish: str | None = None) -> dict[str, Any]:
    """A chunk as llama-server writes it: compact JSON, the delta given as its JSON text."""
    reason = "null" if finish is None else f'"{finish}"'
    return orjson.loads(f'{{"choices":[{{"finish_reason":{reason},"index":0,"delta":{delta}}}]' + _TAIL)


_FIRST = '{"role":"assistant","content":null}'
_USAGE = {"completion_tokens": 7, "prompt_tokens": 11, "total_tokens": 18}


def _usage_chunk(usage: dict[str, Any]) -> dict[str, Any]:
    return {"choices": [], "created": 1760000000, "id": "chatcmpl-x1", "model": "qwen3", "usage": usage}


def _translated(body: dict[str, Any]) -> ResponsesRequest:
    req = translate_request(body)
    assert isinstance(req, ResponsesRequest), req
    return req


def _refused(body: dict[str, Any]) -> ResponsesRefusal:
    refusal = translate_request(body)
    assert isinstance(refusal, ResponsesRefusal), refusal
    return refusal


def _client(handler: Callable[[httpx2.Request], httpx2.Response]) -> openai.OpenAI:
    http = httpx2.Client(transport=httpx2.MockTransport(handler))
    return openai.OpenAI(api_key="sk-test", base_url="http://llmgw.test/v1", http_client=http, max_retries=0)


class Engine:
    """Stands where llmgw's gateway stands: translates what the SDK sent, answers from chat replies."""

    def __init__(self, completion: dict[str, Any] | None = None, chunks: list[dict[str, Any]] | None = None) -> None:
        self.completion, self.chunks = completion, chunks or []
        self.usage: dict[str, Any] | None = _USAGE
        self.broken: str | None = None
        self.req: ResponsesRequest | None = None
        self.reply: list[dict[str, Any]] = []
        self.final: dict[str, Any] = {}
        self.raw = b""

    def __call__(self, request: httpx2.Request) -> httpx2.Response:
        req = self.req = _translated(orjson.loads(request.content))
        if not req.stream:
            assert self.completion is not None
            obj, self.reply = render_response(req, self.completion)
            Response.model_validate(obj)  # strict: every required field, every literal
            return httpx2.Response(200, json=obj)
        stream = ResponseStream(req)
        raw = stream.start() + b"".join(stream.feed(c) for c in self.chunks)
        raw += stream.fail(self.broken) if self.broken else stream.finish(self.usage)
        self.raw, self.reply, self.final = raw, stream.reply_messages(), stream.response()
        Response.model_validate(self.final)
        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=raw)


def _events(raw: bytes) -> list[dict[str, Any]]:
    """Each SSE event, checked: the event line names its data's type, sequence numbers rise by one,
    and the data validates as the SDK's event type."""
    events = []
    for block in raw.decode().split("\n\n")[:-1]:
        head, data = block.split("\n")
        event = orjson.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}"
        _EVENT.validate_python(event)
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def _completion(message: dict[str, Any], finish: str = "stop", usage: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1760000000,
        "model": "qwen3-8b-q4",
        "choices": [{"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish}],
        "usage": usage or _USAGE,
    }


WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
APPLY_PATCH = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Apply a patch",
    "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch" body'},
}


# --- whole responses --------------------------------------------------------------------------


def test_a_plain_reply_comes_back_as_a_response_whose_output_text_the_sdk_reads():
    usage = _USAGE | {"prompt_tokens_details": {"cached_tokens": 4}}
    engine = Engine(_completion({"content": "Hej!"}, usage=usage))
    resp = _client(engine).responses.create(model="team/chat", input="Say hi in Swedish")
    assert resp.output_text == "Hej!"
    assert resp.status == "completed" and resp.model == "team/chat" and resp.id.startswith("resp_")
    assert resp.usage is not None
    assert (resp.usage.input_tokens, resp.usage.output_tokens, resp.usage.total_tokens) == (11, 7, 18)
    assert resp.usage.input_tokens_details.cached_tokens == 4
    assert engine.reply == [{"role": "assistant", "content": "Hej!"}]


def test_reasoning_content_comes_back_as_a_reasoning_item_before_the_message():
    engine = Engine(_completion({"content": "4", "reasoning_content": "2+2 is 4"}))
    resp = _client(engine).responses.create(model="m", input="2+2?")
    assert [item.type for item in resp.output] == ["reasoning", "message"]
    reasoning = resp.output[0]
    assert reasoning.type == "reasoning" and reasoning.content is not None
    assert reasoning.content[0].text == "2+2 is 4"
    assert resp.output_text == "4"
    assert engine.reply == [{"role": "assistant", "content": "4"}]  # reasoning is not replayed


def test_a_function_call_comes_back_as_a_function_call_item_with_the_engines_call_id():
    call = {"id": "call_7", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}
    engine = Engine(_completion({"content": None, "tool_calls": [call]}, finish="tool_calls"))
    resp = _client(engine).responses.create(model="m", input="Weather in Oslo?", tools=[WEATHER])
    [item] = resp.output
    assert item.type == "function_call"
    assert (item.call_id, item.name, item.arguments) == ("call_7", "get_weather", '{"city":"Oslo"}')
    assert engine.reply == [{"role": "assistant", "content": None, "tool_calls": [call]}]


def test_a_custom_tool_call_comes_back_with_its_raw_input():
    patch = "*** Begin Patch\n*** End Patch"
    arguments = orjson.dumps({"input": patch}).decode()
    call = {"id": "call_9", "type": "function", "function": {"name": "apply_patch", "arguments": arguments}}
    engine = Engine(_completion({"content": "Patching.", "tool_calls": [call]}, finish="tool_calls"))
    resp = _client(engine).responses.create(model="m", input="fix it", tools=[APPLY_PATCH])
    assert [item.type for item in resp.output] == ["message", "custom_tool_call"]
    item = resp.output[1]
    assert item.type == "custom_tool_call" and (item.call_id, item.name, item.input) == ("call_9", "apply_patch", patch)
    assert engine.reply == [{"role": "assistant", "content": "Patching.", "tool_calls": [call]}]


def test_a_custom_tool_call_whose_arguments_are_not_an_input_object_keeps_the_raw_arguments():
    req = _translated({"model": "m", "input": "x", "tools": [APPLY_PATCH]})
    call = {"id": "c", "type": "function", "function": {"name": "apply_patch", "arguments": "*** Begin Patch"}}
    obj, reply = render_response(req, _completion({"content": None, "tool_calls": [call]}))
    assert obj["output"][0]["input"] == "*** Begin Patch"
    assert orjson.loads(reply[0]["tool_calls"][0]["function"]["arguments"]) == {"input": "*** Begin Patch"}


def test_a_tool_call_without_an_id_gets_one_made_up():
    req = _translated({"model": "m", "input": "x", "tools": [WEATHER]})
    call = {"type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    obj, reply = render_response(req, _completion({"content": None, "tool_calls": [call]}))
    assert obj["output"][0]["call_id"].startswith("call_")
    assert reply[0]["tool_calls"][0]["id"] == obj["output"][0]["call_id"]


def test_a_reply_cut_at_the_output_limit_is_incomplete_for_max_output_tokens():
    engine = Engine(_completion({"content": "Once upon a"}, finish="length"))
    resp = _client(engine).responses.create(model="m", input="A story", max_output_tokens=3)
    assert resp.status == "incomplete"
    assert resp.incomplete_details is not None and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output_text == "Once upon a" and resp.max_output_tokens == 3


def test_the_response_echoes_the_request_fields_the_sdk_type_expects():
    engine = Engine(_completion({"content": "ok"}))
    resp = _client(engine).responses.create(
        model="m",
        input="x",
        instructions="Be brief.",
        tools=[WEATHER, APPLY_PATCH],
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0.2,
        top_p=0.9,
        parallel_tool_calls=False,
        metadata={"ticket": "42"},
        text={"format": {"type": "text"}},
    )
    assert resp.instructions == "Be brief." and resp.temperature == 0.2 and resp.top_p == 0.9
    assert [t.type for t in resp.tools] == ["function", "custom"]
    assert resp.tool_choice.type == "function" and resp.parallel_tool_calls is False
    assert resp.metadata == {"ticket": "42"}


# --- streams ------------------------------------------------------------------------------------


def _stream(engine: Engine, **kwargs: Any) -> tuple[list[Any], Any]:
    with _client(engine).responses.stream(**{"model": "m", "input": "hi"} | kwargs) as s:
        events = list(s)
        return events, s.get_final_response()


def test_streamed_text_deltas_accumulate_into_the_final_output_text_with_usage():
    chunks = [_chunk(_FIRST), _chunk('{"content":"Hel"}'), _chunk('{"content":"lo"}'), _chunk("{}", "stop")]
    engine = Engine(chunks=[*chunks, _usage_chunk(_USAGE)])
    engine.usage = None  # taken from the usage-only chunk fed in, as an engine sends it
    events, final = _stream(engine)
    raw = _events(engine.raw)
    assert [e["type"] for e in raw] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.snapshot for e in events if e.type == "response.output_text.delta"] == ["Hel", "Hello"]
    assert final.output_text == "Hello" and final.status == "completed"
    assert final.usage is not None and (final.usage.input_tokens, final.usage.output_tokens) == (11, 7)
    assert engine.reply == [{"role": "assistant", "content": "Hello"}]


def test_a_usage_only_chunk_produces_no_events():
    req = _translated({"model": "m", "input": "x", "stream": True})
    stream = ResponseStream(req)
    stream.start()
    assert stream.feed(_usage_chunk(_USAGE)) == b""
    assert stream.feed(_chunk(_FIRST)) == b""


def test_streamed_reasoning_then_text_arrive_as_two_items_in_order():
    chunks = [
        _chunk('{"role":"assistant","content":null,"reasoning_content":null}'),
        _chunk('{"reasoning_content":"Think"}'),
        _chunk('{"reasoning_content":"ing."}'),
        _chunk('{"content":"Done."}'),
        _chunk("{}", "stop"),
    ]
    engine = Engine(chunks=chunks)
    _, final = _stream(engine)
    raw = _events(engine.raw)
    kinds = [e["type"] for e in raw]
    # The reasoning item is closed before the message opens.
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.content_part.added", 4)
    assert [(e["output_index"], e["item"]["type"]) for e in raw if e["type"] == "response.output_item.added"] == [
        (0, "reasoning"),
        (1, "message"),
    ]
    assert final.output[0].type == "reasoning" and final.output[0].content is not None
    assert final.output[0].content[0].text == "Thinking."
    assert final.output_text == "Done."


def test_streamed_function_calls_come_out_with_their_arguments_whole():
    chunks = [
        _chunk(_FIRST),
        _chunk('{"content":"Checking."}'),
        _call_chunk(0, "", "call_a", "get_weather"),
        _call_chunk(0, '{"city":'),
        _call_chunk(0, '"Oslo"}'),
        _call_chunk(1, '{"city":"Rome"}', "call_b", "get_weather"),
        _chunk("{}", "tool_calls"),
    ]
    engine = Engine(chunks=chunks)
    events, final = _stream(engine, tools=[WEATHER])
    _events(engine.raw)
    calls = [item for item in final.output if item.type == "function_call"]
    assert [(c.call_id, c.arguments) for c in calls] == [("call_a", '{"city":"Oslo"}'), ("call_b", '{"city":"Rome"}')]
    done = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    assert done == ['{"city":"Oslo"}', '{"city":"Rome"}']
    assert final.output_text == "Checking."
    assert engine.reply[0]["tool_calls"][0] == {
        "id": "call_a",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'},
    }


def _call_chunk(index: int, arguments: str, call_id: str | None = None, name: str | None = None) -> dict[str, Any]:
    """A tool_calls delta as llama-server writes one: id, type and name on a call's first delta only."""
    call: dict[str, Any] = {"index": index}
    if call_id is not None:
        call |= {"id": call_id, "type": "function"}
    call["function"] = ({"name": name} if name is not None else {}) | {"arguments": arguments}
    return _chunk(orjson.dumps({"tool_calls": [call]}).decode())


def test_a_streamed_custom_tool_call_comes_out_with_its_input():
    patch = "*** Begin Patch\n+hi\n*** End Patch"
    arguments = orjson.dumps({"input": patch}).decode()
    cut = arguments.index("\\") + 1
    chunks = [
        _chunk(_FIRST),
        _call_chunk(0, "", "call_p", "apply_patch"),
        _call_chunk(0, arguments[:cut]),  # cut between an escape's backslash and its letter
        _call_chunk(0, arguments[cut:]),
        _chunk("{}", "tool_calls"),
    ]
    engine = Engine(chunks=chunks)
    events, final = _stream(engine, tools=[APPLY_PATCH])
    _events(engine.raw)
    [item] = final.output
    assert item.type == "custom_tool_call" and (item.call_id, item.input) == ("call_p", patch)
    assert [e.input for e in events if e.type == "response.custom_tool_call_input.done"] == [patch]
    assert not [e for e in events if e.type.startswith("response.function_call_arguments")]


def test_vllms_reasoning_field_streams_as_reasoning_text_once():
    # Newer vLLM names the field "reasoning"; some versions send both names with the same text.
    chunks = [
        _chunk('{"reasoning":"Hm.","reasoning_content":"Hm."}'),
        _chunk('{"content":"Yes."}'),
        _chunk("{}", "stop"),
    ]
    engine = Engine(chunks=chunks)
    events, final = _stream(engine)
    assert [e.delta for e in events if e.type == "response.reasoning_text.delta"] == ["Hm."]
    assert final.output[0].type == "reasoning" and final.output_text == "Yes."


def test_a_stream_cut_at_the_output_limit_ends_with_response_incomplete():
    engine = Engine(chunks=[_chunk(_FIRST), _chunk('{"content":"Once"}'), _chunk("{}", "length")])
    with _client(engine).responses.stream(model="m", input="story", max_output_tokens=1) as s:
        events = list(s)
    last = events[-1]
    assert last.type == "response.incomplete"
    assert last.response.incomplete_details.reason == "max_output_tokens"
    assert last.response.output_text == "Once" and last.response.usage.output_tokens == 7
    assert engine.final["output"][0]["status"] == "incomplete"


def test_a_broken_stream_ends_with_response_failed_and_adds_no_messages():
    engine = Engine(chunks=[_chunk(_FIRST), _chunk('{"content":"Par"}')])
    engine.broken = "the engine closed the connection"
    with _client(engine).responses.stream(model="m", input="x") as s:
        events = list(s)
    _events(engine.raw)
    last = events[-1]
    assert last.type == "response.failed" and last.response.status == "failed"
    assert last.response.error.code == "server_error"
    assert last.response.error.message == "the engine closed the connection"
    assert engine.reply == []


def test_an_error_chunk_from_the_engine_fails_the_stream():
    req = _translated({"model": "m", "input": "x", "stream": True})
    stream = ResponseStream(req)
    raw = stream.start() + stream.feed(_chunk('{"content":"a"}'))
    raw += stream.feed({"error": {"message": "context length exceeded", "code": 400}})
    raw += stream.finish(_USAGE)  # the caller's normal end adds nothing after a failure
    last = _events(raw)[-1]
    assert last["type"] == "response.failed" and last["response"]["error"]["message"] == "context length exceeded"
    assert stream.response()["status"] == "failed" and stream.reply_messages() == []


def test_streamed_and_whole_replies_add_the_same_messages_to_a_conversation():
    call = {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}
    req = _translated({"model": "m", "input": "x", "tools": [WEATHER], "stream": True})
    _, whole = render_response(req, _completion({"content": "Let me see.", "tool_calls": [call]}))
    stream = ResponseStream(req)
    stream.start()
    stream.feed(_chunk('{"content":"Let me see."}'))
    stream.feed(_chunk(orjson.dumps({"tool_calls": [{"index": 0, **call}]}).decode(), "tool_calls"))
    stream.finish(_USAGE)
    assert stream.reply_messages() == whole


def test_an_empty_stream_still_completes_with_an_empty_message():
    engine = Engine(chunks=[_chunk(_FIRST), _chunk("{}", "stop")])
    _, final = _stream(engine)
    assert final.output_text == "" and [item.type for item in final.output] == ["message"]


def test_error_event_is_an_event_the_sdk_parses():
    [event] = _events(error_event("model is loading", "model_not_ready"))
    assert (event["type"], event["code"], event["message"]) == ("error", "model_not_ready", "model is loading")


# --- request mapping ---------------------------------------------------------------------------


def test_instructions_become_a_leading_system_message_not_part_of_the_turn():
    req = _translated({"model": "team/chat", "input": "hi", "instructions": "Be brief."})
    assert req.chat["model"] == "team/chat"
    assert req.chat["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert req.turn == [{"role": "user", "content": "hi"}]
    assert "stream" not in req.chat and req.stream is False


def test_developer_messages_are_sent_as_system_messages_and_text_parts_as_a_string():
    item = {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Rules"}]}
    user = {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]}
    req = _translated({"model": "m", "input": [item, user]})
    assert req.chat["messages"] == [{"role": "system", "content": "Rules"}, {"role": "user", "content": "a\nb"}]


def test_a_string_input_is_one_user_message():
    assert _translated({"model": "m", "input": "hello"}).turn == [{"role": "user", "content": "hello"}]


def test_an_image_input_becomes_an_image_url_part():
    part = {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "low"}
    req = _translated(
        {"model": "m", "input": [{"role": "user", "content": [{"type": "input_text", "text": "?"}, part]}]}
    )
    assert req.turn[0]["content"] == [
        {"type": "text", "text": "?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "low"}},
    ]


def test_function_calls_and_their_outputs_become_tool_calls_and_tool_messages_with_matching_ids():
    items = [
        {"role": "user", "content": "Weather in Oslo and Rome?"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city":"Oslo"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city":"Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "12C"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "20C"}]},
    ]
    req = _translated({"model": "m", "input": items, "tools": [WEATHER]})
    assert req.turn == [
        {"role": "user", "content": "Weather in Oslo and Rome?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}},
                {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "12C"},
        {"role": "tool", "tool_call_id": "c2", "content": "20C"},
    ]
    assert req.chat["tools"] == [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]


def test_a_custom_tool_becomes_a_function_tool_taking_one_input_string_with_its_grammar():
    req = _translated(
        {"model": "m", "input": "x", "tools": [APPLY_PATCH], "tool_choice": {"type": "custom", "name": "apply_patch"}}
    )
    [tool] = req.chat["tools"]
    assert tool["type"] == "function" and tool["function"]["name"] == "apply_patch"
    params = tool["function"]["parameters"]
    assert params["required"] == ["input"] and params["properties"]["input"]["type"] == "string"
    assert 'start: "*** Begin Patch" body' in params["properties"]["input"]["description"]
    assert req.chat["tool_choice"] == {"type": "function", "function": {"name": "apply_patch"}}
    assert req.custom_tools == frozenset({"apply_patch"})


def test_a_custom_tool_call_in_input_is_replayed_with_input_arguments():
    items = [
        {"type": "custom_tool_call", "call_id": "p1", "name": "apply_patch", "input": "*** Begin Patch"},
        {"type": "custom_tool_call_output", "call_id": "p1", "output": "Done"},
    ]
    req = _translated({"model": "m", "input": items, "tools": [APPLY_PATCH]})
    [assistant, tool] = req.turn
    assert orjson.loads(assistant["tool_calls"][0]["function"]["arguments"]) == {"input": "*** Begin Patch"}
    assert tool == {"role": "tool", "tool_call_id": "p1", "content": "Done"}


@pytest.mark.parametrize("kind", ["web_search", "web_search_preview", "file_search", "mcp", "local_shell"])
def test_a_built_in_tool_is_refused_naming_it(kind):
    refusal = _refused({"model": "m", "input": "x", "tools": [WEATHER, {"type": kind}]})
    assert (refusal.status, refusal.code, refusal.param) == (400, "unsupported_tool", "tools")
    assert repr(kind) in refusal.message and "function tools" in refusal.message


def test_a_built_in_tool_choice_is_refused():
    refusal = _refused({"model": "m", "input": "x", "tool_choice": {"type": "web_search_preview"}})
    assert refusal.code == "unsupported_tool" and refusal.param == "tool_choice"


def test_an_unknown_input_item_type_is_refused_naming_its_type_and_index():
    refusal = _refused(
        {"model": "m", "input": [{"role": "user", "content": "x"}, {"type": "item_reference", "id": "i"}]}
    )
    assert refusal.param == "input[1]" and "'item_reference'" in refusal.message


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x"}, "model"),
        ({"model": 3, "input": "x"}, "model"),
        ({"model": "m"}, "input"),
        ({"model": "m", "input": "x", "background": True}, "background"),
        ({"model": "m", "input": "x", "previous_response_id": "abc"}, "previous_response_id"),
        ({"model": "m", "input": "x", "store": "yes"}, "store"),
        ({"model": "m", "input": "x", "temperature": "hot"}, "temperature"),
        ({"model": "m", "input": "x", "max_output_tokens": True}, "max_output_tokens"),
        ({"model": "m", "input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"model": "m", "input": "x", "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ],
)
def test_a_malformed_request_is_refused_naming_the_field(body, param):
    refusal = _refused(body)
    assert refusal.status == 400 and refusal.param == param and param.split("[")[0].split(".")[0] in refusal.message


def test_sampling_options_pass_and_max_output_tokens_is_sent_as_max_tokens():
    body = {
        "model": "m",
        "input": "x",
        "max_output_tokens": 64,
        "temperature": 0.5,
        "top_p": 0.8,
        "parallel_tool_calls": False,
        "seed": 7,
        "user": "u1",
        "reasoning": {"effort": "high"},
        "metadata": {"a": "b"},
        "store": False,
        "previous_response_id": "resp_abc",
        "truncation": "auto",
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "k",
    }
    req = _translated(body)
    sent = {k: v for k, v in req.chat.items() if k not in ("model", "messages")}
    assert sent == {
        "max_tokens": 64,
        "temperature": 0.5,
        "top_p": 0.8,
        "parallel_tool_calls": False,
        "seed": 7,
        "user": "u1",
        "reasoning_effort": "high",
    }
    assert (req.store, req.previous_response_id) == (False, "resp_abc")


def test_a_json_schema_text_format_becomes_a_response_format():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    fmt = {"type": "json_schema", "name": "count", "schema": schema, "strict": True}
    req = _translated({"model": "m", "input": "x", "text": {"format": fmt}})
    assert req.chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "count", "schema": schema, "strict": True},
    }
    plain = _translated({"model": "m", "input": "x", "text": {"format": {"type": "text"}}})
    assert "response_format" not in plain.chat


def test_stream_true_asks_the_engine_for_usage():
    req = _translated({"model": "m", "input": "x", "stream": True})
    assert req.stream and req.chat["stream"] is True and req.chat["stream_options"] == {"include_usage": True}


def test_with_history_puts_history_after_the_system_message_and_before_the_turn():
    req = _translated({"model": "m", "input": "and now?", "instructions": "Be brief."})
    history = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "reply"}]
    with_history(req, history)
    assert req.chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        *history,
        {"role": "user", "content": "and now?"},
    ]
    bare = _translated({"model": "m", "input": "and now?"})
    with_history(bare, history)
    assert bare.chat["messages"] == [*history, {"role": "user", "content": "and now?"}]
