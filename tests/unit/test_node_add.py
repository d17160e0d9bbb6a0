"""`llmgw node add`'s decisions without a machine: targets and fabrics as typed, the dialled address
checked against the server certificate, doctor's verdict, fabric groups asked once; the SSH steps
themselves run against real machines in tests/e2e/test_node_add_e2e.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmgw.cli.main import app
from llmgw.onboard import OnboardError
from llmgw.onboard.add import (
    Adder,
    AddOptions,
    ControlPlane,
    Fabric,
    Outcome,
    dial_url,
    fabric_groups,
    read_control_plane,
)
from llmgw.onboard.ssh import Result, Target, known_keys
from llmgw.progress import PlainSteps
from llmgw.protocol.doctor import DoctorReport
from tests.unit.test_server_init import machine


def test_a_target_is_user_at_host_with_root_as_the_default_user():
    assert Target.parse("10.0.0.21") == Target("10.0.0.21", "root", 22)
    assert Target.parse("ubuntu@node-b", port=2222) == Target("node-b", "ubuntu", 2222)
    assert Target.parse("root@[fd00::5]").host == "fd00::5"
    assert Target("h", port=2222).known_hosts_name == "[h]:2222"
    for bad in ("@node", "root@", ""):
        with pytest.raises(OnboardError, match=r"\[user@\]host"):
            Target.parse(bad)


def test_a_fabric_is_a_name_and_its_adapters():
    assert Fabric.parse("ib-a:mlx5_0, mlx5_1") == Fabric("ib-a", ["mlx5_0", "mlx5_1"])
    for bad in ("ib-a", "ib-a:", ":mlx5_0"):
        with pytest.raises(OnboardError, match="NAME:hca1,hca2"):
            Fabric.parse(bad)


def test_known_hosts_entries_are_found_by_name_among_several():
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "known_hosts"
        p.write_text("# c\nb,10.0.0.2 ssh-ed25519 AAAAB\n[c]:2222 ssh-rsa AAAAC\n")
        assert known_keys(p, "10.0.0.2") == ["ssh-ed25519 AAAAB"]
        assert known_keys(p, "[c]:2222") == ["ssh-rsa AAAAC"] and known_keys(p, "c") == []


@pytest.fixture
def control_plane(tmp_path) -> tuple[AddOptions, ControlPlane]:
    from llmgw.init.run import Options, server_init

    m = machine(tmp_path)
    server_init(m, Options(admin="a@example.com", no_mirror=True, no_node=True, no_model=True), emit=lambda _: None)
    opts = AddOptions(hosts=["root@127.0.0.1"], pki=m.pki, config=m.config)
    return opts, read_control_plane(opts)


def test_the_authority_is_read_before_any_machine_is_touched(tmp_path):
    opts = AddOptions(hosts=["root@b"], pki=tmp_path / "nowhere", config=tmp_path / "server.yaml")
    with pytest.raises(OnboardError, match="--pki DIR"):
        read_control_plane(opts)


def test_the_dialled_address_must_be_in_the_server_certificate(control_plane):
    opts, cp = control_plane
    assert dial_url(cp, opts, "127.0.0.1") == "https://127.0.0.1:7443"  # loopback is in it
    opts.server = "https://cp.example.net"
    with pytest.raises(OnboardError, match=r"not in the certificate.*server init --host cp\.example\.net"):
        dial_url(cp, opts, "127.0.0.1")
    opts.server = "10.0.0.5:7443"
    assert dial_url(cp, opts, "127.0.0.1") == "https://10.0.0.5:7443"


REPORT = {
    "findings": [
        {"level": "FAIL", "area": "disk", "message": "0.0 GiB free where weights go", "fix": "free space"},
        {"level": "WARN", "area": "cpu", "message": "no AVX2", "fix": 'CPU type "host"'},
    ],
    "facts": {
        "inventory": {
            "node_id": "b",
            "adapters": [
                {"name": f"mlx5_{i}", "ports": [{"hca": f"mlx5_{i}", "port": 1, **port}]}
                for i, port in enumerate(
                    [
                        {"state": "ACTIVE", "link_layer": "InfiniBand"},
                        {"state": "ACTIVE", "link_layer": "InfiniBand"},
                        {"state": "DOWN", "link_layer": "InfiniBand"},
                        {"state": "ACTIVE", "link_layer": "Ethernet", "network": "10.9.0.0/24"},
                    ]
                )
            ],
        },
        "subnet_managers": {
            "ports": [
                {
                    "hca": "mlx5_0",
                    "port": 1,
                    "master": {"guid": "0x00000000000000b2"},
                    "managers": [{"guid": "0x00000000000000b2"}, {"guid": "0x00000000000000a1"}],
                },
                {"hca": "mlx5_1", "port": 1, "master": {"guid": "0x00000000000000a1"}},
            ]
        },
    },
}


def _report() -> DoctorReport:
    return DoctorReport.model_validate(REPORT)


def test_active_adapters_are_grouped_by_the_lowest_subnet_manager_guid_and_roce_network():
    groups = fabric_groups(_report())
    assert groups == {
        "InfiniBand subnet manager 0x00000000000000a1": ["mlx5_0", "mlx5_1"],
        "RoCE network 10.9.0.0/24": ["mlx5_3"],
    }


class FakeSession:
    def __init__(self, report: dict) -> None:
        import json

        self.out = json.dumps(report)

    async def run(self, command: str, **kw) -> Result:
        return Result(1, self.out, "")


class AskingSteps(PlainSteps):
    def __init__(self, answers: list[str | None]) -> None:
        self.lines: list[str] = []
        super().__init__(self.lines.append)
        self.answers = answers
        self.asked: list[str] = []

    def ask(self, question, choices, default):
        self.asked.append(question)
        return self.answers.pop(0) if self.answers else None


def _adder(opts: AddOptions, steps) -> Adder:
    return Adder(opts, steps, ControlPlane(cfg=None, cert_names=[], api=None))  # type: ignore[arg-type]


def test_a_doctor_fail_stops_the_node_with_each_fix_unless_told_to_go_on():
    steps = AskingSteps([])
    adder = _adder(AddOptions(hosts=["b"]), steps)
    steps.begin("b doctor", "doctor")
    with pytest.raises(OnboardError, match=r"FAIL disk: 0\.0 GiB free .*\(fix: free space\).*--ignore-checks"):
        asyncio.run(adder._doctor(FakeSession(REPORT), "b", "b doctor"))
    assert "FAILED" in steps.lines[-1]
    # --ignore-checks, or "go on" in the terminal: warned, not stopped
    adder = _adder(AddOptions(hosts=["b"], ignore_checks=True), AskingSteps([]))
    assert asyncio.run(adder._doctor(FakeSession(REPORT), "b", "k")).findings[0].level == "FAIL"
    asking = AskingSteps(["go on"])
    adder = _adder(AddOptions(hosts=["b"]), asking)
    asyncio.run(adder._doctor(FakeSession(REPORT), "b", "k"))
    assert "Go on anyway?" in asking.asked[0] and "going on past it (asked)" in asking.lines[-1]


def test_a_doctor_that_prints_no_report_stops_with_what_it_said():
    class Broken(FakeSession):
        async def run(self, command, **kw):
            return Result(127, "", "llmgw: cannot execute binary file: Exec format error")

    adder = _adder(AddOptions(hosts=["b"]), AskingSteps([]))
    with pytest.raises(OnboardError, match="Exec format error"):
        asyncio.run(adder._doctor(Broken(REPORT), "b", "k"))


def test_a_fabric_name_given_for_one_node_is_reused_for_the_next_on_the_same_fabric():
    steps = AskingSteps(["ib-a", "roce-x"])
    adder = _adder(AddOptions(hosts=["b", "c"]), steps)
    first = adder._fabrics(_report(), "b", "b fabric")
    second = adder._fabrics(_report(), "c", "c fabric")
    assert first == second == [{"name": "ib-a", "hcas": ["mlx5_0", "mlx5_1"]}, {"name": "roce-x", "hcas": ["mlx5_3"]}]
    assert len(steps.asked) == 2  # once per fabric, not per node


def test_without_a_terminal_active_adapters_stay_undeclared_and_the_fix_is_said():
    steps = AskingSteps([])
    adder = _adder(AddOptions(hosts=["b"]), steps)
    assert adder._fabrics(_report(), "b", "b fabric") == []
    assert "--fabric NAME:hca" in steps.lines[-1]
    given = _adder(AddOptions(hosts=["b"], fabrics=[Fabric("ib-a", ["mlx5_0"])]), steps)
    assert given._fabrics(_report(), "b", "b fabric") == [{"name": "ib-a", "hcas": ["mlx5_0"]}]


runner = CliRunner()


def test_the_command_refuses_contradicting_flags_and_node_with_several_hosts(tmp_path):
    r = runner.invoke(app, ["node", "add", "b", "--wait", "--no-wait"])
    assert r.exit_code != 0 and "contradict" in r.output
    r = runner.invoke(app, ["node", "add", "b", "c", "--node", "x", "--plain", "--pki", str(tmp_path)])
    assert r.exit_code != 0 and "--node names one node" in r.output


def test_a_missing_authority_is_said_before_any_host_is_tried(tmp_path):
    r = runner.invoke(app, ["node", "add", "root@192.0.2.1", "--plain", "--pki", str(tmp_path / "none")])
    assert r.exit_code != 0 and "authority" in r.output and "192.0.2.1" not in r.output


def test_node_add_refuses_an_administrators_name_given_with_node_before_any_ssh(control_plane, monkeypatch):
    import llmgw.onboard.add as add

    opts, _ = control_plane
    dialled: list[str] = []

    async def no_ssh(target, **kw):
        dialled.append(target.host)
        raise AssertionError("node add dialled SSH")

    monkeypatch.setattr(add, "connect", no_ssh)
    opts.node_id = "admin"
    steps = AskingSteps([])
    with pytest.raises(OnboardError, match=r"--node admin: 'admin' is an administrator's name"):
        add.add_nodes(opts, steps, admin=lambda url, token: None)  # type: ignore[arg-type, return-value]
    assert dialled == [] and "FAILED" in steps.lines[-1]


class NamedHost:
    """A machine reached over SSH whose host name is ``hostname``; records what would change on it."""

    sudo = True

    def __init__(self, hostname: str) -> None:
        self.hostname = hostname
        self.written: list[str] = []
        self.ran: list[str] = []

    async def check_sudo(self) -> None:
        pass

    async def must(self, command: str, doing: str) -> str:
        self.ran.append(command)
        return {"hostname": self.hostname + "\n", "uname -m": "x86_64\n"}[command]

    async def write(self, path: str, data: bytes, mode: int) -> None:
        self.written.append(path)


def test_a_host_named_admin_is_refused_as_soon_as_its_name_is_read_and_nothing_on_it_changes(control_plane):
    opts, cp = control_plane
    steps = AskingSteps([])
    adder = Adder(opts, steps, cp)
    host = NamedHost("admin")
    steps.begin("b ssh", "ssh")
    with pytest.raises(OnboardError, match=r"b: 'admin' is an administrator's name.*--node ID"):
        asyncio.run(adder._on(host, Target("b"), "https://127.0.0.1:7443", Outcome("b"), "b ssh", None))  # type: ignore[arg-type]
    assert host.ran == ["hostname", "uname -m"] and host.written == []
    assert "FAILED" in steps.lines[-1]
