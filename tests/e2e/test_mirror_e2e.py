"""The mirror end to end: a stand-in for Hugging Face, `llmgw mirror serve`, a control
plane and an agent, all separate processes.

The control plane asks the mirror for a model on the stand-in Hugging Face; the
first download is cut off half way and the second resumes it; a model is added
from the mirrored version in one step; the agent installs llama.cpp from a
release archive held by the mirror, fetches the weights from the mirror and
serves them to the openai SDK.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import openai
import pytest
import yaml
from harness import Gateway, Proc, free_port, kill_engines, llmgw_cmd, release_files, serve_files, wait_http, wait_until

from llmgw.mirror.api import ApiAccess, api_app, default_token_file, ensure_token
from llmgw.mirror.fetcher import Manager

pytestmark = pytest.mark.e2e

TAG = "b9999"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


class HuggingFace:
    """Recorded shapes of Hugging Face's API and file server: model info, the tree
    with LFS checksums, resolve URLs answering 302 to a CDN, a gated repository and
    a shard set. The first full download of each file is cut off half way."""

    def __init__(self, files: dict[str, dict[str, bytes]], gated: set[str]) -> None:
        self.files, self.gated = files, gated
        self.requests: list[tuple[str, str | None, str | None]] = []  # path, Range, Authorization
        self.cut: set[str] = set()
        hf = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _json(self, status: int, body) -> None:
                raw = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self):
                hf.requests.append((self.path, self.headers.get("Range"), self.headers.get("Authorization")))
                parts = self.path.split("?")[0].strip("/").split("/")
                if parts[:2] == ["api", "models"] and len(parts) >= 4:
                    repo = f"{parts[2]}/{parts[3]}"
                    if repo not in hf.files:
                        return self._json(404, {"error": "Repository not found"})
                    if repo in hf.gated and not self.headers.get("Authorization"):
                        return self._json(401, {"error": "Access to this repository is restricted"})
                    if len(parts) == 4:
                        return self._json(
                            200, {"id": repo, "sha": COMMIT, "gated": "manual" if repo in hf.gated else False}
                        )
                    return self._json(
                        200,
                        [
                            {
                                "type": "file",
                                "path": name,
                                "size": len(data),
                                "lfs": {"oid": hashlib.sha256(data).hexdigest(), "size": len(data)},
                            }
                            for name, data in hf.files[repo].items()
                        ],
                    )
                if len(parts) >= 5 and parts[2] == "resolve":
                    # As huggingface.co does: a redirect to the CDN holding LFS files.
                    self.send_response(302)
                    self.send_header("Location", f"/cdn/{parts[0]}/{parts[1]}/{'/'.join(parts[4:])}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if parts[0] == "cdn":
                    data = hf.files.get(f"{parts[1]}/{parts[2]}", {}).get("/".join(parts[3:]))
                    if data is None:
                        return self._json(404, {"error": "not found"})
                    rng = self.headers.get("Range")
                    if rng:
                        start, _, end = rng.split("=", 1)[1].partition("-")
                        start, end = int(start), min(int(end) if end else len(data) - 1, len(data) - 1)
                        self.send_response(206)
                        self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
                        self.send_header("Content-Length", str(end - start + 1))
                        self.end_headers()
                        self.wfile.write(data[start : end + 1])
                        return
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    if self.path not in hf.cut and len(data) > 1 << 20:
                        hf.cut.add(self.path)
                        self.wfile.write(data[: len(data) // 2])
                        self.wfile.flush()
                        self.close_connection = True
                        return
                    self.wfile.write(data)
                    return
                self._json(404, {"error": "not found"})

            def log_message(self, *a):
                pass

        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}"

    def close(self) -> None:
        self.srv.shutdown()


def _raw_get(port: int, path: str) -> tuple[int, bytes]:
    """A request line sent exactly as written: clients normalise ../ away."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.putrequest("GET", path, skip_accept_encoding=True)
    conn.endheaders()
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    return resp.status, body


@pytest.mark.slow  # minutes on two cores
def test_mirror_fetches_resumes_and_serves_the_fleet(llama_server_bin, tiny_model, tmp_path):
    model_bytes = tiny_model.read_bytes()
    hf = HuggingFace(
        {
            "acme/tiny-GGUF": {"tiny.gguf": model_bytes},
            "acme/gated-GGUF": {"g.gguf": b"GGUF" + b"\0" * 100},
            "acme/split-GGUF": {"s-00001-of-00002.gguf": b"x" * 1000, "s-00002-of-00002.gguf": b"y" * 1000},
        },
        gated={"acme/gated-GGUF"},
    )
    releases, stop_releases = serve_files(release_files(llama_server_bin, TAG))
    mirror_dir = tmp_path / "mirror"
    mirror_dir.mkdir()
    (tmp_path / "outside.txt").write_text("secret outside the root")
    os.symlink(tmp_path / "outside.txt", mirror_dir / "escape.txt")
    wport, aport = free_port(), free_port()
    base = f"http://127.0.0.1:{wport}"
    env = {**os.environ, "HF_ENDPOINT": hf.url, "PYTHONUNBUFFERED": "1"}
    procs: list[Proc] = []

    # The llama.cpp release archive goes into the mirror first, with its checksum kept.
    asset = f"llama-{TAG}-bin-ubuntu-x64.tar.gz"
    # The release server is on loopback: the operator's own, so allowed by name.
    r = subprocess.run(
        llmgw_cmd(
            "mirror",
            "--dir",
            str(mirror_dir),
            "add",
            f"{releases}/{TAG}/{asset}",
            "--model",
            "llama.cpp",
            "--version",
            TAG,
            "--base",
            base,
            "--allow-local-sources",
        ),
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "sha256 " in r.stdout and f"source: {base}/llama.cpp/{TAG}/{asset}" in r.stdout

    # Made beforehand, as `llmgw mirror init` does, so the control plane can read it at its start.
    token_file = default_token_file(mirror_dir)
    ensure_token(token_file)
    mirror = Proc(
        llmgw_cmd(
            "mirror",
            "--dir",
            str(mirror_dir),
            "serve",
            "--listen",
            f"127.0.0.1:{wport}",
            "--api-listen",
            f"0.0.0.0:{aport}",
            "--base",
            base,
            "--api-allow",
            "10.255.255.1",
        ),
        tmp_path / "mirror.log",
        env=env,
    )
    procs.append(mirror)
    agent_port = free_port()
    gw = Gateway(
        tmp_path,
        models=[],
        agent_listen=f"127.0.0.1:{agent_port}",
        agent_tls=None,
        control={"enabled": True, "interval": "500ms", "base_backoff": "1s"},
        engines={"llamacpp": TAG, "release_url": f"{base}/llama.cpp"},
        mirror={"api": f"http://127.0.0.1:{aport}", "token_file": str(token_file)},
    )
    procs.append(gw)
    agent = None
    engine_pids: list[int] = []
    try:
        wait_http(f"http://127.0.0.1:{aport}/v1/health", mirror.proc, 30, mirror.log)
        assert "for 10.255.255.1 and this machine only" in mirror.text()
        gw.wait_up(ready=False)

        def ctl(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run(
                llmgw_cmd("ctl", *args, "--server", gw.admin, "--token-file", str(gw.token_file)),
                capture_output=True,
                text=True,
                timeout=120,
            )

        # A gated repository without a token: refused with what to do, nothing kept.
        r = ctl("mirror", "fetch", "hf:acme/gated-GGUF/g.gguf", "--model", "gated", "--version", "v1")
        assert r.returncode == 1 and "gated" in r.stderr and "HF_TOKEN" in r.stderr, r.stderr

        # The first download is cut off half way: failed, with the reason, nothing served.
        r = ctl("mirror", "fetch", "hf:acme/tiny-GGUF/tiny.gguf", "--model", "tiny", "--version", "v1", "--wait")
        assert r.returncode == 1 and "failed" in r.stderr, r.stdout + r.stderr
        status, _ = _raw_get(wport, "/tiny/v1/tiny.gguf")
        assert status == 404
        # Asked again, it resumes from the partial file and completes.
        r = ctl("mirror", "fetch", "hf:acme/tiny-GGUF/tiny.gguf", "--model", "tiny", "--version", "v1", "--wait")
        assert r.returncode == 0 and "is present" in r.stdout, r.stdout + r.stderr
        resumed = [rng for path, rng, _ in hf.requests if path.startswith("/cdn/acme/tiny-GGUF/") and rng]
        assert any(rng.startswith("bytes=") and not rng.startswith("bytes=0-") for rng in resumed), hf.requests
        assert (
            hashlib.sha256((mirror_dir / "tiny" / "v1" / "tiny.gguf").read_bytes()).hexdigest()
            == hashlib.sha256(model_bytes).hexdigest()
        )
        st = json.loads(ctl("mirror", "status", "tiny", "v1", "--json").stdout)
        assert st["state"] == "present" and st["files"][0]["sha256"] == hashlib.sha256(model_bytes).hexdigest()

        # A shard set arrives as one version; its manifest lists both files.
        r = ctl(
            "mirror",
            "fetch",
            "hf:acme/split-GGUF/s-00001-of-00002.gguf",
            "--model",
            "split",
            "--version",
            "v1",
            "--wait",
        )
        assert r.returncode == 0, r.stdout + r.stderr
        manifest = httpx.get(f"{base}/split/v1/").json()
        assert [f["name"] for f in manifest["files"]] == ["s-00001-of-00002.gguf", "s-00002-of-00002.gguf"]

        # Nothing outside the root is ever served.
        for path in (
            "/../outside.txt",
            "/tiny/../../outside.txt",
            "/%2e%2e/outside.txt",
            "/tiny/v1/..%2f..%2f..%2foutside.txt",
            "/%252e%252e/outside.txt",
            "/escape.txt",
            "/tiny/v1/.tiny.gguf.part",
            "/..\\outside.txt",
        ):
            status, body = _raw_get(wport, path)
            assert status == 404 and b"secret" not in body, (path, status, body[:200])
        assert httpx.post(f"{base}/tiny/v1/tiny.gguf").status_code == 405

        # The management API answers only this machine and the control plane's address.
        outside = next(
            (
                a
                for a in subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
                if "." in a and not a.startswith("127.")
            ),
            None,
        )
        if outside is not None:
            r = httpx.get(f"http://{outside}:{aport}/v1/models")
            assert r.status_code == 403 and "managed by its control plane only" in r.text

        # One step from the mirrored version to a served model.
        r = ctl("mirror", "serve", "tiny", "v1", "--min", "1")
        assert r.returncode == 0 and f"from {base}/tiny/v1/tiny.gguf" in r.stdout, r.stdout + r.stderr
        mirror_bin = llmgw_cmd(
            "mirror",
            "--dir",
            str(mirror_dir),
            "remove",
            "--model",
            "tiny",
            "--version",
            "v1",
            "--file",
            "tiny.gguf",
            "--server",
            gw.admin.removeprefix("http://"),
            "--base",
            base,
            "--token-file",
            str(gw.token_file),
        )
        r = subprocess.run(mirror_bin, capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and "a model still refers to tiny/v1/tiny.gguf" in r.stderr, r.stdout + r.stderr
        assert (mirror_dir / "tiny" / "v1" / "tiny.gguf").exists()

        cfg = tmp_path / "agent.yaml"
        cfg.write_text(
            yaml.safe_dump(
                {
                    "server": f"127.0.0.1:{agent_port}",
                    "tls": None,
                    "node_id": "node-a",
                    "heartbeat_interval": "500ms",
                    "reconnect_base": "300ms",
                    "reconnect_max": "1s",
                    "weights_cache": str(tmp_path / "weights"),
                    "engines_dir": str(tmp_path / "engines"),
                    "supervisor": {"work_dir": str(tmp_path / "state"), "health_interval": "250ms"},
                    "discovery": {"skip_gpus": True},
                }
            )
        )
        agent = Proc(llmgw_cmd("agent", "--config", str(cfg)), tmp_path / "agent.log", env=env)
        procs.append(agent)
        rows = wait_until(
            lambda: [
                r
                for r in httpx.get(gw.admin + "/api/v1/replicas", headers=gw.admin_auth).json()["replicas"]
                if r["state"] == "ready"
            ],
            120,
            "the replica from the mirror to be ready",
            procs,
        )
        engine_pids = [s["pid"] for r in rows for s in r["shards"] if s.get("pid")]
        # The engine and the weights both came from the mirror.
        assert any(p.name == "llama-server" for p in (tmp_path / "engines").rglob("llama-server"))
        held = [p for p in (tmp_path / "weights").rglob("*") if p.is_file() and p.stat().st_size == len(model_bytes)]
        assert held, list((tmp_path / "weights").rglob("*"))
        key = gw.create_key()
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=60)
        reply = client.chat.completions.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].message.content is not None
    finally:
        for p in reversed(procs):
            if p.alive():
                p.stop()
        kill_engines(engine_pids)
        stop_releases()
        hf.close()


def test_the_mirror_api_answers_only_its_token_never_a_web_page_and_the_control_plane_drives_it_with_its_copy(tmp_path):
    small = os.urandom(50_000)
    hf = HuggingFace({"acme/small": {"small.bin": small}}, gated=set())
    page = HuggingFace({}, gated=set())  # another server on loopback: a page only this machine should see
    mirror_dir = tmp_path / "models"
    mirror_dir.mkdir()
    wport, aport = free_port(), free_port()
    base, api = f"http://127.0.0.1:{wport}", f"http://127.0.0.1:{aport}"
    # HF_ENDPOINT on loopback is the operator's own setting: the one local source fetched without the flag.
    env = {**os.environ, "HF_ENDPOINT": hf.url, "PYTHONUNBUFFERED": "1"}
    mirror = Proc(
        llmgw_cmd(
            "mirror",
            "--dir",
            str(mirror_dir),
            "serve",
            "--listen",
            f"127.0.0.1:{wport}",
            "--api-listen",
            f"127.0.0.1:{aport}",
            "--base",
            base,
        ),
        tmp_path / "mirror.log",
        env=env,
    )
    procs: list[Proc] = [mirror]
    try:
        wait_http(f"{api}/v1/health", mirror.proc, 30, mirror.log)
        token_file = tmp_path / "models.api-token"
        token = token_file.read_text().strip()
        assert (token_file.stat().st_mode & 0o777) == 0o600
        assert f"made the management API token {token_file}" in mirror.text()
        assert f"credential: the token in {token_file}" in mirror.text()
        auth = {"Authorization": f"Bearer {token}"}

        # Every route of the app the mirror serves (taken from its router, so a route added later is
        # in this list too) refuses a request without the token, and says where the token is.
        app = api_app(Manager(tmp_path / "unused"), mirror_dir, base, ApiAccess(token="x", token_file="x"))
        routes = [(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"]
        assert ("POST", "/v1/models") in routes and ("DELETE", "/v1/models/{model}/{version}") in routes
        for method, path in routes:
            r = httpx.request(
                method,
                api + path.replace("{model}", "m").replace("{version}", "v"),
                json={} if method == "POST" else None,
            )
            if path == "/v1/health":
                assert r.status_code == 200  # the probe
                continue
            assert r.status_code == 401 and str(token_file) in r.json()["error"]["message"], (method, path, r.text)

        # A web page's cross-origin text/plain POST (no CORS preflight) is refused even with the token,
        # and nothing is fetched.
        body = json.dumps({"source": "hf:acme/small/small.bin", "model": "small", "version": "v1"})
        r = httpx.post(
            f"{api}/v1/models",
            content=body,
            headers={**auth, "Origin": "http://evil.example", "Content-Type": "text/plain"},
        )
        assert r.status_code == 403 and "web pages" in r.json()["error"]["message"]
        r = httpx.post(f"{api}/v1/models", content=body, headers={**auth, "Content-Type": "text/plain"})
        assert r.status_code == 415
        # A DNS-rebinding page's requests name its own host.
        r = httpx.get(f"{api}/v1/models", headers={**auth, "Host": f"evil.example:{aport}"})
        assert r.status_code == 421
        assert hf.requests == [] and httpx.get(f"{api}/v1/models", headers=auth).json()["models"] == []

        # The control plane holds its own copy of the token (as `llmgw mirror init` tells the operator).
        copy = tmp_path / "cp" / "mirror-token"
        copy.parent.mkdir()
        copy.write_text(token + "\n")
        copy.chmod(0o600)
        gw = Gateway(tmp_path / "cp", models=[], mirror={"api": api, "token_file": str(copy)})
        procs.append(gw)
        gw.wait_up(ready=False)
        r = gw.ctl(
            "mirror", "fetch", "hf:acme/small/small.bin", "--model", "small", "--version", "v1", "--wait", timeout=120
        )
        assert r.returncode == 0 and "is present" in r.stdout, r.stdout + r.stderr
        assert (mirror_dir / "small" / "v1" / "small.bin").read_bytes() == small
        assert httpx.get(f"{base}/small/v1/small.bin").content == small

        # A page on this machine's loopback is not fetched (and so not republished on the byte port).
        r = gw.ctl("mirror", "fetch", f"{page.url}/internal.bin", "--model", "internal", "--version", "v1", timeout=60)
        assert r.returncode == 1 and "is a loopback address" in r.stderr and "--allow-local-sources" in r.stderr, (
            r.stdout + r.stderr
        )
        assert page.requests == [] and not (mirror_dir / "internal").exists()
    finally:
        for p in reversed(procs):
            if p.alive():
                p.stop()
        hf.close()
        page.close()
