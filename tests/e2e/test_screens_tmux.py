"""`llmgw server init`'s screens in a real pseudo-terminal: tmux runs it, the test reads the screen and types.

The email is typed the moment the form is drawn: a start-up terminal query that waited for an answer
a pseudo-terminal never gives would eat those keys (llmgw/cli/screens.py says what Textual sends). The
steps screen is read until it says to press Enter; after it closes, the transcript printed to the
terminal holds every step and the password the box showed. `--root` makes init write under a
directory instead of /, so no systemd is needed: the unit is written, not started.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
from harness import require

from llmgw.testing.waiting import until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

WIDTH, HEIGHT = 120, 40
# COLUMNS and LINES out: Textual (shutil.get_terminal_size) prefers them to the pane's size, and a
# test process can carry them (pytest's own C environment holds 80x24 here).
ENV = ("env", "-u", "COLUMNS", "-u", "LINES", "LANG=C.UTF-8")
PASSWORD_LINE = re.compile(r"^   administrator admin@example\.com, password \(printed only now[^)]*\): (\S+)$", re.M)


class Tmux:
    """A tmux server of the test's own (its own socket, no configuration), killed afterwards."""

    def __init__(self, binary: str) -> None:
        self.base = [binary, "-L", f"llmgw-test-{uuid.uuid4().hex[:8]}", "-f", "/dev/null"]

    def __call__(self, *args: str) -> str:
        return subprocess.run(self.base + list(args), check=True, capture_output=True, text=True, timeout=10).stdout

    def screen(self, history: bool = False) -> str:
        """What the pane shows now; with ``history``, everything printed to it, wrapped lines joined."""
        return self("capture-pane", "-p", "-J", "-t", "init", *(["-S", "-"] if history else []))

    def kill(self) -> None:
        subprocess.run(self.base + ["kill-server"], capture_output=True, timeout=10)


@pytest.fixture
def tmux():
    binary = shutil.which("tmux")
    if binary is None:
        require("tmux", "tmux is not installed (apt-get install tmux): the screens run in its pseudo-terminal")
    t = Tmux(binary)
    yield t
    t.kill()


def test_server_init_in_a_terminal_asks_by_form_shows_the_steps_and_leaves_the_run_with_its_password_in_history(
    tmux, tmp_path: Path
):
    llmgw = shutil.which("llmgw")
    if llmgw is None:
        require("the llmgw command", "`llmgw` is not on PATH: pip install -e . puts it there")
    root = tmp_path / "root"
    init = [llmgw, "server", "init", "--root", str(root), "--no-mirror", "--no-node", "--no-model"]
    # The exit status is echoed and the pane kept (sleep) so the transcript can be read after init ends.
    shell = f"{shlex.join(init)}; echo llmgw-exit=$?; sleep 300"
    tmux("new-session", "-d", "-s", "init", "-x", str(WIDTH), "-y", str(HEIGHT), *ENV, "sh", "-c", shell)

    until(lambda: "The administrator's email" in tmux.screen(), timeout=30, what="the form", detail=tmux.screen)
    tmux("send-keys", "-t", "init", "-l", "admin@example.com")
    tmux("send-keys", "-t", "init", "Enter")

    until(lambda: "press Enter to close" in tmux.screen(), timeout=60, what="the steps to end", detail=tmux.screen)
    steps = tmux.screen()
    assert "FAILED" not in steps, steps
    assert re.search(r"✓ \d+\. \S", steps) and "shown only now" in steps, steps
    tmux("send-keys", "-t", "init", "Enter")

    until(lambda: "llmgw-exit=" in tmux.screen(history=True), timeout=20, what="init to exit", detail=tmux.screen)
    out = tmux.screen(history=True)
    assert "llmgw-exit=0" in out, out
    password = PASSWORD_LINE.search(out)
    assert password is not None, out
    assert password.group(1) in steps  # the one the box showed
    numbered = [int(n) for n in re.findall(r"^(\d+)\. ", out, re.M)]
    assert numbered == list(range(1, len(numbered) + 1)) and len(numbered) >= 7, out
    assert re.search(r"^4\. server\.yaml: wrote .*/etc/llmgw/server\.yaml$", out, re.M), out
    assert (root / "etc" / "llmgw" / "server.yaml").is_file()
