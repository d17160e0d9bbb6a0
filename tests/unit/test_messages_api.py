"""Anthropic's Messages API over chat completions: what the real `anthropic` SDK parses out of
the bodies and streams llmgw answers, and the chat-completions requests it sends on."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import anthropic
import orjson
import pytest

from llmgw.server.gateway.messages_api import (
    EngineReplyError,
    MessagesRefusal,
    MessagesRequest,
    MessageStream,
    count_response,
    error_body,
    error_type,
    models_page,
    render_message,
    translate_count_tokens,
    translate_request,
    with_history,
)

# anthropic 2.x is built on httpx2 and refuses httpx's objects (0.x on httpx): take the one it uses.
http = importlib.import_module(anthropic.DefaultHttpxClient.__mro__[1].__module__.partition(".")[0])

USER = [{"role": "user", "content": "hi"}]
WEATHER = {"name": "weather", "description": "Weather in a city", "input_schema": {"type": "object"}}


def client(handler: Callable[[Any], Any]) -> anthropic.Anthropic:
    # max_retries=0: a 429 or 5xx must reach the test at once, not after the SDK's backoff.
    return anthropic.Anthropic(
        api_key="k",
        base_url="http://test",
        max_retries=0,
        http_client=http.Client(transport=http.MockTransport(handler)),
    )


def request(**body: Any) -> MessagesRequest:
    req = translate_request({"model": "m", "max_tokens": 64, "messages": USER, **body})
    assert isinstance(req, MessagesRequest), req
    return req


def refusal(body: dict[str, Any]) -> MessagesRefusal:
    out = translate_request(body)
    assert isinstance(out, MessagesRefusal), out
    assert (out.status, out.type) == (400, "invalid_request_error")
    return out


def completion(message: dict[str, Any], finish: str = "stop", **choice: Any) -> dict[str, Any]:
    return {
        "choices": [{"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish, **choice}],
        "usage": {"prompt_tokens": 12, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 4}},
    }


def serve_reply(engine_reply: dict[str, Any], sent: list[dict[str, Any]]) -> Callable[[Any], Any]:
    """A /v1/messages that translates the SDK's request, keeps the chat body and renders engine_reply."""

    def handler(r: Any) -> Any:
        req = translate_request(orjson.loads(r.content))
        assert isinstance(req, MessagesRequest), req
        sent.append(req.chat)
        return http.Response(200, json=render_message(req, engine_reply)[0])

    return handler


def serve_stream(chunks: list[dict[str, Any]], usage: dict[str, Any] | None = None, broken: str | None = None):
    def handler(r: Any) -> Any:
        req = translate_request(orjson.loads(r.content))
        assert isinstance(req, MessagesRequest) and req.stream, req
        stream = MessageStream(req)
        body = stream.start() + b"".join(stream.feed(c) for c in chunks)
        body += stream.fail(broken) if broken else stream.finish(usage)
        return http.Response(200, content=body, headers={"content-type": "text/event-stream"})

    return handler


def chunk(finish: str | None = None, **delta: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def tool_chunk(index: int, *, id: str | None = None, name: str | None = None, args: str = "") -> dict[str, Any]:
    function: dict[str, Any] = {"arguments": args}
    if name is not None:
        function["name"] = name
    call: dict[str, Any] = {"index": index, "function": function}
    if id is not None:
        call["id"] = id
    return chunk(tool_calls=[call])


# --- replies, read by the SDK -------------------------------------------------------------


def test_a_reply_with_reasoning_text_and_a_tool_call_parses_as_the_sdks_message() -> None:
    sent: list[dict[str, Any]] = []
    reply = completion(
        {
            "reasoning_content": "they want weather",
            "content": "Looking it up.",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
            ],
        },
        finish="tool_calls",
    )
    message = client(serve_reply(reply, sent)).messages.create(
        model="m", max_tokens=64, messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER]
    )
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use"]
    thinking, text, tool = message.content
    assert thinking.type == "thinking" and thinking.thinking == "they want weather"
    assert text.type == "text" and text.text == "Looking it up."
    assert tool.type == "tool_use" and (tool.id, tool.name, tool.input) == ("call_1", "weather", {"city": "Oslo"})
    assert (message.model, message.role, message.stop_reason, message.stop_sequence) == (
        "m",
        "assistant",
        "tool_use",
        None,
    )
    assert message.id.startswith("msg_") and len(message.id) == 4 + 24
    # Anthropic's input_tokens leaves the cache reads out; OpenAI's prompt_tokens counts them.
    usage = message.usage
    assert (usage.input_tokens, usage.output_tokens, usage.cache_read_input_tokens) == (8, 5, 4)
    assert sent[0]["tools"] == [
        {
            "type": "function",
            "function": {"name": "weather", "parameters": {"type": "object"}, "description": "Weather in a city"},
        }
    ]


def test_the_reply_adds_one_chat_assistant_message_with_the_tool_calls_ids() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Oslo"}'}}
    _, added = render_message(request(), completion({"content": None, "tool_calls": [call]}, "tool_calls"))
    assert added == [{"role": "assistant", "content": None, "tool_calls": [call]}]
    _, added = render_message(request(), completion({"content": "hello"}))
    assert added == [{"role": "assistant", "content": "hello"}]


@pytest.mark.parametrize(
    ("finish", "stop_reason"),
    [("stop", "end_turn"), ("length", "max_tokens"), ("tool_calls", "tool_use"), ("content_filter", "end_turn")],
)
def test_engine_finish_reasons_become_anthropic_stop_reasons(finish: str, stop_reason: str) -> None:
    message, _ = render_message(request(), completion({"content": "x"}, finish))
    assert (message["stop_reason"], message["stop_sequence"]) == (stop_reason, None)


def test_a_stop_sequence_the_engine_names_as_matched_is_the_stop_reason() -> None:
    req = request(stop_sequences=["END"])
    vllm, _ = render_message(req, completion({"content": "x"}, stop_reason="END"))
    sglang, _ = render_message(req, completion({"content": "x"}, matched_stop="END"))
    unasked, _ = render_message(req, completion({"content": "x"}, stop_reason="OTHER"))
    assert (vllm["stop_reason"], vllm["stop_sequence"]) == ("stop_sequence", "END")
    assert (sglang["stop_reason"], sglang["stop_sequence"]) == ("stop_sequence", "END")
    assert (unasked["stop_reason"], unasked["stop_sequence"]) == ("end_turn", None)


def test_tool_arguments_that_are_no_json_object_are_kept_raw_and_replayed_verbatim() -> None:
    bad = '{"city": Oslo'
    call = {"type": "function", "function": {"name": "weather", "arguments": bad}}
    message, _ = render_message(request(), completion({"tool_calls": [call]}, "tool_calls"))
    tool = message["content"][0]
    assert tool["input"] == {"_raw": bad} and tool["id"].startswith("toolu_")
    replay = request(messages=[*USER, {"role": "assistant", "content": [tool]}])
    assert replay.turn[1]["tool_calls"][0]["function"]["arguments"] == bad


def test_a_completion_without_a_message_is_an_engine_reply_error() -> None:
    with pytest.raises(EngineReplyError, match=r"choices\[0\]\.message"):
        render_message(request(), {"choices": []})


# --- streams, read by the SDK -----------------------------------------------------------


def test_a_streamed_text_reply_reads_through_the_sdks_text_stream_and_final_message() -> None:
    chunks = [chunk(role="assistant", content=None), chunk(content="Hel"), chunk(content="lo"), chunk("stop")]
    usage = {"prompt_tokens": 9, "completion_tokens": 2}
    with client(serve_stream(chunks, usage)).messages.stream(model="m", max_tokens=64, messages=USER) as s:
        assert list(s.text_stream) == ["Hel", "lo"]
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["text"] and final.content[0].text == "Hello"
    assert (final.stop_reason, final.usage.input_tokens, final.usage.output_tokens) == ("end_turn", 9, 2)


def test_a_streamed_tool_call_accumulates_its_argument_fragments_into_the_parsed_input() -> None:
    chunks = [
        chunk(role="assistant", content=None),
        chunk(reasoning_content="need "),
        chunk(reasoning_content="weather"),
        tool_chunk(0, id="call_9", name="weather"),
        tool_chunk(0, args='{"city": '),
        tool_chunk(0, args='"Oslo"}'),
        chunk("tool_calls"),
        {"choices": [], "usage": {"prompt_tokens": 20, "completion_tokens": 7}},
    ]
    with client(serve_stream(chunks)).messages.stream(model="m", max_tokens=64, messages=USER, tools=[WEATHER]) as s:
        final = s.get_final_message()
    thinking, tool = final.content
    assert thinking.type == "thinking" and (thinking.thinking, thinking.signature) == ("need weather", "")
    assert tool.type == "tool_use" and (tool.id, tool.name, tool.input) == ("call_9", "weather", {"city": "Oslo"})
    # The usage chunk after the last choice counts when finish() is given none.
    assert (final.stop_reason, final.usage.input_tokens, final.usage.output_tokens) == ("tool_use", 20, 7)


def test_each_streamed_block_is_closed_before_the_next_opens_in_index_order() -> None:
    stream = MessageStream(request(stream=True))
    body = stream.start()
    for c in [
        chunk(reasoning_content="r"),
        chunk(content="t"),
        tool_chunk(0, id="a", name="f", args="{}"),
        chunk("tool_calls"),
    ]:
        body += stream.feed(c)
    body += stream.finish({"prompt_tokens": 1, "completion_tokens": 1})
    events = [orjson.loads(part.split(b"\ndata: ", 1)[1]) for part in body.split(b"\n\n") if part]
    assert [(e["type"], e.get("index"), e.get("delta", {}).get("type")) for e in events] == [
        ("message_start", None, None),
        ("ping", None, None),
        ("content_block_start", 0, None),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "signature_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, None),
        ("content_block_delta", 1, "text_delta"),
        ("content_block_stop", 1, None),
        ("content_block_start", 2, None),
        ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None),
        ("message_delta", None, None),
        ("message_stop", None, None),
    ]
    assert body.startswith(b"event: message_start\ndata: ")


def test_tool_arguments_sent_before_the_tools_name_wait_for_its_block() -> None:
    stream = MessageStream(request(stream=True))
    assert stream.feed(tool_chunk(0, id="c", args='{"a":')) == b""
    started = stream.feed(tool_chunk(0, name="f", args="1}"))
    assert b'"name":"f"' in started and b'"partial_json":"{\\"a\\":1}"' in started


def test_the_streamed_reply_adds_one_chat_assistant_message_with_whole_tool_calls() -> None:
    stream = MessageStream(request(stream=True))
    for c in [
        chunk(content="ok"),
        tool_chunk(0, id="c1", name="f", args='{"x"'),
        tool_chunk(0, args=":1}"),
        chunk("tool_calls"),
    ]:
        stream.feed(c)
    stream.finish(None)
    assert stream.reply_messages() == [
        {
            "role": "assistant",
            "content": "ok",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x":1}'}}],
        }
    ]


def test_a_broken_engine_stream_raises_in_the_sdk_with_llmgws_message() -> None:
    handler = serve_stream([chunk(content="par")], broken="the engine's stream broke off")
    with (
        pytest.raises(anthropic.APIStatusError, match="the engine's stream broke off"),
        client(handler).messages.stream(model="m", max_tokens=64, messages=USER) as s,
    ):
        list(s.text_stream)


# --- other bodies, read by the SDK ----------------------------------------------------------


def test_count_tokens_parses_as_the_sdks_token_count() -> None:
    def handler(r: Any) -> Any:
        chat = translate_count_tokens(orjson.loads(r.content))
        assert isinstance(chat, dict) and chat["messages"] == USER and "max_tokens" not in chat
        return http.Response(200, content=count_response(42))

    assert client(handler).messages.count_tokens(model="m", messages=USER).input_tokens == 42


def test_the_models_page_lists_through_the_sdks_models_list() -> None:
    page = models_page([{"id": "qwen", "context_length": 32768, "max_output": 4096}, {"id": "tiny"}])
    models = list(client(lambda r: http.Response(200, content=page)).models.list())
    assert [(m.id, m.display_name, m.type) for m in models] == [("qwen", "qwen", "model"), ("tiny", "tiny", "model")]
    assert (models[0].max_input_tokens, models[0].max_tokens, models[1].max_input_tokens) == (32768, 4096, None)
    assert models[0].created_at.year == 1970
    assert orjson.loads(page)["first_id"] == "qwen" and orjson.loads(page)["last_id"] == "tiny"


@pytest.mark.parametrize(
    ("status", "error"),
    [(429, anthropic.RateLimitError), (401, anthropic.AuthenticationError), (400, anthropic.BadRequestError)],
)
def test_an_error_body_raises_the_sdks_error_for_its_status_with_llmgws_message(status: int, error: type) -> None:
    body = error_body(status, "slow down, tenant t")
    with pytest.raises(error, match="slow down, tenant t") as raised:
        client(lambda r: http.Response(status, content=body)).messages.create(model="m", max_tokens=8, messages=USER)
    assert raised.value.type == error_type(status)


def test_error_types_follow_anthropics_table_by_status() -> None:
    table = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error"}
    table |= {413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 502: "api_error"}
    table |= {503: "overloaded_error", 529: "overloaded_error", 504: "timeout_error", 418: "invalid_request_error"}
    assert {s: error_type(s) for s in table} == table


# --- requests -----------------------------------------------------------------------------


def test_a_system_string_or_text_blocks_become_one_leading_system_message() -> None:
    plain = request(system="be brief")
    blocks = request(
        system=[{"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}}, {"type": "text", "text": "b"}]
    )
    assert plain.chat["messages"] == [{"role": "system", "content": "be brief"}, *USER] and plain.turn == USER
    assert blocks.chat["messages"][0] == {"role": "system", "content": "a\n\nb"} and blocks.system == "a\n\nb"


def test_tool_use_and_tool_result_round_trip_their_ids_with_results_before_the_users_text() -> None:
    req = request(
        messages=[
            *USER,
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "s"},
                    {"type": "text", "text": "checking"},
                    {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Oslo"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "and then?"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "no such city"}],
                        "is_error": True,
                    },
                ],
            },
        ]
    )
    assert req.turn[1:] == [
        {
            "role": "assistant",
            "content": "checking",
            "tool_calls": [
                {"id": "toolu_1", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Oslo"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: no such city"},
        {"role": "user", "content": "and then?"},
    ]


def test_images_become_image_url_parts_from_base64_or_a_url() -> None:
    content = [
        {"type": "text", "text": "what are these?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"}},
        {"type": "image", "source": {"type": "url", "url": "https://example.test/cat.jpg"}},
    ]
    req = request(messages=[{"role": "user", "content": content}])
    assert req.turn == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what are these?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO"}},
                {"type": "image_url", "image_url": {"url": "https://example.test/cat.jpg"}},
            ],
        }
    ]


def test_a_server_tool_is_refused_naming_its_type() -> None:
    out = refusal(
        {
            "model": "m",
            "max_tokens": 8,
            "messages": USER,
            "tools": [{"type": "web_search_20250305", "name": "web_search"}],
        }
    )
    assert "web_search_20250305" in out.message and "no server-side tools" in out.message


def test_a_document_block_is_refused_naming_its_type() -> None:
    document = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}
    out = refusal({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [document]}]})
    assert "'document'" in out.message and "messages[0].content[0]" in out.message


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"model": "m", "messages": USER}, "max_tokens"),
        ({"model": "m", "max_tokens": 0, "messages": USER}, "max_tokens"),
        ({"max_tokens": 8, "messages": USER}, "model"),
        ({"model": "m", "max_tokens": 8, "messages": []}, "messages"),
    ],
)
def test_a_missing_or_invalid_required_field_is_refused_naming_it(body: dict[str, Any], field: str) -> None:
    assert refusal(body).message.startswith(field)


def test_count_tokens_needs_no_max_tokens_and_keeps_system_and_tools() -> None:
    chat = translate_count_tokens({"model": "m", "system": "s", "messages": USER, "tools": [WEATHER]})
    assert isinstance(chat, dict) and set(chat) == {"model", "messages", "tools"}
    assert chat["messages"][0] == {"role": "system", "content": "s"}


@pytest.mark.parametrize(
    ("choice", "chat_choice"),
    [
        ({"type": "any"}, "required"),
        ({"type": "auto"}, "auto"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "weather"}, {"type": "function", "function": {"name": "weather"}}),
    ],
)
def test_tool_choice_maps_to_chat_completions_tool_choice(choice: dict[str, Any], chat_choice: object) -> None:
    assert request(tools=[WEATHER], tool_choice=choice).chat["tool_choice"] == chat_choice


def test_disabling_parallel_tool_use_turns_off_parallel_tool_calls() -> None:
    chat = request(tools=[WEATHER], tool_choice={"type": "auto", "disable_parallel_tool_use": True}).chat
    assert chat["parallel_tool_calls"] is False


def test_sampling_options_map_to_their_chat_completions_names() -> None:
    chat = request(stop_sequences=["END"], temperature=0.2, top_p=0.9, top_k=40, metadata={"user_id": "u1"}).chat
    assert (chat["stop"], chat["temperature"], chat["top_p"], chat["top_k"], chat["user"]) == (
        ["END"],
        0.2,
        0.9,
        40,
        "u1",
    )
    assert chat["max_tokens"] == 64 and "stream" not in chat
    thinking = request(thinking={"type": "enabled", "budget_tokens": 1024}).chat
    assert "thinking" not in thinking


def test_a_streaming_request_asks_the_engine_for_usage_in_its_stream() -> None:
    req = request(stream=True)
    assert req.stream and req.chat["stream"] is True and req.chat["stream_options"] == {"include_usage": True}


def test_history_goes_after_the_system_message_and_before_this_turn() -> None:
    req = request(system="sys")
    history = [{"role": "user", "content": "earlier"}, {"role": "assistant", "content": "reply"}]
    with_history(req, history)
    assert req.chat["messages"] == [{"role": "system", "content": "sys"}, *history, *USER]
    assert req.turn == USER
