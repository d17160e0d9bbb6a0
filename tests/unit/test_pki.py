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
    ADMIN_MARK,
    NODE_MARK,
    PKIError,
    check_claim,
    check_node_certificate,
    check_not_admin_name,
    client_context,
    client_kind,
    common_name,
    init_ca,
    issue_admin,
    issue_client,
    issue_server,
    load_ca,
    load_cert,
    load_pair,
    peer_node_id,
    server_context,
    verify_issued_by,
)
from llmgw.testing.pki import issue_unmarked


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


# ---- the node's and the administrator's marks ------------------------------


def _usages(path) -> list:
    return list(load_cert(path).extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)


def test_a_node_certificate_carries_the_node_mark_and_an_administrators_the_admin_mark_both_for_client_auth(tmp_path):
    init_ca(tmp_path)
    node = issue_client(tmp_path, tmp_path / "n", "gpu-01", admin_names={"admin"})
    admin = issue_admin(tmp_path, tmp_path / "a", "admin")
    assert client_kind(load_cert(node.cert)) == "node" and client_kind(load_cert(admin.cert)) == "admin"
    assert _usages(node.cert) == [ExtendedKeyUsageOID.CLIENT_AUTH, NODE_MARK]
    assert _usages(admin.cert) == [ExtendedKeyUsageOID.CLIENT_AUTH, ADMIN_MARK]
    assert common_name(load_cert(admin.cert)) == "admin"
    assert stat.S_IMODE(admin.key.stat().st_mode) == 0o600
    # Neither a server certificate nor one issued before the marks is of either kind.
    assert client_kind(load_cert(issue_server(tmp_path, tmp_path / "s", ["cp"]).cert)) is None
    assert client_kind(load_cert(issue_unmarked(tmp_path, tmp_path / "old", "gpu-02").cert)) is None


def test_a_node_id_that_is_an_administrators_name_is_refused_and_nothing_is_written(tmp_path):
    init_ca(tmp_path)
    with pytest.raises(PKIError, match=r"'ops' is an administrator's name .*admin, ops.*issue-admin ops"):
        issue_client(tmp_path, tmp_path / "out", "ops", admin_names={"admin", "ops"})
    with pytest.raises(PKIError, match="'admin' is an administrator's name"):
        issue_client(tmp_path, tmp_path / "out", "admin", admin_names={"admin"})
    assert not (tmp_path / "out").exists()
    assert check_not_admin_name("gpu-01", {"admin"}) == "gpu-01"


def test_one_kind_of_certificate_is_never_written_over_the_other(tmp_path):
    init_ca(tmp_path)
    issue_client(tmp_path, tmp_path, "ops-alice", admin_names={"admin"})
    before = (tmp_path / "ops-alice.pem").read_bytes()
    with pytest.raises(PKIError, match=r"ops-alice\.pem is a node's certificate.*--out another directory"):
        issue_admin(tmp_path, tmp_path, "ops-alice")
    assert (tmp_path / "ops-alice.pem").read_bytes() == before
    issue_admin(tmp_path, tmp_path / "a", "ops-bob")
    with pytest.raises(PKIError, match="is an administrator's certificate"):
        issue_client(tmp_path, tmp_path / "a", "ops-bob", admin_names={"admin"})
    # The same kind again is a reissue, as before; an unmarked one is replaced by its marked successor.
    issue_admin(tmp_path, tmp_path / "a", "ops-bob")
    issue_unmarked(tmp_path, tmp_path / "old", "admin")
    issue_admin(tmp_path, tmp_path / "old", "admin")
    assert client_kind(load_cert(tmp_path / "old" / "admin.pem")) == "admin"


def test_an_administrator_name_must_be_one_a_certificate_and_a_file_can_hold(tmp_path):
    init_ca(tmp_path)
    with pytest.raises(PKIError, match="not a valid administrator name"):
        issue_admin(tmp_path, tmp_path / "out", "../admin")
    assert not (tmp_path / "out").exists()


def test_the_agent_stream_refuses_an_administrators_certificate_and_an_unmarked_one_only_when_told(tmp_path):
    init_ca(tmp_path)
    node = load_cert(issue_client(tmp_path, tmp_path, "gpu-01", admin_names={"admin"}).cert)
    admin = load_cert(issue_admin(tmp_path, tmp_path / "a", "gpu-01").cert)
    old = load_cert(issue_unmarked(tmp_path, tmp_path / "old", "gpu-01").cert)
    for strict in (False, True):
        assert check_node_certificate(node, "gpu-01", require_mark=strict) is None
        refusal = check_node_certificate(admin, "gpu-01", require_mark=strict)
        assert refusal is not None and "is an administrator's, which never joins as a node" in refusal
        assert "`llmgw ctl cert issue-client gpu-01`" in refusal
        assert "the agent claims to be gpu-02" in (check_node_certificate(node, "gpu-02", require_mark=strict) or "")
    assert check_node_certificate(old, "gpu-01", require_mark=False) is None
    refusal = check_node_certificate(old, "gpu-01", require_mark=True)
    assert refusal is not None and "has no node mark" in refusal and "require_node_mark" in refusal
    assert "presented no certificate" in (check_node_certificate(None, "gpu-01", require_mark=False) or "")
