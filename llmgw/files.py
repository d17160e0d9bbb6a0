"""Writing files so that a reader never sees half of one, and secrets that only their owner reads.

The one atomic write of the project: a temporary file beside the target, its
mode set before any byte is written, then :func:`replace_durably`, the one way
a finished file (a download's ``.part`` too) takes its name: fsynced, renamed
over the target, and the directory fsynced so the rename survives a power cut.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import tempfile
from pathlib import Path

from llmgw.errors import LlmgwError


def write_atomic(path: str | os.PathLike[str], data: bytes, mode: int = 0o644) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", dir=p.parent)
    try:
        os.fchmod(fd, mode)  # before any byte is written, so a secret is never readable by others
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        replace_durably(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def replace_durably(tmp: str | os.PathLike[str], target: str | os.PathLike[str]) -> None:
    """Give the finished file ``tmp`` the name ``target`` (same directory), replacing what was there.

    Its bytes reach the disk before the rename and the rename before this
    returns, so after a power cut ``target`` is the old file or the whole new
    one, never a short one. Slow for a big file: call it off the event loop.
    """
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, target)
    fsync_dir(Path(target).parent)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


# ------------------------------------------------------------------ tokens


def new_token(prefix: str) -> str:
    """A random credential with a visible prefix saying what it is for (240 random bits)."""
    return prefix + secrets.token_urlsafe(30)


def token_digest(token: str) -> str:
    """How a credential is stored: sha256, hex. Tokens are random enough that a slow
    hash would buy nothing and cost every request."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def same_secret(a: str, b: str) -> bool:
    """Compares without leaking, through timing, how much of a guess was right."""
    return hmac.compare_digest(a.encode("utf-8"), b.encode("utf-8"))


class SecretFileError(LlmgwError):
    """A secret file that cannot be read or is readable by others; the message says what to do."""


def read_secret_file(path: str | os.PathLike[str]) -> str:
    """The one line a secret file holds. A file others may read is refused: the secret
    in it is no longer only its owner's."""
    p = Path(path)
    try:
        st = p.stat()
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SecretFileError(f"{p}: no such file") from None
    except PermissionError:
        raise SecretFileError(f"{p}: permission denied; run as the user that owns it (or root)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SecretFileError(f"{p}: cannot be read: {exc}") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SecretFileError(
            f"{p}: others can read it (mode {stat.S_IMODE(st.st_mode):04o}); "
            f"run `chmod 600 {p}`, and make a new token if it may have been seen"
        )
    token = text.strip()
    if not token or "\n" in token:
        raise SecretFileError(f"{p}: should hold one token on one line")
    return token


def write_secret_file(path: str | os.PathLike[str], secret: str) -> None:
    """The secret alone on a line, mode 0600, written atomically."""
    write_atomic(path, (secret + "\n").encode("utf-8"), 0o600)


def sha256_file(path: str | os.PathLike[str]) -> str:
    """The file's sha256 as hex, read a megabyte at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
