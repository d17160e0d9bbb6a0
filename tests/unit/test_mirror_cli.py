"""`llmgw mirror`: add, list, unused, remove, init, serve — with a stand-in fetcher
where the network would be, a stub admin API for the catalog, and a recording
runner for init's system commands."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, SimpleHTTPRequestHandler, ThreadingHTTPServer

import pytest
from test_mirror_serve_fake import FakeManager
from typer.testing import CliRunner

import llmgw.cli.mirror as mirror_cli
from llmgw.cli.main import app

runner = CliRunner()


@pytest.fixture
def fake(tmp_path, monkeypatch):
    root = tmp_path / "models"
    root.mkdir()
    mgr = FakeManager(root)
    monkeypatch.setattr(mirror_cli, "_manager", lambda r, **kw: mgr)
    return root, mgr


def run(*args):
    return runner.invoke(app, ["mirror", *args], catch_exceptions=False)


@pytest.fixture
def catalog():
    """A stub control-plane admin API; set .sources, or .status to fail."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            server.auth.append(self.headers.get("Authorization"))
            st = server.status
            if server.token and self.headers.get("Authorization") != f"Bearer {server.token}":
                st = 401
            body = json.dumps(
                {"models": [{"name": f"m{i}", "source": s} for i, s in enumerate(server.sources)]}
            ).encode()
            self.send_response(st)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.sources, server.status, server.token, server.auth = [], 200, None, []
    server.addr = f"127.0.0.1:{server.server_address[1]}"
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield server
    server.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- list


def test_mirror_list_of_an_empty_mirror_says_it_is_empty(fake):
    root, _ = fake
    r = run("--dir", str(root), "list")
    assert r.exit_code == 0 and r.output == f"The mirror at {root} is empty.\n"


def test_list_table_and_total(fake):
    root, mgr = fake
    mgr.put("qwen", "v1", "q.gguf", b"x" * 2000)
    mgr.put("bge", "v2", "b.gguf", b"y" * 500)
    r = run("list", "--dir", str(root))  # --dir works after the subcommand too
    lines = r.output.splitlines()
    assert lines[0].split() == ["MODEL", "VERSION", "FILE", "SIZE"]
    assert lines[1].split()[:3] == ["bge", "v2", "b.gguf"] and lines[2].split()[:3] == ["qwen", "v1", "q.gguf"]
    assert lines[-1] == "2.5 kB in 2 files."


# ---------------------------------------------------------------- add


def test_add_prints_the_layout_checksum_and_source(fake):
    root, mgr = fake
    mgr.auto_finish = True
    mgr.payloads["https://h/x/q.gguf?download=true"] = b"weights"
    r = run(
        "--dir",
        str(root),
        "add",
        "https://h/x/q.gguf?download=true",
        "--model",
        "qwen",
        "--version",
        "2024-01-01",
        "--base",
        "http://mirror.internal:8081",
    )
    assert r.exit_code == 0, r.output
    assert r.output.splitlines() == [
        "fetching https://h/x/q.gguf?download=true",
        "",
        "qwen/2024-01-01/q.gguf  7 B",
        f"  sha256 {hashlib.sha256(b'weights').hexdigest()}",
        "",
        "Point a model at it with:",
        "  source: http://mirror.internal:8081/qwen/2024-01-01/q.gguf",
    ]


def test_add_as_anyway_and_fetch_alias(fake):
    root, mgr = fake
    mgr.auto_finish = True
    r = run(
        "--dir", str(root), "fetch", "https://h/a.gguf", "--model", "m", "--version", "v", "--as", "b.gguf", "--anyway"
    )
    assert r.exit_code == 0 and "source: http://" in r.output and r.output.rstrip().endswith("/m/v/b.gguf")
    assert mgr.fetched == [("https://h/a.gguf", "m", "v", "b.gguf", True)]


def test_add_needs_the_layout(fake):
    root, _ = fake
    r = run("--dir", str(root), "add", "https://h/a.gguf", "--model", "m")
    assert r.exit_code == 1 and "--model and --version are required: they are the layout" in r.output


def test_add_refused_by_the_fetcher(fake):
    root, mgr = fake
    mgr.put("m", "v", "a.gguf", b"1")
    r = run("--dir", str(root), "add", "https://h/a.gguf", "--model", "m", "--version", "v")
    assert r.exit_code == 1 and "never overwritten" in r.output


def test_add_with_the_real_fetcher_from_a_local_server(tmp_path):
    """No stand-in: the fetcher downloads from a file server on loopback."""
    site = tmp_path / "site"
    site.mkdir()
    payload = os.urandom(300_000)
    (site / "tok.bin").write_bytes(payload)

    class Quiet(SimpleHTTPRequestHandler):
        def __init__(self, *a, **k):
            super().__init__(*a, directory=str(site), **k)

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    root = tmp_path / "models"
    root.mkdir()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}/tok.bin"
        # A server on loopback: refused unless the operator says it is theirs.
        r = run("--dir", str(root), "add", url, "--model", "tok", "--version", "v1")
        assert r.exit_code == 1 and "is a loopback address" in r.output and "--allow-local-sources" in r.output
        assert not (root / "tok").exists()
        r = run(
            "--dir",
            str(root),
            "add",
            url,
            "--model",
            "tok",
            "--version",
            "v1",
            "--base",
            "http://m:8081",
            "--allow-local-sources",
        )
        assert r.exit_code == 0, r.output
        assert f"  sha256 {hashlib.sha256(payload).hexdigest()}" in r.output
        assert "  source: http://m:8081/tok/v1/tok.bin" in r.output
        assert (root / "tok" / "v1" / "tok.bin").read_bytes() == payload
        r = run("--dir", str(root), "list")
        assert r.output.splitlines()[1].split() == ["tok", "v1", "tok.bin", "300", "kB"] and "in 1 files." in r.output
    finally:
        srv.shutdown()


# ---------------------------------------------------------------- unused


def test_unused_refuses_without_the_catalog(fake):
    root, mgr = fake
    mgr.put("qwen", "v1", "q.gguf", b"1")
    r = run("--dir", str(root), "unused", "--server", f"127.0.0.1:{free_port()}")
    assert r.exit_code == 1 and "cannot read the catalog, so nothing can be called unused: " in r.output


def test_unused_compares_by_path(fake, catalog):
    root, mgr = fake
    mgr.put("qwen", "v1", "q.gguf", b"1")
    mgr.put("big", "v2", "a-1.gguf", b"22")
    mgr.put("big", "v2", "a-2.gguf", b"22")
    mgr.put("old", "v0", "o.gguf", b"333")
    catalog.sources = ["https://mirror.internal/qwen/v1/q.gguf", "http://10.0.0.2:8081/big/v2", "hf:Qwen/x/y.gguf"]
    r = run("--dir", str(root), "unused", "--server", catalog.addr)
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0].split() == ["MODEL", "VERSION", "FILE", "SIZE"] and lines[1].split()[:3] == ["old", "v0", "o.gguf"]
    assert "3 B in 1 files that no model refers to." in r.output and "Retire the catalog entry first" in r.output
    catalog.sources.append("http://localhost:8081/old/v0/")
    r = run("--dir", str(root), "unused", "--server", catalog.addr)
    assert r.output.strip() == "Every file here is referred to by a model. (4 files, 4 catalog sources.)"


def test_unused_reads_the_catalog_with_an_admin_token_and_says_how_to_give_one(fake, catalog, tmp_path, monkeypatch):
    from llmgw.files import write_secret_file

    root, mgr = fake
    mgr.put("qwen", "v1", "q.gguf", b"1")
    catalog.token = "llmgw-admin-t"
    monkeypatch.delenv("LLMGW_ADMIN_TOKEN", raising=False)
    monkeypatch.setattr("llmgw.cli.admin_client._candidate_files", list)
    r = run("--dir", str(root), "unused", "--server", catalog.addr)
    assert r.exit_code == 1 and "needs an admin token; pass --token-file or set LLMGW_ADMIN_TOKEN" in r.output
    write_secret_file(tmp_path / "admin-token", catalog.token)
    r = run("--dir", str(root), "unused", "--server", catalog.addr, "--token-file", str(tmp_path / "admin-token"))
    assert r.exit_code == 0 and "1 B in 1 files that no model refers to." in r.output, r.output
    monkeypatch.setenv("LLMGW_ADMIN_TOKEN", catalog.token)
    r = run(
        "--dir", str(root), "remove", "--model", "qwen", "--version", "v1", "--file", "q.gguf", "--server", catalog.addr
    )
    assert r.exit_code == 0 and catalog.auth[-1] == f"Bearer {catalog.token}"


def test_unused_refuses_on_an_error_status(fake, catalog):
    root, _ = fake
    catalog.status = 503
    r = run("--dir", str(root), "unused", "--server", catalog.addr)
    assert r.exit_code == 1 and "503" in r.output


# ---------------------------------------------------------------- remove


def test_remove_needs_all_three(fake):
    root, _ = fake
    r = run("--dir", str(root), "remove", "--model", "m", "--version", "v")
    assert r.exit_code == 1 and "--model, --version and --file are all required" in r.output


def test_remove_refuses_when_in_use(fake, catalog):
    root, mgr = fake
    mgr.put("qwen", "v1", "q.gguf", b"1")
    catalog.sources = ["http://mirror:8081/qwen/v1/"]
    r = run(
        "--dir", str(root), "remove", "--model", "qwen", "--version", "v1", "--file", "q.gguf", "--server", catalog.addr
    )
    assert r.exit_code == 1 and "a model still refers to qwen/v1/q.gguf; retire the catalog entry first" in r.output
    assert (root / "qwen" / "v1" / "q.gguf").exists()


def test_remove_refuses_without_the_catalog_unless_forced(fake):
    root, mgr = fake
    mgr.put("qwen", "v1", "q.gguf", b"1")
    args = [
        "--dir",
        str(root),
        "remove",
        "--model",
        "qwen",
        "--version",
        "v1",
        "--file",
        "q.gguf",
        "--server",
        f"127.0.0.1:{free_port()}",
    ]
    r = run(*args)
    assert r.exit_code == 1 and "cannot read the catalog to check whether this is still in use: " in r.output
    assert "  Pass --force to remove it anyway" in r.output
    r = run(*args, "--force")
    assert r.exit_code == 0 and r.output == "removed qwen/v1/q.gguf\n"
    assert not (root / "qwen" / "v1" / "q.gguf").exists()


def test_remove_when_unused(fake, catalog):
    root, mgr = fake
    mgr.put("qwen", "v1", "q.gguf", b"1")
    catalog.sources = ["http://mirror:8081/qwen/v2/q.gguf"]
    r = run(
        "--dir", str(root), "remove", "--model", "qwen", "--version", "v1", "--file", "q.gguf", "--server", catalog.addr
    )
    assert r.exit_code == 0 and r.output == "removed qwen/v1/q.gguf\n"


# ---------------------------------------------------------------- init


class FakeSystem:
    """Records commands; knows whether the user exists and the unit is enabled/active."""

    def __init__(self):
        self.calls: list[list[str]] = []
        self.user = False
        self.enabled = self.active = False

    def __call__(self, argv):
        self.calls.append(argv)
        if argv[0] == "id":
            return (0 if self.user else 1), ""
        if argv[0] == "useradd":
            self.user = True
        if argv[:2] == ["systemctl", "is-enabled"]:
            return (0 if self.enabled else 1), ""
        if argv[:2] == ["systemctl", "is-active"]:
            return (0 if self.active else 3), ""
        if argv[:3] == ["systemctl", "enable", "--now"]:
            self.enabled = self.active = True
        return 0, ""


def test_init_writes_the_unit_and_is_idempotent(tmp_path, monkeypatch):
    system = FakeSystem()
    monkeypatch.setattr(mirror_cli, "_runner", system)
    d, unit = tmp_path / "srv" / "models", tmp_path / "etc" / "llmgw-mirror.service"
    args = [
        "--dir",
        str(d),
        "init",
        "--control-plane",
        "10.0.0.5:7443",
        "--unit-path",
        str(unit),
        "--base",
        "http://models.internal:8081",
    ]
    r = run(*args)
    assert r.exit_code == 0, r.output
    assert "created the system user llmgw" in r.output and f"created {d}, owned by llmgw" in r.output
    assert f"wrote {unit}" in r.output and "enabled and started llmgw-mirror.service" in r.output
    token_file = tmp_path / "srv" / "models.api-token"
    assert f"made the management API token {token_file} (mode 0600, owned by llmgw)" in r.output
    assert (token_file.stat().st_mode & 0o777) == 0o600 and token_file.read_text().startswith("llmgw-mirror-")
    assert ["chown", "llmgw:llmgw", str(token_file)] in system.calls
    # What to put on the control plane, ready to paste.
    assert f"needs the token in {token_file}" in r.output
    assert "  mirror:\n    api: http://models.internal:8082\n    token_file: /etc/llmgw/mirror-token" in r.output
    text = unit.read_text()
    for line in (
        "User=llmgw",
        "Group=llmgw",
        "NoNewPrivileges=true",
        "ProtectSystem=strict",
        "ProtectHome=true",
        "PrivateTmp=true",
        f"ReadWritePaths={d}",
        "WantedBy=multi-user.target",
    ):
        assert line in text.splitlines(), line
    exec_start = text.split("ExecStart=", 1)[1].split("\nUser=", 1)[0].replace("\\\n", " ").split()
    assert exec_start == [
        "/usr/local/bin/llmgw",
        "mirror",
        "serve",
        "--dir",
        str(d),
        "--listen",
        ":8081",
        "--api-listen",
        ":8082",
        "--base",
        "http://models.internal:8081",
        "--api-token-file",
        str(token_file),
        "--api-allow",
        "10.0.0.5",
    ]
    assert d.is_dir()
    assert ["chown", "llmgw:llmgw", str(d)] in system.calls
    assert ["systemctl", "daemon-reload"] in system.calls
    assert (
        system.calls[0] == ["id", "-u", "llmgw"] and system.calls[1][0] == "useradd" and "--system" in system.calls[1]
    )

    system.calls.clear()
    token = token_file.read_text()
    r = run(*args)
    assert r.exit_code == 0 and r.output.startswith("Nothing changed:")
    assert token_file.read_text() == token and f"needs the token in {token_file}" in r.output
    assert not any(c[0] in ("useradd", "chown") or c[1:2] in (["daemon-reload"], ["enable"]) for c in system.calls)

    r = run(*[a if a != "10.0.0.5:7443" else "10.0.0.6" for a in args])
    assert f"updated {unit} (--api-allow 10.0.0.6)" in r.output and "restarted llmgw-mirror.service" in r.output
    assert "--api-allow 10.0.0.6" in unit.read_text()


def test_init_resolves_a_host_name_and_needs_the_control_plane(tmp_path, monkeypatch):
    from llmgw.mirror.systemd import control_plane_allow

    assert control_plane_allow("cp.internal:7443", lambda h: ["10.1.1.1", "fd00::1"]) == ["10.1.1.1", "fd00::1"]
    assert control_plane_allow("https://[fd00::2]:8080/") == ["fd00::2"]
    assert control_plane_allow("10.0.0.0/24") == ["10.0.0.0/24"]
    r = run("--dir", str(tmp_path), "init")
    assert r.exit_code == 1 and "--control-plane is required" in r.output


# ---------------------------------------------------------------- serve


def test_serve_refuses_what_is_not_a_directory(tmp_path):
    f = tmp_path / "file"
    f.write_text("")
    r = run("--dir", str(f), "serve")
    assert r.exit_code == 1 and f"{f} is not a directory to serve" in r.output
    r = run("--dir", str(tmp_path), "serve", "--api-allow", "10.0.0.1,ten")
    assert r.exit_code == 1 and '--api-allow "ten" is not an address or a network' in r.output
    r = run("--dir", str(tmp_path), "serve", "--tls-ca", "ca.pem")
    assert r.exit_code == 1 and "go together" in r.output
    r = run("--dir", str(tmp_path), "serve", "--tls-client", "control-plane")
    assert r.exit_code == 1 and "only a TLS listener sees" in r.output
    r = run("--dir", str(tmp_path), "serve", "--api-token-file", str(tmp_path / "token"))
    assert r.exit_code == 1 and "inside the mirror's directory" in r.output and not (tmp_path / "token").exists()
    exposed = tmp_path.parent / f"{tmp_path.name}-exposed-token"
    exposed.write_text("t\n")
    exposed.chmod(0o644)
    r = run("--dir", str(tmp_path), "serve", "--api-token-file", str(exposed))
    assert r.exit_code == 1 and "others can read it" in r.output


def _start_serve(*args):
    return subprocess.Popen(
        [sys.executable, "-m", "llmgw.cli.main", "mirror", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _lines(proc, n, timeout=20.0):
    out, end = [], time.monotonic() + timeout
    while len(out) < n and time.monotonic() < end:
        line = proc.stdout.readline()
        if not line:
            break
        out.append(line.rstrip("\n"))
    return out


def test_serve_makes_its_token_says_who_may_call_and_serves_only_with_the_token(tmp_path):
    import urllib.error
    import urllib.request

    root = tmp_path / "models"
    (root / "qwen" / "v1").mkdir(parents=True)
    (root / "qwen" / "v1" / "q.gguf").write_bytes(b"abc")
    token_file = tmp_path / "models.api-token"
    p1, p2 = free_port(), free_port()
    proc = _start_serve(
        "--dir",
        str(root),
        "serve",
        "--listen",
        f"127.0.0.1:{p1}",
        "--api-listen",
        f"127.0.0.1:{p2}",
        "--base",
        "http://mirror:8081",
        "--api-allow",
        "10.0.0.5,10.1.0.0/16",
    )
    try:
        lines = _lines(proc, 4)
        assert lines == [
            f"made the management API token {token_file} (mode 0600); the control plane needs a copy, "
            "named by mirror.token_file in server.yaml",
            f"serving {root} on 127.0.0.1:{p1}",
            f"management API on 127.0.0.1:{p2}, for 10.0.0.5, 10.1.0.0/16 and this machine only; "
            f"credential: the token in {token_file}",
            "catalog sources should point at http://mirror:8081",
        ], lines
        assert (token_file.stat().st_mode & 0o777) == 0o600
        with urllib.request.urlopen(f"http://127.0.0.1:{p1}/qwen/v1/q.gguf") as r:
            assert r.read() == b"abc"
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"http://127.0.0.1:{p2}/v1/models")
        assert refused.value.code == 401 and str(token_file) in refused.value.read().decode()
        ask = urllib.request.Request(
            f"http://127.0.0.1:{p2}/v1/models", headers={"Authorization": f"Bearer {token_file.read_text().strip()}"}
        )
        with urllib.request.urlopen(ask) as r:
            assert json.loads(r.read())["models"][0]["model"] == "qwen"
    finally:
        proc.terminate()
        proc.wait(10)
    assert proc.returncode == 0


def test_serve_from_any_address_says_so_and_a_busy_port_ends_it(tmp_path):
    root = tmp_path / "models"
    root.mkdir()
    token_file = tmp_path / "elsewhere" / "token"
    p1, p2 = free_port(), free_port()
    proc = _start_serve(
        "--dir",
        str(root),
        "serve",
        "--listen",
        f"127.0.0.1:{p1}",
        "--api-listen",
        f"127.0.0.1:{p2}",
        "--api-token-file",
        str(token_file),
    )
    try:
        lines = _lines(proc, 4)
        assert lines[0].startswith(f"made the management API token {token_file} ")
        assert lines[2] == f"management API on 127.0.0.1:{p2}, from any address; credential: the token in {token_file}"
        assert lines[3] == "catalog sources should point at http://localhost:8081"
        second = _start_serve(
            "--dir",
            str(root),
            "serve",
            "--listen",
            f"127.0.0.1:{free_port()}",
            "--api-listen",
            f"127.0.0.1:{p2}",
            "--api-token-file",
            str(token_file),
        )
        out, _ = second.communicate(timeout=20)
        assert second.returncode == 1
        assert "made the management API token" not in out  # the file was there: it is read, not replaced
        assert f"error: serving the API: 127.0.0.1:{p2} is already in use by another process" in out
    finally:
        proc.terminate()
        proc.wait(10)
