"""Reading a YAML configuration file into a pydantic model, with errors that say where."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError
from yaml.reader import ReaderError

from llmgw.config.errors import ConfigError, format_validation_error

M = TypeVar("M", bound=BaseModel)

EMPTY = "it holds nothing (or only comments)"


def read_yaml(path: str | os.PathLike[str], what: str, empty: str | None = None) -> Any:
    """The data of a YAML file. Refused, with where and why: a file that is not UTF-8, not
    YAML, says a key twice in one mapping (YAML would keep the last one silently), or holds
    nothing (``empty`` says what to write instead)."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{p}: no such file; pass --config with the path of your {what}") from None
    except OSError as exc:
        raise ConfigError(f"{p}: cannot be read: {exc.strerror}") from None
    text = _decode(p, raw)
    try:
        loader = yaml.SafeLoader(text)
        try:
            node = loader.get_single_node()
            if node is not None:
                _refuse_duplicates(p, node)
            data = loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    except ReaderError as exc:
        line, col = _line_col(text, exc.position)
        raise ConfigError(
            f"{p}: holds the character U+{exc.character:04X} at line {line}, column {col}, "
            "which YAML does not allow; remove it"
        ) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{p}: not valid YAML{where}: {problem}") from None
    if data is None:
        # An empty file is more likely a mistake (a failed copy, the wrong path) than a
        # wish for every default, and the defaults open public listeners.
        raise ConfigError(f"{p}: {EMPTY}; {empty or f'write your {what} in it'}")
    return data


def _decode(p: Path, raw: bytes) -> str:
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise ConfigError(f"{p}: is UTF-16 text; save it as UTF-8")
    try:
        return raw.decode("utf-8-sig")  # a byte-order mark some editors write is not an error
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        col = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise ConfigError(
            f"{p}: is not UTF-8 text: byte 0x{raw[exc.start]:02x} at line {line}, column {col} "
            f"(byte offset {exc.start}); save the file as UTF-8"
        ) from None


def _line_col(text: str, position: int) -> tuple[int, int]:
    return text.count("\n", 0, position) + 1, position - (text.rfind("\n", 0, position) + 1) + 1


def _refuse_duplicates(p: Path, node: yaml.Node, where: str = "", walked: set[int] | None = None) -> None:
    """Every mapping in the file, at any depth, names each key once."""
    walked = set() if walked is None else walked
    if id(node) in walked:  # an alias: its anchor was checked (and may refer to itself)
        return
    walked.add(id(node))
    if isinstance(node, yaml.MappingNode):
        seen: dict[tuple[str, str], yaml.Mark] = {}
        for key, value in node.value:
            if key.tag == "tag:yaml.org,2002:merge" or not isinstance(key, yaml.ScalarNode):
                # Keys a merge (<<) brings in may be overridden: that is what merging is for.
                _refuse_duplicates(p, value, where, walked)
                continue
            first = seen.setdefault((key.tag, key.value), key.start_mark)
            if first is not key.start_mark:
                inside = f" in {where}" if where else ""
                a, b = first.line + 1, key.start_mark.line + 1
                at = (
                    f"at lines {a} and {b}"
                    if a != b
                    else f"at line {a}, columns {first.column + 1} and {key.start_mark.column + 1}"
                )
                raise ConfigError(f'{p}: "{key.value}" appears twice{inside}, {at}; keep one')
            _refuse_duplicates(p, value, f"{where}.{key.value}" if where else key.value, walked)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _refuse_duplicates(p, item, f"{where}[{i}]", walked)


def validate(model: type[M], data: Any, source: str, example_keys: str) -> M:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{source}: the file should hold a mapping of keys ({example_keys} ...), not a {type(data).__name__}"
        )
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, source)) from None
