"""`llmgw server init` from the real frozen binary, on a real machine with systemd as PID 1.

One booted Debian machine (tests/e2e/machines.py) gets the binary at /usr/local/bin/llmgw and runs
`server init` over SSH: the user, the authority, the certificate, server.yaml, the store and the
administrator, the admin token and the hardened llmgw-server unit, started by systemd. From the host,
the gateway answers on the machine's address and the agent port presents a certificate the machine's
authority vouches for under that address. A second run changes nothing: no password, every step kept,
no file rewritten, the server not restarted.
"""

from __future__ import annotations

import json
import re
import socket
import ssl

import httpx
import pytest
from cryptography import x509
from harness import BUILD_TIMEOUT

from llmgw.testing.waiting import until

INIT = "llmgw server init --admin admin@example.com --plain --no-mirror --no-node --no-model"
FILES = ("/etc/llmgw/server.yaml", "/etc/llmgw/pki/ca.pem", "/etc/llmgw/server.pem")
# The frozen build may happen in this test's setup (the session fixture): the same limit as test_frozen_binary.py.
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(BUILD_TIMEOUT + 300)]


def _get(url: str) -> str:
    """A one-liner for the machine's python3 (no curl in the minbase root): GET url, print the body."""
    return f"python3 -c \"import urllib.request; print(urllib.request.urlopen('{url}', timeout=5).read().decode())\""


def _step_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if re.match(r"\d+\. ", line)]


def test_server_init_from_the_frozen_binary_runs_the_server_under_systemd_and_a_rerun_changes_nothing(
    frozen_llmgw, machines, tmp_path
):
    (m,) = machines.boot("cp")
    state = machines.ssh("cp", "systemctl is-system-running --wait", check=False).stdout.strip()
    assert state in ("running", "degraded"), machines.ssh("cp", "systemctl --failed", check=False).stdout
    machines.copy_in("cp", frozen_llmgw, "/usr/local/bin/llmgw")
    machines.ssh("cp", "chmod 0755 /usr/local/bin/llmgw")

    def journal() -> str:
        return machines.ssh("cp", "journalctl -u llmgw-server --no-pager -n 60", check=False).stdout

    first = machines.ssh("cp", INIT, check=False, timeout=300)
    out = first.stdout + first.stderr
    assert first.exit_status == 0, f"server init exited {first.exit_status}:\n{out}\n{journal()}"
    assert len(_step_lines(first.stdout)) == 11, out  # 7, 9, 10 and 11 skipped by the --no-… flags
    passwords = re.findall(r"administrator admin@example\.com, password[^:]*: (\S+)", out)
    assert len(passwords) == 1 and len(passwords[0]) >= 16, out

    # systemd runs the hardened unit as llmgw, and it answers inside the machine.
    assert machines.ssh("cp", "systemctl is-active llmgw-server", check=False).stdout.strip() == "active", journal()
    assert machines.ssh("cp", "ps -o user= -p $(systemctl show -p MainPID --value llmgw-server)").stdout.strip() == (
        "llmgw"
    )
    for port in (9090, 8080):
        body = machines.ssh("cp", _get(f"http://127.0.0.1:{port}/health")).stdout
        assert json.loads(body)["status"] == "ok", body
    # `llmgw ctl` on the machine reaches the admin API with the token init made (data_dir/admin-token).
    nodes = machines.ssh("cp", "llmgw ctl nodes", check=False)
    assert nodes.exit_status == 0, f"{nodes.stdout}{nodes.stderr}\n{journal()}"

    # From the host: the gateway's client port on the machine's bridge address.
    r = until(
        lambda: httpx.get(f"http://{m.address}:8080/health", timeout=5),
        30.0,
        f"the gateway's /health on {m.address}:8080 from the host",
        ignore=(httpx.HTTPError,),
    )
    assert r.status_code == 200 and r.json()["status"] == "ok", r.text

    # The server certificate names the machine's address and verifies against its authority.
    ca = tmp_path / "ca.pem"
    ca.write_text(machines.ssh("cp", "cat /etc/llmgw/pki/ca.pem").stdout)
    cert = x509.load_pem_x509_certificate(machines.ssh("cp", "cat /etc/llmgw/server.pem").stdout.encode())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert m.address in {str(a) for a in san.get_values_for_type(x509.IPAddress)}, san
    assert "cp" in san.get_values_for_type(x509.DNSName), san
    ctx = ssl.create_default_context(cafile=str(ca))  # checks the chain and that the cert names m.address
    with socket.create_connection((m.address, 7443), timeout=10) as raw:
        try:
            with ctx.wrap_socket(raw, server_hostname=m.address) as tls:
                peer = tls.getpeercert()
        except ssl.SSLCertVerificationError:
            raise
        except ssl.SSLError as exc:  # TLS 1.2: the server asks for a client certificate and ends it here
            assert "CERTIFICATE" in str(exc).upper(), exc
            peer = None
    if peer is not None:
        assert ("IP Address", m.address) in peer["subjectAltName"], peer

    stamps = machines.ssh("cp", "stat -c '%n %Y %i' " + " ".join(FILES)).stdout
    pid = machines.ssh("cp", "systemctl show -p MainPID --value llmgw-server").stdout.strip()
    assert pid.isdigit() and pid != "0", pid

    # The same command again: nothing to do.
    second = machines.ssh("cp", INIT, check=False, timeout=300)
    out2 = second.stdout + second.stderr
    assert second.exit_status == 0, f"the rerun exited {second.exit_status}:\n{out2}\n{journal()}"
    assert "password" not in out2, out2
    steps = _step_lines(second.stdout)
    assert len(steps) == 11, out2
    skipped = {line for line in _step_lines(first.stdout) if line.split(".")[0] in ("7", "9", "10", "11")}
    for line in steps:
        assert "kept" in line or "exists" in line or line in skipped, f"a rerun changed something: {line}\n{out2}"
    assert "done: nothing changed." in second.stdout, out2
    assert machines.ssh("cp", "stat -c '%n %Y %i' " + " ".join(FILES)).stdout == stamps
    assert machines.ssh("cp", "systemctl show -p MainPID --value llmgw-server").stdout.strip() == pid
    assert machines.ssh("cp", "systemctl is-active llmgw-server", check=False).stdout.strip() == "active", journal()
