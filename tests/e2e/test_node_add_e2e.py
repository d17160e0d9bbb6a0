"""From three empty machines to a serving cluster over SSH, with the real frozen binary and real systemd.

Machines booted with systemd-nspawn (tests/e2e/machines.py) have no internet. On the first, `server init`
makes the control plane with its mirror beside it; llama.cpp is the build cached on this host, given as
a release archive with --llamacpp-archive; the starter model falls back to the tiny model, pinned to the
control plane's own node. From it, `node add root@b root@c` pushes its own binary to both over SFTP and runs
doctor there: c's weights directory is full for real (a 1 MB tmpfs), so c is refused with the fix and
nothing on it is changed, while b joins over mutual TLS and installs llama.cpp from the mirror. After the
fix, c joins too. A chat completion through the control plane's gateway from this host with the openai
SDK; `node add` again on b leaves its engine running (the same pid, adopted); a changed host key is
refused; `node remove --purge` takes the agent off a node; `server init` run again changes nothing.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from harness import BUILD_TIMEOUT

from llmgw.agent.provision.archive import pack_llama_server
from llmgw.config.server import DEFAULT_LLAMACPP
from llmgw.testing.waiting import until

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(BUILD_TIMEOUT + 900)]

INIT = "llmgw server init --admin admin@example.com --plain --llamacpp-archive /root/llama.tar.gz"


@pytest.fixture
def llama_archive(tmp_path) -> Path:
    from llmgw.agent.provision.llamacpp_source import find_llama_server

    binary = find_llama_server()
    if binary is None:
        pytest.fail("no llama-server: scripts/build-llama-server builds it (scripts/test does)")
    path = tmp_path / "llama.tar.gz"
    path.write_bytes(pack_llama_server(binary, DEFAULT_LLAMACPP))
    return path


def test_three_empty_machines_become_a_cluster_with_server_init_and_node_add(
    frozen_llmgw, machines, llama_archive, tmp_path
):
    a, b, c = machines.boot("a", "b", "c")
    for name in ("a", "b", "c"):
        until(
            lambda n=name: (
                machines.ssh(n, "systemctl is-system-running", check=False).stdout.strip() in ("running", "degraded")
            ),
            60,
            f"{name} to finish booting",
        )
    machines.copy_in("a", frozen_llmgw, "/usr/local/bin/llmgw")
    machines.ssh("a", "chmod 0755 /usr/local/bin/llmgw")
    machines.copy_in("a", llama_archive, "/root/llama.tar.gz")
    # The control plane logs in to the others with the test key, as an operator's own key.
    machines.copy_in("a", machines.key, "/root/.ssh/id_ed25519")
    machines.ssh("a", "chmod 0600 /root/.ssh/id_ed25519")

    def on_a(cmd: str, timeout: float = 600) -> tuple[int, str]:
        r = machines.ssh("a", cmd, check=False, timeout=timeout)
        return r.exit_status, r.stdout + r.stderr

    def journal(name: str, unit: str) -> str:
        return machines.ssh(name, f"journalctl -u {unit} --no-pager -n 80", check=False).stdout

    # ---- the control plane, its mirror, its own node and the tiny model
    rc, out = on_a(INIT, timeout=900)
    assert rc == 0, f"server init exited {rc}:\n{out}\n{journal('a', 'llmgw-agent')}\n{journal('a', 'llmgw-server')}"
    assert re.search(r"^9\. .*llama\.cpp/" + DEFAULT_LLAMACPP, out, re.M), out
    assert re.search(r"^10\. .*a joined with llama\.cpp", out, re.M), out
    assert re.search(r"^11\. .*tiny-test.*it serves", out, re.M), out

    # ---- c's weights directory is full for real: doctor FAILs there and node add stops with the fix
    machines.ssh("c", "mkdir -p /var/lib/llmgw-weights && mount -t tmpfs -o size=1m tmpfs /var/lib/llmgw-weights")
    rc, out = on_a(f"llmgw node add root@{b.address} root@{c.address} --plain", timeout=900)
    assert rc == 1, out
    assert "added: b" in out, f"{out}\n{journal('b', 'llmgw-agent')}"
    assert re.search(rf"not added: {re.escape(c.address)}: doctor on .*FAIL disk", out), out
    assert "free space on the filesystem" in out  # the fix
    assert machines.ssh("c", "test -e /etc/llmgw/agent.yaml", check=False).exit_status != 0  # nothing changed
    machines.ssh("c", "umount /var/lib/llmgw-weights")
    rc, out = on_a(f"llmgw node add root@{c.address} --plain", timeout=600)
    assert rc == 0 and "added: c" in out, f"{out}\n{journal('c', 'llmgw-agent')}"

    # Both joined over mutual TLS and installed llama.cpp from the control plane's mirror.
    rc, out = on_a("llmgw ctl nodes --json")
    assert rc == 0, out
    nodes = {n["node_id"]: n for n in json.loads(out)}
    for name in ("a", "b", "c"):
        assert nodes[name]["state"] == "ready" and "llamacpp" in (nodes[name].get("engines") or {}), nodes
    for name in ("b", "c"):  # the install record names where the archive came from
        r = machines.ssh(name, f"grep -rl 'http://{a.address}:8081/llama.cpp/' /opt/llmgw/engines", check=False)
        assert r.exit_status == 0, (r.stdout, r.stderr, journal(name, "llmgw-agent"))

    # ---- a chat completion through the control plane's gateway, from this host
    import openai
    from openai import OpenAI

    made = machines.ssh("a", "llmgw keys create e2e --project default/default/default --config /etc/llmgw/server.yaml")
    key = made.stdout.strip().splitlines()[-1]  # the secret, alone on stdout's last line
    client = OpenAI(base_url=f"http://{a.address}:8080/v1", api_key=key, max_retries=0, timeout=60)
    # The running gateway learns a key made in the store within its refresh (two seconds).
    reply = until(
        lambda: client.chat.completions.create(
            model="tiny-test", messages=[{"role": "user", "content": "hello"}], max_tokens=8
        ),
        30,
        "the gateway to accept the new key and answer",
        ignore=(openai.AuthenticationError,),
        interval=0.5,
    )
    assert reply.choices[0].message.content is not None and reply.usage and reply.usage.completion_tokens > 0

    # ---- an engine on b, then node add again on b: the restarted agent adopts it (the same pid)
    model = (
        "name: tiny-b\n"
        f"source: http://{a.address}:8081/tiny-test/v1/{_tiny_file(on_a)}\n"
        "scaling: {min: 1}\n"
        "profiles: [{engine: llamacpp, name: cpu}]\n"
    )
    rc, out = on_a(
        "cordon() { llmgw ctl cordon $1 >/dev/null; }; cordon a && cordon c && cat > /root/tiny-b.yaml <<'EOF'\n"
        + model
        + "EOF\nllmgw ctl model add -f /root/tiny-b.yaml"
    )
    assert rc == 0, out

    def pid_on_b() -> int | None:
        _, text = on_a("llmgw ctl replicas --json")
        for r in json.loads(text):
            if r["model"] == "tiny-b" and r["state"] == "ready":
                return next((s.get("pid") for s in r.get("shards") or [] if s.get("node") == "b"), None)
        return None

    before = until(pid_on_b, 300, "tiny-b to serve on b")
    rc, out = on_a(f"llmgw node add root@{b.address} --plain", timeout=600)
    assert rc == 0 and "added: b" in out, out
    after = until(pid_on_b, 120, "tiny-b to be adopted on b")
    assert after == before, (before, after, journal("b", "llmgw-agent"))

    # ---- node remove --purge: refused while a replica is on the node; c (nothing on it) is purged and forgotten
    rc, out = on_a("llmgw node remove b --purge")
    assert rc == 1 and "drain it first" in out and "tiny-b" in out, out
    rc, out = on_a("llmgw node remove c --purge", timeout=300)
    assert rc == 0 and "removed c" in out, out
    left = machines.ssh(
        "c", "ls /etc/llmgw /usr/local/bin/llmgw /opt/llmgw/engines 2>&1; systemctl is-active llmgw-agent", check=False
    )
    assert "No such file" in left.stdout and left.stdout.strip().endswith(("inactive", "unknown")), left.stdout
    rc, out = on_a("llmgw ctl nodes --json")
    assert "c" not in {n["node_id"] for n in json.loads(out)}, out

    # ---- a changed host key is refused before anything is sent
    machines.change_host_key("c")
    rc, out = on_a(f"llmgw node add root@{c.address} --plain", timeout=300)
    assert rc == 1 and "changed since it was first seen" in out and "ssh-keygen" in out, out

    # ---- server init again changes nothing
    rc, out = on_a(INIT, timeout=600)
    assert rc == 0 and "done: nothing changed." in out and "password (printed only now" not in out, out


def _tiny_file(on_a) -> str:
    _, out = on_a("ls /srv/models/tiny-test/v1/")
    return out.split()[0]
