"""The bodies of the mirror's management API (`llmgw mirror serve`, :8082), see docs/mirror.md.

The control plane's admin API passes these on (``/api/v1/mirror…``), adding
``used_by``. Replies are written with ``exclude_unset``: a field the mirror did
not set is absent, one it set to None is null, as docs/mirror.md shows them
(``bytes_done``/``bytes_total`` only while fetching, ``reason`` only on a
failure, ``url`` only in a fetch's reply). A DELETE answers ``admin.Removed``.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import ConfigDict, Field, StrictBool, StrictStr, StringConstraints

from .base import WireModel

# A name or URL with something in it besides blanks.
NonBlank = Annotated[StrictStr, StringConstraints(pattern=r"\S")]


class MirrorFile(WireModel):
    name: str
    state: str | None = None  # fetching, present or failed
    bytes: int | None = None  # on disk, once present
    bytes_done: int | None = None
    bytes_total: int | None = None  # None while the length is not known
    sha256: str | None = None
    reason: str | None = None
    source: str | None = None  # where it came from (hf:ORG/REPO/FILE@commit, a URL)


class MirrorVersion(WireModel):
    """One version of a model: its state is the worst of its files'."""

    model: str
    version: str
    state: str  # fetching, present or failed
    bytes: int | None = None  # of the files present
    files: list[MirrorFile] | None = None
    bytes_done: int | None = None  # while fetching
    bytes_total: int | None = None  # while fetching; None when a file's length is not known
    reason: str | None = None  # the first failed file's
    url: str | None = None  # in a fetch's reply: what a catalog entry's source should say
    used_by: list[str] | None = None  # added by the control plane: catalog models whose source lies here


class MirrorListing(WireModel):
    base: str | None = None  # the byte port's address, which nodes fetch from
    models: list[MirrorVersion] | None = None


class MirrorFetchRequest(WireModel):
    """Fetch ``source`` into ``model/version`` (both one directory level)."""

    # "as" is a Python keyword: the attribute is as_, the wire name "as".
    model_config = ConfigDict(validate_by_name=True, validate_by_alias=True, serialize_by_alias=True)

    source: NonBlank  # an http(s) URL or hf:ORG/REPO/FILE
    model: NonBlank
    version: NonBlank
    as_: StrictStr | None = Field(default=None, validation_alias="as", serialization_alias="as")
    anyway: StrictBool = False  # keep a GGUF the pinned llama.cpp may not load


class MirrorHealth(WireModel):
    status: str
    dir: str
