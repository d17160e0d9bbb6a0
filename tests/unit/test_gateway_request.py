"""read_request: every refusal of a parsed body, and the shapes it lets through (with what it
rewrites in the body the engine is sent). No server: it is a plain function."""

from __future__ import annotations

import pytest

from llmgw.server.gateway.principal import ANONYMOUS
from llmgw.server.gateway.request import CHAT, COMPLETIONS, EMBEDDINGS, Call, Refusal, ServedModel, read_request

PLAIN = ServedModel("m", ("alias",), None, None)
CAPPED = ServedModel("capped", (), None, 200)
MODELS = {"m": PLAIN, "alias": PLAIN, "capped": CAPPED}

MESSAGES = [{"role": "user", "content": "hi"}]


def _chat(**extra) -> dict:
    return {"model": "m", "messages": MESSAGES, **extra}


def _refused(route, body) -> Refusal:
    got = read_request(route, body, MODELS)
    assert isinstance(got, Refusal), got
    return got


def _accepted(route, body) -> Call:
    got = read_request(route, body, MODELS)
    assert isinstance(got, Call), got
    return got


# ------------------------------------------------------------------ refusals


@pytest.mark.parametrize("body", [[], [1, 2], "text", 3, 1.5, None, True])
def test_a_body_that_is_not_an_object(body):
    r = _refused(CHAT, body)
    assert (r.status, r.message, r.code, r.param, r.model) == (
        400,
        "the request body should be a JSON object",
        "invalid_request",
        None,
        "",
    )


@pytest.mark.parametrize(
    "body", [{"messages": MESSAGES}, {"model": ""}, {"model": None}, {"model": 3}, {"model": ["m"]}]
)
def test_no_model_name(body):
    r = _refused(CHAT, body)
    assert (r.status, r.message, r.code, r.param, r.model) == (
        400,
        "'model' is required: the name of a model from GET /v1/models",
        "missing_field",
        "model",
        "",
    )


def test_a_model_not_served():
    r = _refused(CHAT, {"model": "nope", "messages": MESSAGES})
    assert (r.status, r.code, r.param, r.model) == (404, "model_not_found", "model", "")
    assert r.message == "The model 'nope' does not exist; GET /v1/models lists the models you can use"


@pytest.mark.parametrize("route, field", [(CHAT, "messages"), (COMPLETIONS, "prompt"), (EMBEDDINGS, "input")])
def test_the_routes_required_field_missing(route, field):
    r = _refused(route, {"model": "alias"})
    assert (r.status, r.message, r.code, r.param) == (
        400,
        f"'{field}' is required for {route.path}",
        "missing_field",
        field,
    )
    assert r.model == "m"  # counted under the served name, not the alias


@pytest.mark.parametrize("messages", [[], None, "hi", {"role": "user"}])
def test_chat_messages_not_a_non_empty_list(messages):
    r = _refused(CHAT, {"model": "m", "messages": messages})
    assert (r.status, r.message, r.code, r.param, r.model) == (
        400,
        "'messages' should be a non-empty list of messages",
        "invalid_request",
        "messages",
        "m",
    )


@pytest.mark.parametrize("route", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("stream", ["true", 1, 0, None, {}])
def test_stream_not_a_boolean(route, stream):
    body = {"model": "m", route.required: MESSAGES, "stream": stream}
    r = _refused(route, body)
    assert (r.status, r.message, r.code, r.param, r.model) == (
        400,
        "'stream' should be true or false",
        "invalid_request",
        "stream",
        "m",
    )


@pytest.mark.parametrize("route", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens", "n_predict"])
@pytest.mark.parametrize(
    "value, says",
    [
        (200.5, "'{f}' should be a whole number of tokens, not 200.5"),
        ("9", "'{f}' should be a whole number of tokens, not \"9\""),
        (False, "'{f}' should be a whole number of tokens, not false"),
        (-1, "'{f}' is -1; give a number of tokens of 0 or more, or leave it out"),
    ],
)
def test_an_output_limit_it_cannot_read(route, field, value, says):
    r = _refused(route, {"model": "m", route.required: MESSAGES, field: value})
    assert (r.status, r.message, r.code, r.param, r.model) == (400, says.format(f=field), "invalid_request", field, "m")


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens", "n_predict"])
def test_an_output_limit_above_the_models_max_output(field):
    r = _refused(CHAT, {"model": "capped", "messages": MESSAGES, field: 201})
    assert (r.status, r.code, r.param, r.model) == (400, "max_tokens_too_large", field, "capped")
    assert r.message == (
        f"{field} is 201, but this model allows at most 200; ask for 200 or fewer, or leave it out to get up to that"
    )


@pytest.mark.parametrize("opts", [[], "yes", True, 1])
def test_stream_options_not_an_object(opts):
    r = _refused(CHAT, _chat(stream=True, stream_options=opts))
    assert (r.status, r.message, r.code, r.param, r.model) == (
        400,
        "'stream_options' should be an object",
        "invalid_request",
        "stream_options",
        "m",
    )


def test_checks_run_in_order_the_first_refusal_wins():
    # Both 'stream' and 'max_tokens' are wrong; 'stream' is read first, as it always was.
    assert _refused(CHAT, _chat(stream="x", max_tokens=-1)).param == "stream"
    assert _refused(CHAT, {"model": "nope"}).status == 404  # the model before its fields


# ------------------------------------------------------------------ accepted shapes


def test_a_plain_chat_request_is_left_as_it_came():
    body = _chat()
    c = _accepted(CHAT, body)
    assert (c.route, c.served, c.asked, c.body) == (CHAT, PLAIN, "m", body)
    assert (c.changed, c.stream, c.client_wants_usage, c.out_limit) == (False, False, True, None)
    assert body == _chat()  # not rewritten
    # Filled in by the proxy afterwards.
    assert (c.principal, c.raw, c.t0, c.res) == (ANONYMOUS, b"", 0.0, None)


def test_an_alias_resolves_to_its_model_and_keeps_the_name_asked():
    c = _accepted(CHAT, {"model": "alias", "messages": MESSAGES})
    assert c.served is PLAIN and c.asked == "alias"
    assert c.body["model"] == "alias"  # the upstream name is the proxy's to put in, per endpoint


def test_a_stream_asks_the_engine_for_usage_and_remembers_the_client_did_not():
    body = _chat(stream=True)
    c = _accepted(CHAT, body)
    assert c.stream and not c.client_wants_usage and c.changed
    assert body["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize("opts", [None, {}, {"include_usage": False}, {"include_usage": "yes"}])
def test_stream_options_without_include_usage_true_get_it(opts):
    body = _chat(stream=True, stream_options=opts)
    c = _accepted(CHAT, body)
    assert not c.client_wants_usage and c.changed
    assert body["stream_options"]["include_usage"] is True


def test_other_stream_options_are_kept():
    body = _chat(stream=True, stream_options={"continuous_usage_stats": True})
    _accepted(CHAT, body)
    assert body["stream_options"] == {"continuous_usage_stats": True, "include_usage": True}


def test_a_client_that_asks_for_usage_gets_the_body_unchanged():
    body = _chat(stream=True, stream_options={"include_usage": True})
    c = _accepted(CHAT, body)
    assert c.stream and c.client_wants_usage and not c.changed
    assert body == _chat(stream=True, stream_options={"include_usage": True})


def test_stream_false_is_not_a_stream_and_stream_options_are_not_read():
    c = _accepted(CHAT, _chat(stream=False, stream_options="ignored"))
    assert not c.stream and c.client_wants_usage and not c.changed


def test_completions_read_the_same_way():
    body = {"model": "m", "prompt": "once", "stream": True, "max_tokens": 7.0}
    c = _accepted(COMPLETIONS, body)
    assert c.route is COMPLETIONS and c.stream and c.out_limit == 7 and c.changed
    assert body["max_tokens"] == 7 and type(body["max_tokens"]) is int


def test_embeddings_neither_stream_nor_read_an_output_limit():
    # Embeddings generate nothing: 'stream' and the output fields are the engine's business.
    body = {"model": "capped", "input": "x", "stream": "yes", "max_tokens": "many"}
    c = _accepted(EMBEDDINGS, body)
    assert (c.stream, c.out_limit, c.changed, c.client_wants_usage) == (False, None, False, True)
    assert body == {"model": "capped", "input": "x", "stream": "yes", "max_tokens": "many"}
    assert _accepted(EMBEDDINGS, {"model": "m", "input": []}).served is PLAIN  # only its presence is checked


def test_the_output_limit_is_read_and_a_cap_always_sent():
    c = _accepted(CHAT, _chat(max_tokens=50))
    assert c.out_limit == 50 and not c.changed
    body = {"model": "capped", "messages": MESSAGES}
    c = _accepted(CHAT, body)
    assert c.out_limit == 200 and c.changed and body["max_tokens"] == 200
    body = {"model": "capped", "messages": MESSAGES, "n_predict": 20, "max_tokens": None}
    c = _accepted(CHAT, body)
    assert c.out_limit == 20 and body["max_tokens"] == 20


def test_the_context_is_one_slotted_object():
    c = _accepted(CHAT, _chat())
    assert not hasattr(c, "__dict__")  # no per-request dict: slots on the request path
    c.principal, c.raw, c.t0 = ANONYMOUS, b"{}", 1.0  # the proxy's fields, set after reading
