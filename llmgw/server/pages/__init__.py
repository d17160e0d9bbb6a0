"""The pages on the client port (docs/pages.md)."""

from llmgw.errors import LlmgwError


class PageError(LlmgwError):
    """A page refused what a form asked for; the message is shown on the page."""


__all__ = ["PageError"]
