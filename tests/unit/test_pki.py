"""The fleet's authority: issuing, loading, refusing, and a real mutual-TLS handshake."""

from __future__ import annotations

import asyncio
import ipaddress
import ssl
import stat

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from llmgw.pki import (
    PKIError,
    check_claim,
    client_context,
    common_name,
    init_ca,
    issue_client,
    issue_server,
    load_ca,
    load_cert,
    load_pair,
    peer_node_id,
    server_context,
    verify_issued_by,
)


@pytest.fixture()
def fleet(tmp_path):
    ca = tmp_path / "pki"
    init_ca(ca)
    issue_server(ca, tmp_path / "srv", ["localhost", "127.0.0.1", "::1", "cp.internal"])
    issue_client(ca, tmp_path / "cl", "node-a", admin_names={"admin"})
    return tmp_path


def _mode(p) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_ca_round_trip(tmp_path):
    out = init_ca(tmp_path / "pki", name="test CA", days=10)
    assert out.cert.name == "ca.pem" and out.key.name == "ca-key.pem"
    assert _mode(out.key) == 0o600
    cert, _key = load_ca(tmp_path / "pki")
    assert common_name(cert) == "test CA"
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert not list(tmp_path.joinpath("pki").glob(".*")), "no temp files left behind"


def test_init_ca_refuses_to_overwrite(tmp_path):
    first = init_ca(tmp_path)
    before = first.key.read_bytes()
    with pytest.raises(PKIError, match=rf"already exists in {tmp_path}.*--force"):
        init_ca(tmp_path)
    assert first.key.read_bytes() == before
    init_ca(tmp_path, force=True)
    assert first.key.read_bytes() != before


def test_server_cert_sans(fleet):
    cert = load_cert(fleet / "srv" / "server.pem")
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["localhost", "cp.internal"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")]
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.SERVER_AUTH in eku
    assert _mode(fleet / "srv" / "server-key.pem") == 0o600
    verify_issued_by(fleet / "pki" / "ca.pem", fleet / "srv" / "server.pem")


def test_client_cert_names_the_node(fleet):
    cert = load_cert(fleet / "cl" / "node-a.pem")
    assert common_name(cert) == "node-a"
    assert ExtendedKeyUsageOID.CLIENT_AUTH in cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert _mode(fleet / "cl" / "node-a-key.pem") == 0o600


@pytest.mark.parametrize(
    "name, words",
    [
        ("", "empty"),
        ("bad_host", "neither an IP address nor a valid host name"),
        ("-lead.example", "neither"),
        ("cp.internal:7443", "has a port"),
        ("https://cp.internal/", "is a URL"),
        ("a" * 64 + ".example", "neither"),
    ],
)
def test_issue_server_refuses_bad_names(tmp_path, name, words):
    init_ca(tmp_path)
    with pytest.raises(PKIError, match=words):
        issue_server(tmp_path, tmp_path / "out", ["ok.example", name])
    assert not (tmp_path / "out").exists()


def test_issue_server_refuses_empty_list(tmp_path):
    init_ca(tmp_path)
    with pytest.raises(PKIError, match="at least one name"):
        issue_server(tmp_path, tmp_path, [])


def test_bracketed_ipv6_is_an_ip_san(tmp_path):
    init_ca(tmp_path)
    out = issue_server(tmp_path, tmp_path, ["[fd00::1]"])
    san = load_cert(out.cert).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("fd00::1")]


@pytest.mark.parametrize("node", ["node_a", "-node", "a/b", "", "x" * 64])
def test_issue_client_refuses_bad_node_id(tmp_path, node):
    init_ca(tmp_path)
    with pytest.raises(PKIError, match="not a valid node id"):
        issue_client(tmp_path, tmp_path / "out", node, admin_names={"admin"})
    assert not (tmp_path / "out").exists()


def test_issuing_without_authority_says_how_to_make_one(tmp_path):
    with pytest.raises(PKIError, match=r"no authority in .*run 'llmgw ctl cert init-ca --dir"):
        issue_client(tmp_path, tmp_path, "node-a", admin_names={"admin"})


def test_mismatched_key_refused(fleet):
    with pytest.raises(PKIError, match="does not belong to the certificate"):
        load_pair(fleet / "cl" / "node-a.pem", fleet / "srv" / "server-key.pem")
    with pytest.raises(PKIError, match="does not belong"):
        server_context(fleet / "pki" / "ca.pem", fleet / "srv" / "server.pem", fleet / "cl" / "node-a-key.pem")


def test_missing_files_refused(tmp_path):
    with pytest.raises(PKIError, match="no certificate at"):
        load_cert(tmp_path / "nope.pem")
    (tmp_path / "junk.pem").write_text("hello")
    with pytest.raises(PKIError, match="not a PEM certificate"):
        load_cert(tmp_path / "junk.pem")


def test_cert_from_another_authority_refused(fleet, tmp_path):
    init_ca(tmp_path / "other")
    issue_client(tmp_path / "other", tmp_path / "other", "node-a", admin_names={"admin"})
    with pytest.raises(PKIError, match="was not issued by the authority"):
        verify_issued_by(fleet / "pki" / "ca.pem", tmp_path / "other" / "node-a.pem")


def test_check_claim_wording():
    assert check_claim("node-a", "node-a") is None
    assert check_claim("node-b", "node-a") == (
        "the certificate is for node-b but the agent claims to be node-a; "
        "issue a certificate for node-a with `llmgw ctl cert issue-client node-a`"
    )
    assert "presented no certificate" in check_claim(None, "node-a")


def test_server_context_requires_client_certs(fleet):
    ctx = server_context(fleet / "pki" / "ca.pem", fleet / "srv" / "server.pem", fleet / "srv" / "server-key.pem")
    assert ctx.verify_mode == ssl.CERT_REQUIRED


# ---- a real handshake over loopback ----------------------------------------


async def _exchange(server_ctx, client_ctx, host="127.0.0.1"):
    """Start a TLS server that answers with the peer's node id; return (client's reply or error, server saw)."""
    seen: list[str | None] = []

    async def handle(reader, writer):
        seen.append(peer_node_id(writer.get_extra_info("ssl_object")))
        await reader.readline()
        writer.write(f"{seen[-1]}\n".encode())
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, host, 0, ssl=server_ctx)
    port = server.sockets[0].getsockname()[1]
    try:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, ssl=client_ctx), 5)
            writer.write(b"hello\n")
            await writer.drain()
            reply: object = await asyncio.wait_for(reader.readline(), 5)
            writer.close()
        except (ssl.SSLError, ConnectionError, OSError) as exc:
            reply = exc
    finally:
        server.close()
        await server.wait_closed()
    return reply, seen


def _server_ctx(fleet):
    return server_context(fleet / "pki" / "ca.pem", fleet / "srv" / "server.pem", fleet / "srv" / "server-key.pem")


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_handshake_with_fleet_client_cert(fleet, host):
    cctx = client_context(fleet / "pki" / "ca.pem", fleet / "cl" / "node-a.pem", fleet / "cl" / "node-a-key.pem")
    reply, seen = asyncio.run(_exchange(_server_ctx(fleet), cctx, host))
    assert reply == b"node-a\n"
    assert seen == ["node-a"]


def test_handshake_refuses_cert_from_another_authority(fleet, tmp_path):
    init_ca(tmp_path / "other")
    issue_client(tmp_path / "other", tmp_path / "other", "node-a", admin_names={"admin"})
    # Trusts the real server, but presents a certificate the fleet's authority did not sign.
    cctx = client_context(
        fleet / "pki" / "ca.pem", tmp_path / "other" / "node-a.pem", tmp_path / "other" / "node-a-key.pem"
    )
    reply, seen = asyncio.run(_exchange(_server_ctx(fleet), cctx))
    assert reply in (b"",) or isinstance(reply, Exception)
    assert seen == []


def test_handshake_refuses_no_client_cert(fleet):
    cctx = client_context(fleet / "pki" / "ca.pem")
    reply, seen = asyncio.run(_exchange(_server_ctx(fleet), cctx))
    assert reply in (b"",) or isinstance(reply, Exception)
    assert seen == []


def test_client_refuses_server_from_another_authority(fleet, tmp_path):
    init_ca(tmp_path / "other")
    cctx = client_context(tmp_path / "other" / "ca.pem", fleet / "cl" / "node-a.pem", fleet / "cl" / "node-a-key.pem")
    with pytest.raises(PKIError, match="does not belong"):
        # and a key belonging elsewhere is caught before any connection
        client_context(fleet / "pki" / "ca.pem", fleet / "cl" / "node-a.pem", fleet / "srv" / "server-key.pem")
    reply, seen = asyncio.run(_exchange(_server_ctx(fleet), cctx))
    assert isinstance(reply, ssl.SSLCertVerificationError)
    assert seen == []


def test_address_missing_from_sans_fails_even_as_common_name(fleet, tmp_path):
    # Hostname verification ignores the CN: an address agents dial must be a SAN.
    issue_server(fleet / "pki", tmp_path / "narrow", ["cp.internal"])
    sctx = server_context(
        fleet / "pki" / "ca.pem", tmp_path / "narrow" / "server.pem", tmp_path / "narrow" / "server-key.pem"
    )
    cctx = client_context(fleet / "pki" / "ca.pem", fleet / "cl" / "node-a.pem", fleet / "cl" / "node-a-key.pem")
    reply, _ = asyncio.run(_exchange(sctx, cctx))
    assert isinstance(reply, ssl.SSLCertVerificationError)
