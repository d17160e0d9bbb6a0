"""Line charts of the cluster's history, read back from Prometheus (``monitoring.prometheus``).

llmgw publishes these series on its metrics listener already; what a gauge cannot do is
remember, and keeping a ring buffer here would be a second copy with its own retention,
lost at every restart. So the history is read from the Prometheus that scrapes the
gateway, and without one the pages say so instead of drawing panels.

The rules every chart keeps:

- one y-axis: two measures of different scale are two charts;
- four colours in a fixed order; a fifth series and beyond are summed into a grey
  "other", by timestamp (the tail's series do not share sample times);
- a legend whenever there is more than one line: colour alone cannot be relied on;
- a flat zero is drawn along the bottom (nothing happening is an answer), and a single
  sample says so rather than putting a dot in a corner;
- one failed query fails every panel of the set: a blank among drawn panels reads as
  "nothing happened there";
- NaN (Prometheus sends it as a string) is dropped: one NaN coordinate stops an SVG
  path from drawing at all;
- the axis maximum is rounded up to a number a person would pick (1, 2, 2.5 or 5 times
  a power of ten).

The charts are inline SVG drawn here, so they need no script and load nothing from
elsewhere.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx

from llmgw.server.pages import PageError
from llmgw.server.pages.admin_format import percent, size

COLOURS = 4  # series drawn in a colour of their own; the rest fold into "other"
WIDTH, HEIGHT = 600, 150  # the SVG's units; it is scaled to the page's width
QUERY_TIMEOUT_S = 3.0  # a page waits no longer than this for Prometheus
POINTS = 120  # samples per series asked for over the window

# Windows offered on the cluster page, in words.
WINDOWS = {
    "15m": (900, "the last 15 minutes"),
    "1h": (3600, "the last hour"),
    "1d": (86400, "the last day"),
    "7d": (7 * 86400, "the last week"),
}
DEFAULT_WINDOW = "1h"


def window_of(asked: str | None) -> tuple[str, int, str]:
    """The window a page's ?window= names (the default for anything else): key, seconds, words."""
    key = asked if asked in WINDOWS else DEFAULT_WINDOW
    seconds, words = WINDOWS[key]
    return key, seconds, words


@dataclass(frozen=True)
class Panel:
    """One chart: its title, its PromQL and how to read the series it returns."""

    title: str
    query: str
    unit: str  # percent (0-100), ratio (0-1, shown as percent), bytes, count, cores
    label: str  # the series label that names a line
    rename: Callable[[str], str] | None = None  # a label value to what the page calls it (series merge on it)


@dataclass
class Series:
    name: str
    points: list[tuple[float, float]]  # (unix time, value), time ascending
    folded: bool = False  # the tail beyond the coloured series, summed: drawn grey

    @property
    def peak(self) -> float:
        return max((v for _, v in self.points), default=0.0)


@dataclass
class Line:
    name: str
    css: str  # c1..c4, or other
    paths: list[str]  # SVG polyline points, one per unbroken run of samples
    last: str  # the latest value, formatted


@dataclass
class Chart:
    title: str
    lines: list[Line] = field(default_factory=list)
    axis_max: str = ""
    axis_mid: str = ""
    message: str = ""  # said instead of a drawing: no samples, one sample
    zero: bool = False  # every value is zero: the flat line along the bottom is the answer

    @property
    def legend(self) -> bool:
        return len(self.lines) > 1


@dataclass
class ChartSet:
    """What a page shows: the panels, or one sentence saying why there are none."""

    window: str  # in words: "the last hour"
    charts: list[Chart] = field(default_factory=list)
    problem: str = ""  # Prometheus could not be read: every panel gives way to this
    unset: bool = False  # monitoring.prometheus is not set


class PrometheusUnreadable(PageError):
    """The history could not be read; the page says why in place of its charts."""


def promql_string(value: str) -> str:
    """A label value as a PromQL double-quoted string."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def promql_regex_of(values: Sequence[str]) -> str:
    """An anchored alternation matching exactly these label values (RE2 metacharacters escaped)."""
    escaped = ["".join("\\" + c if c in r"\.+*?()|[]{}^$" else c for c in v) for v in values]
    return promql_string("|".join(escaped))


def _number(raw: object) -> float | None:
    try:
        v = float(str(raw))
    except ValueError:
        return None
    return v if math.isfinite(v) else None


def read_matrix(body: object, label: str, what: str) -> list[Series]:
    """A query_range answer as series named by ``label``; NaN and infinities dropped."""
    if not isinstance(body, dict):
        raise PrometheusUnreadable(f"{what}: the answer is not a Prometheus API reply")
    if body.get("status") != "success":
        raise PrometheusUnreadable(f"{what}: {body.get('errorType') or 'error'}: {body.get('error') or 'no reason'}")
    data = body.get("data")
    if not isinstance(data, dict) or data.get("resultType") != "matrix" or not isinstance(data.get("result"), list):
        raise PrometheusUnreadable(f"{what}: the answer is not a range of samples (a matrix)")
    out = []
    for item in data["result"]:
        metric = item.get("metric") if isinstance(item, dict) else None
        values = item.get("values") if isinstance(item, dict) else None
        if not isinstance(metric, dict) or not isinstance(values, list):
            raise PrometheusUnreadable(f"{what}: a series in the answer has no labels or samples")
        points = []
        for pair in values:
            if isinstance(pair, list) and len(pair) == 2:
                t, v = _number(pair[0]), _number(pair[1])
                if t is not None and v is not None:
                    points.append((t, v))
        out.append(Series(str(metric.get(label) or "(none)"), points))
    return out


def merge(series: list[Series], name: str) -> Series:
    """Series summed by timestamp (not by position: their samples need not line up)."""
    total: dict[float, float] = {}
    for s in series:
        for t, v in s.points:
            total[t] = total.get(t, 0.0) + v
    return Series(name, sorted(total.items()))


def fold(series: list[Series], rename: Callable[[str], str] | None = None) -> list[Series]:
    """Series renamed (merging those that share a name), ranked by peak, the tail summed into "other"."""
    if rename is not None:
        groups: dict[str, list[Series]] = {}
        for s in series:
            groups.setdefault(rename(s.name), []).append(s)
        series = [g[0] if len(g) == 1 else merge(g, n) for n, g in groups.items()]
    # A series at zero throughout adds nothing to a sum: it is drawn only when nothing else is.
    moving = [s for s in series if s.points and s.peak != 0]
    if not moving:
        return [s for s in series if s.points][:1]
    ranked = sorted(moving, key=lambda s: (-s.peak, s.name))
    if len(ranked) <= COLOURS:
        return ranked
    other = merge(ranked[COLOURS - 1 :], "other")
    other.folded = True
    return [*ranked[: COLOURS - 1], other]


def nice_ceiling(v: float) -> float:
    """The smallest of 1, 2, 2.5, 5 times a power of ten at or above v (1 for nothing)."""
    if v <= 0:
        return 1.0
    scale = 10 ** math.floor(math.log10(v))
    for step in (1, 2, 2.5, 5, 10):
        if v <= step * scale * (1 + 1e-9):
            return step * scale
    return 10 * scale


def axis_top(unit: str, peak: float) -> float:
    """The axis maximum: a round number in the unit the axis is read in (GiB, not 10^9 bytes)."""
    if unit == "percent" and peak > 50:
        return 100.0
    if unit == "ratio" and peak > 0.5:
        return 1.0
    if unit == "bytes" and peak >= 1024:
        scale = 1024 ** min(int(math.log(peak, 1024)), 4)
        return nice_ceiling(peak / scale) * scale
    return nice_ceiling(peak)


def show(unit: str, v: float) -> str:
    if unit == "percent":
        return percent(v)
    if unit == "ratio":
        return percent(v * 100)
    if unit == "bytes":
        return size(v)
    if unit == "cores":
        return f"{v:.2f}".rstrip("0").rstrip(".") if v < 10 else f"{v:.0f}"
    return f"{v:.1f}".rstrip("0").rstrip(".") if v < 10 else f"{v:,.0f}"


def draw(panel: Panel, series: list[Series], start: float, end: float, step: float) -> Chart:
    chart = Chart(panel.title)
    lines = fold(series, panel.rename)
    samples = sum(len(s.points) for s in lines)
    if samples == 0:
        chart.message = "No samples in this window: nothing scraped has this series yet."
        return chart
    if all(len(s.points) == 1 for s in lines) and len({s.points[0][0] for s in lines}) == 1:
        t, v = lines[0].points[0]
        chart.message = f"One sample so far ({show(panel.unit, v)}): a line needs two."
        return chart
    peak = max(s.peak for s in lines)
    top = axis_top(panel.unit, peak)
    chart.zero = peak == 0
    chart.axis_max, chart.axis_mid = show(panel.unit, top), show(panel.unit, top / 2)
    span = max(end - start, 1.0)
    names = [f"c{i + 1}" for i in range(COLOURS)]
    for i, s in enumerate(lines):
        runs: list[list[str]] = [[]]
        previous: float | None = None
        for t, v in s.points:
            # A gap of more than two steps is a gap (the scrape stopped): the line breaks there.
            if previous is not None and t - previous > 2.5 * step and runs[-1]:
                runs.append([])
            x = (t - start) / span * WIDTH
            y = HEIGHT - (v / top) * HEIGHT
            runs[-1].append(f"{x:.1f},{y:.1f}")
            previous = t
        css = "other" if s.folded else names[i]
        chart.lines.append(
            Line(s.name, css, [" ".join(r) for r in runs if len(r) > 1], show(panel.unit, s.points[-1][1]))
        )
    return chart


class Prometheus:
    """query_range against the Prometheus named by monitoring.prometheus."""

    def __init__(self, url: str | None, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.url = url
        self._transport = transport
        self._client: httpx.AsyncClient | None = None

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=QUERY_TIMEOUT_S, transport=self._transport)
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _range(self, panel: Panel, start: float, end: float, step: float) -> list[Series]:
        assert self.url is not None
        what = f"the {panel.title.lower()} query"
        try:
            resp = await self._http().get(
                self.url + "/api/v1/query_range",
                params={"query": panel.query, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"},
            )
        except httpx.TimeoutException:
            raise PrometheusUnreadable(f"it did not answer within {QUERY_TIMEOUT_S:g} s") from None
        except httpx.HTTPError as exc:
            raise PrometheusUnreadable(f"it could not be reached ({exc.__class__.__name__}: {exc})") from None
        try:
            body = resp.json()
        except ValueError:
            raise PrometheusUnreadable(
                f"{what}: it answered {resp.status_code} with something other than JSON"
            ) from None
        return read_matrix(body, panel.label, what)

    async def charts(self, panels: list[Panel], seconds: float, words: str, now: float | None = None) -> ChartSet:
        out = ChartSet(words)
        if not self.url:
            out.unset = True
            return out
        end = time.time() if now is None else now
        start = end - seconds
        step = max(seconds / POINTS, 1.0)
        try:
            got = await asyncio.gather(*(self._range(p, start, end, step) for p in panels))
        except PrometheusUnreadable as exc:
            out.problem = f"Prometheus at {self.url} could not be read: {exc}."
            return out
        out.charts = [draw(p, s, start, end, step) for p, s in zip(panels, got, strict=True)]
        return out


# -- the panels the pages show -------------------------------------------------------------------


def cluster_panels() -> list[Panel]:
    """What the cluster is doing: saturation, queue depth, cache occupancy, replicas by state."""
    return [
        Panel("Saturation", "max by (model) (llmgw_pool_saturation)", "ratio", "model"),
        Panel(
            "Queue depth",
            # Waiting in the gateway's admission and in the engines' own queues, together.
            'sum by (model) ({__name__=~"llmgw_admission_queue_depth|llmgw_endpoint_waiting"})',
            "count",
            "model",
        ),
        Panel("Cache occupancy", "max by (model) (llmgw_endpoint_kv_cache_usage)", "ratio", "model"),
        Panel("Replicas", "max by (state) (llmgw_replicas)", "count", "state"),
    ]


def node_panels(node_id: str, replicas: dict[str, str]) -> list[Panel]:
    """A node's hour: CPU, memory, load, each model's cores and memory, and its engines' queues.

    ``replicas`` maps the node's replica ids to their models: an engine's series carry its
    shard (``<replica>-<rank>``), which the charts show as the model it serves.
    """
    node = promql_string(node_id)

    def model_of(shard: str) -> str:
        replica = shard.rsplit("-", 1)[0]
        return replicas.get(replica, shard)

    panels = [
        Panel("CPU", f"max by (node) (llmgw_node_cpu_utilization_percent{{node={node}}})", "percent", "node"),
        Panel("Memory in use", f"max by (node) (llmgw_node_memory_used_bytes{{node={node}}})", "bytes", "node"),
        Panel("Load", f"max by (window) (llmgw_node_load{{node={node}}})", "count", "window"),
        Panel("Cores by model", f"max by (shard) (llmgw_shard_cpu_cores{{node={node}}})", "cores", "shard", model_of),
        Panel(
            "Memory by model", f"max by (shard) (llmgw_shard_memory_bytes{{node={node}}})", "bytes", "shard", model_of
        ),
    ]
    if replicas:
        on_node = promql_regex_of(sorted(replicas))
        panels.append(
            Panel("Queue depth", f"sum by (model) (llmgw_endpoint_waiting{{replica=~{on_node}}})", "count", "model")
        )
    return panels
