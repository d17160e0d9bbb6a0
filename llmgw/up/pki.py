"""The private authority of this one machine and the two certificates `up` needs, under <data dir>/pki."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509

from llmgw.config.server import DEFAULT_ADMIN_CLIENT
from llmgw.pki import (
    CA_CERT,
    CA_KEY,
    PKIError,
    client_kind,
    common_name,
    init_ca,
    issue_client,
    issue_server,
    load_ca,
    load_cert,
    load_pair,
    near_end,
    san_names,
    verify_issued_by,
)

NODE_ID = "local"
SERVER_NAMES = ("127.0.0.1", "localhost")


@dataclass(frozen=True)
class Pki:
    """The private authority of this one machine and the two certificates `up` needs."""

    dir: Path
    node_id: str = NODE_ID

    @property
    def ca(self) -> Path:
        return self.dir / CA_CERT

    @property
    def server(self) -> Path:
        return self.dir / "server.pem"

    @property
    def server_key(self) -> Path:
        return self.dir / "server-key.pem"

    @property
    def client(self) -> Path:
        return self.dir / f"{self.node_id}.pem"

    @property
    def client_key(self) -> Path:
        return self.dir / f"{self.node_id}-key.pem"


def _fresh(cert_path: Path) -> bool:
    return not near_end(load_cert(cert_path))


def _leaf_ok(pki: Pki, cert: Path, key: Path, names_ok: Callable[[x509.Certificate], bool]) -> bool:
    """Present, signed by this authority, with its own key, not near its end, naming what it must."""
    try:
        verify_issued_by(pki.ca, cert)
        load_pair(cert, key)
        return _fresh(cert) and names_ok(load_cert(cert))
    except PKIError:
        return False


def ensure_pki(workdir: Path, node_id: str = NODE_ID) -> tuple[Pki, list[str]]:
    """The authority and certificates under ``workdir``/pki: reused when valid, made otherwise.

    Returns them and what was (re)made, in words (empty: everything reused).
    """
    pki = Pki(workdir / "pki", node_id)
    pki.dir.mkdir(parents=True, exist_ok=True)
    os.chmod(pki.dir, 0o700)
    made: list[str] = []
    try:
        load_ca(pki.dir)
        ca_ok = _fresh(pki.ca)
    except PKIError:
        ca_ok = False
    if not ca_ok:
        init_ca(pki.dir, name="llmgw up (this machine only)", force=True)
        made.append("certificate authority")
    if not _leaf_ok(pki, pki.server, pki.server_key, lambda c: set(SERVER_NAMES) <= set(san_names(c))):
        issue_server(pki.dir, pki.dir, list(SERVER_NAMES))
        made.append("control plane certificate")
    # A node certificate from before node certificates were marked is issued again, marked.
    if not _leaf_ok(pki, pki.client, pki.client_key, lambda c: common_name(c) == node_id and client_kind(c) == "node"):
        # up's admin listener has no admin_tls: only the default administrator's name is reserved.
        issue_client(pki.dir, pki.dir, node_id, admin_names={DEFAULT_ADMIN_CLIENT})
        made.append(f"agent certificate ({node_id})")
    for key in (pki.dir / CA_KEY, pki.server_key, pki.client_key):
        os.chmod(key, 0o600)  # whoever copied them in, they stay private
    return pki, made
