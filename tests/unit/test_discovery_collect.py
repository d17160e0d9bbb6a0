"""Discovery put together: the inventory and the heartbeat sample, on fake
machines (fixture files, a fake command runner, a stand-in for pynvml)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import orjson
import pytest

from llmgw.agent.discovery import (
    Discovery,
    DiscoveryOptions,
    collect_heartbeat_sample,
    collect_inventory,
    render_inventory,
)
from llmgw.agent.discovery.commands import CommandResult
from llmgw.protocol import NodeInventory, Register, decode, encode

FIX = Path(__file__).parent.parent / "fixtures" / "discovery"
SMI = "/usr/bin/nvidia-smi"


class FakeRun:
    """Answers commands by argv prefix; records every call and its timeout."""

    def __init__(self, answers: dict[tuple[str, ...], object]):
        self.answers = answers
        self.calls: list[tuple[tuple[str, ...], float]] = []

    def __call__(self, argv: Sequence[str], timeout: float) -> CommandResult:
        argv = tuple(argv)
        self.calls.append((argv, timeout))
        for prefix, answer in self.answers.items():
            if argv[: len(prefix)] == prefix:
                if isinstance(answer, Exception):
                    raise answer
                if isinstance(answer, str):
                    return CommandResult(argv, 0, answer)
                return CommandResult(argv, **answer)  # type: ignore[arg-type]
        return CommandResult(argv, None, missing=True)

    def ran(self, *prefix: str) -> bool:
        return any(argv[: len(prefix)] == prefix for argv, _ in self.calls)


def fake_proc(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "meminfo").write_text((FIX / "meminfo").read_text())
    (root / "cpuinfo").write_text((FIX / "cpuinfo_x86_2socket").read_text())
    (root / "loadavg").write_text("3.00 2.00 1.00 5/900 1234\n")
    (root / "stat").write_text("cpu  100 0 0 900 0 0 0 0 0 0\ncpu0 0 0 0 0 0 0 0 0\ncpu1 0 0 0 0 0 0 0 0\n")
    (root / "driver" / "nvidia").mkdir(parents=True)
    (root / "driver" / "nvidia" / "version").write_text(
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.90.07  Fri May 31 09:35:42 UTC 2024\n"
    )
    return root


def fake_ib(root: Path) -> Path:
    port = root / "mlx5_0" / "ports" / "1"
    for rel, body in {
        "state": "4: ACTIVE",
        "phys_state": "5: LinkUp",
        "rate": "400 Gb/sec (4X NDR)",
        "link_layer": "InfiniBand",
        "lid": "0x1a",
        "sm_lid": "0x1",
        "gids/0": "fe80:0000:0000:0000:b83f:d203:00a1:2b3c",
    }.items():
        (port / rel).parent.mkdir(parents=True, exist_ok=True)
        (port / rel).write_text(body + "\n")
    (root / "mlx5_0" / "node_guid").write_text("b83f:d203:00a1:2b3c\n")
    return root


def h100_answers() -> dict[tuple[str, ...], object]:
    return {
        (SMI, "topo", "-m"): (FIX / "topo_h100_sxm_nics.txt").read_text(),
        (SMI, "-q"): (FIX / "smi_q_hgx_h100.txt").read_text(),
        (SMI,): (FIX / "query_gpu_h100.csv").read_text(),
    }


def options(tmp_path: Path, run: FakeRun, **kw) -> DiscoveryOptions:
    models = tmp_path / "models"
    models.mkdir(parents=True)
    base = dict(
        model_dirs=(str(models), str(tmp_path / "not-mounted")),
        ib_root=fake_ib(tmp_path / "ib"),
        proc_root=fake_proc(tmp_path / "proc"),
        sys_root=tmp_path / "sys",
        dev_root=tmp_path / "dev",
        os_release=FIX / "os_release_ubuntu2404",
        mounts_file=FIX / "proc_mounts",
        run=run,
        which=lambda name: {"nvidia-smi": SMI, "apt-get": "/usr/bin/apt-get"}.get(name),
        nvml=None,
    )
    base.update(kw)
    return DiscoveryOptions(**base)


def test_an_h100_node_through_nvidia_smi(tmp_path):
    run = FakeRun(h100_answers())
    inv = collect_inventory(options(tmp_path, run))
    assert inv.warnings is None
    assert inv.memory.total_bytes == 2113266788 * 1024
    h = inv.host
    assert (h.os_id, h.family, h.package_manager, h.nvidia_driver) == ("ubuntu", "debian", "apt-get", "550.90.07")
    assert "avx512f" in h.cpu_flags

    assert inv.gpu_source == "nvidia-smi" and len(inv.gpus) == 8
    g0, g3 = inv.gpus[0], inv.gpus[3]
    assert [p.index for p in g0.nvlink_peers] == [1, 2, 3, 4, 5, 6, 7] and g0.nvlink_peers[0].links == 18
    assert g0.nic_paths["mlx5_0"] == "PXB" and g0.numa_node == 0 and inv.gpus[5].numa_node == 1
    assert g0.fabric.state == "Completed" and g0.fabric.domain is None  # one machine's NVSwitch
    assert g3.fabric is None  # not in the -q excerpt
    assert g3.memory_used_bytes == 4112 << 20 and g0.problems is None

    [port] = inv.adapters[0].ports
    assert port.active and port.rate_gbps == 400.0
    [disk] = inv.storage  # the missing directory is skipped
    assert disk.dirs == [os.path.realpath(tmp_path / "models")]

    # Every command ran with a timeout.
    assert run.calls and all(t > 0 for _, t in run.calls)
    assert run.ran(SMI, "topo", "-m") and run.ran(SMI, "-q")


def test_a_node_without_nvidia_smi_has_no_gpus_and_nothing_is_wrong(tmp_path):
    run = FakeRun({})
    inv = collect_inventory(options(tmp_path, run, which=lambda name: None))
    assert inv.gpus == [] and inv.gpu_source is None and inv.imex is None
    assert inv.warnings is None
    assert inv.memory.total_bytes > 0
    assert not run.ran(SMI)


def test_memory_is_reported_whatever_else_fails(tmp_path):
    boom = RuntimeError("the driver wedged")
    run = FakeRun({(SMI,): boom, ("ip",): boom, ("systemctl",): boom})
    opts = options(tmp_path, run, os_release=tmp_path / "missing", mounts_file=tmp_path / "missing")
    inv = collect_inventory(opts)
    assert inv.memory.total_bytes == 2113266788 * 1024
    assert inv.gpus is None  # unknown, not none
    assert any("could not read GPUs: the driver wedged" in w for w in inv.warnings)
    assert inv.host is not None and inv.host.os_id is None
    assert inv.adapters and inv.adapters[0].name == "mlx5_0"


def test_a_failing_nvidia_smi_is_said_and_gpus_are_unknown(tmp_path):
    run = FakeRun(
        {
            (SMI,): {
                "returncode": 9,
                "stdout": "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n",
            }
        }
    )
    inv = collect_inventory(options(tmp_path, run))
    assert inv.gpus is None
    assert any("couldn't communicate with the NVIDIA driver" in w for w in inv.warnings)


def test_a_bad_topology_costs_the_topology_not_the_cards(tmp_path):
    answers = h100_answers()
    answers[(SMI, "topo", "-m")] = {"returncode": 0, "stdout": "Failed to run topology\n"}
    answers[(SMI, "-q")] = {"returncode": None, "timed_out": True}
    inv = collect_inventory(options(tmp_path, FakeRun(answers)))
    assert len(inv.gpus) == 8 and inv.gpus[0].nvlink_peers is None
    assert any("GPU topology" in w for w in inv.warnings)
    assert any("NVLink fabric state" in w and "did not finish in time" in w for w in inv.warnings)


def test_a_configured_nvidia_smi_that_does_not_exist_is_a_warning(tmp_path):
    opts = options(tmp_path, FakeRun({}), nvidia_smi="/opt/driver/bin/nvidia-smi", which=lambda n: None)
    inv = collect_inventory(opts)
    assert inv.gpus is None
    assert any("/opt/driver/bin/nvidia-smi, which does not exist" in w for w in inv.warnings)


def test_skipping_gpus_runs_no_gpu_tool(tmp_path):
    run = FakeRun(h100_answers())
    inv = collect_inventory(options(tmp_path, run, skip_gpus=True))
    assert inv.gpus is None and not run.ran(SMI)


def test_an_old_driver_without_numa_in_topo_gets_it_from_sysfs(tmp_path):
    dev = tmp_path / "sys" / "bus" / "pci" / "devices" / "0000:07:00.0"
    dev.mkdir(parents=True)
    (dev / "numa_node").write_text("1\n")
    answers = {
        (SMI, "topo", "-m"): (FIX / "topo_v100_4gpu_old.txt").read_text(),
        (SMI, "-q"): (FIX / "smi_q_a100_no_fabric.txt").read_text(),
        (SMI,): "0, GPU-a, Tesla V100-SXM2-32GB, 32510, 0, 0, 1, 7.0, 00000000:07:00.0\n",
    }
    inv = collect_inventory(options(tmp_path, FakeRun(answers)))
    [g] = inv.gpus
    assert g.numa_node == 1 and g.fabric is None
    assert g.nic_paths == {"mlx5_0": "PIX", "mlx5_1": "SYS"}
    assert g.problems and "1 uncorrected ECC error" in g.problems[0]


class TinyNVML:
    """Two H100s on an NVSwitch, as pynvml would show them."""

    class NVMLError(Exception):
        pass

    NVMLError_LibraryNotFound = type("NVMLError_LibraryNotFound", (NVMLError,), {})
    NVML_FEATURE_ENABLED = 1
    NVML_NVLINK_MAX_LINKS = 18
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0

    def __init__(self, fail_init=None):
        self.fail_init = fail_init
        self.shutdowns = 0

    def nvmlInit(self):
        if self.fail_init:
            raise self.fail_init

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlSystemGetDriverVersion(self):
        return "550.90.07"

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return b"NVIDIA H100 80GB HBM3"

    def nvmlDeviceGetUUID(self, h):
        return f"GPU-{h}"

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(total=81559 << 20, used=512 << 20)

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=7)

    def nvmlDeviceGetTotalEccErrors(self, h, kind, counter):
        return 0

    def nvmlDeviceGetCudaComputeCapability(self, h):
        return (9, 0)

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(busId=[b"00000000:18:00.0", b"00000000:2A:00.0"][h])

    def nvmlDeviceGetNvLinkState(self, h, link):
        if link >= 18:
            raise self.NVMLError("Invalid Argument")
        return 1

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
        return SimpleNamespace(busId=b"00000000:C4:00.0")  # an NVSwitch


def test_nvml_is_preferred_and_topo_still_gives_the_adapters(tmp_path):
    nvml = TinyNVML()
    run = FakeRun(h100_answers())
    d = Discovery(options(tmp_path, run, nvml=nvml))
    inv = d.inventory()
    assert inv.gpu_source == "nvml" and len(inv.gpus) == 2
    g0 = inv.gpus[0]
    # NVML's peers (the two GPUs it knows) are kept over topo's eight.
    assert [(p.index, p.links) for p in g0.nvlink_peers] == [(1, 18)]
    assert g0.nic_paths["mlx5_0"] == "PXB" and g0.fabric.state == "Completed"
    assert not run.ran(
        SMI,
        "--query-gpu=index,uuid,name,memory.total,memory.used,utilization.gpu,"
        "ecc.errors.uncorrected.volatile.total,compute_cap,pci.bus_id",
    )
    # The heartbeat reads usage through the open NVML session.
    sample = d.sample()
    assert [u.utilization_percent for u in sample.gpus] == [7, 7]
    d.close()
    assert nvml.shutdowns == 1


def test_a_broken_nvml_falls_back_to_nvidia_smi_with_a_warning(tmp_path):
    nvml = TinyNVML(fail_init=TinyNVML.NVMLError("Unknown Error"))
    inv = collect_inventory(options(tmp_path, FakeRun(h100_answers()), nvml=nvml))
    assert inv.gpu_source == "nvidia-smi" and len(inv.gpus) == 8
    assert any("NVML could not start: Unknown Error; using nvidia-smi instead" in w for w in inv.warnings)
    # No library at all is a node without a driver: no warning about it.
    nvml = TinyNVML(fail_init=TinyNVML.NVMLError_LibraryNotFound("NVML Shared Library Not Found"))
    inv = collect_inventory(options(tmp_path / "again", FakeRun(h100_answers()), nvml=nvml))
    assert inv.gpu_source == "nvidia-smi" and inv.warnings is None


def test_the_heartbeat_sample_rereads_what_changes(tmp_path):
    # The more specific prefix first: answers are matched in order.
    run = FakeRun(
        {
            (
                SMI,
                "--query-gpu=index,memory.used,utilization.gpu,ecc.errors.uncorrected.volatile.total",
            ): "0, 100, 50, 0\n1, 0, [N/A], 0\n",
            **h100_answers(),
        }
    )
    opts = options(tmp_path, run)
    d = Discovery(opts)
    first = d.sample()
    assert first.memory.total_bytes == 2113266788 * 1024
    assert first.load.cpu_percent is None and first.load.load1 == 3.0
    assert [u.memory_used_bytes for u in first.gpus] == [100 << 20, 0] and first.gpus[1].utilization_percent is None
    assert [p.hca for p in first.ib_ports] == ["mlx5_0"]
    assert len(first.storage) == 1
    (opts.proc_root / "stat").write_text("cpu  300 0 0 1100 0 0 0 0 0 0\ncpu0 0\ncpu1 0\n")
    second = d.sample(gpu_fabric=True)
    assert second.load.cpu_percent == 50.0
    # The fabric state is attached by PCI address once asked for.
    assert second.gpus[0].fabric.state == "Completed"


def test_collect_heartbeat_sample_keeps_the_sampler_it_is_given(tmp_path):
    from llmgw.agent.discovery import LoadSampler

    opts = options(tmp_path, FakeRun({}), which=lambda n: None)
    sampler = LoadSampler(opts.proc_root)
    collect_heartbeat_sample(opts, sampler=sampler)
    (opts.proc_root / "stat").write_text("cpu  200 0 0 1000 0 0 0 0 0 0\n")
    s = collect_heartbeat_sample(opts, sampler=sampler)
    assert s.load.cpu_percent == 50.0 and s.gpus == []


def test_options_can_be_given_as_keywords(tmp_path):
    base = options(tmp_path, FakeRun({}), which=lambda n: None)
    inv = collect_inventory(base, model_dirs=[tmp_path], ib_root=str(tmp_path / "none"))
    assert inv.adapters == [] and inv.storage[0].dirs == [os.path.realpath(tmp_path)]


def test_the_inventory_travels_in_a_register_message(tmp_path):
    inv = collect_inventory(options(tmp_path, FakeRun(h100_answers())))
    reg = decode(encode(Register(node_id="gpu01", protocol_version=1, inventory=inv)))
    assert reg.inventory == inv


def test_the_human_report_says_what_the_scheduler_sees(tmp_path):
    inv = collect_inventory(options(tmp_path, FakeRun(h100_answers())))
    text = render_inventory(inv, as_json=False)
    assert "Ubuntu 24.04.1 LTS" in text and "debian family" in text and "apt-get" in text
    assert "Memory    2.0 TiB total, 1.9 TiB available" in text
    assert "NVIDIA 550.90.07" in text
    assert "GPUs (8, read with nvidia-smi)" in text
    assert "NVLink to 1-7 (18 links each)" in text
    assert "nearest adapters: mlx5_0 (PXB)" in text
    assert "no multi-node domain" in text
    assert "mlx5_0" in text and "400 Gb/s (4X NDR)" in text and "ACTIVE/LinkUp" in text
    assert "Could not read" not in text


def test_the_json_report_is_the_model(tmp_path):
    inv = collect_inventory(options(tmp_path, FakeRun(h100_answers())))
    data = orjson.loads(render_inventory(inv, as_json=True))
    assert NodeInventory.model_validate(data) == inv
    assert "imex" not in data  # unknown is left out, not written as null


def test_the_report_of_a_bare_node(tmp_path):
    inv = collect_inventory(
        options(tmp_path, FakeRun({}), which=lambda n: None, ib_root=tmp_path / "none", model_dirs=())
    )
    text = render_inventory(inv, as_json=False)
    assert "GPUs      none" in text
    assert "no InfiniBand or RoCE adapters" in text
    assert "no model directories configured" in text


@pytest.mark.parametrize("flags, warned", [(["avx", "avx2"], False), (["avx"], True)])
def test_the_report_warns_about_a_cpu_without_avx2(tmp_path, flags, warned):
    inv = collect_inventory(options(tmp_path, FakeRun({}), which=lambda n: None))
    inv.host.cpu_flags = flags
    assert ("no AVX2" in render_inventory(inv, as_json=False)) == warned
