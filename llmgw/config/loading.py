"""Reading a YAML configuration file into a pydantic model, with errors that say where."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from llmgw.config.errors import ConfigError, format_validation_error

M = TypeVar("M", bound=BaseModel)


def read_yaml(path: str | os.PathLike[str], what: str) -> Any:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{p}: no such file; pass --config with the path of your {what}") from None
    except OSError as exc:
        raise ConfigError(f"{p}: cannot be read: {exc.strerror}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{p}: not valid YAML{where}: {problem}") from None


def validate(model: type[M], data: Any, source: str, example_keys: str) -> M:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the file should hold a mapping of keys ({example_keys} ...), not a {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, source)) from None
