"""The administrator's Fabrics page (/admin/fabrics) and NVLink page (/admin/nvlink).

Fabrics lists every physical fabric the control plane knows (its declared names, kind,
master subnet manager, standbys, the last day's master changes, and each problem with
its fix), and draws one InfiniBand fabric's map (``?fabric=ID``; the first mapped one
otherwise): switch tiers as rows (core at the top, then spines, leaves, and the hosts'
adapters at the bottom grouped by node), every cable a line coloured by its rate,
degraded cables marked, switch ports without a cable shown, rails by colour on request
(``?colour=rail``) and a node found (``?find=NODE``). The drawing is inline SVG laid out
here, so it reads without script; ``static/fabrics.js`` only adds zoom and pan, hover,
the detail panel and finding without a reload.

NVLink draws each multi-node NVLink domain as a rack: the NVLink Switch band, the
backplane, and a tray per node whose GPU chips show joined, not joined or degraded, with
what keeps a tray out in words; GPUs in no rack are listed.

Both read the admin API's own methods (``fabrics``, ``fabric_topology``, ``nvlink``), so
they show what ``/api/v1/fabrics``, ``…/topology`` and ``/api/v1/nvlink`` answer, and both
refresh in place every fifteen seconds like the Cluster page (``static/admin.js`` pauses
it while the tab is hidden; without script a ``<noscript>`` refresh reloads them).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode

from aiohttp import web

from llmgw.protocol.admin import FabricProblemRow, FabricRow, FabricsReply
from llmgw.server.admin.api import AdminAPI, AdminRefused, NotControlPlane
from llmgw.server.control.fabric_map import natural_key
from llmgw.server.pages.admin_format import FMT, ago, clock
from llmgw.server.pages.site import Site

REFRESH_S = 15  # the spec's fifteen seconds: a map is rescanned every five minutes, problems move faster
NOSCRIPT_REFRESH_S = 30

# -- drawing a fabric's map ---------------------------------------------------------------------
#
# Everything is laid out in SVG units for a drawing shown about FIT_W pixels wide; a fabric
# whose adapters need more room gets a wider drawing, and every size but the adapters'
# pitch grows with it (``u``), so that at first sight text and boxes look alike whatever
# the fabric's size, and zooming in shows the detail.

FIT_W = 1100.0
MARGIN_L, MARGIN_R = 64.0, 16.0  # the tier names sit in the left margin
MIN_PITCH, MAX_PITCH = 2.0, 26.0  # an adapter's slot; below 2 units a mark stops reading as one
GROUP_GAP = 0.8  # between one node's adapters and the next node's, in pitches
MIN_SLOT = 14.0  # the least room a switch gets in its row
SWITCH_H = 34.0
SWITCH_GAP = 96.0  # between rows of switches
LEAF_GAP = 120.0  # between the leaves and the adapters: the densest bundle of cables
ADAPTER_H = 16.0
FONT = 11.0
LABEL_BAND = 110.0  # the most room under the adapters for node names written downwards
MIN_FONT = 0.6  # a label smaller than this is left out: it would not read even zoomed in
RATE_COLOURS = 6  # rates drawn in a colour of their own, fastest first; the rest grey
RAIL_COLOURS = 8

UNKNOWN, CORE, SPINE, LEAF = "unknown", "core", "spine", "leaf"
ROWS = (UNKNOWN, CORE, SPINE, LEAF)  # top to bottom
ROW_NAMES = {UNKNOWN: "no host", CORE: "core", SPINE: "spine", LEAF: "leaf"}


def _r(v: float) -> float:
    return round(v, 1)


def _gbps(v: float | None) -> str:
    return "rate not known" if v is None else f"{v:g} Gb/s"


@dataclass
class PortMark:
    x: float
    y: float
    w: float
    h: float
    title: str


@dataclass
class SwitchMark:
    id: str
    guid: str
    name: str
    tier: str
    x: float
    y: float
    w: float
    h: float
    font: float | None  # None: no room for the name (it is in the title and the panel)
    used: str  # an SVG path of the cells of cabled ports
    free: str  # and of ports without a cable
    down: list[PortMark]  # ports without a cable where every other switch of the tier has one
    title: str
    found: bool = False

    @property
    def cx(self) -> float:
        return _r(self.x + self.w / 2)

    @property
    def label_y(self) -> float:
        return _r(self.y + self.h * 0.45)


@dataclass
class AdapterMark:
    id: str
    guid: str
    node: str  # the map's host name ("" for an adapter that names none)
    llmgw: str  # the llmgw node it belongs to, when the control plane knows
    kind: str
    rail: int | None
    x: float
    y: float
    w: float
    h: float
    title: str
    degraded: bool = False
    found: bool = False


@dataclass
class CableMark:
    a: str  # element ids of its ends
    b: str
    cls: str
    title: str
    x1: float = 0.0
    y1: float = 0.0
    x2: float = 0.0
    y2: float = 0.0
    d: str = ""  # a curve, for a cable between two marks of one row
    degraded: bool = False
    found: bool = False


@dataclass
class NodeLabel:
    node: str
    llmgw: str
    text: str
    x: float
    y: float
    font: float
    rotated: bool
    href: str | None
    found: bool = False


@dataclass
class RowLabel:
    text: str
    y: float


@dataclass
class RateKey:
    cls: str
    words: str  # "400 Gb/s"
    labels: str  # "4xNDR"
    cables: int


@dataclass
class RailKey:
    cls: str
    index: int
    device: str | None
    leaves: str
    nodes: int


@dataclass
class Found:
    """What ``?find=`` matched: a node's adapters and where each is cabled."""

    node: str
    llmgw: str
    lines: list[str]


@dataclass
class Drawing:
    width: float
    height: float
    u: float
    font: float
    switches: list[SwitchMark]
    adapters: list[AdapterMark]
    cables: list[CableMark]
    labels: list[NodeLabel]
    rows: list[RowLabel]
    rates: list[RateKey]
    rails: list[RailKey]
    nodes: list[str]  # what the find box suggests: map host names and llmgw node ids
    by_rail: bool = False
    find: str = ""
    found: Found | None = None

    @property
    def view_box(self) -> str:
        return f"0 0 {_r(self.width)} {_r(self.height)}"

    @property
    def classes(self) -> str:
        return " ".join(
            c for c in ("fabric-map", "by-rail" if self.by_rail else "", "finding" if self.found else "") if c
        )


def _port_cells(x: float, w: float, y: float, h: float, ports: Iterable[int], count: int) -> str:
    cw = w / max(count, 1)
    return " ".join(
        f"M{_r(x + (p - 1) * cw + cw * 0.15)} {_r(y)}h{_r(cw * 0.7)}v{_r(h)}h{_r(-cw * 0.7)}z" for p in ports
    )


def _suspect_ports(switches: Iterable[dict[str, Any]], cabled: Mapping[str, set[int]]) -> dict[str, list[int]]:
    """Ports without a cable that every other switch of the same tier and size has cabled: a
    cable lost, not a port never used (ibnetdiscover's output tells the two apart in neither)."""
    by_tier: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for s in switches:
        by_tier[(s["tier"], s["ports"])].append(s)
    out: dict[str, list[int]] = {}
    for members in by_tier.values():
        if len(members) < 2:
            continue
        for s in members:
            others = [cabled[o["guid"]] for o in members if o is not s]
            out[s["guid"]] = [p for p in s["down_ports"] if all(p in o for o in others)]
    return out


def _mean(values: list[int]) -> float:
    return sum(values) / len(values) if values else float("inf")


class _Layout:
    """One map laid out: the rows ordered, every mark placed, then the cables between them."""

    def __init__(self, fmap: Mapping[str, Any], llmgw_nodes: Mapping[str, str]) -> None:
        self.fmap = fmap
        self.llmgw_nodes = llmgw_nodes
        switches: list[dict[str, Any]] = list(fmap.get("switches") or ())
        self.sw_by = {s["guid"]: s for s in switches}
        adapters: list[dict[str, Any]] = list(fmap.get("adapters") or ())
        self.ad_by = {a["guid"]: a for a in adapters}
        # A SHARP aggregation node is a CA inside its switch: said on the switch, not drawn as a host.
        self.adapters = [a for a in adapters if a["kind"] != "aggregation"]
        self.inside: dict[str, list[str]] = defaultdict(list)
        self.cables: list[dict[str, Any]] = []
        self.cabled: dict[str, set[int]] = defaultdict(set)
        for c in fmap.get("cables") or ():
            self.cabled[c["a"]["guid"]].add(c["a"]["port"])
            self.cabled[c["b"]["guid"]].add(c["b"]["port"])
            if c["kind"] == "internal":
                self.inside[c["b"]["guid"]].append(f"its SHARP aggregation node on port {c['b']['port']}")
            else:
                self.cables.append(c)
        self.suspect = _suspect_ports(switches, self.cabled)
        self.cables_of: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for c in self.cables:
            self.cables_of[c["a"]["guid"]].append(c)
            self.cables_of[c["b"]["guid"]].append(c)
        self.rows = self._rows(switches)
        self.groups = self._groups()
        self.switch_marks: dict[str, SwitchMark] = {}
        self.adapter_marks: dict[str, AdapterMark] = {}
        self.labels: list[NodeLabel] = []
        self.row_labels: list[RowLabel] = []

    # -- order ----------------------------------------------------------------------------------

    def _rows(self, switches: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
        """Switches by tier, ordered so that cables cross as little as a simple rule allows: leaves by
        name (as to_json has them), each row above by the middle of where its cables come from below."""
        rows: dict[str, list[dict[str, Any]]] = {t: [] for t in ROWS}
        for s in switches:
            rows[s["tier"] if s["tier"] in rows else UNKNOWN].append(s)
        neighbours: dict[str, set[str]] = defaultdict(set)
        for c in self.cables:
            if c["a"]["guid"] in self.sw_by and c["b"]["guid"] in self.sw_by:
                neighbours[c["a"]["guid"]].add(c["b"]["guid"])
                neighbours[c["b"]["guid"]].add(c["a"]["guid"])
        below = {s["guid"]: i for i, s in enumerate(rows[LEAF])}
        for tier in (SPINE, CORE):
            keyed = [
                ((_mean([below[g] for g in neighbours[s["guid"]] if g in below]), natural_key(s["name"])), s)
                for s in rows[tier]
            ]
            rows[tier] = [s for _, s in sorted(keyed, key=lambda k: k[0])]
            below = {s["guid"]: i for i, s in enumerate(rows[tier])}
        rows[UNKNOWN].sort(key=lambda s: natural_key(s["name"]))
        return {t: rows[t] for t in ROWS if rows[t]}

    def _groups(self) -> list[tuple[str, list[dict[str, Any]]]]:
        """The adapters by node (an adapter naming no host alone), each node under the middle of the
        leaves it is cabled to, so a pod's nodes sit under the pod's leaves."""
        leaf_at = {s["guid"]: i for i, s in enumerate(self.rows.get(LEAF, ()))}
        groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for a in self.adapters:
            groups[a["node"] or f"\x00{a['guid']}"].append(a)

        def key(item: tuple[str, list[dict[str, Any]]]) -> tuple[Any, ...]:
            name, members = item
            at = [leaf_at[g] for a in members for g in a.get("leaves") or () if g in leaf_at]
            return (_mean(at), name.startswith("\x00"), natural_key(name))

        return sorted(groups.items(), key=key)

    # -- words ----------------------------------------------------------------------------------

    def end_name(self, guid: str, port: int) -> str:
        if guid in self.sw_by:
            return f"{self.sw_by[guid]['name']} port {port}"
        a = self.ad_by.get(guid)
        if a is None:
            return guid
        label = f"{a['node']} {a['device']}" if a["node"] else a["description"]
        return label if a["ports"] == 1 else f"{label} port {port}"

    def switch_title(self, s: dict[str, Any], tier: str, lost: list[int]) -> str:
        used, free = self.cabled[s["guid"]], s["down_ports"]
        what = "switch no host adapter reaches" if tier == UNKNOWN else f"{tier} switch"
        lines = [
            f"{s['name']} ({what})",
            f"GUID {s['guid']}, LID {s['lid']}",
            f"{s['ports']} ports: {len(used)} cabled, {len(free)} without a cable",
        ]
        if lost:
            lines.append(
                f"port{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} without a cable where every "
                f"other {tier} switch has one: a cable unplugged or down"
            )
        lines += self.inside.get(s["guid"], ())
        if s["description"] != s["name"]:
            lines.append(s["description"])
        return "\n".join(lines)

    def adapter_title(self, a: dict[str, Any]) -> str:
        rail = a.get("rail")
        head = f"{a['node']} {a['device']}" if a["node"] else a["description"]
        lines = [head + (f" (rail {rail})" if rail is not None else "")]
        if self.llmgw_nodes.get(a["guid"], a["node"]) != a["node"]:
            lines.append(f"llmgw node {self.llmgw_nodes[a['guid']]}")
        if a["kind"] == "router":
            lines.append("an InfiniBand router")
        elif not a["node"]:
            lines.append(f'"{a["description"]}" names no host (is rdma-ndd running there?)')
        lines.append(f"GUID {a['guid']}")
        for c in self.cables_of[a["guid"]]:
            own, other = (c["a"], c["b"]) if c["a"]["guid"] == a["guid"] else (c["b"], c["a"])
            lines.append(
                f"port {own['port']} → {self.end_name(other['guid'], other['port'])}, "
                f"{c['width']}{c['speed']} ({_gbps(c['rate_gbps'])})"
            )
        if not self.cables_of[a["guid"]]:
            lines.append("no cable")
        lines += [f"degraded: {c.get('reason') or 'degraded'}" for c in self.cables_of[a["guid"]] if c["degraded"]]
        return "\n".join(lines)

    def cable_title(self, c: dict[str, Any]) -> str:
        lines = [
            f"{self.end_name(c['a']['guid'], c['a']['port'])} – {self.end_name(c['b']['guid'], c['b']['port'])}",
            f"{c['width']}{c['speed']}, {_gbps(c['rate_gbps'])} ({c['kind']} cable)",
        ]
        if c["degraded"]:
            lines.append(f"degraded: {c.get('reason') or 'trained below others of its kind'}")
        return "\n".join(lines)

    # -- places ---------------------------------------------------------------------------------

    def place(self) -> None:
        """Sizes from the adapters' row: their slot shrinks to MIN_PITCH before the drawing widens,
        and then everything but that slot grows with the width (``u``)."""
        n_ad, n_groups = len(self.adapters), len(self.groups)
        avail = FIT_W - MARGIN_L - MARGIN_R
        content = n_ad + GROUP_GAP * max(0, n_groups - 1)
        self.pitch = min(MAX_PITCH, max(MIN_PITCH, avail / content)) if content else MAX_PITCH
        self.row_w = content * self.pitch
        widest = max((len(r) for r in self.rows.values()), default=0)
        u = self.u = max(1.0, self.row_w / avail, widest * MIN_SLOT / avail)
        self.width = FIT_W * u
        self.x0, self.inner = MARGIN_L * u, avail * u
        self.font = FONT * u
        y = 12.0 * u
        tiers = list(self.rows)
        for i, t in enumerate(tiers):
            self._place_row(t, y)
            y += (SWITCH_H + (LEAF_GAP if t == LEAF or i == len(tiers) - 1 else SWITCH_GAP)) * u
        ad_y = y if n_ad else y - (LEAF_GAP - 20) * u
        band = self._place_adapters(ad_y)
        if n_ad:
            self.row_labels.append(RowLabel("adapters", _r(ad_y + ADAPTER_H * u / 2)))
        self.height = ad_y + (ADAPTER_H + 6) * u + band + 10 * u

    def _place_row(self, tier: str, y: float) -> None:
        u, members = self.u, self.rows[tier]
        slot = self.inner / len(members)
        w, h = min(slot * 0.86, 170.0 * u), SWITCH_H * u
        self.row_labels.append(RowLabel(ROW_NAMES[tier], _r(y + h / 2)))
        strip_y, strip_h = y + h - 9 * u, 6 * u  # the ports, a cell each, along the bottom
        for i, s in enumerate(members):
            x = self.x0 + i * slot + (slot - w) / 2
            fs = min(self.font, (w - 4 * u) / (0.6 * max(len(s["name"]), 1)))
            count = s["ports"]
            cw = w / max(count, 1)
            lost = self.suspect.get(s["guid"], [])
            self.switch_marks[s["guid"]] = SwitchMark(
                id=f"sw-{s['guid']}",
                guid=s["guid"],
                name=s["name"],
                tier=tier,
                x=_r(x),
                y=_r(y),
                w=_r(w),
                h=_r(h),
                font=_r(fs) if fs >= MIN_FONT else None,
                used=_port_cells(x, w, strip_y, strip_h, sorted(self.cabled[s["guid"]]), count),
                free=_port_cells(x, w, strip_y, strip_h, s["down_ports"], count),
                down=[
                    PortMark(
                        _r(x + (p - 1) * cw),
                        _r(strip_y - 1.5 * u),
                        _r(max(cw, 1.5 * u)),
                        _r(strip_h + 3 * u),
                        f"{s['name']} port {p}: no cable, where every other {tier} switch has one",
                    )
                    for p in lost
                ],
                title=self.switch_title(s, tier, lost),
            )

    def _place_adapters(self, y: float) -> float:
        """Every adapter a mark in its node's group, each group labelled under it; the labels' height."""
        u, pitch = self.u, self.pitch
        cursor = self.x0 + (self.inner - self.row_w) / 2
        aw, ah = pitch * 0.72, ADAPTER_H * u
        label_y = y + ah + 6 * u
        band = 14.0 * u
        for gi, (key, members) in enumerate(self.groups):
            if gi:
                cursor += GROUP_GAP * pitch
            start = cursor
            node = "" if key.startswith("\x00") else key
            llmgw = min((self.llmgw_nodes[a["guid"]] for a in members if a["guid"] in self.llmgw_nodes), default="")
            for a in members:
                self.adapter_marks[a["guid"]] = AdapterMark(
                    id=f"ad-{a['guid']}",
                    guid=a["guid"],
                    node=node,
                    llmgw=self.llmgw_nodes.get(a["guid"], ""),
                    kind=a["kind"],
                    rail=a.get("rail"),
                    x=_r(cursor + (pitch - aw) / 2),
                    y=_r(y),
                    w=_r(aw),
                    h=_r(ah),
                    title=self.adapter_title(a),
                    degraded=any(c["degraded"] for c in self.cables_of[a["guid"]]),
                )
                cursor += pitch
            gw = cursor - start
            # Across when the name fits its adapters, else downwards; the font shrinks to the room.
            text = node or members[0]["description"][:24]
            length = 0.6 * max(len(text), 1)
            fs = min(self.font, (gw + GROUP_GAP * pitch * 0.8) / length)
            rotated = fs < 7 * u
            if rotated:
                fs = min(self.font, gw * 0.9, LABEL_BAND * u / length)
                band = max(band, length * fs + 6 * u)
            if fs >= MIN_FONT:
                self.labels.append(
                    NodeLabel(
                        node=node,
                        llmgw=llmgw,
                        text=text,
                        x=_r(start + gw / 2),
                        y=_r(label_y),
                        font=_r(fs),
                        rotated=rotated,
                        href=FMT.node_href(llmgw) if llmgw else None,
                    )
                )
        return band

    # -- cables ---------------------------------------------------------------------------------

    def _mark(self, guid: str) -> SwitchMark | AdapterMark | None:
        return self.switch_marks.get(guid) or self.adapter_marks.get(guid)

    def cable_marks(self, rate_cls: Mapping[float | None, str]) -> list[CableMark]:
        """Lines between the marks. A switch's cables leave its top edge for the row above and its
        bottom edge for the rows below (and its own), spread along the edge in the order of their
        other ends: the bundles then cross only where the fabric itself crosses."""
        present = [c for c in self.cables if self._mark(c["a"]["guid"]) and self._mark(c["b"]["guid"])]

        def centre(guid: str) -> tuple[float, float]:
            m = self._mark(guid)
            assert m is not None
            return m.x + m.w / 2, m.y + m.h / 2

        edges: dict[tuple[str, bool], list[tuple[float, int, int, str]]] = defaultdict(list)
        for i, c in enumerate(present):
            for end, other in (("a", "b"), ("b", "a")):
                g = c[end]["guid"]
                if g in self.switch_marks:
                    ox, oy = centre(c[other]["guid"])
                    edges[(g, oy < centre(g)[1] - 1e-6)].append((ox, c[end]["port"], i, end))
        placed: dict[tuple[int, str], tuple[float, float]] = {}
        for (g, top), ends in edges.items():
            box = self.switch_marks[g]
            for k, (_, _, i, end) in enumerate(sorted(ends)):
                placed[(i, end)] = (box.x + (k + 0.5) / len(ends) * box.w, box.y if top else box.y + box.h)

        out = []
        for i, c in enumerate(present):
            ga, gb = c["a"]["guid"], c["b"]["guid"]
            ma, mb = self._mark(ga), self._mark(gb)
            assert ma is not None and mb is not None
            x1, y1 = placed.get((i, "a"), (ma.x + ma.w / 2, ma.y))  # an adapter: the middle of its top
            x2, y2 = placed.get((i, "b"), (mb.x + mb.w / 2, mb.y))
            rail = self.adapter_marks[ga].rail if ga in self.adapter_marks else None
            cls = ["cable", rate_cls.get(c["rate_gbps"], "rate-unknown")]
            cls += [f"rail-{rail % RAIL_COLOURS}"] if rail is not None else []
            cls += ["degraded"] if c["degraded"] else []
            mark = CableMark(
                a=ma.id, b=mb.id, cls=" ".join(cls), title=self.cable_title(c), degraded=bool(c["degraded"])
            )
            if abs(centre(ga)[1] - centre(gb)[1]) < 1e-6:
                # Two switches of one row (bending below it), or two adapters cabled together (above).
                y_mid = min(y1, y2) - 60 * self.u if ga in self.adapter_marks else max(y1, y2) + 50 * self.u
                mark.d = f"M{_r(x1)} {_r(y1)}Q{_r((x1 + x2) / 2)} {_r(y_mid)} {_r(x2)} {_r(y2)}"
            else:
                mark.x1, mark.y1, mark.x2, mark.y2 = _r(x1), _r(y1), _r(x2), _r(y2)
            out.append(mark)
        out.sort(key=lambda m: m.degraded)  # degraded cables last: nothing is drawn over them
        return out

    # -- the whole ------------------------------------------------------------------------------

    def drawing(self, by_rail: bool) -> Drawing:
        self.place()
        # Rates coloured fastest first, so the commonest fabric reads alike everywhere.
        rates = sorted({c["rate_gbps"] for c in self.cables if c["rate_gbps"] is not None}, reverse=True)
        rate_cls: dict[float | None, str] = {
            r: f"rate-{i}" if i < RATE_COLOURS else "rate-other" for i, r in enumerate(rates)
        }
        labels: dict[float | None, Counter[str]] = defaultdict(Counter)
        for c in self.cables:
            labels[c["rate_gbps"]][c["width"] + c["speed"]] += 1
        keys = [*rates, *([None] if None in labels else [])]
        return Drawing(
            width=self.width,
            height=self.height,
            u=self.u,
            font=_r(self.font),
            switches=[self.switch_marks[s["guid"]] for row in self.rows.values() for s in row],
            adapters=list(self.adapter_marks.values()),
            cables=self.cable_marks(rate_cls),
            labels=self.labels,
            rows=self.row_labels,
            rates=[
                RateKey(
                    rate_cls.get(r, "rate-unknown"),
                    _gbps(r),
                    ", ".join(sorted(labels[r])),
                    sum(labels[r].values()),
                )
                for r in keys
            ],
            rails=[
                RailKey(
                    f"rail-{r['index'] % RAIL_COLOURS}",
                    r["index"],
                    r.get("device"),
                    ", ".join(self.sw_by[g]["name"] if g in self.sw_by else g for g in r.get("leaves") or ()),
                    len(r.get("nodes") or ()),
                )
                for r in self.fmap.get("rails") or ()
            ],
            nodes=sorted(
                {a.node for a in self.adapter_marks.values() if a.node} | set(self.llmgw_nodes.values()),
                key=natural_key,
            ),
            by_rail=by_rail,
        )


def draw(
    fmap: Mapping[str, Any],
    llmgw_nodes: Mapping[str, str] | None = None,
    *,
    find: str = "",
    by_rail: bool = False,
) -> Drawing:
    """The map of ``fabric_map.to_json`` laid out as SVG marks (see the notes above FIT_W); ``find``
    marks a node found, ``by_rail`` colours the cables by rail."""
    d = _Layout(fmap, llmgw_nodes or {}).drawing(by_rail)
    d.find = find.strip()
    if d.find:
        d.found = _find(d, d.find)
    return d


def _find(d: Drawing, asked: str) -> Found | None:
    """Marks a node's adapters, their cables and the switches at the other ends as found: by the
    map's host name or the llmgw node id, whatever the case."""
    want = asked.casefold()
    hit = [a for a in d.adapters if a.node.casefold() == want or (a.llmgw and a.llmgw.casefold() == want)]
    if not hit:
        return None
    ids = {a.id for a in hit}
    for a in hit:
        a.found = True
    ends: set[str] = set()
    for c in d.cables:
        if c.a in ids or c.b in ids:
            c.found = True
            ends.update((c.a, c.b))
    for s in d.switches:
        s.found = s.id in ends
    for lbl in d.labels:
        lbl.found = lbl.node == hit[0].node
    return Found(node=hit[0].node, llmgw=hit[0].llmgw, lines=[a.title.replace("\n", "; ") for a in hit])


# -- the fabrics list -------------------------------------------------------------------------


@dataclass
class FabricLine:
    row: FabricRow
    problems: list[FabricProblemRow] = field(default_factory=list)

    @property
    def standbys(self) -> list[Any]:
        master = self.row.master.guid if self.row.master else None
        return [m for m in self.row.managers if m.state == "standby" and m.guid != master]

    @property
    def nodes(self) -> int:
        return len({m.node for m in self.row.members})

    @property
    def infiniband(self) -> bool:
        return self.row.kind == "infiniband"


def fabric_lines(reply: FabricsReply) -> tuple[list[FabricLine], list[FabricProblemRow]]:
    """Each fabric with its own problems (failures first), and the problems tied to no one fabric."""
    lines = [FabricLine(f) for f in reply.fabrics]
    by_id = {f.row.id: f for f in lines}
    loose = []
    for p in sorted(reply.problems, key=lambda p: p.level != "fail"):
        if p.fabric is not None and p.fabric in by_id:
            by_id[p.fabric].problems.append(p)
        else:
            loose.append(p)
    return lines, loose


def chosen_fabric(lines: list[FabricLine], asked: str | None) -> FabricLine | None:
    """The fabric whose map is drawn: the one asked for, else the first InfiniBand fabric with a map,
    else the first InfiniBand fabric."""
    if asked:
        return next((f for f in lines if f.row.id == asked), None)
    ib = [f for f in lines if f.infiniband]
    mapped = [f for f in ib if f.row.map is not None and f.row.map.switches is not None]
    first = mapped or ib
    return first[0] if first else None


# -- the pages ----------------------------------------------------------------------------------


class FabricPages:
    """/admin/fabrics and /admin/nvlink, through the Cluster page's AdminAPI."""

    def __init__(self, site: Site, api: AdminAPI) -> None:
        self.site = site
        self.api = api

    def add_routes(self) -> None:
        self.site.route("GET", "/admin/fabrics", "admin", self.fabrics)
        self.site.route("GET", "/admin/nvlink", "admin", self.nvlink)

    async def fabrics(self, request: web.Request) -> web.StreamResponse:
        asked = request.query.get("fabric") or None
        find = (request.query.get("find") or "").strip()[:200]
        by_rail = request.query.get("colour") == "rail"
        live = request.headers.get("HX-Request") == "true"
        template = "admin_fabrics_live.html" if live else "admin_fabrics.html"
        common: dict[str, Any] = dict(
            fmt=FMT, ago=ago, clock=clock, refresh_s=REFRESH_S, noscript_refresh_s=NOSCRIPT_REFRESH_S
        )
        try:
            reply = await self.api.fabrics()
        except NotControlPlane:
            return self.site.render.page(request, template, control=False, here_url="/admin/fabrics", **common)
        lines, loose = fabric_lines(reply)
        chosen = chosen_fabric(lines, asked)
        if asked and chosen is None:
            known = ", ".join(f.row.id for f in lines) or "none yet"
            return self.site.refuse(request, 404, f"No fabric {asked} is known here (known: {known}).")
        topology: dict[str, Any] | None = None
        problem = ""
        if chosen is not None and chosen.infiniband:
            try:
                topology = self.api.fabric_topology(chosen.row.id)
            except AdminRefused as exc:  # the fabric went between the two reads
                problem = exc.message
        drawing = None
        if topology is not None and topology.get("map") is not None:
            drawing = draw(topology["map"], topology.get("llmgw_nodes") or {}, find=find, by_rail=by_rail)

        def link(**change: str | None) -> str:
            q: dict[str, str | None] = {
                "fabric": chosen.row.id if chosen is not None and asked else None,
                "colour": "rail" if by_rail else None,
                "find": find or None,
            }
            q.update(change)
            kept = {k: v for k, v in q.items() if v}
            return "/admin/fabrics" + ("?" + urlencode(kept) if kept else "")

        return self.site.render.page(
            request,
            template,
            control=True,
            fabrics=lines,
            loose=loose,
            chosen=chosen,
            topology=topology,
            topology_problem=problem,
            drawing=drawing,
            find=find,
            by_rail=by_rail,
            asked=chosen.row.id if chosen is not None and asked else "",
            link=link,
            here_url=link(),
            **common,
        )

    async def nvlink(self, request: web.Request) -> web.StreamResponse:
        live = request.headers.get("HX-Request") == "true"
        template = "admin_nvlink_live.html" if live else "admin_nvlink.html"
        control = True
        try:
            body = self.api.nvlink()
        except NotControlPlane:
            body, control = {}, False
        return self.site.render.page(
            request,
            template,
            control=control,
            racks=[rack_view(r) for r in body.get("racks") or ()],
            unplaced=list(body.get("unplaced") or ()),
            chip_state=chip_state,
            chip_title=chip_title,
            fmt=FMT,
            refresh_s=REFRESH_S,
            noscript_refresh_s=NOSCRIPT_REFRESH_S,
        )


# -- racks ------------------------------------------------------------------------------------


@dataclass
class TrayView:
    tray: dict[str, Any]
    state: str  # joined, out (a GPU not joined), degraded (joined, bandwidth degraded), held (joined, not ready)

    @property
    def words(self) -> str:
        t = self.tray
        bits = [f"{t['gpus_joined']} of {t['gpus_total']} GPUs joined"]
        imex = t.get("imex") or {}
        if imex.get("state"):
            ch = imex.get("channels")
            bits.append(
                f"IMEX {imex['state']}" + (f" ({ch} channel{'s' if ch != 1 else ''})" if ch is not None else "")
            )
        else:
            bits.append("IMEX not reported")
        if t.get("fabric_manager"):
            bits.append(f"fabric manager {t['fabric_manager']}")
        cliques = t.get("cliques") or []
        if cliques:
            bits.append(("clique " if len(cliques) == 1 else "cliques ") + ", ".join(cliques))
        return " · ".join(bits)


def chip_state(g: Mapping[str, Any]) -> str:
    if not g.get("joined"):
        return "out"
    return "degraded" if g.get("degraded") else "joined"


def chip_title(g: Mapping[str, Any]) -> str:
    """A GPU chip's tooltip: what nvidia-smi says of its fabric."""
    bits = [f"GPU {g['index']}" + (f" ({g['name']})" if g.get("name") else "")]
    if g.get("uuid"):
        bits.append(str(g["uuid"]))
    bits.append(f"state {g.get('state') or 'unknown'}" + (f", status {g['status']}" if g.get("status") else ""))
    if g.get("bandwidth"):
        bits.append(f"bandwidth {g['bandwidth']}")
    if g.get("clique_id"):
        bits.append(f"clique {g['clique_id']}")
    return "\n".join(bits)


@dataclass
class RackView:
    rack: dict[str, Any]
    trays: list[TrayView]


def rack_view(rack: dict[str, Any]) -> RackView:
    trays = []
    for t in rack.get("trays") or ():
        if t["gpus_joined"] < t["gpus_total"] or not t["gpus_total"]:
            state = "out"
        elif t.get("degraded"):
            state = "degraded"
        elif not t.get("ready"):
            state = "held"
        else:
            state = "joined"
        trays.append(TrayView(t, state))
    return RackView(rack, trays)
