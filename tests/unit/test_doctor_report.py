"""doctor's output: the spec's layout, its JSON and its exit code, on injected
facts and (this machine has no GPU) on this real machine."""

from __future__ import annotations

import json

from typer.testing import CliRunner

import llmgw.doctor as doctor_pkg
from llmgw.cli.main import app
from llmgw.doctor import evaluate, render_json, render_text
from llmgw.protocol import GPU, HCA, Host, IBPort, NodeInventory, NVLinkPeer
from llmgw.protocol.doctor import ControlPlane, DeclaredFabric, Facts, InstalledEngine, Level, Route, Service

runner = CliRunner()


def gpu_node() -> Facts:
    host = Host(
        hostname="gpu7", os_id="ubuntu", os_version="24.04", arch="amd64", nvidia_driver="550.90.07", cpu_flags=["avx2"]
    )
    gpus = [
        GPU(
            index=0,
            name="NVIDIA H100 80GB HBM3",
            numa_node=0,
            nvlink_peers=[NVLinkPeer(index=1, links=18)],
            nic_paths={"mlx5_0": "PIX", "mlx5_1": "SYS"},
        ),
        GPU(
            index=1,
            name="NVIDIA H100 80GB HBM3",
            numa_node=1,
            nvlink_peers=[NVLinkPeer(index=0, links=18)],
            nic_paths={"mlx5_0": "SYS", "mlx5_1": "PXB"},
        ),
    ]
    port = IBPort(
        hca="mlx5_0",
        port=1,
        state="ACTIVE",
        phys_state="LinkUp",
        link_layer="InfiniBand",
        rate_gbps=400,
        sm_lid=1,
        counters={"symbol_error": 3, "port_xmit_data": 99},
    )
    inv = NodeInventory(host=host, gpus=gpus, adapters=[HCA(name="mlx5_0", numa_node=0, ports=[port])])
    return Facts(
        inventory=inv,
        modules=["ib_uverbs"],
        nvswitch=True,
        services=[Service(name="nvidia-fabricmanager", load_state="loaded", active_state="inactive")],
        route=Route(interface="ens3", address="10.1.0.21"),
        fabrics=[DeclaredFabric(name="ib-a", hcas=["mlx5_0"])],
        nccl={"ib-a": {"NCCL_IB_HCA": "=mlx5_0", "NCCL_IB_DISABLE": "0"}},
        engines=[InstalledEngine(engine="llamacpp", version="b10991", variant="cuda-12.8", state="installed")],
        topo_raw="\tGPU0\tGPU1\nGPU0\t X \tNV18\n",
    )


def test_the_human_report_has_the_specs_layout_in_order():
    facts = gpu_node()
    findings = evaluate(facts)
    text = render_text(findings, facts, verbose=True)
    lines = text.splitlines()
    assert lines[0] == "gpu7 · ubuntu 24.04 amd64 · driver 550.90.07"
    assert lines[1] == ""
    assert lines[2].startswith("FAIL nvlink this machine has NVSwitch but nvidia-fabricmanager is inactive")
    assert lines[3] == "     → systemctl enable --now nvidia-fabricmanager (its version must match the driver's)"
    assert "WARN fabric nvidia_peermem is not loaded" in text and "     → modprobe nvidia_peermem" in text
    assert "OK   agent  NCCL bootstraps over ens3 (10.1.0.21)" in text
    order = [
        text.index(s)
        for s in (
            "GPU  NAME",
            "ADAPTER   STATE",
            "A shard on ib-a is given:",
            "Engines:",
            "nvidia-smi topo -m:",
            "failed, ",
        )
    ]
    assert order == sorted(order)
    assert "0    NVIDIA H100 80GB HBM3  0     1             mlx5_0 (PIX)" in text
    assert "mlx5_0/1  ACTIVE  LinkUp  400 Gb/s  InfiniBand  0     -         symbol_error=3" in text
    assert "  NCCL_IB_HCA==mlx5_0" in text
    assert "  llamacpp: installed b10991 (cuda-12.8)" in text
    failed = sum(f.level is Level.FAIL for f in findings)
    warned = sum(f.level is Level.WARN for f in findings)
    assert lines[-1] == (
        f"{failed} failed, {warned} warnings. `llmgw doctor --json > report.json` keeps everything read, to send back."
    )


def test_ok_findings_show_no_fix_and_the_raw_topology_only_when_verbose():
    facts = gpu_node()
    text = render_text(evaluate(facts), facts)
    assert "nvidia-smi topo -m:" not in text
    assert not any(line.startswith("OK") and "→" in line for line in text.splitlines())


def test_the_json_is_findings_and_facts_with_two_space_indent():
    facts = gpu_node()
    text = render_json(evaluate(facts), facts)
    data = json.loads(text)
    assert list(data) == ["findings", "facts"]
    assert text.startswith('{\n  "findings": [\n    {\n      "level": "FAIL"')
    assert data["findings"][0] == {
        "level": "FAIL",
        "area": "nvlink",
        "message": "this machine has NVSwitch but nvidia-fabricmanager is inactive: CUDA will not initialise on its GPUs",
        "fix": "systemctl enable --now nvidia-fabricmanager (its version must match the driver's)",
    }
    assert data["facts"]["inventory"]["host"]["hostname"] == "gpu7"
    assert data["facts"]["nccl"]["ib-a"]["NCCL_IB_HCA"] == "=mlx5_0"
    # What node add will do with it: read it back whole.
    from llmgw.protocol.doctor import DoctorReport

    assert DoctorReport.model_validate_json(text).facts == facts


def test_doctor_json_exits_1_when_something_fails(monkeypatch):
    monkeypatch.setattr(doctor_pkg, "collect_facts", lambda opts: gpu_node())
    res = runner.invoke(app, ["doctor", "--json"])
    assert res.exit_code == 1
    assert json.loads(res.stdout)["findings"][0]["level"] == "FAIL"


def test_doctor_exits_0_when_nothing_fails(monkeypatch):
    monkeypatch.setattr(
        doctor_pkg, "collect_facts", lambda opts: Facts(route=Route(interface="eth0", address="10.0.0.2"))
    )
    res = runner.invoke(app, ["doctor"])
    assert res.exit_code == 0, res.output
    assert res.stdout.endswith(
        "0 failed, 0 warnings. `llmgw doctor --json > report.json` keeps everything read, to send back.\n"
    )


def test_a_named_config_that_does_not_exist_is_a_clear_error(tmp_path):
    res = runner.invoke(app, ["doctor", "--config", str(tmp_path / "agent.yaml")])
    assert res.exit_code == 1
    assert f"{tmp_path / 'agent.yaml'} does not exist" in res.output


def test_a_config_naming_an_unreachable_control_plane_fails_for_real(tmp_path):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(f"server: 127.0.0.1:{port}\ntls: null\n")
    res = runner.invoke(app, ["doctor", "--config", str(cfg)])
    assert res.exit_code == 1
    assert f"FAIL control the control plane at 127.0.0.1:{port} does not answer" in res.stdout
    assert "1 problem(s) need fixing" in res.output


def test_doctor_runs_for_real_on_this_gpu_less_machine():
    res = runner.invoke(app, ["doctor"])
    lines = res.stdout.splitlines()
    assert " · driver " in lines[0]
    assert any(line.startswith("OK   memory ") for line in lines)
    assert not any(line.split()[:2] in (["FAIL", "gpu"], ["WARN", "gpu"], ["FAIL", "nvlink"]) for line in lines)
    assert "Engines:" in lines
    assert lines[-1].endswith("keeps everything read, to send back.")
    failed = sum(line.startswith("FAIL ") for line in lines)
    assert res.exit_code == (1 if failed else 0)
    data = json.loads(runner.invoke(app, ["doctor", "--json"]).stdout)
    assert data["facts"]["inventory"]["memory"]["total_bytes"] > 0


def test_a_control_plane_fact_travels_in_the_json():
    facts = Facts(
        control_plane=ControlPlane(
            address="cp:7443", host="cp", port=7443, reachable=True, certificate_ok=True, clock_offset_s=0.4
        )
    )
    data = json.loads(render_json(evaluate(facts), facts))
    assert data["facts"]["control_plane"]["clock_offset_s"] == 0.4
