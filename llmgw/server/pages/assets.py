"""The pages' static files, served under names that carry a hash of their content.

``/static/style.3f2a9c1e.css``: a deploy that changes a file changes its name, so
browsers fetch the new one at once, and every name can be cached for a year
(``immutable``). The table is built once at start from the files beside this
module; a name not in it is a 404 (nothing is looked up on disk per request).
"""

from __future__ import annotations

import hashlib
import mimetypes
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

STATIC_DIR = Path(__file__).parent / "static"
PREFIX = "/static/"


@dataclass(frozen=True)
class Asset:
    name: str  # the hashed name
    body: bytes
    content_type: str


class Assets:
    def __init__(self, root: Path = STATIC_DIR) -> None:
        self._by_plain: dict[str, Asset] = {}
        self._by_hashed: dict[str, Asset] = {}
        for path in sorted(root.iterdir()):
            if not path.is_file() or path.name.startswith("."):
                continue
            body = path.read_bytes()
            digest = hashlib.sha256(body).hexdigest()[:12]
            stem, dot, ext = path.name.partition(".")
            hashed = f"{stem}.{digest}.{ext}" if dot else f"{stem}.{digest}"
            ctype = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
            if ctype.startswith("text/") or ctype == "application/javascript":
                ctype += "; charset=utf-8"
            asset = Asset(hashed, body, ctype)
            self._by_plain[path.name] = asset
            self._by_hashed[hashed] = asset

    def url(self, plain: str) -> str:
        """The URL of a static file by its plain name (``style.css``); KeyError for a file that is not there."""
        return PREFIX + self._by_plain[plain].name

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get(PREFIX + "{name}", self.serve)

    async def serve(self, request: web.Request) -> web.StreamResponse:
        asset = self._by_hashed.get(request.match_info["name"])
        if asset is None:
            raise web.HTTPNotFound(text="no such file", content_type="text/plain")
        return web.Response(
            body=asset.body,
            headers={
                "Content-Type": asset.content_type,
                "Cache-Control": "public, max-age=31536000, immutable",
                "X-Content-Type-Options": "nosniff",
            },
        )
