import orjson

from llmgw.server.gateway.proxy import _take_usage

CHUNK = b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"hi"}}],"usage":null}\n\n'
USAGE = b'data: {"id":"c","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2,"total_tokens":7}}\n\n'
DONE = b"data: [DONE]\n\n"


def test_usage_event_stripped_when_client_did_not_ask():
    out, usage = _take_usage(CHUNK + USAGE + DONE, strip=True)
    assert usage == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    assert out == CHUNK + DONE  # the other events are byte for byte the same


def test_usage_event_kept_when_client_asked():
    block = CHUNK + USAGE + DONE
    out, usage = _take_usage(block, strip=False)
    assert out is block and usage["completion_tokens"] == 2


def test_null_usage_is_not_usage():
    out, usage = _take_usage(CHUNK, strip=True)
    assert usage is None and out == CHUNK


def test_usage_on_a_content_chunk_is_read_but_not_dropped():
    ev = b"data: " + orjson.dumps({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                                   "usage": {"prompt_tokens": 1, "completion_tokens": 3}}) + b"\n\n"
    out, usage = _take_usage(ev, strip=True)
    assert out == ev and usage["completion_tokens"] == 3
