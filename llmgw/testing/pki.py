"""Certificates as llmgw issued them before client certificates carried a node's or an administrator's
mark, for the tests of how an existing fleet is told to reissue them."""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path
from typing import cast

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.types import CertificateIssuerPrivateKeyTypes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmgw.pki import Issued, load_ca


def issue_unmarked(ca_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], name: str) -> Issued:
    """<name>.pem and <name>-key.pem: a clientAuth certificate from the authority in ``ca_dir`` with no mark."""
    ca_cert, loaded = load_ca(ca_dir)
    ca_key = cast(CertificateIssuerPrivateKeyTypes, loaded)
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}-key.pem").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    (out / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return Issued(out / f"{name}.pem", out / f"{name}-key.pem")
