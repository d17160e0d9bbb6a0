"""What the benchmark scripts under scripts/ share: another commit's tree to run beside this one,
and their sections of docs/benchmarks.md."""

from __future__ import annotations

import subprocess
from pathlib import Path

from llmgw.errors import LlmgwError

REPO = Path(__file__).resolve().parents[2]


class TreeError(LlmgwError):
    """A baseline that cannot be exported; the message says which and why."""


def export_tree(rev: str, dest: Path, repo: Path = REPO) -> str:
    """Commit ``rev``'s files (git archive: the work tree is not touched) under ``dest``; the commit's
    short name. Run from there (``cwd``, or PYTHONPATH) so `python -m llmgw...` is that commit's."""
    r = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "--short", "--verify", f"{rev}^{{commit}}"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if r.returncode != 0:
        raise TreeError(f"--baseline {rev}: not a commit of this repository ({r.stderr.strip()})")
    short = r.stdout.strip()
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.Popen(["git", "-C", str(repo), "archive", short], stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(dest)], stdin=archive.stdout, check=True, timeout=120)
    if archive.wait(timeout=120) != 0:
        raise TreeError(f"git archive {short} failed")
    return short


def replace_section(path: Path, mark: str, body: str, file_heading: str = "# Benchmarks\n") -> None:
    """Put ``body`` between a script's markers in ``path``, leaving the rest as it is; appended
    (after a file heading when the file is new) when the markers are absent."""
    start, end = f"<!-- {mark}:start -->", f"<!-- {mark}:end -->"
    block = f"{start}\n{body.strip()}\n{end}\n"
    text = path.read_text() if path.exists() else file_heading
    if start in text and end in text:
        head, rest = text.split(start, 1)
        tail = rest.split(end, 1)[1].lstrip("\n")
        text = head + block + ("\n" + tail if tail else "")
    else:
        text = text.rstrip("\n") + "\n\n" + block
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
