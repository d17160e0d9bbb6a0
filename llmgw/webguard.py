"""The guard in front of every management API (the control plane's admin API, the mirror's).

Being reachable is not a credential: a web page open in the operator's browser
reaches 127.0.0.1 too. So a request must carry a credential (a bearer token,
or a client certificate checked by the TLS handshake), and what only a browser
or a DNS-rebinding page sends is refused before the credential is looked at:

- a ``Host`` that is not an address or a name this listener is known by (a
  rebinding page's requests carry the attacker's name);
- an ``Origin`` other than the listener itself, or ``Sec-Fetch-Site: cross-site``
  (a page elsewhere; the command-line clients send neither);
- a write (POST, PUT, PATCH) whose body is not ``application/json`` (the forms
  and ``text/plain`` posts a page can send without a CORS preflight).
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from aiohttp import web
from aiohttp.typedefs import Middleware

from llmgw.errors import LlmgwError

WRITE_METHODS = frozenset({"POST", "PUT", "PATCH"})

# Where a guarded handler finds who called it ("token adm-…", "certificate admin").
CALLER = web.RequestKey("llmgw.caller", str)

ErrorFactory = Callable[[int, str, str], web.StreamResponse]
Authenticate = Callable[[web.Request], Awaitable[str | None]]


class CredentialRefused(LlmgwError):
    """Raised by an ``authenticate`` that recognised a credential and refuses it: the caller reads this
    sentence (what was wrong with it, how to get a good one) instead of the listener's general how-to."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


def machine_names(*extra: str | None) -> frozenset[str]:
    """The names this machine answers to, lowercased, plus ``extra`` (a bind host, configured names)."""
    names = {"localhost", "localhost.localdomain"}
    for n in (socket.gethostname(), socket.getfqdn()):
        if n:
            names.add(n.lower())
    for e in extra:
        if e:
            names.add(e.lower().strip("[]"))
    return frozenset(names)


def bearer_token(request: web.Request) -> str | None:
    """The token of ``Authorization: Bearer <token>``, or None. Never raises: a header
    with bytes that are not ASCII is simply no token."""
    header = request.headers.get("Authorization")
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or not token.isascii() or not token.isprintable():
        return None
    return token


def _host_of(value: str) -> tuple[str, int | None] | None:
    """(host, port) of a Host header, or None when it cannot be read."""
    try:
        parts = urlsplit("//" + value)
        host = parts.hostname
        port = parts.port
    except ValueError:
        return None
    if not host:
        return None
    return host.lower(), port


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class Guard:
    """Checks every request of one listener; see the module's docstring for the rules.

    ``authenticate`` returns who the caller is (a token's id, a certificate's name) or
    None, or raises CredentialRefused to say why a credential it recognised is refused; ``how_to`` is the sentence a refused caller reads to get a credential;
    ``open_paths`` need no credential (probes such as /health), the other checks still apply;
    ``names_hint`` says where further names are configured, ``credential_code`` is the
    error code of a request without a credential.
    """

    names: frozenset[str]
    authenticate: Authenticate
    how_to: str
    error: ErrorFactory
    open_paths: frozenset[str] = frozenset()
    names_hint: str = "add others to admin_hosts in server.yaml"
    credential_code: str = "admin_credential_required"

    def host_allowed(self, host_header: str | None) -> bool:
        if not host_header:
            return False
        hp = _host_of(host_header)
        if hp is None:
            return False
        host = hp[0]
        # An address is what a rebinding page cannot present: its requests name its own domain.
        return _is_ip(host) or host in self.names

    def refusal(self, request: web.Request) -> tuple[int, str, str] | None:
        """(status, message, code) when the request is refused before its credential is looked at."""
        host = request.headers.get("Host")
        if not self.host_allowed(host):
            return (
                421 if host else 400,
                f"this API does not answer to the host name {host!r}; use this machine's address or name "
                f"({self.names_hint})"
                if host
                else "the request has no Host header",
                "host_not_allowed",
            )
        origin = request.headers.get("Origin")
        if origin is not None:
            own = _host_of(host or "")
            try:
                # Inside the try: urlsplit itself refuses some spellings ("http://[::1"), and a
                # header no browser would send is still only a refusal, never a 500.
                o = urlsplit(origin) if origin != "null" else None
                same = (
                    o is not None
                    and o.hostname is not None
                    and own is not None
                    and o.hostname.lower() == own[0]
                    and (o.port or _default_port(o.scheme)) == (own[1] or _default_port(request.scheme))
                )
            except ValueError:
                same = False
            if not same:
                return (
                    403,
                    f"requests from web pages ({origin}) are refused here; use llmgw ctl or send no Origin",
                    "cross_origin",
                )
        if request.headers.get("Sec-Fetch-Site") == "cross-site":
            return 403, "requests from web pages on other sites are refused here", "cross_origin"
        if request.method in WRITE_METHODS and request.content_type != "application/json":
            return (
                415,
                f"a {request.method} here must send its body as application/json "
                f"(this one is {request.content_type or 'without a type'})",
                "unsupported_media_type",
            )
        return None

    def middleware(self) -> Middleware:
        @web.middleware
        async def guard(
            request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
        ) -> web.StreamResponse:
            refused = self.refusal(request)
            if refused is not None:
                return self.error(*refused)
            if request.path not in self.open_paths:
                try:
                    who = await self.authenticate(request)
                except CredentialRefused as exc:
                    return self.error(401, str(exc), exc.code)
                if who is None:
                    return self.error(401, self.how_to, self.credential_code)
                request[CALLER] = who
            return await handler(request)

        return guard


def _default_port(scheme: str) -> int:
    return 443 if scheme == "https" else 80


def guard_for(
    names: Iterable[str],
    authenticate: Authenticate,
    how_to: str,
    error: ErrorFactory,
    open_paths: Iterable[str] = (),
    **wording: str,
) -> Guard:
    """``wording``: names_hint and credential_code, for a listener other than the admin API."""
    return Guard(frozenset(n.lower() for n in names), authenticate, how_to, error, frozenset(open_paths), **wording)
