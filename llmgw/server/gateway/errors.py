"""Errors in the shape each API's clients parse: OpenAI's {"error": {"message", "type", "code"}}
everywhere, and Anthropic's {"type": "error", "error": {"type", "message"}} on the Messages routes."""

from __future__ import annotations

import logging

import orjson
from aiohttp import web

from llmgw.httpserve import ErrorBody, route_of
from llmgw.server.gateway.checks import BadInput
from llmgw.server.gateway.limits import LimitError
from llmgw.server.gateway.messages_api import error_body as anthropic_error_body

log = logging.getLogger("llmgw.gateway")

# Sent by Anthropic's SDKs on every request: GET /v1/models answers them in their shape.
ANTHROPIC_VERSION = "anthropic-version"

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
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


def speaks_anthropic(request: web.BaseRequest) -> bool:
    """Whether a request was made to Anthropic's API here, so its errors take Anthropic's shape:
    the Messages routes (/v1/messages and what is below it), and /v1/models asked by Anthropic's
    SDKs. Decided from the request alone, so that errors raised before or outside a handler (a
    broken body, a bug) are shaped as the handler's own refusals are."""
    path = request.path
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return True
    return (path == "/v1/models" or path.startswith("/v1/models/")) and ANTHROPIC_VERSION in request.headers


def error_body_for(request: web.BaseRequest) -> ErrorBody:
    """The error shape of the API a request was made to (httpserve's Runner asks for it)."""
    if speaks_anthropic(request):
        return lambda status, message, code: anthropic_error_body(status, message)
    return error_body


def refuse_input(request: web.BaseRequest, exc: BadInput, *, anthropic: bool) -> web.Response:
    """The answer to input no route can take, and its one line in the log (never the body)."""
    log.info(
        "refused a request from %s to %s %s: %s (%s)",
        request.remote,
        request.method,
        route_of(request),
        exc.message[:300],
        exc.code,
    )
    return error_response(exc.status, exc.message, exc.code, exc.param, anthropic=anthropic)
