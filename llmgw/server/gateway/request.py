"""What a client asked for, read from its parsed body once: the model, the stream flag, the
output limit; and the per-request context the proxy carries from there to the usage row.

read_request is the one place a body is checked before it is forwarded. It waits on nothing
and touches no state but the body it is given, which it rewrites in place into what the
engine is to be sent (the body was parsed for this request alone; copying it would cost a
dict per request for nothing).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from llmgw.errors import LlmgwError
from llmgw.server.gateway.checks import whole
from llmgw.server.gateway.limits import Reservation
from llmgw.server.gateway.principal import ANONYMOUS, Principal


@dataclass(frozen=True, slots=True)
class Route:
    """One OpenAI route: its upstream path and what its body must hold."""

    name: str
    path: str  # the engine's route it is sent to
    required: str  # the field without which the request makes no sense
    streams: bool
    kind: str = ""  # the engine API it speaks (chat, completions, embeddings): its name, unless translated
    # A max_tokens above the model's limit is lowered to it (said in OUTPUT_CLAMPED_HEADER) rather
    # than refused: the agents' routes, whose clients send a fixed large one on every turn.
    clamps: bool = False
    anthropic: bool = False  # errors in Anthropic's shape (errors.py)

    def __post_init__(self) -> None:
        if not self.kind:
            object.__setattr__(self, "kind", self.name)


CHAT = Route("chat", "/v1/chat/completions", "messages", True)
COMPLETIONS = Route("completions", "/v1/completions", "prompt", True)
EMBEDDINGS = Route("embeddings", "/v1/embeddings", "input", False)
# Translated to chat completions and back (responses_api.py, messages_api.py).
RESPONSES = Route("responses", "/v1/chat/completions", "messages", True, kind="chat", clamps=True)
MESSAGES = Route("messages", "/v1/chat/completions", "messages", True, kind="chat", clamps=True, anthropic=True)

# Set on a reply whose max_tokens was lowered to what the model allows: "ASKED->ALLOWED".
OUTPUT_CLAMPED_HEADER = "X-Llmgw-Max-Tokens-Clamped"


@dataclass(frozen=True, slots=True)
class ServedModel:
    name: str
    aliases: tuple[str, ...]
    description: str | None
    max_output: int | None
    managed: bool = False  # run by the control plane: it may have to be loaded first
    context_length: int | None = None  # tokens of prompt and output one request may hold, when known


@dataclass(frozen=True, slots=True)
class Refusal:
    """A request refused before it reaches an engine: the client's error, as error_response takes it."""

    status: int
    message: str
    code: str
    param: str | None
    model: str  # the served model, for the request counter's label: "" before one is known


@dataclass(slots=True)
class Call:
    """One client request as the proxy carries it, from its body to its usage row.

    Made once per request, by read_request; the proxy adds who sent it, its bytes and when it
    began, and the reservation once the limits let it through. Slots, not pydantic: this is
    the request path, and the one object made for it costs about 0.15 µs.
    """

    route: Route
    served: ServedModel
    asked: str  # the name the client asked for (an alias, say): what its answer shows
    body: dict
    changed: bool  # body differs from the bytes received: re-encode it before sending
    stream: bool
    client_wants_usage: bool  # else the usage event the engine is asked for is stripped
    out_limit: int | None  # the output limit the client gave, as _output_limit read it
    # Sequences the engine generates, each up to out_limit: choices per prompt (n, n_cmpl, best_of)
    # times the prompts of a completions request. What the estimate and the settlement multiply.
    outputs: int = 1
    prompts: int = 1  # prompts the engine reads: a completions request may send several
    prompt_ids: int = 0  # token ids given as such (a prompt or input of token arrays): the prompt's floor
    min_out: int = 0  # vLLM's min_tokens: output each sequence makes at least, whatever the limit's default
    principal: Principal = ANONYMOUS
    raw: bytes = b""
    t0: float = 0.0  # perf_counter when the request arrived
    res: Reservation | None = None
    clamped: tuple[int, int] | None = None  # (asked, allowed) when a clamping route lowered max_tokens
    reply: Any = None  # a translated route's Reply (agent_apis.py): how the engine's answer is written back


def prompt_estimate(raw: bytes) -> int:
    """Prompt tokens before the engine says: about four bytes of request JSON a token."""
    return len(raw) // 4


def read_request(
    route: Route, body: object, models: Mapping[str, ServedModel], prompt_estimate: int | None = None
) -> Call | Refusal:
    """Check a parsed request body for ``route``; the request to forward, or why it is refused.

    ``models`` maps every served name and alias to its model. The body is rewritten in place
    where the engine must be sent something else: output limits as whole numbers, a max_tokens
    under a model's max_output, and include_usage asked on every stream (so its tokens are
    counted), which is stripped from the answer again when the client did not ask for it.
    On a clamping route a max_tokens above the limit is lowered to it instead of refused; the
    limit there is also what the context leaves after ``prompt_estimate`` tokens, when the
    model's context length is known.
    """
    if not isinstance(body, dict):
        return Refusal(400, "the request body should be a JSON object", "invalid_request", None, "")
    name = body.get("model")
    if not isinstance(name, str) or not name:
        return Refusal(
            400, "'model' is required: the name of a model from GET /v1/models", "missing_field", "model", ""
        )
    served = models.get(name)
    if served is None:
        return Refusal(
            404,
            f"The model '{name}' does not exist; GET /v1/models lists the models you can use",
            "model_not_found",
            "model",
            "",
        )
    if route.required not in body:
        return Refusal(
            400, f"'{route.required}' is required for {route.path}", "missing_field", route.required, served.name
        )
    if route.kind == "chat" and (not isinstance(body["messages"], list) or not body["messages"]):
        return Refusal(
            400, "'messages' should be a non-empty list of messages", "invalid_request", "messages", served.name
        )
    stream = body.get("stream", False) if route.streams else False
    if not isinstance(stream, bool):
        return Refusal(400, "'stream' should be true or false", "invalid_request", "stream", served.name)
    out_limit: int | None = None
    changed = False
    clamped: tuple[int, int] | None = None
    if route.streams:  # the routes that generate; embeddings have no output to cap
        cap = served.max_output
        if route.clamps and prompt_estimate is not None and served.context_length is not None:
            # What the context leaves after the prompt: an engine refuses (vLLM) or cuts short
            # (llama.cpp) a request whose prompt and output do not fit.
            room = max(1, served.context_length - prompt_estimate)
            cap = room if cap is None else min(cap, room)
        try:
            out_limit, changed, clamped = _output_limit(body, cap, route.clamps)
        except _BadField as exc:
            return Refusal(400, exc.message, exc.code, exc.field, served.name)
    outputs = prompts = 1
    prompt_ids = min_out = 0
    try:
        if route.streams:
            outputs = _sequences(body)
            min_out = _min_output(body)
        if route.kind == "completions":
            prompts, prompt_ids = _inputs(body["prompt"])
            outputs *= prompts
        elif route.kind == "embeddings":
            prompt_ids = _inputs(body["input"])[1]
    except _BadField as exc:
        return Refusal(400, exc.message, exc.code, exc.field, served.name)
    client_wants_usage = True
    if stream:
        opts = body.get("stream_options")
        if opts is None:
            opts = {}
        elif not isinstance(opts, dict):
            return Refusal(
                400, "'stream_options' should be an object", "invalid_request", "stream_options", served.name
            )
        client_wants_usage = opts.get("include_usage") is True
        if not client_wants_usage:
            body["stream_options"] = {**opts, "include_usage": True}
            changed = True
    call = Call(route, served, name, body, changed, stream, client_wants_usage, out_limit)
    call.clamped = clamped
    call.outputs, call.prompts, call.prompt_ids, call.min_out = outputs, prompts, prompt_ids, min_out
    return call


def _min_output(body: dict) -> int:
    """vLLM's min_tokens (0 when not given): the output it makes before it may stop, read as the
    output limits are; _BadField for anything but a whole number of 0 or more."""
    v = body.get("min_tokens")
    if v is None:
        return 0
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        shown = orjson.dumps(v).decode()[:40]
        raise _BadField(
            "min_tokens", f"'min_tokens' is {shown}; give a whole number of tokens of 0 or more, or leave it out"
        )
    return v


# The fields that ask an engine for several sequences from one prompt: OpenAI's n, llama.cpp's own
# name for it (which llama.cpp prefers to n), and best_of (sequences generated server-side, of which
# n are returned: vLLM's completions, and its beam search's width). The engine generates the largest.
_SEQUENCE_FIELDS = ("n", "n_cmpl", "best_of")

# The most sequences one request may ask for: OpenAI's own limit on n. A request's estimate is what
# a budget may be overspent by; without a ceiling a client would choose that overspend.
MAX_SEQUENCES = 128


def _sequences(body: dict) -> int:
    """How many sequences a generating request asks for (the largest of _SEQUENCE_FIELDS, 1 when
    none is given); _BadField for a value that is not a whole number from 1 to MAX_SEQUENCES."""
    largest = 1
    for field in _SEQUENCE_FIELDS:
        v = body.get(field)
        if v is None:
            continue
        if isinstance(v, float) and v.is_integer():
            v = int(v)  # as the engines read it (JSON has one number type)
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_SEQUENCES:
            shown = orjson.dumps(v).decode()[:40]
            raise _BadField(
                field,
                f"'{field}' is {shown}; give a whole number of choices from 1 to {MAX_SEQUENCES}, "
                "or leave it out for one (each choice is generated, and charged, in full)",
            )
        largest = max(largest, v)
    return largest


def _inputs(value: object) -> tuple[int, int]:
    """(prompts, token ids) in a completions prompt or an embeddings input: a string or a list of
    token ids is one; a list of strings or of token-id lists is one each. Engines refuse other shapes
    themselves; whatever they are, the request's bytes still estimate them."""
    if not isinstance(value, list) or not value:
        return 1, 0
    if all(isinstance(x, int) for x in value):
        return 1, len(value)
    return len(value), sum(len(x) for x in value if isinstance(x, list))


# What a request asks an engine to generate at most, by every name engines read it under:
# OpenAI's two and llama.cpp's own (which llama.cpp prefers over the others).
_OUTPUT_FIELDS = ("max_tokens", "max_completion_tokens", "n_predict")


class _BadField(LlmgwError):
    """A field of the request the gateway cannot read: refused with 400, naming it."""

    def __init__(self, field: str, message: str, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.field = field
        self.message = message
        self.code = code


def _output_limit(body: dict, cap: int | None, clamp: bool = False) -> tuple[int | None, bool, tuple[int, int] | None]:
    """Read the request's output limit, the same way for each of _OUTPUT_FIELDS; returns it
    (the largest given, None when none is), whether the body was changed, and (asked, cap)
    when ``clamp`` lowered a limit above the cap to it.

    A whole number is read as such, 200.0 included (and sent on as 200, so the engine reads
    what the gateway read); null is "not given". Anything else (200.5, a negative number, a
    string, true/false) raises _BadField, as does a value above ``cap`` (the model's
    max_output). With a cap, the engine is always sent a max_tokens, which every engine
    reads: the cap when no limit was given, else the client's own n_predict (an engine that
    does not know n_predict would otherwise run on to its context).
    """
    largest: int | None = None
    changed = False
    openai_named = False
    clamped: tuple[int, int] | None = None
    for field in _OUTPUT_FIELDS:
        v = body.get(field)
        if v is None:
            continue
        n = whole(v)
        if n is None:
            shown = orjson.dumps(v).decode()[:40]
            raise _BadField(field, f"'{field}' should be a whole number of tokens, not {shown}")
        if n is not v:
            v = body[field] = n  # 200.0 is sent on as 200, so the engine reads what the gateway read
            changed = True
        if v < 0:
            raise _BadField(field, f"'{field}' is {v}; give a number of tokens of 0 or more, or leave it out")
        if cap is not None and v > cap and clamp:
            clamped = (max(v, clamped[0]) if clamped else v, cap)
            v = body[field] = cap
            changed = True
        elif cap is not None and v > cap:
            raise _BadField(
                field,
                f"{field} is {v}, but this model allows at most {cap}; ask for {cap} or "
                "fewer, or leave it out to get up to that",
                "max_tokens_too_large",
            )
        if field != "n_predict":
            openai_named = True
        if largest is None or v > largest:
            largest = v
    if cap is not None and not openai_named:
        largest = cap if largest is None else largest
        body["max_tokens"] = largest
        changed = True
    return largest, changed, clamped
