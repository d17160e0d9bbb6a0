"""Who may use the admin API: an admin token, or an administrator's certificate (one the fleet's CA
marked as an administrator's) issued to a name listed in admin_tls.clients. A node's certificate
never is, whatever its name. Being on loopback is not a credential.

The first token is made at the server's first start and written, mode 0600, to
``data_dir/admin-token``, where `llmgw ctl` on this machine finds it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web

from llmgw.config.server import ADMIN_TOKEN_FILE
from llmgw.errors import LlmgwError
from llmgw.files import SecretFileError, read_secret_file
from llmgw.pki import client_kind, common_name, peer_certificate
from llmgw.server.gateway.errors import error_response
from llmgw.store.admin_tokens import ensure_token_file
from llmgw.webguard import CredentialRefused, Guard, bearer_token, guard_for, machine_names

if TYPE_CHECKING:
    from llmgw.config.server import ServerConfig
    from llmgw.store import Store

log = logging.getLogger("llmgw.server.admin")

# Probes a load balancer or systemd may call without a credential; everything else needs one.
OPEN_PATHS = frozenset({"/health", "/ready"})


class AccessError(LlmgwError):
    """The admin credential could not be set up; the message says what to change."""


def token_file(config: ServerConfig) -> Path:
    return Path(config.data_path) / ADMIN_TOKEN_FILE


async def ensure_first_token(store: Store, config: ServerConfig) -> Path:
    """Make the data directory and, at the first start, the first admin token in it.

    A token file that exists is left alone, even if its token was revoked: revoking it
    was someone's decision. Delete the file and restart to get a new one.
    """
    path = token_file(config)
    try:
        path.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
    except OSError as exc:
        raise AccessError(
            f"data_dir {path.parent}: cannot be created ({exc.strerror}); create it, owned by the "
            "user llmgw runs as, or set data_dir in server.yaml"
        ) from None
    if path.exists():
        try:
            read_secret_file(path)
        except SecretFileError as exc:
            log.warning("admin token file: %s", exc)
        return path
    try:
        await ensure_token_file(store, path, f"first token ({path})")
    except OSError as exc:
        raise AccessError(
            f"{path}: cannot be written ({exc.strerror}); make data_dir writable by the user llmgw runs as"
        ) from None
    log.info("made the first admin token in %s; llmgw ctl on this machine reads it from there", path)
    return path


class AdminAccess:
    """The admin listener's guard: browser refusals, then a token or a listed client certificate."""

    def __init__(self, store: Store, config: ServerConfig) -> None:
        self.store = store
        self.tls_clients = frozenset(config.admin_tls.clients) if config.admin_tls is not None else frozenset()
        names = machine_names(config.admin_listen.host, *config.admin_hosts)
        how = (
            f"the admin API needs a credential: send 'Authorization: Bearer <admin token>'. On the control plane "
            f"`llmgw ctl` reads {token_file(config)} by itself (as root or the server's user); "
            "`llmgw ctl token create NAME` makes another; pass one with --token-file or LLMGW_ADMIN_TOKEN"
        )
        if self.tls_clients:
            how += (
                f", or present an administrator's certificate issued to {' or '.join(sorted(self.tls_clients))} "
                "(`llmgw ctl cert issue-admin NAME`)"
            )
        self.guard: Guard = guard_for(names, self.authenticate, how, _error, OPEN_PATHS)
        self._unmarked_said: set[str] = set()  # listed names already logged as needing reissue

    async def authenticate(self, request: web.Request) -> str | None:
        refused: str | None = None
        if self.tls_clients and request.transport is not None:
            cert = peer_certificate(request.transport.get_extra_info("ssl_object"))
            name = None if cert is None else common_name(cert)
            if cert is not None and name is not None and name in self.tls_clients:
                kind = client_kind(cert)
                if kind == "admin":
                    return f"certificate {name}"
                refused = self._refusal(name, kind is None)
        token = bearer_token(request)
        tok = None if token is None else await self.store.admin_token_by_secret(token)
        if tok is not None:
            return f"token {tok.id}"
        if refused is not None:
            raise CredentialRefused(refused, "admin_certificate_refused")
        return None

    def _refusal(self, name: str, unmarked: bool) -> str:
        """Why a certificate whose name is listed is still no credential: only the mark makes it one."""
        reissue = (
            f"issue an administrator's certificate with `llmgw ctl cert issue-admin {name}` where the fleet's CA "
            "is kept and present that, or send an admin token"
        )
        if not unmarked:
            return f"the client certificate for {name} is a node's, and a node's certificate never opens the admin API; {reissue}"
        if name not in self._unmarked_said:
            self._unmarked_said.add(name)
            log.warning(
                "refused the certificate for %s on the admin API: it has no administrator's mark (issued before "
                "llmgw marked administrators' certificates); issue it again with `llmgw ctl cert issue-admin %s`",
                name,
                name,
            )
        return (
            f"the client certificate for {name} has no administrator's mark: it was issued before llmgw marked "
            f"administrators' certificates (or by `issue-client`), and such a certificate cannot be told from a "
            f"node's; {reissue}"
        )


def _error(status: int, message: str, code: str) -> web.Response:
    resp = error_response(status, message, code)
    if status == 401:
        resp.headers["WWW-Authenticate"] = 'Bearer realm="llmgw admin"'
    return resp
