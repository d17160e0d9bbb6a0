"""GPUs from `nvidia-smi --query-gpu` and from NVML (through a stand-in for pynvml)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import pytest

from llmgw.agent.discovery.commands import CommandResult
from llmgw.agent.discovery.gpu_nvml import NVMLReader, NVMLUnavailable
from llmgw.agent.discovery.gpu_smi import (
    QUERY_FIELDS,
    SMIError,
    gpus_from_rows,
    parse_query_csv,
    query_gpus,
    query_usage,
)

FIX = Path(__file__).parent.parent / "fixtures" / "discovery"
MIB = 1 << 20


def test_an_h100_node_is_read_from_the_query():
    rows = parse_query_csv((FIX / "query_gpu_h100.csv").read_text())
    gpus = gpus_from_rows(rows)
    assert [g.index for g in gpus] == list(range(8))
    g = gpus[0]
    assert g.name == "NVIDIA H100 80GB HBM3"
    assert g.memory_total_bytes == 81559 * MIB and g.memory_used_bytes == 0
    assert (g.compute_capability, g.pci_bus_id, g.ecc_uncorrected, g.utilization_percent) == (
        "9.0",
        "00000000:18:00.0",
        0,
        0,
    )
    # Memory held by a process nobody placed there is reported as found.
    assert gpus[3].memory_used_bytes == 4112 * MIB and gpus[3].utilization_percent == 37


def test_na_and_not_supported_are_unknown_not_zero():
    rtx, vgpu, t4 = gpus_from_rows(parse_query_csv((FIX / "query_gpu_na.csv").read_text()))
    assert rtx.ecc_uncorrected is None and rtx.utilization_percent == 3
    assert vgpu.utilization_percent is None and vgpu.ecc_uncorrected is None
    assert vgpu.name == "GRID A100D-40C" and vgpu.memory_used_bytes == 3577 * MIB
    assert t4.ecc_uncorrected == 2


def test_a_short_row_from_an_old_driver_lacks_only_its_trailing_fields():
    [row] = parse_query_csv("0, GPU-1, Tesla P100-PCIE-16GB, 16280, 0\n")
    assert row["name"] == "Tesla P100-PCIE-16GB" and row["memory.total"] == "16280"
    assert row["utilization.gpu"] is None and row["pci.bus_id"] is None


def test_a_comma_in_the_name_does_not_shift_the_columns():
    [row] = parse_query_csv("0, GPU-1, NVIDIA RTX 6000 Ada, Generation, 49140, 2, 0, [N/A], 8.9, 00000000:01:00.0\n")
    assert row["name"] == "NVIDIA RTX 6000 Ada, Generation" and row["memory.total"] == "49140"
    assert row["pci.bus_id"] == "00000000:01:00.0"


def test_a_row_without_the_essentials_is_an_error():
    with pytest.raises(SMIError, match="has no memory.total"):
        parse_query_csv("0, GPU-1, Tesla T4, [N/A], 0\n")


class FakeRun:
    """Answers commands from a table: argv prefix -> CommandResult fields."""

    def __init__(self, answers: dict[tuple[str, ...], dict]):
        self.answers = answers
        self.calls: list[tuple[str, ...]] = []

    def __call__(self, argv: Sequence[str], timeout: float) -> CommandResult:
        argv = tuple(argv)
        self.calls.append(argv)
        assert timeout > 0
        for prefix, answer in self.answers.items():
            if argv[: len(prefix)] == prefix:
                ans = answer(argv) if callable(answer) else answer
                return CommandResult(argv, **ans)
        return CommandResult(argv, None, missing=True)


def test_fields_an_old_driver_refuses_are_dropped_and_the_query_asked_again():
    def answer(argv):
        query = argv[1]
        if "compute_cap" in query:
            return {"returncode": 2, "stdout": 'Field "compute_cap" is not a valid field to query.\n\n'}
        if "utilization.gpu" in query:
            return {"returncode": 2, "stdout": 'Field "utilization.gpu" is not a valid field to query.\n'}
        return {"returncode": 0, "stdout": "0, GPU-1, Tesla V100-SXM2-32GB, 32510, 0, 0, 00000000:07:00.0\n"}

    run = FakeRun({("nvidia-smi",): answer})
    [g] = query_gpus("nvidia-smi", run)
    assert len(run.calls) == 3
    assert g.name == "Tesla V100-SXM2-32GB" and g.pci_bus_id == "00000000:07:00.0"
    assert g.compute_capability is None and g.utilization_percent is None and g.ecc_uncorrected == 0
    assert run.calls[0][1] == "--query-gpu=" + ",".join(QUERY_FIELDS)


def test_a_failing_nvidia_smi_says_why():
    run = FakeRun(
        {
            ("nvidia-smi",): {
                "returncode": 9,
                "stdout": "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n",
            }
        }
    )
    with pytest.raises(SMIError, match="couldn't communicate with the NVIDIA driver"):
        query_gpus("nvidia-smi", run)
    with pytest.raises(SMIError, match="did not finish in time"):
        query_gpus("nvidia-smi", lambda argv, t: CommandResult(tuple(argv), None, timed_out=True))


def test_usage_is_read_for_the_heartbeat():
    run = FakeRun({("nvidia-smi",): {"returncode": 0, "stdout": "0, 1024, 55, 0\n1, 0, [N/A], [N/A]\n"}})
    u0, u1 = query_usage("nvidia-smi", run)
    assert (u0.index, u0.memory_used_bytes, u0.utilization_percent, u0.ecc_uncorrected) == (0, 1024 * MIB, 55, 0)
    assert u1.utilization_percent is None and u1.ecc_uncorrected is None


# ------------------------------------------------------------------ NVML


class NVMLError(Exception):
    pass


class NVMLError_LibraryNotFound(NVMLError):
    pass


class NVMLError_NotSupported(NVMLError):
    pass


class NVMLError_InvalidArgument(NVMLError):
    pass


class FakeNVML:
    """The subset of pynvml discovery uses. ``links[i]`` is the list of far ends
    of GPU i's active NVLinks: a GPU index, or "switch"; None: no NVLink."""

    NVMLError = NVMLError
    NVMLError_LibraryNotFound = NVMLError_LibraryNotFound
    NVMLError_DriverNotLoaded = type("NVMLError_DriverNotLoaded", (NVMLError,), {})
    NVML_FEATURE_ENABLED = 1
    NVML_NVLINK_MAX_LINKS = 18
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    NVML_P2P_CAPS_INDEX_NVLINK = 2
    NVML_P2P_STATUS_OK = 0

    def __init__(self, names, links, *, init_error=None, util_supported=True, ecc=None):
        self.names, self.links = names, links
        self.init_error, self.util_supported = init_error, util_supported
        self.ecc = ecc or {}
        self.inits = self.shutdowns = 0

    def bus(self, i):
        return f"00000000:{0x18 + 0x10 * i:02X}:00.0".encode()

    def nvmlInit(self):
        if self.init_error:
            raise self.init_error
        self.inits += 1

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlSystemGetDriverVersion(self):
        return "550.90.07"

    def nvmlDeviceGetCount(self):
        return len(self.names)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return self.names[h]

    def nvmlDeviceGetUUID(self, h):
        return f"GPU-{h:08d}"

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(total=80 * (1 << 30), used=(1 << 30) * h, free=0)

    def nvmlDeviceGetUtilizationRates(self, h):
        if not self.util_supported:
            raise NVMLError_NotSupported("Not Supported")
        return SimpleNamespace(gpu=10 * h, memory=0)

    def nvmlDeviceGetTotalEccErrors(self, h, kind, counter):
        assert (kind, counter) == (1, 0)
        if h not in self.ecc:
            raise NVMLError_NotSupported("Not Supported")
        return self.ecc[h]

    def nvmlDeviceGetCudaComputeCapability(self, h):
        return (9, 0)

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(busId=self.bus(h))

    def nvmlDeviceGetNvLinkState(self, h, link):
        ends = self.links[h]
        if ends is None:
            raise NVMLError_NotSupported("Not Supported")
        if link >= len(ends):
            raise NVMLError_InvalidArgument("Invalid Argument")
        return self.NVML_FEATURE_ENABLED

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
        end = self.links[h][link]
        return SimpleNamespace(busId=b"00000000:C4:00.0" if end == "switch" else self.bus(end))

    def nvmlDeviceGetP2PStatus(self, a, b, cap):
        return self.NVML_P2P_STATUS_OK


def test_nvml_reads_the_cards_and_nvswitch_peers():
    nvml = FakeNVML(["NVIDIA H100 80GB HBM3"] * 4, [["switch"] * 18] * 4, ecc={0: 0, 1: 3})
    with NVMLReader(nvml) as r:
        gpus = r.gpus()
        usage = r.usage()
        assert r.driver_version() == "550.90.07"
    assert nvml.inits == 1 and nvml.shutdowns == 1
    assert [g.index for g in gpus] == [0, 1, 2, 3]
    g = gpus[1]
    assert g.uuid == "GPU-00000001" and g.compute_capability == "9.0" and g.pci_bus_id == "00000000:28:00.0"
    assert g.memory_total_bytes == 80 << 30 and g.memory_used_bytes == 1 << 30 and g.utilization_percent == 10
    assert g.ecc_uncorrected == 3 and gpus[2].ecc_uncorrected is None
    assert [(p.index, p.links) for p in g.nvlink_peers] == [(0, 18), (2, 18), (3, 18)]
    assert usage[3].memory_used_bytes == 3 << 30 and usage[3].utilization_percent == 30


def test_nvml_counts_direct_links_between_bridged_pairs_and_none_on_pcie():
    # 0 and 1 joined by a 4-link bridge; 2 a PCIe card without NVLink.
    nvml = FakeNVML(["A100"] * 3, [[1, 1, 1, 1], [0, 0, 0, 0], None], util_supported=False)
    with NVMLReader(nvml) as r:
        g0, g1, g2 = r.gpus()
    assert [(p.index, p.links) for p in g0.nvlink_peers] == [(1, 4)]
    assert [(p.index, p.links) for p in g1.nvlink_peers] == [(0, 4)]
    assert g2.nvlink_peers == []
    assert g0.utilization_percent is None  # unsupported, not idle


def test_no_nvml_library_is_a_node_without_a_driver_not_a_fault():
    with pytest.raises(NVMLUnavailable) as err:
        NVMLReader(FakeNVML([], [], init_error=NVMLError_LibraryNotFound("NVML Shared Library Not Found")))
    assert err.value.no_driver
    with pytest.raises(NVMLUnavailable) as err:
        NVMLReader(FakeNVML([], [], init_error=NVMLError("Unknown Error")))
    assert not err.value.no_driver and "Unknown Error" in str(err.value)
