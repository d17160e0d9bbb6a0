"""Where the mirror may fetch from: not from this machine, not from link-local addresses.

Whatever the mirror fetches it republishes on its byte listener, which answers
anyone who reaches it without a credential. A source on this machine's
loopback (a service that trusts loopback) or on a link-local address (a
cloud's metadata service, 169.254.169.254, hands out credentials) would make
the mirror a way to read what only this machine may. So those addresses are
refused unless the operator started the mirror with ``--allow-local-sources``.

The check is made on the addresses a host name resolves to at the moment of
each request, every hop of a redirect included (Hugging Face lookups, the GGUF
header check, the download), and the connection is then made to the checked
address itself, so a name that resolves elsewhere a moment later (DNS
rebinding) cannot slip past. The Hugging Face endpoint the operator configured
(``HF_ENDPOINT``) is the operator's own choice and is fetched from even on
loopback; a redirect from it to another local address is still refused.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import urllib.request
from collections.abc import Awaitable, Callable, Iterable
from urllib.parse import urlsplit

import httpcore
import httpx

from llmgw.mirror.layout import MirrorError

log = logging.getLogger(__name__)

ALLOW_FLAG = "--allow-local-sources"

_LOCAL = (
    (ipaddress.ip_network("127.0.0.0/8"), "a loopback address (this machine)"),
    (ipaddress.ip_network("::1/128"), "a loopback address (this machine)"),
    # Connecting to 0.0.0.0 (or ::) reaches this machine on Linux.
    (ipaddress.ip_network("0.0.0.0/8"), "an unspecified address (it reaches this machine)"),
    (ipaddress.ip_network("::/128"), "an unspecified address (it reaches this machine)"),
    (ipaddress.ip_network("169.254.0.0/16"), "a link-local address (where cloud metadata services answer)"),
    (ipaddress.ip_network("fe80::/10"), "a link-local address"),
)

Resolve = Callable[[str, int], Awaitable[list[str]]]


class SourceRefused(MirrorError):
    """A fetch would reach a local address the operator did not allow."""


def local_kind(address: str) -> str | None:
    """What kind of local address ``address`` is (words for a refusal), or None when it is not one."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # ::ffff:127.0.0.1 is 127.0.0.1
    for net, words in _LOCAL:
        if ip.version == net.version and ip in net:
            return words
    return None


async def system_resolve(host: str, port: int) -> list[str]:
    """The addresses of ``host``, in the order the system prefers them."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    seen: list[str] = []
    for info in infos:
        addr = str(info[4][0]).split("%", 1)[0]
        if addr not in seen:
            seen.append(addr)
    return seen


def _host_port(url: httpx.URL) -> tuple[str, int]:
    return url.host.lower(), url.port or (443 if url.scheme == "https" else 80)


def _endpoint(url: str) -> tuple[str, int] | None:
    # An endpoint that does not parse trusts nothing; its own requests then fail in words.
    try:
        u = httpx.URL(url)
    except httpx.InvalidURL:
        return None
    return _host_port(u) if u.host else None


class SourcePolicy:
    """Which addresses a fetch may connect to.

    ``allow_local``: the operator's ``--allow-local-sources``; ``trusted``:
    URLs the operator configured (the Hugging Face endpoint), whose host and
    port are connected to wherever they resolve.
    """

    def __init__(
        self, *, allow_local: bool = False, trusted: Iterable[str] = (), resolve: Resolve = system_resolve
    ) -> None:
        self.allow_local = allow_local
        self.trusted = frozenset(hp for hp in (_endpoint(u) for u in trusted) if hp is not None)
        self._resolve = resolve

    def exempt(self, host: str, port: int) -> bool:
        return self.allow_local or (host.lower(), port) in self.trusted

    async def addresses(self, host: str, port: int) -> list[str]:
        """Every address ``host`` resolves to, each checked; SourceRefused when any is local,
        httpcore.ConnectError when it resolves to nothing.

        One local address among public ones refuses the whole name: a name that
        answers both is the shape of a rebinding attack, not of a download site.
        """
        try:
            found = [str(ipaddress.ip_address(host))]
        except ValueError:
            found = await self._lookup(host, port)
        for addr in found:
            kind = local_kind(addr)
            if kind is not None:
                shown = host if host == addr else f"{host} ({addr})"
                raise SourceRefused(
                    f"{shown} is {kind}; the mirror does not fetch from this machine or from link-local "
                    "addresses, since what it fetches is served to anyone who reaches its byte port. "
                    f"If this source is yours, start the mirror with {ALLOW_FLAG}."
                )
        return found

    async def _lookup(self, host: str, port: int) -> list[str]:
        try:
            found = await self._resolve(host, port)
        except OSError as exc:
            raise httpcore.ConnectError(f"{host} could not be resolved ({exc.strerror or exc})") from None
        if not found:
            raise httpcore.ConnectError(f"{host} resolves to no address")
        return found

    async def check(self, source: str) -> None:
        """Refuse ``source`` at once (before a download starts) when its host is local."""
        try:
            url = httpx.URL(source)
        except httpx.InvalidURL as exc:
            raise MirrorError(f"{source!r} is not a URL that can be fetched ({exc}); check it") from None
        if not url.host or self.exempt(*_host_port(url)):
            return
        try:
            await self.addresses(*_host_port(url))
        except SourceRefused as exc:
            raise SourceRefused(f"{_plain(url)}: {exc}") from None
        except httpcore.ConnectError:
            pass  # unresolvable: the download says so in its own words


def _plain(url: httpx.URL) -> str:
    # Without its query: a signed URL's token is nobody's business in an error message.
    return str(url.copy_with(query=None, fragment=None))


class _CheckedBackend(httpcore.AsyncNetworkBackend):
    """Connects to a name only through the addresses the policy checked, so what was
    checked is what is connected to (a name cannot resolve elsewhere in between)."""

    def __init__(self, policy: SourcePolicy, inner: httpcore.AsyncNetworkBackend | None = None) -> None:
        self.policy = policy
        self._inner = inner or httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        if self.policy.exempt(host, port):
            return await self._inner.connect_tcp(host, port, timeout, local_address, socket_options)
        last: Exception | None = None
        for addr in await self.policy.addresses(host, port):
            try:  # the name's next address when one cannot be reached, as a browser would
                return await self._inner.connect_tcp(addr, port, timeout, local_address, socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                last = exc
        assert last is not None
        raise last

    async def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None
    ) -> httpcore.AsyncNetworkStream:
        return await self._inner.connect_unix_socket(path, timeout, socket_options)

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


class GuardedTransport(httpx.AsyncBaseTransport):
    """An httpx transport that connects only where ``policy`` allows, checked per connection.

    TLS is unchanged: the connection is made to the checked address and the
    certificate verified against the host name. Proxies from the environment
    (``HTTPS_PROXY``, ``NO_PROXY``…) are honoured; through a proxy the name is
    checked as this machine resolves it, and the proxy makes the connection.
    ``network`` is what makes connections to checked addresses (a test's stand-in network).
    """

    def __init__(
        self,
        policy: SourcePolicy,
        *,
        proxies: dict[str, str] | None = None,
        network: httpcore.AsyncNetworkBackend | None = None,
    ) -> None:
        self.policy = policy
        self._direct = httpx.AsyncHTTPTransport()
        # httpx has no parameter for the network backend; its pool, built as httpx builds it, has one.
        self._direct._pool = httpcore.AsyncConnectionPool(
            ssl_context=httpx.create_ssl_context(), network_backend=_CheckedBackend(policy, network)
        )
        self._proxies: dict[str, httpx.AsyncBaseTransport] = {}
        env = urllib.request.getproxies() if proxies is None else proxies
        for scheme in ("http", "https", "all"):
            proxy = env.get(scheme)
            if not proxy:
                continue
            try:
                self._proxies[scheme] = httpx.AsyncHTTPTransport(proxy=proxy)
            except (ValueError, ImportError, httpx.InvalidURL) as exc:
                log.warning("mirror: the %s proxy %s is not used: %s", scheme, _no_userinfo(proxy), exc)

    def _proxy_for(self, url: httpx.URL) -> httpx.AsyncBaseTransport | None:
        if not self._proxies or urllib.request.proxy_bypass(url.host):
            return None
        return self._proxies.get(url.scheme) or self._proxies.get("all")

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        proxy = self._proxy_for(url)
        try:
            if proxy is None:
                return await self._direct.handle_async_request(request)
            if not self.policy.exempt(*_host_port(url)):
                try:
                    await self.policy.addresses(*_host_port(url))
                except httpcore.ConnectError:
                    pass  # not resolvable here: the proxy resolves it
            return await proxy.handle_async_request(request)
        except SourceRefused as exc:
            # Every hop of a redirect comes through here: the message names the one refused.
            raise SourceRefused(f"{_plain(url)}: {exc}") from None

    async def aclose(self) -> None:
        await self._direct.aclose()
        for t in self._proxies.values():
            await t.aclose()


def _no_userinfo(proxy: str) -> str:
    parts = urlsplit(proxy)
    if not parts.username:
        return proxy
    return parts._replace(netloc=(parts.hostname or "") + (f":{parts.port}" if parts.port else "")).geturl()
