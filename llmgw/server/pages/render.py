"""Templates for the pages: Jinja2 with escaping always on, the menu, and the headers every page carries.

Nothing a person typed or a model wrote is trusted: every value is escaped by
the template engine, and the few pieces of HTML made in code (a rendered chat
reply) are made by :mod:`llmgw.server.pages.markdown`, which drops raw HTML.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
from aiohttp import web

from llmgw import __version__
from llmgw.server.pages.assets import Assets

TEMPLATES = Path(__file__).parent / "templates"

# Scripts and styles only from this gateway; no frames, no forms posting elsewhere.
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'; object-src 'none'"
)
PAGE_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


@dataclass(frozen=True)
class MenuItem:
    label: str
    path: str
    who: str  # "everyone", "admin", or "manager" (an organization's managers, and administrators)


@dataclass
class Menu:
    """The one menu of every signed-in page: administrators' pages on the left, everyone's on the right."""

    items: list[MenuItem] = field(default_factory=list)

    def add(self, label: str, path: str, who: str = "everyone") -> None:
        self.items.append(MenuItem(label, path, who))

    def for_visitor(self, admin: bool, manager: bool = False) -> tuple[list[MenuItem], list[MenuItem]]:
        left = [i for i in self.items if (i.who == "admin" and admin) or (i.who == "manager" and (admin or manager))]
        right = [i for i in self.items if i.who == "everyone"]
        return left, right


class Renderer:
    def __init__(self, assets: Assets, menu: Menu) -> None:
        self.assets = assets
        self.menu = menu
        self.env = jinja2.Environment(
            loader=jinja2.FileSystemLoader(str(TEMPLATES)),
            autoescape=True,
            undefined=jinja2.StrictUndefined,
            trim_blocks=True,
            lstrip_blocks=True,
        )
        self.env.globals["asset"] = assets.url
        self.env.globals["version"] = __version__

    def page(self, request: web.Request, template: str, status: int = 200, **values: Any) -> web.Response:
        from llmgw.server.pages.session import FORM_CSRF, SET_COOKIES, current

        visitor = current(request)
        left, right = self.menu.for_visitor(bool(visitor and visitor.user.admin), bool(visitor and visitor.manages))
        # The current page: the item whose path is the request's or the longest one above it
        # (a node's page is under the Cluster page).
        under = [
            i.path for i in left + right if request.path == i.path or request.path.startswith(i.path.rstrip("/") + "/")
        ]
        current_path = max(under, key=len) if under else ""
        body = self.env.get_template(template).render(
            visitor=visitor,
            menu_left=left if visitor else [],
            menu_right=right if visitor else [],
            here=current_path,
            csrf=visitor.csrf if visitor else request.get(FORM_CSRF, ""),
            **values,
        )
        resp = web.Response(text=body, status=status, content_type="text/html", headers=PAGE_HEADERS)
        for name, value, opts in request.get(SET_COOKIES, []):
            resp.set_cookie(name, value, **opts)
        return resp
