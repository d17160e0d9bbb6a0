"""Setting `auth.store` in server.yaml by editing its text, so that every other line and every comment
stays as the operator wrote it (a YAML dump would drop the comments and reorder nothing usefully).

Only block-style YAML is edited; the result is parsed again and must be the old file's data with that
one value changed, or nothing is written.
"""

from __future__ import annotations

import copy
import json
import re

import yaml

from llmgw.init import InitError

_TOP_AUTH = re.compile(r"^auth[ \t]*:(?P<rest>.*?)(?P<nl>\r?\n)?$")
_KEY = re.compile(r"^(?P<indent>[ \t]*)(?P<key>[^\s#:][^:#]*?)[ \t]*:(?:[ \t]|$)")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" \t"))


def _blank_or_comment(line: str) -> bool:
    s = line.strip()
    return not s or s.startswith("#")


def _split_comment(rest: str) -> tuple[str, str]:
    """A one-line value and its trailing comment (with the spaces before the #), quotes respected."""
    s = rest
    i = len(s) - len(s.lstrip(" \t"))
    if i < len(s) and s[i] in "\"'":
        q = s[i]
        j = i + 1
        while j < len(s):
            if q == '"' and s[j] == "\\":
                j += 2
                continue
            if s[j] == q:
                if q == "'" and j + 1 < len(s) and s[j + 1] == "'":  # '' is a quote inside single quotes
                    j += 2
                    continue
                break
            j += 1
        after = s[j + 1 :]
        m = re.search(r"[ \t]+#", after)
        return (s[: j + 1 + m.start()], after[m.start() :]) if m else (s, "")
    m = re.search(r"[ \t]+#", s)
    if m:
        return s[: m.start()], s[m.start() :]
    return s, ""


def _flow(quoted: str, line: str) -> InitError:
    return InitError(
        f"server.yaml's auth is written in flow style ({line.strip()[:60]}), which init does not edit as text "
        f"(it keeps the file's comments by changing one line): set auth.store to {quoted} by hand, "
        "or write auth as a block (one key a line), and run init again"
    )


def set_store(text: str, value: str) -> str:
    """server.yaml's text with `auth.store` set to ``value``: the `store:` line under `auth:` replaced (its
    trailing comment kept), added when auth has none, or an `auth:` block appended when there is none.
    Raises InitError for YAML it does not edit (flow style, aliases) or whose meaning the edit would
    change beyond that one value."""
    quoted = json.dumps(value)  # a double-quoted YAML scalar: @ cannot start a plain one
    try:
        before = yaml.safe_load(text) if text.strip() else {}
    except yaml.YAMLError as exc:
        raise InitError(f"server.yaml does not parse as YAML ({exc}); fix it and run init again") from None
    if before is None:
        before = {}
    if not isinstance(before, dict):
        raise InitError("server.yaml does not hold a mapping of keys; fix it and run init again")
    first = next((ln for ln in text.splitlines() if not _blank_or_comment(ln)), "")
    if first.lstrip().startswith("{"):  # the whole file is one flow mapping
        raise _flow(quoted, first)

    lines = text.splitlines(keepends=True)
    at = next((i for i, ln in enumerate(lines) if _TOP_AUTH.match(ln)), None)
    if at is None:
        tail = "" if not text or text.endswith("\n") else "\n"
        new = f"{text}{tail}auth:\n  store: {quoted}\n"
    else:
        new = "".join(_edit_auth(lines, at, quoted))

    after = yaml.safe_load(new)
    want = copy.deepcopy(before)
    auth = want.get("auth")
    if not isinstance(auth, dict):
        auth = {}
    want["auth"] = {**auth, "store": value}
    if after != want:
        raise InitError(
            "server.yaml could not be edited as text without changing more than auth.store (anchors, aliases or "
            f"an unusual layout): set auth.store to {quoted} by hand and run init again"
        )
    return new


def _edit_auth(lines: list[str], at: int, quoted: str) -> list[str]:
    head = _TOP_AUTH.match(lines[at])
    assert head is not None
    rest, nl = head.group("rest"), head.group("nl") or "\n"
    value, comment = _split_comment(rest)
    v = value.strip()
    if v.startswith(("{", "*")):
        raise _flow(quoted, lines[at])
    out = list(lines)
    if not out[at].endswith("\n"):  # auth: on the file's last line: what follows goes on a line of its own
        out[at] += nl
    if v in ("null", "~", "Null", "NULL"):  # `auth: null`: an empty block from here
        out[at] = f"auth:{comment}{nl}"
    elif v and not v.startswith("&"):
        raise InitError(f"server.yaml's auth is {v[:40]!r}, not a block of keys; fix it and run init again")
    # The block: the lines after auth: that are indented, blank or comments, up to the next top-level key.
    end = at + 1
    while end < len(out) and (_blank_or_comment(out[end]) or _indent(out[end]) > 0):
        end += 1
    children = [i for i in range(at + 1, end) if not _blank_or_comment(out[i])]
    if not children:
        out.insert(at + 1, f"  store: {quoted}{nl}")
        return out
    child = _indent(out[children[0]])
    for i in children:
        m = _KEY.match(out[i])
        if m is None or _indent(out[i]) != child or m.group("key").strip() != "store":
            continue
        line = out[i]
        line_nl = "\r\n" if line.endswith("\r\n") else "\n" if line.endswith("\n") else ""
        old_value, old_comment = _split_comment(line[m.end() :].rstrip("\r\n"))
        if old_value.strip().startswith(("&", "*", "|", ">", "{", "[", "!")):
            raise InitError(
                f"server.yaml's auth.store is written as {old_value.strip()[:40]!r}, which init does not edit as "
                f"text: set it to {quoted} by hand and run init again"
            )
        # A plain scalar continued on more indented lines belongs to the value, and goes with it.
        stop = i + 1
        while stop < end and not _blank_or_comment(out[stop]) and _indent(out[stop]) > child:
            stop += 1
        out[i:stop] = [f"{m.group('indent')}store: {quoted}{old_comment}{line_nl or nl}"]
        return out
    out.insert(at + 1, f"{out[children[0]][:child]}store: {quoted}{nl}")  # first in the block, as indented
    return out
