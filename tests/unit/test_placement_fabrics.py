"""Placement over physical fabrics (spec cluster.md §2.4, filter 7 and the
multi-node preferences): a declared fabric divided by physical identity, a node
on two fabrics refused for that name, nodes under one leaf switch preferred,
degraded cables avoided, and the explanations that say so."""

from __future__ import annotations

import random

from llmgw.protocol import FabricAttachment
from llmgw.server.control.agents import Node
from llmgw.server.control.placement import (
    GPUView,
    NodeFabricFacts,
    NodeView,
    Placement,
    PlacementGroup,
    PlacementRequest,
    Refusal,
    explain,
    node_view,
    place,
    place_all,
)

IB_A, IB_B = "ib:0xa000", "ib:0xb000"
LEAF_1, LEAF_2, LEAF_3 = "0x1111", "0x2222", "0x3333"
SLOW = "trained at 100 Gb/s where the others of its kind run at 400"


def view(
    nid: str,
    *,
    fabrics: dict[str, tuple[str, ...]] | None = None,
    physical: dict[str, frozenset[str]] | None = None,
    leaves: dict[str, tuple[str, ...]] | None = None,
    degraded: dict[str, str] | None = None,
    **kw,
) -> NodeView:
    """An 8-card H100 node on fabric "rail" through mlx5_0 unless told otherwise."""
    kw.setdefault("engines", {"vllm": "0.11.0"})
    kw.setdefault("gpus", tuple(GPUView(index=i, gpu_class="h100-80g") for i in range(8)))
    facts = NodeFabricFacts(physical=physical or {}, leaves=leaves or {}, degraded=degraded or {})
    return NodeView(node_id=nid, fabrics=fabrics or {"rail": ("mlx5_0",)}, fabric_facts=facts, **kw)


def on(identity: str, nid: str, **kw) -> NodeView:
    return view(nid, physical={"rail": frozenset({identity})}, **kw)


def under(leaf: str, nid: str, **kw) -> NodeView:
    return view(nid, leaves={"mlx5_0": (leaf,)}, **kw)


def two_nodes(**kw) -> PlacementRequest:
    kw.setdefault("nodes", 2)
    return PlacementRequest(model="m", engine="vllm", gpu_class="h100-80g", tp=8, **kw)


def reasons(verdicts, nid):
    return next(v.reasons for v in verdicts if v.node_id == nid)


def names(res) -> list[str]:
    return [n for n, _ in res.nodes]


# ------------------------------------------------------------- the input type


def test_node_view_carries_the_fabric_facts_it_is_given_and_none_known_by_default():
    node = Node(node_id="n1", fabrics=[FabricAttachment(fabric="rail", hcas=["mlx5_0"])])
    assert node_view(node).fabric_facts == NodeFabricFacts()
    facts = NodeFabricFacts(
        physical={"rail": frozenset({IB_A})}, leaves={"mlx5_0": (LEAF_1,)}, degraded={"mlx5_0": SLOW}
    )
    v = node_view(node, fabric_facts=facts)
    assert v.fabric_facts is facts
    # A claim keeps them: placing several requests must not forget the fabric.
    assert v.with_claim([0]).fabric_facts is facts


def test_placement_group_names_the_physical_fabric_only_when_it_is_known():
    assert str(PlacementGroup("rail", identity=IB_A)) == f"fabric rail ({IB_A})"
    assert str(PlacementGroup("rail")) == "fabric rail"
    assert str(PlacementGroup("c1/0", nvlink=True)) == "nvlink domain c1/0"


# ------------------------------------------------- filter 7: physical identity


def test_a_declared_fabric_is_divided_by_physical_identity_and_a_replica_forms_on_one_part():
    nodes = [on(IB_A, "a1"), on(IB_B, "b1"), on(IB_A, "a2"), on(IB_B, "b2")]
    res = place(two_nodes(), nodes)
    assert isinstance(res, Placement)
    assert names(res) == ["a1", "a2"]
    # The agent is given the declared name and its adapters, not the identity.
    assert res.fabric == "rail" and res.adapters == {"a1": ("mlx5_0",), "a2": ("mlx5_0",)}
    assert f"in fabric rail ({IB_A})" in res.explanation
    v = explain(two_nodes(), nodes)
    assert reasons(v, "b1") == [
        f"b1 fits, but the replica was placed in fabric rail ({IB_A}); its adapters for rail are on {IB_B}"
    ]
    # Two on each part: three nodes cannot form although four share the name.
    refused = place(two_nodes(nodes=3), nodes)
    assert isinstance(refused, Refusal)
    assert reasons(refused.verdicts, "b1") == [
        f"b1 fits, but no fabric it is on has 3 nodes that fit (fabric rail ({IB_B}) has 2)"
    ]


def test_a_node_that_cannot_say_its_identity_is_kept_apart_from_those_that_can():
    # One that can say, two that cannot: the two form alone.
    nodes = [on(IB_A, "a1"), view("u1"), view("u2")]
    res = place(two_nodes(), nodes)
    assert names(res) == ["u1", "u2"]
    assert reasons(explain(two_nodes(), nodes), "a1") == [
        "a1 fits, but the replica was placed in fabric rail, among nodes that cannot say which physical "
        f"fabric they are on; its adapters for rail are on {IB_A}"
    ]
    # Two that can, one that cannot.
    nodes = [view("u1"), on(IB_A, "a1"), on(IB_A, "a2")]
    assert names(place(two_nodes(), nodes)) == ["a1", "a2"]
    assert reasons(explain(two_nodes(), nodes), "u1") == [
        f"u1 fits, but the replica was placed in fabric rail ({IB_A}); "
        "it cannot say which physical fabric its adapters for rail are on"
    ]
    # One of each: never placed together.
    assert isinstance(place(two_nodes(), [on(IB_A, "a1"), view("u1")]), Refusal)
    # An empty set of identities is "not known", like a name left out.
    nodes = [view("e1", physical={"rail": frozenset()}), view("u1")]
    assert names(place(two_nodes(), nodes)) == ["e1", "u1"]


def test_a_node_whose_adapters_for_one_name_sit_on_two_fabrics_is_refused_for_that_name_in_words():
    split = view("s1", fabrics={"rail": ("mlx5_0", "mlx5_1")}, physical={"rail": frozenset({IB_B, IB_A})})
    words = f"s1 is refused on fabric rail: its adapters for fabric rail are cabled to two fabrics: {IB_A}, {IB_B}"
    nodes = [split, on(IB_A, "a1"), on(IB_B, "b1")]
    refused = place(two_nodes(), nodes)
    assert isinstance(refused, Refusal)
    assert reasons(refused.verdicts, "s1") == [words]
    assert words in refused.explanation
    # Beside another part that forms, the refusal is still what it is told.
    nodes.append(on(IB_A, "a2"))
    assert names(place(two_nodes(), nodes)) == ["a1", "a2"]
    assert reasons(explain(two_nodes(), nodes), "s1") == [words]
    # Refused for that name only: on a second fabric it still joins a replica.
    both = view(
        "s1",
        fabrics={"rail": ("mlx5_0", "mlx5_1"), "eth": ("mlx5_2",)},
        physical={"rail": frozenset({IB_A, IB_B})},
    )
    other = view("e1", fabrics={"eth": ("mlx5_2",)})
    res = place(two_nodes(), [both, other])
    assert names(res) == ["e1", "s1"] and res.fabric == "eth"
    # A node refused for other reasons hears this one too.
    cordoned = view("s1", physical={"rail": frozenset({IB_A, IB_B})}, cordoned=True)
    assert reasons(explain(two_nodes(), [cordoned]), "s1") == [
        "s1 is cordoned",
        f"s1 is refused on fabric rail: its adapters for fabric rail are cabled to two fabrics: {IB_A}, {IB_B}",
    ]


def test_single_node_placement_ignores_fabric_identity_leaves_and_cables():
    split = view("s1", physical={"rail": frozenset({IB_A, IB_B})}, degraded={"mlx5_0": SLOW})
    req = two_nodes(nodes=1)
    res = place(req, [split])
    assert names(res) == ["s1"]
    assert res.explanation == "m on s1: GPUs 0,1,2,3,4,5,6,7; packed: 0 free GPUs left there"
    assert explain(req, [split])[0].chosen


# ------------------------------------------------- preferences: leaf, cables


def test_multi_node_prefers_nodes_under_one_leaf_switch_and_explains_who_lost_for_it():
    nodes = [under(LEAF_1, "n1"), under(LEAF_2, "n2"), under(LEAF_2, "n3"), view("n4")]
    res = place(two_nodes(), nodes)
    # By name alone n1 and n2; n2 and n3 share a leaf.
    assert names(res) == ["n2", "n3"]
    assert res.explanation.endswith(f"; all under one leaf switch {LEAF_2}")
    v = explain(two_nodes(), nodes)
    assert reasons(v, "n2") == [
        f"m on n2: GPUs 0,1,2,3,4,5,6,7; packed: 0 free GPUs left there; in fabric rail, all under one leaf switch {LEAF_2}"
    ]
    assert reasons(v, "n1") == [f"n1 fits, but the chosen nodes share leaf switch {LEAF_2} and n1 is under {LEAF_1}"]
    assert reasons(v, "n4") == [
        f"n4 fits, but the chosen nodes share leaf switch {LEAF_2} and n4's adapters are not on the fabric map"
    ]


def test_one_leaf_switch_outranks_holding_the_weights_and_packing():
    weights = frozenset({"/models/m"})
    nodes = [
        under(LEAF_1, "n1", weights=weights),
        under(LEAF_2, "n2", weights=weights),
        under(LEAF_3, "n3"),
        under(LEAF_3, "n4"),
    ]
    assert names(place(two_nodes(source="/models/m"), nodes)) == ["n3", "n4"]


def test_rail_aligned_nodes_count_as_under_one_leaf_through_each_rail():
    rails = {"mlx5_0": (LEAF_1,), "mlx5_1": (LEAF_2,)}
    fabric = {"rail": ("mlx5_0", "mlx5_1")}
    nodes = [
        view("n1", fabrics=fabric, leaves={"mlx5_0": (LEAF_3,), "mlx5_1": (LEAF_3,)}),
        view("n2", fabrics=fabric, leaves=rails),
        view("n3", fabrics=fabric, leaves=rails),
    ]
    res = place(two_nodes(), nodes)
    assert names(res) == ["n2", "n3"]
    assert res.explanation.endswith(f"; all under the same leaf switches {LEAF_1} and {LEAF_2}")


def test_a_partly_shared_leaf_is_said_as_a_count():
    nodes = [under(LEAF_1, "n1"), under(LEAF_1, "n2"), under(LEAF_2, "n3")]
    res = place(two_nodes(nodes=3), nodes)
    assert names(res) == ["n1", "n2", "n3"]
    assert res.explanation.endswith(f"; at most 2 of 3 under one leaf switch ({LEAF_1})")


def test_leaves_of_adapters_off_the_replicas_fabric_do_not_count():
    # n2 and n3 share a leaf only through an adapter no declared fabric uses.
    nodes = [
        view("n1", leaves={"mlx5_0": (LEAF_1,)}),
        view("n2", leaves={"mlx5_0": (LEAF_2,), "mlx5_9": (LEAF_3,)}),
        view("n3", leaves={"mlx5_0": (LEAF_1,), "mlx5_9": (LEAF_3,)}),
    ]
    assert names(place(two_nodes(), nodes)) == ["n1", "n3"]


def test_multi_node_avoids_a_node_with_a_degraded_cable_and_says_so():
    nodes = [view("n1", degraded={"mlx5_0": SLOW}), view("n2"), view("n3")]
    res = place(two_nodes(), nodes)
    assert names(res) == ["n2", "n3"]
    assert reasons(explain(two_nodes(), nodes), "n1") == [f"n1 fits, but its cable on mlx5_0 is degraded ({SLOW})"]


def test_a_degraded_cable_outranks_sharing_a_leaf():
    nodes = [
        under(LEAF_1, "n1", degraded={"mlx5_0": SLOW}),
        under(LEAF_1, "n2"),
        under(LEAF_2, "n3"),
    ]
    assert names(place(two_nodes(), nodes)) == ["n2", "n3"]
    # Among the healthy, the leaf still counts.
    nodes.append(under(LEAF_1, "n4"))
    res = place(two_nodes(), nodes)
    assert names(res) == ["n2", "n4"]
    assert reasons(explain(two_nodes(), nodes), "n1") == [f"n1 fits, but its cable on mlx5_0 is degraded ({SLOW})"]


def test_a_degraded_cable_is_a_preference_not_a_filter_and_the_placement_names_it():
    nodes = [view("n1", degraded={"mlx5_0": SLOW}), view("n2")]
    res = place(two_nodes(), nodes)
    assert names(res) == ["n2", "n1"]  # the healthy node ranks first
    assert res.explanation.endswith(f"; n1: its cable on mlx5_0 is degraded ({SLOW})")
    assert reasons(explain(two_nodes(), nodes), "n1")[0].endswith(
        f"; in fabric rail; its cable on mlx5_0 is degraded ({SLOW})"
    )


def test_a_degraded_cable_on_another_fabrics_adapter_does_not_count():
    fabric = {"rail": ("mlx5_0",), "mgmt": ("mlx5_9",)}
    nodes = [view("n1", fabrics=fabric, degraded={"mlx5_9": SLOW}), view("n2"), view("n3")]
    assert names(place(two_nodes(), nodes)) == ["n1", "n2"]


def test_a_part_without_degraded_cables_is_chosen_over_one_with_them():
    nodes = [
        on(IB_A, "a1", degraded={"mlx5_0": SLOW}),
        on(IB_A, "a2"),
        on(IB_B, "b1"),
        on(IB_B, "b2"),
    ]
    res = place(two_nodes(), nodes)
    assert names(res) == ["b1", "b2"]
    assert f"in fabric rail ({IB_B})" in res.explanation


def test_an_nvlink_domain_still_comes_before_a_fabric_under_one_leaf():
    nodes = [under(LEAF_1, f"g{i}", nvlink_domain="c1/0" if i >= 2 else None) for i in range(4)]
    res = place(two_nodes(), nodes)
    assert names(res) == ["g2", "g3"] and res.nvlink_domain == "c1/0"


# ------------------------------------------------------------ over a fleet


def fabric_fleet(n: int, seed: int = 3) -> list[NodeView]:
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        physical = rnd.choice(
            [{}, {"rail": frozenset({IB_A})}, {"rail": frozenset({IB_B})}, {"rail": frozenset({IB_A, IB_B})}]
        )
        out.append(
            view(
                f"node-{i}",
                physical=physical,
                leaves={"mlx5_0": (rnd.choice([LEAF_1, LEAF_2, LEAF_3]),)} if rnd.random() < 0.8 else {},
                degraded={"mlx5_0": SLOW} if rnd.random() < 0.2 else {},
            )
        )
    rnd.shuffle(out)
    return out


def test_placements_over_a_fleet_with_fabric_facts_are_deterministic_and_stay_on_one_physical_fabric():
    nodes = fabric_fleet(60)
    reqs = [PlacementRequest(model=f"m{i}", engine="vllm", gpu_class="h100-80g", tp=8, nodes=2) for i in range(20)]
    a, _ = place_all(reqs, nodes)
    b, _ = place_all(reqs, list(reversed(nodes)))
    assert [(r.ok, getattr(r, "nodes", None), r.explanation) for r in a] == [
        (r.ok, getattr(r, "nodes", None), r.explanation) for r in b
    ]
    by_id = {v.node_id: v for v in nodes}
    placed = [r for r in a if isinstance(r, Placement)]
    assert len(placed) >= 10
    for r in placed:
        identities = {by_id[nid].fabric_facts.physical.get("rail", frozenset()) for nid, _ in r.nodes}
        assert len(identities) == 1 and len(next(iter(identities))) <= 1
