"""The base of the engine adapters' errors: a shard that cannot be planned as asked."""

from __future__ import annotations

from llmgw.errors import LlmgwError


class EngineError(LlmgwError):
    """An engine, its weights or its launch that the adapters refuse; the message says what to fix."""
