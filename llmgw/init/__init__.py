"""`llmgw server init`: the steps that make a machine a control plane, each looking before it acts.

Every step is a function of a :class:`~llmgw.init.machine.Machine` (where the
files go, how commands run, what the machine is) returning a
:class:`~llmgw.init.steps.Done`: what it made, kept or changed, in one line.
A rerun finishes an interrupted install and changes nothing on a finished one.
"""

from llmgw.errors import LlmgwError


class InitError(LlmgwError):
    """`server init` stopped before doing damage; the message says what was found and what to do."""


__all__ = ["InitError"]
