"""The root of every error llmgw raises.

Each area has one base beneath it, named for what went wrong there
(ConfigError, StoreError, PKIError, ProtocolError, ProvisionError, MirrorError…),
so a caller can catch one area, or everything llmgw means to raise, without
catching Python's own errors. This module imports nothing from llmgw: every
layer may import it.
"""

from __future__ import annotations


class LlmgwError(Exception):
    """Something llmgw refused or could not do; the message says what and why."""
