"""`llmgw up` as a user runs it: a control plane, a model mirror, a local agent over mutual TLS, llama.cpp
installed by the agent, the model fetched from the mirror and served through the gateway with a key; Ctrl-C
stops it all, engines included.

A stand-in for Hugging Face holds the "starter" model (the tiny model's bytes under the starter's name): the
mirror fetches it through HF_ENDPOINT, an interrupted fetch falls back to the tiny model and is resumed on the
next run, and a later run reuses the version without asking Hugging Face anything.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import openai
import pytest
import yaml
from harness import free_port, llmgw_cmd, require

from llmgw.agent.provision.llamacpp_source import binary_works, cached_binary_path
from llmgw.testing.waiting import until
from llmgw.up.model import STARTER_FILE, STARTER_NAME, STARTER_REPO, STARTER_SOURCE, STARTER_VERSION

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


class HuggingFace:
    """The starter model's repository as Hugging Face answers for it: model info, the tree with the LFS
    checksum, and the file (Range honoured). Every request is counted; ``cut`` cuts the next whole
    download off half way, as a dropped connection does."""

    def __init__(self, data: bytes) -> None:
        self.data, self.requests, self.cut = data, [], False
        hf = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _send(self, status: int, body: bytes, headers: dict | None = None) -> None:
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                hf.requests.append((self.path, self.headers.get("Range")))
                path = self.path.split("?")[0]
                repo = f"/api/models/{STARTER_REPO}"
                if path == repo:
                    return self._send(
                        200, json.dumps({"id": STARTER_REPO, "sha": "c0ffee" * 6 + "c0ff", "gated": False}).encode()
                    )
                if path.startswith(repo + "/tree/"):
                    return self._send(
                        200,
                        json.dumps(
                            [
                                {
                                    "type": "file",
                                    "path": STARTER_FILE,
                                    "size": len(hf.data),
                                    "lfs": {"oid": hashlib.sha256(hf.data).hexdigest(), "size": len(hf.data)},
                                }
                            ]
                        ).encode(),
                    )
                if path.startswith(f"/{STARTER_REPO}/resolve/") and path.endswith("/" + STARTER_FILE):
                    rng, data = self.headers.get("Range"), hf.data
                    if rng:
                        start, _, end = rng.split("=", 1)[1].partition("-")
                        start, end = int(start), min(int(end) if end else len(data) - 1, len(data) - 1)
                        return self._send(
                            206, data[start : end + 1], {"Content-Range": f"bytes {start}-{end}/{len(data)}"}
                        )
                    if hf.cut:
                        hf.cut = False
                        self.send_response(200)
                        self.send_header("Content-Length", str(len(data)))
                        self.end_headers()
                        self.wfile.write(data[: len(data) // 2])
                        self.wfile.flush()
                        self.close_connection = True
                        return
                    return self._send(200, data)
                self._send(404, b'{"error": "not found"}')

            def log_message(self, *a):
                pass

        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}"

    def downloads(self) -> list[str | None]:
        """The Range header of each download of the file itself (not the mirror's look at its GGUF header)."""
        return [rng for path, rng in self.requests if "/resolve/" in path and not (rng or "").startswith("bytes=0-")]

    def close(self) -> None:
        self.srv.shutdown()
        self.srv.server_close()


class Up:
    """One `llmgw up` run in its own process, with the data directory under the test's tmp_path."""

    def __init__(self, tmp_path: Path, run: str, *args: str, hf: str | None = None) -> None:
        self.port, self.admin = free_port(), free_port()
        self.out, self.err = tmp_path / f"{run}.out", tmp_path / f"{run}.err"
        # Without a stand-in nothing listens at HF_ENDPOINT: the starter fetch fails at once, as it does offline.
        env = {
            **os.environ,
            "HF_ENDPOINT": hf or f"http://127.0.0.1:{free_port()}",
            "XDG_DATA_HOME": str(tmp_path / "xdg"),
            "PYTHONUNBUFFERED": "1",
        }
        self.env = env
        with open(self.out, "w") as o, open(self.err, "w") as e:
            self.proc = subprocess.Popen(
                llmgw_cmd("up", "--port", str(self.port), "--admin-port", str(self.admin), "--ctx-size", "2048", *args),
                stdout=o,
                stderr=e,
                stdin=subprocess.DEVNULL,
                env=env,
            )

    def wait_up(self, timeout: float = 180) -> str:
        until(
            lambda: "Press Ctrl-C" in self.out.read_text(),
            timeout,
            "llmgw up to come up",
            detail=lambda: f"exit status {self.proc.poll()}\n{self.err.read_text()}",
            alive=[self.proc],
            interval=0.2,
        )
        return self.out.read_text()

    def interrupt(self) -> int:
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


def _serves(text: str, port: int, model: str = "tiny-test") -> None:
    key = re.search(r"API key\s+(llmgw-\S+)", text).group(1)
    base = re.search(r"base URL\s+(\S+)", text).group(1)
    assert base == f"http://127.0.0.1:{port}/v1"
    assert f'-H "Authorization: Bearer {key}"' in text and 'OpenAI(base_url="' in text
    client = openai.OpenAI(base_url=base, api_key=key, max_retries=0)
    assert [m.id for m in client.models.list().data] == [model]
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert reply.usage.completion_tokens == 4


def _mirror_pids(data: Path) -> set[int]:
    return _pids_with(f"mirror --dir {data / 'mirror'} serve")


def _catalog(data: Path) -> tuple[str, str]:
    """The served model's source, and up's mirror: its byte address (from its command line) and API."""
    cfg = yaml.safe_load((data / "server.yaml").read_text())
    (pid,) = _mirror_pids(data)
    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    base = cmd[cmd.index(b"--base") + 1].decode()
    assert cfg["mirror"]["api"].startswith("http://127.0.0.1:")
    return cfg["models"][0]["source"], base


def _ctl_mirror_list(up: Up) -> list[dict]:
    # No --token-file: ctl finds the token up made in its default data directory by itself.
    r = subprocess.run(
        llmgw_cmd("ctl", "mirror", "list", "--json", "--server", f"http://127.0.0.1:{up.admin}"),
        capture_output=True,
        text=True,
        timeout=60,
        env=up.env,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)["models"]


@pytest.mark.slow  # minutes on two cores
def test_up_runs_control_plane_mirror_agent_and_engine_and_stops_them_all(llama_server_bin, tiny_model, tmp_path):
    data = tmp_path / "xdg" / "llmgw" / "up"
    if not binary_works(cached_binary_path()):
        require("the cached llama-server build", f"{cached_binary_path()} is not built; run scripts/build-llama-server")
    # Run 1, offline: Hugging Face and the release server cannot be reached. The tiny model goes into the
    # mirror and the agent fetches it from there; llama-server is built from the pinned source (reusing
    # the build cached in ~/.cache/llmgw), as it is on a machine without GitHub.
    first = Up(tmp_path, "first", "--release-url", f"http://127.0.0.1:{free_port()}")
    try:
        text = first.wait_up()
        err = first.err.read_text()
        assert f"the mirror could not fetch {STARTER_SOURCE}" in err and "replies are noise" in err
        assert "made the certificate authority, control plane certificate, agent certificate (local)" in err
        assert "llama.cpp is ready: llama-server" in err and "built from the llama.cpp source" in err
        _serves(text, first.port)
        source, base = _catalog(data)
        tiny = data / "mirror" / "tiny-test" / "v1" / tiny_model.name
        assert source == f"{base}/tiny-test/v1/{tiny_model.name}" and tiny.read_bytes() == tiny_model.read_bytes()
        # The agent fetched the weights from the mirror: it holds its own copy.
        assert any(p.stat().st_size == tiny.stat().st_size for p in (data / "weights").rglob("*") if p.is_file())
        # `llmgw ctl mirror …` works against up's control plane.
        (held,) = _ctl_mirror_list(first)
        assert (held["model"], held["version"], held["state"], held["used_by"]) == (
            "tiny-test",
            "v1",
            "present",
            ["tiny-test"],
        )
        agents = _pids_with(str(data / "agent.yaml"))
        engines = _pids_with(str(data / "engines" / "llamacpp"))
        mirrors = _mirror_pids(data)
        assert len(agents) == 1 and len(engines) == 1 and len(mirrors) == 1, (agents, engines, mirrors)
        # The engine listens on loopback only: nothing but the gateway, with its keys, reaches it.
        assert (
            "--host 127.0.0.1"
            in Path(f"/proc/{next(iter(engines))}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        )
        # A key made with the printed command works on the running gateway.
        r = subprocess.run(
            llmgw_cmd("keys", "list", "--config", str(data / "server.yaml")), capture_output=True, text=True, timeout=60
        )
        assert r.returncode == 0 and "llmgw up" in r.stdout
    finally:
        rc = first.interrupt()
    assert rc == 0, first.err.read_text()
    assert not [p for p in agents | engines | mirrors if _alive(p)], "a process `llmgw up` started outlived it"
    assert "serving" in (data / "mirror.log").read_text()
    for key in ("ca-key.pem", "server-key.pem", "local-key.pem"):
        assert (data / "pki" / key).stat().st_mode & 0o777 == 0o600
    certs = {p.name: p.read_bytes() for p in (data / "pki").iterdir()}

    hf = HuggingFace(tiny_model.read_bytes())
    try:
        # Run 2: Hugging Face is there but the download is cut off half way: the tiny model is served
        # instead, said plainly; the partial download stays in the mirror. The certificates are
        # reused; a given llama-server is what the agent installs.
        hf.cut = True
        second = Up(tmp_path, "second", "--llama-server", str(llama_server_bin), hf=hf.url)
        try:
            _serves(second.wait_up(), second.port)
            err = second.err.read_text()
            assert f"certificates in {data / 'pki'}: reused" in err
            assert f"the mirror could not fetch {STARTER_SOURCE}" in err and "replies are noise" in err
            assert "the agent installs" in err and "llama.cpp is ready: llama-server" in err
            assert hf.downloads() == [None]
        finally:
            rc = second.interrupt()
        assert rc == 0, second.err.read_text()

        # Run 3: the mirror resumes the download and the starter model is served from it.
        third = Up(tmp_path, "third", "--llama-server", str(llama_server_bin), hf=hf.url)
        try:
            _serves(third.wait_up(), third.port, STARTER_NAME)
            err = third.err.read_text()
            assert "replies are noise" not in err
            assert hf.downloads() == [None, f"bytes={len(hf.data) // 2}-"], hf.requests  # resumed, not restarted
            source, base = _catalog(data)
            starter = data / "mirror" / STARTER_NAME / STARTER_VERSION / STARTER_FILE
            assert source == f"{base}/{STARTER_NAME}/{STARTER_VERSION}/{STARTER_FILE}"
            assert starter.read_bytes() == hf.data and f"the mirror holds {STARTER_FILE}: {source}" in err
            agents = _pids_with(str(data / "agent.yaml"))
            engines = _pids_with(str(data / "engines" / "llamacpp"))
            mirrors = _mirror_pids(data)
            assert len(agents) == 1 and len(engines) == 1 and len(mirrors) == 1, (agents, engines, mirrors)
        finally:
            rc = third.interrupt()
        assert rc == 0, third.err.read_text()
        assert not [p for p in agents | engines | mirrors if _alive(p)], "a process `llmgw up` started outlived it"

        # Run 4: the version is in the mirror; Hugging Face is not asked anything. The mirror keeps its
        # address, so the catalog source is the same and the agent's copy of the weights is used again.
        hf.requests.clear()
        held = sorted(p for p in (data / "weights").iterdir() if "starter" in p.name)
        fourth = Up(tmp_path, "fourth", "--llama-server", str(llama_server_bin), hf=hf.url)
        try:
            _serves(fourth.wait_up(), fourth.port, STARTER_NAME)
            assert hf.requests == []
            assert _catalog(data) == (source, base)
            assert sorted(p for p in (data / "weights").iterdir() if "starter" in p.name) == held and held
        finally:
            rc = fourth.interrupt()
        assert rc == 0, fourth.err.read_text()
    finally:
        hf.close()
    assert {p.name: p.read_bytes() for p in (data / "pki").iterdir()} == certs


def test_up_refuses_a_missing_model_file(tmp_path, llama_server_bin):
    r = subprocess.run(
        llmgw_cmd(
            "up",
            "--model",
            str(tmp_path / "nope.gguf"),
            "--llama-server",
            str(llama_server_bin),
            "--port",
            str(free_port()),
            "--admin-port",
            str(free_port()),
            "--dir",
            str(tmp_path),
        ),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1 and "no such file" in r.stderr
