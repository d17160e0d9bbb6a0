"""The name an agent keeps a fetched source under in its weights cache.

Shared by the agent (which names what it fetches) and the control plane (which
reads nodes' reports of ``LocalWeights.path`` by it, to tell which files a
catalog model still needs): one function, so the two cannot drift apart.
"""

from __future__ import annotations

import hashlib
import re
from urllib.parse import urlsplit

HASH_LEN = 16
CACHE_NAME = re.compile(rf"^[0-9a-f]{{{HASH_LEN}}}-[A-Za-z0-9._-]+$")
_READABLE_MAX = 150  # keeps name + ".part" well under the 255-byte limit
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def cache_name_of(source: str) -> str:
    """The cache name of an ``http(s)://`` or ``hf:`` source (the agent's ``cache_name`` checks it is one).

    A hash of the whole source makes it collision-free; the host and path
    after it are only there so a person listing the directory can tell what
    is what. The file's own name stays last so its extension survives.
    """
    digest = hashlib.sha256(source.encode()).hexdigest()[:HASH_LEN]
    if source.startswith("hf:"):
        host, path = "hf", source[len("hf:") :]
    else:
        parts = urlsplit(source)
        host, path = parts.hostname or "", parts.path
        if parts.port:
            host += f"_{parts.port}"
    readable = _UNSAFE.sub("_", f"{host}/{path.strip('/')}".replace("/", "_")).strip("._") or "x"
    if len(readable) > _READABLE_MAX:
        readable = readable[-_READABLE_MAX:].lstrip("._-") or "x"  # the tail holds the file name
    return f"{digest}-{readable}"


def is_cache_name(name: str) -> bool:
    """Whether ``name`` is one the cache gives to what it fetches (anything else is not llmgw's)."""
    return bool(CACHE_NAME.match(name))
