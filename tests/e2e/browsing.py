"""What the pages' browser tests share: the screenshot folder, the 390-px fit check, signing in,
and the llmgw command line."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from harness import llmgw_cmd

PASSWORD = "correct horse battery"
ADMIN = "root@example.com"
NARROW = {"width": 390, "height": 844}
WIDE = {"width": 1280, "height": 900}


def shot_dir(tmp_path: Path) -> Path:
    """Where screenshots go: LLMGW_SCREENSHOTS (the README's come from there), else the test's directory."""
    d = Path(os.environ.get("LLMGW_SCREENSHOTS") or tmp_path / "screenshots")
    d.mkdir(parents=True, exist_ok=True)
    return d


def fits(page) -> bool:
    """The page does not scroll sideways at its viewport's width."""
    return bool(page.evaluate("document.documentElement.scrollWidth <= window.innerWidth"))


def cli(*args: str, config: Path | None = None) -> str:
    """``llmgw ARGS`` (against server.yaml ``config`` when given); its output, or the test fails with it."""
    extra = ("--config", str(config)) if config is not None else ()
    r = subprocess.run(llmgw_cmd(*args, *extra), capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def sign_in(page, url: str, email: str, then: str | None = None, password: str = PASSWORD) -> None:
    """Signs in on /login (asking to go on to ``then``) and waits to be there."""
    page.goto(url + "/login" + (f"?next={then}" if then else ""))
    page.fill("input[name=email]", email)
    page.fill("input[name=password]", password)
    page.click("main button[type=submit]")
    if then:
        page.wait_for_url(url + then)
    else:
        page.wait_for_url(lambda u: "/login" not in u)
