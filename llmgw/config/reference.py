"""The configuration reference (docs/configuration.md), generated from the models.

Generating it means it cannot describe a key that does not exist or miss one
that does; a test regenerates it and compares.
Run `python -m llmgw.config.reference > docs/configuration.md` after changing a model.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable
from typing import Any, cast

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from llmgw.config.agent import AgentConfig
from llmgw.config.server import ServerConfig
from llmgw.config.types import ListenAddress

_HEADER = """# Configuration reference: server.yaml and agent.yaml

Generated from the configuration models by `python -m llmgw.config.reference`;
a test fails when this file and the code disagree. Durations are written like
`30s`, `10m`, `250ms` or a number of seconds; sizes like `32MiB` or a number of
bytes; addresses like `:8080`, `127.0.0.1:9090` or `[::1]:9090`. An unknown key
or a value of the wrong type stops the process at start with the key's full path.
So does a file that is not UTF-8 (the message names the byte and its line), a key
written twice in one mapping at any depth (both lines named; YAML alone would keep
the last silently), and an empty file, or one holding only comments: write `{}`
in server.yaml to take every default.
"""


def _type_name(annotation: Any, info: FieldInfo) -> str:
    meta = " ".join(type(m).__name__ for m in info.metadata)
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        every = typing.get_args(annotation)
        args = [a for a in every if a is not type(None)]
        inner = " or ".join(_type_name(a, FieldInfo()) for a in args)
        return f"{inner} or null" if len(args) < len(every) else inner
    if origin is typing.Annotated:
        return _type_name(typing.get_args(annotation)[0], info)
    if origin is list:
        (arg,) = typing.get_args(annotation)
        return f"list of {_type_name(arg, FieldInfo())}"
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in typing.get_args(annotation))
    if annotation is ListenAddress:
        return "address"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "block"
    if annotation is float and "BeforeValidator" in meta:
        return "duration"
    if annotation is int and "BeforeValidator" in meta:
        return "size"
    return getattr(annotation, "__name__", str(annotation))


def _default(info: FieldInfo, kind: str = "") -> str:
    if info.default is PydanticUndefined:
        if info.default_factory is not None:
            # No configuration field's factory takes the validated data.
            value = cast(Callable[[], Any], info.default_factory)()
            if isinstance(value, BaseModel):
                return ""
            return f"`{value!r}`" if value != [] else "`[]`"
        return "required"
    value = info.default
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, ListenAddress):
        return f'`"{value}"`'
    if isinstance(value, str):
        return f'`"{value}"`'
    if kind == "duration":
        return f"`{value:g}s`"
    if kind == "size" and value % (1 << 20) == 0:
        return f"`{value >> 20}MiB`"
    return f"`{value}`"


def _walk(model: type[BaseModel], prefix: str, rows: list[tuple[str, str, str, str]]) -> None:
    for name, info in model.model_fields.items():
        annotation = info.annotation
        hints = typing.get_type_hints(model, include_extras=True)
        full = hints.get(name, annotation)
        path = f"{prefix}{name}"
        inner = annotation
        if typing.get_origin(annotation) is list:
            (inner,) = typing.get_args(annotation)
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                rows.append((path, "list", _default(info), info.description or ""))
                _walk(inner, f"{path}[].", rows)
                continue
        kind = "block"
        if typing.get_origin(annotation) in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(annotation) if a is not type(None)]
            if len(args) == 1 and isinstance(args[0], type) and issubclass(args[0], BaseModel):
                inner, kind = args[0], "block or null"
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            rows.append((path, kind, "", info.description or (inner.__doc__ or "").strip()))
            _walk(inner, f"{path}.", rows)
            continue
        kind = _type_name(full, info)
        rows.append((path, kind, _default(info, kind), info.description or ""))


_SECTIONS = (
    ("server.yaml", ServerConfig, "The gateway (`llmgw server --config`). See `examples/server.yaml`."),
    (
        "agent.yaml",
        AgentConfig,
        "The node agent (`llmgw agent --config`). A plain node's file holds only "
        "`server` (or `servers`) and `tls`; every other key overrides what the agent finds out for itself.",
    ),
)


def render() -> str:
    out = [_HEADER]
    for title, model, intro in _SECTIONS:
        rows: list[tuple[str, str, str, str]] = []
        _walk(model, "", rows)
        out += [f"## {title}", "", intro, "", "| key | type | default | meaning |", "|---|---|---|---|"]
        for path, kind, default, desc in rows:
            cell = desc.replace("|", "\\|")
            out.append(f"| `{path}` | {kind} | {default} | {cell} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(render(), end="")
