"""The claim link page: `llmgw keys create --claim` prints <base>/claim/<token>.

Opening the link (GET) only shows a button; the key is revealed by the POST
that button sends. Link previews in chat tools fetch with GET, and a GET that
consumed the link would spend it before the person it was sent to saw it.
The POST works once; the store empties the sealed key as it answers.
"""

from __future__ import annotations

import html

import orjson
from aiohttp import web

from llmgw.store import NotFound, Store, StoreError

_HEADERS = {
    # The key must not be cached anywhere or leak through a Referer.
    "Cache-Control": "no-store",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'",
}

_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>body{{font-family:system-ui,sans-serif;max-width:40rem;margin:3rem auto;padding:0 1rem;line-height:1.5}}
code{{display:block;padding:.75rem;background:#f2f2f2;word-break:break-all;font-size:1.05rem}}
button{{font-size:1rem;padding:.5rem 1rem}}</style></head>
<body><h1>{title}</h1>{body}</body></html>
"""


class ClaimPage:
    def __init__(self, store: Store) -> None:
        self.store = store

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/claim/{token}", self.show)
        app.router.add_post("/claim/{token}", self.claim)

    @staticmethod
    def _page(title: str, body: str, status: int = 200) -> web.Response:
        return web.Response(
            status=status,
            text=_PAGE.format(title=html.escape(title), body=body),
            content_type="text/html",
            headers=_HEADERS,
        )

    async def show(self, request: web.Request) -> web.Response:
        return self._page(
            "Your API key",
            "<p>This link shows an API key once. Open it only when you are ready "
            "to copy the key somewhere safe: it cannot be shown again.</p>"
            '<form method="post"><button type="submit">Show my key</button></form>',
        )

    async def claim(self, request: web.Request) -> web.Response:
        wants_json = "application/json" in request.headers.get("Accept", "")
        token = request.match_info["token"]
        if not token.isascii():
            # Tokens are URL-safe base64: anything else is no link of ours, told apart without the store.
            return self._answer(wants_json, 404, "This claim link is not valid.")
        try:
            secret = await self.store.claim_key(token)
        except NotFound as exc:
            return self._answer(wants_json, 404, str(exc))
        except StoreError as exc:
            # Used, expired or revoked: gone for good.
            return self._answer(wants_json, 410, str(exc))
        if wants_json:
            return web.Response(body=orjson.dumps({"key": secret}), content_type="application/json", headers=_HEADERS)
        return self._page(
            "Your API key",
            f"<p>Copy it now; it will not be shown again.</p><code>{html.escape(secret)}"
            "</code><p>Send it as <kbd>Authorization: Bearer &lt;key&gt;</kbd>.</p>",
        )

    def _answer(self, wants_json: bool, status: int, message: str) -> web.Response:
        if wants_json:
            return web.Response(
                status=status,
                content_type="application/json",
                headers=_HEADERS,
                body=orjson.dumps({"error": {"message": message, "code": "claim_unavailable"}}),
            )
        return self._page("This link cannot show a key", f"<p>{html.escape(message)}</p>", status)
