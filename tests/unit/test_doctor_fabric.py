"""doctor's GPU-driver, NVSwitch, IMEX and subnet-manager checks, on the
outputs of lspci, nvidia-smi -L, sminfo and saquery in their real formats
(tests/fixtures/doctor/README.md says where each came from), through doctor's
own fact collection; and against the real lspci and sminfo where installed."""

from __future__ import annotations

import dataclasses
import shutil
import socket
import threading
from pathlib import Path

import pytest
from test_doctor_checks import DOCTOR_FIX, SMI, FakeRun, find, gb200_facts, h100_answers, machine, write_port

from llmgw.agent.discovery.commands import CommandResult, run_command
from llmgw.agent.discovery.subnet import (
    MASTER,
    STANDBY,
    collect_subnet_managers,
    parse_issm_lids,
    parse_sminfo,
    parse_smir,
)
from llmgw.doctor import collect_facts, evaluate
from llmgw.doctor.nvidia import (
    dial_peers,
    is_gpu,
    is_nvswitch,
    nvidia_pci,
    parse_lspci,
    parse_smi_list,
    read_imex_config,
)
from llmgw.protocol import IMEX, IBPort
from llmgw.protocol.doctor import ImexPeer, Level

FX = DOCTOR_FIX
LSPCI = "/usr/bin/lspci"
SMINFO, SAQUERY = "/usr/sbin/sminfo", "/usr/sbin/saquery"
M_GUID, S_GUID = "0x248a070300f7d3a0", "0x248a070300f7d3c8"


def tools(*names: str):
    known = {"nvidia-smi": SMI, "systemctl": "/usr/bin/systemctl", "lspci": LSPCI, "sminfo": SMINFO, "saquery": SAQUERY}
    return lambda name: known.get(name) if name in names else None


def fixture(name: str) -> str:
    return (FX / name).read_text()


# ------------------------------------------------------------------ PCI bus


def test_lspci_of_an_hgx_h100_shows_four_nvswitches_and_eight_gpus_whichever_pci_ids_names_them():
    for name in ("lspci_hgx_h100_rhel94.txt", "lspci_hgx_h100_debian12.txt"):
        devices = parse_lspci(fixture(name))
        assert [d.address for d in devices if is_nvswitch(d)] == [f"0000:{b}:00.0" for b in ("07", "08", "09", "0a")]
        assert len([d for d in devices if is_gpu(d)]) == 8
        assert all(d.device_id in ("22a3", "2330") for d in devices), "the ASPEED VGA is not NVIDIA's"
    named = parse_lspci(fixture("lspci_hgx_h100_rhel94.txt"))
    assert named[0].name == "GH100 [H100 NVSwitch]" and named[0].class_id == "0680"
    # Debian 12's pci.ids calls the switch only "Device": the device id decides.
    assert parse_lspci(fixture("lspci_hgx_h100_debian12.txt"))[0].name is None


def test_an_nforce_ethernet_bridge_and_a_grace_root_port_are_not_nvswitches():
    devices = parse_lspci(fixture("lspci_nforce_mcp61.txt"))
    assert [d.address for d in devices if d.class_id == "0680"] == ["0000:00:07.0"]
    assert not [d for d in devices if is_nvswitch(d) or is_gpu(d)]
    # A GB200 tray's Grace root port, as lspci prints it there (an NVIDIA PCI bridge, class 0604).
    grace = parse_lspci("0018:00:00.0 PCI bridge [0604]: NVIDIA Corporation Device [10de:22b1]\n")
    assert len(grace) == 1 and not is_nvswitch(grace[0])


def test_sysfs_gives_the_nvidia_devices_where_lspci_is_not_installed(tmp_path):
    devices = tmp_path / "bus" / "pci" / "devices"
    for addr, vendor, device, cls in (
        ("0000:07:00.0", "0x10de", "0x22a3", "0x068000"),
        ("0000:1b:00.0", "0x10de", "0x2330", "0x030200"),
        ("0000:04:00.0", "0x1a03", "0x2000", "0x030000"),
    ):
        d = devices / addr
        d.mkdir(parents=True)
        for f, v in (("vendor", vendor), ("device", device), ("class", cls)):
            (d / f).write_text(v + "\n")
    found, source = nvidia_pci(FakeRun({}), None, tmp_path)
    assert source == "sysfs"
    assert [(d.address, d.class_id, d.device_id) for d in found or ()] == [
        ("0000:07:00.0", "0680", "22a3"),
        ("0000:1b:00.0", "0302", "2330"),
    ]
    assert is_nvswitch((found or [])[0])


def test_the_real_lspci_prints_the_hgx_dump_in_the_format_doctor_parses():
    lspci = shutil.which("lspci") or next((p for p in ("/usr/sbin/lspci", "/sbin/lspci") if Path(p).exists()), None)
    if lspci is None:
        pytest.skip("pciutils is not installed here")
    res = run_command([lspci, "-F", str(FX / "hgx_h100_config_space.lspci-x"), "-Dnn", "-d", "10de:"], 10)
    assert res.ok, res.describe_failure()
    devices = parse_lspci(res.stdout)
    assert len([d for d in devices if is_nvswitch(d)]) == 4 and len([d for d in devices if is_gpu(d)]) == 8
    # And on this machine's own bus lspci and sysfs agree on NVIDIA's devices.
    live, source = nvidia_pci(run_command, lspci, Path("/sys"))
    sysfs, _ = nvidia_pci(run_command, None, Path("/sys"))
    assert source == "lspci" and [d.address for d in live or ()] == [d.address for d in sysfs or ()]


# ------------------------------------------------------------------ NVSwitch and the driver


def no_smi_machine(tmp_path, fm_state: str, *, module_loaded: bool):
    answers = {k: v for k, v in h100_answers(fm_state).items() if k[0] != SMI}
    answers[(LSPCI, "-Dnn")] = fixture("lspci_hgx_h100_debian12.txt")
    opts = dataclasses.replace(machine(tmp_path, answers, nvswitch=False), which=tools("systemctl", "lspci"))
    if not module_loaded:
        (opts.proc_root / "driver" / "nvidia" / "version").unlink()
    return opts


def test_nvswitches_on_the_pci_bus_with_no_driver_fail_the_fabric_manager_and_the_driver(tmp_path):
    facts = collect_facts(no_smi_machine(tmp_path, "inactive", module_loaded=False))
    assert facts.nvidia_pci_source == "lspci" and facts.nvswitch is True
    assert "4 NVSwitch(es) on the PCI bus" in (facts.nvswitch_evidence or "")
    findings = evaluate(facts)
    find(findings, Level.FAIL, "nvlink", "this machine has NVSwitch but nvidia-fabricmanager is inactive")
    f = find(findings, Level.FAIL, "gpu", "8 NVIDIA GPU(s) on the PCI bus")
    assert "no NVIDIA driver is installed" in f.message and "580" in (f.fix or "")


def test_a_loaded_module_without_nvidia_smi_says_the_utilities_are_missing(tmp_path):
    findings = evaluate(collect_facts(no_smi_machine(tmp_path, "active", module_loaded=True)))
    f = find(findings, Level.FAIL, "gpu", "the kernel module 550.90.07 is loaded but nvidia-smi is not installed")
    assert "GH100[H100 SXM5 80GB]" in f.message  # named as that lspci names it


@pytest.mark.parametrize(
    ("output", "code", "said", "fix"),
    [
        ("smi_no_driver.txt", 9, "couldn't communicate with the NVIDIA driver", "modprobe nvidia"),
        ("smi_version_mismatch.txt", 18, "Driver/library version mismatch", "reboot"),
        ("smi_L_gpu_lost.txt", 15, "Unable to determine the device handle", "fell off the bus"),
    ],
)
def test_a_driver_that_does_not_answer_fails_with_the_fix_for_what_nvidia_smi_said(tmp_path, output, code, said, fix):
    answers = h100_answers("active")
    answers[(SMI, "-L")] = {"returncode": code, "stdout": fixture(output)}
    findings = evaluate(collect_facts(machine(tmp_path, answers, nvswitch=True)))
    f = find(findings, Level.FAIL, "gpu", "the NVIDIA driver does not answer")
    assert said in f.message and fix in (f.fix or "")
    assert ("it lists 7 GPU(s) and fails on the rest" in f.message) == (output == "smi_L_gpu_lost.txt")


def test_nouveau_holding_the_gpus_is_named_in_the_fix(tmp_path):
    answers = h100_answers("active")
    answers[(SMI, "-L")] = {"returncode": 9, "stdout": fixture("smi_no_driver.txt")}
    opts = machine(tmp_path, answers, modules="nouveau 1 0 - Live 0\nib_uverbs 1 0 - Live 0\n")
    f = find(evaluate(collect_facts(opts)), Level.FAIL, "gpu", "the NVIDIA driver does not answer")
    assert "blacklist nouveau" in (f.fix or "")


def test_a_hung_nvidia_smi_is_said_to_be_a_wedged_driver():
    probe = parse_smi_list(SMI, CommandResult((SMI, "-L"), None, timed_out=True))
    assert not probe.answered and "did not answer within 15 s" in (probe.error or "")
    facts = gb200_facts(IMEX(state="active", channels=1)).model_copy(update={"nvidia_smi": probe})
    assert "wedged" in (find(evaluate(facts), Level.FAIL, "gpu", "does not answer").fix or "")


def test_a_driver_listing_fewer_gpus_than_the_bus_holds_warns(tmp_path):
    answers = h100_answers("active")
    answers[(SMI, "-L")] = "".join(fixture("smi_L_hgx_h100.txt").splitlines(keepends=True)[:7])
    answers[(LSPCI, "-Dnn")] = fixture("lspci_hgx_h100_rhel94.txt")
    opts = dataclasses.replace(machine(tmp_path, answers), which=tools("nvidia-smi", "systemctl", "lspci"))
    find(evaluate(collect_facts(opts)), Level.WARN, "gpu", "8 NVIDIA GPUs are on the PCI bus but the driver lists 7")


def test_an_answering_driver_with_every_gpu_listed_gives_no_driver_finding(tmp_path):
    answers = h100_answers("active")
    answers[(LSPCI, "-Dnn")] = fixture("lspci_hgx_h100_rhel94.txt")
    opts = dataclasses.replace(machine(tmp_path, answers), which=tools("nvidia-smi", "systemctl", "lspci"))
    facts = collect_facts(opts)
    assert facts.nvidia_smi is not None and facts.nvidia_smi.answered and facts.nvidia_smi.gpus == 8
    assert not [f for f in evaluate(facts) if f.area == "gpu" and f.level is not Level.OK]


# ------------------------------------------------------------------ subnet managers


def test_sminfo_and_saquery_outputs_parse_into_subnet_managers():
    m = parse_sminfo(fixture("sminfo_master.txt"))
    assert m is not None and (m.guid, m.lid, m.priority, m.state) == (M_GUID, 1, 15, MASTER)
    assert [(r.guid, r.lid, r.priority, r.state) for r in parse_smir(fixture("saquery_smir_master_standby.txt"))] == [
        (M_GUID, 1, 15, MASTER),
        (S_GUID, 2, 14, STANDBY),
    ]
    assert parse_issm_lids(fixture("saquery_s_issm.txt")) == [1, 2]  # lid 37 is under IsSMdisabled
    assert parse_sminfo(fixture("sminfo_no_umad.stdout")) is None


class Diags:
    """sminfo and saquery answers by port and query, counting what was asked."""

    def __init__(self, smir: str | dict[str, object], *, sminfo: dict[str, object] | None = None, issm: str = ""):
        self.smir, self.sminfo, self.issm = smir, sminfo, issm
        self.asked: list[tuple[str, ...]] = []
        self.lock = threading.Lock()

    def __call__(self, argv):
        with self.lock:
            self.asked.append(tuple(argv))
        args = argv[5:]
        if argv[0] == SMINFO:
            if self.sminfo is not None:
                return CommandResult(tuple(argv), **self.sminfo)  # type: ignore[arg-type]
            name = "sminfo_lid2_standby.txt" if args == ("2",) else "sminfo_master.txt"
            return CommandResult(tuple(argv), 0, fixture(name))
        if args == ("SMIR",):
            if isinstance(self.smir, dict):
                return CommandResult(tuple(argv), **self.smir)  # type: ignore[arg-type]
            return CommandResult(tuple(argv), 0, fixture(self.smir))
        return CommandResult(tuple(argv), 0, self.issm)


def ib_machine(tmp_path, diags: Diags, *names: str):
    answers = h100_answers("active")
    answers[(SMINFO,)] = diags
    answers[(SAQUERY,)] = diags
    opts = machine(tmp_path, answers)
    write_port(opts.ib_root, "mlx5_1", 1)  # type: ignore[arg-type]
    write_port(opts.ib_root, "mlx5_2", 1, link_layer="Ethernet", rate="100 Gb/sec (4X EDR)")  # type: ignore[arg-type]
    return dataclasses.replace(opts, which=tools("nvidia-smi", "systemctl", *names))


def test_a_subnet_with_a_standby_manager_is_ok_and_asked_once_for_both_its_ports(tmp_path):
    diags = Diags("saquery_smir_master_standby.txt")
    facts = collect_facts(ib_machine(tmp_path, diags, "sminfo", "saquery"))
    sm = facts.subnet_managers
    assert sm is not None and [(r.hca, r.source) for r in sm.ports or ()] == [
        ("mlx5_0", "saquery SMIR"),
        ("mlx5_1", "as mlx5_0/1"),
    ], "the RoCE port mlx5_2 has no subnet manager to ask"
    assert sorted(a[:5] for a in diags.asked if a[0] == SMINFO) == [
        (SMINFO, "-C", "mlx5_0", "-P", "1"),
        (SMINFO, "-C", "mlx5_1", "-P", "1"),
    ]
    assert [a for a in diags.asked if a[0] == SAQUERY] == [(SAQUERY, "-C", "mlx5_0", "-P", "1", "SMIR")]
    f = find(evaluate(facts), Level.OK, "fabric", "subnet of mlx5_0/1, mlx5_1/1: master 0x248a070300f7d3a0")
    assert "standby 0x248a070300f7d3c8 (lid 2, priority 14)" in f.message


@pytest.mark.parametrize("smir", ["saquery_smir_master_only.txt", "saquery_smir_master_notactive.txt"])
def test_a_subnet_without_a_standby_manager_warns_with_the_fix(tmp_path, smir):
    # A second SM that is not active (SMState 0) would not take over either.
    facts = collect_facts(ib_machine(tmp_path, Diags(smir), "sminfo", "saquery"))
    f = find(evaluate(facts), Level.WARN, "fabric", "no standby subnet manager on the subnet of mlx5_0/1, mlx5_1/1")
    assert "a master's failure stops the fabric's routing changes" in f.message
    assert "lower priority" in (f.fix or "")


def test_when_saquery_smir_fails_the_ports_running_an_sm_are_asked_one_by_one(tmp_path):
    smir_fails = {"returncode": 255, "stderr": fixture("saquery_no_sa.stderr")}
    diags = Diags(smir_fails, issm=fixture("saquery_s_issm.txt"))
    facts = collect_facts(ib_machine(tmp_path, diags, "sminfo", "saquery"))
    row = (facts.subnet_managers.ports or [])[0]  # type: ignore[union-attr]
    assert row.source == "saquery -s + sminfo" and row.error is None
    assert [(m.lid, m.state) for m in row.managers or ()] == [(1, MASTER), (2, STANDBY)]
    assert (SMINFO, "-C", "mlx5_0", "-P", "1", "2") in diags.asked
    find(evaluate(facts), Level.OK, "fabric", "standby 0x248a070300f7d3c8")


def test_infiniband_ports_without_infiniband_diags_warn_to_install_it(tmp_path):
    facts = collect_facts(ib_machine(tmp_path, Diags("saquery_smir_master_only.txt")))
    assert facts.subnet_managers is not None and facts.subnet_managers.missing_tools == ["sminfo", "saquery"]
    f = find(evaluate(facts), Level.WARN, "fabric", "infiniband-diags is not installed (no sminfo, saquery)")
    assert "mlx5_0/1, mlx5_1/1" in f.message and "install infiniband-diags" in (f.fix or "")


def test_a_node_without_active_infiniband_ports_gets_no_subnet_manager_finding(tmp_path):
    roce = IBPort(hca="mlx5_2", port=1, state="ACTIVE", link_layer="Ethernet")
    down = IBPort(hca="mlx5_3", port=1, state="DOWN", link_layer="InfiniBand")
    assert collect_subnet_managers([roce, down], FakeRun({}), lambda name: None) is None
    facts = collect_facts(machine(tmp_path, h100_answers("active"), ib=False))
    assert facts.subnet_managers is None
    assert not [f for f in evaluate(facts) if "subnet manager" in f.message or "infiniband-diags" in f.message]


def test_sminfo_failing_for_want_of_ib_umad_says_to_load_it(tmp_path):
    no_umad = {
        "returncode": 255,
        "stdout": fixture("sminfo_no_umad.stdout"),
        "stderr": fixture("sminfo_no_umad.stderr"),
    }
    diags = Diags("saquery_smir_master_only.txt", sminfo=no_umad)
    findings = evaluate(collect_facts(ib_machine(tmp_path, diags, "sminfo", "saquery")))
    f = find(findings, Level.WARN, "fabric", "could not ask mlx5_0/1 for its subnet manager: ibwarn: get_abi_version")
    assert "is ib_umad module loaded?" in f.message and f.fix and f.fix.startswith("modprobe ib_umad")
    assert not [a for a in diags.asked if a[0] == SAQUERY], "no master, nothing to ask the SA about"


def test_a_master_reporting_that_it_is_still_discovering_warns(tmp_path):
    discovering = {"returncode": 0, "stdout": fixture("sminfo_discovering.txt")}
    diags = Diags("saquery_smir_master_only.txt", sminfo=discovering)
    findings = evaluate(collect_facts(ib_machine(tmp_path, diags, "sminfo", "saquery")))
    find(findings, Level.WARN, "fabric", "reports SMINFO_DISCOVER, not master")


def test_a_port_in_init_with_its_link_up_warns_that_no_subnet_manager_configured_it(tmp_path):
    opts = machine(tmp_path, h100_answers("active"))
    write_port(opts.ib_root, "mlx5_1", 1, state="2: INIT", sm_lid="0x0")  # type: ignore[arg-type]
    f = find(evaluate(collect_facts(opts)), Level.WARN, "fabric", "mlx5_1/1 is INIT with its link up")
    assert "subnet manager" in (f.fix or "")


def test_the_real_sminfo_says_why_it_cannot_ask_a_port():
    sminfo = shutil.which("sminfo") or next((p for p in ("/usr/sbin/sminfo", "/sbin/sminfo") if Path(p).exists()), None)
    if sminfo is None:
        pytest.skip("infiniband-diags is not installed here")
    if Path("/sys/class/infiniband/mlx5_0").exists():
        pytest.skip("this machine has an mlx5_0: the no-adapter answer cannot be asked for")
    port = IBPort(hca="mlx5_0", port=1, state="ACTIVE", link_layer="InfiniBand")
    found = {"sminfo": sminfo, "saquery": shutil.which("saquery") or str(Path(sminfo).with_name("saquery"))}
    sm = collect_subnet_managers([port], run_command, found.get)
    row = (sm.ports or [])[0]  # type: ignore[union-attr]
    assert row.master is None and "Failed to open 'mlx5_0' port '1'" in (row.error or "")


# ------------------------------------------------------------------ IMEX peers


@pytest.fixture
def imex_listener():
    """A real listener on 127.0.0.2 standing in for a peer's nvidia-imex; 127.0.0.3 has none."""
    s = socket.create_server(("127.0.0.2", 0))
    yield s.getsockname()[1]
    s.close()


def imex_files(tmp_path: Path, port: int, nodes: list[str] | None) -> Path:
    nodes_file = tmp_path / "nodes_config.cfg"
    if nodes is not None:
        nodes_file.write_text("\n".join(nodes) + "\n")
    cfg = fixture("imex_config.cfg").replace("SERVER_PORT=50000", f"SERVER_PORT={port}")
    cfg = cfg.replace("/etc/nvidia-imex/nodes_config.cfg", str(nodes_file))
    path = tmp_path / "config.cfg"
    path.write_text(cfg)
    return path


def ip_addr() -> FakeRun:
    return FakeRun({("ip", "-j", "addr", "show"): fixture("ip_j_addr_show.json")})


def in_domain(imex_config):
    return gb200_facts(IMEX(state="active", channels=1)).model_copy(update={"imex_config": imex_config})


def test_imex_peers_are_dialled_on_the_imex_port_and_one_that_refuses_warns(tmp_path, imex_listener):
    # 192.0.2.2 is this machine's own address in the captured `ip -j addr show`.
    cfg = imex_files(tmp_path, imex_listener, ["192.0.2.2", "127.0.0.2", "127.0.0.3"])
    answers = h100_answers("active")
    answers[("ip", "-j", "addr", "show")] = fixture("ip_j_addr_show.json")
    facts = collect_facts(machine(tmp_path / "m", answers, imex_config=cfg))
    c = facts.imex_config
    assert c is not None and c.port == imex_listener and c.nodes_file == str(tmp_path / "nodes_config.cfg")
    assert [(p.address, p.local, p.reachable) for p in c.peers or ()] == [
        ("192.0.2.2", True, None),
        ("127.0.0.2", False, True),
        ("127.0.0.3", False, False),
    ]
    findings = evaluate(in_domain(c))
    f = find(findings, Level.WARN, "nvlink", f"IMEX peer(s) do not answer on port {imex_listener}: 127.0.0.3 (")
    assert "refused" in f.message.lower() and f"TCP port {imex_listener}" in (f.fix or "")
    assert not [x for x in findings if "none of this node's addresses" in x.message]


def test_imex_peers_that_all_answer_are_ok(tmp_path, imex_listener):
    c = read_imex_config(imex_files(tmp_path, imex_listener, ["192.0.2.2", "127.0.0.2"]), ip_addr())
    find(evaluate(in_domain(c)), Level.OK, "nvlink", f"the 1 other IMEX peer(s) in {tmp_path / 'nodes_config.cfg'}")


def test_a_node_missing_from_its_own_imex_node_list_fails(tmp_path, imex_listener):
    c = read_imex_config(imex_files(tmp_path, imex_listener, ["127.0.0.2", "172.27.58.71"]), ip_addr())
    f = find(evaluate(in_domain(c)), Level.FAIL, "nvlink", "none of this node's addresses is in")
    assert "will not start" in f.message and "systemctl restart nvidia-imex" in (f.fix or "")


def test_an_unreadable_imex_node_list_fails_naming_it(tmp_path):
    c = read_imex_config(imex_files(tmp_path, 50000, None), ip_addr())
    assert c is not None and c.peers is None and c.error
    f = find(evaluate(in_domain(c)), Level.FAIL, "nvlink", f"{tmp_path / 'nodes_config.cfg'} could not be read")
    assert "one IP address per line" in (f.fix or "")


def test_the_default_node_list_and_port_apply_when_config_cfg_leaves_them_out(tmp_path):
    path = tmp_path / "config.cfg"
    path.write_text("DAEMONIZE=1\n")
    c = read_imex_config(path, ip_addr())
    assert c is not None and (c.nodes_file, c.port) == ("/etc/nvidia-imex/nodes_config.cfg", 50000)
    assert read_imex_config(tmp_path / "absent.cfg", ip_addr()) is None


def test_imex_peers_are_not_judged_outside_a_multi_node_nvlink_domain(tmp_path, imex_listener):
    c = read_imex_config(imex_files(tmp_path, imex_listener, ["127.0.0.3"]), ip_addr())
    facts = collect_facts(machine(tmp_path / "m", h100_answers("active"), nvswitch=True))
    assert not [f for f in evaluate(facts.model_copy(update={"imex_config": c})) if "IMEX" in f.message]


def test_a_peer_that_never_answers_is_said_silent_once_its_dial_timeout_passes(tmp_path):
    release = threading.Event()
    peers = [ImexPeer(address="10.9.9.9")]
    try:
        dial_peers(peers, 50000, lambda host, port, timeout: release.wait(), timeout=0.2)
    finally:
        release.set()
    assert (peers[0].reachable, peers[0].error) == (False, "no answer within 0.2 s")
