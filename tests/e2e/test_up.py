"""`llmgw up` as a user runs it: a control plane, a local agent over mutual TLS, llama.cpp installed by the
agent, the model served through the gateway with a key; Ctrl-C stops it all, engines included."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import openai
import pytest

from harness import free_port, llmgw_cmd, require
from llmgw.agent.provision.llamacpp_source import binary_works, cached_binary_path

pytestmark = pytest.mark.e2e


def _pids_with(text: str) -> set[int]:
    """Processes whose command line holds ``text`` (a path under this test's tmp_path)."""
    out = set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd:
            out.add(int(d.name))
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Up:
    """One `llmgw up` run in its own process, with the data directory under the test's tmp_path."""

    def __init__(self, tmp_path: Path, run: str, *args: str) -> None:
        self.port, self.admin = free_port(), free_port()
        self.out, self.err = tmp_path / f"{run}.out", tmp_path / f"{run}.err"
        # Nothing listens on the HF stand-in: the starter download fails at once, as it does offline.
        env = {**os.environ, "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}",
               "XDG_DATA_HOME": str(tmp_path / "xdg"), "PYTHONUNBUFFERED": "1"}
        with open(self.out, "w") as o, open(self.err, "w") as e:
            self.proc = subprocess.Popen(llmgw_cmd("up", "--port", str(self.port), "--admin-port", str(self.admin),
                                                   "--ctx-size", "2048", *args),
                                         stdout=o, stderr=e, stdin=subprocess.DEVNULL, env=env)

    def wait_up(self, timeout: float = 180) -> str:
        deadline = time.monotonic() + timeout
        while "Press Ctrl-C" not in self.out.read_text():
            assert self.proc.poll() is None, f"llmgw up exited {self.proc.returncode}:\n{self.err.read_text()}"
            assert time.monotonic() < deadline, f"llmgw up did not come up:\n{self.err.read_text()}"
            time.sleep(0.2)
        return self.out.read_text()

    def interrupt(self) -> int:
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


def _serves(text: str, port: int) -> None:
    key = re.search(r"API key\s+(llmgw-\S+)", text).group(1)
    base = re.search(r"base URL\s+(\S+)", text).group(1)
    assert base == f"http://127.0.0.1:{port}/v1"
    assert f'-H "Authorization: Bearer {key}"' in text and 'OpenAI(base_url="' in text
    client = openai.OpenAI(base_url=base, api_key=key, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny-test"]
    reply = client.chat.completions.create(model="tiny-test", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=4)
    assert reply.usage.completion_tokens == 4


def test_up_runs_control_plane_agent_and_engine_and_stops_them_all(llama_server_bin, tiny_model, tmp_path):
    data = tmp_path / "xdg" / "llmgw" / "up"
    if not binary_works(cached_binary_path()):
        require("the cached llama-server build", f"{cached_binary_path()} is not built; run scripts/build-llama-server")
    # Run 1: the release server cannot be reached, so the agent builds llama-server from the pinned
    # source (reusing the build cached in ~/.cache/llmgw), as it does on a machine without GitHub.
    first = Up(tmp_path, "first", "--release-url", f"http://127.0.0.1:{free_port()}")
    try:
        text = first.wait_up()
        err = first.err.read_text()
        assert "could not be downloaded" in err and "replies are noise" in err
        assert "made the certificate authority, control plane certificate, agent certificate (local)" in err
        assert "llama.cpp is ready: llama-server" in err and "built from the llama.cpp source" in err
        _serves(text, first.port)
        agents = _pids_with(str(data / "agent.yaml"))
        engines = _pids_with(str(data / "engines" / "llamacpp"))
        assert len(agents) == 1 and len(engines) == 1, (agents, engines)
        # The engine listens on loopback only: nothing but the gateway, with its keys, reaches it.
        assert "--host 127.0.0.1" in Path(f"/proc/{next(iter(engines))}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        # A key made with the printed command works on the running gateway.
        r = subprocess.run(llmgw_cmd("keys", "list", "--config", str(data / "server.yaml")),
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "llmgw up" in r.stdout
    finally:
        rc = first.interrupt()
    assert rc == 0, first.err.read_text()
    assert not [p for p in agents | engines if _alive(p)], "a process `llmgw up` started outlived it"
    for key in ("ca-key.pem", "server-key.pem", "local-key.pem"):
        assert (data / "pki" / key).stat().st_mode & 0o777 == 0o600
    certs = {p.name: p.read_bytes() for p in (data / "pki").iterdir()}

    # Run 2: the certificates are reused; a given llama-server is what the agent installs.
    second = Up(tmp_path, "second", "--llama-server", str(llama_server_bin))
    try:
        _serves(second.wait_up(), second.port)
        err = second.err.read_text()
        assert f"certificates in {data / 'pki'}: reused" in err
        assert "the agent installs" in err and "llama.cpp is ready: llama-server" in err
        agents = _pids_with(str(data / "agent.yaml"))
        engines = _pids_with(str(data / "engines" / "llamacpp"))
        assert len(agents) == 1 and len(engines) == 1, (agents, engines)
    finally:
        rc = second.interrupt()
    assert rc == 0, second.err.read_text()
    assert {p.name: p.read_bytes() for p in (data / "pki").iterdir()} == certs
    assert not [p for p in agents | engines if _alive(p)], "a process `llmgw up` started outlived it"


def test_up_refuses_a_missing_model_file(tmp_path, llama_server_bin):
    r = subprocess.run(llmgw_cmd("up", "--model", str(tmp_path / "nope.gguf"), "--llama-server", str(llama_server_bin),
                                 "--port", str(free_port()), "--admin-port", str(free_port()), "--dir", str(tmp_path)),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "no such file" in r.stderr
