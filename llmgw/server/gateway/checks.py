"""What every client route checks the same way before anything reads it: a JSON body (valid
JSON, and no whole number past 64 bits anywhere in it) and an id a client hands back (a
conversation, a stored response, a note).

Each refusal is a BadInput. The client listener's middleware (server/app.py) answers one that a
handler lets through with 400 in the shape of the API that was called, and one line in the log
(errors.refuse_input); a handler that counts its refusals (the proxy) answers it the same way.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

from llmgw.errors import LlmgwError
from llmgw.store import caller_id_problem

# The whole numbers a body may hold: what SQLite, PostgreSQL's bigint and the engines' parsers
# all take. orjson reads a larger one as a float (or, up to 2**64, an int that orjson.dumps
# still writes but no database stores), so it would be sent on, or stored, as something else.
INT_MIN = -(2**63)
INT_MAX = 2**63 - 1
_FLOAT_LIMIT = 2.0**63

# A number past 64 bits has at least 19 digits in a row; a body without such a run needs no
# further look. Searching the bytes costs about 0.7 µs per KiB, walking the parsed body about
# 0.1 µs per value: the bytes are searched in a small body, the values walked in a large one.
_DIGITS = bytes(48 if 48 <= b <= 57 else 32 for b in range(256))
_RUN = b"0" * 19
_SEARCH_BELOW = 8192


class BadInput(LlmgwError):
    """Something a client sent that no route can take: refused with 400, saying what and where."""

    def __init__(self, message: str, code: str = "invalid_request", param: str | None = None) -> None:
        super().__init__(message)
        self.status = 400
        self.message = message
        self.code = code
        self.param = param


def load_json(raw: bytes) -> Any:
    """A request body parsed, or BadInput: not JSON, or a whole number past 64 bits in it."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadInput(f"the request body is not valid JSON: {exc}", "invalid_json") from None
    if _RUN in raw.translate(_DIGITS) if len(raw) < _SEARCH_BELOW else _out_of_range(body):
        _refuse_large_whole_numbers(raw, body)
    return body


def whole(value: object) -> int | None:
    """A JSON number that is whole and fits 64 bits (200 and 200.0 alike), as an int; else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if INT_MIN <= value <= INT_MAX else None
    if isinstance(value, float) and value.is_integer() and -_FLOAT_LIMIT <= value < _FLOAT_LIMIT:
        return int(value)
    return None


def check_id(what: str, value: object, param: str | None = None) -> str:
    """``value`` when it can be a ``what`` id ("thread", "response", "note") the gateway gave;
    else BadInput saying why (store.caller_id_problem is the rule)."""
    problem = caller_id_problem(what, value)
    if problem is not None:
        raise BadInput(f"{problem} Use the id this gateway gave you.", "invalid_id", param)
    assert isinstance(value, str)
    return value


# -- numbers past 64 bits ----------------------------------------------------------------


class _Literal(str):
    """A whole number written in the body that does not fit 64 bits, kept as its text."""


def _int(text: str) -> int | _Literal:
    digits = len(text) - text.startswith("-")
    # JSON has no leading zeros: 20 digits are past 64 bits, and int() of a few thousand
    # digits would itself raise.
    if digits > 19 or (digits == 19 and not INT_MIN <= int(text) <= INT_MAX):
        return _Literal(text)
    return int(text)


def _out_of_range(body: Any) -> bool:
    """Whether a value orjson read may have been written as a whole number past 64 bits."""
    stack = [body]
    while stack:
        v = stack.pop()
        t = type(v)
        if t is dict:
            stack.extend(v.values())
        elif t is list:
            stack.extend(v)
        elif t is int:
            if not INT_MIN <= v <= INT_MAX:
                return True
        elif t is float and not -_FLOAT_LIMIT <= v < _FLOAT_LIMIT:
            return True
    return False


def _refuse_large_whole_numbers(raw: bytes, body: Any) -> None:
    """Raise BadInput naming the first whole number past 64 bits, if the body holds one.

    Read again with Python's json, which hands every whole number over as written, so that
    1e300 (a float, which JSON allows and engines read) is told apart from 1000…0 (a whole
    number no engine or database takes). A body nested deeper than Python's json reads
    (orjson reads 1024 levels) is judged by orjson's values: any number that large is refused.
    """
    try:
        tree = json.loads(raw, parse_int=_int)
        exact = True
    except RecursionError:
        tree, exact = body, False
    stack: list[tuple[Any, str]] = [(tree, "")]
    while stack:
        v, path = stack.pop()
        if isinstance(v, dict):
            stack.extend((x, f"{path}.{k}" if path else str(k)) for k, x in reversed(v.items()))
        elif isinstance(v, list):
            stack.extend((x, f"{path}[{i}]") for i, x in reversed(list(enumerate(v))))
        elif isinstance(v, _Literal) or (not exact and type(v) in (int, float) and _too_large(v)):
            shown = str(v) if len(str(v)) <= 40 else f"{str(v)[:20]}…({len(str(v))} digits)"
            where = f"'{path}'" if path else "the body"
            raise BadInput(
                f"{where} is {shown}, a number past the 64 bits this gateway reads; give a whole number "
                f"from {INT_MIN} to {INT_MAX}",
                "number_too_large",
                path.split(".", 1)[0].split("[", 1)[0] or None,
            )


def _too_large(v: float) -> bool:
    return not -_FLOAT_LIMIT <= v < _FLOAT_LIMIT
