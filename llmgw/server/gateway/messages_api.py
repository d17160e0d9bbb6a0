"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) over engines
that speak OpenAI chat completions (llama-server, vLLM, SGLang), and the replies back.

Pure: bodies in, bodies and SSE bytes out; the routes do the I/O. The shapes follow the
`anthropic` SDK's types (Message, the raw stream events, Usage, ModelInfo) and its stream
accumulator, which is what the tests read them with.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

import orjson

from llmgw.errors import LlmgwError
from llmgw.server.gateway.checks import INT_MAX, whole

JSON = dict[str, Any]

# Blocks an engine has no use for: a local model's reasoning is not replayed to it.
_DROPPED_BLOCKS = frozenset({"thinking", "redacted_thinking"})
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
    # The SDK's GatewayTimeoutErrorObject: Anthropic answers 504 with timeout_error.
    504: "timeout_error",
    529: "overloaded_error",
}


class EngineReplyError(LlmgwError):
    """The engine's chat completion holds no message to translate (no choices[0].message)."""


class _MessagesRefused(LlmgwError):
    """Unwinds the request parsing to translate_request, which answers a MessagesRefusal."""


@dataclass(frozen=True, slots=True)
class MessagesRefusal:
    status: int
    message: str  # says what was wrong and how to fix it
    type: str  # Anthropic error type, e.g. "invalid_request_error"


@dataclass(slots=True)
class MessagesRequest:
    chat: JSON  # the chat-completions body to send to the engine
    turn: list[JSON]  # chat-format messages of this request's own `messages` (system excluded)
    system: str | None
    stream: bool
    model: str
    message_id: str
    max_tokens: int


# --- requests ---------------------------------------------------------------------------


def translate_request(body: object) -> MessagesRequest | MessagesRefusal:
    try:
        chat, system, turn, raw = _translate(body)
        max_tokens = whole(raw.get("max_tokens"))
        if max_tokens is None or max_tokens < 1:
            raise _MessagesRefused(
                f"max_tokens is required: a whole number from 1 to {INT_MAX}, the most tokens the reply may have"
            )
        chat["max_tokens"] = max_tokens
        _options(raw, chat)
        stream = raw.get("stream", False)
        if not isinstance(stream, bool):
            raise _MessagesRefused("stream must be true or false")
    except _MessagesRefused as e:
        return MessagesRefusal(400, str(e), "invalid_request_error")
    if stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return MessagesRequest(
        chat=chat,
        turn=turn,
        system=system,
        stream=stream,
        model=chat["model"],
        message_id="msg_" + secrets.token_hex(12),
        max_tokens=max_tokens,
    )


def translate_count_tokens(body: object) -> JSON | MessagesRefusal:
    """The chat-format {"model","messages","tools"?} a count_tokens request stands for (no max_tokens required there)."""
    try:
        chat, _, _, _ = _translate(body)
    except _MessagesRefused as e:
        return MessagesRefusal(400, str(e), "invalid_request_error")
    return chat


def with_history(req: MessagesRequest, history: list[JSON]) -> None:
    """Put earlier chat-format messages before this turn, after the system message."""
    req.chat["messages"] = _system_messages(req.system) + list(history) + req.turn


def _translate(body: object) -> tuple[JSON, str | None, list[JSON], JSON]:
    """What /v1/messages and count_tokens share: model, system, messages and tools."""
    if not isinstance(body, dict):
        raise _MessagesRefused("the request body must be a JSON object with model, max_tokens and messages")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _MessagesRefused("model is required: the name of a model as GET /v1/models lists it")
    system = _system(body.get("system"))
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _MessagesRefused('messages is required: a non-empty list of {"role", "content"} objects')
    turn = [out for i, m in enumerate(messages) for out in _message(f"messages[{i}]", m)]
    chat: JSON = {"model": model, "messages": _system_messages(system) + turn}
    if body.get("mcp_servers"):
        raise _MessagesRefused(
            "mcp_servers is not supported: llmgw connects to no MCP servers; run them in your client"
        )
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    return chat, system, turn, body


def _system_messages(system: str | None) -> list[JSON]:
    return [] if system is None else [{"role": "system", "content": system}]


def _system(raw: object) -> str | None:
    if raw is None:
        return None
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list):
        texts = []
        for i, block in enumerate(raw):
            if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
                raise _MessagesRefused(f'system[{i}] must be a text block {{"type": "text", "text": ...}}')
            texts.append(block["text"])  # cache_control is Anthropic's prompt caching: engines cache by prefix
        return "\n\n".join(texts)
    raise _MessagesRefused("system must be a string or a list of text blocks")


def _message(where: str, m: object) -> list[JSON]:
    if not isinstance(m, dict):
        raise _MessagesRefused(f'{where} must be an object with "role" and "content"')
    role = m.get("role")
    if role not in ("user", "assistant"):
        raise _MessagesRefused(
            f'{where}.role must be "user" or "assistant", not {role!r}; system text goes in the top-level system field'
        )
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise _MessagesRefused(f"{where}.content must be a string or a list of content blocks")
    blocks = [(f"{where}.content[{j}]", _block(f"{where}.content[{j}]", b)) for j, b in enumerate(content)]
    return _user(blocks) if role == "user" else [_assistant(blocks)]


def _block(at: str, block: object) -> JSON:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise _MessagesRefused(f'{at} must be a content block: an object with a "type"')
    return block


def _unsupported(at: str, kind: str, role: str) -> _MessagesRefused:
    if kind == "image":
        return _MessagesRefused(f"{at} is an image block in an {role} message; images go in user messages")
    return _MessagesRefused(
        f"{at} is a {kind!r} block, which the chat-completions engines behind llmgw cannot take "
        "(no documents, search results or server tools); send its content as text blocks instead"
    )


def _user(blocks: list[tuple[str, JSON]]) -> list[JSON]:
    # Tool results answer the assistant's calls, so they come first as `tool` messages, the
    # message's own text and images after them: the order chat templates expect.
    tools: list[JSON] = []
    parts: list[JSON] = []
    for at, block in blocks:
        kind = block["type"]
        if kind == "text":
            parts.append({"type": "text", "text": _text(at, block)})
        elif kind == "image":
            parts.append(_image(at, block))
        elif kind == "tool_result":
            message, images = _tool_result(at, block)
            tools.append(message)
            parts.extend(images)
        elif kind not in _DROPPED_BLOCKS:
            raise _unsupported(at, kind, "user")
    if parts or not tools:
        tools.append({"role": "user", "content": _user_content(parts)})
    return tools


def _user_content(parts: list[JSON]) -> str | list[JSON]:
    if all(p["type"] == "text" for p in parts):
        return "\n\n".join(p["text"] for p in parts)
    return parts


def _text(at: str, block: JSON) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise _MessagesRefused(f"{at}.text must be a string")
    return text


def _image(at: str, block: JSON) -> JSON:
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source, dict):
        media, data = source.get("media_type"), source.get("data")
        if not isinstance(media, str) or not isinstance(data, str):
            raise _MessagesRefused(f"{at}.source needs media_type and data (base64) strings")
        url = f"data:{media};base64,{data}"
    elif kind == "url" and isinstance(source, dict) and isinstance(source.get("url"), str):
        url = source["url"]
    else:
        raise _MessagesRefused(
            f'{at}.source must be {{"type": "base64", "media_type", "data"}} or {{"type": "url", "url"}}'
        )
    return {"type": "image_url", "image_url": {"url": url}}


def _tool_result(at: str, block: JSON) -> tuple[JSON, list[JSON]]:
    """The `tool` message, and the result's images (a tool message holds text only: they
    go to the user message that follows)."""
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise _MessagesRefused(f"{at}.tool_use_id is required: the id of the tool_use block this answers")
    content = block.get("content")
    images: list[JSON] = []
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts = []
        for j, raw in enumerate(content):
            inner = _block(f"{at}.content[{j}]", raw)
            if inner["type"] == "text":
                texts.append(_text(f"{at}.content[{j}]", inner))
            elif inner["type"] == "image":
                images.append(_image(f"{at}.content[{j}]", inner))
            else:
                raise _unsupported(f"{at}.content[{j}]", inner["type"], "user")
        text = "\n\n".join(texts)
    else:
        raise _MessagesRefused(f"{at}.content must be a string or a list of text blocks")
    if block.get("is_error") is True:
        text = "Error: " + text
    return {"role": "tool", "tool_call_id": call_id, "content": text}, images


def _assistant(blocks: list[tuple[str, JSON]]) -> JSON:
    texts: list[str] = []
    calls: list[JSON] = []
    for at, block in blocks:
        kind = block["type"]
        if kind == "text":
            texts.append(_text(at, block))
        elif kind == "tool_use":
            call_id, name, args = block.get("id"), block.get("name"), block.get("input", {})
            if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(args, dict):
                raise _MessagesRefused(f"{at} needs an id and a name (strings) and an input object")
            calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": _arguments(args)}})
        elif kind not in _DROPPED_BLOCKS:
            raise _unsupported(at, kind, "assistant")
    return _chat_reply("\n\n".join(texts), calls)


def _arguments(args: JSON) -> str:
    # An input we kept as {"_raw": text} (see _tool_input) goes back as the model wrote it.
    if len(args) == 1 and isinstance(args.get("_raw"), str):
        return str(args["_raw"])
    return orjson.dumps(args).decode()


def _chat_reply(text: str, calls: list[JSON]) -> JSON:
    # Chat completions' convention: content is null beside tool calls when there is no text.
    message: JSON = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    return message


def _tools(raw: object) -> list[JSON]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise _MessagesRefused("tools must be a list of tool definitions")
    out = []
    for i, tool in enumerate(raw):
        at = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _MessagesRefused(f"{at} must be an object with name, description and input_schema")
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise _MessagesRefused(
                f"{at} is Anthropic's server tool {kind!r}; the engines behind llmgw run no server-side tools. "
                "Define it as a custom tool (name, description, input_schema) and run it in your client"
            )
        name, schema, description = tool.get("name"), tool.get("input_schema"), tool.get("description")
        if not isinstance(name, str) or not name:
            raise _MessagesRefused(f"{at}.name is required: the tool's name as a string")
        if not isinstance(schema, dict):
            raise _MessagesRefused(f"{at}.input_schema is required: a JSON Schema object for the tool's input")
        function: JSON = {"name": name, "parameters": schema}
        if isinstance(description, str) and description:
            function["description"] = description
        out.append({"type": "function", "function": function})
    return out


def _options(body: JSON, chat: JSON) -> None:
    for name in ("temperature", "top_p"):
        value = body.get(name)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise _MessagesRefused(f"{name} must be a number")
            chat[name] = value
    if body.get("top_k") is not None:
        top_k = whole(body["top_k"])
        if top_k is None or top_k < 0:
            raise _MessagesRefused("top_k must be a whole number of at least 0")
        chat["top_k"] = top_k  # not OpenAI's, but llama-server, vLLM and SGLang all read it
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise _MessagesRefused("stop_sequences must be a list of strings")
        if stops:
            chat["stop"] = stops
    metadata = body.get("metadata")
    if isinstance(metadata, dict) and isinstance(metadata.get("user_id"), str):
        chat["user"] = metadata["user_id"]
    # `thinking` is not refused and not sent: whether and how long a local model reasons is
    # its chat template's and its engine's business.
    _tool_choice(body.get("tool_choice"), chat)


def _tool_choice(raw: object, chat: JSON) -> None:
    if raw is None:
        return
    kind = raw.get("type") if isinstance(raw, dict) else None
    choice: object
    if kind == "auto":
        choice = "auto"
    elif kind == "any":
        choice = "required"
    elif kind == "none":
        choice = "none"
    elif kind == "tool" and isinstance(raw, dict) and isinstance(raw.get("name"), str):
        choice = {"type": "function", "function": {"name": raw["name"]}}
    else:
        raise _MessagesRefused(
            'tool_choice must be {"type": "auto"}, {"type": "any"}, {"type": "none"} or {"type": "tool", "name": ...}'
        )
    if "tools" not in chat:
        if kind in ("any", "tool"):
            raise _MessagesRefused(f"tool_choice {kind!r} needs tools to choose from: add them to tools")
        return  # auto or none over no tools means nothing, and some engines refuse it
    chat["tool_choice"] = choice
    if isinstance(raw, dict) and raw.get("disable_parallel_tool_use") is True:
        chat["parallel_tool_calls"] = False


# --- replies ----------------------------------------------------------------------------


def render_message(req: MessagesRequest, completion: dict[str, Any]) -> tuple[JSON, list[JSON]]:
    """The engine's chat.completion JSON -> (Anthropic Message object, chat-format messages the reply adds)."""
    choices = completion.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else None
    message = choice.get("message") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or not isinstance(message, dict):
        raise EngineReplyError("the engine's chat completion has no choices[0].message")
    content: list[JSON] = []
    reasoning = _reasoning(message)
    if reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    text = _content_text(message.get("content"))
    if text:
        content.append({"type": "text", "text": text})
    calls: list[JSON] = []
    for call in message.get("tool_calls") or []:
        if not isinstance(call, dict):
            continue
        function = call.get("function") or {}
        call_id = call.get("id") or _tool_id()
        name = function.get("name") or ""
        args = function.get("arguments")
        args_text = args if isinstance(args, str) else orjson.dumps(args or {}).decode()
        content.append({"type": "tool_use", "id": call_id, "name": name, "input": _tool_input(args_text)})
        calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": args_text}})
    stop_reason, stop_sequence = _stop(choice.get("finish_reason"), choice, req, bool(calls))
    reply = {
        "id": req.message_id,
        "type": "message",
        "role": "assistant",
        "model": req.model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": _usage(completion.get("usage")),
    }
    return reply, [_chat_reply(text, calls)]


def _reasoning(message: JSON) -> str:
    # llama-server and older vLLM say reasoning_content, newer vLLM reasoning.
    value = message.get("reasoning_content") or message.get("reasoning")
    return value if isinstance(value, str) else ""


def _content_text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _tool_input(args: str) -> JSON:
    # A tool_use input is an object. Arguments that parse to none are kept as {"_raw": text}
    # rather than dropped to {}: the client's tool then fails on what the model really wrote,
    # and _arguments sends the text back unchanged when the client replays the call.
    if not args.strip():
        return {}
    try:
        parsed = orjson.loads(args)
    except orjson.JSONDecodeError:
        return {"_raw": args}
    return parsed if isinstance(parsed, dict) else {"_raw": args}


def _tool_id() -> str:
    return "toolu_" + secrets.token_hex(12)


def _stop(finish: object, choice: JSON, req: MessagesRequest, called: bool) -> tuple[str, str | None]:
    if finish == "length":
        return "max_tokens", None
    # Some engines end a turn of tool calls with "stop"; clients loop on tool_use, so the calls decide.
    if finish == "tool_calls" or called:
        return "tool_use", None
    if finish == "stop":
        # vLLM names the stop string that matched in stop_reason, SGLang in matched_stop;
        # llama-server says nothing, and that reads as end_turn.
        matched = choice.get("stop_reason") or choice.get("matched_stop")
        if isinstance(matched, str) and matched in (req.chat.get("stop") or []):
            return "stop_sequence", matched
    return "end_turn", None


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _usage(raw: object) -> JSON:
    usage = raw if isinstance(raw, dict) else {}
    details = usage.get("prompt_tokens_details")
    cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else 0
    prompt = _count(usage.get("prompt_tokens"))
    # Anthropic's input_tokens leaves out cache reads (the SDK: total input is input_tokens +
    # cache_creation_input_tokens + cache_read_input_tokens); OpenAI's prompt_tokens includes them.
    return {
        "input_tokens": max(prompt - cached, 0),
        "output_tokens": _count(usage.get("completion_tokens")),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


# --- streaming --------------------------------------------------------------------------


def _sse(event: str, data: JSON) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


@dataclass(slots=True)
class _ToolCall:
    id: str = ""
    name: str = ""
    args: list[str] = field(default_factory=list)
    block: int | None = None  # its content block's index, once started


class MessageStream:
    """Chat-completion chunks in, Anthropic's stream events out, one content block open at a time."""

    def __init__(self, req: MessagesRequest) -> None:
        self._req = req
        self._index = -1  # the latest block's index
        self._open: str | None = None  # "thinking", "text" or "tool_use" while a block is open
        self._text: list[str] = []
        self._tools: dict[int, _ToolCall] = {}  # by the engine's tool_calls index
        self._finish: object = None
        self._choice: JSON = {}  # the choice that carried finish_reason (for the matched stop)
        self._usage: JSON | None = None
        self._done = False

    def start(self) -> bytes:
        # input_tokens is known only at the end; the SDK takes message_delta's usage over this one's.
        message: JSON = {
            "id": self._req.message_id,
            "type": "message",
            "role": "assistant",
            "model": self._req.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
        return _sse("message_start", {"type": "message_start", "message": message}) + _sse("ping", {"type": "ping"})

    def feed(self, chunk: dict[str, Any]) -> bytes:
        """One parsed chat.completion.chunk -> SSE bytes (may be b"")."""
        if self._done:
            return b""
        if isinstance(chunk.get("usage"), dict):
            self._usage = chunk["usage"]
        out: list[bytes] = []
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue  # the Messages API has one reply; n > 1 is not asked for
            delta = choice.get("delta") or {}
            reasoning = _reasoning(delta)
            if reasoning:
                if self._open != "thinking":
                    out.append(self._start_block({"type": "thinking", "thinking": "", "signature": ""}))
                out.append(self._delta({"type": "thinking_delta", "thinking": reasoning}))
            text = delta.get("content")
            if isinstance(text, str) and text:
                if self._open != "text":
                    out.append(self._start_block({"type": "text", "text": ""}))
                out.append(self._delta({"type": "text_delta", "text": text}))
                self._text.append(text)
            out.extend(self._tool_delta(call) for call in delta.get("tool_calls") or [] if isinstance(call, dict))
            if choice.get("finish_reason"):
                self._finish, self._choice = choice["finish_reason"], choice
        return b"".join(out)

    def finish(self, usage: dict[str, Any] | None) -> bytes:
        """Close the open block, then message_delta (stop reason, usage) and message_stop."""
        if self._done:
            return b""
        out = [self._start_tool(call) for call in self._calls() if call.block is None]  # never named: still the model's
        out.append(self._close())
        self._done = True
        stop_reason, stop_sequence = _stop(self._finish, self._choice, self._req, bool(self._tools))
        raw = usage if usage is not None else self._usage
        # Without usage the counts are unknown: output_tokens is required, input_tokens is left out.
        counts = _usage(raw) if raw is not None else {"output_tokens": 0}
        delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        out.append(_sse("message_delta", {"type": "message_delta", "delta": delta, "usage": counts}))
        out.append(_sse("message_stop", {"type": "message_stop"}))
        return b"".join(out)

    def fail(self, message: str) -> bytes:
        """The engine's stream broke: an `error` event, which the SDK raises as an APIStatusError."""
        self._done = True
        return _sse("error", {"type": "error", "error": {"type": "api_error", "message": message}})

    def reply_messages(self) -> list[JSON]:
        calls = []
        for call in self._calls():
            call.id = call.id or _tool_id()
            calls.append(
                {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": "".join(call.args)}}
            )
        return [_chat_reply("".join(self._text), calls)]

    def _calls(self) -> list[_ToolCall]:
        return [self._tools[i] for i in sorted(self._tools)]

    def _start_block(self, block: JSON) -> bytes:
        closed = self._close()
        self._index += 1
        self._open = block["type"]
        return closed + _sse(
            "content_block_start", {"type": "content_block_start", "index": self._index, "content_block": block}
        )

    def _delta(self, delta: JSON) -> bytes:
        return _sse("content_block_delta", {"type": "content_block_delta", "index": self._index, "delta": delta})

    def _close(self) -> bytes:
        if self._open is None:
            return b""
        # Anthropic ends a thinking block with its signature; local models have none to give.
        closing = self._delta({"type": "signature_delta", "signature": ""}) if self._open == "thinking" else b""
        self._open = None
        return closing + _sse("content_block_stop", {"type": "content_block_stop", "index": self._index})

    def _tool_delta(self, delta: JSON) -> bytes:
        index = delta.get("index", 0)
        call = self._tools.setdefault(index if isinstance(index, int) else 0, _ToolCall())
        function = delta.get("function") or {}
        if isinstance(delta.get("id"), str) and not call.id:
            call.id = delta["id"]
        if isinstance(function.get("name"), str) and not call.name:
            call.name = function["name"]
        fragment = function.get("arguments")
        fragment = fragment if isinstance(fragment, str) else ""
        call.args.append(fragment)
        if call.block is None:
            # content_block_start must carry the name: arguments before it wait in call.args.
            return self._start_tool(call) if call.name else b""
        if fragment and call.block == self._index and self._open == "tool_use":
            return self._delta({"type": "input_json_delta", "partial_json": fragment})
        # Fragments of a call whose block is closed (engines send calls one after another, so
        # this is not seen) cannot be streamed; reply_messages still has them.
        return b""

    def _start_tool(self, call: _ToolCall) -> bytes:
        call.id = call.id or _tool_id()
        out = self._start_block({"type": "tool_use", "id": call.id, "name": call.name, "input": {}})
        call.block = self._index
        buffered = "".join(call.args)
        if buffered:
            out += self._delta({"type": "input_json_delta", "partial_json": buffered})
        return out


# --- other bodies -----------------------------------------------------------------------


def error_type(status: int) -> str:
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def error_body(status: int, message: str) -> bytes:
    """Anthropic's error shape: {"type":"error","error":{"type": <by status>, "message": ...}}."""
    return orjson.dumps({"type": "error", "error": {"type": error_type(status), "message": message}})


def count_response(input_tokens: int) -> bytes:
    return orjson.dumps({"input_tokens": input_tokens})


def models_page(models: list[dict[str, Any]]) -> bytes:
    """GET /v1/models in Anthropic's shape, one page (has_more false) for the SDK's models.list()."""
    data = []
    for model in models:
        entry: JSON = {
            "type": "model",
            "id": model["id"],
            "display_name": model["id"],
            "created_at": "1970-01-01T00:00:00Z",  # the epoch: the SDK's way of saying the date is unknown
            "lifecycle": "active",  # required by the SDK's ModelInfo
        }
        for ours, theirs in (("context_length", "max_input_tokens"), ("max_output", "max_tokens")):
            known = whole(model.get(ours))
            if known is not None:
                entry[theirs] = known
        data.append(entry)
    return orjson.dumps(
        {
            "data": data,
            "has_more": False,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
        }
    )
