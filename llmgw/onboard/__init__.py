"""`llmgw node add` and `node remove --purge`: machines made nodes (and unmade) over SSH from the control plane.

The control plane holds the authority and its own frozen executable; it pushes
that executable to each machine, runs `llmgw doctor` there before changing
anything, installs the node's certificate, agent.yaml and unit, and waits for
the node to join. Every step looks before it acts, so a rerun is safe and a
restarted agent adopts the engines it left running.
"""

from llmgw.errors import LlmgwError


class OnboardError(LlmgwError):
    """A machine could not be added (or purged); the message says what was found and what to do."""


__all__ = ["OnboardError"]
