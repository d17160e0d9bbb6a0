"""`llmgw up`: an engine, the gateway and a key on one machine, without root.

It finds (or builds) llama-server, finds a model (the one given, the starter
model downloaded once, or the tiny test model when the download cannot be
made), starts the engine and the gateway, creates a key and says how to use
it. Ctrl-C stops everything it started.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import httpx
import yaml

from llmgw.agent.provision import llamacpp_source
from llmgw.server.app import Server, serve_until_stopped
from llmgw.testing.tiny_model import tiny_model_path

log = logging.getLogger("llmgw.up")

STARTER_REPO = "Qwen/Qwen2.5-0.5B-Instruct-GGUF"
STARTER_FILE = "qwen2.5-0.5b-instruct-q4_k_m.gguf"
STARTER_NAME = "qwen2.5-0.5b-instruct"
TINY_NAME = "tiny-test"


class UpError(Exception):
    """`llmgw up` cannot go on; the message says why and what to do."""


@dataclass
class Choice:
    path: Path
    name: str
    noise: bool = False  # the tiny test model: its replies are random text


def default_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(Path.home(), ".local", "share")
    return Path(base) / "llmgw" / "up"


def hf_endpoint() -> str:
    # The same variable huggingface_hub reads, so an internal mirror works for both.
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def download_starter(progress: Callable[[int, int | None], None], say: Callable[[str], None]) -> Path | None:
    """The starter model, downloaded once (resumed when interrupted); None when it cannot be reached."""
    target = llamacpp_source.cache_dir() / "models" / STARTER_FILE
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    part = target.with_name(target.name + ".part")
    url = f"{hf_endpoint()}/{STARTER_REPO}/resolve/main/{STARTER_FILE}"
    have = part.stat().st_size if part.exists() else 0
    headers = {"Range": f"bytes={have}-"} if have else {}
    timeout = httpx.Timeout(30.0, connect=10.0)
    try:
        with httpx.stream("GET", url, headers=headers, follow_redirects=True, timeout=timeout) as r:
            if r.status_code == 416:  # the part file is already whole
                pass
            elif r.status_code not in (200, 206):
                say(f"the starter model could not be downloaded from {url}: HTTP {r.status_code}")
                return None
            else:
                if r.status_code == 200:
                    have = 0
                length = r.headers.get("Content-Length")
                total = have + int(length) if length and length.isdigit() else None
                with open(part, "ab" if have else "wb") as f:
                    done = have
                    for chunk in r.iter_bytes(1 << 20):
                        f.write(chunk)
                        done += len(chunk)
                        progress(done, total)
                if total is not None and done != total:
                    say(f"the download of {STARTER_FILE} stopped at {done} of {total} bytes; run again to resume")
                    return None
    except httpx.HTTPError as exc:
        say(f"the starter model could not be downloaded from {hf_endpoint()} ({type(exc).__name__}: {exc})")
        return None
    with open(part, "rb") as f:
        if f.read(4) != b"GGUF":
            part.unlink()
            say(f"what {url} sent is not a GGUF file; it was discarded")
            return None
    os.replace(part, target)
    return target


class Engine:
    """A llama-server process that belongs to this `up` and stops with it."""

    def __init__(self, binary: Path, model: Choice, port: int, log_path: Path, ctx_size: int, parallel: int) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.cmd = [
            str(binary), "--model", str(model.path), "--host", "127.0.0.1", "--port", str(port),
            "--ctx-size", str(ctx_size), "--parallel", str(parallel), "--jinja", "--metrics",
            "--alias", model.name,
        ]
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self._log = open(self.log_path, "ab")
        # Its own process group, so a Ctrl-C in the terminal reaches us, and we stop it in order.
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)

    def wait_ready(self, timeout: float = 300.0) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise UpError(f"llama-server exited with status {self.proc.returncode} while loading; "
                              f"its last lines ({self.log_path}):\n{self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise UpError(f"llama-server did not become ready within {timeout:.0f}s; see {self.log_path}")

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self._log.close()


def write_config(workdir: Path, model: Choice, engine: Engine, port: int, admin_port: int, host: str) -> Path:
    cfg = {
        "listen": f"{host}:{port}",
        "admin_listen": f"127.0.0.1:{admin_port}",
        "metrics_listen": None,
        "auth": {"enabled": True, "store": str(workdir / "llmgw.db")},
        "models": [{
            "name": model.name,
            "description": "Random-weight test model: its replies are noise" if model.noise else f"{model.path.name}, served by llama.cpp",
            "endpoints": [{"url": engine.url, "engine": "llamacpp"}],
        }],
    }
    path = workdir / "server.yaml"
    tmp = path.with_suffix(".tmp")
    tmp.write_text("# Written by `llmgw up`; rewritten on each run.\n" + yaml.safe_dump(cfg, sort_keys=False))
    os.replace(tmp, path)
    return path


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
Press Ctrl-C to stop.
"""


async def run_gateway(config_path: Path, key_name: str, on_ready: Callable[[str], None]) -> None:
    """Start the gateway in this process, create the key, and serve until a signal."""
    from llmgw.config import load_server_config

    async def make_key(server: Server) -> None:
        assert server.store is not None and server.keys is not None
        secret, _ = await server.store.create_key(key_name)
        await server.keys.load()
        on_ready(secret)

    await serve_until_stopped(load_server_config(config_path), make_key)


def choose_model(model: str | None, name: str | None, say: Callable[[str], None],
                 progress: Callable[[int, int | None], None], offline: bool) -> Choice:
    if model:
        path = Path(model).expanduser()
        if not path.is_file():
            raise UpError(f"--model {model}: no such file; give the path of a .gguf file")
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise UpError(f"--model {model}: not a GGUF file (llama.cpp loads .gguf files)")
        return Choice(path, name or path.stem.lower())
    starter = None if offline else download_starter(progress, say)
    if starter is not None:
        return Choice(starter, name or STARTER_NAME)
    say("using the tiny test model instead: it loads in a moment, but its weights are random, "
        "so its replies are noise. Give --model PATH.gguf for a real model.")
    return Choice(tiny_model_path(), name or TINY_NAME, noise=True)


def find_or_build_llama_server(explicit: str | None, say: Callable[[str], None],
                               progress: Callable[[str, float | None], None]) -> Path:
    if explicit:
        p = Path(explicit).expanduser()
        if not (p.is_file() and os.access(p, os.X_OK)):
            raise UpError(f"--llama-server {explicit}: not an executable file")
        return p
    found = llamacpp_source.find_llama_server()
    if found is not None:
        return found
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise UpError(f"llama-server is not installed and cannot be built here: {tool} is missing "
                          "(apt-get install cmake g++), or pass --llama-server PATH")
    say("llama-server was not found; building it from source once (a few minutes on two cores)")
    return llamacpp_source.build_llama_server(progress=progress)


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
