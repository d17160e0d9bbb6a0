"""Errors in the shape each API's clients parse: OpenAI's {"error": {"message", "type", "code"}}
everywhere, and Anthropic's {"type": "error", "error": {"type", "message"}} on the Messages routes."""

from __future__ import annotations

import orjson
from aiohttp import web

from llmgw.server.gateway.limits import LimitError
from llmgw.server.gateway.messages_api import error_body as anthropic_error_body

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "client_closed_request",
    500: "server_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout",
}


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> bytes:
    return orjson.dumps(
        {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": param, "code": code}}
    )


def error_response(
    status: int,
    message: str,
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
    *,
    anthropic: bool = False,
) -> web.Response:
    body = anthropic_error_body(status, message) if anthropic else error_body(status, message, code, param)
    return web.Response(status=status, body=body, content_type="application/json", headers=headers)


def limit_response(exc: LimitError, *, anthropic: bool = False) -> web.Response:
    """A refusal by the key's limits (429 with Retry-After and x-ratelimit-*, or 403 for a model it
    may not use): the one shape every route answers it in."""
    return error_response(exc.status, exc.message, exc.code, headers=exc.headers or None, anthropic=anthropic)
