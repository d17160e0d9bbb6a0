"""Shipped monitoring end to end: Debian's real Prometheus runs deploy/monitoring's rules and
scrapes a real `llmgw server` (control plane, metrics listener) with a real `llmgw agent` over
mutual TLS, itself, and Debian's node_exporter for the monitoring machine's disks. Cordoning the
node takes NodeNotReady through pending to firing; uncordoning it resolves the alert. Every rule
evaluates without error on what llmgw really exports, and every dashboard expression is a query
that Prometheus answers.

The test runs copies of the shipped files, changed only in these ways (`_prometheus_yml` and
`_rules_yml`), so that it takes seconds rather than minutes:

- prometheus.yml: scrape and evaluation every 1 s instead of 15 s; each job's target is this
  test's (the server's metrics listener, this Prometheus, this node_exporter); `rule_files` names
  the rewritten rules.
- llmgw-rules.yml: NodeNotReady's `for:` becomes 5 s instead of 2 m. Nothing else changes.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from datetime import datetime
from pathlib import Path

import httpx
import pytest
import yaml
from harness import REPO, Gateway, Proc, llmgw_cmd, require, start_agent, wait_http, wait_until

from llmgw.testing.ports import free_port

MONITORING = REPO / "deploy" / "monitoring"
NODE_NOT_READY_FOR = 5  # seconds, instead of the shipped two minutes

pytestmark = pytest.mark.e2e


def _cert(*args: str) -> None:
    r = subprocess.run(llmgw_cmd("ctl", "cert", *args), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def _rules_yml() -> dict:
    """The shipped rules, with NodeNotReady's wait shortened and nothing else touched."""
    doc = yaml.safe_load((MONITORING / "llmgw-rules.yml").read_text())
    (rule,) = [r for g in doc["groups"] for r in g["rules"] if r.get("alert") == "NodeNotReady"]
    assert rule["for"] == "2m", "the shipped wait changed: update this test's description"
    rule["for"] = f"{NODE_NOT_READY_FOR}s"
    return doc


def _prometheus_yml(targets: dict[str, str], rules: Path) -> dict:
    """The shipped configuration, scraping and evaluating every second, each job at this test's target."""
    cfg = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    cfg["global"] = {**cfg["global"], "scrape_interval": "1s", "evaluation_interval": "1s"}
    cfg["rule_files"] = [str(rules)]
    assert sorted(j["job_name"] for j in cfg["scrape_configs"]) == sorted(targets)
    for job in cfg["scrape_configs"]:
        job["static_configs"] = [{"targets": [targets[job["job_name"]]]}]
    return cfg


class NodeExporter(Proc):
    """Debian's node_exporter (a package prometheus recommends), reading filesystems only."""

    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("prometheus-node-exporter") or shutil.which("node_exporter")
        if binary is None:
            require("node_exporter", "prometheus-node-exporter is not installed (apt-get install prometheus brings it)")
        self.address = f"127.0.0.1:{free_port()}"
        cmd = [binary, f"--web.listen-address={self.address}", "--collector.disable-defaults", "--collector.filesystem"]
        super().__init__(cmd, workdir / "node-exporter.log")

    def wait_ready(self, timeout: float = 30.0) -> NodeExporter:
        wait_http(f"http://{self.address}/metrics", self.proc, timeout, self.log)
        return self


class RulesPrometheus(Proc):
    """Debian's `prometheus` on the shipped configuration and rules, as rewritten above."""

    def __init__(self, workdir: Path, llmgw: str, node_exporter: str) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            require("Prometheus", "prometheus is not installed (apt-get install prometheus; scripts/test does)")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        home = workdir / "prometheus"
        home.mkdir()
        rules = home / "llmgw-rules.yml"
        rules.write_text(yaml.safe_dump(_rules_yml(), sort_keys=False))
        config = home / "prometheus.yml"
        targets = {"llmgw": llmgw, "prometheus": f"127.0.0.1:{self.port}", "monitoring-host": node_exporter}
        config.write_text(yaml.safe_dump(_prometheus_yml(targets, rules), sort_keys=False))
        cmd = [
            str(binary),
            f"--config.file={config}",
            f"--storage.tsdb.path={home / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
        ]
        super().__init__(cmd, workdir / "prometheus.log")

    def wait_ready(self, timeout: float = 60.0) -> RulesPrometheus:
        wait_http(self.url + "/-/ready", self.proc, timeout, self.log)
        return self

    def api(self, path: str, **params) -> dict:
        r = httpx.get(self.url + "/api/v1/" + path, params=params, timeout=10)
        body = r.json()
        assert body["status"] == "success", body
        return body["data"]

    def alerts(self, name: str) -> list[dict]:
        return [a for a in self.api("alerts")["alerts"] if a["labels"]["alertname"] == name]


def test_cordoning_a_node_takes_node_not_ready_through_pending_to_firing_and_uncordoning_resolves_it(tmp_path):
    pki = tmp_path / "pki"
    _cert("init-ca", "--dir", str(pki))
    _cert("issue-server", "127.0.0.1", "localhost", "--dir", str(pki))
    _cert("issue-client", "node-a", "--dir", str(pki))
    agent_port, metrics_port = free_port(), free_port()
    gw = Gateway(
        tmp_path,
        models=[],
        agent_listen=f"127.0.0.1:{agent_port}",
        agent_tls={"ca": str(pki / "ca.pem"), "cert": str(pki / "server.pem"), "key": str(pki / "server-key.pem")},
        metrics_listen=f"127.0.0.1:{metrics_port}",
        control={"enabled": True},
        engines={"llamacpp": None},  # nothing to install: the node only has to be there
    )
    procs: list[Proc] = [gw]
    try:
        procs.append(start_agent(tmp_path, "node-a", agent_port, pki))
        exporter = NodeExporter(tmp_path)
        procs.append(exporter)
        exporter.wait_ready()
        prom = RulesPrometheus(tmp_path, f"127.0.0.1:{metrics_port}", exporter.address)
        procs.append(prom)
        gw.wait_up(ready=False)
        prom.wait_ready()

        def node_up() -> list[dict]:
            return prom.api("query", query='llmgw_node_up{node="node-a"}')["result"]

        got = wait_until(node_up, 60, "Prometheus to scrape node-a from llmgw", procs)
        assert got[0]["metric"]["state"] == "ready" and got[0]["value"][1] == "1"

        # Every shipped rule evaluates on llmgw's real series without an error (a bad expression
        # or a template Prometheus cannot run shows here as health "err").
        def rules_evaluated() -> list[dict] | None:
            rules = [r for g in prom.api("rules")["groups"] for r in g["rules"]]
            return rules if rules and all(r["health"] != "unknown" for r in rules) else None

        rules = wait_until(rules_evaluated, 30, "every rule to be evaluated once", procs)
        assert len(rules) == 13
        assert [(r["name"], r["lastError"]) for r in rules if r["health"] != "ok"] == []
        assert prom.alerts("NodeNotReady") == [] and prom.alerts("ControlPlaneUnreachable") == []
        # The monitoring machine's disk alerts read names node_exporter really prints.
        for name in ("node_filesystem_avail_bytes", "node_filesystem_size_bytes"):
            query = f'{name}{{job="monitoring-host"}}'
            wait_until(lambda q=query: prom.api("query", query=q)["result"], 30, f"Prometheus to hold {query}", procs)

        # Every dashboard expression is a query Prometheus answers; the panels on nodes read the node.
        dash = json.loads((MONITORING / "grafana" / "llmgw-overview.json").read_text())
        answers = {}
        for panel in dash["panels"]:
            for t in panel["targets"]:
                expr = t["expr"].replace("$__rate_interval", "1m")
                answers[(panel["title"], t["legendFormat"])] = prom.api("query", query=expr)["result"]
        assert [r["value"][1] for r in answers[("Nodes ready", "ready")]] == ["1"]
        assert [r["metric"]["node"] for r in answers[("Seconds since each node last reported", "{{node}}")]] == [
            "node-a"
        ]

        # Cordoned: not ready, so pending at once and firing only after its wait.
        r = gw.ctl("cordon", "node-a")
        assert r.returncode == 0, r.stdout + r.stderr

        def state_of_alert(state: str):
            def check() -> dict | None:
                found = [a for a in prom.alerts("NodeNotReady") if a["state"] == state]
                return found[0] if found else None

            return check

        pending = wait_until(state_of_alert("pending"), 30, "NodeNotReady to be pending", procs)
        assert pending["labels"] == {"alertname": "NodeNotReady", "node": "node-a", "severity": "warning"}
        firing = wait_until(state_of_alert("firing"), 30, "NodeNotReady to fire", procs)
        fired_at = time.time()
        assert firing["labels"] == pending["labels"] and firing["activeAt"] == pending["activeAt"]
        assert firing["annotations"]["summary"] == "Node node-a takes no new work"
        assert "`llmgw ctl uncordon node-a`" in firing["annotations"]["description"]
        assert node_up()[0]["metric"]["state"] == "cordoned"
        # activeAt is when it went pending (RFC 3339, with the machine's clock, as ours).
        active = _epoch(firing["activeAt"])
        assert fired_at >= active + NODE_NOT_READY_FOR, (firing["activeAt"], fired_at)

        # Uncordoned: ready again, and the alert is gone (resolved alerts leave the list).
        r = gw.ctl("uncordon", "node-a")
        assert r.returncode == 0, r.stdout + r.stderr
        wait_until(lambda: prom.alerts("NodeNotReady") == [], 30, "NodeNotReady to resolve", procs)
        assert node_up()[0]["metric"]["state"] == "ready"
    finally:
        for p in reversed(procs):
            p.stop()


def _epoch(rfc3339: str) -> float:
    # Prometheus gives nanoseconds; Python's parser takes at most microseconds.
    head, _, frac = rfc3339.rstrip("Z").partition(".")
    stamp = datetime.fromisoformat(head + "+00:00").timestamp()
    return stamp + (float("0." + frac) if frac else 0.0)
