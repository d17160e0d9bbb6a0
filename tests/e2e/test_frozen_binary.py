"""The one-file `llmgw` built by build/pyinstaller.spec runs every role on its own.

It is built fresh into a temporary folder (a couple of minutes), then run from a folder
outside the checkout with no PYTHON* variables, so nothing can come from the source tree
or the installed package: `--version`, `server` (store migrations, SQLite driver, uvloop,
metrics), `keys create`, an authenticated request, a clean stop on SIGTERM, the tenancy
commands (argon2) and the mirror's GGUF check (its architecture list is a data file).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml
from harness import BUILD_TIMEOUT

import llmgw
from llmgw.testing.waiting import until

# Whichever test runs first builds the binary in its fixture setup, which pytest-timeout
# counts: the build's own limit, and then some for the test.
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(BUILD_TIMEOUT + 300)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _clean_env() -> dict[str, str]:
    """The environment without anything that could point Python at the checkout."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}


def test_the_frozen_binary_prints_the_version_of_the_source_it_was_built_from(
    frozen_llmgw: Path, tmp_path: Path
) -> None:
    r = subprocess.run(
        [str(frozen_llmgw), "--version"],
        cwd=tmp_path,
        env=_clean_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"llmgw --version exited {r.returncode}:\n{out}"
    lines = r.stdout.strip().splitlines()
    assert lines and lines[-1].strip().endswith(f"v{llmgw.__version__}"), out


def test_certificate_authority_and_agent_inventory(frozen_llmgw: Path, tmp_path: Path) -> None:
    # The roles beyond the gateway pull in cryptography and discovery; both must be bundled.
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(frozen_llmgw), *args],
            cwd=tmp_path,
            env=_clean_env(),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=120,
        )

    pki = tmp_path / "pki"
    for args in (
        ("ctl", "cert", "init-ca", "--dir", str(pki)),
        ("ctl", "cert", "issue-client", "node-a", "--dir", str(pki)),
        ("agent", "inventory", "--json"),
    ):
        r = run(*args)
        assert r.returncode == 0, f"llmgw {' '.join(args)} exited {r.returncode}:\n{r.stdout}{r.stderr}"
    assert (pki / "ca.pem").exists() and (pki / "node-a.pem").exists()
    assert '"memory"' in r.stdout

    # node add runs the pushed binary's doctor on each node and reads its JSON back.
    r = run("doctor", "--json")
    assert r.returncode == 0, f"llmgw doctor --json exited {r.returncode}:\n{r.stdout}{r.stderr}"
    report = json.loads(r.stdout)
    assert report["findings"] and report["facts"]["inventory"]["memory"]


def test_tenancy_and_the_mirrors_architecture_check(frozen_llmgw: Path, tmp_path: Path) -> None:
    # argon2 (a compiled extension) for passwords, and the GGUF architecture list, a data
    # file the mirror reads: both must be in the bundle.
    import gguf as gguf_lib
    import numpy as np
    from harness import serve_files

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(frozen_llmgw), *args],
            cwd=tmp_path,
            env=_clean_env(),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=120,
        )

    store = str(tmp_path / "t.db")
    for args in (
        ("org", "add", "org", "Acme", "--store", store),
        ("users", "create", "ann@example.com", "--password", "correct horse", "--store", store),
    ):
        r = run(*args)
        assert r.returncode == 0, f"llmgw {' '.join(args)} exited {r.returncode}:\n{r.stdout}{r.stderr}"

    w = gguf_lib.GGUFWriter(str(tmp_path / "foo.gguf"), "foo")
    w.add_tensor("t", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    base, stop = serve_files({"/foo.gguf": (tmp_path / "foo.gguf").read_bytes()})
    try:
        # The stand-in is on loopback, which the mirror fetches from only when told.
        r = run(
            "mirror",
            "--dir",
            str(tmp_path / "mirror"),
            "add",
            f"{base}/foo.gguf",
            "--model",
            "foo",
            "--version",
            "v1",
            "--allow-local-sources",
        )
    finally:
        stop()
    assert r.returncode == 1 and "cannot load architecture 'foo'" in r.stderr, r.stdout + r.stderr


class _Server:
    """`<frozen llmgw> server` with its output in a file, for the failure messages."""

    def __init__(self, binary: Path, config: Path, workdir: Path) -> None:
        self.log = workdir / "server.log"
        # The server holds its own copy of the log's descriptor; ours is closed once it is started.
        with open(self.log, "wb") as logf:
            self.proc = subprocess.Popen(
                [str(binary), "server", "--config", str(config)],
                cwd=workdir,
                env=_clean_env(),
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
            )

    def output(self) -> str:
        text = self.log.read_text(errors="replace")
        return f"--- server output (exit code {self.proc.poll()}) ---\n{text[-8000:]}"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def test_server_keys_and_stop(frozen_llmgw: Path, tmp_path: Path) -> None:
    port, admin_port, engine_port = _free_port(), _free_port(), _free_port()
    url, admin = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}"
    config = tmp_path / "server.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "listen": f"127.0.0.1:{port}",
                "admin_listen": f"127.0.0.1:{admin_port}",
                "metrics_listen": None,
                # A second serving process: the one-file build starts itself as the worker.
                "workers": 2,
                "auth": {"store": str(tmp_path / "llmgw.db")},
                # Nothing listens there: the gateway is up but not ready.
                "models": [
                    {
                        "name": "frozen-model",
                        "endpoints": [{"url": f"http://127.0.0.1:{engine_port}", "engine": "vllm"}],
                    }
                ],
            },
            sort_keys=False,
        )
    )

    server = _Server(frozen_llmgw, config, tmp_path)
    try:
        # Up: /health on the client listener. The first start extracts the bundle and
        # migrates the store, so give it time.
        until(
            lambda: httpx.get(url + "/health", timeout=2.0).status_code == 200,
            60,
            "/health to answer 200",
            detail=server.output,
            alive=[server.proc],
            ignore=(httpx.HTTPError,),
            interval=0.2,
        )

        r = httpx.get(url + "/ready", timeout=5.0)
        assert r.status_code == 503, f"/ready answered {r.status_code} with no engine: {r.text}\n{server.output()}"

        # The admin listener wants the token the frozen server made at its first start; the frozen
        # ctl finds it in data_dir (the store's directory) and reads the API through it.
        r = httpx.get(admin + "/metrics", timeout=5.0)
        assert r.status_code == 401, f"admin /metrics answered {r.status_code} without a token"
        token = (tmp_path / "admin-token").read_text().strip()
        r = httpx.get(admin + "/metrics", timeout=5.0, headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 200 and "llmgw_" in r.text, (
            f"admin /metrics answered {r.status_code}: {r.text[:2000]}\n{server.output()}"
        )
        until(
            lambda: (
                "llmgw_workers 2.0" in httpx.get(admin + "/metrics", headers={"Authorization": f"Bearer {token}"}).text
            ),
            60,
            "the frozen server's second worker to listen",
            detail=server.output,
            alive=[server.proc],
        )
        c = subprocess.run(
            [
                str(frozen_llmgw),
                "ctl",
                "models",
                "--json",
                "--server",
                admin,
                "--token-file",
                str(tmp_path / "admin-token"),
            ],
            cwd=tmp_path,
            env=_clean_env(),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert c.returncode != 0 and "not a control plane" in c.stderr, (
            f"ctl models against a plain gateway:\n{c.stdout}{c.stderr}"
        )

        # A key made by the same binary, against the same store, while the server runs.
        k = subprocess.run(
            [str(frozen_llmgw), "keys", "create", "--name", "frozen", "--config", str(config)],
            cwd=tmp_path,
            env=_clean_env(),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert k.returncode == 0, f"keys create exited {k.returncode}:\n{k.stdout}{k.stderr}\n{server.output()}"
        lines = k.stdout.strip().splitlines()
        secret = lines[-1].strip() if lines else ""
        assert secret.startswith("llmgw-"), f"keys create printed no secret:\n{k.stdout}{k.stderr}"

        # The server reads the key table every second.
        def models() -> httpx.Response | None:
            r = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {secret}"}, timeout=5.0)
            return r if r.status_code == 200 else None

        r = until(
            models, 10, "/v1/models to accept the new key", detail=server.output, alive=[server.proc], interval=0.2
        )
        assert r.status_code == 200, (
            f"/v1/models with the new key answered {r.status_code}: {r.text}\n{server.output()}"
        )
        ids = [m.get("id") for m in r.json().get("data", [])]
        assert "frozen-model" in ids, f"/v1/models lists {ids}\n{server.output()}"

        # SIGTERM to the bootloader reaches the server, which drains and exits 0.
        server.proc.send_signal(signal.SIGTERM)
        try:
            code = server.proc.wait(20)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the server did not exit within 20s of SIGTERM\n{server.output()}")
        assert code == 0, f"the server exited {code} after SIGTERM\n{server.output()}"
    finally:
        server.close()
