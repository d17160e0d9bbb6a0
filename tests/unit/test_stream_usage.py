import orjson

from llmgw.server.gateway.proxy import _OUTPUT_FIELDS_SEEN, _count_output, _has_usage, _model_field, _take_usage

CHUNK = b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"hi"}}],"usage":null}\n\n'
USAGE = b'data: {"id":"c","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2,"total_tokens":7}}\n\n'
DONE = b"data: [DONE]\n\n"


def test_usage_event_stripped_when_client_did_not_ask():
    out, (usage,) = _take_usage(CHUNK + USAGE + DONE, strip=True)
    assert usage == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    assert out == CHUNK + DONE  # the other events are byte for byte the same


def test_usage_event_kept_when_client_asked():
    block = CHUNK + USAGE + DONE
    out, (usage,) = _take_usage(block, strip=False)
    assert out is block and usage["completion_tokens"] == 2


def test_null_usage_is_not_usage():
    out, usages = _take_usage(CHUNK, strip=True)
    assert usages == [] and out == CHUNK


def test_usage_on_a_content_chunk_is_read_but_not_dropped():
    ev = (
        b"data: "
        + orjson.dumps(
            {
                "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 3},
            }
        )
        + b"\n\n"
    )
    out, (usage,) = _take_usage(ev, strip=True)
    assert out == ev and usage["completion_tokens"] == 3


# Events as llama-server (llama.cpp in llama-cpp-python 0.3.36) writes them, one token each.
LLAMA = (
    b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant","content":null}}],'
    b'"created":1,"id":"c","model":"tiny","object":"chat.completion.chunk"}\n\n'
    b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"\xd1\x82"}}],"created":1,'
    b'"id":"c","model":"tiny","object":"chat.completion.chunk"}\n\n'
    b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":" European"}}],"created":1,'
    b'"id":"c","model":"tiny","object":"chat.completion.chunk"}\n\n'
    b'data: {"choices":[{"finish_reason":"length","index":0,"delta":{}}],"created":1,"id":"c",'
    b'"model":"tiny","object":"chat.completion.chunk"}\n\n'
)


def test_output_tokens_are_counted_from_events_as_engines_write_them():
    chat = _OUTPUT_FIELDS_SEEN["chat", False]
    assert _count_output(LLAMA, chat) == 2  # the role event (null) and the final one ({}) are none
    vllm_first = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
    assert _count_output(vllm_first + CHUNK, chat) == 1  # an empty string is no token
    reasoning = b'data: {"choices":[{"delta":{"reasoning_content":"hm","content":null}}]}\n\n'
    tools = (
        b'data: {"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"name":"f","arguments":""}}]}}]}\n\n'
        b'data: {"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\\"a\\":"}}]}}]}\n\n'
    )
    assert _count_output(reasoning + tools, chat) == 2
    # Text that mentions the fields is escaped in JSON, so it is not counted twice.
    quoting = b"data: " + orjson.dumps({"choices": [{"delta": {"content": 'say "content":"x"'}}]}) + b"\n\n"
    assert _count_output(quoting, chat) == 1
    spaced = b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\ndata: {"choices": [{"delta": {"content": ""}}]}\n\n'
    assert _count_output(spaced, _OUTPUT_FIELDS_SEEN["chat", True]) == 1
    text = (
        b'data: {"choices":[{"text":" lorem","index":0}]}\n\ndata: {"choices":[{"text":"","finish_reason":"stop"}]}\n\n'
    )
    assert _count_output(text, _OUTPUT_FIELDS_SEEN["completions", False]) == 1


def test_usage_null_is_not_decoded_and_model_field_is_found_exactly():
    assert not _has_usage(CHUNK) and _has_usage(USAGE)
    assert _model_field(LLAMA) == b'"model":"tiny"'
    assert _model_field(b'data: {"model": "a/b"}\n\n') == b'"model": "a/b"'
    assert _model_field(b'data: {"model":"a\\"b"}\n\n') == b""  # an escape: left alone
    assert _model_field(b'data: {"model":null}\n\n') == b""
    assert _model_field(CHUNK) is None
