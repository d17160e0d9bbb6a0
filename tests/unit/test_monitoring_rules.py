"""The shipped monitoring (deploy/monitoring): rules and configuration promtool accepts, rules
tested firing and not firing, the thresholds llmgw promises, and no expression reading a
metric llmgw does not export.

The metric names are checked against what a real `llmgw server` (in-process, control plane
on) registers on its metrics registry, not against a list kept here: a renamed metric makes
an alert that can never fire, and that must fail a test rather than a night's sleep.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from llmgw.config.server import parse_server_config
from llmgw.server.app import Server
from llmgw.testing.ports import free_port

REPO = Path(__file__).resolve().parents[2]
MONITORING = REPO / "deploy" / "monitoring"
RULES = MONITORING / "llmgw-rules.yml"
CONFIG = MONITORING / "prometheus.yml"
RULE_TESTS = MONITORING / "tests" / "llmgw-rules.test.yml"
DASHBOARD = MONITORING / "grafana" / "llmgw-overview.json"

# data.md §4.4: each alert's wait and severity, as llmgw's operating expectations state them.
THRESHOLDS = {
    "ControlPlaneUnreachable": ("1m", "critical"),
    "NodeNotReady": ("2m", "warning"),
    "AgentGoneQuiet": ("1m", "warning"),
    "ModelHasNothingServing": ("10m", "critical"),
    "PoolSaturated": ("5m", "warning"),
    "EndpointBreakerOpen": ("2m", "warning"),
    "EndpointMetricsStale": ("5m", "warning"),
    "NodeDiskFilling": ("15m", "warning"),
    "MonitoringDiskFilling": ("10m", "warning"),
    "MonitoringDiskAlmostFull": ("5m", "critical"),
    "HighErrorRate": ("5m", "critical"),
    "SlowFirstToken": ("10m", "warning"),
    "RequestsBeingRejected": ("5m", "warning"),
}

# data.md §4.4's limits, each as it must appear in its alert's expression.
LIMITS = {
    "ControlPlaneUnreachable": 'up{job="llmgw"} == 0',
    "NodeNotReady": "(llmgw_node_up) == 0",
    "AgentGoneQuiet": "llmgw_node_last_seen_seconds > 60",
    "ModelHasNothingServing": "llmgw_model_replicas_ready == 0",
    "PoolSaturated": "llmgw_pool_saturation > 1",
    "EndpointBreakerOpen": "llmgw_endpoint_breaker_open == 1",
    "EndpointMetricsStale": "llmgw_endpoint_metrics_stale == 1",
    "NodeDiskFilling": "llmgw_node_disk_free_bytes / llmgw_node_disk_total_bytes < 0.10",
    "MonitoringDiskFilling": "< 0.15",
    "MonitoringDiskAlmostFull": "< 0.05",
    "HighErrorRate": "> 0.05",
    "SlowFirstToken": "rate(llmgw_ttft_seconds_bucket[10m]))) > 30",
    "RequestsBeingRejected": "sum by (band) (rate(llmgw_admission_rejected_total[5m])) > 0",
}

# Names that are not llmgw's, and which alerts may read them: Prometheus's own scrape health,
# and node_exporter's filesystems on the monitoring machine.
NOT_LLMGW = {
    "up": {"ControlPlaneUnreachable"},
    "node_filesystem_avail_bytes": {"MonitoringDiskFilling", "MonitoringDiskAlmostFull"},
    "node_filesystem_size_bytes": {"MonitoringDiskFilling", "MonitoringDiskAlmostFull"},
}

SPEC_PANELS = [
    "Nodes ready",
    "Replicas serving",
    "Models with something serving",
    "Requests per second",
    "Replicas ready by model",
    "Pool saturation",
    "Time to first token (p50/p99)",
    "Tokens per second",
    "Engine queue depth",
    "KV cache occupancy",
    "Model disk free",
    "Seconds since each node last reported",
    "Replicas by state",
]


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        reason = "promtool is not installed (apt-get install prometheus; scripts/test does)"
        if os.environ.get("LLMGW_REQUIRE_E2E") == "1":
            pytest.fail(f"promtool is required for this run: {reason}")
        pytest.skip(reason)
    return path


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([_promtool(), *args], capture_output=True, text=True, timeout=120)


def _rules() -> list[dict]:
    doc = yaml.safe_load(RULES.read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def _dashboard_exprs() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]


# -- the names an expression reads ------------------------------------------------------------

_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGES = re.compile(r"\[[^\]]*\]")
# Label lists, which are names too but not metrics: by (model), on (node), group_left (state).
_LABEL_LISTS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", re.I)
# Not inside a number (1e3), a Grafana variable ($model) or another name.
_NAME = re.compile(r"(?<![\w.:$])[A-Za-z_:][A-Za-z0-9_:]*")
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan", "group_left", "group_right"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (not its functions, labels or keywords)."""
    text = _LABEL_LISTS.sub(" ", _RANGES.sub(" ", _MATCHERS.sub(" ", _STRINGS.sub(" ", expr))))
    out = set()
    for m in _NAME.finditer(text):
        if re.match(r"\s*\(", text[m.end() :]) or m.group().lower() in _KEYWORDS:
            continue  # a function or aggregation, or an operator word
        out.add(m.group())
    return out


def test_the_name_reader_finds_metrics_and_nothing_else():
    assert metric_names('sum by (model) (rate(llmgw_requests_total{status=~"5.."}[5m])) > 0.05') == {
        "llmgw_requests_total"
    }
    assert metric_names(
        "histogram_quantile(0.99, sum by (model, le) (rate(llmgw_ttft_seconds_bucket[$__rate_interval]))) > 1e3"
    ) == {"llmgw_ttft_seconds_bucket"}
    assert metric_names("max by (node) (a) == 0 and on (node) group_left (state) b unless c offset 5m") == {
        "a",
        "b",
        "c",
    }
    assert metric_names("count(x > 0) or vector(0)") == {"x"}


# -- what llmgw exports ------------------------------------------------------------------------

_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("", "_count", "_sum", "_created"),
    "info": ("_info",),
}


@pytest.fixture
async def exported(tmp_path) -> set[str]:
    """Every sample name a control plane's metrics listener can print, read from the families its
    collectors (gateway, admission, router, fleet, fabrics, leadership) register at start."""
    cfg = parse_server_config(
        {
            "listen": f"127.0.0.1:{free_port()}",
            "admin_listen": f"127.0.0.1:{free_port()}",
            "metrics_listen": f"127.0.0.1:{free_port()}",
            "agent_listen": f"127.0.0.1:{free_port()}",
            "agent_tls": None,
            "control": {"enabled": True},
            "auth": {"store": str(tmp_path / "gw.db")},
            "data_dir": str(tmp_path),
            "models": [{"name": "m", "endpoints": [{"url": "http://127.0.0.1:9", "engine": "llamacpp"}]}],
        }
    )
    server = Server(cfg)
    await server.start()
    try:
        names = set()
        for family in server.metrics.registry.collect():
            names.update(family.name + s for s in _SUFFIXES.get(family.type, ("",)))
        return names
    finally:
        await server.stop()


async def test_every_metric_an_alert_reads_is_one_llmgw_exports(exported):
    assert "llmgw_node_up" in exported and "llmgw_ttft_seconds_bucket" in exported  # the reading works
    for rule in _rules():
        names = metric_names(rule["expr"])
        assert names, f"{rule['alert']}: no metric found in {rule['expr']!r}"
        for name in names:
            if name in NOT_LLMGW:
                assert rule["alert"] in NOT_LLMGW[name], f"{rule['alert']} reads {name}, which is not llmgw's"
            else:
                assert name in exported, f"{rule['alert']} reads {name}, which llmgw does not export"


async def test_every_metric_a_dashboard_panel_reads_is_one_llmgw_exports(exported):
    exprs = _dashboard_exprs()
    assert exprs
    for title, expr in exprs:
        names = metric_names(expr)
        assert names, f"{title}: no metric found in {expr!r}"
        missing = names - exported
        assert not missing, f"panel {title!r} reads {sorted(missing)}, which llmgw does not export"


# -- the rules ---------------------------------------------------------------------------------


def test_the_rules_are_the_specs_alerts_with_its_waits_severities_and_limits():
    rules = {r["alert"]: r for r in _rules()}
    assert sorted(rules) == sorted(THRESHOLDS)
    for name, (wait, severity) in THRESHOLDS.items():
        r = rules[name]
        assert (r["for"], r["labels"]["severity"]) == (wait, severity), name
        assert LIMITS[name] in " ".join(r["expr"].split()), f"{name}: {r['expr']!r} lacks {LIMITS[name]!r}"


def test_every_alert_says_what_is_wrong_and_what_to_do():
    for r in _rules():
        ann = r["annotations"]
        assert ann["summary"].strip() and "\n" not in ann["summary"], r["alert"]
        # What to do is a command or a place to look, written as code.
        assert "`" in ann["description"], f"{r['alert']}: the description names nothing to run or read"


def test_promtool_accepts_the_rules_and_the_prometheus_configuration():
    r = _run("check", "rules", str(RULES))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(THRESHOLDS)} rules found" in r.stdout
    # check config also reads the rule files it names, relative to the configuration.
    r = _run("check", "config", str(CONFIG))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 1 rule files found" in r.stdout


def test_promtool_sees_each_alert_fire_and_not_fire_as_the_rule_tests_expect():
    r = _run("test", "rules", str(RULE_TESTS))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout + r.stderr


def test_the_rule_tests_cover_every_alert_firing_and_not_firing():
    doc = yaml.safe_load(RULE_TESTS.read_text())
    fired: set[str] = set()
    quiet: set[str] = set()
    for case in doc["tests"]:
        for check in case["alert_rule_test"]:
            (fired if check["exp_alerts"] else quiet).add(check["alertname"])
    assert fired == set(THRESHOLDS), f"never seen firing: {sorted(set(THRESHOLDS) - fired)}"
    assert quiet == set(THRESHOLDS), f"never seen not firing: {sorted(set(THRESHOLDS) - quiet)}"


def test_the_prometheus_configuration_scrapes_llmgw_as_the_rules_expect_and_loads_them():
    cfg = yaml.safe_load(CONFIG.read_text())
    assert cfg["rule_files"] == [RULES.name]
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert {"llmgw", "prometheus", "monitoring-host"} <= set(jobs)
    # metrics_listen's port (docs/configuration.md), which serves /metrics, the default path.
    (target,) = jobs["llmgw"]["static_configs"][0]["targets"]
    assert target.endswith(":9091") and "metrics_path" not in jobs["llmgw"]


# -- the dashboard -----------------------------------------------------------------------------


def test_the_dashboard_has_the_specs_panels_on_a_chosen_prometheus():
    dash = json.loads(DASHBOARD.read_text())
    assert (dash["uid"], dash["title"]) == ("llmgw-overview", "llmgw — cluster")
    assert [p["title"] for p in dash["panels"]] == SPEC_PANELS
    (var,) = dash["templating"]["list"]
    assert (var["name"], var["type"], var["query"]) == ("datasource", "datasource", "prometheus")
    for p in dash["panels"]:
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"] and all(t["datasource"] == p["datasource"] for t in p["targets"]), p["title"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(set(ids)) == len(ids)


def test_promtool_parses_every_dashboard_expression(tmp_path):
    # promtool has no query parser of its own: each expression goes in as a recording rule.
    rules = [
        {"record": f"llmgw_dashboard:panel_{i}", "expr": expr.replace("$__rate_interval", "5m")}
        for i, (_, expr) in enumerate(_dashboard_exprs())
    ]
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    r = _run("check", "rules", str(path))
    assert r.returncode == 0, r.stdout + r.stderr


def test_grafanas_provisioning_points_at_the_dashboard_and_the_datasource():
    prov = MONITORING / "grafana" / "provisioning"
    (ds,) = yaml.safe_load((prov / "datasources" / "llmgw.yml").read_text())["datasources"]
    assert (ds["type"], ds["uid"], ds["url"]) == ("prometheus", "llmgw-prom", "http://localhost:9090")
    (provider,) = yaml.safe_load((prov / "dashboards" / "llmgw.yml").read_text())["providers"]
    assert provider["type"] == "file" and provider["options"]["path"]
