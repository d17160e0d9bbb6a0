"""A model's reply as HTML: markdown rendered on the server, never trusting what the model wrote.

Raw HTML in the text is not passed through (``html`` off: it shows as text),
links and images whose address is not http(s) or mailto are emptied (the
``javascript:`` and ``data:`` kinds), images are shown as links (nothing is
fetched from elsewhere by showing a reply), and every link opens with
``rel="noopener noreferrer nofollow"``.

Maths is set aside before anything else reads the text: ``$…$`` inline and
``$$…$$`` on its own, outside code, where the opening ``$`` is not followed by
a space and the closing one is not followed by a digit, so "$5 and $10" stays
prose. Each becomes ``<span class="math inline">`` (``$$…$$`` inside a line:
``<span class="math display">``; on its own: ``<div class="math display">``)
holding the TeX as escaped text, which the chat page's script typesets with KaTeX
(vendored, as MathML: no fonts, no inline styles); without script the TeX
stays as text.
"""

from __future__ import annotations

from html import escape
from typing import Any
from urllib.parse import urlsplit

from markdown_it import MarkdownIt
from markdown_it.token import Token
from mdit_py_plugins.dollarmath import dollarmath_plugin

SAFE_SCHEMES = ("http", "https", "mailto")


def _safe(href: str) -> bool:
    href = href.strip()
    if href.startswith(("#", "/")) and not href.startswith("//"):
        return True
    return urlsplit(href).scheme.lower() in SAFE_SCHEMES


def _math(tag: str, display: str) -> Any:
    """A maths token as an element holding its TeX as text: display maths inside a paragraph stays a span."""

    def render(self: Any, tokens: list[Token], idx: int, options: Any, env: Any) -> str:
        return f'<{tag} class="math {display}">{escape(tokens[idx].content.strip())}</{tag}>' + (
            "\n" if tag == "div" else ""
        )

    return render


def _md() -> MarkdownIt:
    md = MarkdownIt("commonmark", {"html": False, "linkify": False, "typographer": False}).enable("table")
    # "$5 and $10": no space after an opening $, no digit after a closing one, or it is prose.
    dollarmath_plugin(md, allow_space=False, allow_digits=False, allow_labels=False, double_inline=True)
    md.add_render_rule("math_inline", _math("span", "inline"))
    md.add_render_rule("math_inline_double", _math("span", "display"))
    md.add_render_rule("math_block", _math("div", "display"))
    # Judged below instead, so that an unsafe link is emptied rather than left as text.
    md.validateLink = lambda url: True  # type: ignore[method-assign]

    def links_and_images(state) -> None:
        for block in state.tokens:
            if block.type != "inline" or not block.children:
                continue
            out: list[Token] = []
            for tok in block.children:
                if tok.type == "link_open":
                    href = str(tok.attrGet("href") or "")
                    tok.attrSet("href", href if _safe(href) else "")
                    tok.attrSet("rel", "noopener noreferrer nofollow")
                elif tok.type == "image":
                    src = str(tok.attrGet("src") or "")
                    link = Token("link_open", "a", 1)
                    link.attrSet("href", src if _safe(src) else "")
                    link.attrSet("rel", "noopener noreferrer nofollow")
                    text = Token("text", "", 0)
                    text.content = tok.content or src
                    out += [link, text, Token("link_close", "a", -1)]
                    continue
                out.append(tok)
            block.children = out

    md.core.ruler.push("llmgw_safe_links", links_and_images)
    return md


_MD = _md()


def render_markdown(text: str) -> str:
    return _MD.render(text)
