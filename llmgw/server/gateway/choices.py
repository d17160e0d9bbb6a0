"""What a request of several sequences (n choices, several prompts) generated, where its engine's
usage does not say.

vLLM and SGLang count every sequence in their usage. llama.cpp's llama-server does not: a reply
that is not streamed carries the usage of its first sequence only, and a stream one usage event per
sequence. An OpenAI-compatible server of unknown make may do either. A request is charged for
every sequence either way: at least what the reply itself shows was generated (the proxy counts a
stream's output events; choices_output reads a whole reply), and never less than the engine says.
"""

from __future__ import annotations

# Engines whose usage counts every sequence of a request: their numbers are taken as they are.
REPORTS_EVERY_SEQUENCE = frozenset({"vllm", "sglang"})

# Engines whose streams carry one usage event per sequence, each counting only its own: summed.
USAGE_PER_SEQUENCE = frozenset({"llamacpp"})

# Bytes of generated text taken for one token where nothing better is known (as the prompt estimate).
_BYTES_PER_TOKEN = 4


def recounts(engine: str, outputs: int) -> bool:
    """Whether a request of ``outputs`` sequences served by ``engine`` is settled to at least what
    its reply shows (its engine's usage may count one sequence only)."""
    return outputs > 1 and engine not in REPORTS_EVERY_SEQUENCE


def choices_output(reply: dict, limit: int | None) -> int:
    """Output tokens a whole (not streamed) reply shows it generated, over all its choices: a choice
    cut by the limit (finish_reason "length") made ``limit`` tokens, exactly; any other, its text
    at _BYTES_PER_TOKEN bytes a token (at least one: the token that ended it), never above ``limit``."""
    choices = reply.get("choices")
    if not isinstance(choices, list):
        return 0
    total = 0
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        if limit is not None and choice.get("finish_reason") == "length":
            total += limit
            continue
        made = max(1, -(-_text_bytes(choice) // _BYTES_PER_TOKEN))
        total += made if limit is None else min(made, limit)
    return total


def _text_bytes(choice: dict) -> int:
    """Bytes of what one choice generated: a completion's text, or a chat message's content, its
    reasoning and its tool calls' names and arguments."""
    text = choice.get("text")
    if isinstance(text, str):
        return len(text.encode())
    message = choice.get("message")
    if not isinstance(message, dict):
        return 0
    n = 0
    for field in ("content", "reasoning_content"):
        v = message.get(field)
        if isinstance(v, str):
            n += len(v.encode())
    calls = message.get("tool_calls")
    if isinstance(calls, list):
        for call in calls:
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict):
                for field in ("name", "arguments"):
                    v = fn.get(field)
                    if isinstance(v, str):
                        n += len(v.encode())
    return n
