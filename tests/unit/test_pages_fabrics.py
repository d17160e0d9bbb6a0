"""The Fabrics (/admin/fabrics) and NVLink (/admin/nvlink) pages against a real in-process control plane,
its agents fakes on the real agent stream (tests/unit/fabric_agents.py): the fabric identity comes from
doctor's subnet-manager fixtures read by the agent's collector, the map from the control plane's own scan
answered with an ibnetdiscover fixture, racks from GB200 inventories read from `nvidia-smi -q`. What each
page shows, the drawing's marks, finding a node, a failed scan, refreshing in place, the guards, and a
layout that stays readable at a few hundred adapters."""

from __future__ import annotations

import contextlib
import itertools
import re
from collections.abc import AsyncIterator

import httpx
import pytest
from markupsafe import escape

from llmgw.config.server import parse_server_config
from llmgw.protocol import IMEX
from llmgw.server.app import Server
from llmgw.server.control import fabric_map
from llmgw.server.pages.admin_fabrics import MIN_FONT, draw
from llmgw.testing.waiting import async_until
from tests.unit.fabric_agents import (
    DEGRADED,
    FABRIC,
    FAT_TREE,
    FIX,
    MASTER,
    RACK,
    SMINFO_FAILED_OVER,
    SMIR_FAILED_OVER,
    SMIR_MASTER_ONLY,
    STANDBY,
    FabricAgent,
    control_config,
    gb200_tray,
    hgx_gpus,
    ib_adapters,
    rail_fat_tree,
)
from tests.unit.test_pages import PASSWORD, active_person, base, sign_in

ADMIN = "root@example.com"


class Plane:
    """A control plane in process and the agents that joined it."""

    def __init__(self, srv: Server) -> None:
        self.srv = srv
        self.agents: list[FabricAgent] = []

    async def join(self, node_id: str, **kw) -> FabricAgent:
        agent = await FabricAgent(f"http://127.0.0.1:{self.srv.config.agent_listen.port}", node_id, **kw).start()
        self.agents.append(agent)
        return agent


@contextlib.asynccontextmanager
async def control_plane(tmp_path, control: bool = True) -> AsyncIterator[Plane]:
    srv = Server(parse_server_config(control_config(tmp_path, control=control)))
    await srv.start()
    plane = Plane(srv)
    try:
        yield plane
    finally:
        for a in plane.agents:
            await a.stop()
        await srv.stop()


@contextlib.asynccontextmanager
async def admin(srv: Server) -> AsyncIterator[httpx.AsyncClient]:
    await srv.store.create_user(ADMIN, PASSWORD, admin=True)
    async with httpx.AsyncClient(base_url=base(srv)) as http:
        assert (await sign_in(http, ADMIN)).status_code == 303
        yield http


async def mapped(http: httpx.AsyncClient, what: str, path: str = "/admin/fabrics") -> str:
    """The page once it shows ``what`` (the scan is the control plane's own, every half second here)."""

    async def page() -> str | None:
        text = (await http.get(path)).text
        return text if what in text else None

    return await async_until(page, 20, f"{path} to show {what!r}")


def shown(text: str) -> str:
    """A sentence as the page carries it: escaped."""
    return str(escape(text))


def svg_of(page: str) -> str:
    return re.search(r'<svg class="fabric-map.*?</svg>', page, re.S).group(0)


def count(svg: str, cls: str) -> int:
    """Marks whose class list starts with ``cls`` (switches ``sw``, adapters ``ad``, cables ``cable``)."""
    return len(re.findall(rf'class="{cls}[ "]', svg))


@pytest.fixture
async def fat_tree(tmp_path):
    """node-a scans (the fat tree; agents[0]); gpu-c is llmgw's name for the map's node-c."""
    async with control_plane(tmp_path) as plane:
        await plane.join("node-a", adapters=ib_adapters("node-a"), scan=FAT_TREE)
        await plane.join("gpu-c", adapters=ib_adapters("node-c"))
        yield plane


# -- fabrics ------------------------------------------------------------------------------------


async def test_the_fabrics_page_lists_the_fabric_with_its_master_and_standby_and_draws_the_fat_tree(fat_tree):
    srv = fat_tree.srv
    async with admin(srv) as http:
        page = await mapped(http, 'class="fabric-map')
    # The physical fabric, named by its lowest SM GUID, declared as "rail", with the master and its standby.
    assert FABRIC in page and "declared as rail" in page
    assert f'<code>{MASTER}</code> <span class="muted">(lid 1, priority 15, master)' in page
    assert f'<code>{STANDBY}</code> <span class="muted">(lid 2, priority 14, standby)' in page
    assert '8 <span class="muted">on 2 nodes' in page  # four ports each on node-a and gpu-c
    assert "6 switches, 32 adapters, 64 cables" in page and "rail-aligned" in page
    assert "by <code>ibnetdiscover</code> on node-a through mlx5_0" in page
    svg = svg_of(page)
    # Every switch, adapter and cable of the fixture is a mark: two spines, four leaves, 32 + 32 cables.
    assert count(svg, "sw") == 6 and count(svg, "ad") == 32 and count(svg, "cable") == 64
    assert svg.count("sw tier-spine") == 2 and svg.count("sw tier-leaf") == 4
    assert "degraded" not in svg and "port-down" not in svg
    # One rate, in the legend; the tiers named; every node labelled, the llmgw ones linking to their page.
    assert "400 Gb/s" in page and "4xNDR, 64 cables" in page and "degraded: trained below" in page
    assert ">spine</text>" in svg and ">leaf</text>" in svg and ">adapters</text>" in svg
    for host in "abcdefgh":
        assert f">node-{host}</text>" in svg
    assert '<a href="/admin/nodes/node-a"><text class="node-label" data-node="node-a"' in svg
    assert '<a href="/admin/nodes/gpu-c"><text class="node-label" data-node="node-c" data-llmgw="gpu-c"' in svg
    # Rails: mlx5_N of every node on ib-leaf-0N+1.
    assert "rail 2 (mlx5_2)" in page and "on ib-leaf-03, 8 nodes" in page
    # Refreshing in place every fifteen seconds (paused while hidden by admin.js), and without script.
    assert 'hx-get="/admin/fabrics"' in page and 'hx-trigger="every 15s, refresh"' in page and "data-refresh" in page
    assert '<noscript><meta http-equiv="refresh"' in page and "/static/fabrics." in page and "/static/admin." in page
    # No inline script or style: the CSP stands.
    assert "<script>" not in page and "style=" not in page


async def test_each_problem_is_shown_under_its_fabric_with_what_to_do(tmp_path):
    async with control_plane(tmp_path) as plane:
        # No standby subnet manager, and mlx5_3 up but in no fabric of agent.yaml.
        agent = await plane.join(
            "node-a", adapters=ib_adapters("node-a"), declared=["mlx5_0", "mlx5_1", "mlx5_2"], scan=FAT_TREE
        )
        agent.smir = SMIR_MASTER_ONLY
        async with admin(plane.srv) as http:

            async def every_problem_shown():
                page = (await http.get("/admin/fabrics")).text
                problems = plane.srv.fabrics.reply().problems
                kinds = {p.kind for p in problems}
                if {"no_standby", "undeclared_adapter"} <= kinds and all(shown(p.fix) in page for p in problems):
                    return page, problems
                return None

            page, problems = await async_until(every_problem_shown, 20, "both problems on the page")
    assert '<span class="bad">none</span>' in page  # the Standbys column
    for p in problems:
        assert shown(p.message) in page and f"What to do: {shown(p.fix)}" in page
        assert f'<span class="tag {"tag-bad" if p.level == "fail" else "tag-warn"}">{p.level}</span>' in page


async def test_a_master_change_is_listed_with_when_and_both_guids_and_the_fabric_keeps_its_name(fat_tree):
    srv = fat_tree.srv
    async with admin(srv) as http:
        await mapped(http, 'class="fabric-map')
        for agent in fat_tree.agents:
            agent.sminfo, agent.smir = SMINFO_FAILED_OVER, SMIR_FAILED_OVER
        page = await mapped(http, "<summary>1</summary>")
    assert f"<code>{MASTER}</code> → <code>{STANDBY}</code>" in page
    assert f'<code>{STANDBY}</code> <span class="muted">(lid 2, priority 14, master)' in page
    assert FABRIC in page and "master_changed" not in page  # the kind is worded, not shown as a code
    (change,) = [p for p in srv.fabrics.reply().problems if p.kind == "master_changed"]
    assert shown(change.message) in page


async def test_a_degraded_cable_and_a_lost_uplink_are_marked_on_the_map_with_the_ports_left_empty(fat_tree):
    srv, scanner = fat_tree.srv, fat_tree.agents[0]
    scanner.scan = DEGRADED  # the next scan finds two cables trained low and one uplink gone
    async with admin(srv) as http:
        page = await mapped(http, "63 cables")
    svg = svg_of(page)
    assert count(svg, "cable") == 63
    degraded = re.findall(r'<line class="cable [^"]*degraded[^"]*"[^>]*><title>([^<]*)</title>', svg)
    assert len(degraded) == 2
    assert any("node-c mlx5_2 – ib-leaf-03 port 3" in t and "4xHDR, 200 Gb/s" in t for t in degraded)
    assert any("ib-leaf-02 port 38 – ib-spine-02 port 6" in t and "2xNDR" in t for t in degraded)
    # The dead uplink leaves a port empty at each end where every sibling has a cable.
    assert "ib-leaf-03 port 40: no cable, where every other leaf switch has one" in svg
    assert "ib-spine-02 port 12: no cable, where every other spine switch has one" in svg
    assert svg.count('class="port-down"') == 2
    # node-c's adapter is marked, the legend carries the second rate, the map's own findings are listed.
    assert re.search(r'class="ad [^"]*degraded[^"]*" id="ad-0xa088c20300135c30"', svg)
    assert "200 Gb/s" in page and "2xNDR, 4xHDR, 2 cables" in page
    assert "2 degraded" in page
    assert "leaf ib-leaf-03 has 7 uplinks where other leaf switches have 8" in page


async def test_finding_a_node_by_its_llmgw_name_or_its_host_name_marks_its_adapters_cables_and_leaves(fat_tree):
    srv = fat_tree.srv
    async with admin(srv) as http:
        await mapped(http, 'class="fabric-map')
        for asked in ("gpu-c", "NODE-C"):
            page = (await http.get("/admin/fabrics", params={"find": asked})).text
            svg = svg_of(page)
            assert 'class="fabric-map finding"' in svg
            found = re.findall(r'class="ad [^"]*found[^"]*" id="([^"]+)" data-node="([^"]+)" data-llmgw="([^"]*)"', svg)
            assert [(n, llmgw) for _, n, llmgw in found] == [("node-c", "gpu-c")] * 4
            assert len(re.findall(r'class="cable [^"]*found', svg)) == 4
            assert re.findall(r'<g class="sw tier-(\w+) found"', svg) == ["leaf"] * 4
            assert "4 adapters on this fabric" in page and "node-c mlx5_2 (rail 2)" in page
            assert 'llmgw node <a href="/admin/nodes/gpu-c">gpu-c</a>' in page
            assert 'value="' + asked + '"' in page and f"find={asked}" in page  # the refresh keeps asking for it
        missing = (await http.get("/admin/fabrics", params={"find": "node-z"})).text
        assert "No node named “node-z” has an adapter on this fabric." in missing
        assert 'class="fabric-map"' in missing


async def test_cables_are_coloured_by_rail_when_asked_and_the_choice_is_kept(fat_tree):
    srv = fat_tree.srv
    async with admin(srv) as http:
        await mapped(http, 'class="fabric-map')
        page = (await http.get("/admin/fabrics", params={"colour": "rail"})).text
    svg = svg_of(page)
    assert 'class="fabric-map by-rail"' in svg
    assert len(re.findall(r'class="cable rate-0 rail-3', svg)) == 8  # mlx5_3 of each of the eight nodes
    assert 'data-colour="rail" href="/admin/fabrics?colour=rail#map" aria-current="page"' in page
    assert 'hx-get="/admin/fabrics?colour=rail"' in page


async def test_a_failed_scan_says_why_and_when_and_keeps_the_map_before_it(fat_tree):
    srv, scanner = fat_tree.srv, fat_tree.agents[0]
    async with admin(srv) as http:
        await mapped(http, 'class="fabric-map')
        scanner.scan_error = "ibnetdiscover: iberror: failed: discover failed"
        page = await mapped(http, "The last scan failed")
    assert "node-a: ibnetdiscover: iberror: failed: discover failed" in page
    assert "The map below is the one before it." in page and count(svg_of(page), "cable") == 64
    assert "the last scan failed" in page  # in the fabrics table too


async def test_a_fabric_whose_first_scan_fails_says_so_and_draws_nothing(tmp_path):
    async with control_plane(tmp_path) as plane:
        srv = plane.srv
        scanner = await plane.join("node-a", adapters=ib_adapters("node-a"), scan=FAT_TREE)
        scanner.scan_error = "ibnetdiscover is not installed: install infiniband-diags"
        async with admin(srv) as http:
            page = await mapped(http, "The last scan failed")
        assert "install infiniband-diags" in page and "not mapped yet" in page
        assert "fabric-map" not in page and "The map below" not in page


async def test_htmx_gets_only_the_part_of_the_fabrics_page_that_refreshes(fat_tree):
    srv = fat_tree.srv
    async with admin(srv) as http:
        await mapped(http, 'class="fabric-map')
        r = await http.get("/admin/fabrics", params={"find": "node-b"}, headers={"HX-Request": "true"})
    assert r.status_code == 200 and "<html" not in r.text and "<nav" not in r.text.split('id="fabrics"')[0]
    assert r.text.lstrip().startswith('<div id="fabrics"') and 'class="fabric-map finding"' in r.text
    # The tools and the detail panel are kept by htmx across the swap.
    assert 'id="fabric-tools" hx-preserve="true"' in r.text and 'id="fabric-detail"' in r.text


async def test_an_unknown_fabric_is_a_404_naming_the_known_ones(fat_tree):
    srv = fat_tree.srv
    async with admin(srv) as http:
        await mapped(http, 'class="fabric-map')
        r = await http.get("/admin/fabrics", params={"fabric": "ib:0x0000000000000001"})
    assert r.status_code == 404 and "No fabric ib:0x0000000000000001" in r.text and FABRIC in r.text


async def test_with_no_fabric_yet_the_page_says_so_and_the_cluster_page_links_both_pages(tmp_path):
    async with control_plane(tmp_path) as plane, admin(plane.srv) as http:
        page = (await http.get("/admin/fabrics")).text
        cluster = (await http.get("/admin")).text
    assert "No fabric yet" in page and "fabric-map" not in page
    assert 'href="/admin/fabrics">Fabrics</a>' in cluster and 'href="/admin/nvlink">NVLink racks</a>' in cluster


async def test_without_a_control_plane_both_pages_say_so(tmp_path):
    async with control_plane(tmp_path, control=False) as plane, admin(plane.srv) as http:
        fabrics = await http.get("/admin/fabrics")
        nvlink = await http.get("/admin/nvlink")
    assert fabrics.status_code == nvlink.status_code == 200
    assert "is not a control plane" in fabrics.text and "no fabric to show" in fabrics.text
    assert "is not a control plane" in nvlink.text and "no NVLink domain to show" in nvlink.text


async def test_a_person_who_is_not_an_administrator_is_refused_both_pages(tmp_path):
    async with control_plane(tmp_path) as plane:
        srv = plane.srv
        await active_person(srv)
        async with httpx.AsyncClient(base_url=base(srv)) as http:
            await sign_in(http, "ann@example.com")
            for path in ("/admin/fabrics", "/admin/nvlink"):
                r = await http.get(path)
                assert r.status_code == 403 and "for administrators" in r.text, path
        async with httpx.AsyncClient(base_url=base(srv), follow_redirects=False) as anonymous:
            r = await anonymous.get("/admin/fabrics")
            assert r.status_code == 303 and "/login?next=" in r.headers["location"]


async def test_names_the_fabric_reports_are_shown_escaped(tmp_path):
    # A node description is whatever rdma-ndd (or anyone with the adapter) wrote into it.
    evil = "node-<b>h</b>"
    async with control_plane(tmp_path) as plane:
        await plane.join("node-a", adapters=ib_adapters("node-a"), scan=FAT_TREE.replace("node-h", evil))
        async with admin(plane.srv) as http:
            page = await mapped(http, 'class="fabric-map')
            found = (await http.get("/admin/fabrics", params={"find": evil})).text
    assert "node-&lt;b&gt;h&lt;/b&gt;" in page and evil not in page
    assert "4 adapters on this fabric" in found and evil not in found


# -- the layout at scale ------------------------------------------------------------------------


def test_a_fabric_of_512_adapters_is_laid_out_without_overlaps_and_every_node_labelled():
    fmap = fabric_map.to_json(fabric_map.analyse(fabric_map.parse_ibnetdiscover(rail_fat_tree())))
    d = draw(fmap)
    assert (len(d.switches), len(d.adapters), len(d.cables)) == (48, 512, 1024)
    # Readable at first sight: no wider than a screen's few widths, and not a thin strip.
    assert d.width <= 3 * 1100 and 0.25 < d.height / d.width < 0.8
    # Adapters: each within the drawing, none on another, every node's together in rail order.
    marks = sorted(d.adapters, key=lambda a: a.x)
    assert marks[0].x >= 0 and marks[-1].x + marks[-1].w <= d.width
    assert all(a.x + a.w <= b.x for a, b in itertools.pairwise(marks))
    by_node: dict[str, list[int]] = {}
    for a in marks:
        by_node.setdefault(a.node, []).append(a.rail)
    assert len(by_node) == 64 and all(rails == list(range(8)) for rails in by_node.values())
    # The pods read left to right: gpu-001..016 under pod 1's leaves, and so on.
    assert [a.node for a in marks[:: 8 * 16]] == ["gpu-001", "gpu-017", "gpu-033", "gpu-049"]
    # Every node is labelled, written downwards where the name is wider than its adapters, labels apart.
    assert len(d.labels) == 64 and all(lbl.font >= MIN_FONT for lbl in d.labels)
    labels = sorted(d.labels, key=lambda lbl: lbl.x)
    assert all(b.x - a.x >= (a.font + b.font) / 2 for a, b in itertools.pairwise(labels))
    # Switches: each row's boxes side by side, spines above leaves, leaves above the adapters.
    for tier in ("spine", "leaf"):
        row = sorted((s for s in d.switches if s.tier == tier), key=lambda s: s.x)
        assert all(a.x + a.w < b.x for a, b in itertools.pairwise(row))
    spine_y = {s.y for s in d.switches if s.tier == "spine"}
    leaf_y = {s.y for s in d.switches if s.tier == "leaf"}
    assert len(spine_y) == len(leaf_y) == 1 and spine_y.pop() < leaf_y.pop() < marks[0].y
    # Cables leave their switch's edge facing the other end.
    for c in d.cables[:64]:
        assert c.y1 != c.y2 and min(c.y1, c.y2) >= 0 and max(c.y1, c.y2) <= d.height


def test_a_three_tier_fabric_puts_its_cores_on_top_and_its_aggregation_nodes_inside_their_switches():
    text = (FIX / "fabric" / "ibnetdiscover_three_tier.txt").read_text()
    d = draw(fabric_map.to_json(fabric_map.analyse(fabric_map.parse_ibnetdiscover(text))))
    ys = {t: {s.y for s in d.switches if s.tier == t} for t in ("core", "spine", "leaf")}
    assert all(len(v) == 1 for v in ys.values())
    assert min(ys["core"]) < min(ys["spine"]) < min(ys["leaf"])
    # The SHARP aggregation nodes are no hosts: not drawn as adapters, said on their switch.
    assert len(d.adapters) == 9 and all(a.kind == "hca" for a in d.adapters)
    assert all("SHARP aggregation node on port 41" in s.title for s in d.switches)
    assert len(d.cables) == 43 - 10
    # Each pod's spines sit above its own leaves.
    spines = [s.name for s in sorted((s for s in d.switches if s.tier == "spine"), key=lambda s: s.x)]
    assert spines[:2] == ["ib-pod1-spine-01", "ib-pod1-spine-02"]
    # The login node's adapter names no host: labelled by its description, linked to nothing.
    assert any(lbl.text.startswith("MT4123 ConnectX6") and lbl.href is None for lbl in d.labels)


# -- NVLink -------------------------------------------------------------------------------------


async def test_the_nvlink_page_draws_the_rack_with_its_trays_chips_and_what_keeps_a_tray_out(tmp_path):
    async with control_plane(tmp_path) as plane:
        for t in range(1, 5):
            imex = IMEX(state="inactive" if t == 3 else "active", channels=1)
            await plane.join(f"gb200-{t}", gpus=gb200_tray(t, as_captured=(t == 2)), imex=imex)
        async with admin(plane.srv) as http:
            page = await mapped(http, "gb200-4", "/admin/nvlink")
    assert f"Domain <code>{RACK}</code>" in page and "15 of 16 GPUs joined on 4 trays" in page
    assert "NVLink Switch" in page and "nv-backplane" in page and "bandwidth degraded" in page
    trays = re.findall(r'<li class="nv-tray nv-(\w+)">', page)
    assert trays == ["joined", "out", "held", "joined"]
    chips = re.findall(r'class="gpu-chip (\w+)" title="([^"]*)"', page)
    assert [c for c, _ in chips].count("joined") == 14 and [c for c, _ in chips].count("out") == 1
    assert [c for c, _ in chips].count("degraded") == 1
    assert any("GPU 2 (NVIDIA GB200)" in t and "state In Progress" in t for c, t in chips if c == "out")
    # What keeps each tray out, in words, under that tray.
    assert "GPU 2 has not joined the NVLink domain (state In Progress)" in page
    assert "bandwidth Degraded on GPU 3: check NVLink cables/trays" in page
    assert "nvidia-imex is inactive" in page and "systemctl start nvidia-imex" in page
    assert 'href="/admin/nodes/gb200-2"' in page and "clique 32766" in page
    assert 'hx-get="/admin/nvlink"' in page and 'hx-trigger="every 15s, refresh"' in page
    assert "style=" not in page


async def test_the_nvlink_page_says_there_is_no_multi_node_domain_and_lists_gpus_in_none(tmp_path):
    async with control_plane(tmp_path) as plane:
        await plane.join("hgx-1", gpus=hgx_gpus(), imex=None)  # one chassis's NVSwitch: no rack
        async with admin(plane.srv) as http:
            page = await mapped(http, "There is no multi-node NVLink domain", "/admin/nvlink")
            assert "GPUs in no rack" not in page and "nv-rack" not in page
            # A tray whose every card is still joining names no cluster: its GPUs are in no rack.
            joining = [g for g in gb200_tray(9, as_captured=True) if g.fabric and not g.fabric.cluster_uuid]
            await plane.join("lone-1", gpus=joining, imex=IMEX(state="active", channels=1))
            page = await mapped(http, "GPUs in no rack", "/admin/nvlink")
    assert "There is no multi-node NVLink domain" in page
    assert 'href="/admin/nodes/lone-1"' in page and "has not joined any NVLink domain" in page
