"""How every HTTP listener of llmgw runs (the server's four, the mirror's two).

aiohttp's defaults are wrong for a public listener in three places, fixed here
once for all of them:

- A request its parser refuses (a header or request line too long, too many
  headers, a bad request line, a byte HTTP forbids) never reaches a handler or
  a middleware. aiohttp answers it in plain text that echoes the offending
  line and logs a traceback holding the same bytes: an API key, when the bad
  byte follows one. aiohttp has no hook for this (aio-libs/aiohttp#3287), so
  the listeners here run a connection class whose ``handle_error`` answers in
  the listener's own JSON error shape and logs one line naming the kind of
  fault, never the request's bytes.
- Every response says ``Server: Python/3.x aiohttp/3.y``; here it says ``llmgw``.
- A response finished after shutdown began still invites keep-alive, although
  aiohttp closes the connection right after it; a client reusing it is reset.
  While a runner drains, every response carries ``Connection: close``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import Any

from aiohttp import hdrs, web
from aiohttp.http_exceptions import (
    BadHttpMethod,
    BadStatusLine,
    ContentEncodingError,
    HttpProcessingError,
    InvalidHeader,
    InvalidURLError,
    LineTooLong,
)
from aiohttp.web_protocol import RequestHandler

log = logging.getLogger("llmgw.http")

BAD_BODY = "the request body could not be read (its chunks or compression are broken)"

SERVER = "llmgw"

# (status, message, code) -> the body of an error response (JSON).
ErrorBody = Callable[[int, str, str], bytes]
# A request -> the error body of the API it was made to, for a listener serving more than one.
ErrorBodyFor = Callable[[web.BaseRequest], ErrorBody]

# Refusals aiohttp raises with a fixed text (none of them holds request bytes) and
# the sentence a client gets instead. Everything else the parser raises carries the
# offending bytes in its message, so only its class (or llhttp's reason) is used.
_FIXED: dict[str, tuple[str, str]] = {
    "Missing 'Host' header in request.": ("missing_host", "the request has no Host header"),
    "Request has invalid `Transfer-Encoding`": (
        "bad_transfer_encoding",
        "the request's Transfer-Encoding is not one this server reads",
    ),
    "Data after `Connection: close`": ("data_after_close", "the request sent data after `Connection: close`"),
    "Bad line ending, expected CRLF": ("bad_line_ending", "a line of the request does not end in CRLF"),
}


def describe(exc: HttpProcessingError, max_headers: int) -> tuple[str, str]:
    """(code, sentence) for a request the parser refused; neither holds a byte of the request."""
    if isinstance(exc, LineTooLong):
        limit = exc.args[1] if len(exc.args) > 1 and isinstance(exc.args[1], int) else None
        size = f" {limit} bytes" if limit else " the limit"
        return "header_too_large", f"a header or the request line is longer than{size}"
    if isinstance(exc, BadHttpMethod) and exc.message == "Received HTTPS traffic on an HTTP port":
        return "https_on_http_port", "this port speaks plain HTTP, not HTTPS"
    if isinstance(exc, (BadStatusLine, InvalidURLError)):
        return "bad_request_line", "the request line is not `METHOD /path HTTP/1.1`"
    if isinstance(exc, InvalidHeader):
        return "bad_header", "a header is malformed or holds a byte HTTP does not allow"
    if isinstance(exc, ContentEncodingError):
        if "Please install" in str(exc.message):
            # At the headers: an encoding this build has no decoder for (br, zstd).
            return (
                "unsupported_encoding",
                "the request's Content-Encoding is not one this server reads; "
                "send the body as it is, or in gzip or deflate",
            )
        # A deflate stream that stops short of its end, found when the body ends.
        return "bad_body", BAD_BODY
    text = exc.message if isinstance(exc.message, str) else ""
    # llhttp's refusals read "<reason>:\n\n  <the bytes>\n  <pointer>": its reason is a
    # fixed string, the rest is the request's own bytes. aiohttp's own have no bytes.
    reason, sep, _ = text.partition(":\n")
    if reason == "Too many headers received":
        return "too_many_headers", f"the request has more than {max_headers} headers"
    fixed = _FIXED.get(reason)
    if fixed is not None:
        return fixed
    if not sep and text.startswith("Duplicate '") and text.endswith("' header found."):
        # The name is one of the few headers that may appear once (Host, Content-Length...).
        return "duplicate_header", f"the request repeats the {text[len('Duplicate ') : -len(' found.')]}"
    if sep and reason and len(reason) <= 60 and reason.replace(" ", "").replace("-", "").isalpha():
        if "header" in reason.lower():
            return "bad_header", f"a header is malformed or holds a byte HTTP does not allow ({reason.lower()})"
        return "invalid_http", f"the request is not valid HTTP/1.1 ({reason.lower()})"
    return "invalid_http", "the request is not valid HTTP/1.1"


def route_of(request: web.BaseRequest) -> str:
    """The route a request matched, as written (/claim/{token}), never its path: a path may carry a secret."""
    info = getattr(request, "match_info", None)
    route = getattr(info, "route", None)
    resource = getattr(route, "resource", None)
    return resource.canonical if resource is not None else "?"


class _Protocol(RequestHandler):
    """aiohttp's connection, with errors raised below the handlers answered our way."""

    __slots__ = ("_error_body", "_error_body_for", "_target")

    def __init__(
        self, manager: web.Server, *, error_body: ErrorBody, error_body_for: ErrorBodyFor | None, **kwargs: Any
    ) -> None:
        super().__init__(manager, **kwargs)
        self._error_body = error_body
        self._error_body_for = error_body_for
        self._target = b""

    def data_received(self, data: bytes) -> None:
        if self._error_body_for is not None and self._current_request is None and not self._messages:
            # The path of the request these bytes begin: a refusal of the parser (a deflate body
            # sent with its headers that stops short) comes with no request to take its shape
            # from. Only the shape is chosen by it.
            self._target = data[:512].split(b" ", 2)[1] if data.count(b" ", 0, 512) >= 2 else b""
        queued = len(self._messages)
        super().data_received(data)
        # A deflate stream that stops short is found when its body ends, and aiohttp's parser
        # then queues the refusal as a message of its own, behind the request whose body it is:
        # that request's handler would wait for the rest of its body until the client gave up.
        # No next message can be parsed before a body ends, so a message queued while the body
        # being read is unfinished is that refusal; the body fails instead, as a broken gzip
        # body does, and is answered in the route's own shape.
        request = self._current_request
        if len(self._messages) > queued and request is not None:
            body = request.content
            if not body.is_eof() and body.exception() is None:
                body.set_exception(web.RequestPayloadError(BAD_BODY))

    def log_exception(self, *args: Any, **kw: Any) -> None:
        if isinstance(kw.get("exc_info"), web.RequestPayloadError):
            # aiohttp reads what is left of a body after the response, and a broken one raises
            # there: the client's fault, already answered; the connection just closes.
            log.debug("dropped the rest of a request body that could not be read")
            return
        super().log_exception(*args, **kw)

    def handle_error(
        self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        # `message` and the exception's own text hold the request's bytes; neither is used.
        if isinstance(exc, HttpProcessingError):
            code, text = describe(exc, self.max_headers)
            status = 415 if code == "unsupported_encoding" else exc.code if 400 <= exc.code < 500 else 400
            # What scanners and TLS clients send to a plain port as their first bytes: noise
            # on a public listener, so it is logged only when debugging (as aiohttp does).
            level = logging.DEBUG if isinstance(exc, BadHttpMethod) and self._request_count == 1 else logging.INFO
            log.log(level, "refused a request from %s: %s (%s)", request.remote, text, code)
        elif isinstance(exc, web.RequestPayloadError):
            # The body broke off or would not decode (chunks, compression): the client's fault,
            # raised where a handler reads it. Its text may quote the body, so it is not used.
            status, code, text = 400, "bad_body", BAD_BODY
            log.info(
                "refused a request from %s to %s %s: %s (%s)",
                request.remote,
                request.method,
                route_of(request),
                text,
                code,
            )
        elif status == 504:
            code, text = "timeout", "the server took too long to answer"
            log.warning("%s %s from %s: the handler timed out", request.method, route_of(request), request.remote)
        else:
            # A handler raised: a bug, whose traceback is worth having. The route is named
            # as written, not the request's path, which may hold a secret (a claim link).
            status, code, text = 500, "internal_error", "the server failed on this request; the log says why"
            log.error("%s %s from %s failed", request.method, route_of(request), request.remote, exc_info=exc)
        if request.writer.output_size > 0:
            # The response has begun: the connection cannot carry another (as aiohttp does).
            raise ConnectionError("the response has begun; the error cannot be sent")
        # A refusal of the parser has no route yet (aiohttp hands over a stand-in request for "/"):
        # it takes the listener's own shape.
        shape = (
            self._error_body if self._error_body_for is None else self._error_body_for(self._shaped_by(request, exc))
        )
        resp = web.Response(
            status=status,
            body=shape(status, text, code),
            content_type="application/json",
            headers={hdrs.SERVER: SERVER, hdrs.CONNECTION: "close"},
        )
        resp.force_close()
        return resp

    def _shaped_by(self, request: web.BaseRequest, exc: BaseException | None) -> web.BaseRequest:
        """The request whose API an error answer speaks: for a refusal of the parser, aiohttp's
        stand-in for "/" with the path these bytes asked for."""
        if not isinstance(exc, HttpProcessingError) or not self._target.startswith(b"/"):
            return request
        try:
            return request.clone(rel_url=self._target.decode("ascii"))
        except (ValueError, RuntimeError):  # not a path yarl reads: the listener's own shape
            return request


class _Server(web.Server):
    """aiohttp's low-level server, with connections of our class."""

    def __init__(self, base: web.Server, error_body: ErrorBody, error_body_for: ErrorBodyFor | None) -> None:
        # The application built `base` with every setting aiohttp derives (debug, handler
        # arguments, access log); it has no parameter for the connection class.
        super().__init__(
            base.request_handler,
            request_factory=base.request_factory,
            handler_cancellation=base.handler_cancellation,
            loop=base._loop,
            **base._kwargs,
        )
        self.error_body = error_body
        self.error_body_for = error_body_for

    def __call__(self) -> RequestHandler:
        return _Protocol(
            self, loop=self._loop, error_body=self.error_body, error_body_for=self.error_body_for, **self._kwargs
        )


class Runner(web.AppRunner):
    """An AppRunner for one listener: llmgw's error answers, Server header and drain.

    ``error_body_for``, given, picks the shape for each request a handler or its body failed on
    (a listener serving two APIs); ``kwargs`` go to aiohttp's AppRunner (``shutdown_timeout``,
    ``handler_cancellation``...); access logging is off, as the gateway keeps its own records.
    """

    def __init__(
        self, app: web.Application, error_body: ErrorBody, error_body_for: ErrorBodyFor | None = None, **kwargs: Any
    ) -> None:
        kwargs.setdefault("access_log", None)
        super().__init__(app, handle_signals=False, **kwargs)
        self.error_body = error_body
        self.error_body_for = error_body_for
        self.draining = False
        app.on_response_prepare.append(self._on_prepare)

    async def _on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        # Headers are decided by now but not yet written: both can still change.
        response.headers[hdrs.SERVER] = SERVER
        if self.draining and response.status != 101:  # a WebSocket's 101 must keep `Connection: upgrade`
            response.headers[hdrs.CONNECTION] = "close"
            response.force_close()

    async def _make_server(self) -> web.Server:
        return _Server(await super()._make_server(), self.error_body, self.error_body_for)


def begin_drain(runners: Iterable[web.BaseRunner]) -> None:
    """From now on every response of these runners closes its connection, and says so."""
    for r in runners:
        if isinstance(r, Runner):
            r.draining = True


async def drain(runners: Iterable[web.BaseRunner]) -> None:
    """Stop the runners together: each stops accepting, closes its idle connections and
    gives running requests its shutdown_timeout, all at once rather than one after another."""
    runners = list(runners)
    begin_drain(runners)
    results = await asyncio.gather(*(r.cleanup() for r in runners), return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
