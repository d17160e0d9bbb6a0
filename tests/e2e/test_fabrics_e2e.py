"""Fabrics end to end: a real `llmgw server` and two real `llmgw agent` processes over
mutual TLS, on machines whose InfiniBand adapters are sysfs trees and whose
infiniband-diags and perftest are scripts printing the fixtures (llmgw/testing/ib_machine.py).

What runs for real: the agents' discovery, their subnet-manager reads once a
(short) interval, their `ibnetdiscover` and `ib_write_bw` runs with the retries;
the stream; the control plane's fabric identity, scans, map and test; the admin
API, `llmgw ctl fabric-test` and the Prometheus metrics. What does not: an
adapter, a switch, a subnet manager, RDMA traffic.
"""

from __future__ import annotations

import subprocess

import httpx
from harness import Gateway, llmgw_cmd, start_agent

from llmgw.testing.ib_machine import FIXTURES, SM_A, SM_B, Tools, map_guids, write_adapter
from llmgw.testing.ports import free_port
from llmgw.testing.waiting import until

MASTER_A, MASTER_B = SM_A, SM_B
FABRIC = f"ib:{MASTER_A}"
DEVICES = ("mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3")


def _ctl(*args: str) -> None:
    r = subprocess.run(llmgw_cmd("ctl", "cert", *args), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def _metric(text: str, name: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith(name + "{")]


def test_two_agents_report_their_fabric_map_it_test_its_rails_and_show_a_failover(tmp_path):
    pki = tmp_path / "pki"
    _ctl("init-ca", "--dir", str(pki))
    _ctl("issue-server", "127.0.0.1", "localhost", "--dir", str(pki))
    for node in ("node-a", "node-b"):
        _ctl("issue-client", node, "--dir", str(pki))

    tools = Tools(tmp_path / "tools")
    master = tmp_path / "master"
    master.write_text("A")
    tools.add_diags(master)
    tools.add_ibnetdiscover()
    tools.add_ib_write_bw(slow=("mlx5_2",), refuse_first=True)
    guids = map_guids((FIXTURES / "fabric" / "ibnetdiscover_fat_tree.txt").read_text())

    agent_port, metrics_port = free_port(), free_port()
    gw = Gateway(
        tmp_path,
        models=[],
        agent_listen=f"127.0.0.1:{agent_port}",
        agent_tls={"ca": str(pki / "ca.pem"), "cert": str(pki / "server.pem"), "key": str(pki / "server-key.pem")},
        metrics_listen=f"127.0.0.1:{metrics_port}",
        control={"enabled": True, "fabric_scan_interval": "2s"},
        engines={"llamacpp": None},  # no engine to install: these nodes only carry fabrics
    )
    procs = [gw]
    try:
        for node in ("node-a", "node-b"):
            ib_root = tmp_path / node / "sys-class-infiniband"
            for dev in DEVICES:
                write_adapter(ib_root, dev, guids[node][dev], counters={"symbol_error": 3} if dev == "mlx5_1" else {})
            procs.append(
                start_agent(
                    tmp_path,
                    node,
                    agent_port,
                    pki,
                    extra={
                        "discovery": {"ib_root": str(ib_root)},
                        "fabrics": [{"name": "rail", "hcas": list(DEVICES)}],
                        "subnet_manager_interval": "1s",
                        "mgmt_addr": "127.0.0.1",
                    },
                    env={"PATH": f"{tools.bin}:/usr/bin:/bin"},
                )
            )
        gw.wait_up(ready=False)
        api = httpx.Client(base_url=gw.admin, headers=gw.admin_auth, timeout=30)

        def fabric() -> dict | None:
            got = api.get("/api/v1/fabrics").json()
            rows = [f for f in got["fabrics"] if f["id"] == FABRIC]
            return rows[0] if rows else None

        # Both nodes' eight ports on one fabric named by the lowest SM GUID, and its map.
        row = until(
            lambda: (f := fabric()) and len(f["members"]) == 8 and (f.get("map") or {}).get("switches") and f,
            60,
            "the fabric with both nodes' ports and a map",
            procs,
        )
        assert row["declared"] == ["rail"]
        assert row["master"]["guid"] == MASTER_A
        assert sorted(m["state"] for m in row["managers"]) == ["master", "standby"]
        assert (row["map"]["switches"], row["map"]["adapters"], row["map"]["cables"]) == (6, 32, 64)
        assert row["map"]["node"] in ("node-a", "node-b") and row["map"]["rails_aligned"] is True
        topo = api.get(f"/api/v1/fabrics/{FABRIC}/topology").json()
        assert sorted(set(topo["llmgw_nodes"].values())) == ["node-a", "node-b"]
        assert ["-C", row["map"]["hca"], "-P", "1"] in tools.calls("ibnetdiscover")
        assert api.get("/api/v1/fabrics/ib:0x0000000000000001/topology").status_code == 404

        # The metrics: the master, its standby, the error counter.
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        text = httpx.get(metrics_url).text
        assert f'llmgw_fabric_master_sm{{fabric="{FABRIC}",sm_guid="{MASTER_A}"}} 1.0' in text
        assert f'llmgw_fabric_subnet_managers{{fabric="{FABRIC}",state="standby"}} 1.0' in text
        assert any('counter="symbol_error"' in ln for ln in _metric(text, "llmgw_ib_port_counter_total"))

        # ctl fabric-test: four rails, mlx5_2 slow, so it exits 1; the first client of each
        # rail found no server listening and was retried.
        r = gw.ctl("fabric-test", "node-a", "node-b", "--seconds", "1", timeout=300)
        assert r.returncode == 1, r.stdout + r.stderr
        assert "node-a → node-b on rail" in r.stdout
        lines = {ln.split()[0]: ln for ln in r.stdout.splitlines() if ln.startswith("mlx5_")}
        assert sorted(lines) == list(DEVICES)
        assert "390.1 Gb/s" in lines["mlx5_0"] and " ok " in lines["mlx5_0"] and "97% of 400 Gb/s" in lines["mlx5_0"]
        assert " slow " in lines["mlx5_2"] and "211.5 Gb/s" in lines["mlx5_2"]
        assert "not every rail passed" in r.stderr
        clients = [c for c in tools.calls("ib_write_bw") if c[-1] == "127.0.0.1"]
        assert len(clients) == 8, "each rail's client tried twice: refused, then through"

        # A test asked of a fabric one node does not advertise is refused at once, in words.
        r = gw.ctl("fabric-test", "node-a", "node-b", "--fabric", "storage")
        assert r.returncode == 1 and "does not advertise fabric 'storage'" in r.stderr

        # The standby takes over: the fabric keeps its name, the change is a problem and
        # the master metric moves.
        master.write_text("B")

        def master_changed() -> list[dict]:
            return [p for p in api.get("/api/v1/fabrics").json()["problems"] if p["kind"] == "master_changed"]

        # The change counts once both nodes' ports name the new master (each reads once a second).
        changed = until(master_changed, 60, "the master change to be a problem", procs)
        assert fabric()["master"]["guid"] == MASTER_B
        assert changed and changed[0]["fabric"] == FABRIC and changed[0]["fix"]
        text = httpx.get(metrics_url).text
        assert f'llmgw_fabric_master_sm{{fabric="{FABRIC}",sm_guid="{MASTER_B}"}} 1.0' in text
        assert 'llmgw_fabric_problems{kind="master_changed",level="warn"} 1.0' in text
        assert [c["old_guid"] for c in fabric()["master_changes"]] == [MASTER_A]
    finally:
        for p in reversed(procs):
            p.stop()
