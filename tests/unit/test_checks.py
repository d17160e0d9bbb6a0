"""llmgw.server.gateway.checks and errors.speaks_anthropic: the decisions every client route
shares about what a client sent (its JSON body, an id it hands back) and which API's shape an
error of a request takes."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import make_mocked_request

from llmgw.server.gateway.checks import INT_MAX, INT_MIN, BadInput, check_id, load_json, whole
from llmgw.server.gateway.errors import speaks_anthropic


def _refusal(raw: bytes) -> BadInput:
    with pytest.raises(BadInput) as ei:
        load_json(raw)
    return ei.value


@pytest.mark.parametrize(
    ("literal", "path"),
    [
        (str(2**64).encode(), "max_tokens"),  # orjson reads it as a float
        (str(2**63).encode(), "max_tokens"),  # orjson reads it as an int no database stores
        (str(INT_MIN - 1).encode(), "max_tokens"),
        (b"1" + b"0" * 300, "max_tokens"),  # 301 digits: shown cut short
    ],
    ids=["2**64", "2**63", "-2**63-1", "10**300"],
)
def test_a_whole_number_past_64_bits_is_refused_naming_its_field(literal, path):
    exc = _refusal(b'{"model":"m","max_tokens":' + literal + b"}")
    assert exc.code == "number_too_large" and exc.param == "max_tokens"
    assert exc.message.startswith(f"'{path}' is ") and str(INT_MAX) in exc.message
    assert len(exc.message) < 200  # 301 digits are not repeated back


def test_the_64_bit_edges_themselves_are_read():
    assert load_json(b'{"seed":%d,"n":%d}' % (INT_MAX, INT_MIN)) == {"seed": INT_MAX, "n": INT_MIN}


def test_a_number_deep_inside_is_named_by_its_path():
    exc = _refusal(b'{"messages":[{"role":"user","content":[{"x":1},{"n":99999999999999999999}]}]}')
    assert exc.message.startswith("'messages[0].content[1].n' is 99999999999999999999") and exc.param == "messages"


def test_a_large_float_is_a_float_not_a_whole_number_and_is_read():
    # JSON allows 1e300 and engines read it (a tool schema's maximum, say): only whole numbers are bounded.
    assert load_json(b'{"maximum":1e300,"x":1.8446744073709552e19}') == {"maximum": 1e300, "x": 1.8446744073709552e19}


def test_a_long_run_of_digits_inside_a_string_is_text_not_a_number():
    assert load_json(b'{"content":"order 123456789012345678901234567890"}')["content"].endswith("7890")


def test_a_large_body_is_checked_by_its_values_as_a_small_one_is_by_its_bytes():
    padding = b'"' + b"a" * 20_000 + b'"'
    assert load_json(b'{"p":' + padding + b',"n":2}')["n"] == 2
    exc = _refusal(b'{"p":' + padding + b',"n":18446744073709551616}')
    assert exc.param == "n"


def test_a_body_nested_deeper_than_pythons_json_reads_is_still_judged():
    depth = 1000
    deep = b"[" * depth + b"18446744073709551616" + b"]" * depth
    assert _refusal(deep).code == "number_too_large"
    assert load_json(b"[" * depth + b"1" + b"]" * depth) is not None


@pytest.mark.parametrize(
    "raw",
    [b"", b"{", b"NaN", b'"\\ud800"', b"[" * 2000 + b"]" * 2000, b"\xff", b"1" + b"0" * 5000],
    ids=["empty", "cut", "nan", "lone-surrogate", "too-deep", "not-utf8", "past-a-double"],
)
def test_what_is_not_json_is_refused_as_invalid_json(raw):
    exc = _refusal(raw)
    assert exc.code == "invalid_json" and exc.message.startswith("the request body is not valid JSON")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (200, 200),
        (200.0, 200),
        (INT_MAX, INT_MAX),
        (2**63, None),
        (1e20, None),
        (200.5, None),
        (True, None),
        ("9", None),
    ],
)
def test_whole_reads_a_whole_number_that_fits_64_bits(value, expected):
    got = whole(value)
    assert got == expected and (got is None or type(got) is int)


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("thr_\x00", "cannot contain control characters"),
        ("a\x1bb", "cannot contain control characters"),
        ("a\x85b", "cannot contain control characters"),
        ("a\udcffb", "lone surrogate"),
        ("x" * 65, "1 to 64 characters"),
        ("", "1 to 64 characters"),
    ],
)
def test_an_id_no_gateway_gives_is_refused_saying_why(value, problem):
    with pytest.raises(BadInput) as ei:
        check_id("thread", value, "thread")
    assert problem in ei.value.message and "the id this gateway gave you" in ei.value.message
    assert ei.value.code == "invalid_id" and ei.value.param == "thread"


def test_an_id_the_gateway_gives_passes():
    assert check_id("note", "note_0123456789abcdef01234567") == "note_0123456789abcdef01234567"


@pytest.mark.parametrize(
    ("method", "path", "headers", "anthropic"),
    [
        ("POST", "/v1/messages", {}, True),
        ("POST", "/v1/messages/count_tokens", {}, True),
        ("GET", "/v1/models", {"anthropic-version": "2023-06-01"}, True),
        ("GET", "/v1/models/m", {"anthropic-version": "2023-06-01"}, True),
        ("GET", "/v1/models", {}, False),
        ("POST", "/v1/chat/completions", {"anthropic-version": "2023-06-01"}, False),
        ("POST", "/v1/messagesx", {}, False),
        ("GET", "/", {}, False),
    ],
)
def test_a_request_to_anthropics_api_takes_its_error_shape(method, path, headers, anthropic):
    assert speaks_anthropic(make_mocked_request(method, path, headers=headers)) is anthropic
