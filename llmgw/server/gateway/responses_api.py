"""The OpenAI Responses API (`POST /v1/responses`), translated to chat completions and back.

Every engine llmgw runs (llama-server, vLLM, SGLang) speaks chat completions; Codex and newer
OpenAI clients speak Responses. This module turns a Responses request into a chat request, a
chat completion into a Response object, and a stream of chat chunks into the Responses event
stream, with the shapes the openai SDK parses. Pure: no I/O and no store; the gateway sends,
stores and streams what it returns.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any

import orjson

from llmgw.errors import LlmgwError

_TOOL_CHOICE_MODES = ("auto", "none", "required")
_TEXT_PARTS = ("input_text", "output_text", "text")
_DEFAULT_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
_PART_EVENTS = {"reasoning": "response.reasoning_text", "message": "response.output_text"}  # by item type


@dataclass(frozen=True, slots=True)
class ResponsesRefusal:
    """A request refused before any engine sees it (HTTP 400 unless said)."""

    status: int
    message: str  # says what was wrong and how to fix it
    code: str
    param: str | None


@dataclass(slots=True)
class ResponsesRequest:
    chat: dict[str, Any]  # the chat-completions body to send
    turn: list[dict[str, Any]]  # chat messages this request's input added (instructions excluded)
    instructions: str | None
    previous_response_id: str | None
    store: bool | None
    stream: bool
    model: str
    response_id: str
    created_at: int
    request_echo: dict[str, Any]  # the request fields a Response object echoes
    custom_tools: frozenset[str]  # names of free-form custom tools: their calls go back as custom_tool_call


class _ResponsesRefused(LlmgwError):
    """Raised while translating so that a refusal leaves from any depth; translate_request returns it."""

    def __init__(self, message: str, param: str | None, code: str = "invalid_value", status: int = 400) -> None:
        super().__init__(message)
        self.refusal = ResponsesRefusal(status=status, message=message, code=code, param=param)


def _hex_id(prefix: str) -> str:
    return prefix + secrets.token_hex(16)


def _json_kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object" if isinstance(value, dict) else type(value).__name__


def _take(obj: dict[str, Any], key: str, kind: type | tuple[type, ...], what: str, where: str | None = None) -> Any:
    """obj[key] when present and of the kind asked (None when absent or null), else a refusal."""
    value = obj.get(key)
    if value is None:
        return None
    kinds = kind if isinstance(kind, tuple) else (kind,)
    # bool is an int to Python but not a number to a JSON client.
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        param = f"{where}.{key}" if where else key
        raise _ResponsesRefused(f"{param} must be {what}; got {_json_kind(value)}", param, "invalid_type")
    return value


def _need(obj: dict[str, Any], key: str, kind: type, what: str, where: str | None = None) -> Any:
    value = _take(obj, key, kind, what, where)
    if value is None:
        param = f"{where}.{key}" if where else key
        raise _ResponsesRefused(f"{param} is required: {what}", param, "missing_required_parameter")
    return value


def translate_request(body: object) -> ResponsesRequest | ResponsesRefusal:
    try:
        return _translate(body)
    except _ResponsesRefused as refused:
        return refused.refusal


def _translate(body: object) -> ResponsesRequest:
    if not isinstance(body, dict):
        raise _ResponsesRefused(f"the request body must be a JSON object; got {_json_kind(body)}", None, "invalid_type")
    model = _need(body, "model", str, "the name of a model, as GET /v1/models lists it")
    if body.get("input") is None:
        raise _ResponsesRefused(
            "input is required: a string, or a list of input items", "input", "missing_required_parameter"
        )
    if _take(body, "background", bool, "a boolean"):
        raise _ResponsesRefused(
            "background responses are not supported: llmgw keeps no response to poll later; send the request "
            "without background, streaming it if it is long",
            "background",
            "unsupported_parameter",
        )
    instructions = _take(body, "instructions", str, "a string")
    previous = _take(body, "previous_response_id", str, "a string")
    if previous is not None and not previous.startswith("resp_"):
        raise _ResponsesRefused(
            f"previous_response_id must be the id of an earlier response, starting with resp_; got {previous!r}",
            "previous_response_id",
        )
    store = _take(body, "store", bool, "a boolean")
    stream = bool(_take(body, "stream", bool, "a boolean"))

    chat_tools, custom, names = _tools(body.get("tools"))
    turn = _input_messages(body["input"])
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + turn
    chat: dict[str, Any] = {"model": model, "messages": messages}
    if chat_tools:
        chat["tools"] = chat_tools
    choice = _tool_choice(body.get("tool_choice"), names)
    if choice is not None:
        chat["tool_choice"] = choice
    _options(body, chat)
    if stream:
        chat["stream"] = True
        # Usage is what the final response.completed reports, so always ask for it.
        chat["stream_options"] = {"include_usage": True}
    return ResponsesRequest(
        chat=chat,
        turn=turn,
        instructions=instructions,
        previous_response_id=previous,
        store=store,
        stream=stream,
        model=model,
        response_id=_hex_id("resp_"),
        created_at=int(time.time()),
        request_echo=_echo(body, instructions, previous),
        custom_tools=custom,
    )


def _options(body: dict[str, Any], chat: dict[str, Any]) -> None:
    limit = _take(body, "max_output_tokens", int, "a whole number of tokens")
    if limit is not None:
        if limit < 1:
            raise _ResponsesRefused(f"max_output_tokens must be at least 1; got {limit}", "max_output_tokens")
        chat["max_tokens"] = limit
    for key, kind, what in (
        ("temperature", (int, float), "a number"),
        ("top_p", (int, float), "a number"),
        ("parallel_tool_calls", bool, "a boolean"),
        ("user", str, "a string"),
        ("seed", int, "a whole number"),
    ):
        value = _take(body, key, kind, what)
        if value is not None:
            chat[key] = value
    stop = body.get("stop")
    if stop is not None:
        if not (isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))):
            raise _ResponsesRefused(
                f"stop must be a string or a list of strings; got {_json_kind(stop)}", "stop", "invalid_type"
            )
        chat["stop"] = stop
    text = _take(body, "text", dict, "an object")
    fmt = _take(text, "format", dict, "an object", "text") if text else None
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_schema":
            schema = _need(fmt, "schema", dict, "a JSON schema object", "text.format")
            spec: dict[str, Any] = {"name": _take(fmt, "name", str, "a string", "text.format") or "response"}
            spec["schema"] = schema
            if fmt.get("strict") is not None:
                spec["strict"] = _take(fmt, "strict", bool, "a boolean", "text.format")
            chat["response_format"] = {"type": "json_schema", "json_schema": spec}
        elif kind == "json_object":
            chat["response_format"] = {"type": "json_object"}
        elif kind != "text":
            raise _ResponsesRefused(
                f"text.format.type must be text, json_schema or json_object; got {kind!r}", "text.format.type"
            )
    reasoning = _take(body, "reasoning", dict, "an object")
    effort = _take(reasoning, "effort", str, "a string", "reasoning") if reasoning else None
    if effort is not None:
        chat["reasoning_effort"] = effort


def _echo(body: dict[str, Any], instructions: str | None, previous: str | None) -> dict[str, Any]:
    metadata = _take(body, "metadata", dict, "an object of string values") or {}
    if not all(isinstance(v, str) for v in metadata.values()):
        raise _ResponsesRefused("metadata values must be strings", "metadata", "invalid_type")
    truncation = _take(body, "truncation", str, "auto or disabled") or "disabled"
    if truncation not in ("auto", "disabled"):
        raise _ResponsesRefused(f"truncation must be auto or disabled; got {truncation!r}", "truncation")
    return {
        "instructions": instructions,
        "previous_response_id": previous,
        "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice") or "auto",
        "parallel_tool_calls": _take(body, "parallel_tool_calls", bool, "a boolean") is not False,
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "max_output_tokens": body.get("max_output_tokens"),
        "text": body.get("text") or {"format": {"type": "text"}},
        "reasoning": body.get("reasoning"),
        "metadata": metadata,
        "truncation": truncation,
        "user": body.get("user"),
        "background": False,
    }


def _tools(value: object) -> tuple[list[dict[str, Any]], frozenset[str], set[str]]:
    if value is None:
        return [], frozenset(), set()
    if not isinstance(value, list):
        raise _ResponsesRefused(f"tools must be a list of tools; got {_json_kind(value)}", "tools", "invalid_type")
    chat_tools: list[dict[str, Any]] = []
    custom: set[str] = set()
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _ResponsesRefused(f"{where} must be an object; got {_json_kind(tool)}", where, "invalid_type")
        kind = tool.get("type")
        if kind not in ("function", "custom"):
            raise _ResponsesRefused(
                f"{where} is a {kind!r} tool, a tool OpenAI runs on its own servers; llmgw's engines run no "
                "server-side tools. Give the model function tools (type function) and run them in the client.",
                "tools",
                "unsupported_tool",
            )
        name = _need(tool, "name", str, "the tool's name", where)
        fn: dict[str, Any] = {"name": name}
        description = _take(tool, "description", str, "a string", where)
        if description is not None:
            fn["description"] = description
        if kind == "function":
            fn["parameters"] = _take(tool, "parameters", dict, "a JSON schema object", where) or _DEFAULT_PARAMETERS
            strict = _take(tool, "strict", bool, "a boolean", where)
            if strict is not None:
                fn["strict"] = strict
        else:
            fn["parameters"] = _custom_parameters(_take(tool, "format", dict, "an object", where), where)
            custom.add(name)
        chat_tools.append({"type": "function", "function": fn})
    return chat_tools, frozenset(custom), {t["function"]["name"] for t in chat_tools}


def _custom_parameters(fmt: dict[str, Any] | None, where: str) -> dict[str, Any]:
    """A free-form tool as a function of one string: chat engines call only JSON-argument functions."""
    described = "The tool's raw free-form input, exactly as the tool takes it (plain text, not JSON)."
    if fmt is not None and fmt.get("type") == "grammar":
        definition = _need(fmt, "definition", str, "the grammar's text", f"{where}.format")
        syntax = _take(fmt, "syntax", str, "a string", f"{where}.format") or "lark"
        described += f" It must match this {syntax} grammar:\n{definition}"
    return {
        "type": "object",
        "properties": {"input": {"type": "string", "description": described}},
        "required": ["input"],
    }


def _tool_choice(value: object, names: set[str]) -> str | dict[str, Any] | None:
    if value is None:
        return None
    if isinstance(value, str):
        if value not in _TOOL_CHOICE_MODES:
            raise _ResponsesRefused(
                f"tool_choice must be auto, none, required or a named tool; got {value!r}", "tool_choice"
            )
        return value
    if not isinstance(value, dict):
        raise _ResponsesRefused(
            f"tool_choice must be a string or an object; got {_json_kind(value)}", "tool_choice", "invalid_type"
        )
    kind = value.get("type")
    if kind not in ("function", "custom"):
        raise _ResponsesRefused(
            f"tool_choice names a {kind!r} tool; llmgw's engines run no server-side tools, so tool_choice may "
            "only be auto, none, required, or a function or custom tool given in tools",
            "tool_choice",
            "unsupported_tool",
        )
    name = _need(value, "name", str, "the name of a tool given in tools", "tool_choice")
    if name not in names:
        raise _ResponsesRefused(f"tool_choice names {name!r}, which is not among the tools given", "tool_choice.name")
    return {"type": "function", "function": {"name": name}}


def _input_messages(value: object) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise _ResponsesRefused(
            f"input must be a string or a list of items; got {_json_kind(value)}", "input", "invalid_type"
        )
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _ResponsesRefused(f"{where} must be an object; got {_json_kind(item)}", where, "invalid_type")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            out.append(_message(item, where))
        elif kind in ("function_call", "custom_tool_call"):
            call_id = _need(item, "call_id", str, "the call's id", where)
            name = _need(item, "name", str, "the tool's name", where)
            if kind == "function_call":
                arguments = _need(item, "arguments", str, "the call's JSON arguments as a string", where)
            else:
                arguments = _custom_arguments(_need(item, "input", str, "the call's input as a string", where))
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            # Calls of one reply are one assistant message in chat, with the text that came before them.
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id = _need(item, "call_id", str, "the id of the call this answers", where)
            out.append({"role": "tool", "tool_call_id": call_id, "content": _tool_output(item.get("output"), where)})
        elif kind == "reasoning":
            continue  # the engines take no reasoning back; chat templates replay text and calls only
        else:
            raise _ResponsesRefused(
                f"{where} has type {kind!r}, which has no chat-completions equivalent; send message, "
                "function_call, function_call_output, custom_tool_call or custom_tool_call_output items",
                where,
            )
    return out


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise _ResponsesRefused(
            f"{where}.role must be user, assistant, system or developer; got {role!r}", f"{where}.role"
        )
    content = item.get("content")
    if isinstance(content, list):
        content = _content_parts(content, f"{where}.content")
    elif not isinstance(content, str):
        raise _ResponsesRefused(
            f"{where}.content must be a string or a list of parts; got {_json_kind(content)}",
            f"{where}.content",
            "invalid_type",
        )
    return {"role": "system" if role == "developer" else role, "content": content}


def _content_parts(parts: list[Any], where: str) -> str | list[dict[str, Any]]:
    chat_parts: list[dict[str, Any]] = []
    for j, part in enumerate(parts):
        pw = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS:
            chat_parts.append({"type": "text", "text": _need(part, "text", str, "a string", pw)})
        elif kind == "refusal":
            chat_parts.append({"type": "text", "text": _need(part, "refusal", str, "a string", pw)})
        elif kind == "input_image":
            url = _take(part, "image_url", str, "a URL or a data: URL", pw)
            if url is None:
                raise _ResponsesRefused(
                    f"{pw} has no image_url: llmgw holds no uploaded files, so send the image as an https or data: URL",
                    f"{pw}.image_url",
                )
            image: dict[str, Any] = {"url": url}
            if isinstance(part.get("detail"), str):
                image["detail"] = part["detail"]
            chat_parts.append({"type": "image_url", "image_url": image})
        else:
            raise _ResponsesRefused(
                f"{pw} has type {kind!r}; message parts may be input_text, output_text, input_image or refusal", pw
            )
    if any(p["type"] != "text" for p in chat_parts):
        return chat_parts
    # Text alone goes as a string: some chat templates read only string content.
    return "\n".join(p["text"] for p in chat_parts)


def _tool_output(output: object, where: str) -> str:
    if isinstance(output, str):
        return output
    if not isinstance(output, list):
        raise _ResponsesRefused(
            f"{where}.output must be a string or a list of parts; got {_json_kind(output)}",
            f"{where}.output",
            "invalid_type",
        )
    texts = []
    for part in output:
        if isinstance(part, dict) and part.get("type") in _TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            # A chat tool message carries text only; say what was left out rather than fail the turn.
            kind = part.get("type") if isinstance(part, dict) else _json_kind(part)
            texts.append(f"[{kind} omitted: tool output reaches this model as text only]")
    return "\n".join(texts)


def with_history(req: ResponsesRequest, history: list[dict[str, Any]]) -> None:
    """Put earlier chat-format messages (a stored conversation) before this turn in req.chat["messages"],
    after the system message made from instructions (if any)."""
    head = [{"role": "system", "content": req.instructions}] if req.instructions else []
    req.chat["messages"] = head + list(history) + list(req.turn)


def _custom_arguments(raw_input: str) -> str:
    return orjson.dumps({"input": raw_input}).decode()


def _custom_input(arguments: str) -> str:
    """The raw input of a custom tool call from the function arguments the engine wrote."""
    try:
        parsed = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return arguments  # a model that wrote the input bare: pass it on as written
    if isinstance(parsed, dict) and isinstance(parsed.get("input"), str):
        return parsed["input"]
    return arguments


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [_text_part(text)]
    return {"id": _hex_id("msg_"), "type": "message", "role": "assistant", "status": status, "content": content}


def _reasoning_item(text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"id": _hex_id("rs_"), "type": "reasoning", "summary": [], "content": content, "status": status}


def _call_item(req: ResponsesRequest, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    if name in req.custom_tools:
        return {
            "id": _hex_id("ctc_"),
            "type": "custom_tool_call",
            "call_id": call_id,
            "name": name,
            "input": _custom_input(arguments) if arguments else "",
        }
    item = {"id": _hex_id("fc_"), "type": "function_call", "call_id": call_id, "name": name}
    return item | {"arguments": arguments, "status": status}


def _reply_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat-format assistant message the output items add, so a later turn to any model replays it."""
    texts = [p["text"] for item in output if item["type"] == "message" for p in item["content"]]
    calls = []
    for item in output:
        if item["type"] == "function_call":
            arguments = item["arguments"]
        elif item["type"] == "custom_tool_call":
            arguments = _custom_arguments(item["input"])
        else:
            continue
        calls.append(
            {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": arguments}}
        )
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts else None}
    if calls:
        message["tool_calls"] = calls
    elif message["content"] is None:
        message["content"] = ""
    return [message]


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _usage(usage: object) -> dict[str, Any] | None:
    if not isinstance(usage, dict):
        return None
    prompt, completion = _count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens"))
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens")
    return {
        "input_tokens": prompt,
        # The SDK requires cache_write_tokens; no engine reports cache writes, and none are billed.
        "input_tokens_details": {"cached_tokens": _count(cached), "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": _count(reasoning)},
        "total_tokens": _count(usage["total_tokens"]) if "total_tokens" in usage else prompt + completion,
    }


def _response_object(
    req: ResponsesRequest,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    obj = dict(req.request_echo)
    obj.update(
        id=req.response_id,
        object="response",
        created_at=req.created_at,
        status=status,
        model=req.model,
        output=output,
        usage=usage,
        error=error,
        incomplete_details={"reason": "max_output_tokens"} if status == "incomplete" else None,
    )
    if status == "completed":
        obj["completed_at"] = int(time.time())
    return obj


def _mark_incomplete(item: dict[str, Any]) -> None:
    if "status" in item:  # a custom_tool_call item has no status field
        item["status"] = "incomplete"


def render_response(req: ResponsesRequest, completion: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The engine's chat.completion JSON -> (the Response object, the chat-format messages this reply adds)."""
    choices = completion.get("choices") or [{}]
    choice = choices[0] if isinstance(choices[0], dict) else {}
    message = choice.get("message") or {}
    output: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if isinstance(reasoning, str) and reasoning:
        output.append(_reasoning_item(reasoning, "completed"))
    content = message.get("content")
    if isinstance(content, list):  # some engines answer with text parts
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    text = content if isinstance(content, str) else ""
    tool_calls = [c for c in message.get("tool_calls") or [] if isinstance(c, dict)]
    if text or not tool_calls:
        output.append(_message_item(text, "completed"))
    for call in tool_calls:
        fn = call.get("function") or {}
        arguments = fn.get("arguments")
        if not isinstance(arguments, str):  # an engine that decoded them already
            arguments = "" if arguments is None else orjson.dumps(arguments).decode()
        call_id = call.get("id") or _hex_id("call_")
        output.append(_call_item(req, call_id, fn.get("name") or "", arguments, "completed"))
    status = "incomplete" if choice.get("finish_reason") == "length" else "completed"
    if status == "incomplete":
        _mark_incomplete(output[-1])  # the item the limit cut off
    return _response_object(req, status, output, _usage(completion.get("usage"))), _reply_messages(output)


@dataclass(slots=True)
class _Call:
    """One streamed tool call; its item is added once its name is known (output_index set then)."""

    call_id: str
    name: str = ""
    arguments: str = ""
    output_index: int | None = None


class ResponseStream:
    """Chat chunks in, Responses SSE events out, in the order the openai SDK's accumulator expects."""

    def __init__(self, req: ResponsesRequest) -> None:
        self._req = req
        self._seq = 0
        self._output: list[dict[str, Any]] = []
        self._open: int | None = None  # output index of the open reasoning or message item
        self._calls: dict[int, _Call] = {}  # open tool calls by the engine's tool_call index
        self._finish_reason: str | None = None
        self._usage: dict[str, Any] | None = None
        self._cut: int | None = None  # output index of the item a length stop cut off
        self._final: dict[str, Any] | None = None

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = orjson.dumps({"type": kind, "sequence_number": self._seq, **fields})
        self._seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"

    def _add(self, item: dict[str, Any]) -> tuple[int, bytes]:
        self._output.append(item)
        index = len(self._output) - 1
        return index, self._event("response.output_item.added", output_index=index, item=item)

    def _done(self, index: int) -> bytes:
        item = self._output[index]
        if "status" in item:
            item["status"] = "incomplete" if index == self._cut else "completed"
        return self._event("response.output_item.done", output_index=index, item=item)

    def start(self) -> bytes:
        obj = _response_object(self._req, "in_progress", [], None)
        return self._event("response.created", response=obj) + self._event("response.in_progress", response=obj)

    def feed(self, chunk: dict[str, Any]) -> bytes:
        if self._final is not None:
            return b""
        if isinstance(chunk.get("usage"), dict):
            self._usage = chunk["usage"]
        error = chunk.get("error")
        if error:  # an engine that reports a failure inside the stream
            message = error.get("message") if isinstance(error, dict) else None
            return self.fail(message if isinstance(message, str) else str(error))
        choices = chunk.get("choices") or []
        if not choices or not isinstance(choices[0], dict):
            return b""
        choice = choices[0]
        delta = choice.get("delta") or {}
        out = b""
        # vLLM may send both names for the same text; take one.
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if isinstance(reasoning, str) and reasoning:
            out += self._part_delta("reasoning", reasoning)
        content = delta.get("content")
        if isinstance(content, str) and content:
            out += self._part_delta("message", content)
        for call in delta.get("tool_calls") or []:
            if isinstance(call, dict):
                out += self._call_delta(call)
        if choice.get("finish_reason"):
            self._finish_reason = choice["finish_reason"]
        return out

    def _where(self, index: int) -> dict[str, Any]:
        return {"item_id": self._output[index]["id"], "output_index": index, "content_index": 0}

    def _part_delta(self, kind: str, text: str) -> bytes:
        """Text for the open reasoning or message item; a change of kind closes what was open first."""
        out = b""
        if self._open is None or self._output[self._open]["type"] != kind:
            out = self._close_open() + self._close_calls()
            if kind == "reasoning":
                item, part = _reasoning_item(None, "in_progress"), {"type": "reasoning_text", "text": ""}
            else:
                item, part = _message_item(None, "in_progress"), _text_part("")
            self._open, added = self._add(item)
            out += added + self._event("response.content_part.added", part=part, **self._where(self._open))
            item["content"].append(dict(part))
        if not text:
            return out
        self._output[self._open]["content"][0]["text"] += text
        extra: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
        return out + self._event(f"{_PART_EVENTS[kind]}.delta", delta=text, **extra, **self._where(self._open))

    def _close_open(self) -> bytes:
        if self._open is None:
            return b""
        index, self._open = self._open, None
        item = self._output[index]
        part, where = item["content"][0], self._where(index)
        extra: dict[str, Any] = {"logprobs": []} if item["type"] == "message" else {}
        done = self._event(f"{_PART_EVENTS[item['type']]}.done", text=part["text"], **extra, **where)
        return done + self._event("response.content_part.done", part=part, **where) + self._done(index)

    def _call_delta(self, delta: dict[str, Any]) -> bytes:
        out = b""
        key = delta["index"] if isinstance(delta.get("index"), int) else 0
        call = self._calls.get(key)
        if call is None:
            out = self._close_open()
            call = self._calls[key] = _Call(call_id=_hex_id("call_"))
        fn = delta.get("function") or {}
        if call.output_index is None:
            if isinstance(delta.get("id"), str) and delta["id"]:
                call.call_id = delta["id"]
            if isinstance(fn.get("name"), str):
                call.name = fn["name"]
        fragment: str = fn["arguments"] if isinstance(fn.get("arguments"), str) else ""
        call.arguments += fragment
        if call.output_index is None:
            if not call.name:
                return out  # arguments before the name: held until the item can be added
            out += self._open_call(call)
            fragment = call.arguments  # what was held, with this fragment
        if fragment and call.name not in self._req.custom_tools and call.output_index is not None:
            item_id = self._output[call.output_index]["id"]
            out += self._event(
                "response.function_call_arguments.delta",
                item_id=item_id,
                output_index=call.output_index,
                delta=fragment,
            )
        return out

    def _open_call(self, call: _Call) -> bytes:
        call.output_index, added = self._add(_call_item(self._req, call.call_id, call.name, "", "in_progress"))
        return added

    def _close_calls(self) -> bytes:
        out = b""
        for call in self._calls.values():
            if call.output_index is None:  # the name never came; the item still has to exist
                out += self._open_call(call)
        for call in sorted(self._calls.values(), key=lambda c: c.output_index or 0):
            index = call.output_index
            assert index is not None
            item = self._output[index]
            fields = {"item_id": item["id"], "output_index": index}
            if item["type"] == "custom_tool_call":
                # Custom input is the "input" string inside JSON arguments, known whole only at the end.
                item["input"] = _custom_input(call.arguments) if call.arguments else ""
                if item["input"]:
                    out += self._event("response.custom_tool_call_input.delta", delta=item["input"], **fields)
                out += self._event("response.custom_tool_call_input.done", input=item["input"], **fields)
            else:
                item["arguments"] = call.arguments
                out += self._event("response.function_call_arguments.done", arguments=call.arguments, **fields)
            out += self._done(index)
        self._calls.clear()
        return out

    def finish(self, usage: dict[str, Any] | None) -> bytes:
        if self._final is not None:
            return b""
        if usage is not None:
            self._usage = usage
        status = "incomplete" if self._finish_reason == "length" else "completed"
        if status == "incomplete" and self._output:
            self._cut = len(self._output) - 1
        out = self._close_open() + self._close_calls()
        if not any(item["type"] != "reasoning" for item in self._output):
            # Nothing but (perhaps) reasoning: an empty message, as render_response makes.
            out += self._part_delta("message", "") + self._close_open()
        self._final = _response_object(self._req, status, self._output, _usage(self._usage))
        return out + self._event(f"response.{status}", response=self._final)

    def fail(self, message: str) -> bytes:
        if self._final is not None:
            return b""
        open_items = [self._open, *(c.output_index for c in self._calls.values())]
        for index in open_items:
            if index is not None:
                _mark_incomplete(self._output[index])
        error = {"code": "server_error", "message": message}
        self._final = _response_object(self._req, "failed", self._output, _usage(self._usage), error)
        return self._event("response.failed", response=self._final)

    def reply_messages(self) -> list[dict[str, Any]]:
        """The chat messages the reply added; none for a reply that failed or has not finished."""
        if self._final is None or self._final["status"] == "failed":
            return []
        return _reply_messages(self._output)

    def response(self) -> dict[str, Any]:
        if self._final is not None:
            return self._final
        return _response_object(self._req, "in_progress", self._output, _usage(self._usage))


def error_event(message: str, code: str) -> bytes:
    """An SSE error event, for a failure before anything else was streamed."""
    data = orjson.dumps({"type": "error", "sequence_number": 0, "code": code, "message": message, "param": None})
    return b"event: error\ndata: " + data + b"\n\n"
