"""Can the pinned llama.cpp load this GGUF? Judged from the header alone.

A file llama.cpp cannot load is fetched, catalogued and placed, and then
fails on every node, while the answer sits in its first kilobytes
(``general.architecture``). So the header is read with HTTP Range requests,
a few hundred KB at most in practice, before anything is downloaded: by the
mirror before it fetches a model, by the server before it catalogues one.

The known architectures are ``LLM_ARCH_NAMES`` from the llama.cpp vendored
in the pinned llama-cpp-python sdist, written to ``gguf_architectures.txt``
by ``scripts/gen-gguf-architectures`` (never typed by hand; a unit test
re-derives it from the sdist and compares).
"""

from __future__ import annotations

import functools
import logging
import re
import struct
from collections.abc import Callable
from importlib import resources
from typing import Any
from urllib.parse import unquote, urlsplit

import httpx

from llmgw import download
from llmgw.errors import LlmgwError

log = logging.getLogger(__name__)

MAGIC = b"GGUF"
FIRST_READ = 256 << 10  # most headers put general.architecture in the first few hundred bytes
MAX_READ = 8 << 20  # a header that needs more than this before its architecture is not worth chasing
ARCH_KEY = "general.architecture"
ARCHITECTURES_FILE = "gguf_architectures.txt"

# Value types, GGUF spec order.
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9


class GGUFError(LlmgwError, ValueError):
    """Not a GGUF header we can read."""


class _NeedMore(GGUFError):
    """The bytes ran out before the header did."""


class _Reader:
    def __init__(self, data: bytes, version: int) -> None:
        self.data, self.pos = data, 0
        # v1 counted lengths with uint32; v2 moved every count and length to uint64.
        self.count_fmt = "<I" if version == 1 else "<Q"

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise _NeedMore(f"the header continues past byte {len(self.data)}")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str) -> Any:  # what struct gives: an int, float or bool by fmt
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def count(self) -> int:
        return int(self.unpack(self.count_fmt))

    def string(self) -> str:
        return self.take(self.count()).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> object:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, n = self.unpack("<I"), self.count()
            if etype in _SCALARS and etype != 7:
                # Skip fixed-size arrays without building them: a vocabulary's
                # scores are hundreds of thousands of floats nobody here reads.
                self.take(n * struct.calcsize(_SCALARS[etype]))
                return f"<array of {n}>"
            return [self.value(etype) for _ in range(n)]
        raise GGUFError(f"unknown GGUF value type {vtype} at byte {self.pos}")


def parse_header(data: bytes) -> dict[str, Any]:
    """Read a GGUF header (v1–v3) from its first bytes.

    Returns ``{"version", "tensor_count", "kv_count", "metadata", "complete"}``;
    ``metadata`` holds the key/value pairs read, in file order. Reading stops
    cleanly where the bytes end once ``general.architecture`` has been seen
    (``complete`` False); before that, running out raises GGUFError (so a
    caller can fetch more), as does anything that is not a GGUF header.
    """
    if len(data) < 8:
        raise _NeedMore("fewer than 8 bytes")
    if data[:4] != MAGIC:
        raise GGUFError(f"not a GGUF file (it starts with {data[:4]!r}, not b'GGUF')")
    version = struct.unpack("<I", data[4:8])[0]
    if version not in (1, 2, 3):
        raise GGUFError(f"GGUF version {version} is not one this reader knows (1 to 3)")
    r = _Reader(data, version)
    r.pos = 8
    tensor_count, kv_count = r.count(), r.count()
    metadata: dict[str, object] = {}
    for _ in range(kv_count):
        try:
            key = r.string()
            metadata[key] = r.value(r.unpack("<I"))
        except _NeedMore:
            if ARCH_KEY in metadata:
                break
            raise
    else:
        return {
            "version": version,
            "tensor_count": tensor_count,
            "kv_count": kv_count,
            "metadata": metadata,
            "complete": True,
        }
    return {
        "version": version,
        "tensor_count": tensor_count,
        "kv_count": kv_count,
        "metadata": metadata,
        "complete": False,
    }


# ---------------------------------------------------------------- the pinned list


@functools.cache
def _pinned() -> tuple[frozenset[str], str]:
    try:
        text = resources.files(__package__).joinpath(ARCHITECTURES_FILE).read_text(encoding="utf-8")
    except OSError as exc:
        # A build that left the list out must not refuse every model: an
        # empty set is "unknown build", which refuses nothing.
        log.warning("%s is missing (%s); GGUF architectures are not checked", ARCHITECTURES_FILE, exc)
        return frozenset(), "an unknown build"
    names, build = [], "the pinned build"
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("#"):
            m = re.match(r"#\s*build:\s*(.+)$", line)
            if m:
                build = m.group(1).strip()
        elif line:
            names.append(line)
    return frozenset(names), build


def pinned_architectures() -> frozenset[str]:
    """The architectures the pinned llama.cpp build knows (from gguf_architectures.txt)."""
    return _pinned()[0]


def pinned_build() -> str:
    """How the pinned build is named in messages, e.g. 'llama.cpp (llama-cpp-python 0.3.36)'."""
    return _pinned()[1]


def parse_arch_names(source: str) -> list[str]:
    """The names in llama-arch.cpp's ``LLM_ARCH_NAMES`` map, in source order."""
    m = re.search(r"LLM_ARCH_NAMES\s*=\s*\{(.*?)\n\};", source, re.S)
    if not m:
        raise GGUFError("llama-arch.cpp has no LLM_ARCH_NAMES map; the generator needs updating")
    names = []
    for enum, name in re.findall(r"\{\s*(LLM_ARCH_\w+)\s*,\s*\"([^\"]*)\"\s*\}", m.group(1)):
        # LLM_ARCH_UNKNOWN maps to "(unknown)", which no model file names as its architecture.
        if enum != "LLM_ARCH_UNKNOWN":
            names.append(name)
    if not names:
        raise GGUFError("llama-arch.cpp's LLM_ARCH_NAMES map yielded no names")
    return names


# ---------------------------------------------------------------- judging


def _is_mmproj_name(url: str) -> bool:
    name = unquote(urlsplit(url).path.rsplit("/", 1)[-1]).lower()
    return "mmproj" in name


def judge(header: dict[str, Any], url: str, architectures: frozenset[str]) -> str | None:
    """None when the pinned llama.cpp can load this model, else why not."""
    meta = header.get("metadata", {})
    arch = meta.get(ARCH_KEY)
    name = unquote(urlsplit(url).path.rsplit("/", 1)[-1]) or url
    if arch == "clip" or meta.get("general.type") == "mmproj" or _is_mmproj_name(url):
        return f"{name} is a vision projector (mmproj), not a model on its own; it goes with a model as --mmproj."
    if not isinstance(arch, str):
        return None  # no architecture to judge: refuse nothing
    if architectures and arch not in architectures:
        build = pinned_build()
        return f"{build} cannot load architecture {arch!r} ({name}); pass --anyway to fetch it all the same."
    return None


async def read_header(
    url: str,
    client: httpx.AsyncClient,
    headers: dict[str, str] | None = None,
    *,
    until: Callable[[dict[str, Any]], bool] | None = None,
) -> dict[str, Any]:
    """Fetch just enough of ``url`` to read its header, growing the Range as needed.

    ``until``: given the metadata read so far, whether it holds what the caller needs; while it
    does not, the header is read on (to MAX_READ at most) past ``general.architecture``, e.g. to
    the vocabulary, which `llmgw ctl plan` counts the embeddings with."""
    want = FIRST_READ
    while True:
        h = {**(headers or {}), **download.request_headers(0), "Range": f"bytes=0-{want - 1}"}
        data = bytearray()
        async with client.stream("GET", url, headers=h) as resp:
            if resp.status_code not in (200, 206):
                raise GGUFError(f"{url} answered {resp.status_code}")
            # A server that ignores Range sends everything; stop reading at `want`.
            async for chunk in resp.aiter_raw():
                data += chunk
                if len(data) >= want:
                    break
            cr = download.parse_content_range(resp.headers.get("Content-Range"))
            whole = resp.status_code == 200 or (cr is not None and cr.total is not None and cr.total <= want)
        try:
            header = parse_header(bytes(data[:want]))
        except _NeedMore:
            if whole or len(data) < want or want >= MAX_READ:
                raise GGUFError(f"the header of {url} did not fit in its first {min(want, len(data))} bytes") from None
            want = min(want * 4, MAX_READ)
            continue
        if header["complete"] or until is None or until(header["metadata"]):
            return header
        if whole or len(data) < want or want >= MAX_READ:
            return header  # all there is: the caller finds what is missing
        want = min(want * 4, MAX_READ)


async def check_gguf_url(
    url: str,
    session: httpx.AsyncClient | None = None,
    architectures: frozenset[str] | None = None,
    *,
    headers: dict[str, str] | None = None,
    timeout: float = 30.0,
) -> str | None:
    """None when ``url`` is fine to fetch (or cannot be judged), else the refusal.

    ``architectures`` None means the pinned list; an empty set means the
    nodes' build is unknown, so only a vision projector is refused. A
    header that cannot be fetched or read refuses nothing: the check is a
    courtesy, and a flaky first request must not block a real model.
    """
    if architectures is None:
        architectures = pinned_architectures()
    if _is_mmproj_name(url):
        return judge({}, url, architectures)
    own = session is None
    client = session or httpx.AsyncClient(timeout=timeout, follow_redirects=True)
    try:
        header = await read_header(url, client, headers)
    except (GGUFError, httpx.HTTPError, OSError) as exc:
        log.info("GGUF header of %s not checked: %s", url, exc)
        return None
    finally:
        if own:
            await client.aclose()
    return judge(header, url, architectures)
