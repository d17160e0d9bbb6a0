"""`llmgw ctl cert`: the commands write what they say and refuse what they should."""

from __future__ import annotations

import stat

from typer.testing import CliRunner

from llmgw.cli.ctl import app
from llmgw.pki import common_name, load_cert, san_names, verify_issued_by

runner = CliRunner()


def test_init_issue_and_refuse(tmp_path):
    pki = tmp_path / "pki"
    r = runner.invoke(app, ["cert", "init-ca", "--dir", str(pki)])
    assert r.exit_code == 0, r.output
    assert f"wrote {pki / 'ca.pem'}" in r.output and f"wrote {pki / 'ca-key.pem'}" in r.output
    assert stat.S_IMODE((pki / "ca-key.pem").stat().st_mode) == 0o600

    r = runner.invoke(app, ["cert", "init-ca", "--dir", str(pki)])
    assert r.exit_code == 1
    assert "already exists" in r.output and "--force" in r.output

    out = tmp_path / "srv"
    r = runner.invoke(
        app, ["cert", "issue-server", "cp.internal", "10.0.0.5", "--host", "::1", "--dir", str(pki), "--out", str(out)]
    )
    assert r.exit_code == 0, r.output
    assert "cp.internal, 10.0.0.5, ::1" in r.output
    assert san_names(load_cert(out / "server.pem")) == ["cp.internal", "10.0.0.5", "::1"]
    verify_issued_by(pki / "ca.pem", out / "server.pem")

    r = runner.invoke(app, ["cert", "issue-client", "gpu-a-01", "--dir", str(pki)])
    assert r.exit_code == 0, r.output
    assert f"wrote {pki / 'gpu-a-01.pem'}" in r.output
    assert common_name(load_cert(pki / "gpu-a-01.pem")) == "gpu-a-01"


def test_cert_commands_refuse_without_an_authority_or_with_bad_names_and_write_nothing(tmp_path):
    pki = tmp_path / "pki"
    r = runner.invoke(app, ["cert", "issue-client", "node-a", "--dir", str(pki)])
    assert r.exit_code == 1 and "no authority in" in r.output and "init-ca" in r.output
    runner.invoke(app, ["cert", "init-ca", "--dir", str(pki)])
    r = runner.invoke(app, ["cert", "issue-server", "--dir", str(pki)])
    assert r.exit_code == 1 and "at least one name" in r.output
    r = runner.invoke(app, ["cert", "issue-server", "bad_name", "--dir", str(pki)])
    assert r.exit_code == 1 and "'bad_name'" in r.output
    r = runner.invoke(app, ["cert", "issue-client", "node_a", "--dir", str(pki)])
    assert r.exit_code == 1 and "not a valid node id" in r.output
    assert sorted(p.name for p in pki.iterdir()) == ["ca-key.pem", "ca.pem"]


def test_issue_admin_makes_an_administrators_certificate_and_says_how_to_use_it(tmp_path):
    from llmgw.pki import client_kind

    pki = tmp_path / "pki"
    runner.invoke(app, ["cert", "init-ca", "--dir", str(pki)])
    r = runner.invoke(app, ["cert", "issue-admin", "--dir", str(pki)])
    assert r.exit_code == 0, r.output
    assert f"wrote {pki / 'admin.pem'} (administrator's certificate for admin)" in r.output
    assert "admin_tls.clients" in r.output and f"LLMGW_ADMIN_CERT={pki / 'admin.pem'}" in r.output
    assert client_kind(load_cert(pki / "admin.pem")) == "admin"
    r = runner.invoke(app, ["cert", "issue-client", "gpu-a-01", "--dir", str(pki)])
    assert "node certificate for gpu-a-01" in r.output
    assert client_kind(load_cert(pki / "gpu-a-01.pem")) == "node"


def test_issue_client_refuses_the_default_administrator_and_the_names_the_servers_config_lists(tmp_path):
    pki = tmp_path / "pki"
    runner.invoke(app, ["cert", "init-ca", "--dir", str(pki)])
    out = tmp_path / "out"
    # No server.yaml given (and none at /etc/llmgw here): admin is reserved all the same.
    r = runner.invoke(app, ["cert", "issue-client", "admin", "--dir", str(pki), "--out", str(out)])
    assert r.exit_code == 1 and "'admin' is an administrator's name" in r.output
    assert "llmgw ctl cert issue-admin admin" in r.output
    config = tmp_path / "server.yaml"
    config.write_text("admin_tls:\n  clients: [ops-alice]\n")
    r = runner.invoke(
        app, ["cert", "issue-client", "ops-alice", "--dir", str(pki), "--out", str(out), "--config", str(config)]
    )
    assert r.exit_code == 1 and "'ops-alice' is an administrator's name" in r.output, r.output
    r = runner.invoke(
        app, ["cert", "issue-client", "admin", "--dir", str(pki), "--out", str(out), "--config", str(config)]
    )
    assert r.exit_code == 1 and "administrator's name" in r.output
    # A server.yaml that cannot be read is said, not passed over.
    r = runner.invoke(
        app,
        ["cert", "issue-client", "gpu-01", "--dir", str(pki), "--out", str(out), "--config", str(tmp_path / "no.yaml")],
    )
    assert r.exit_code == 1 and "administrators' names" in r.output and "--config" in r.output, r.output
    assert not out.exists()
    r = runner.invoke(
        app, ["cert", "issue-client", "gpu-01", "--dir", str(pki), "--out", str(out), "--config", str(config)]
    )
    assert r.exit_code == 0, r.output
