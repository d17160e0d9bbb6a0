"""The mirror's management API (:8082), and how the mirror reads the control plane's catalog.

The API is what the control plane's mirror page drives: list what is held or
arriving, start a download, follow it, remove a version. It answers JSON;
errors travel as ``{"error": {"message": SENTENCE}}``.

Access: every route but ``/v1/health`` (a probe) needs a credential: the
bearer token kept in the API token file (made at the first start, mode 0600,
beside the mirror's directory, never inside it: the byte port serves that), or,
on a TLS listener, a client certificate from the fleet's CA issued to one of
the names given (``control-plane`` by default; a node's certificate is not
one). Before the credential is looked at, what only a browser sends is refused
(``llmgw.webguard``: a foreign Origin, a Host that is not this machine, a write
that is not JSON). ``--api-allow`` is a network filter in front of all of it:
loopback and the listed networks reach the API, others get 403; being on one
of them is not a credential.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import ssl
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote, unquote, urlsplit

import httpx
import orjson
from aiohttp import web
from pydantic import BaseModel, ValidationError

from llmgw.files import SecretFileError, new_token, read_secret_file, same_secret, token_digest, write_secret_file
from llmgw.mirror.layout import MirrorError
from llmgw.pki import peer_node_id
from llmgw.protocol.admin import ModelsReply, Removed
from llmgw.protocol.mirror_api import MirrorFetchRequest, MirrorFile, MirrorHealth, MirrorListing, MirrorVersion
from llmgw.webguard import bearer_token, guard_for, machine_names

if TYPE_CHECKING:
    from llmgw.mirror.fetcher import FileStatus, VersionStatus

FORBIDDEN = "this mirror is managed by its control plane only"
TOKEN_PREFIX = "llmgw-mirror-"
TOKEN_SUFFIX = ".api-token"
DEFAULT_TLS_CLIENTS = ("control-plane",)
# A probe (systemd, a load balancer, `llmgw up` waiting for it): it says only whether the directory reads.
OPEN_PATHS = frozenset({"/v1/health"})

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def _dumps(obj: object) -> str:
    return orjson.dumps(obj).decode()


def error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status, dumps=_dumps)


def error_body(status: int, message: str, code: str) -> bytes:
    """A request refused below the handlers (one aiohttp could not parse), in this API's shape."""
    return orjson.dumps({"error": {"message": message, "code": code}})


# ---------------------------------------------------------------- shapes


def reply(body: BaseModel, status: int = 200) -> web.Response:
    """A reply body as protocol.mirror_api defines it: a field left unset is absent."""
    return web.json_response(body.model_dump(mode="json", exclude_unset=True), status=status, dumps=_dumps)


def mirror_file(f: FileStatus) -> MirrorFile:
    said = {key: getattr(f, key) for key in ("sha256", "reason", "source") if getattr(f, key, None)}
    return MirrorFile(
        name=f.name, state=f.state, bytes=f.size, bytes_done=f.bytes_done, bytes_total=f.bytes_total, **said
    )


def mirror_version(vs: VersionStatus) -> MirrorVersion:
    """A version as the API shows it: state (the worst of its files), sizes, files."""
    v = MirrorVersion(
        model=vs.model, version=vs.version, state=vs.state, bytes=vs.size, files=[mirror_file(f) for f in vs.files]
    )
    if vs.state == "fetching":
        v.bytes_done = sum(f.bytes_done or 0 for f in vs.files)
        totals = [f.bytes_total for f in vs.files]
        v.bytes_total = None if any(t is None for t in totals) else sum(t or 0 for t in totals)
    if vs.reason:
        v.reason = vs.reason
    return v


_FETCH_SHAPE = '{"source": URL, "model": NAME, "version": NAME}'


def _fetch_refusal(exc: ValidationError) -> str:
    """The first thing wrong with a fetch's body, in the words the API has always used."""
    loc = exc.errors()[0]["loc"]
    key = loc[0] if loc else None
    if key in ("source", "model", "version"):
        return f'"{key}" is required, as a string: {_FETCH_SHAPE}'
    if key == "as":
        return '"as" is a file name, a string'
    if key == "anyway":
        return '"anyway" is true or false'
    return f"the body must be an object: {_FETCH_SHAPE}"


def source_url(base: str, model: str, version: str, files: list[str]) -> str:
    """The source a catalog entry should use: the file for one, the version (ending in /) for several."""
    prefix = f"{base.rstrip('/')}/{quote(model, safe='')}/{quote(version, safe='')}/"
    return prefix + quote(files[0], safe="") if len(files) == 1 else prefix


# ---------------------------------------------------------------- access control


def peer_allowed(peer: str | None, allow: Iterable[Network]) -> bool | None:
    """True for loopback and the allowed networks, False for others, None when the peer is unreadable."""
    if not peer:
        return None
    try:
        ip = ipaddress.ip_address(peer.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback or any(ip in net for net in allow)


def default_token_file(root: str | os.PathLike[str]) -> Path:
    """Where the API token lives unless told: beside the mirror's directory, ``<dir>.api-token``
    (``/srv/models`` → ``/srv/models.api-token``): outside what the byte port serves, and
    found from ``--dir`` alone by every command that needs it."""
    p = Path(os.path.abspath(root))
    if not p.name:
        raise MirrorError(
            f"the mirror's directory is {p}, so there is no place beside it for the API token; "
            "pass --api-token-file PATH"
        )
    return p.with_name(p.name + TOKEN_SUFFIX)


def check_token_place(path: str | os.PathLike[str], root: str | os.PathLike[str]) -> Path:
    """``path``, unless it lies inside ``root``, where the byte port would hand it to anyone."""
    p, r = Path(os.path.realpath(path)), Path(os.path.realpath(root))
    if p == r or r in p.parents:
        raise MirrorError(
            f"--api-token-file {path} is inside the mirror's directory {root}, which the byte port "
            f"serves to anyone; keep it outside, e.g. {default_token_file(root)}"
        )
    return Path(path)


def ensure_token(path: str | os.PathLike[str]) -> tuple[str, bool]:
    """(the token in ``path``, whether it was made now): a file that is missing gets a new
    random token, mode 0600; one that exists must be only its owner's."""
    p = Path(path)
    if not p.exists():
        token = new_token(TOKEN_PREFIX)
        try:
            write_secret_file(p, token)
        except OSError as exc:
            raise MirrorError(
                f"cannot create the API token file {p} ({exc.strerror or exc}); run as a user that "
                "may write there (`llmgw mirror init` makes it as root), or pass --api-token-file PATH"
            ) from None
        return token, True
    try:
        return read_secret_file(p), False
    except SecretFileError as exc:
        raise MirrorError(f"the API token file {exc}") from None


@dataclass(frozen=True)
class ApiAccess:
    """What the management API accepts as a credential, and the names it answers to.

    ``names``: host names besides this machine's own (the bind host, the
    ``--base`` host, ``--api-name``); ``tls_clients``: the certificate names
    that are a credential when the listener has TLS (empty: certificates are not).
    """

    token: str
    token_file: str
    names: tuple[str, ...] = ()
    tls_clients: tuple[str, ...] = ()

    def how_to(self) -> str:
        how = (
            f"the mirror's management API needs a credential: send 'Authorization: Bearer <token>' with the "
            f"token in {self.token_file} on the mirror's machine (the control plane reads a copy of it named by "
            "mirror.token_file in server.yaml)"
        )
        if self.tls_clients:
            how += f", or present a client certificate from the fleet's CA issued to {' or '.join(self.tls_clients)}"
        return how

    def middleware(self):
        digest = token_digest(self.token)
        clients = frozenset(self.tls_clients)

        async def authenticate(request: web.Request) -> str | None:
            if clients and request.transport is not None:
                name = peer_node_id(request.transport.get_extra_info("ssl_object"))
                if name is not None and name in clients:
                    return f"certificate {name}"
            token = bearer_token(request)
            # Digests compared, so the comparison takes as long whatever the guess.
            if token is not None and same_secret(token_digest(token), digest):
                return "token"
            return None

        return guard_for(
            machine_names(*self.names),
            authenticate,
            self.how_to(),
            _guard_error,
            OPEN_PATHS,
            names_hint="add others with `llmgw mirror serve --api-name NAME`",
            credential_code="credential_required",
        ).middleware()


def _guard_error(status: int, message: str, code: str) -> web.Response:
    resp = web.json_response({"error": {"message": message, "code": code}}, status=status, dumps=_dumps)
    if status == 401:
        resp.headers["WWW-Authenticate"] = 'Bearer realm="llmgw mirror"'
    return resp


def allow_list_middleware(allow: list[Network]):
    @web.middleware
    async def only_allowed(request: web.Request, handler):
        ok = peer_allowed(request.remote, allow)
        if ok is None:
            return error(403, "forbidden")
        if not ok:
            return error(403, FORBIDDEN)
        return await handler(request)

    return only_allowed


# ---------------------------------------------------------------- the app


def api_app(
    manager, root: str | os.PathLike[str], base: str, access: ApiAccess, *, allow: list[Network] | None = None
) -> web.Application:
    """The management API over ``manager`` (a llmgw.mirror.fetcher.Manager), behind ``access``.

    ``allow``: when given (even empty), only loopback and these networks reach it at all.
    """
    root = Path(root)
    # The network filter first (outsiders learn nothing more), then the guard on every route.
    middlewares = [allow_list_middleware(allow)] if allow is not None else []
    middlewares.append(access.middleware())
    app = web.Application(middlewares=middlewares)

    async def models(request: web.Request) -> web.Response:
        return reply(MirrorListing(base=base, models=[mirror_version(v) for v in manager.list()]))

    async def add(request: web.Request) -> web.Response:
        try:
            body = await request.json(loads=orjson.loads)
        except (ValueError, orjson.JSONDecodeError):
            return error(400, f"the body is not JSON; send {_FETCH_SHAPE}")
        try:
            req = MirrorFetchRequest.model_validate(body)
        except ValidationError as exc:
            return error(400, _fetch_refusal(exc))
        model, version = req.model, req.version
        try:
            vs = await manager.fetch(req.source, model, version, as_name=req.as_ or None, anyway=req.anyway)
        except MirrorError as exc:
            held = manager.status(model, version)
            return error(409 if held is not None else 400, str(exc))
        v = mirror_version(vs)
        v.url = source_url(base, model, version, [f.name for f in vs.files])
        return reply(v, status=202)

    async def one(request: web.Request) -> web.Response:
        m, v = request.match_info["model"], request.match_info["version"]
        vs = manager.status(m, v)
        if vs is None:
            return error(404, f"the mirror holds no {m}/{v}")
        return reply(mirror_version(vs))

    async def remove(request: web.Request) -> web.Response:
        m, v = request.match_info["model"], request.match_info["version"]
        if manager.status(m, v) is None:
            return error(404, f"the mirror holds no {m}/{v}")
        try:
            await manager.remove(m, v)
        except MirrorError as exc:
            return error(409, str(exc))
        return reply(Removed(removed=f"{m}/{v}"))

    async def health(request: web.Request) -> web.Response:
        try:
            await asyncio.to_thread(os.listdir, root)
        except OSError as exc:
            return error(503, f"cannot read {root}: {exc.strerror or exc}")
        return reply(MirrorHealth(status="ok", dir=str(root)))

    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/models", add)
    app.router.add_get("/v1/models/{model}/{version}", one)
    app.router.add_delete("/v1/models/{model}/{version}", remove)
    app.router.add_get("/v1/health", health)
    return app


# ---------------------------------------------------------------- the control plane's catalog


class CatalogUnreadable(MirrorError):
    """The catalog could not be read."""


def read_catalog_sources(
    server: str,
    *,
    tokens: Iterable[str] = (),
    verify: ssl.SSLContext | bool = True,
    timeout: float = 10.0,
    transport: httpx.BaseTransport | None = None,
) -> list[str]:
    """Every model's ``source`` from the control plane's admin API (GET /api/v1/models),
    with the first of ``tokens`` (admin tokens, in the order found) that it accepts."""
    url = server if "://" in server else f"http://{server}"
    url = url.rstrip("/") + "/api/v1/models"
    creds: list[str | None] = list(tokens) or [None]
    try:
        with httpx.Client(timeout=timeout, transport=transport, verify=verify) as client:
            for token in creds:
                resp = client.get(url, headers={"Authorization": f"Bearer {token}"} if token else {})
                if resp.status_code != 401:
                    break
    except httpx.HTTPError as exc:
        raise CatalogUnreadable(f"{url}: {exc or type(exc).__name__}") from None
    if resp.status_code == 401:
        raise CatalogUnreadable(
            f"{url} answered 401: it needs an admin token; pass --token-file or set "
            "LLMGW_ADMIN_TOKEN (on the control plane, its data_dir/admin-token is found by itself)"
        )
    if resp.status_code != 200:
        raise CatalogUnreadable(f"{url} answered {resp.status_code} {resp.reason_phrase}")
    try:
        return [m.source for m in ModelsReply.model_validate(resp.json()).models if m.source is not None]
    except (ValueError, ValidationError):
        raise CatalogUnreadable(f"{url} did not answer with a list of models") from None


def references(sources: Iterable[str], base: str) -> set[tuple[str, ...]]:
    """What catalog sources refer to on this mirror, by path: ``(model, version)``
    for a whole version, ``(model, version, file)`` for one file.

    Scheme, host and a trailing slash do not matter; a source whose path is not
    under ``base``'s path, or is not two or three levels deep, refers to nothing here.
    """
    prefix = [s for s in urlsplit(base).path.split("/") if s]
    refs: set[tuple[str, ...]] = set()
    for source in sources:
        if "://" not in source:
            continue
        segs = [unquote(s) for s in urlsplit(source).path.split("/") if s]
        if segs[: len(prefix)] != prefix:
            continue
        rest = tuple(segs[len(prefix) :])
        if len(rest) in (2, 3):
            refs.add(rest)
    return refs


def is_referenced(refs: set[tuple[str, ...]], model: str, version: str, name: str) -> bool:
    return (model, version) in refs or (model, version, name) in refs
