"""Messages to and from bytes: one JSON object per WebSocket message,

    {"type": "start_shard", "id": "42", "payload": {...}}

``id`` is optional and pairs a reply with its request. Decoding is strict
about types (a number sent as a string is a bug in the sender, said as such)
and ignores fields it does not know (a newer peer adds them).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

import orjson
from pydantic import ConfigDict, Field, TypeAdapter, ValidationError, create_model
from pydantic_core import ErrorDetails

from llmgw.errors import LlmgwError

from .messages import MESSAGE_TYPES, Direction, Message

Sender = Literal["agent", "control"]

_BY_TYPE: dict[str, type[Message]] = {cls.TYPE: cls for cls in MESSAGE_TYPES}


class ProtocolError(LlmgwError, ValueError):
    """A message that cannot be used. ``msg_type`` and ``msg_id`` are set when
    they could be read, so the receiver can still answer the sender."""

    def __init__(self, message: str, *, msg_type: str | None = None, msg_id: str | None = None):
        super().__init__(message)
        self.msg_type = msg_type
        self.msg_id = msg_id


def _envelope(cls: type[Message]) -> type:
    # One envelope model per message type, joined in a union discriminated by
    # "type", so a whole message is parsed and validated in one pass.
    return create_model(
        f"{cls.__name__}Envelope",
        __config__=ConfigDict(extra="ignore"),
        type=(Literal[cls.TYPE], ...),
        id=(str | None, None),
        # A message whose fields are all optional may leave the payload out.
        payload=(cls, Field(default_factory=dict, validate_default=True)),
    )


# Built at run time from MESSAGE_TYPES, so no static type describes it.
_ENVELOPES: TypeAdapter[Any] = TypeAdapter(
    # Union[...] of a tuple built at run time: the `X | Y` spelling cannot take one.
    Annotated[Union[tuple(_envelope(c) for c in MESSAGE_TYPES)], Field(discriminator="type")]  # noqa: UP007
)


def encode(msg: Message) -> bytes:
    """The bytes to send for ``msg``. Fields that are None are left out: absent
    and None mean the same thing ("unknown") on the wire."""
    if not isinstance(msg, Message):
        raise ProtocolError(f"cannot encode {type(msg).__name__}: only protocol messages travel on the stream")
    if msg.NEEDS_ID and not msg.id:
        raise ProtocolError(
            f"{msg.TYPE} needs an id: set it to the id of the request it answers",
            msg_type=msg.TYPE,
        )
    env: dict[str, Any] = {"type": msg.TYPE}
    if msg.id is not None:
        env["id"] = msg.id
    env["payload"] = msg.model_dump(mode="json", exclude_none=True)
    return orjson.dumps(env)


def decode(data: bytes | bytearray | memoryview | str, *, sender: Sender | None = None) -> Message:
    """The message in ``data``; ``ProtocolError`` saying what is wrong otherwise.

    ``sender`` is who is on the other end: a control plane decodes with
    ``sender="agent"`` and refuses a ``start_shard`` coming up, and the reverse.
    """
    if isinstance(data, memoryview):
        data = data.tobytes()
    try:
        env = _ENVELOPES.validate_json(data, strict=True)
    except ValidationError as exc:
        raise _explain(exc, data) from None
    msg: Message = env.payload
    msg.id = env.id
    if msg.NEEDS_ID and not msg.id:
        raise ProtocolError(
            f"{msg.TYPE} message has no id: it must carry the id of the request it answers",
            msg_type=msg.TYPE,
        )
    if sender is not None and not _may_send(sender, msg.DIRECTION):
        other = "the control plane" if sender == "agent" else "an agent"
        raise ProtocolError(
            f"{msg.TYPE} is sent by {other}, not by {'an agent' if sender == 'agent' else 'the control plane'}",
            msg_type=msg.TYPE,
            msg_id=msg.id,
        )
    return msg


def _may_send(sender: Sender, direction: Direction) -> bool:
    return direction == "both" or (direction == "up") == (sender == "agent")


# ------------------------------------------------------------ error words


def _explain(exc: ValidationError, data: bytes | bytearray | str) -> ProtocolError:
    msg_type, msg_id = _peek(data)
    errors = exc.errors(include_url=False)
    first = errors[0] if errors else {"type": "", "msg": "is not valid"}
    kind = first["type"]
    if kind == "json_invalid":
        return ProtocolError(f"the message is not valid JSON: {first['msg'].removeprefix('Invalid JSON: ')}")
    if kind in ("dict_type", "model_type") and not first["loc"]:
        return ProtocolError("the message must be a JSON object with a type and a payload")
    if kind == "union_tag_not_found":
        return ProtocolError('the message has no "type"; it must name one of: ' + ", ".join(sorted(_BY_TYPE)))
    if kind == "union_tag_invalid":
        return ProtocolError(
            f'unknown message type "{msg_type}"; this side knows: ' + ", ".join(sorted(_BY_TYPE)),
            msg_type=msg_type,
            msg_id=msg_id,
        )
    head = f"{msg_type} message" + (f" {msg_id}" if msg_id else "")
    parts = [_describe(err) for err in errors[:5]]
    if len(errors) > 5:
        parts.append(f"and {len(errors) - 5} more")
    return ProtocolError(f"{head}: " + "; ".join(parts), msg_type=msg_type, msg_id=msg_id)


def _describe(err: ErrorDetails) -> str:
    loc = list(err["loc"][1:])  # the first element is the type tag
    if loc[:1] == ["payload"]:
        loc = loc[1:]
        where = f"field {_path(loc)}" if loc else "payload"
    else:
        where = f"envelope field {_path(loc)}"
    if err["type"] == "missing":
        return f"{where} is required but missing"
    reason = err["msg"]
    for prefix in ("Value error, ", "Assertion failed, "):
        reason = reason.removeprefix(prefix)
    got = err.get("input")
    shown = "" if isinstance(got, (dict, list)) else f" (got {_short(got)})"
    return f"{where}: {reason}{shown}"


def _path(loc: list[Any]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _short(value: Any) -> str:
    text = orjson.dumps(value).decode() if _jsonable(value) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _jsonable(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


def _peek(data: bytes | bytearray | str) -> tuple[str | None, str | None]:
    # Only on the error path: the type and id, so the error can name them and
    # the receiver can still ack the request with the reason.
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None, None
    if not isinstance(obj, dict):
        return None, None
    t, i = obj.get("type"), obj.get("id")
    return (t if isinstance(t, str) else None), (i if isinstance(i, str) else None)
