import re

from typer.testing import CliRunner

from llmgw import __version__
from llmgw.cli.main import app

runner = CliRunner()


def run(*args):
    return runner.invoke(app, list(args))


def test_version():
    r = run("--version")
    assert r.exit_code == 0
    assert re.fullmatch(r"llmgw v\d+\.\d+\.\d+\n", r.output) and r.output.split()[-1] == f"v{__version__}"


def test_every_command_has_help():
    for args in [(), ("server",), ("keys",), ("keys", "create"), ("keys", "list"), ("keys", "revoke"), ("up",),
                 ("agent",), ("agent", "inventory"), ("agent", "engine-check"), ("ctl",), ("ctl", "cert"),
                 ("ctl", "nodes"), ("ctl", "models"), ("ctl", "model", "add"), ("ctl", "scale"), ("ctl", "logs"), ("ctl", "explain-placement"),
                 ("node", "remove")]:
        r = run(*args, "--help")
        assert r.exit_code == 0, args
        assert len(r.output.strip()) > 40


def test_keys_create_list_revoke(tmp_path):
    store = str(tmp_path / "k.db")
    r = run("keys", "create", "--name", "ci-bot", "--project", "web", "--store", store)
    assert r.exit_code == 0, r.output
    secret = r.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"llmgw-[A-Za-z0-9_-]{40}", secret)
    assert r.stdout.strip() == secret  # stdout holds the secret alone; the rest went to stderr
    r = run("keys", "list", "--store", store)
    assert r.exit_code == 0 and "ci-bot" in r.stdout and secret[:14] in r.stdout and secret not in r.stdout
    assert "active" in r.stdout and "web" in r.stdout
    r = run("keys", "revoke", secret[:14], "--store", store)
    assert r.exit_code == 0, r.output
    assert "ci-bot" not in run("keys", "list", "--store", store).stdout
    assert "revoked" in run("keys", "list", "--all", "--store", store).stdout
    r = run("keys", "revoke", secret[:14], "--store", store)
    assert r.exit_code == 1 and "already revoked" in r.output


def test_keys_errors(tmp_path):
    store = str(tmp_path / "k.db")
    r = run("keys", "revoke", "key-000000000000", "--store", store)
    assert r.exit_code == 1 and "error:" in r.output
    r = run("keys", "create", "--name", "x", "--expires-in", "soon", "--store", store)
    assert r.exit_code == 1 and "not a lifetime" in r.output
    r = run("keys", "create", "--name", "x", "--store", "mysql://nope/db")
    assert r.exit_code == 1 and "--store" in r.output
    cfg = tmp_path / "s.yaml"
    cfg.write_text("auth: {stor: x}\n")
    r = run("keys", "list", "--config", str(cfg))
    assert r.exit_code == 1 and "auth.stor: unknown key" in r.output


def test_keys_use_the_store_of_the_config(tmp_path):
    cfg = tmp_path / "s.yaml"
    cfg.write_text(f"auth: {{store: {tmp_path / 'from-config.db'}}}\n")
    r = run("keys", "create", "--name", "a", "--config", str(cfg))
    assert r.exit_code == 0
    assert (tmp_path / "from-config.db").exists()
    r = run("keys", "create", "--name", "a", "--expires-in", "30d", "--config", str(cfg))
    assert r.exit_code == 0 and "expires" in r.output
