"""InfiniBand and RoCE ports from a sysfs tree built the way the kernel lays it out."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from llmgw.agent.discovery.commands import CommandResult
from llmgw.agent.discovery.infiniband import (
    find_rocev2_gid,
    gid_ipv4,
    ip_network_lookup,
    normalize_guid,
    parse_int,
    parse_ip_addr,
    parse_rate,
    read_adapters,
    strip_code,
)


def write(root: Path, rel: str, body: str) -> None:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(body + "\n")


def build_sysfs(tmp_path: Path) -> Path:
    """/sys/class/infiniband with an NDR InfiniBand HCA (mlx5_0), a two-port
    HCA with its second port down (mlx5_1), and a RoCE port (mlx5_2)."""
    sys = tmp_path / "sys"
    ib = sys / "class" / "infiniband"

    # The PCI devices the adapters are, with their NUMA nodes.
    for addr, numa in (("0000:1a:00.0", "0"), ("0000:3b:00.0", "-1"), ("0000:9c:00.0", "1")):
        write(sys, f"devices/pci0000:00/{addr}/numa_node", numa)

    write(ib, "mlx5_0/fw_ver", "28.39.1002")
    write(ib, "mlx5_0/node_guid", "b83f:d203:00a1:2b3c")
    write(ib, "mlx5_0/board_id", "MT_0000000838")
    os.symlink(sys / "devices/pci0000:00/0000:1a:00.0", ib / "mlx5_0/device")
    port = "mlx5_0/ports/1"
    write(ib, f"{port}/state", "4: ACTIVE")
    write(ib, f"{port}/phys_state", "5: LinkUp")
    write(ib, f"{port}/rate", "400 Gb/sec (4X NDR)")
    write(ib, f"{port}/link_layer", "InfiniBand")
    write(ib, f"{port}/lid", "0x1a")
    write(ib, f"{port}/sm_lid", "0x1")
    write(ib, f"{port}/gids/0", "fe80:0000:0000:0000:b83f:d203:00a1:2b3c")
    write(ib, f"{port}/gids/1", "0000:0000:0000:0000:0000:0000:0000:0000")
    write(ib, f"{port}/counters/symbol_error", "3")
    write(ib, f"{port}/counters/link_downed", "1")
    write(ib, f"{port}/counters/port_rcv_errors", "0")
    write(ib, f"{port}/counters/port_xmit_data", "1000")
    write(ib, f"{port}/counters/port_rcv_data", "250")

    # Two ports, the second with no cable (Polling) and no subnet manager.
    write(ib, "mlx5_1/fw_ver", "20.31.1014")
    write(ib, "mlx5_1/node_guid", "0c42:a103:0045:bd6c")
    os.symlink(sys / "devices/pci0000:00/0000:3b:00.0", ib / "mlx5_1/device")
    write(sys, "devices/pci0000:00/0000:3b:00.0/net/ibp59s0f0/operstate", "up")
    for n, state, phys, rate in (
        ("1", "4: ACTIVE", "5: LinkUp", "200 Gb/sec (4X HDR)"),
        ("2", "1: DOWN", "2: Polling", "10 Gb/sec (4X SDR)"),
    ):
        write(ib, f"mlx5_1/ports/{n}/state", state)
        write(ib, f"mlx5_1/ports/{n}/phys_state", phys)
        write(ib, f"mlx5_1/ports/{n}/rate", rate)
        write(ib, f"mlx5_1/ports/{n}/link_layer", "InfiniBand")
        write(ib, f"mlx5_1/ports/{n}/lid", "0x0" if n == "2" else "17")
        write(ib, f"mlx5_1/ports/{n}/sm_lid", "0x0" if n == "2" else "1")
        write(ib, f"mlx5_1/ports/{n}/gids/0", f"fe80:0000:0000:0000:0c42:a103:0045:bd6{n}")

    # RoCE: v1 link-local at 0, v2 link-local at 1, v1 IPv4 at 2, v2 IPv4 at 3.
    write(ib, "mlx5_2/fw_ver", "22.36.1010")
    write(ib, "mlx5_2/node_guid", "a088:c203:0064:55e0")
    os.symlink(sys / "devices/pci0000:00/0000:9c:00.0", ib / "mlx5_2/device")
    port = "mlx5_2/ports/1"
    write(ib, f"{port}/state", "4: ACTIVE")
    write(ib, f"{port}/phys_state", "5: LinkUp")
    write(ib, f"{port}/rate", "100 Gb/sec (4X EDR)")
    write(ib, f"{port}/link_layer", "Ethernet")
    write(ib, f"{port}/lid", "0x0")
    write(ib, f"{port}/sm_lid", "0x0")
    gids = [
        ("fe80:0000:0000:0000:a288:c2ff:fe64:55e0", "IB/RoCE v1"),
        ("fe80:0000:0000:0000:a288:c2ff:fe64:55e0", "RoCE v2"),
        ("0000:0000:0000:0000:0000:ffff:0a0a:0107", "IB/RoCE v1"),
        ("0000:0000:0000:0000:0000:ffff:0a0a:0107", "RoCE v2"),
    ]
    for i, (gid, kind) in enumerate(gids):
        write(ib, f"{port}/gids/{i}", gid)
        write(ib, f"{port}/gid_attrs/types/{i}", kind)
        write(ib, f"{port}/gid_attrs/ndevs/{i}", "ens1f0np0")
    for i in range(4, 16):  # the rest of the table: empty entries
        write(ib, f"{port}/gids/{i}", "0000:0000:0000:0000:0000:0000:0000:0000")
    write(ib, f"{port}/counters/port_xmit_data", "40")
    write(ib, f"{port}/counters/link_downed", "0")
    return ib


def test_an_infiniband_port_is_read(tmp_path):
    mlx5_0, _mlx5_1, _mlx5_2 = read_adapters(build_sysfs(tmp_path))
    assert (mlx5_0.name, mlx5_0.fw_ver, mlx5_0.board_id) == ("mlx5_0", "28.39.1002", "MT_0000000838")
    assert mlx5_0.node_guid == "0xb83fd20300a12b3c"
    assert mlx5_0.pci_address == "0000:1a:00.0" and mlx5_0.numa_node == 0
    [p] = mlx5_0.ports
    assert (p.hca, p.port, p.state, p.phys_state, p.link_layer) == ("mlx5_0", 1, "ACTIVE", "LinkUp", "InfiniBand")
    assert (p.rate_gbps, p.rate_detail) == (400.0, "4X NDR")
    assert (p.lid, p.sm_lid) == (26, 1)
    assert p.node_guid == "0xb83fd20300a12b3c"
    assert p.port_guid == "0xb83fd20300a12b3c" and p.gid_prefix == "fe80:0000:0000:0000"
    assert p.gid_index is None and p.network is None and p.active and not p.is_roce


def test_a_ports_counters_are_read_and_data_is_in_bytes(tmp_path):
    p = read_adapters(build_sysfs(tmp_path))[0].ports[0]
    assert p.counters == {
        "symbol_error": 3,
        "link_downed": 1,
        "port_rcv_errors": 0,
        "port_xmit_data": 4000,  # sysfs counts 4-byte words
        "port_rcv_data": 1000,
    }
    # A counter the driver does not have is absent, not zero.
    assert "port_xmit_discards" not in p.counters


def test_a_port_without_a_cable_is_down_and_polling(tmp_path):
    mlx5_1 = read_adapters(build_sysfs(tmp_path))[1]
    up, down = mlx5_1.ports
    assert up.active and (up.rate_gbps, up.lid) == (200.0, 17)
    assert (down.state, down.phys_state, down.active) == ("DOWN", "Polling", False)
    assert mlx5_1.numa_node is None  # -1: no NUMA affinity
    assert up.counters is None  # no counters directory at all
    assert up.netdev == "ibp59s0f0"  # the IPoIB interface of the device


def test_roce_finds_its_routable_v2_gid(tmp_path):
    asked = []

    def network_of(netdev, address):
        asked.append((netdev, address))
        return "10.10.1.0/24"

    roce = read_adapters(build_sysfs(tmp_path), network_of=network_of)[2]
    [p] = roce.ports
    assert p.is_roce and p.link_layer == "Ethernet"
    # Index 3: the v2 entry holding an IPv4 address, over the earlier v2 link-local one.
    assert p.gid_index == 3
    assert p.gid == "0000:0000:0000:0000:0000:ffff:0a0a:0107"
    assert p.roce_address == "10.10.1.7" and p.netdev == "ens1f0np0"
    assert p.network == "10.10.1.0/24" and asked == [("ens1f0np0", "10.10.1.7")]
    assert p.lid is None and p.sm_lid is None  # meaningless on Ethernet
    assert p.counters == {"port_xmit_data": 160, "link_downed": 0}


def test_without_an_ipv4_v2_entry_the_first_v2_is_used_and_without_v2_none(tmp_path):
    port = tmp_path / "port"
    write(port, "gids/0", "fe80:0000:0000:0000:a288:c2ff:fe64:55e0")
    write(port, "gid_attrs/types/0", "IB/RoCE v1")
    assert find_rocev2_gid(port) is None
    write(port, "gids/1", "fe80:0000:0000:0000:a288:c2ff:fe64:55e0")
    write(port, "gid_attrs/types/1", "RoCE v2")
    assert find_rocev2_gid(port) == 1


def test_no_adapters_is_an_empty_list_not_an_error(tmp_path):
    assert read_adapters(tmp_path / "class" / "infiniband") == []
    (tmp_path / "empty").mkdir()
    assert read_adapters(tmp_path / "empty") == []


def test_the_network_of_a_roce_address_is_asked_of_ip():
    out = (
        "5: ens1f0np0    inet 10.10.1.7/24 brd 10.10.1.255 scope global ens1f0np0\\       valid_lft forever preferred_lft forever\n"
        "5: ens1f0np0    inet 192.168.5.2/16 scope global secondary ens1f0np0\\       valid_lft forever preferred_lft forever\n"
    )
    calls = []

    def run(argv, timeout):
        calls.append(tuple(argv))
        return CommandResult(tuple(argv), 0, out)

    lookup = ip_network_lookup(run)
    assert lookup("ens1f0np0", "10.10.1.7") == "10.10.1.0/24"
    assert lookup("ens1f0np0", "192.168.5.2") == "192.168.0.0/16"
    assert lookup("ens1f0np0", "10.9.9.9") is None
    assert calls[0] == ("ip", "-o", "-4", "addr", "show", "dev", "ens1f0np0")
    assert ip_network_lookup(lambda a, t: CommandResult(tuple(a), None, missing=True))("x", "1.2.3.4") is None
    assert [str(i) for i in parse_ip_addr(out)] == ["10.10.1.7/24", "192.168.5.2/16"]


@pytest.mark.parametrize(
    "fn, value, expected",
    [
        (strip_code, "4: ACTIVE", "ACTIVE"),
        (strip_code, "5: LinkUp", "LinkUp"),
        (strip_code, "ACTIVE", "ACTIVE"),
        (strip_code, None, None),
        (parse_rate, "2.5 Gb/sec (1X SDR)", (2.5, "1X SDR")),
        (parse_rate, "100 Gb/sec", (100.0, None)),
        (parse_rate, "garbage", (None, None)),
        (parse_int, "0x1a", 26),
        (parse_int, "17", 17),
        (parse_int, "", None),
        (normalize_guid, "0c42:a103:0045:bd6c", "0x0c42a1030045bd6c"),
        (normalize_guid, "0x98039B03009FCFD6", "0x98039b03009fcfd6"),
        (normalize_guid, "0000:0000:0000:0000", None),
        (gid_ipv4, "0000:0000:0000:0000:0000:ffff:0a00:0001", "10.0.0.1"),
        (gid_ipv4, "fe80:0000:0000:0000:a288:c2ff:fe64:55e0", None),
    ],
)
def test_infiniband_sysfs_values_parse_states_rates_numbers_guids_and_gids(fn, value, expected):
    assert fn(value) == expected
