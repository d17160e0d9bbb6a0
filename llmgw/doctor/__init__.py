"""`llmgw doctor`: what a node lacks for llmgw, each finding with its fix.

facts.py reads (discovery plus what only doctor needs), checks.py judges
(pure), report.py prints. The wire shape is llmgw.protocol.doctor.
"""

from .checks import evaluate
from .facts import DoctorError, DoctorOptions, collect_facts
from .report import counts, render_json, render_text

__all__ = ["DoctorError", "DoctorOptions", "collect_facts", "counts", "evaluate", "render_json", "render_text"]
