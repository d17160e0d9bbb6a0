"""A small certificate authority: its key lives on one machine, its root is trusted everywhere.

Private because public authorities stopped issuing clientAuth certificates,
and agents prove who they are with one: the common name is the node id.

Client certificates are of two kinds, told apart by a mark only this authority
sets (an extended key usage beside clientAuth), never by their name: a node's
(NODE_MARK, the agent stream's credential) and an administrator's (ADMIN_MARK,
the admin listener's). A machine whose host name is an administrator's name
therefore still gets a node's certificate, which the admin listener refuses.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, cast

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.types import CertificateIssuerPrivateKeyTypes, PrivateKeyTypes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmgw.errors import LlmgwError
from llmgw.files import write_atomic

CA_CERT = "ca.pem"
CA_KEY = "ca-key.pem"
DEFAULT_PKI_DIR = "/etc/llmgw/pki"
CA_DAYS = 3650
LEAF_DAYS = 825  # the longest a browser-trusted leaf may live; kept for habit's sake
# A leaf closer to its end than this is issued again by whoever keeps it (server init, up):
# a month leaves room for a run that fails and the one that fixes it.
RENEW_BEFORE = dt.timedelta(days=30)

# A certificate valid only from "now" fails on a machine whose clock is a little behind.
_BACKDATE = dt.timedelta(minutes=5)
# What a clock may lag before a new certificate is refused as not yet valid (doctor's clock check).
CERT_BACKDATE = _BACKDATE
# The two kinds' marks. OIDs under 2.25 are UUIDs written as numbers (ITU-T X.667): unique without
# registering an arc. A certificate issued before the marks existed carries neither.
NODE_MARK = x509.ObjectIdentifier("2.25.7326827169724999956928474036178522880")
ADMIN_MARK = x509.ObjectIdentifier("2.25.199663784989677268631635715156606044297")
ClientKind = Literal["node", "admin"]
_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$", re.IGNORECASE)


class PKIError(LlmgwError):
    """A certificate problem, said as a sentence with what to do about it."""


@dataclass(frozen=True)
class Issued:
    cert: Path
    key: Path


# ---- names ---------------------------------------------------------------


def _is_hostname(name: str, *, wildcard: bool = False) -> bool:
    if not name or len(name) > 253:
        return False
    labels = name.rstrip(".").split(".")
    if wildcard and labels[0] == "*" and len(labels) > 1:
        labels = labels[1:]
    return all(_LABEL.match(label) for label in labels)


def _validate_name(name: str, what: str, example: str) -> str:
    if not _is_hostname(name) or name.endswith("."):
        raise PKIError(
            f"{name!r} is not a valid {what}: use what a hostname may hold — letters, digits, "
            "hyphens and dots, each dot-separated part 1 to 63 characters, not starting or ending with a hyphen "
            f"(for example {example})"
        )
    return name


def validate_node_id(node_id: str) -> str:
    """A node id goes into a certificate's common name and a file name, so it holds what a hostname may."""
    return _validate_name(node_id, "node id", "gpu-a-01")


def check_not_admin_name(node_id: str, admin_names: Collection[str]) -> str:
    """Refuse a node id that is an administrator's name. The marks already keep such a node out of the
    admin API; the refusal keeps the two apart where only names show (files, logs, listings)."""
    if node_id in admin_names:
        raise PKIError(
            f"{node_id!r} is an administrator's name (the names reserved are {', '.join(sorted(admin_names))}: "
            "admin, and admin_tls.clients in server.yaml) and cannot be a node id; give this node another id "
            "(`llmgw node add --node ID`, node_id in its agent.yaml). An administrator's certificate is made "
            f"with `llmgw ctl cert issue-admin {node_id}`"
        )
    return node_id


def parse_san(name: str) -> x509.GeneralName:
    """One name agents dial: a bare IP (v4 or v6) becomes an IP SAN, anything else must be a DNS name."""
    raw = name.strip()
    if not raw:
        raise PKIError("an empty name cannot go into a certificate; give a host name or an IP address")
    if "://" in raw:
        raise PKIError(
            f"{name!r} is a URL; give only its host (for example {raw.split('://', 1)[1].split('/')[0].rsplit(':', 1)[0]!r})"
        )
    bare = raw[1:-1] if raw.startswith("[") and raw.endswith("]") else raw
    try:
        return x509.IPAddress(ipaddress.ip_address(bare))
    except ValueError:
        pass
    if re.fullmatch(r"[^:]+:\d+", raw):
        raise PKIError(
            f"{name!r} has a port; give the host alone ({raw.rsplit(':', 1)[0]!r}) — certificates name hosts, not ports"
        )
    if not _is_hostname(raw, wildcard=True):
        raise PKIError(
            f"{name!r} is neither an IP address nor a valid host name: host names hold letters, digits, "
            "hyphens and dots, each dot-separated part 1 to 63 characters"
        )
    return x509.DNSName(raw.rstrip(".").lower())


def parse_sans(names: list[str]) -> list[x509.GeneralName]:
    if not names:
        raise PKIError(
            "a server certificate needs at least one name: give every host name and IP address agents dial "
            "(for example `llmgw ctl cert issue-server cp.internal 10.0.0.5`)"
        )
    out: list[x509.GeneralName] = []
    for name in names:
        san = parse_san(name)
        if san not in out:
            out.append(san)
    return out


# ---- files ---------------------------------------------------------------


def _write_pair(cert_path: Path, key_path: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> Issued:
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    write_atomic(key_path, key_pem, 0o600)
    write_atomic(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return Issued(cert_path, key_path)


def _read(path: str | os.PathLike[str], what: str) -> tuple[Path, bytes]:
    p = Path(path)
    try:
        return p, p.read_bytes()
    except FileNotFoundError:
        raise PKIError(f"no {what} at {p}; check the path") from None
    except OSError as exc:
        raise PKIError(f"cannot read the {what} {p}: {exc.strerror}") from None


def load_cert(path: str | os.PathLike[str]) -> x509.Certificate:
    p, data = _read(path, "certificate")
    try:
        return x509.load_pem_x509_certificate(data)
    except ValueError:
        raise PKIError(f"{p} is not a PEM certificate (it should start with -----BEGIN CERTIFICATE-----)") from None


def load_key(path: str | os.PathLike[str]) -> PrivateKeyTypes:
    p, data = _read(path, "private key")
    try:
        return serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError):
        raise PKIError(f"{p} is not an unencrypted PEM private key") from None


def _same_public_key(cert: x509.Certificate, key: PrivateKeyTypes) -> bool:
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    der = serialization.Encoding.DER
    ours: bytes = cert.public_key().public_bytes(der, spki)
    return ours == key.public_key().public_bytes(der, spki)


def load_pair(
    cert_path: str | os.PathLike[str], key_path: str | os.PathLike[str]
) -> tuple[x509.Certificate, PrivateKeyTypes]:
    """A certificate and its key, refusing a key that belongs to another certificate."""
    cert, key = load_cert(cert_path), load_key(key_path)
    if not _same_public_key(cert, key):
        raise PKIError(
            f"the key {key_path} does not belong to the certificate {cert_path}; "
            "they were issued separately — use the key written beside that certificate, or issue both again"
        )
    return cert, key


def load_ca(ca_dir: str | os.PathLike[str]) -> tuple[x509.Certificate, PrivateKeyTypes]:
    d = Path(ca_dir)
    if not (d / CA_KEY).exists() or not (d / CA_CERT).exists():
        missing = " and ".join(n for n in (CA_CERT, CA_KEY) if not (d / n).exists())
        raise PKIError(f"no authority in {d} ({missing} missing); run 'llmgw ctl cert init-ca --dir {d}' first")
    return load_pair(d / CA_CERT, d / CA_KEY)


def common_name(cert: x509.Certificate) -> str | None:
    attrs = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(attrs[0].value) if attrs else None


def verify_issued_by(ca_path: str | os.PathLike[str], cert_path: str | os.PathLike[str]) -> None:
    """Refuse a certificate the fleet's authority did not sign."""
    ca, cert = load_cert(ca_path), load_cert(cert_path)
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        raise PKIError(
            f"{cert_path} (for {common_name(cert) or 'no name'}) was not issued by the authority in {ca_path} "
            f"(it names {cert.issuer.rfc4514_string() or 'no issuer'} as issuer); "
            "issue it again with this authority (`llmgw ctl cert issue-client` or `issue-server`)"
        ) from None
    now = dt.datetime.now(dt.UTC)
    if cert.not_valid_after_utc < now:
        raise PKIError(f"{cert_path} expired on {cert.not_valid_after_utc:%Y-%m-%d}; issue it again")


# ---- issuing -------------------------------------------------------------


def _check_days(days: int) -> None:
    if days < 1:
        raise PKIError(f"a certificate must be valid for at least 1 day, not {days}")


def init_ca(
    dir: str | os.PathLike[str] = DEFAULT_PKI_DIR,
    name: str = "llmgw fleet CA",
    days: int = CA_DAYS,
    *,
    force: bool = False,
) -> Issued:
    """Create the authority: ca.pem (to trust everywhere) and ca-key.pem (0600, to back up)."""
    d = Path(dir)
    _check_days(days)
    existing = [n for n in (CA_CERT, CA_KEY) if (d / n).exists()]
    if existing and not force:
        raise PKIError(
            f"an authority already exists in {d} ({', '.join(existing)}); every certificate it issued depends on it. "
            "Use it as it is, or pass --force to replace it and then reissue every node's and server's certificate"
        )
    if not name.strip():
        raise PKIError("the authority needs a name; leave --name out for the default")
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = dt.datetime.now(dt.UTC)
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE)
        .not_valid_after(now + dt.timedelta(days=days))
        # path_length 0: this authority signs leaves only, never another authority.
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(ski, critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False)
        .sign(key, hashes.SHA256())
    )
    return _write_pair(d / CA_CERT, d / CA_KEY, cert, key)


def _issue(
    ca_dir: str | os.PathLike[str],
    subject_cn: str,
    sans: list[x509.GeneralName],
    ekus: list[x509.ObjectIdentifier],
    days: int,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    _check_days(days)
    ca_cert, loaded = load_ca(ca_dir)
    # init_ca writes an EC key; a key that cannot sign (DH, X25519) makes cryptography raise TypeError.
    ca_key = cast(CertificateIssuerPrivateKeyTypes, loaded)
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    # A leaf outliving its authority would fail verification anyway; say so by capping it.
    not_after = min(now + dt.timedelta(days=days), ca_cert.not_valid_after_utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject_cn)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage(ekus), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(ca_key, hashes.SHA256()), key


def issue_server(
    ca_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    names: list[str],
    days: int = LEAF_DAYS,
    *,
    stem: str = "server",
) -> Issued:
    """server.pem and server-key.pem naming every host and address agents dial.

    Hostname verification ignores the common name, so an address missing from
    the SANs fails the handshake even when it is the CN.
    """
    sans = parse_sans(list(names))
    first = sans[0].value
    cert, key = _issue(ca_dir, str(first), sans, [ExtendedKeyUsageOID.SERVER_AUTH], days)
    out = Path(out_dir)
    return _write_pair(out / f"{stem}.pem", out / f"{stem}-key.pem", cert, key)


def client_kind(cert: x509.Certificate) -> ClientKind | None:
    """Which kind of client certificate this is by the mark its authority set; None when it has none
    (issued before the marks, or by another authority). The admin mark wins: this authority never sets both."""
    try:
        usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        return None
    if ADMIN_MARK in usages:
        return "admin"
    if NODE_MARK in usages:
        return "node"
    return None


def _refuse_overwriting_other_kind(cert_path: Path, kind: ClientKind) -> None:
    """A node's and an administrator's files share a directory and a naming rule: never replace one
    kind with the other without being told where."""
    if not cert_path.exists():
        return
    try:
        there = client_kind(load_cert(cert_path))
    except PKIError:
        return  # not a certificate of ours: replaced as before
    if there is not None and there != kind:
        whose = "an administrator's" if there == "admin" else "a node's"
        raise PKIError(
            f"{cert_path} is {whose} certificate; writing {'a node' if kind == 'node' else 'an administrator'}'s "
            "certificate over it would take that credential away. Give another name, or --out another directory"
        )


def issue_client(
    ca_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    node_id: str,
    days: int = LEAF_DAYS,
    *,
    admin_names: Collection[str],
) -> Issued:
    """<node>.pem and <node>-key.pem: a node's certificate (NODE_MARK) whose common name is the node id the
    agent must claim. ``admin_names`` are refused as node ids (config.server.ServerConfig.admin_names)."""
    validate_node_id(node_id)
    check_not_admin_name(node_id, admin_names)
    out = Path(out_dir)
    _refuse_overwriting_other_kind(out / f"{node_id}.pem", "node")
    cert, key = _issue(ca_dir, node_id, [], [ExtendedKeyUsageOID.CLIENT_AUTH, NODE_MARK], days)
    return _write_pair(out / f"{node_id}.pem", out / f"{node_id}-key.pem", cert, key)


def issue_admin(
    ca_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], name: str, days: int = LEAF_DAYS
) -> Issued:
    """<name>.pem and <name>-key.pem: an administrator's certificate (ADMIN_MARK), a credential on an admin
    listener whose admin_tls.clients lists ``name``, and refused on the agent stream."""
    _validate_name(name, "administrator name", "admin or ops-alice")
    out = Path(out_dir)
    _refuse_overwriting_other_kind(out / f"{name}.pem", "admin")
    cert, key = _issue(ca_dir, name, [], [ExtendedKeyUsageOID.CLIENT_AUTH, ADMIN_MARK], days)
    return _write_pair(out / f"{name}.pem", out / f"{name}-key.pem", cert, key)


def near_end(cert: x509.Certificate) -> bool:
    """Whether the certificate ends within RENEW_BEFORE and should be issued again."""
    return cert.not_valid_after_utc - dt.datetime.now(dt.UTC) < RENEW_BEFORE


def san_names(cert: x509.Certificate) -> list[str]:
    """The DNS names and addresses a certificate answers to, as text."""
    try:
        ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [str(n.value) for n in ext if isinstance(n, (x509.DNSName, x509.IPAddress))]
