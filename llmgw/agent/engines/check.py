"""engine-check: does this engine build still take every flag llmgw passes it?

Engines rename flags between releases, and the failure otherwise arrives
minutes into a model load, in the engine's words, on a node nobody watches.
The flags come from the real command builders (multi-node included, since a
flag used only there is the one nobody notices has gone) and are looked for
in the engine's own --help. No GPU is needed: a CLI prints its help anywhere.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from dataclasses import asdict, dataclass, field
from typing import Any

from llmgw.agent.engines.base import EngineAdapter
from llmgw.agent.engines.registry import adapter_for

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_OPTION_LINE = re.compile(r"^\s*\[?-{1,2}[A-Za-z0-9]")
# The last lines of a complete help list options (or a short epilog after them).
_TAIL_LINES = 40

_WHAT_BIN = {
    "llamacpp": "the llama-server binary",
    "vllm": "the vllm executable of a vLLM environment",
    "sglang": "the Python interpreter of an SGLang environment",
}
_TIMEOUT = {"llamacpp": 60.0, "vllm": 180.0, "sglang": 180.0}  # Python engines import torch first


@dataclass
class EngineCheck:
    engine: str
    flags: list[str]
    missing: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass
class EngineCheckReport(EngineCheck):
    bin: str = ""
    command: list[str] = field(default_factory=list)
    exit_code: int | None = None
    help_lines: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def flag_present(flag: str, text: str) -> bool:
    """On a word boundary, where '-' counts as part of the word: --port is not --port-range or --portable."""
    return re.search(r"(?<![\w-])" + re.escape(flag) + r"(?![\w-])", text) is not None


def truncation_signs(adapter: EngineAdapter, text: str) -> list[str]:
    signs: list[str] = []
    lines = text.splitlines()
    if len(lines) < adapter.min_help_lines:
        signs.append(f"it is {len(lines)} lines, and a complete {adapter.label} help is over {adapter.min_help_lines}")
    if text and not text.endswith("\n"):
        signs.append("it ends in the middle of a line")
    tail = [ln for ln in lines if ln.strip()][-_TAIL_LINES:]
    if tail and not any(_OPTION_LINE.match(ln) for ln in tail):
        signs.append("its last lines list no options")
    signs += adapter.help_problems(text)
    return signs


def engine_check(engine: str, help_text: str, *, extra_signs: list[str] | None = None) -> EngineCheck:
    """Every flag llmgw would pass `engine`, looked for in `help_text`.

    Problems: flags the help does not have. Warnings: signs the help is not the
    whole of it, in which case a flag reported missing may only have been cut off.
    """
    adapter = adapter_for(engine)
    flags = adapter.check_flags()
    text = _ANSI.sub("", help_text)
    result = EngineCheck(engine=adapter.name, flags=flags)
    if not text.strip():
        result.problems.append(f"the help is empty, so none of llmgw's {len(flags)} flags could be checked")
        return result
    result.missing = [f for f in flags if not flag_present(f, text)]
    for f in result.missing:
        result.problems.append(
            f"{f} is not in {adapter.label}'s --help: llmgw passes it, so this build would refuse "
            "to start a shard (renamed or removed in this version?)"
        )
    # A variable the engine no longer reads fails silently: it would start, and serve without a key.
    for name in adapter.checked_env():
        if not flag_present(name, text):
            result.missing.append(name)
            result.problems.append(
                f"{name} is not in {adapter.label}'s --help: llmgw gives the engine the replica's "
                "key through it, so this build would serve anyone without one (renamed or "
                "removed in this version?)"
            )
    signs = (extra_signs or []) + truncation_signs(adapter, text)
    if signs:
        consequence = (
            "so the flags reported missing may be there"
            if result.missing
            else "so this check may have missed something"
        )
        result.warnings.append(
            f"the help looks cut short ({'; '.join(signs)}), {consequence}; "
            "run the help command yourself and read it whole"
        )
    return result


def _run(argv: list[str], timeout: float) -> tuple[int | None, str, str, bool]:
    """Run a help command in its own session, so a timeout kills whatever it started too."""
    proc = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
        timed_out = True
    return (
        (None if timed_out else proc.returncode),
        out.decode(errors="replace"),
        err.decode(errors="replace"),
        timed_out,
    )


def _resolve_bin(bin_path: str) -> str | None:
    if os.sep in bin_path:
        return bin_path if os.path.isfile(bin_path) and os.access(bin_path, os.X_OK) else None
    return shutil.which(bin_path)


def run_engine_check(engine: str, bin_path: str, timeout: float | None = None) -> EngineCheckReport:
    """Run the engine's --help and check it (llmgw agent engine-check ENGINE --bin PATH)."""
    adapter = adapter_for(engine)
    flags = adapter.check_flags()
    report = EngineCheckReport(engine=adapter.name, flags=flags, bin=bin_path)
    resolved = _resolve_bin(bin_path)
    if resolved is None:
        why = "is not executable" if os.path.isfile(bin_path) else "was not found"
        report.problems.append(f"{bin_path} {why}; pass --bin with the path of {_WHAT_BIN[adapter.name]}")
        return report
    limit = timeout if timeout is not None else _TIMEOUT[adapter.name]
    attempts = adapter.help_commands(resolved)
    for i, argv in enumerate(attempts):
        try:
            code, out, err, timed_out = _run(argv, limit)
        except OSError as exc:
            report.command = argv
            report.problems.append(f"could not run {' '.join(argv)}: {exc.strerror or exc}")
            return report
        # Help goes to stdout; an engine that prints it to stderr still counts.
        text = out if out.strip() else err
        report.command, report.exit_code = argv, code
        if code not in (0, None) and i + 1 < len(attempts):
            continue  # refused this way of asking (an older release); try the next
        break
    report.help_lines = len(text.splitlines())
    failed = code not in (0, None)
    if failed and not any(flag_present(f, _ANSI.sub("", text)) for f in flags):
        # An error, not a help: checking flags against it would only list them all.
        last = next((ln.strip() for ln in reversed((err or out).splitlines()) if ln.strip()), "no output")
        report.problems.append(f"{' '.join(report.command)} exited with status {code}: {last}")
        return report
    signs = [f"it had not finished after {limit:g} s and was stopped"] if timed_out else []
    checked = engine_check(adapter.name, text, extra_signs=signs)
    report.missing, report.problems, report.warnings = checked.missing, checked.problems, checked.warnings
    if failed:
        report.warnings.append(f"{' '.join(report.command)} exited with status {code} after printing its help")
    return report
