"""The fabric map: ibnetdiscover's output parsed into switches, adapters and cables,
then tiers, node attribution, degraded cables, down ports and rail alignment.

The fixtures were printed by the real ibnetdiscover (infiniband-diags 44.0) from
fabric caches; tests/fixtures/fabric/README.md says how and what each holds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmgw.errors import LlmgwError
from llmgw.server.control.fabric_map import (
    AGGREGATION,
    CORE,
    LEAF,
    MAX_OUTPUT_BYTES,
    SPINE,
    Endpoint,
    FabricMapError,
    analyse,
    host_and_device,
    link_rate_gbps,
    natural_key,
    parse_ibnetdiscover,
    to_json,
)

FIX = Path(__file__).resolve().parent.parent / "fixtures" / "fabric"

SPINE_01, SPINE_02 = "0xfc6a1c0300e1b0a0", "0xfc6a1c0300e1b3c0"
LEAVES = ["0xfc6a1c0300e1a400", "0xfc6a1c0300e1a7e0", "0xfc6a1c0300e1ab20", "0xfc6a1c0300e1ae60"]
NODES = [f"node-{c}" for c in "abcdefgh"]


def fixture(name: str) -> str:
    return (FIX / f"ibnetdiscover_{name}.txt").read_text()


def fabric(name: str):
    return analyse(parse_ibnetdiscover(fixture(name)))


def by_name(fmap):
    return {s.name: s for s in fmap.topology.switches}


# A two-node fabric written in the tool's format, for cases the fixtures do not hold.
SMALL_HEADER = "#\n# Topology file: generated on Tue Mar 11 09:42:17 2025\n#\n# Initiated from node a088c2030012f3a0 port a088c2030012f3a0\n"


def small(cabling: dict[str, tuple[int, str]], ports: int = 8) -> str:
    """One switch ("MF0;leaf-a:MQM9700/U1", or leaf-b for a port above 100) and
    adapters named "host dev", each cabled to the (switch port, rate) given."""
    leaves = {"a": "fc6a1c0300e1a400", "b": "fc6a1c0300e1a7e0"}
    blocks = [SMALL_HEADER]
    ca_blocks = []
    switch_ports: dict[str, list[str]] = {"a": [], "b": []}
    for i, (desc, (port, rate)) in enumerate(cabling.items()):
        leaf = "b" if port > 100 else "a"
        sport = port - 100 if port > 100 else port
        g = f"a088c2030012{0xF3A0 + i * 8:04x}"
        lid = 10 + i
        switch_ports[leaf].append(f'[{sport}]\t"H-{g}"[1]({g}) \t\t# "{desc}" lid {lid} {rate}\n')
        ca_blocks.append(
            f"\nvendid=0x2c9\ndevid=0x1021\nsysimgguid=0x{g}\ncaguid=0x{g}\n"
            f'Ca\t1 "H-{g}"\t\t# "{desc}"\n'
            f'[1]({g}) \t"S-{leaves[leaf]}"[{sport}]\t\t# lid {lid} lmc 0 "MF0;leaf-{leaf}:MQM9700/U1" lid 1 {rate}\n'
        )
    for leaf, lines in switch_ports.items():
        if lines:
            blocks.append(
                f"\nvendid=0x2c9\ndevid=0xd2f2\nsysimgguid=0x{leaves[leaf]}\nswitchguid=0x{leaves[leaf]}({leaves[leaf]})\n"
                f'Switch\t{ports} "S-{leaves[leaf]}"\t\t# "MF0;leaf-{leaf}:MQM9700/U1" enhanced port 0 lid 1 lmc 0\n'
                + "".join(lines)
            )
    return "".join(blocks + ca_blocks)


# ------------------------------------------------------------------------- parsing


def test_the_fat_tree_parses_into_six_switches_thirty_two_adapters_and_each_cable_once():
    topo = parse_ibnetdiscover(fixture("fat_tree"))
    assert len(topo.switches) == 6
    assert len(topo.adapters) == 32
    # 32 host cables and 4 leaves x 2 spines x 4 uplinks, though the text prints each from both ends.
    assert len(topo.cables) == 32 + 32
    ends = [frozenset((c.a, c.b)) for c in topo.cables]
    assert len(set(ends)) == len(ends)
    assert topo.initiated_from == "0xa088c2030012f3a0"


def test_a_switch_keeps_its_port_count_lid_and_the_name_between_semicolon_and_colon():
    s = next(s for s in parse_ibnetdiscover(fixture("fat_tree")).switches if s.guid == LEAVES[0])
    assert (s.ports, s.lid, s.description) == (65, 3, "MF0;ib-leaf-01:MQM9700/U1")
    assert s.name == "ib-leaf-01"


def test_a_host_cable_is_written_adapter_end_first_with_its_width_speed_and_data_rate():
    topo = parse_ibnetdiscover(fixture("fat_tree"))
    cable = next(c for c in topo.cables if c.a.guid == "0xa088c2030012f3a0")
    assert cable.a == Endpoint("0xa088c2030012f3a0", 1)
    assert cable.b == Endpoint(LEAVES[0], 1)
    assert (cable.width, cable.speed, cable.rate_gbps) == ("4x", "NDR", 400.0)


def test_port_guids_printed_without_leading_zeros_are_read_as_full_guids():
    a = next(a for a in parse_ibnetdiscover(fixture("fat_tree")).adapters if a.description == "node-a mlx5_0")
    assert a.port_guids == ((1, "0xa088c2030012f3a0"),)


@pytest.mark.parametrize(
    ("width", "speed", "gbps"),
    [
        ("4x", "NDR", 400.0),
        ("4x", "HDR", 200.0),
        ("2x", "HDR", 100.0),
        ("1x", "HDR", 50.0),
        ("2x", "NDR", 200.0),
        ("4x", "EDR", 100.0),
        ("4x", "FDR", 54.56),
        ("4x", "FDR10", 40.0),
        ("4x", "QDR", 32.0),
        ("12x", "SDR", 24.0),
        ("4x", "XDR", 800.0),
        ("4x", "???", None),
        ("??", "NDR", None),
    ],
)
def test_link_rates_are_data_rates_that_operators_quote(width, speed, gbps):
    assert link_rate_gbps(width, speed) == gbps


def test_an_adapter_description_of_host_and_device_names_the_node_and_a_drivers_own_names_none():
    assert host_and_device("node-a mlx5_0") == ("node-a", "mlx5_0")
    assert host_and_device("gpu-p1-01 HCA-1") == ("gpu-p1-01", "HCA-1")
    assert host_and_device("MT4123 ConnectX6 Mellanox Technologies") == (None, None)


def test_device_names_sort_by_their_numbers_so_mlx5_10_comes_after_mlx5_9():
    assert sorted(["mlx5_10", "mlx5_2", "mlx5_9"], key=natural_key) == ["mlx5_2", "mlx5_9", "mlx5_10"]


# --------------------------------------------------------------------------- tiers


def test_switches_with_hosts_are_leaves_and_those_only_above_them_spines():
    fmap = fabric("fat_tree")
    assert {g for g, t in fmap.tiers.items() if t == LEAF} == set(LEAVES)
    assert {g for g, t in fmap.tiers.items() if t == SPINE} == {SPINE_01, SPINE_02}


def test_a_three_tier_fabric_puts_the_switches_above_the_spines_in_the_core():
    fmap = fabric("three_tier")
    tiers = {s.name: fmap.tiers[s.guid] for s in fmap.topology.switches}
    assert tiers == {
        "ib-core-01": CORE,
        "ib-core-02": CORE,
        "ib-pod1-spine-01": SPINE,
        "ib-pod1-spine-02": SPINE,
        "ib-pod2-spine-01": SPINE,
        "ib-pod2-spine-02": SPINE,
        "ib-pod1-leaf-01": LEAF,
        "ib-pod1-leaf-02": LEAF,
        "ib-pod2-leaf-01": LEAF,
        "ib-pod2-leaf-02": LEAF,
    }


def test_a_switchs_sharp_aggregation_node_does_not_make_it_a_leaf_or_a_host():
    fmap = fabric("three_tier")
    aggregation = [a for a in fmap.topology.adapters if a.kind == AGGREGATION]
    assert len(aggregation) == 10  # one inside every Quantum switch, on port 41
    assert all(a.node is None for a in aggregation)
    core = by_name(fmap)["ib-core-01"]
    assert fmap.tiers[core.guid] == CORE
    assert 41 not in fmap.down_ports[core.guid]
    assert fmap.degraded == ()


# ---------------------------------------------------------------- node attribution


def test_every_node_has_its_four_adapters_in_device_order():
    fmap = fabric("fat_tree")
    assert [n.name for n in fmap.nodes] == NODES
    adapters = {a.guid: a for a in fmap.topology.adapters}
    for n in fmap.nodes:
        assert [adapters[g].device for g in n.adapters] == ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]
        assert {adapters[g].node for g in n.adapters} == {n.name}
        assert n.leaves == tuple(sorted(LEAVES))


def test_an_adapter_whose_description_names_no_host_belongs_to_no_node_and_is_reported():
    fmap = fabric("three_tier")
    login = next(a for a in fmap.topology.adapters if a.guid == "0x1070fd0300a13f3e")
    assert (login.node, login.device) == (None, None)
    assert "0x1070fd0300a13f3e" not in fmap.rail_of
    assert [n.name for n in fmap.nodes] == ["gpu-p1-01", "gpu-p1-02", "gpu-p2-01", "gpu-p2-02"]
    assert any(p.subject == "0x1070fd0300a13f3e" and "rdma-ndd" in p.text for p in fmap.problems)


# ---------------------------------------------------------------------- degraded


def test_a_host_cable_trained_at_hdr_among_ndr_ones_is_degraded_and_says_why():
    fmap = fabric("fat_tree_degraded")
    host = [d for d in fmap.degraded if d.kind == "adapter"]
    assert len(host) == 1
    adapter = next(a for a in fmap.topology.adapters if a.guid == host[0].cable.a.guid)
    assert adapter.label == "node-c mlx5_2"
    assert host[0].reason == "4xHDR (200 Gb/s) where others of its kind are 4xNDR (400 Gb/s)"
    assert fmap.node("node-c").degraded
    assert not fmap.node("node-b").degraded


def test_a_switch_uplink_trained_at_two_lanes_is_degraded_against_other_uplinks_only():
    fmap = fabric("fat_tree_degraded")
    uplinks = [d for d in fmap.degraded if d.kind == "switch"]
    assert len(uplinks) == 1
    ends = {uplinks[0].cable.a, uplinks[0].cable.b}
    assert ends == {Endpoint(LEAVES[1], 38), Endpoint(SPINE_02, 6)}
    assert uplinks[0].reason == "2xNDR (200 Gb/s) where others of its kind are 4xNDR (400 Gb/s)"


def test_a_healthy_fabric_has_no_degraded_cables_and_no_warnings():
    fmap = fabric("fat_tree")
    assert fmap.degraded == ()
    assert [p for p in fmap.problems if p.level == "warn"] == []


def test_hdr_hosts_under_ndr_uplinks_are_not_degraded_since_kinds_are_compared_apart():
    fmap = fabric("three_tier")  # all HDR, hosts and switches alike
    assert fmap.degraded == ()
    text = small({"h1 mlx5_0": (1, "4xHDR"), "h2 mlx5_0": (2, "4xHDR"), "h3 mlx5_0": (3, "4xHDR")})
    assert analyse(parse_ibnetdiscover(text)).degraded == ()


def test_when_rates_tie_for_most_common_the_slower_cables_are_the_degraded_ones():
    text = small({"h1 mlx5_0": (1, "4xNDR"), "h2 mlx5_0": (2, "4xHDR")})
    fmap = analyse(parse_ibnetdiscover(text))
    assert [d.reason for d in fmap.degraded] == ["4xHDR (200 Gb/s) where others of its kind are 4xNDR (400 Gb/s)"]


# --------------------------------------------------------------------- down ports


def test_switch_ports_with_no_cable_are_down_ports_listed_per_switch():
    fmap = fabric("fat_tree")
    leaf = LEAVES[0]
    # 8 hosts on 1-8, uplinks on 33-40: the other 49 of the 65 have no cable.
    assert len(fmap.down_ports[leaf]) == 65 - 16
    assert set(fmap.down_ports[leaf]).isdisjoint(range(1, 9))
    assert 9 in fmap.down_ports[leaf]


def test_an_unplugged_uplink_shows_as_a_down_port_at_both_ends_and_a_leaf_short_of_uplinks():
    healthy, broken = fabric("fat_tree"), fabric("fat_tree_degraded")
    assert 40 not in healthy.down_ports[LEAVES[2]]
    assert 40 in broken.down_ports[LEAVES[2]]
    assert 12 in broken.down_ports[SPINE_02]
    assert len(broken.down_ports[LEAVES[2]]) == len(healthy.down_ports[LEAVES[2]]) + 1
    short = [p for p in broken.problems if "uplinks" in p.text]
    assert [(p.subject, p.text) for p in short] == [
        (
            "ib-leaf-03",
            "leaf ib-leaf-03 has 7 uplinks where other leaf switches have 8: a cable up from it is unplugged or down",
        )
    ]


# ------------------------------------------------------------------ rail alignment


def test_a_fabric_with_every_nodes_nth_adapter_on_leaf_n_is_rail_aligned():
    fmap = fabric("fat_tree")
    assert fmap.rail_aligned
    assert fmap.misaligned == ()
    assert [(r.index, r.device, r.leaves, r.nodes) for r in fmap.rails] == [
        (i, f"mlx5_{i}", (LEAVES[i],), tuple(NODES)) for i in range(4)
    ]


def test_two_swapped_cables_make_the_fabric_not_rail_aligned_and_name_the_node_and_why():
    fmap = fabric("fat_tree_misaligned")
    assert not fmap.rail_aligned
    assert [m.node for m in fmap.misaligned] == ["node-f"]
    assert fmap.misaligned[0].reasons == (
        "mlx5_1 (rail 1) is on ib-leaf-03, which carries rail 2 for 7 other adapters",
        "mlx5_2 (rail 2) is on ib-leaf-02, which carries rail 1 for 7 other adapters",
    )
    assert fmap.rails[1].leaves == (LEAVES[1], LEAVES[2])
    assert any(p.subject == "node-f" and "not rail-aligned" in p.text for p in fmap.problems)


def test_a_rail_spread_over_one_leaf_per_pod_is_still_aligned_when_no_leaf_carries_two_rails():
    fmap = fabric("three_tier")
    assert fmap.rail_aligned
    names = {s.guid: s.name for s in fmap.topology.switches}
    assert [(r.device, [names[g] for g in r.leaves]) for r in fmap.rails] == [
        ("HCA-1", ["ib-pod1-leaf-01", "ib-pod2-leaf-01"]),
        ("HCA-2", ["ib-pod1-leaf-02", "ib-pod2-leaf-02"]),
    ]


def test_nodes_with_all_their_adapters_on_one_leaf_are_not_rail_aligned():
    text = small(
        {"h1 mlx5_0": (1, "4xNDR"), "h1 mlx5_1": (2, "4xNDR"), "h2 mlx5_0": (3, "4xNDR"), "h2 mlx5_1": (4, "4xNDR")}
    )
    fmap = analyse(parse_ibnetdiscover(text))
    assert not fmap.rail_aligned
    assert [(m.node, m.reasons) for m in fmap.misaligned] == [
        ("h1", ("mlx5_0, mlx5_1 share leaf leaf-a",)),
        ("h2", ("mlx5_0, mlx5_1 share leaf leaf-a",)),
    ]


def test_a_node_whose_adapter_is_down_lacks_that_rail_rather_than_shifting_the_others():
    # h2's mlx5_1 port is down, so ibnetdiscover never saw it; its mlx5_2 is still rail 2.
    text = small(
        {
            "h1 mlx5_0": (1, "4xNDR"),
            "h1 mlx5_1": (101, "4xNDR"),
            "h1 mlx5_2": (3, "4xNDR"),
            "h2 mlx5_0": (2, "4xNDR"),
            "h2 mlx5_2": (4, "4xNDR"),
        }
    )
    fmap = analyse(parse_ibnetdiscover(text))
    assert (fmap.misaligned[0].node, fmap.misaligned[0].reasons) == ("h1", ("mlx5_0, mlx5_2 share leaf leaf-a",))
    assert fmap.misaligned[1].node == "h2"
    assert "has no mlx5_1 on this fabric (rail 1): its port is down or not cabled" in fmap.misaligned[1].reasons
    assert fmap.rails[2].nodes == ("h1", "h2")


# ------------------------------------------------------------------- bad input


def test_a_malformed_line_is_an_error_naming_its_number_and_what_was_expected():
    lines = fixture("fat_tree").splitlines(keepends=True)
    number = next(i for i, line in enumerate(lines, 1) if line.startswith("[3]\t"))
    lines[number - 1] = lines[number - 1].replace("4xNDR", "4xNDQ")
    with pytest.raises(FabricMapError, match=rf"line {number}: expected a switch port line") as caught:
        parse_ibnetdiscover("".join(lines))
    assert caught.value.line == number
    assert isinstance(caught.value, LlmgwError)


def test_a_port_line_outside_any_nodes_block_is_an_error():
    text = SMALL_HEADER + '\n[1]\t"S-fc6a1c0300e1a400"[1]\t\t# "leaf" lid 1 4xNDR\n'
    with pytest.raises(FabricMapError, match=r"line 6: expected a port line only inside a node's block"):
        parse_ibnetdiscover(text)


def test_output_cut_short_before_a_named_peers_block_is_an_error():
    text = fixture("fat_tree")
    cut = text[: text.rindex("\nvendid=")]  # the last adapter's block is missing
    with pytest.raises(FabricMapError, match=r"has no block of its own \(output cut short\?\)"):
        parse_ibnetdiscover(cut)


def test_a_port_said_to_be_cabled_to_two_different_peers_is_an_error():
    text = fixture("fat_tree").replace(
        '"S-fc6a1c0300e1a400"[1]\t\t# lid 10 ', '"S-fc6a1c0300e1a400"[9]\t\t# lid 10 ', 1
    )
    with pytest.raises(FabricMapError, match=r"is cabled to .* here but to .* on line \d+"):
        parse_ibnetdiscover(text)


def test_output_over_sixteen_mebibytes_is_refused_before_it_is_read():
    with pytest.raises(FabricMapError, match=r"more than 16777216 bytes \(16 MiB\) is refused"):
        parse_ibnetdiscover("#" * (MAX_OUTPUT_BYTES + 1))
    # Multi-byte characters count as the bytes they are, not as characters.
    with pytest.raises(FabricMapError, match="16 MiB"):
        parse_ibnetdiscover("#" + "é" * (MAX_OUTPUT_BYTES // 2))
    assert parse_ibnetdiscover("#" * MAX_OUTPUT_BYTES).switches == ()


def test_the_full_information_flag_and_grouping_lines_do_not_stop_the_parse():
    text = fixture("fat_tree").replace(" 4xNDR\n", " 4xNDR s=4 w=2 v=4 e=8\n")
    text = text.replace("# Initiated", "Non-Chassis Nodes\n# Initiated", 1)
    assert len(parse_ibnetdiscover(text).cables) == 64


# -------------------------------------------------------------------------- JSON


def test_the_json_form_survives_a_round_trip_and_does_not_depend_on_the_printed_order():
    text = fixture("fat_tree_degraded")
    first = to_json(analyse(parse_ibnetdiscover(text)))
    assert json.loads(json.dumps(first)) == first
    header, *blocks = text.split("\n\n")
    reordered = "\n\n".join([header, *reversed(blocks)])
    again = to_json(analyse(parse_ibnetdiscover(reordered)))
    assert json.dumps(again, sort_keys=False) == json.dumps(first, sort_keys=False)


def test_the_json_form_carries_tiers_nodes_rates_degraded_flags_and_problems():
    doc = to_json(fabric("fat_tree_degraded"))
    assert doc["summary"]["tiers"] == {"leaf": 4, "spine": 2, "core": 0, "unknown": 0}
    assert [s["name"] for s in doc["switches"]] == [
        "ib-leaf-01",
        "ib-leaf-02",
        "ib-leaf-03",
        "ib-leaf-04",
        "ib-spine-01",
        "ib-spine-02",
    ]
    leaf3 = doc["switches"][2]
    assert leaf3["tier"] == "leaf" and 40 in leaf3["down_ports"] and leaf3["down_port_count"] == 50
    first = doc["adapters"][0]
    assert (first["node"], first["device"], first["rail"], first["leaves"]) == ("node-a", "mlx5_0", 0, [LEAVES[0]])
    flagged = [c for c in doc["cables"] if c["degraded"]]
    assert len(flagged) == 2 and all(c["reason"] for c in flagged)
    assert all(c["rate_gbps"] == 400.0 for c in doc["cables"] if not c["degraded"])
    assert doc["rail_aligned"] is True
    assert {p["subject"] for p in doc["problems"]} == {"node-c", "ib-leaf-02", "ib-leaf-03"}
