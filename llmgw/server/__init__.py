"""The control plane and gateway (``llmgw server``).

StartError lives here, not in app.py, so a caller that only catches it (``llmgw up``'s command)
need not load the whole server first: ``up`` loads it while its other processes start.
"""

from __future__ import annotations

from llmgw.errors import LlmgwError


class StartError(LlmgwError):
    """The server could not start; the message says why and what to change."""
