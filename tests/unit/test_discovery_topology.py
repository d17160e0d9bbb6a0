"""`nvidia-smi topo -m` in both layouts, and the `nvidia-smi -q` Fabric sections."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.agent.discovery.fabric import apply_fabric, normalize_bus_id, parse_gpu_fabric
from llmgw.agent.discovery.topology import TopologyError, apply_topology, parse_topology
from llmgw.protocol import GPU, NVLinkPeer

FIX = Path(__file__).parent.parent / "fixtures" / "discovery"


def test_nvlink_and_adapter_distance_are_read_from_an_h100_topology():
    topo = parse_topology((FIX / "topo_h100_sxm_nics.txt").read_text())
    assert topo.nvlink[0] == dict.fromkeys(range(1, 8), 18)
    assert all(len(peers) == 7 for peers in topo.nvlink.values())
    # The legend turns NICn into the adapter's own name.
    assert topo.adapters == [f"mlx5_{i}" for i in range(10)]
    assert topo.nic_paths[0]["mlx5_0"] == "PXB"
    assert topo.nic_paths[0]["mlx5_4"] == "NODE"
    assert topo.nic_paths[0]["mlx5_9"] == "SYS"
    assert topo.nic_paths[4]["mlx5_5"] == "PXB"
    # "0<tab><tab>N/A": the empty cell does not shift the NUMA column.
    assert topo.numa == {g: (0 if g < 4 else 1) for g in range(8)}
    assert topo.cpu_affinity[0] == "0-55,112-167" and topo.cpu_affinity[7] == "56-111,168-223"


def test_older_drivers_name_adapters_in_the_header_and_have_no_numa_column():
    topo = parse_topology((FIX / "topo_v100_4gpu_old.txt").read_text())
    assert topo.nvlink[0] == {1: 1, 2: 2, 3: 1}
    assert topo.nvlink[2] == {0: 2, 1: 1, 3: 2}
    assert topo.nic_paths[0] == {"mlx5_0": "PIX", "mlx5_1": "SYS"}
    assert topo.nic_paths[3] == {"mlx5_0": "SYS", "mlx5_1": "PIX"}
    assert topo.numa == {}
    assert topo.cpu_affinity[2] == "20-39,60-79"


def test_a_pcie_machine_has_no_nvlink():
    topo = parse_topology((FIX / "topo_l40s_pcie.txt").read_text())
    assert topo.nvlink == {}
    assert topo.nic_paths[0] == {"mlx5_0": "PHB", "mlx5_1": "SYS"}
    assert topo.numa[3] == 1
    gpus = [GPU(index=i) for i in range(4)]
    apply_topology(gpus, topo)
    # Read and found none: an empty list, not unknown.
    assert all(g.nvlink_peers == [] for g in gpus)


def test_a_matrix_without_any_affinity_column_and_spaces_for_tabs():
    text = (
        "        GPU0    GPU1    mlx5_0\n"
        "GPU0     X      NV4     SYS\n"
        "GPU1    NV4      X      SOC\n"
        "mlx5_0  SYS     SYS      X\n"
        "\n"
        "Legend:\n"
    )
    topo = parse_topology(text)
    assert topo.nvlink == {0: {1: 4}, 1: {0: 4}}
    assert topo.nic_paths[1] == {"mlx5_0": "SYS"}  # SOC is the old name for SYS
    assert topo.numa == {}


def test_a_header_without_leading_tab_is_still_found():
    text = "GPU0\tGPU1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\nGPU0\t X \tPIX\t0-47\t0\t\tN/A\nGPU1\tPIX\t X \t0-47\t0\t\tN/A\n"
    topo = parse_topology(text)
    assert topo.numa == {0: 0, 1: 0} and topo.nvlink == {}


def test_nvml_peers_are_kept_over_topo():
    topo = parse_topology((FIX / "topo_h100_sxm_nics.txt").read_text())
    gpus = [GPU(index=0, nvlink_peers=[NVLinkPeer(index=1, links=18)]), GPU(index=3)]
    apply_topology(gpus, topo)
    assert gpus[0].nvlink_peers == [NVLinkPeer(index=1, links=18)]
    assert [p.index for p in gpus[1].nvlink_peers] == [0, 1, 2, 4, 5, 6, 7]
    assert gpus[1].numa_node == 0 and gpus[1].nic_paths["mlx5_3"] == "PXB"
    # The adapter distances come from topo either way.
    assert gpus[0].nic_paths["mlx5_0"] == "PXB"


@pytest.mark.parametrize(
    "text",
    [
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
        "Make sure that the latest NVIDIA driver is installed and running.\n",
        "",
        "\tGPU0\tGPU1\n\n",
    ],
)
def test_something_that_is_not_a_matrix_is_an_error(text):
    with pytest.raises(TopologyError):
        parse_topology(text)


# ---------------------------------------------------------------- fabric


def test_a_gpus_nvlink_domain_is_read_by_pci_address():
    fab = parse_gpu_fabric((FIX / "smi_q_gb200.txt").read_text())
    a = fab["00000008:01:00.0"]
    assert (a.state, a.status, a.clique_id, a.bandwidth) == ("Completed", "Success", "32766", "Full")
    assert a.domain == "76b1ad76-7c24-4b6b-9f6c-2a1e0d8c11aa/32766"
    # Still joining: reported, with no domain yet.
    joining = fab["00000018:01:00.0"]
    assert joining.state == "In Progress" and joining.status is None and joining.domain is None
    assert fab["00000019:01:00.0"].bandwidth == "Degraded"


def test_a_single_machines_nvswitch_is_no_domain():
    fab = parse_gpu_fabric((FIX / "smi_q_hgx_h100.txt").read_text())
    assert set(fab) == {"00000000:18:00.0", "00000000:2a:00.0"}
    f = fab["00000000:18:00.0"]
    assert f.state == "Completed" and f.cluster_uuid == "00000000-0000-0000-0000-000000000000"
    assert f.domain is None


def test_cards_without_a_fabric_are_absent():
    assert parse_gpu_fabric((FIX / "smi_q_l40s.txt").read_text()) == {}  # a section of N/A
    assert parse_gpu_fabric((FIX / "smi_q_a100_no_fabric.txt").read_text()) == {}  # no section at all


def test_fabric_is_applied_by_bus_id_whatever_its_case_or_domain_width():
    fab = parse_gpu_fabric((FIX / "smi_q_gb200.txt").read_text())
    gpus = [
        GPU(index=0, pci_bus_id="00000008:01:00.0"),
        GPU(index=1, pci_bus_id="0009:01:00.0"),
        GPU(index=2, pci_bus_id="0000:ff:00.0"),
    ]
    apply_fabric(gpus, fab)
    assert gpus[0].fabric.domain and gpus[1].fabric.domain == gpus[0].fabric.domain
    assert gpus[2].fabric is None
    assert normalize_bus_id("0000:2A:00.0") == "00000000:2a:00.0"
