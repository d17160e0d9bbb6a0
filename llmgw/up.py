"""`llmgw up`: the whole system on one machine, without root.

A control plane and gateway run in this process; a node agent runs beside it
as a process of its own and connects over mutual TLS, with certificates from
a private authority kept under the data directory. The agent installs
llama.cpp's `llama-server` (the release archive, or a build from source when
releases cannot be reached) and serves the model: the one given, the starter
model downloaded once, or the tiny test model when the download cannot be
made. Then a key is created and how to use it is printed. Ctrl-C stops
everything it started, engines included.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable

import httpx
import yaml

from llmgw.config.server import DEFAULT_LLAMACPP
from llmgw.mirror.api import default_token_file, ensure_token, source_url
from llmgw.mirror.layout import MirrorError
from llmgw.pki import (CA_CERT, CA_KEY, PKIError, common_name, init_ca, issue_client, issue_server, load_ca,
                       load_cert, load_pair, san_names, verify_issued_by)
from llmgw.protocol import ProvisionState
from llmgw.server.app import Server
from llmgw.testing.tiny_model import tiny_model_path

log = logging.getLogger("llmgw.up")

STARTER_REPO = "Qwen/Qwen2.5-0.5B-Instruct-GGUF"
STARTER_FILE = "qwen2.5-0.5b-instruct-q4_k_m.gguf"
STARTER_NAME = "qwen2.5-0.5b-instruct"
STARTER_SOURCE = f"hf:{STARTER_REPO}/{STARTER_FILE}"
STARTER_VERSION = "starter"  # fixed: a later run finds the version it fetched and reuses it
TINY_NAME = "tiny-test"
TINY_VERSION = "v1"


class UpError(Exception):
    """`llmgw up` cannot go on; the message says why and what to do."""


@dataclass
class Choice:
    """The model `up` serves: what clients call it, and the catalog source the agent loads it from."""

    source: str  # a URL on up's mirror, or the path of the user's own file (served where it is)
    name: str
    file: str  # the file's name, for the messages
    noise: bool = False  # the tiny test model: its replies are random text


def default_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(Path.home(), ".local", "share")
    return Path(base) / "llmgw" / "up"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- certificates ------------------------------------------------------------

NODE_ID = "local"
SERVER_NAMES = ("127.0.0.1", "localhost")
_MIN_LEFT = timedelta(days=7)  # a certificate closer to its end than this is issued again


@dataclass(frozen=True)
class Pki:
    """The private authority of this one machine and the two certificates `up` needs."""

    dir: Path
    node_id: str = NODE_ID

    @property
    def ca(self) -> Path:
        return self.dir / CA_CERT

    @property
    def server(self) -> Path:
        return self.dir / "server.pem"

    @property
    def server_key(self) -> Path:
        return self.dir / "server-key.pem"

    @property
    def client(self) -> Path:
        return self.dir / f"{self.node_id}.pem"

    @property
    def client_key(self) -> Path:
        return self.dir / f"{self.node_id}-key.pem"


def _fresh(cert_path: Path) -> bool:
    return load_cert(cert_path).not_valid_after_utc - datetime.now(timezone.utc) > _MIN_LEFT


def _leaf_ok(pki: Pki, cert: Path, key: Path, names_ok: Callable[[object], bool]) -> bool:
    """Present, signed by this authority, with its own key, not near its end, naming what it must."""
    try:
        verify_issued_by(pki.ca, cert)
        load_pair(cert, key)
        return _fresh(cert) and names_ok(load_cert(cert))
    except PKIError:
        return False


def ensure_pki(workdir: Path, node_id: str = NODE_ID) -> tuple[Pki, list[str]]:
    """The authority and certificates under ``workdir``/pki: reused when valid, made otherwise.

    Returns them and what was (re)made, in words (empty: everything reused).
    """
    pki = Pki(workdir / "pki", node_id)
    pki.dir.mkdir(parents=True, exist_ok=True)
    os.chmod(pki.dir, 0o700)
    made: list[str] = []
    try:
        load_ca(pki.dir)
        ca_ok = _fresh(pki.ca)
    except PKIError:
        ca_ok = False
    if not ca_ok:
        init_ca(pki.dir, name="llmgw up (this machine only)", force=True)
        made.append("certificate authority")
    if not _leaf_ok(pki, pki.server, pki.server_key, lambda c: set(SERVER_NAMES) <= set(san_names(c))):
        issue_server(pki.dir, pki.dir, list(SERVER_NAMES))
        made.append("control plane certificate")
    if not _leaf_ok(pki, pki.client, pki.client_key, lambda c: common_name(c) == node_id):
        issue_client(pki.dir, pki.dir, node_id)
        made.append(f"agent certificate ({node_id})")
    for key in (pki.dir / CA_KEY, pki.server_key, pki.client_key):
        os.chmod(key, 0o600)  # whoever copied them in, they stay private
    return pki, made


# ---- configuration -------------------------------------------------------------


def _write_yaml(path: Path, data: dict) -> Path:
    tmp = path.with_suffix(".tmp")
    tmp.write_text("# Written by `llmgw up`; rewritten on each run.\n" + yaml.safe_dump(data, sort_keys=False))
    os.replace(tmp, path)
    return path


def write_server_config(workdir: Path, model: Choice, pki: Pki, *, port: int, admin_port: int, agent_port: int,
                        host: str, ctx_size: int, parallel: int, release_url: str | None = None,
                        llamacpp: str = DEFAULT_LLAMACPP, mirror_api: str | None = None,
                        mirror_token_file: Path | None = None) -> Path:
    """server.yaml: the gateway, the control plane with the agent listener on loopback, the model in its catalog,
    and up's mirror (its management API on loopback, with its token), so `llmgw ctl mirror …` works against it."""
    cfg = {
        "listen": f"{host}:{port}",
        "admin_listen": f"127.0.0.1:{admin_port}",
        "metrics_listen": None,
        "agent_listen": f"127.0.0.1:{agent_port}",
        "agent_tls": {"ca": str(pki.ca), "cert": str(pki.server), "key": str(pki.server_key)},
        # One node on loopback, heartbeating every 2s: react within a second, and do not wait the
        # fleet's 15s for other agents to come back before placing (the settle time is unreachable_after).
        "control": {"enabled": True, "interval": "1s", "unreachable_after": "5s", "lost_after": "20s",
                    "base_backoff": "5s", "max_backoff": "60s"},
        "engines": {"llamacpp": llamacpp, "release_url": release_url},
        "auth": {"enabled": True, "store": str(workdir / "llmgw.db")},
        "mirror": {"api": mirror_api, "token_file": str(mirror_token_file) if mirror_token_file else None}
        if mirror_api else None,
        "models": [{
            "name": model.name,
            "description": ("Random-weight test model: its replies are noise" if model.noise
                            else f"{model.file}, served by llama.cpp"),
            # A mirror URL is fetched by the agent like any node's weights; a path (the user's own
            # file) is never fetched: the node, this machine, loads it where it is.
            "source": model.source,
            "scaling": {"min": 1},
            "profiles": [{"engine": "llamacpp",
                          "args": ["--ctx-size", str(ctx_size), "--parallel", str(parallel)]}],
        }],
    }
    return _write_yaml(workdir / "server.yaml", cfg)


def write_agent_config(workdir: Path, pki: Pki, agent_port: int) -> Path:
    """agent.yaml: dial the control plane on loopback; everything it keeps lives under ``workdir``."""
    cfg = {
        "server": f"127.0.0.1:{agent_port}",
        "node_id": pki.node_id,
        "tls": {"ca": str(pki.ca), "cert": str(pki.client), "key": str(pki.client_key)},
        "weights_cache": str(workdir / "weights"),
        "engines_dir": str(workdir / "engines"),
        "heartbeat_interval": "2s",
        "reconnect_base": "300ms",
        "reconnect_max": "2s",
        "supervisor": {"work_dir": str(workdir / "agent"), "stop_timeout": "15s", "stop_engines_on_exit": True},
    }
    return _write_yaml(workdir / "agent.yaml", cfg)


def llmgw_command(*args: str) -> list[str]:
    """How to run this llmgw itself: the one-file build is its own executable."""
    if getattr(sys, "frozen", False):
        return [sys.executable, *args]
    return [sys.executable, "-m", "llmgw.cli.main", *args]


def agent_command(config_path: Path) -> list[str]:
    """How to run this llmgw's own agent."""
    return llmgw_command("agent", "--config", str(config_path))


def _port_free(port: object) -> bool:
    if not isinstance(port, int) or not 1024 <= port <= 65535:
        return False
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def mirror_ports(workdir: Path) -> tuple[int, int]:
    """The mirror's two loopback ports (bytes, API): the last run's while they are free, so the catalog
    source stays the same URL and the agent's cached copy of the weights is used again; new ones
    otherwise. Remembered in ``workdir``/mirror.json."""
    path = workdir / "mirror.json"
    try:
        kept = json.loads(path.read_text())
        ports = (kept["listen"], kept["api"])
    except (OSError, ValueError, KeyError, TypeError):
        ports = (None, None)
    if ports[0] != ports[1] and all(_port_free(p) for p in ports):
        return ports  # type: ignore[return-value]
    listen = free_port()
    api = free_port()
    while api == listen:
        api = free_port()
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"listen": listen, "api": api}) + "\n")
    os.replace(tmp, path)
    return listen, api


def mirror_command(root: Path, listen: str, api_listen: str, base: str, token_file: Path) -> list[str]:
    """How to run this llmgw's own mirror over ``root``; its API is left on loopback (allowed: this machine)
    and needs the token in ``token_file`` like any mirror's."""
    return llmgw_command("mirror", "--dir", str(root), "serve", "--listen", listen, "--api-listen", api_listen,
                         "--base", base, "--api-allow", "127.0.0.1", "--api-token-file", str(token_file))


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class Child:
    """A process `up` starts beside itself, logging to a file, in a session of its own."""

    what = "a process"

    def __init__(self, cmd: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.cmd = cmd
        self.log_path = log_path
        self.env = env
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log_path, "ab") as log_file:
            # Its own session: a Ctrl-C reaches `up` alone, which stops the others in order.
            self.proc = subprocess.Popen(self.cmd, stdout=log_file, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True, env=self.env)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def tail(self, lines: int = 20) -> str:
        return tail(self.log_path, lines)

    def stop(self, timeout: float = 40.0) -> None:
        """SIGTERM, then SIGKILL to its group when it does not end in time."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop within %.0fs; killing it", self.what, timeout)
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(5)


class AgentProcess(Child):
    """The local agent, a process of its own; it stops the engines it started when it stops (SIGTERM)."""

    what = "the agent"

    def __init__(self, config_path: Path, log_path: Path) -> None:
        super().__init__(agent_command(config_path), log_path)


class MirrorProcess(Child):
    """`llmgw mirror serve` over ``root``: bytes on one loopback port, the management API on another.

    It inherits up's environment, so HF_ENDPOINT and HF_TOKEN reach its fetcher (an HF_ENDPOINT on
    loopback included: the endpoint the operator set is the one local source a mirror fetches from
    without --allow-local-sources). Its API token is ``<root>.api-token``, made by `up` before the
    mirror starts, so server.yaml and up's own calls never wait on the mirror's first start.
    """

    what = "the mirror"

    def __init__(self, root: Path, log_path: Path, weights_port: int | None = None, api_port: int | None = None) -> None:
        self.root = root
        self.weights_port = weights_port or free_port()
        self.api_port = api_port or free_port()
        self.base = f"http://127.0.0.1:{self.weights_port}"
        self.api = f"http://127.0.0.1:{self.api_port}"
        self.token_file = default_token_file(root)
        self.token: str | None = None
        super().__init__(mirror_command(root, f"127.0.0.1:{self.weights_port}", f"127.0.0.1:{self.api_port}",
                                        self.base, self.token_file), log_path)

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            self.token, _ = ensure_token(self.token_file)
        except MirrorError as exc:
            raise UpError(str(exc)) from None
        super().start()

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Until its management API answers; UpError with its last log lines when it does not."""
        deadline = time.monotonic() + timeout
        while True:
            rc = self.exited()
            if rc is not None:
                raise UpError(f"the mirror exited with status {rc}; its last lines ({self.log_path}):\n{self.tail()}")
            try:
                if httpx.get(f"{self.api}/v1/health", timeout=2.0, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise UpError(f"the mirror did not answer within {timeout:.0f}s; its last lines "
                              f"({self.log_path}):\n{self.tail()}")
            time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is not running; only its parent (the agent, now gone) would reap it.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def kill_leftovers(pids: set[int], timeout: float = 10.0) -> list[int]:
    """The last guard: engines the agent should have stopped and did not. Returns those it had to stop."""
    left = [p for p in pids if _alive(p)]
    for pid in left:
        try:
            os.killpg(pid, signal.SIGTERM)  # the supervisor gives each engine its own process group
        except (ProcessLookupError, PermissionError):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in left) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:
        if _alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return left


class LocalRelease:
    """A given llama-server offered to the agent as llama.cpp's release, from loopback.

    The agent then installs it the way it installs any release (checksum,
    unpack, prove it runs, record it) under its engines directory.
    """

    def __init__(self, binary: Path, tag: str = DEFAULT_LLAMACPP) -> None:
        self.tag = tag
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tf:
            tf.add(binary, arcname=f"llama-{tag}/llama-server")
            for lib in sorted(binary.parent.glob("lib*.so*")):  # a release's shared libraries travel with it
                tf.add(lib, arcname=f"llama-{tag}/{lib.name}")
        self.archive = buf.getvalue()
        empty = io.BytesIO()
        with tarfile.open(fileobj=empty, mode="w:gz") as tf:
            note = b"llmgw up: the given llama-server needs nothing more\n"
            info = tarfile.TarInfo("README-llmgw-up.txt")
            info.size = len(note)
            tf.addfile(info, io.BytesIO(note))
        self.extra = empty.getvalue()
        self._srv: ThreadingHTTPServer | None = None

    def body(self, path: str) -> bytes | None:
        parts = path.split("?", 1)[0].strip("/").split("/")
        if len(parts) != 2 or parts[0] != self.tag:
            return None
        name = parts[1]
        sidecar = name.endswith(".sha256")
        asset = name[: -len(".sha256")] if sidecar else name
        if not asset.endswith(".tar.gz"):
            return None
        # The CUDA build comes as two archives; the second (the CUDA runtime) is not needed here.
        data = self.extra if asset.startswith("cudart-") else self.archive
        return f"{hashlib.sha256(data).hexdigest()}  {asset}\n".encode() if sidecar else data

    def start(self) -> str:
        release = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, send_body: bool) -> None:
                body = release.body(self.path)
                self.send_response(404 if body is None else 200)
                self.send_header("Content-Length", str(0 if body is None else len(body)))
                self.end_headers()
                if body is not None and send_body:
                    self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                self._answer(True)

            def do_HEAD(self) -> None:  # noqa: N802
                self._answer(False)

            def log_message(self, *args) -> None:
                pass

        self._srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._srv.serve_forever, daemon=True, name="llama-server release").start()
        return f"http://127.0.0.1:{self._srv.server_address[1]}"

    def stop(self) -> None:
        if self._srv is not None:
            self._srv.shutdown()
            self._srv.server_close()
            self._srv = None


# ---- watching the control plane ------------------------------------------------


@dataclass
class Progress:
    """What `up` is waiting for, in words, and the reason it cannot go on (None while it can)."""

    words: str
    failure: str | None = None


def describe(node, rows: list[dict], model_status: dict | None = None) -> Progress:
    """``node``: the agent service's record of the local node (None before it registers);
    ``rows``: the reconciler's replica rows for the model; ``model_status``: its status
    (a failed replica is dropped from the rows at once, its reason kept there)."""
    if node is None or not getattr(node, "connected", False):
        return Progress("waiting for the local agent to connect over mutual TLS")
    p = (node.provision or {}).get("llamacpp")
    if p is None or p.state != ProvisionState.READY:
        if p is None:
            return Progress("the agent is looking at llama.cpp")
        if p.state == ProvisionState.FAILED:
            return Progress("installing llama.cpp failed", f"installing llama.cpp failed: {p.detail or 'no reason given'}")
        if p.state in (ProvisionState.UNSUPPORTED, ProvisionState.SKIPPED):
            return Progress("llama.cpp cannot be installed", f"llama.cpp cannot be installed here: {p.detail or p.state.value}")
        words = f"installing llama.cpp: {p.detail or p.state.value}"
        if p.progress is not None and p.progress.percent is not None:
            words += f" ({p.progress.percent:.0f}%)"
        return Progress(words)
    backoff = (model_status or {}).get("backoff")
    if backoff and backoff.get("failures"):
        # One machine, one node: a start that failed fails the same way again.
        return Progress("the engine failed", f"the engine failed to start: {backoff.get('last_failure') or 'no reason given'}")
    if not rows:
        problem = (model_status or {}).get("problem")
        return Progress(f"placing the model on this machine{f': {problem}' if problem else ''}")
    failed = [r for r in rows if r["state"] == "failed"]
    if failed and not any(r["state"] in ("starting", "ready") for r in rows):
        return Progress("the engine failed", f"the engine failed to start: {failed[-1].get('reason') or 'no reason given'}")
    row = next((r for r in rows if r["state"] in ("starting", "ready")), rows[-1])
    for shard in row.get("shards") or ():
        fetch = shard.get("fetch")
        if fetch and shard.get("state") == "pending":
            pct = fetch.get("percent")
            return Progress(f"fetching the weights{'' if pct is None else f' {pct:.0f}%'}")
    if row["state"] == "ready":
        return Progress("llama-server is up; waiting for its health check")
    return Progress("starting llama-server with the model")


def engine_pids(rows: list[dict]) -> set[int]:
    return {s["pid"] for r in rows for s in r.get("shards") or () if s.get("pid")}


async def wait_until_served(server: Server, model: str, agent: AgentProcess, status: Callable[[str], None],
                            seen_pids: set[int], interval: float = 0.25) -> None:
    """Until the gateway has a healthy endpoint for ``model``; UpError with the reason when it cannot get one."""
    last = None
    said_ready = False
    while True:
        rc = agent.exited()
        if rc is not None:
            raise UpError(f"the agent exited with status {rc}; its last lines ({agent.log_path}):\n{agent.tail()}")
        rows = server.reconciler.replica_rows(model) if server.reconciler is not None else []
        seen_pids |= engine_pids(rows)
        if server.endpoints.model_ready(model):
            return
        node = server.agents.get(NODE_ID) if server.agents is not None else None
        installed = (node.provision or {}).get("llamacpp") if node is not None else None
        if installed is not None and installed.state == ProvisionState.READY and not said_ready:
            said_ready = True
            status(f"llama.cpp is ready: {installed.detail or installed.version}")
        p = describe(node, rows, server.reconciler.model_status(model) if server.reconciler is not None else None)
        if p.failure is not None:
            raise UpError(f"{p.failure}\nthe agent's last lines ({agent.log_path}):\n{agent.tail()}")
        if p.words != last:
            last = p.words
            status(p.words)
        await asyncio.sleep(interval)


def instructions(base: str, key: str, model: str, config_path: Path) -> str:
    return f"""
llmgw is up.

  base URL  {base}/v1
  API key   {key}
  model     {model}

Try it:

  curl {base}/v1/chat/completions \\
    -H "Authorization: Bearer {key}" \\
    -H "Content-Type: application/json" \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}]}}'

  from openai import OpenAI
  client = OpenAI(base_url="{base}/v1", api_key="{key}")
  reply = client.chat.completions.create(model="{model}", messages=[{{"role": "user", "content": "Hello!"}}])
  print(reply.choices[0].message.content)

More keys: llmgw keys create --name NAME --config {config_path}
The cluster: llmgw ctl replicas (it finds the admin token, {config_path.parent / "admin-token"}, by itself
             when --dir is the default; else add --token-file)
Press Ctrl-C to stop.
"""


async def run_system(config_path: Path, agent: AgentProcess, model: str, key_name: str,
                     status: Callable[[str], None], on_ready: Callable[[str], None],
                     mirror: Child | None = None) -> None:
    """The control plane and gateway in this process, the agent beside it; serve until a signal.

    Stops in order: the agent first (it stops its engines), then any engine
    still running (the last guard), then the control plane. The mirror, started
    before, is watched here and stopped by the caller.
    """
    from llmgw.config import load_server_config

    server = Server(load_server_config(config_path))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    pids: set[int] = set()
    waiter = asyncio.create_task(stop.wait())
    watch: asyncio.Task | None = None
    try:
        await server.start()
        agent.start()
        watch = asyncio.create_task(wait_until_served(server, model, agent, status, pids))
        await asyncio.wait({watch, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if not watch.done():
            return  # stopped while loading
        watch.result()  # the reason it cannot go on, as UpError
        assert server.store is not None and server.keys is not None
        secret, _ = await server.store.create_key(key_name)
        await server.keys.load()
        on_ready(secret)
        while not stop.is_set():
            await asyncio.wait({waiter}, timeout=1.0)
            if server.reconciler is not None:
                pids |= engine_pids(server.reconciler.replica_rows(model))
            rc = agent.exited()
            if rc is not None and not stop.is_set():
                raise UpError(f"the agent exited with status {rc}; its last lines ({agent.log_path}):\n{agent.tail()}")
            rc = mirror.exited() if mirror is not None else None
            if rc is not None and not stop.is_set():
                raise UpError(f"the mirror exited with status {rc}; its last lines ({mirror.log_path}):\n{mirror.tail()}")
    finally:
        for t in (watch, waiter):
            if t is not None and not t.done():
                t.cancel()
        status("stopping the agent and its engines")
        await asyncio.to_thread(agent.stop)
        left = await asyncio.to_thread(kill_leftovers, pids)
        if left:
            log.warning("engine(s) %s outlived the agent and were stopped", ", ".join(map(str, left)))
        await server.stop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


# ---- the model ---------------------------------------------------------------------

OnBytes = Callable[[int, int | None], None]


def _message(resp: httpx.Response) -> str:
    try:
        return resp.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {resp.status_code}"


def fetch_into_mirror(api: str, base: str, source: str, model: str, version: str, progress: OnBytes,
                      say: Callable[[str], None], *, interval: float = 0.5,
                      client: httpx.Client | None = None, token: str | None = None) -> str | None:
    """``source`` in up's mirror as ``model/version``: the URL the agent fetches it from there.

    A version already present is reused (nothing fetched); one that failed or was
    interrupted is fetched again (the mirror resumes its partial file). Progress
    comes from the mirror's own counts. None, said why, when the mirror cannot get it.
    """
    own = client is None
    c = client or httpx.Client(timeout=httpx.Timeout(60.0, connect=5.0), trust_env=False)  # loopback: no proxy
    where = f"{api}/v1/models/{model}/{version}"
    auth = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        r = c.get(where, headers=auth)
        if r.status_code == 200 and r.json().get("state") == "present":
            d = r.json()
            return source_url(base, model, version, [f["name"] for f in d["files"]])
        r = c.post(f"{api}/v1/models", json={"source": source, "model": model, "version": version}, headers=auth)
        if r.status_code != 202:
            say(f"the mirror could not fetch {source}: {_message(r)}")
            return None
        d = r.json()
        url = d["url"]
        while d.get("state") == "fetching":
            if d.get("bytes_done") is not None:
                progress(d["bytes_done"], d.get("bytes_total"))
            time.sleep(interval)
            r = c.get(where, headers=auth)
            if r.status_code != 200:
                say(f"the mirror lost {model}/{version}: {_message(r)}")
                return None
            d = r.json()
        if d.get("state") != "present":
            say(f"the mirror could not fetch {source}: {d.get('reason') or d.get('state')}")
            return None
        total = d.get("bytes")
        progress(total or 0, total)
        return url
    except httpx.HTTPError as exc:
        say(f"the mirror's API at {api} did not answer ({type(exc).__name__}: {exc})")
        return None
    finally:
        if own:
            c.close()


def place_in_mirror(root: Path, base: str, file: Path, model: str, version: str) -> str:
    """A copy of ``file`` at ``root/model/version/<name>`` (the mirror serves hand-copied files); its URL there.

    Copied under a hidden name (never served) and renamed into place; an identical copy is kept.
    """
    vdir = root / model / version
    target = vdir / file.name
    if not (target.is_file() and target.stat().st_size == file.stat().st_size
            and target.read_bytes() == file.read_bytes()):
        vdir.mkdir(parents=True, exist_ok=True)
        tmp = vdir / f".{file.name}.part"
        shutil.copyfile(file, tmp)
        os.replace(tmp, target)
    return source_url(base, model, version, [file.name])


def own_model(model: str, name: str | None) -> Choice:
    """The user's own .gguf, checked; served where it is (gigabytes are not copied into the mirror)."""
    path = Path(model).expanduser()
    if not path.is_file():
        raise UpError(f"--model {model}: no such file; give the path of a .gguf file")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise UpError(f"--model {model}: not a GGUF file (llama.cpp loads .gguf files)")
    return Choice(str(path.resolve()), name or path.stem.lower(), path.name)


TINY_WORDS = ("using the tiny test model instead: it loads in a moment, but its weights are random, "
              "so its replies are noise. Give --model PATH.gguf for a real model.")


def mirrored_model(mirror: MirrorProcess, name: str | None, say: Callable[[str], None], progress: OnBytes,
                   offline: bool, fetch: Callable[..., str | None] = fetch_into_mirror) -> Choice:
    """The starter model through the mirror; the tiny test model, placed in the mirror, when it cannot be had."""
    if not offline:
        url = fetch(mirror.api, mirror.base, STARTER_SOURCE, STARTER_NAME, STARTER_VERSION, progress, say,
                    token=mirror.token)
        if url is not None:
            return Choice(url, name or STARTER_NAME, STARTER_FILE)
    say(TINY_WORDS)
    tiny = tiny_model_path()
    url = place_in_mirror(mirror.root, mirror.base, tiny, TINY_NAME, TINY_VERSION)
    return Choice(url, name or TINY_NAME, tiny.name, noise=True)


def check_llama_server(explicit: str) -> Path:
    p = Path(explicit).expanduser()
    if not (p.is_file() and os.access(p, os.X_OK)):
        raise UpError(f"--llama-server {explicit}: not an executable file")
    return p.resolve()


def started_at() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M")


def check_port(host: str, port: int, what: str) -> None:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host or "0.0.0.0", port))
        except OSError:
            raise UpError(f"port {port} ({what}) is already in use; choose another with "
                          f"{'--port' if what == 'the API' else '--admin-port'}") from None
