"""The history charts' rules (llmgw/server/pages/charts.py), against a stand-in Prometheus."""

from __future__ import annotations

import asyncio
import math

import httpx
import pytest

from llmgw.server.pages.charts import (
    Panel,
    Prometheus,
    PrometheusUnreadable,
    Series,
    cluster_panels,
    draw,
    fold,
    nice_ceiling,
    node_panels,
    promql_regex_of,
    promql_string,
    read_matrix,
)

START, END, STEP = 1000.0, 1600.0, 60.0


def matrix(*series: tuple[dict, list]) -> dict:
    return {
        "status": "success",
        "data": {"resultType": "matrix", "result": [{"metric": m, "values": v} for m, v in series]},
    }


def stand_in(answers: dict[str, object], seen: list[httpx.Request] | None = None) -> httpx.MockTransport:
    """Prometheus's query_range: each query (by a word in it) answers its JSON; others 404."""

    def handle(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append(request)
        assert request.url.path == "/api/v1/query_range"
        query = request.url.params["query"]
        for word, body in answers.items():
            if word in query:
                return httpx.Response(200 if body.get("status") == "success" else 400, json=body)  # type: ignore[union-attr]
        return httpx.Response(404, text="not here")

    return httpx.MockTransport(handle)


def test_nan_and_infinite_samples_are_dropped_rather_than_drawn():
    got = read_matrix(matrix(({"model": "m"}, [[1000, "1"], [1060, "NaN"], [1120, "+Inf"], [1180, "2"]])), "model", "q")
    assert got == [Series("m", [(1000.0, 1.0), (1180.0, 2.0)])]
    chart = draw(Panel("T", "q", "count", "model"), got, START, END, STEP)
    assert all("nan" not in p.lower() and "inf" not in p.lower() for line in chart.lines for p in line.paths)


def test_a_fifth_series_and_beyond_fold_into_other_summed_by_timestamp():
    series = [Series(f"s{i}", [(1000.0, float(10 - i)), (1060.0, float(10 - i))]) for i in range(4)]
    # The tail's samples fall at different times: the fold adds them by timestamp, not by position.
    series += [Series("late", [(1030.0, 1.0), (1060.0, 1.0)]), Series("early", [(1000.0, 2.0)])]
    got = fold(series)
    assert [s.name for s in got] == ["s0", "s1", "s2", "other"]
    other = got[-1]
    assert other.folded
    assert other.points == [(1000.0, 7.0 + 2.0), (1030.0, 1.0), (1060.0, 7.0 + 1.0)]


def test_four_series_keep_their_own_colours_and_a_legend():
    series = [Series(f"s{i}", [(1000.0, float(i + 1)), (1600.0, float(i + 1))]) for i in range(4)]
    chart = draw(Panel("T", "q", "count", "x"), series, START, END, STEP)
    assert [line.css for line in chart.lines] == ["c1", "c2", "c3", "c4"]
    assert chart.legend


def test_one_line_has_no_legend():
    chart = draw(Panel("T", "q", "count", "x"), [Series("a", [(1000.0, 1.0), (1600.0, 2.0)])], START, END, STEP)
    assert len(chart.lines) == 1 and not chart.legend


def test_a_flat_zero_is_drawn_along_the_bottom():
    series = [Series("idle", [(1000.0, 0.0), (1300.0, 0.0), (1600.0, 0.0)]), Series("also", [(1000.0, 0.0)])]
    chart = draw(Panel("Queue", "q", "count", "model"), series, START, END, 300.0)
    assert chart.zero and not chart.message
    assert len(chart.lines) == 1
    assert chart.lines[0].paths == ["0.0,150.0 300.0,150.0 600.0,150.0"]


def test_a_single_sample_says_so_instead_of_drawing_a_dot():
    chart = draw(Panel("CPU", "q", "percent", "node"), [Series("n", [(1500.0, 42.0)])], START, END, STEP)
    assert not chart.lines
    assert "One sample so far (42%)" in chart.message


def test_no_series_at_all_says_nothing_has_been_scraped():
    chart = draw(Panel("CPU", "q", "percent", "node"), [], START, END, STEP)
    assert "No samples" in chart.message


def test_a_gap_in_the_scrape_breaks_the_line():
    s = Series("a", [(1000.0, 1.0), (1060.0, 1.0), (1400.0, 1.0), (1460.0, 1.0)])
    chart = draw(Panel("T", "q", "count", "x"), [s], START, END, STEP)
    assert len(chart.lines[0].paths) == 2


@pytest.mark.parametrize(
    ("peak", "top"), [(0.8347, 1.0), (0.12, 0.2), (3.0, 5.0), (21.0, 25.0), (1.0, 1.0), (0.0, 1.0), (7e9, 1e10)]
)
def test_the_axis_maximum_is_a_number_a_person_would_pick(peak, top):
    assert math.isclose(nice_ceiling(peak), top)


def test_sizes_on_an_axis_are_binary_and_small_percents_keep_a_decimal():
    mem = draw(Panel("M", "q", "bytes", "n"), [Series("n", [(1000.0, 3 * 2**30), (1600.0, 2**30)])], START, END, STEP)
    assert mem.axis_max == "5.0 GiB"
    cpu = draw(Panel("C", "q", "percent", "n"), [Series("n", [(1000.0, 1.5), (1600.0, 2.0)])], START, END, STEP)
    assert cpu.axis_max == "2.0%" and cpu.axis_mid == "1.0%"


def test_renamed_series_that_share_a_name_are_summed():
    shards = [Series("r1-0", [(1000.0, 1.0), (1060.0, 1.0)]), Series("r1-1", [(1000.0, 2.0), (1060.0, 2.0)])]
    got = fold(shards, {"r1-0": "qwen", "r1-1": "qwen"}.__getitem__)
    assert [(s.name, s.points) for s in got] == [("qwen", [(1000.0, 3.0), (1060.0, 3.0)])]


def test_label_values_are_escaped_into_promql():
    assert promql_string('a"b\\c') == '"a\\"b\\\\c"'
    assert promql_regex_of(["r.1", "x|y"]) == '"r\\\\.1|x\\\\|y"'
    panels = node_panels('evil"} or vector(1) #', {"r.1": "m"})
    assert all('node="evil\\"} or vector(1) #"' in p.query for p in panels if "node=" in p.query)


def test_every_panel_is_drawn_from_its_own_query():
    seen: list[httpx.Request] = []
    answers = {
        "saturation": matrix(({"model": "m"}, [[1000, "0.5"], [1600, "0.7"]])),
        "waiting": matrix(({"model": "m"}, [[1000, "3"], [1600, "1"]])),
        "kv_cache": matrix(({"model": "m"}, [[1000, "0.2"], [1600, "0.25"]])),
        "llmgw_replicas": matrix(({"state": "ready"}, [[1000, "2"], [1600, "2"]])),
    }
    prom = Prometheus("http://prom:9090", transport=stand_in(answers, seen))
    got = asyncio.run(prom.charts(cluster_panels(), 600, "the last ten minutes", now=END))
    assert not got.problem and not got.unset
    assert [c.title for c in got.charts] == ["Saturation", "Queue depth", "Cache occupancy", "Replicas"]
    assert all(c.lines for c in got.charts)
    assert {r.url.params["start"] for r in seen} == {"1000.000"}
    asyncio.run(prom.close())


def test_one_failed_query_fails_every_panel():
    answers = {
        "saturation": matrix(({"model": "m"}, [[1000, "0.5"], [1600, "0.7"]])),
        "waiting": {"status": "error", "errorType": "bad_data", "error": "parse error at char 3"},
        "kv_cache": matrix(),
        "llmgw_replicas": matrix(),
    }
    got = asyncio.run(Prometheus("http://prom:9090", transport=stand_in(answers)).charts(cluster_panels(), 600, "w"))
    assert got.charts == []
    assert "Prometheus at http://prom:9090 could not be read" in got.problem
    assert "parse error at char 3" in got.problem


def test_an_unreachable_prometheus_is_said_outright():
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    got = asyncio.run(
        Prometheus("http://prom:9090", transport=httpx.MockTransport(refuse)).charts(cluster_panels(), 60, "w")
    )
    assert "could not be reached" in got.problem and got.charts == []


def test_without_monitoring_prometheus_there_are_no_panels_and_the_page_says_why():
    got = asyncio.run(Prometheus(None).charts(cluster_panels(), 60, "w"))
    assert got.unset and got.charts == [] and not got.problem


def test_an_answer_that_is_not_a_matrix_is_refused_in_words():
    with pytest.raises(PrometheusUnreadable, match="not a range of samples"):
        read_matrix({"status": "success", "data": {"resultType": "vector", "result": []}}, "x", "the query")
