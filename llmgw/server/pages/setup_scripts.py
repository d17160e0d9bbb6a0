"""What "Connect your editor" writes: the configuration blocks for Continue and Codex, the fields for Cline,
and the POSIX sh script ``GET /setup/<tool>?model=…`` serves (``curl -fsSL …/setup/continue?model=m | sh``).

The script holds no secret: it reads the key from ``LLMGW_API_KEY`` and refuses, changing nothing, when it is
unset. It writes only its own block, between two marker lines, adding it or replacing the one it wrote before;
everything else in the file stays as it was, and the file it changes is copied to ``FILE.bak-<timestamp>`` first.
Run twice, it finds the file already up to date and leaves it alone.

Formats targeted (checked against the tools' documentation):

* Continue: a local assistant file of its own, ``~/.continue/assistants/llmgw.yaml`` (``$CONTINUE_GLOBAL_DIR``
  when set), in the ``config.yaml`` schema v1 (``name``, ``version``, ``schema``, ``models:`` with ``provider:
  openai``, ``model``, ``apiBase``, ``apiKey``, ``roles``); the person's own ``config.yaml`` is not touched.
  Continue does not read keys from the environment, so the key is written into that file (mode 600).
* Codex: ``[model_providers.llmgw]`` (``base_url``, ``env_key = "LLMGW_API_KEY"``, ``wire_api = "responses"``,
  the only value current Codex accepts) appended to ``~/.codex/config.toml`` (``$CODEX_HOME`` when set), and the
  profile as Codex 0.134 and later read it: its own file ``~/.codex/llmgw.config.toml`` (``model_provider``,
  ``model``), used as ``codex --profile llmgw``; the default model is left as it was. The key stays in the
  environment, where Codex reads it on every run.
* Cline: nothing to write (it keeps keys in VS Code's secret storage): the four fields to paste.

Every value put into the script is first checked (the model is one the gateway serves, the address a plain
scheme, host and port) and then written as a JSON string, which YAML and TOML both read, inside a quoted here
document, or single-quoted for sh: nothing a request carries is ever run as shell.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass

from llmgw.server.pages import PageError

KEY_ENV = "LLMGW_API_KEY"
TOOLS = ("continue", "codex", "cline")
SCRIPTED = ("continue", "codex")  # the tools /setup/<tool> serves a script for
TOOL_NAMES = {"continue": "Continue", "codex": "Codex", "cline": "Cline"}
PROFILE = "llmgw"  # Codex's profile and provider id
BEGIN = "# >>> llmgw >>> written by the gateway's setup script; running it again replaces this block"
END = "# <<< llmgw <<<"
_HEREDOC = "LLMGW_END_OF_BLOCK"
_ORIGIN = re.compile(r"https?://(?:[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252})|\[[0-9A-Fa-f:.]{2,45}\])(?::[0-9]{1,5})?")
_MODEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,199}")  # as llmgw.config.server checks catalog names


class Unsafe(PageError, ValueError):
    """A value that cannot go into a configuration or a script."""


def check_origin(origin: str) -> str:
    """The gateway's address as the client sees it: scheme, host and port only (no path, no quotes, no spaces)."""
    if not _ORIGIN.fullmatch(origin):
        raise Unsafe(f"{origin!r} is not an address this page can write into a configuration")
    return origin


def check_model(model: str) -> str:
    if not _MODEL.fullmatch(model):
        raise Unsafe(f"{model!r} is not a model name")
    return model


def quoted(value: str) -> str:
    """A string as JSON writes it (ASCII, every control character escaped): valid in YAML and in TOML."""
    return json.dumps(value, ensure_ascii=True)


@dataclass(frozen=True)
class Target:
    """One file a tool's setup writes: where (a shell expression), its block, and where a new block goes."""

    path: str  # a sh expression, e.g. "$HOME/.codex/config.toml"
    shown: str  # the same for people: ~/.codex/config.toml
    lines: tuple[str, ...]  # the block, without its marker lines; KEY_LINE marks where the key goes
    top: bool = False  # a block of top-level TOML keys goes first in a file that has none yet


KEY_LINE = "\0key"  # stands for the apiKey line, which the script writes from the environment


def _continue_lines(base: str, model: str, key_line: str) -> tuple[str, ...]:
    return (
        "name: llmgw",
        "version: 1.0.0",
        "schema: v1",
        "models:",
        f"  - name: {quoted(model + ' (llmgw)')}",
        "    provider: openai",
        f"    model: {quoted(model)}",
        f"    apiBase: {quoted(base)}",
        key_line,
        "    roles:",
        "      - chat",
        "      - edit",
        "      - apply",
    )


def _continue_key(key: str) -> str:
    return f"    apiKey: {quoted(key)}"


def targets(tool: str, origin: str, model: str) -> list[Target]:
    """The files ``tool``'s setup writes for this gateway and model, each with its block."""
    base = check_origin(origin) + "/v1"
    check_model(model)
    if tool == "continue":
        return [
            Target(
                '"${CONTINUE_GLOBAL_DIR:-$HOME/.continue}/assistants/llmgw.yaml"',
                "~/.continue/assistants/llmgw.yaml",
                _continue_lines(base, model, KEY_LINE),
            )
        ]
    if tool == "codex":
        host = origin.split("://", 1)[1]
        return [
            Target(
                '"${CODEX_HOME:-$HOME/.codex}/config.toml"',
                "~/.codex/config.toml",
                (
                    f"[model_providers.{PROFILE}]",
                    f"name = {quoted('llmgw at ' + host)}",
                    f"base_url = {quoted(base)}",
                    f'env_key = "{KEY_ENV}"',
                    'wire_api = "responses"',
                ),
            ),
            Target(
                f'"${{CODEX_HOME:-$HOME/.codex}}/{PROFILE}.config.toml"',
                f"~/.codex/{PROFILE}.config.toml",
                (f'model_provider = "{PROFILE}"', f"model = {quoted(model)}"),
                top=True,
            ),
        ]
    raise Unsafe(f"there is no setup script for {tool!r}")


def shown_files(tool: str, origin: str, model: str, key: str) -> list[tuple[str, str]]:
    """(file, what the setup puts in it) with the key filled in, as the account page shows them."""
    out = []
    for t in targets(tool, origin, model):
        lines = [_continue_key(key) if line == KEY_LINE else line for line in t.lines]
        out.append((t.shown, "\n".join([BEGIN, *lines, END]) + "\n"))
    return out


def cline_fields(origin: str, model: str) -> list[tuple[str, str]]:
    """The fields Cline's settings ask for, but the key (shown beside them)."""
    return [
        ("API Provider", "OpenAI Compatible"),
        ("Base URL", check_origin(origin) + "/v1"),
        ("Model ID", check_model(model)),
    ]


def run_after(tool: str) -> str:
    return f"codex --profile {PROFILE}" if tool == "codex" else ""


# ---------------------------------------------------------------------------------------------- the script

_PUT_BLOCK = r"""
say() { printf '%s\n' "$*" >&2; }

stamp=$(date +%Y%m%d-%H%M%S)
LLMGW_BEGIN=$BEGIN_TEXT
LLMGW_END=$END_TEXT
export LLMGW_BEGIN LLMGW_END
new=""
block0=""
block1=""
trap 'rm -f "$new" "$block0" "$block1"' EXIT

# put_block FILE BLOCK WHERE: FILE gets BLOCK in place of the block it holds, or (none yet) at its end, or at its
# top when WHERE is "top". Everything else in FILE is kept; the old FILE is copied to FILE.bak-<timestamp>.
put_block() {
  target=$1
  block=$2
  dir=$(dirname "$target")
  mkdir -p "$dir"
  if [ -e "$target" ] && [ ! -f "$target" ]; then
    say "llmgw: $target is not a plain file; nothing was changed."
    exit 1
  fi
  if [ ! -f "$target" ]; then
    cat "$block" > "$target"
    say "llmgw: wrote $target"
    return 0
  fi
  begins=$(grep -c -x -F -e "$LLMGW_BEGIN" "$target" || true)
  ends=$(grep -c -x -F -e "$LLMGW_END" "$target" || true)
  if [ "$begins" -gt 1 ] || [ "$begins" != "$ends" ]; then
    say "llmgw: $target holds a broken llmgw block (its >>> and <<< lines do not pair up); mend it by hand. Nothing was changed."
    exit 1
  fi
  new="$target.llmgw-new.$$"
  LLMGW_BLOCK=$block LLMGW_HAS=$begins LLMGW_WHERE=$3 awk '
    function emit(   line) {
      while ((getline line < ENVIRON["LLMGW_BLOCK"]) > 0) print line
      close(ENVIRON["LLMGW_BLOCK"])
    }
    BEGIN { b = ENVIRON["LLMGW_BEGIN"]; e = ENVIRON["LLMGW_END"]; has = ENVIRON["LLMGW_HAS"] + 0; top = ENVIRON["LLMGW_WHERE"] == "top" }
    !has && top && NR == 1 { emit(); print "" }
    $0 == b { emit(); skip = 1; next }
    skip { if ($0 == e) skip = 0; next }
    { print; last = $0 }
    END { if (!has && (!top || NR == 0)) { if (NR > 0 && last != "") print ""; emit() } }
  ' "$target" > "$new"
  if cmp -s "$new" "$target"; then
    rm -f "$new"
    say "llmgw: $target is already up to date."
    return 0
  fi
  bak="$target.bak-$stamp"
  n=1
  while [ -e "$bak" ]; do
    n=$((n + 1))
    bak="$target.bak-$stamp-$n"
  done
  cp -p "$target" "$bak"
  cat "$new" > "$target"
  rm -f "$new"
  say "llmgw: updated $target (the file as it was is kept as $bak)"
}
"""


def script(tool: str, origin: str, model: str) -> str:
    """The sh script that sets ``tool`` up for this gateway and model, reading the key from LLMGW_API_KEY."""
    files = targets(tool, origin, model)  # checks the origin and the model first
    name = TOOL_NAMES[tool]
    q = shlex.quote
    out = [
        "#!/bin/sh",
        f"# Connects {name} to the llmgw gateway at {origin} (model {model}).",
        f"# This script holds no secret: it reads your API key from {KEY_ENV}. It changes only the block between",
        "# its own marker lines, keeps a copy of each file it changes (FILE.bak-<timestamp>), and leaves the rest.",
        "set -eu",
        "umask 077",
        f"BEGIN_TEXT={q(BEGIN)}",
        f"END_TEXT={q(END)}",
        _PUT_BLOCK.strip("\n"),
        "",
        f'if [ -z "${{{KEY_ENV}:-}}" ]; then',
        f"  say {q(f'llmgw: {KEY_ENV} is not set, so nothing was changed.')}",
        f"  say {q(f'  Make a key for {name} on {origin}/profile (Connect your editor), then run')}",
        f"  say {q(f'    export {KEY_ENV}=<the key>')}",
        "  say '  and this command again.'",
        "  exit 1",
        "fi",
        f"case ${KEY_ENV} in",
        "  *[!A-Za-z0-9_-]*)",
        f"    say {q(f'llmgw: {KEY_ENV} holds characters no llmgw key has (a key is letters, digits, - and _); nothing was changed.')}",
        "    exit 1",
        "    ;;",
        "esac",
        "",
    ]
    for i, t in enumerate(files):
        out.append(f"target{i}={t.path}")
        out.append(f'block{i}="$target{i}.llmgw-block.$$"')
        out.append(f'mkdir -p "$(dirname "$target{i}")"')
        out.append("{")
        out.append("  printf '%s\\n' \"$LLMGW_BEGIN\"")
        chunk: list[str] = []
        for line in [*t.lines, None]:
            if line is None or line == KEY_LINE:
                if chunk:
                    out.append(f"  cat <<'{_HEREDOC}'")
                    out.extend(chunk)
                    out.append(_HEREDOC)
                    chunk = []
                if line == KEY_LINE:
                    out.append(f'  printf \'    apiKey: "%s"\\n\' "${KEY_ENV}"')
            else:
                chunk.append(line)
        out.append("  printf '%s\\n' \"$LLMGW_END\"")
        out.append(f'}} > "$block{i}"')
        out.append(f'put_block "$target{i}" "$block{i}" {"top" if t.top else "end"}')
        out.append(f'rm -f "$block{i}"')
        out.append("")
    if tool == "codex":
        out += [
            f"say {q(f'llmgw: done. Codex reads the key from {KEY_ENV} each time it runs: keep it exported')}",
            f"say {q(f'  (in your shell profile, say) and start Codex with: codex --profile {PROFILE}')}",
        ]
    else:
        out += [
            f"say {q('llmgw: done. In Continue, choose the assistant llmgw (its model: ' + model + ').')}",
        ]
    out.append("")
    return "\n".join(out)
