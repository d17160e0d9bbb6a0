"""Real processes for end-to-end tests: llama-server engines and `llmgw server`."""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from llmgw.testing.ports import free_port
from llmgw.testing.waiting import until

REPO = Path(__file__).resolve().parents[2]
# Seconds the frozen-binary build (the session fixture frozen_llmgw in conftest.py) may take.
BUILD_TIMEOUT = 15 * 60


def require(what: str, reason: str) -> None:
    """Skip when something is missing, except where the run demands the full suite (CI)."""
    if os.environ.get("LLMGW_REQUIRE_E2E") == "1":
        pytest.fail(f"{what} is required for this run: {reason}")
    pytest.skip(reason)


def wait_http(
    url: str, proc: subprocess.Popen | None, timeout: float, log: Path | None = None, status: int = 200
) -> None:
    """Poll ``url`` until it answers ``status``; fail at once if ``proc`` exits, with the log's tail."""
    last: list = [None]

    def answered() -> bool:
        last[0] = httpx.get(url, timeout=2.0).status_code
        return last[0] == status

    def detail() -> str:
        tail = log.read_text(errors="replace")[-3000:] if log and log.exists() else ""
        code = f"exit status {proc.returncode}; " if proc is not None and proc.returncode is not None else ""
        return f"{code}last status: {last[0]}\n{tail}"

    until(
        answered,
        timeout,
        f"{url} to answer {status}",
        detail=detail,
        alive=[proc] if proc is not None else [],
        ignore=(httpx.HTTPError,),
        interval=0.1,
    )


class Proc:
    def __init__(self, cmd: list[str], log: Path, env: dict | None = None, cwd: Path | None = None) -> None:
        self.cmd = cmd
        self.log = log
        # The child holds its own copy of the log's descriptor; ours is closed once it is started.
        with open(log, "ab") as logf:
            self.proc = subprocess.Popen(
                cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=cwd
            )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        if self.alive():
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired as exc:
                self.proc.kill()
                self.proc.wait(5)
                raise AssertionError(f"{self.cmd[0]} did not stop within {timeout}s of signal {sig}") from exc
        return self.proc.returncode

    def text(self) -> str:
        return self.log.read_text(errors="replace")


class Prometheus(Proc):
    """Debian's real ``prometheus``, scraping the given targets every second into a fresh database."""

    def __init__(self, workdir: Path, targets: list[str], job: str = "llmgw") -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            require("Prometheus", "prometheus is not installed (apt-get install prometheus; scripts/test does)")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        home = workdir / f"prometheus-{self.port}"
        home.mkdir()
        config = home / "prometheus.yml"
        config.write_text(
            yaml.safe_dump(
                {
                    "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                    "scrape_configs": [{"job_name": job, "static_configs": [{"targets": targets}]}],
                }
            )
        )
        cmd = [
            str(binary),
            f"--config.file={config}",
            f"--storage.tsdb.path={home / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
        ]
        super().__init__(cmd, workdir / f"prometheus-{self.port}.log")

    def wait_ready(self, timeout: float = 60.0) -> Prometheus:
        wait_http(self.url + "/-/ready", self.proc, timeout, self.log)
        return self

    def samples(self, query: str, seconds: float = 600) -> int:
        """How many samples ``query`` has over the last ``seconds``, summed over its series."""
        now = time.time()
        r = httpx.get(
            self.url + "/api/v1/query_range",
            params={"query": query, "start": now - seconds, "end": now, "step": 1},
            timeout=10,
        ).json()
        return sum(len(s["values"]) for s in r["data"]["result"])


class LlamaServer(Proc):
    def __init__(self, binary: Path, model: Path, workdir: Path, alias: str, extra: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            str(binary),
            "--model",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--ctx-size",
            "2048",
            "--parallel",
            "2",
            "--jinja",
            "--metrics",
            "--alias",
            alias,
            "--threads",
            "1",
            *extra,
        ]
        super().__init__(cmd, workdir / f"llama-server-{self.port}.log")

    def wait_ready(self, timeout: float = 120.0) -> LlamaServer:
        wait_http(self.url + "/health", self.proc, timeout, self.log)
        return self


def kill_engines(pids: list[int]) -> None:
    """Agents leave their engines running on purpose (a restarted agent adopts them); a test must not:
    each engine's process group is killed."""
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def llmgw_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "llmgw.cli.main", *args]


class Gateway(Proc):
    """`llmgw server` in its own process, with a server.yaml written for the test."""

    def __init__(self, workdir: Path, models: list[dict], store: str | None = None, **overrides) -> None:
        self.port, self.admin_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin = f"http://127.0.0.1:{self.admin_port}"
        self.store = store or str(workdir / "llmgw.db")
        cfg = {
            "listen": f"127.0.0.1:{self.port}",
            # One process unless a test asks for workers: the suite's time does not grow with the cores.
            "workers": 1,
            "admin_listen": f"127.0.0.1:{self.admin_port}",
            "metrics_listen": None,
            "auth": {"enabled": True, "store": self.store},
            # The admin token is made here at the first start (data_dir/admin-token).
            "data_dir": str(workdir),
            "router": {"scrape_interval": "250ms", "breaker": {"failures": 2, "cooldown": "30s"}},
            "usage": {"flush_interval": "200ms"},
            "models": models,
        }
        for k, v in overrides.items():
            if isinstance(v, dict) and isinstance(cfg.get(k), dict):
                cfg[k] = {**cfg[k], **v}
            else:
                cfg[k] = v
        self.config = workdir / f"server-{self.port}.yaml"
        self.config.write_text(yaml.safe_dump(cfg, sort_keys=False))
        super().__init__(llmgw_cmd("server", "--config", str(self.config)), workdir / f"gateway-{self.port}.log")

    def wait_up(self, timeout: float = 30.0, ready: bool = True) -> Gateway:
        wait_http(self.admin + "/health", self.proc, timeout, self.log)
        if ready:
            wait_http(self.url + "/ready", self.proc, timeout, self.log)
        return self

    @property
    def token_file(self) -> Path:
        """The admin token the server made at its first start."""
        return Path(yaml.safe_load(self.config.read_text())["data_dir"]) / "admin-token"

    @property
    def admin_auth(self) -> dict[str, str]:
        """Headers that open the admin API."""
        return {"Authorization": f"Bearer {self.token_file.read_text().strip()}"}

    def ctl(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """`llmgw ctl ARGS` against this server's admin API, with its token."""
        return subprocess.run(
            llmgw_cmd("ctl", *args, "--server", self.admin, "--token-file", str(self.token_file)),
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def keys(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            llmgw_cmd("keys", *args, "--config", str(self.config)), capture_output=True, text=True, timeout=60
        )

    def create_key(self, name: str = "test") -> str:
        """A new key, returned once the running server accepts it (it polls the store every second)."""
        r = self.keys("create", "--name", name)
        assert r.returncode == 0, r.stderr
        secret = r.stdout.strip().splitlines()[-1]
        auth = {"Authorization": f"Bearer {secret}"}
        until(
            lambda: httpx.get(self.url + "/v1/models", headers=auth).status_code != 401,
            10,
            "the server to accept a new key",
            [self],
        )
        return secret


def start_agent(
    tmp_path: Path,
    name: str,
    port: int | list[int],
    pki: Path,
    *,
    cert_node: str | None = None,
    supervisor: dict | None = None,
    extra: dict | None = None,
    env: dict[str, str] | None = None,
) -> Proc:
    """`llmgw agent` as node NAME dialling 127.0.0.1:PORT (or each of a list of ports in turn: control
    planes that share a store) with the certificate of CERT_NODE (default NAME: another node's
    certificate makes an impostor), fast heartbeats and reconnects, files under tmp_path/NAME, no GPUs.
    ``extra`` is merged into agent.yaml (a block into its block); ``env`` into the environment."""
    cert = cert_node or name
    cfg = tmp_path / f"agent-{name}.yaml"
    where = {"servers": [f"127.0.0.1:{p}" for p in port]} if isinstance(port, list) else {"server": f"127.0.0.1:{port}"}
    cfg.write_text(
        yaml.safe_dump(
            {
                **where,
                "node_id": name,
                "tls": {
                    "ca": str(pki / "ca.pem"),
                    "cert": str(pki / f"{cert}.pem"),
                    "key": str(pki / f"{cert}-key.pem"),
                },
                "heartbeat_interval": "500ms",
                "reconnect_base": "300ms",
                "reconnect_max": "1s",
                "weights_cache": str(tmp_path / name / "weights"),
                "engines_dir": str(tmp_path / name / "engines"),
                "supervisor": {"work_dir": str(tmp_path / name / "state"), **(supervisor or {})},
                "discovery": {"skip_gpus": True},
            }
            | _merged({"discovery": {"skip_gpus": True}}, extra or {})
        )
    )
    return Proc(
        llmgw_cmd("agent", "--config", str(cfg)),
        tmp_path / f"agent-{name}.log",
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )


def _merged(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = {**out[k], **v} if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def serve_files(files: dict[str, bytes]) -> tuple[str, callable]:
    """A plain HTTP file server on a free port (release archives, model files); returns
    its base URL and the function that stops it."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class H(BaseHTTPRequestHandler):
        def do_GET(self):
            body = files.get(self.path)
            if body is None:
                self.send_response(404)
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_HEAD(self):
            body = files.get(self.path)
            self.send_response(404 if body is None else 200)
            if body is not None:
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{srv.server_address[1]}", srv.shutdown


def release_archive(binary: Path, tag: str) -> bytes:
    """llama-server packed the way llama.cpp's release archives hold it (the packer server init uses)."""
    from llmgw.agent.provision.archive import pack_llama_server

    return pack_llama_server(binary, tag)


def release_files(binary: Path, tag: str) -> dict[str, bytes]:
    """The release server's paths for ``tag``'s CPU build: the archive and its .sha256."""
    asset = f"llama-{tag}-bin-ubuntu-x64.tar.gz"
    archive = release_archive(binary, tag)
    digest = hashlib.sha256(archive).hexdigest()
    return {f"/{tag}/{asset}": archive, f"/{tag}/{asset}.sha256": f"{digest}  {asset}\n".encode()}


# The shared until() as end-to-end tests call it: wait_until(cond, timeout, what, procs, detail); an HTTP
# error (a server not up yet) counts as "not yet", and a failure shows the tail of every process's log.
wait_until = functools.partial(until, ignore=(httpx.HTTPError,), interval=0.2)
