"""A real `llmgw server` with admin_tls and agent_tls: a node's certificate never opens the admin API,
whatever its name, and an administrator's never joins the fleet as a node."""

from __future__ import annotations

import os
import ssl
import subprocess

import httpx
import pytest

from llmgw.pki import issue_client
from llmgw.testing.pki import issue_unmarked
from tests.e2e.harness import Gateway, free_port, llmgw_cmd, start_agent, wait_until

pytestmark = pytest.mark.e2e


def _cert(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(llmgw_cmd("ctl", "cert", *args), capture_output=True, text=True, timeout=60)


def test_a_node_named_admin_cannot_use_the_admin_api_and_an_administrators_certificate_cannot_join(tmp_path):
    pki = tmp_path / "pki"
    for args in (("init-ca",), ("issue-server", "127.0.0.1"), ("issue-client", "node-a"), ("issue-admin", "admin")):
        r = _cert(*args, "--dir", str(pki))
        assert r.returncode == 0, r.stderr
    # A node named admin, made as issue-client and node add would make it if they allowed the name.
    rogue = tmp_path / "rogue"
    issue_client(pki, rogue, "admin", admin_names=())
    (rogue / "ca.pem").write_bytes((pki / "ca.pem").read_bytes())
    # A node certificate from before node certificates were marked.
    issue_unmarked(pki, pki, "node-old")
    agent_port = free_port()
    tls = {"ca": str(pki / "ca.pem"), "cert": str(pki / "server.pem"), "key": str(pki / "server-key.pem")}
    gw = Gateway(
        tmp_path,
        models=[],
        agent_listen=f"127.0.0.1:{agent_port}",
        agent_tls=tls,
        admin_tls=tls,
        control={"enabled": True},
        engines={"llamacpp": None},
    )
    admin_url = f"https://127.0.0.1:{gw.admin_port}"
    verify = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    wait_until(lambda: httpx.get(admin_url + "/health", verify=verify), 30, "the admin listener", [gw], alive=[gw])

    def ctx(where, name) -> ssl.SSLContext:
        c = ssl.create_default_context(cafile=str(pki / "ca.pem"))
        c.load_cert_chain(str(where / f"{name}.pem"), str(where / f"{name}-key.pem"))
        return c

    agents = []
    try:
        r = httpx.get(admin_url + "/api/v1/nodes", verify=ctx(rogue, "admin"))
        assert r.status_code == 401, r.text
        assert "is a node's" in r.json()["error"]["message"]
        r = httpx.get(admin_url + "/api/v1/nodes", verify=ctx(pki, "node-old"))
        assert r.status_code == 401  # unmarked, and not listed

        # ctl presents the administrator's certificate, with no token anywhere it looks.
        env = {k: v for k, v in os.environ.items() if k != "LLMGW_ADMIN_TOKEN"}
        env |= {
            "XDG_DATA_HOME": str(tmp_path / "no-token"),
            "LLMGW_ADMIN_CA": str(pki / "ca.pem"),
            "LLMGW_ADMIN_CERT": str(pki / "admin.pem"),
            "LLMGW_ADMIN_KEY": str(pki / "admin-key.pem"),
        }

        def ctl_nodes() -> subprocess.CompletedProcess:
            return subprocess.run(
                llmgw_cmd("ctl", "nodes", "--json", "--server", admin_url),
                capture_output=True,
                text=True,
                timeout=60,
                env=env,
            )

        assert ctl_nodes().returncode == 0, ctl_nodes().stderr
        # The rogue certificate as ctl's: refused with the command that makes a real one.
        r = subprocess.run(
            llmgw_cmd("ctl", "nodes", "--server", admin_url),
            capture_output=True,
            text=True,
            timeout=60,
            env=env | {"LLMGW_ADMIN_CERT": str(rogue / "admin.pem"), "LLMGW_ADMIN_KEY": str(rogue / "admin-key.pem")},
        )
        assert r.returncode == 1 and "llmgw ctl cert issue-admin admin" in r.stderr, r.stderr

        # issue-client refuses the name, reading this server's admin_tls.clients, and writes nothing.
        r = _cert("issue-client", "admin", "--dir", str(pki), "--out", str(tmp_path / "x"), "--config", str(gw.config))
        assert r.returncode == 1 and "is an administrator's name" in r.stderr, r.stderr
        assert not (tmp_path / "x").exists()

        # The administrator's certificate claiming to be node admin is refused; node-old, from before the
        # marks, joins (agent_tls.require_node_mark is off) with the server saying what to reissue.
        impostor = start_agent(tmp_path, "admin", agent_port, pki)
        old = start_agent(tmp_path, "node-old", agent_port, pki)
        good = start_agent(tmp_path, "node-a", agent_port, pki)
        agents += [impostor, old, good]
        wait_until(
            lambda: "the certificate for admin is an administrator's, which never joins as a node" in impostor.text(),
            30,
            "the administrator's certificate refused as a node",
            [impostor, gw],
        )
        wait_until(
            lambda: (
                "node node-old joined with a certificate that has no node mark" in gw.text()
                and "llmgw ctl cert issue-client node-old" in gw.text()
            ),
            30,
            "the server to say node-old's certificate needs reissuing",
            [old, gw],
        )
        nodes = wait_until(
            lambda: ids if {"node-a", "node-old"} <= (ids := {n["node_id"] for n in _nodes(ctl_nodes())}) else None,
            30,
            "node-a and node-old to register",
            [good, old, gw],
        )
        assert "admin" not in nodes
    finally:
        for a in agents:
            a.stop()
        gw.stop()


def _nodes(r: subprocess.CompletedProcess) -> list[dict]:
    import json

    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)
