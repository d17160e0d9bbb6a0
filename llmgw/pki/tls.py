"""TLS contexts for the agent stream and the mirror API, and the node identity a peer proves."""

from __future__ import annotations

import os
import ssl

from cryptography import x509

from llmgw.pki.ca import PKIError, client_kind, common_name, load_cert, load_pair

_Path = str | os.PathLike[str]


def _load(ctx: ssl.SSLContext, ca: _Path, cert: _Path | None, key: _Path | None) -> ssl.SSLContext:
    # Read with cryptography first: its failures can be said plainly, ssl's cannot.
    load_cert(ca)
    if cert is not None:
        load_pair(cert, key if key is not None else cert)
    try:
        ctx.load_verify_locations(cafile=os.fspath(ca))
        if cert is not None:
            ctx.load_cert_chain(os.fspath(cert), os.fspath(key) if key is not None else None)
    except ssl.SSLError as exc:
        raise PKIError(f"TLS could not load {cert or ca}: {exc.reason or exc}") from None
    return ctx


def server_context(ca: _Path, cert: _Path | None, key: _Path | None, *, require_client: bool = True) -> ssl.SSLContext:
    """A listener that accepts only clients holding a certificate from the authority in `ca`;
    with require_client=False a client may present none (and then needs another credential),
    but one it presents must still come from that authority."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.verify_mode = ssl.CERT_REQUIRED if require_client else ssl.CERT_OPTIONAL
    return _load(ctx, ca, cert, key)


def client_context(ca: _Path, cert: _Path | None = None, key: _Path | None = None) -> ssl.SSLContext:
    """A dialler that trusts only the authority in `ca` and, given a certificate, presents it."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the server and its host name
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return _load(ctx, ca, cert, key)


def peer_certificate(ssl_object: ssl.SSLObject | ssl.SSLSocket | None) -> x509.Certificate | None:
    """The certificate the peer presented (verified by the handshake), or None when it presented none."""
    if ssl_object is None:
        return None
    der = ssl_object.getpeercert(binary_form=True)
    if not der:
        return None
    return x509.load_der_x509_certificate(der)


def peer_node_id(ssl_object: ssl.SSLObject | ssl.SSLSocket | None) -> str | None:
    """The common name of the certificate the peer presented, or None when it presented none."""
    cert = peer_certificate(ssl_object)
    return None if cert is None else common_name(cert)


def check_claim(cert_cn: str | None, claimed_node_id: str) -> str | None:
    """The refusal to send an agent whose certificate names another node than it claims; None when they agree."""
    fix = f"issue a certificate for {claimed_node_id} with `llmgw ctl cert issue-client {claimed_node_id}`"
    if not cert_cn:
        return f"the agent claims to be {claimed_node_id} but presented no certificate naming a node; {fix}"
    if cert_cn != claimed_node_id:
        return f"the certificate is for {cert_cn} but the agent claims to be {claimed_node_id}; {fix}"
    return None


def check_node_certificate(cert: x509.Certificate | None, claimed_node_id: str, *, require_mark: bool) -> str | None:
    """The refusal to send an agent whose certificate does not make it node ``claimed_node_id``: another name,
    an administrator's certificate, or (``require_mark``) one issued before node certificates were marked."""
    refusal = check_claim(None if cert is None else common_name(cert), claimed_node_id)
    if refusal is not None or cert is None:
        return refusal
    kind = client_kind(cert)
    fix = f"issue the node's own with `llmgw ctl cert issue-client {claimed_node_id}` (or run `llmgw node add` again)"
    if kind == "admin":
        return f"the certificate for {claimed_node_id} is an administrator's, which never joins as a node; {fix}"
    if kind is None and require_mark:
        return (
            f"the certificate for {claimed_node_id} has no node mark (it was issued before llmgw marked node "
            f"certificates) and agent_tls.require_node_mark is on; {fix}"
        )
    return None
