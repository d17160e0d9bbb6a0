"""`llmgw server init`'s non-interactive core: the real steps run into a temporary root, with a fake
runner standing in for useradd and systemctl."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmgw.cli.main import app
from llmgw.config import load_server_config
from llmgw.init import InitError, steps
from llmgw.init.machine import Machine, parse_ip_addr
from llmgw.init.run import Options, server_init
from llmgw.init.units import agent_unit_text, server_unit_text
from llmgw.pki import load_cert, san_names, verify_issued_by
from llmgw.store import Store


class FakeSystem:
    """useradd, id and systemctl as a machine would answer them, remembering what was run."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.users: set[str] = set()
        self.active: set[str] = set()

    def __call__(self, argv: list[str]) -> tuple[int, str]:
        self.calls.append(argv)
        if argv[:2] == ["id", "-u"]:
            return (0, "999") if argv[2] in self.users else (1, "no such user")
        if argv[0] == "useradd":
            self.users.add(argv[-1])
            return 0, ""
        if argv[:2] == ["systemctl", "enable"]:
            self.active.add(argv[-1])
            return 0, ""
        if argv[:2] in (["systemctl", "is-enabled"], ["systemctl", "is-active"]):
            return (0, "") if argv[-1] in self.active else (3, "")
        return 0, ""

    def ran(self, word: str) -> list[list[str]]:
        return [c for c in self.calls if word in c]


def machine(tmp_path: Path, system: FakeSystem | None = None, **kw) -> Machine:
    return Machine(
        root=tmp_path,
        run=system or FakeSystem(),
        names=["cp1", "localhost"],
        addresses=["127.0.0.1", "10.0.0.5"],
        binary="/usr/local/bin/llmgw",
        **kw,
    )


def snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    return {
        str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(root.rglob("*")) if p.is_file()
    }


def full_run(m: Machine, **kw) -> tuple[list[str], object]:
    lines: list[str] = []
    rep = server_init(m, Options(admin="admin@example.com", **kw), emit=lines.append)
    return lines, rep


def test_the_first_step_creates_the_user_only_when_missing_and_makes_the_directories(tmp_path):
    system = FakeSystem()
    m = machine(tmp_path, system)
    first = steps.user_and_directories(m)
    assert first.status == "made" and "the system user llmgw" in first.detail
    assert len(system.ran("useradd")) == 1 and "--system" in system.ran("useradd")[0]
    assert (m.etc.is_dir(), m.pki.is_dir(), m.var.is_dir()) == (True, True, True)
    assert oct(m.pki.stat().st_mode & 0o777) == "0o700"
    again = steps.user_and_directories(m)
    assert again.status == "kept" and len(system.ran("useradd")) == 1


def test_the_authority_is_made_once_and_never_replaced(tmp_path):
    m = machine(tmp_path)
    steps.user_and_directories(m)
    assert steps.authority(m).status == "made"
    before = (m.pki / "ca.pem").read_bytes(), (m.pki / "ca-key.pem").read_bytes()
    assert steps.authority(m).status == "kept"
    assert ((m.pki / "ca.pem").read_bytes(), (m.pki / "ca-key.pem").read_bytes()) == before


def test_half_an_authority_is_refused_rather_than_replaced(tmp_path):
    m = machine(tmp_path)
    steps.user_and_directories(m)
    steps.authority(m)
    (m.pki / "ca-key.pem").unlink()
    with pytest.raises(InitError, match="half an authority"):
        steps.authority(m)


def test_the_server_certificate_names_the_host_every_address_and_the_extra_names(tmp_path):
    m = machine(tmp_path)
    steps.user_and_directories(m)
    steps.authority(m)
    done = steps.server_certificate(m, ["cp.internal"])
    assert done.status == "made"
    names = san_names(load_cert(m.etc / "server.pem"))
    assert {"cp1", "localhost", "127.0.0.1", "10.0.0.5", "cp.internal"} <= set(names)
    verify_issued_by(m.pki / "ca.pem", m.etc / "server.pem")
    assert (m.etc / "ca.pem").read_bytes() == (m.pki / "ca.pem").read_bytes()
    assert oct((m.etc / "server-key.pem").stat().st_mode & 0o777) == "0o600"


def test_host_on_a_later_run_adds_names_to_the_certificate_keeping_the_old_ones(tmp_path):
    m = machine(tmp_path)
    full_run(m, hosts=["cp.internal"])
    lines, _ = full_run(m, hosts=["203.0.113.10"])
    names = san_names(load_cert(m.etc / "server.pem"))
    assert {"cp.internal", "203.0.113.10", "cp1", "10.0.0.5"} <= set(names)
    assert any("added names 203.0.113.10" in line for line in lines)


def test_certificates_whose_authority_is_elsewhere_are_kept_and_host_says_it_cannot_reissue(tmp_path):
    m = machine(tmp_path)
    full_run(m)
    for name in ("ca.pem", "ca-key.pem"):
        (m.pki / name).unlink()  # the authority moved to another machine
    assert steps.authority(m).status == "kept"
    assert steps.server_certificate(m).status == "kept"
    with pytest.raises(InitError, match="its authority is not on this machine"):
        steps.server_certificate(m, ["new.internal"])
    assert not (m.pki / "ca.pem").exists()


def test_server_yaml_loads_and_holds_mutual_tls_auth_and_an_enabled_control_plane(tmp_path):
    m = machine(tmp_path)
    full_run(m)
    cfg = load_server_config(m.config)
    assert cfg.control.enabled and cfg.auth.enabled and cfg.models == []
    assert cfg.agent_tls is not None and cfg.agent_tls.cert == str(m.etc / "server.pem")
    assert cfg.agent_tls.require_node_mark  # a new control plane's nodes all get marked certificates
    assert cfg.auth.default_price is not None and cfg.auth.default_rpm
    assert cfg.data_path == str(m.var)
    # The mirror beside it: its API on loopback with its token, llama.cpp offered to nodes from its bytes.
    assert cfg.mirror is not None and cfg.mirror.api == "http://127.0.0.1:8082"
    assert cfg.mirror.token_file == str(tmp_path / "srv/models.api-token")
    assert cfg.engines.release_url == "http://10.0.0.5:8081/llama.cpp"
    bare = machine(tmp_path / "bare")
    full_run(bare, no_mirror=True)
    cfg = load_server_config(bare.config)
    assert cfg.mirror is None and cfg.engines.release_url is None


def test_server_yaml_is_never_overwritten_even_when_the_flags_differ_and_the_output_says_so(tmp_path):
    m = machine(tmp_path)
    full_run(m)
    m.config.write_text(m.config.read_text() + "# my edit\n")
    before = m.config.read_bytes()
    lines, _ = full_run(m, mirror_url="http://models.internal:8082")
    assert m.config.read_bytes() == before
    line = next(x for x in lines if x.startswith("4."))
    assert "never overwritten" in line and "differs" in line and "mirror" in line


def test_the_store_gets_the_default_project_and_an_approved_administrator_whose_password_works(tmp_path):
    m = machine(tmp_path)
    lines, rep = full_run(m)
    assert rep.password and sum(rep.password in line for line in lines) == 1

    async def check():
        store = await Store.open(str(m.var / "llmgw.db"))
        try:
            user = await store.verify_password("admin@example.com", rep.password)
            tree = await store.tree(people=True)
            return user, tree
        finally:
            await store.close()

    user, tree = asyncio.run(check())
    assert user is not None and user.admin and user.state == "active"
    project = next(p for p in tree.projects.values() if p.path == "default/default/default")
    assert tree.reaches(user.id, project)
    token = m.var / "admin-token"
    assert token.read_text().startswith("llmgw-admin-") and oct(token.stat().st_mode & 0o777) == "0o600"


def test_a_second_run_changes_no_file_and_never_reprints_or_resets_the_password(tmp_path):
    m = machine(tmp_path)
    _, first = full_run(m)
    before = snapshot(tmp_path)
    lines, rep = full_run(m)
    after = snapshot(tmp_path)
    assert after == before  # every file's bytes and mtime
    assert rep.password is None and not any(first.password in line for line in lines)
    assert "done: nothing changed." in lines
    # Without systemd the mirror is not running, so llama.cpp is not fetched and no model is added.
    assert [d.status for d in rep.done] == ["kept"] * 8 + ["skipped", "kept", "skipped"]


def test_an_interrupted_run_is_finished_by_a_rerun(tmp_path):
    m = machine(tmp_path)
    lines: list[str] = []
    server_init(m, Options(admin="admin@example.com", stop_after=3), emit=lines.append)
    assert len(lines) == 3 and not m.config.exists()
    ca = (m.pki / "ca.pem").read_bytes()
    lines, rep = full_run(m)
    assert [line.split(":")[0] for line in lines[:3]] == [
        "1. user and directories",
        "2. authority",
        "3. server certificate",
    ]
    assert "kept" in lines[1] and "kept" in lines[2]
    assert rep.password and m.config.exists() and (m.var / "admin-token").exists()
    assert (m.pki / "ca.pem").read_bytes() == ca


def test_a_certificate_cut_short_by_an_interruption_is_issued_again(tmp_path):
    m = machine(tmp_path)
    full_run(m)
    (m.etc / "server-key.pem").unlink()
    done = steps.server_certificate(m)
    assert done.status == "changed" and (m.etc / "server-key.pem").exists()


def test_the_units_are_hardened_as_each_role_allows():
    server = server_unit_text(binary="/usr/local/bin/llmgw", config="/etc/llmgw/server.yaml", data_dir="/var/lib/llmgw")
    for line in (
        "User=llmgw",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "ReadWritePaths=/var/lib/llmgw",
        "ExecStart=/usr/local/bin/llmgw server --config /etc/llmgw/server.yaml",
    ):
        assert line in server.splitlines()
    agent = agent_unit_text(binary="/usr/local/bin/llmgw").splitlines()
    for line in ("KillMode=process", "LimitMEMLOCK=infinity", "NoNewPrivileges=yes", "ProtectSystem=strict"):
        assert line in agent
    assert any(x.startswith("ReadWritePaths=/var/lib/llmgw-weights") for x in agent)


def test_without_systemd_the_unit_is_written_but_not_started_and_the_output_says_how(tmp_path):
    system = FakeSystem()
    m = machine(tmp_path, system)
    lines, _ = full_run(m)
    assert (m.units / "llmgw-server.service").exists()
    assert not system.ran("systemctl")
    line = next(x for x in lines if x.startswith("8."))
    assert "not started" in line and "systemctl daemon-reload && systemctl enable --now llmgw-server" in line


def test_with_systemd_the_unit_is_started_once_and_health_awaited(tmp_path):
    system = FakeSystem()
    asked: list[str] = []
    m = machine(tmp_path, system, health=lambda url: asked.append(url) or True)
    (tmp_path / "run/systemd/system").mkdir(parents=True)
    full_run(m, no_mirror=True, no_node=True, no_model=True)
    assert system.ran("enable") == [["systemctl", "enable", "--now", "llmgw-server.service"]]
    assert asked == ["http://127.0.0.1:9090/health"]
    lines, _ = full_run(m, no_mirror=True, no_node=True, no_model=True)
    assert "it is enabled and running" in next(x for x in lines if x.startswith("8."))
    assert len(system.ran("enable")) == 1 and not system.ran("restart")
    full_run(m, hosts=["cp.internal"], no_mirror=True, no_node=True, no_model=True)  # a new name: reissued, restarted
    assert system.ran("restart") == [["systemctl", "restart", "llmgw-server.service"]]


def test_a_server_that_never_answers_health_stops_init_with_where_to_look(tmp_path):
    m = machine(tmp_path, health=lambda url: False, health_timeout=0.2)
    (tmp_path / "run/systemd/system").mkdir(parents=True)
    with pytest.raises(InitError, match="journalctl -u llmgw-mirror"):
        full_run(m)  # the mirror, started first, is waited for the same way
    m = machine(tmp_path / "bare", health=lambda url: False, health_timeout=0.2)
    (tmp_path / "bare/run/systemd/system").mkdir(parents=True)
    with pytest.raises(InitError, match="journalctl -u llmgw-server"):
        full_run(m, no_mirror=True)


def test_each_no_flag_skips_its_step_and_says_which_flag(tmp_path):
    lines, _ = full_run(machine(tmp_path), no_mirror=True, no_node=True, no_model=True)
    by_step = {line.split(".")[0]: line for line in lines if line[:1].isdigit()}
    assert "(--no-mirror)" in by_step["7"] and "(--no-node)" in by_step["10"] and "(--no-model)" in by_step["11"]
    assert not (tmp_path / "srv/models").exists() and not (tmp_path / "etc/llmgw/agent.yaml").exists()


def test_contradicting_or_bad_options_are_refused_before_anything_is_written(tmp_path):
    with pytest.raises(InitError, match="contradict"):
        full_run(machine(tmp_path), mirror_url="http://m:8082", no_mirror=True)
    with pytest.raises(InitError, match="not an email"):
        server_init(machine(tmp_path), Options(admin="nobody"), emit=lambda line: None)
    assert list(tmp_path.iterdir()) == []


def test_ip_addr_output_gives_every_address_but_link_local_ones():
    text = """[{"ifname":"lo","addr_info":[{"family":"inet","local":"127.0.0.1","scope":"host"},
    {"family":"inet6","local":"::1","scope":"host"}]},
    {"ifname":"eth0","addr_info":[{"family":"inet","local":"10.0.0.5","scope":"global"},
    {"family":"inet6","local":"fe80::1","scope":"link"}]}]"""
    assert parse_ip_addr(text) == ["127.0.0.1", "::1", "10.0.0.5"]


runner = CliRunner()


def test_the_command_refuses_as_non_root_without_a_root_prefix(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    r = runner.invoke(app, ["server", "init", "--admin", "a@example.com", "--plain"])
    assert r.exit_code != 0 and "must run as root" in r.output and "--root DIR" in r.output


def test_the_command_without_admin_asks_for_it(tmp_path):
    r = runner.invoke(app, ["server", "init", "--plain", "--root", str(tmp_path)])
    assert r.exit_code != 0 and "--admin EMAIL" in r.output
    assert list(tmp_path.iterdir()) == []


def test_the_command_prints_one_line_per_step_into_a_root_prefix(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    r = runner.invoke(app, ["server", "init", "--admin", "a@example.com", "--plain", "--root", str(tmp_path)])
    assert r.exit_code == 0, r.output
    numbered = [line.split(".")[0] for line in r.output.splitlines() if line[:1].isdigit()]
    assert numbered == [str(i) for i in range(1, 12)]
    assert (tmp_path / "etc/llmgw/server.yaml").exists()
    r = runner.invoke(app, ["server", "init", "--admin", "a@example.com", "--plain", "--root", str(tmp_path)])
    assert r.exit_code == 0 and "nothing changed" in r.output and "password" not in r.output
