"""The base of discovery's errors: a tool or library that could not say what the node is."""

from __future__ import annotations

from llmgw.errors import LlmgwError


class DiscoveryError(LlmgwError):
    """Reading the node failed (NVML, nvidia-smi, its topology); the message says which and why."""
