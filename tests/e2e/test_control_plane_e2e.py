"""`llmgw server` as a control plane: real agents connect over mutual TLS with certificates from `llmgw ctl cert`."""

from __future__ import annotations

import subprocess

import httpx
import pytest
import yaml
from harness import Gateway, free_port, llmgw_cmd, start_agent, wait_until

pytestmark = pytest.mark.e2e


def _ctl(*args: str) -> None:
    r = subprocess.run(llmgw_cmd("ctl", "cert", *args), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_agents_connect_over_mutual_tls_and_a_wrong_certificate_is_refused(tmp_path):
    pki = tmp_path / "pki"
    _ctl("init-ca", "--dir", str(pki))
    _ctl("issue-server", "127.0.0.1", "localhost", "--dir", str(pki))
    _ctl("issue-client", "node-a", "--dir", str(pki))
    _ctl("issue-client", "node-b", "--dir", str(pki))
    agent_port = free_port()
    huge = {
        "name": "huge",
        "source": str(pki / "ca.pem"),
        "scaling": {"min": 0, "max": 1},
        "profiles": [{"engine": "llamacpp", "min_memory_gb": 100000}],
    }
    gw = Gateway(
        tmp_path,
        models=[huge],
        agent_listen=f"127.0.0.1:{agent_port}",
        agent_tls={"ca": str(pki / "ca.pem"), "cert": str(pki / "server.pem"), "key": str(pki / "server-key.pem")},
        control={"enabled": True, "unreachable_after": "1s", "lost_after": "2s"},
        engines={"llamacpp": None},
    ).wait_up(ready=False)
    good = start_agent(tmp_path, "node-a", agent_port, pki)
    # node-c presents node-b's certificate: the control plane refuses it, naming both.
    impostor = start_agent(tmp_path, "node-c", agent_port, pki, cert_node="node-b")

    def node_map() -> dict:
        return {n["node_id"]: n for n in httpx.get(gw.admin + "/api/v1/nodes", headers=gw.admin_auth).json()["nodes"]}

    try:
        nodes = wait_until(
            lambda: m if "node-a" in (m := node_map()) and m["node-a"]["memory"] else None,
            30,
            "node-a to register",
            [good, gw],
        )
        assert nodes["node-a"]["state"] == "ready" and nodes["node-a"]["connected"]
        listing = subprocess.run(
            llmgw_cmd("ctl", "nodes", "--server", gw.admin, "--token-file", str(gw.token_file)),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert listing.returncode == 0 and "node-a" in listing.stdout and "ready" in listing.stdout, listing.stderr
        wait_until(
            lambda: "the certificate is for node-b but the agent claims to be node-c" in impostor.text(),
            15,
            "the impostor's refusal logged",
            [impostor],
        )
        assert "node-c" not in nodes

        def ctl(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run(
                llmgw_cmd(*args, "--server", gw.admin, "--token-file", str(gw.token_file)),
                capture_output=True,
                text=True,
                timeout=60,
            )

        # Logs come through the agent's own stream.
        r = ctl("ctl", "logs", "node-a", "-n", "50")
        assert r.returncode == 0 and "connected to the control plane" in r.stdout, r.stderr
        r = ctl("ctl", "logs", "node-a", "--source", "no-such-shard")
        assert r.returncode == 1 and "no log named no-such-shard" in r.stderr
        # Placement explains itself in words: this node is far too small for the model.
        r = ctl("ctl", "explain-placement", "huge")
        assert r.returncode == 0 and "node-a: not chosen" in r.stdout and "needs 100000" in r.stdout, (
            r.stdout + r.stderr
        )
        # A connected node is not forgotten: only a lost one, or an unreachable one with nothing on it.
        r = ctl("node", "remove", "node-a")
        assert r.returncode == 1 and "ready" in r.stderr
        assert good.stop() == 0, good.text()[-3000:]
        wait_until(lambda: node_map()["node-a"]["state"] == "lost", 15, "node-a to become lost", [gw])
        r = ctl("ctl", "logs", "node-a")
        assert r.returncode == 1 and "not connected" in r.stderr
        r = ctl("node", "remove", "node-a")
        assert r.returncode == 0 and "removed node-a" in r.stdout, r.stderr
        assert all(
            n["node_id"] != "node-a"
            for n in httpx.get(gw.admin + "/api/v1/nodes", headers=gw.admin_auth).json()["nodes"]
        )
    finally:
        if good.alive():
            good.stop()
        assert impostor.stop() == 0, impostor.text()[-3000:]
        assert gw.stop() == 0, gw.text()[-3000:]


def test_control_plane_refuses_to_start_without_its_certificates(tmp_path):
    gw = Gateway(
        tmp_path,
        models=[],
        agent_listen=f"127.0.0.1:{free_port()}",
        agent_tls={"ca": str(tmp_path / "nope.pem"), "cert": str(tmp_path / "s.pem"), "key": str(tmp_path / "k.pem")},
        control={"enabled": True},
    )
    assert gw.proc.wait(30) == 1
    assert "agent_tls:" in gw.text() and "llmgw ctl cert init-ca" in gw.text()


def test_catalog_commands_against_a_running_control_plane(tmp_path, tiny_model):
    declared = {"name": "declared-model", "source": str(tiny_model), "profiles": [{"engine": "llamacpp"}]}
    gw = Gateway(
        tmp_path, models=[declared], agent_listen=f"127.0.0.1:{free_port()}", agent_tls=None, control={"enabled": True}
    ).wait_up(ready=False)

    def ctl(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            llmgw_cmd("ctl", *args, "--server", gw.admin, "--token-file", str(gw.token_file)),
            capture_output=True,
            text=True,
            timeout=60,
        )

    try:
        model = tmp_path / "model.yaml"
        model.write_text(
            yaml.safe_dump(
                {
                    "name": "tiny",
                    "aliases": ["small"],
                    "source": str(tiny_model),
                    "scaling": {"min": 0, "max": 1},
                    "profiles": [{"engine": "llamacpp", "min_memory_gb": 1}],
                }
            )
        )
        r = ctl("model", "add", "-f", str(model))
        assert r.returncode == 0 and "added tiny: on demand" in r.stdout, r.stderr
        r = ctl("models")
        assert r.returncode == 0 and "tiny" in r.stdout and "declared-model" in r.stdout and "server.yaml" in r.stdout
        r = ctl("scale", "tiny", "--min", "2", "--max", "3")
        assert r.returncode == 0 and "min 2, max 3" in r.stdout, r.stderr
        # Declared models are changed in the file, and the refusal says so.
        r = ctl("scale", "declared-model", "--min", "0")
        assert r.returncode == 1 and "declared in server.yaml" in r.stderr
        # A source that does not exist is refused and nothing is added.
        bad = tmp_path / "bad.yaml"
        bad.write_text(
            yaml.safe_dump(
                {"name": "ghost", "source": str(tmp_path / "missing.gguf"), "profiles": [{"engine": "llamacpp"}]}
            )
        )
        r = ctl("model", "add", "-f", str(bad))
        assert r.returncode == 1 and "missing.gguf" in r.stderr
        # An alias already taken is refused.
        dup = tmp_path / "dup.yaml"
        dup.write_text(
            yaml.safe_dump(
                {"name": "other", "aliases": ["small"], "source": str(tiny_model), "profiles": [{"engine": "llamacpp"}]}
            )
        )
        r = ctl("model", "add", "-f", str(dup))
        assert r.returncode == 1 and "small" in r.stderr
        assert "ghost" not in ctl("models", "--json").stdout
        # Run-time models survive a restart of the control plane.
        assert gw.stop() == 0, gw.text()[-3000:]
        gw2 = Gateway(
            tmp_path,
            models=[declared],
            store=gw.store,
            agent_listen=f"127.0.0.1:{free_port()}",
            agent_tls=None,
            control={"enabled": True},
        ).wait_up(ready=False)
        try:
            r = subprocess.run(
                llmgw_cmd("ctl", "models", "--json", "--server", gw2.admin, "--token-file", str(gw2.token_file)),
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert '"tiny"' in r.stdout and '"min": 2' in r.stdout
            r = subprocess.run(
                llmgw_cmd("ctl", "model", "remove", "tiny", "--server", gw2.admin, "--token-file", str(gw2.token_file)),
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert r.returncode == 0 and "removed tiny" in r.stdout
        finally:
            assert gw2.stop() == 0, gw2.text()[-3000:]
    finally:
        if gw.alive():
            gw.stop()
