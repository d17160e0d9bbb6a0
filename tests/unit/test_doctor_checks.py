"""doctor's checks, on facts read from captured outputs in their real formats
(nvidia-smi -q and topo -m, /proc/cpuinfo, sysfs trees, `ip -j`, `systemctl show`)
through doctor's own fact collection with a fake command runner."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from pathlib import Path

import yaml

from llmgw.agent.discovery import parse_gpu_fabric
from llmgw.agent.discovery.commands import CommandResult
from llmgw.config.agent import parse_agent_config
from llmgw.doctor import DoctorOptions, collect_facts, evaluate
from llmgw.doctor.checks import CLOCK_FAIL_S, FABRIC_MANAGER_FIX
from llmgw.doctor.facts import parse_ldd_version, parse_memlock, parse_route_get
from llmgw.protocol import GPU, IMEX, Host, NodeInventory
from llmgw.protocol.doctor import ControlPlane, Facts, Level, Memlock

FIX = Path(__file__).parent.parent / "fixtures" / "discovery"
DOCTOR_FIX = Path(__file__).parent.parent / "fixtures" / "doctor"
SMI = "/usr/bin/nvidia-smi"
GIB = 1 << 30


class FakeRun:
    """Answers commands by argv prefix (first match wins); anything else is not installed."""

    def __init__(self, answers: dict[tuple[str, ...], object]):
        self.answers = answers

    def __call__(self, argv: Sequence[str], timeout: float) -> CommandResult:
        argv = tuple(argv)
        for prefix, answer in self.answers.items():
            if argv[: len(prefix)] == prefix:
                if callable(answer):
                    return answer(argv)
                if isinstance(answer, str):
                    return CommandResult(argv, 0, answer)
                return CommandResult(argv, **answer)  # type: ignore[arg-type]
        return CommandResult(argv, None, missing=True)


def systemctl_show(load: str, active: str, memlock: str | None = None) -> str:
    text = f"LoadState={load}\nActiveState={active}\n"
    return text + (f"LimitMEMLOCK={memlock}\n" if memlock else "")


def h100_answers(fm_state: str = "inactive") -> dict[tuple[str, ...], object]:
    return {
        (SMI, "topo", "-m"): (FIX / "topo_h100_sxm_nics.txt").read_text(),
        (SMI, "-q"): (FIX / "smi_q_hgx_h100.txt").read_text(),
        (SMI, "-L"): (DOCTOR_FIX / "smi_L_hgx_h100.txt").read_text(),
        (SMI,): (FIX / "query_gpu_h100.csv").read_text(),
        ("systemctl", "show", "nvidia-fabricmanager"): systemctl_show("loaded", fm_state),
        ("systemctl", "show", "llmgw-agent"): systemctl_show("loaded", "active", "infinity"),
        ("systemctl", "show", "nvidia-imex"): systemctl_show("not-found", "inactive"),
        ("ip", "-j", "route", "show", "default"): '[{"dst":"default","gateway":"10.1.0.1","dev":"ens3"}]',
        ("ip", "-j", "-4", "addr"): '[{"ifname":"ens3","addr_info":[{"family":"inet","local":"10.1.0.21"}]}]',
    }


def write_port(root: Path, hca: str, port: int, **files: str) -> None:
    base = {
        "state": "4: ACTIVE",
        "phys_state": "5: LinkUp",
        "rate": "400 Gb/sec (4X NDR)",
        "link_layer": "InfiniBand",
        "lid": "0x1a",
        "sm_lid": "0x1",
        "gids/0": "fe80:0000:0000:0000:b83f:d203:00a1:2b3c",
    }
    base.update(files)
    p = root / hca / "ports" / str(port)
    for rel, body in base.items():
        (p / rel).parent.mkdir(parents=True, exist_ok=True)
        (p / rel).write_text(body + "\n")
    (root / hca / "node_guid").write_text("b83f:d203:00a1:2b3c\n")


def machine(
    tmp_path: Path,
    answers: dict[tuple[str, ...], object],
    *,
    cpuinfo: str | None = None,
    modules: str = "nvidia 1 0 - Live 0\nib_uverbs 1 0 - Live 0\nnvidia_peermem 1 0 - Live 0\n",
    nvswitch: bool = False,
    ib: bool = True,
    config: str | None = None,
    glibc: str | None = "2.36",
    free: int = 500 * GIB,
    **kw,
) -> DoctorOptions:
    proc = tmp_path / "proc"
    (proc / "driver" / "nvidia").mkdir(parents=True)
    (proc / "meminfo").write_text((FIX / "meminfo").read_text())
    (proc / "cpuinfo").write_text(cpuinfo or (FIX / "cpuinfo_x86_2socket").read_text())
    (proc / "modules").write_text(modules)
    (proc / "driver" / "nvidia" / "version").write_text(
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.90.07  Fri May 31 09:35:42 UTC 2024\n"
    )
    dev = tmp_path / "dev"
    dev.mkdir()
    if nvswitch:
        (dev / "nvidia-nvswitch0").write_text("")
        (dev / "nvidia-nvswitchctl").write_text("")
    ib_root = tmp_path / "ib"
    ib_root.mkdir()
    if ib:
        write_port(ib_root, "mlx5_0", 1)
    systemd = tmp_path / "run-systemd"
    systemd.mkdir()
    # Nothing of this machine's own: no sbin directory to find tools in, no IMEX configuration.
    kw.setdefault("sbin_dirs", ())
    kw.setdefault("imex_config", tmp_path / "etc-nvidia-imex" / "config.cfg")
    cfg = parse_agent_config(yaml.safe_load(config)) if config else None
    return DoctorOptions(
        config=cfg,
        ib_root=ib_root,
        proc_root=proc,
        sys_root=tmp_path / "sys",
        dev_root=dev,
        os_release=FIX / "os_release_ubuntu2404",
        mounts_file=FIX / "proc_mounts",
        systemd_root=systemd,
        run=FakeRun(answers),
        which=lambda name: {"nvidia-smi": SMI, "systemctl": "/usr/bin/systemctl"}.get(name),
        glibc=lambda: glibc,
        free_bytes=lambda path: free,
        memlock_rlimit=lambda: (8 << 20, 8 << 20),
        **kw,
    )


def find(findings, level: Level, area: str, text: str):
    hits = [f for f in findings if f.level is level and f.area == area and text in f.message]
    assert hits, f"no {level} {area} finding with {text!r} in:\n" + "\n".join(
        f"{f.level} {f.area} {f.message}" for f in findings
    )
    return hits[0]


def none_of(findings, area: str) -> None:
    assert not [f for f in findings if f.area == area], [f.message for f in findings if f.area == area]


# ------------------------------------------------------------------ NVLink and GPUs


def test_an_hgx_h100_with_nvswitch_and_fabric_manager_inactive_fails_first_with_the_fix(tmp_path):
    facts = collect_facts(machine(tmp_path, h100_answers("inactive"), nvswitch=True))
    findings = evaluate(facts)
    f = find(findings, Level.FAIL, "nvlink", "this machine has NVSwitch but nvidia-fabricmanager is inactive")
    assert "CUDA will not initialise" in f.message
    assert f.fix == FABRIC_MANAGER_FIX
    assert findings[0].level is Level.FAIL


def test_nvswitch_is_seen_from_the_nvlink_count_when_its_device_files_are_not_there(tmp_path):
    facts = collect_facts(machine(tmp_path, h100_answers("inactive"), nvswitch=False))
    assert facts.nvswitch is True and "NVLinks" in (facts.nvswitch_evidence or "")
    find(evaluate(facts), Level.FAIL, "nvlink", "nvidia-fabricmanager is inactive")


def test_an_active_fabric_manager_on_an_nvswitch_machine_is_ok(tmp_path):
    findings = evaluate(collect_facts(machine(tmp_path, h100_answers("active"), nvswitch=True)))
    find(findings, Level.OK, "nvlink", "nvidia-fabricmanager is active")
    assert not [f for f in findings if f.level is Level.FAIL and f.area == "nvlink"]


def gb200_facts(imex: IMEX | None) -> Facts:
    fabric = parse_gpu_fabric((FIX / "smi_q_gb200.txt").read_text())
    gpus = [
        GPU(index=i, name="NVIDIA GB200", pci_bus_id=bus, fabric=fab) for i, (bus, fab) in enumerate(fabric.items())
    ]
    inv = NodeInventory(gpus=gpus, adapters=[], imex=imex)
    return Facts(inventory=inv)


def test_a_gb200_gpu_still_joining_its_nvlink_domain_fails_naming_it():
    findings = evaluate(gb200_facts(IMEX(state="active", channels=1)))
    f = find(findings, Level.FAIL, "nvlink", "GPUs not joined to their NVLink domain")
    assert "GPU 2 In Progress" in f.message
    assert "nvidia-smi -q -d FABRIC" in (f.fix or "")


def test_imex_inactive_inside_an_nvlink_domain_fails_with_its_fix():
    f = find(evaluate(gb200_facts(IMEX(state="inactive", channels=1))), Level.FAIL, "nvlink", "nvidia-imex is inactive")
    assert f.fix and f.fix.startswith("systemctl enable --now nvidia-imex")


def test_imex_without_a_channel_fails():
    find(evaluate(gb200_facts(IMEX(state="active", channels=0))), Level.FAIL, "nvlink", "no IMEX channel")


def test_a_node_without_gpus_gets_no_gpu_nvlink_or_vllm_findings(tmp_path):
    answers = {k: v for k, v in h100_answers().items() if k[0] != SMI}
    opts = machine(tmp_path, answers, ib=False)
    opts = dataclasses.replace(opts, which=lambda name: {"systemctl": "/usr/bin/systemctl"}.get(name))
    findings = evaluate(collect_facts(opts))
    none_of(findings, "gpu")
    none_of(findings, "nvlink")
    none_of(findings, "fabric")
    assert not [f for f in findings if "vLLM" in f.message]


def test_vllm_is_not_installable_on_driver_550_and_says_why(tmp_path):
    findings = evaluate(collect_facts(machine(tmp_path, h100_answers("active"), nvswitch=True)))
    f = find(findings, Level.WARN, "engine", "vLLM 0.30.0 cannot be installed")
    assert "driver 580" in f.message and "550.90.07" in f.message


def test_vllm_refuses_a_volta_card_and_a_small_disk():
    inv = NodeInventory(gpus=[GPU(index=0, name="Tesla V100", compute_capability="7.0")])
    inv.host = Host(nvidia_driver="580.65.06")
    f = find(
        evaluate(Facts(inventory=inv, vllm_version="0.30.0", engines_free_bytes=10 * 10**9, engines_dir="/opt/e")),
        Level.WARN,
        "engine",
        "cannot be installed",
    )
    assert "compute capability 7.5" in f.message and "25 GB free in /opt/e" in f.message


# ------------------------------------------------------------------ RDMA


def test_missing_peermem_and_uverbs_on_a_gpu_node_with_adapters_are_warnings_with_modprobe(tmp_path):
    findings = evaluate(collect_facts(machine(tmp_path, h100_answers("active"), modules="nvidia 1 0 - Live 0\n")))
    assert find(findings, Level.WARN, "fabric", "nvidia_peermem is not loaded").fix == "modprobe nvidia_peermem"
    assert find(findings, Level.WARN, "fabric", "ib_uverbs is not loaded").fix == "modprobe ib_uverbs"


def test_each_port_state_rate_subnet_manager_and_roce_gid_is_judged(tmp_path):
    opts = machine(tmp_path, h100_answers("active"))
    write_port(opts.ib_root, "mlx5_1", 1, state="1: DOWN", phys_state="3: Disabled")  # type: ignore[arg-type]
    write_port(opts.ib_root, "mlx5_2", 1, rate="200 Gb/sec (4X HDR)")  # type: ignore[arg-type]
    write_port(opts.ib_root, "mlx5_3", 1, sm_lid="0x0")  # type: ignore[arg-type]
    write_port(opts.ib_root, "mlx5_4", 1, link_layer="Ethernet", rate="100 Gb/sec (4X EDR)")  # type: ignore[arg-type]
    findings = evaluate(collect_facts(opts))
    find(findings, Level.OK, "fabric", "mlx5_0/1 ACTIVE 400 Gb/s (4X NDR) InfiniBand")
    find(findings, Level.WARN, "fabric", "mlx5_1/1 is DOWN (Disabled)")
    find(findings, Level.WARN, "fabric", "mlx5_2/1 runs at 200 Gb/s, slower than this machine's other ports")
    find(findings, Level.FAIL, "fabric", "mlx5_3/1 is ACTIVE but no subnet manager answers")
    assert "NCCL_IB_GID_INDEX" in (find(findings, Level.WARN, "fabric", "mlx5_4/1 (RoCE").fix or "")


def test_declared_fabrics_are_checked_against_the_adapters_and_give_the_nccl_env(tmp_path):
    cfg = "server: cp.example:7443\nfabrics:\n  - name: ib-a\n    hcas: [mlx5_0, mlx5_9]\n"
    opts = machine(
        tmp_path,
        h100_answers("active"),
        config=cfg,
        dial=lambda t: ControlPlane(
            address=t.address, host=t.host, port=t.port, reachable=True, certificate_ok=True, clock_offset_s=0.0
        ),
        resolve=lambda host: None,
    )
    write_port(opts.ib_root, "mlx5_1", 1)  # type: ignore[arg-type]
    facts = collect_facts(opts)
    findings = evaluate(facts)
    find(findings, Level.FAIL, "fabric", "agent.yaml puts mlx5_9 on fabric ib-a, but this machine has no adapter")
    assert "--fabric NAME:mlx5_1" in (find(findings, Level.WARN, "fabric", "mlx5_1 are on no fabric").fix or "")
    env = (facts.nccl or {})["ib-a"]
    assert env["NCCL_IB_HCA"] == "=mlx5_0,mlx5_9"
    assert env["NCCL_SOCKET_IFNAME"] == "ens3"


# ------------------------------------------------------------------ host


def test_a_cpu_without_avx2_warns_with_the_vm_fix(tmp_path):
    text = (FIX / "cpuinfo_x86_2socket").read_text().replace(" avx2", "").replace(" avx512f", "")
    f = find(evaluate(collect_facts(machine(tmp_path, h100_answers(), cpuinfo=text))), Level.WARN, "cpu", "no AVX2")
    assert 'a VM needs CPU type "host"' in (f.fix or "")


def test_an_old_glibc_fails_the_llamacpp_release_and_a_new_one_is_ok(tmp_path):
    old = evaluate(collect_facts(machine(tmp_path / "a", h100_answers(), glibc="2.28")))
    f = find(old, Level.FAIL, "engine", "glibc 2.28 is older than the 2.34")
    assert "engines.llamacpp.bin" in (f.fix or "")
    find(
        evaluate(collect_facts(machine(tmp_path / "b", h100_answers(), glibc="2.39"))), Level.OK, "engine", "glibc 2.39"
    )


def test_glibc_is_read_from_ldd_when_confstr_is_not_there():
    assert parse_ldd_version("ldd (Ubuntu GLIBC 2.35-0ubuntu3.8) 2.35\nCopyright (C) 2022\n") == "2.35"
    assert parse_ldd_version("musl libc (x86_64)\nVersion 1.2.4\n") is None


def test_free_disk_where_weights_go_fails_below_a_gigabyte_and_warns_below_twenty(tmp_path):
    tiny = evaluate(collect_facts(machine(tmp_path / "a", h100_answers(), free=GIB // 2)))
    find(tiny, Level.FAIL, "disk", "free where weights go (/var/lib/llmgw-weights): no model fits")
    find(
        evaluate(collect_facts(machine(tmp_path / "b", h100_answers(), free=10 * GIB))),
        Level.WARN,
        "disk",
        "room for one",
    )


def test_a_small_memlock_on_a_node_with_adapters_warns_and_names_the_unit(tmp_path):
    answers = h100_answers("active")
    answers[("systemctl", "show", "llmgw-agent")] = systemctl_show("loaded", "active", "8388608")
    facts = collect_facts(machine(tmp_path, answers))
    assert facts.memlock == Memlock(source="systemd unit llmgw-agent", unlimited=False, limit_bytes=8388608)
    f = find(evaluate(facts), Level.WARN, "agent", "locked memory is limited to 8192 KiB (systemd unit llmgw-agent)")
    assert "LimitMEMLOCK=infinity" in (f.fix or "")


def test_without_the_agent_unit_memlock_is_this_process_and_says_so(tmp_path):
    answers = h100_answers("active")
    answers[("systemctl", "show", "llmgw-agent")] = systemctl_show("not-found", "inactive", "8388608")
    facts = collect_facts(machine(tmp_path, answers))
    assert facts.memlock is not None and facts.memlock.source == "this process"
    assert parse_memlock("infinity").unlimited is True


def test_the_bootstrap_interface_is_the_route_to_the_control_plane_and_named_with_its_address(tmp_path):
    answers = h100_answers("active")
    answers[("ip", "-j", "route", "get")] = '[{"dst":"10.1.0.5","dev":"ens5","prefsrc":"10.1.0.22","uid":0}]'
    opts = machine(
        tmp_path,
        answers,
        config="server: cp.example:7443\n",
        resolve=lambda host: "10.1.0.5",
        dial=lambda t: ControlPlane(address=t.address, host=t.host, port=t.port, reachable=False, connect_error="x"),
    )
    find(
        evaluate(collect_facts(opts)),
        Level.OK,
        "agent",
        "NCCL bootstraps over ens5 (10.1.0.22) towards the control plane",
    )
    assert parse_route_get("[]", "10.0.0.1") is None


def test_the_default_route_names_the_interface_when_there_is_no_control_plane(tmp_path):
    find(
        evaluate(collect_facts(machine(tmp_path, h100_answers()))),
        Level.OK,
        "agent",
        "NCCL bootstraps over ens3 (10.1.0.21)",
    )


# ------------------------------------------------------------------ control plane clock


def cp(offset: float) -> Facts:
    return Facts(
        control_plane=ControlPlane(
            address="cp:7443", host="cp", port=7443, reachable=True, certificate_ok=True, clock_offset_s=offset
        )
    )


def test_a_clock_a_few_seconds_off_is_ok_and_beyond_warns():
    find(evaluate(cp(1.5)), Level.OK, "control", "clocks agree")
    find(evaluate(cp(-30)), Level.WARN, "control", "30 s behind this node's")


def test_a_clock_off_by_more_than_the_certificates_backdating_fails_saying_why():
    f = find(evaluate(cp(CLOCK_FAIL_S + 60)), Level.FAIL, "control", "ahead of this node's")
    assert "not yet valid" in f.message and "NTP" in (f.fix or "")


def test_an_unreachable_control_plane_fails_with_what_to_check():
    facts = Facts(
        control_plane=ControlPlane(
            address="cp:7443", host="cp", port=7443, reachable=False, connect_error="Connection refused"
        )
    )
    f = find(evaluate(facts), Level.FAIL, "control", "does not answer: Connection refused")
    assert "port 7443" in (f.fix or "")


# ------------------------------------------------------------------ collection


def test_a_step_that_hangs_is_recorded_as_unreadable_and_collection_returns(tmp_path):
    release = threading.Event()
    answers = h100_answers()
    answers[(SMI,)] = lambda argv: (release.wait(30), CommandResult(argv, 0, ""))[1]
    opts = machine(tmp_path, answers, timeout_s=0.5)
    try:
        facts = collect_facts(opts)
    finally:
        release.set()
    assert facts.inventory is None
    assert any("the inventory: still not read after 0.5 s" in u for u in facts.unreadable or ())
    find(evaluate(facts), Level.WARN, "doctor", "still not read")


def test_findings_are_most_serious_first():
    findings = evaluate(cp(CLOCK_FAIL_S + 60).model_copy(update={"glibc": "2.36", "weights_free_bytes": 5 * GIB}))
    ranks = [f.level.rank for f in findings]
    assert ranks == sorted(ranks) and findings[0].level is Level.FAIL and findings[-1].level is Level.OK
