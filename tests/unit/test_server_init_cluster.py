"""`server init`'s steps past the control plane: the mirror beside it, llama.cpp in that mirror, this
machine as a node, the starter model; real files in a temporary root, systemd and the admin API faked."""

from __future__ import annotations

import hashlib
import io
import tarfile
import time
from pathlib import Path

import pytest
import yaml

from llmgw.init import InitError, cluster
from llmgw.init.run import Options, server_init
from llmgw.pki import common_name, load_cert, verify_issued_by
from llmgw.progress import PlainSteps
from llmgw.protocol.admin import ModelsReply, NodesReply, ReplicasReply
from tests.unit.test_server_init import FakeSystem, machine


class FakeAdmin:
    """The admin API as a control plane answers it: the node joins once its agent is started."""

    def __init__(self, system: FakeSystem, *, install: str = "ready", classes: list[str] | None = None) -> None:
        self.system = system
        self.install = install
        self.classes = classes or []
        self.models: list[dict] = []
        self.calls: list[tuple[str, str]] = []
        self.url: str | None = None
        self.token: str | None = None

    def __call__(self, url: str, token: str | None) -> FakeAdmin:
        self.url, self.token = url, token
        return self

    def call(self, method, path, shape, body=None):
        self.calls.append((method, path))
        if path == "/api/v1/nodes":
            rows = []
            if "llmgw-agent.service" in self.system.active:
                row = {"node_id": "cp1", "state": "ready", "connected": True, "last_seen": time.time() + 1}
                row["classes"] = self.classes
                if self.install == "ready":
                    row["engines"] = {"llamacpp": "b10991"}
                else:
                    row["provision"] = {
                        "llamacpp": {"engine": "llamacpp", "state": "failed", "detail": "404 from the mirror"}
                    }
                rows.append(row)
            return NodesReply.model_validate({"nodes": rows})
        if path == "/api/v1/models" and method == "GET":
            return ModelsReply.model_validate({"models": [{"name": m["name"]} for m in self.models]})
        if path == "/api/v1/models" and method == "POST":
            self.models.append(body.model)
            return shape.model_validate({"model": {"name": body.model["name"]}})
        if path == "/api/v1/replicas":
            return ReplicasReply.model_validate(
                {"replicas": [{"id": "r1", "model": m["name"], "state": "ready"} for m in self.models]}
            )
        raise AssertionError(f"unexpected call {method} {path}")


def systemd_machine(tmp_path: Path, **kw):
    system = FakeSystem()
    admin = FakeAdmin(system, **{k: kw.pop(k) for k in ("install", "classes") if k in kw})
    m = machine(tmp_path, system, health=lambda url: True, admin=admin, node_timeout=2, **kw)
    (tmp_path / "run/systemd/system").mkdir(parents=True)
    return m, system, admin


def release_archive(tmp_path: Path, name: str = "llama-b10991-bin-ubuntu-x64.tar.gz") -> Path:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        body = b"#!/bin/sh\necho llama-server\n"
        info = tarfile.TarInfo("build/bin/llama-server")
        info.size, info.mode = len(body), 0o755
        tf.addfile(info, io.BytesIO(body))
    path = tmp_path / name
    path.write_bytes(buf.getvalue())
    return path


def run(m, **kw) -> list[str]:
    lines: list[str] = []
    server_init(m, Options(admin="admin@example.com", **kw), PlainSteps(lines.append))
    return lines


def step(lines: list[str], n: int) -> str:
    return next(line for line in lines if line.startswith(f"{n}."))


def test_the_mirror_beside_it_serves_bytes_to_nodes_and_its_api_only_on_loopback(tmp_path):
    m, system, _ = systemd_machine(tmp_path)
    lines = run(m, no_node=True, no_model=True)
    unit = (m.units / "llmgw-mirror.service").read_text()
    assert "--api-listen 127.0.0.1:8082" in unit and "--listen :8081" in unit
    assert "--base http://10.0.0.5:8081" in unit and "--api-allow 127.0.0.1" in unit
    assert (tmp_path / "srv/models").is_dir() and (tmp_path / "srv/models.api-token").is_file()
    assert ["systemctl", "enable", "--now", "llmgw-mirror.service"] in system.calls
    # Started before the server, which reads the mirror's token when it starts.
    enables = [c[-1] for c in system.calls if c[:2] == ["systemctl", "enable"]]
    assert enables.index("llmgw-mirror.service") < enables.index("llmgw-server.service")
    assert "serving http://10.0.0.5:8081 to nodes" in step(lines, 7)


def test_a_given_llamacpp_archive_is_offered_under_the_name_agents_ask_for_with_its_checksum(tmp_path):
    m, _, _ = systemd_machine(tmp_path / "root")
    archive = release_archive(tmp_path, "my-build.tar.gz")
    lines = run(m, no_node=True, no_model=True, llamacpp_archive=str(archive))
    placed = tmp_path / "root/srv/models/llama.cpp/b10991/llama-b10991-bin-ubuntu-x64.tar.gz"
    assert placed.read_bytes() == archive.read_bytes()
    sidecar = placed.with_name(placed.name + ".sha256").read_text()
    assert sidecar == f"{hashlib.sha256(archive.read_bytes()).hexdigest()}  {placed.name}\n"
    assert "put" in step(lines, 9) and "llama.cpp/b10991/" in step(lines, 9)
    again = run(m, no_node=True, no_model=True, llamacpp_archive=str(archive))
    assert "kept" in step(again, 9) and "nothing changed" in "\n".join(again)


def test_an_archive_without_llama_server_is_refused_and_nothing_is_placed(tmp_path):
    m, _, _ = systemd_machine(tmp_path / "root")
    bogus = tmp_path / "bogus.tar.gz"
    with tarfile.open(bogus, "w:gz") as tf:
        info = tarfile.TarInfo("README")
        info.size = 2
        tf.addfile(info, io.BytesIO(b"hi"))
    with pytest.raises(InitError, match="holds no executable llama-server"):
        run(m, no_node=True, no_model=True, llamacpp_archive=str(bogus))
    assert not (tmp_path / "root/srv/models/llama.cpp").exists()


def test_when_releases_cannot_be_fetched_llama_server_is_built_from_source_and_offered(tmp_path, monkeypatch):
    m, _, _ = systemd_machine(tmp_path / "root")
    monkeypatch.setattr(cluster, "fetch_into_mirror", lambda *a, **k: a[6]("github.com did not answer") or None)
    built = tmp_path / "build/llama-server"
    built.parent.mkdir()
    built.write_bytes(b"\x7fELF built here")
    built.chmod(0o755)
    monkeypatch.setattr(cluster, "_source_build", lambda progress: built)
    lines = run(m, no_node=True, no_model=True)
    vdir = tmp_path / "root/srv/models/llama.cpp/b10991"
    placed = vdir / "llama-b10991-bin-ubuntu-x64.tar.gz"
    assert "github.com did not answer; built llama-server from source" in step(lines, 9)
    with tarfile.open(placed) as tf:
        assert "llama-b10991/llama-server" in tf.getnames()


def test_when_neither_releases_nor_a_source_build_work_the_fix_is_the_archive_flag(tmp_path, monkeypatch):
    m, _, _ = systemd_machine(tmp_path / "root")
    monkeypatch.setattr(cluster, "fetch_into_mirror", lambda *a, **k: a[6]("github.com did not answer") or None)

    def no_compiler(progress):
        raise OSError("no C++ compiler")

    monkeypatch.setattr(cluster, "_source_build", no_compiler)
    with pytest.raises(InitError, match="--llamacpp-archive FILE") as e:
        run(m, no_node=True, no_model=True)
    assert "github.com did not answer" in str(e.value) and "no C++ compiler" in str(e.value)


def test_this_machine_joins_as_a_node_labelled_as_the_control_plane_with_its_own_certificate(tmp_path):
    m, system, admin = systemd_machine(tmp_path)
    lines = run(m, no_model=True, llamacpp_archive=str(release_archive(tmp_path)))
    cert = m.etc / "agent.pem"
    verify_issued_by(m.pki / "ca.pem", cert)
    assert common_name(load_cert(cert)) == "cp1"
    data = yaml.safe_load((m.etc / "agent.yaml").read_text())
    assert data["server"] == "https://10.0.0.5:7443" and data["labels"] == {"llmgw.control-plane": "true"}
    assert data["tls"]["cert"] == str(cert) and "node_id" not in data  # the hostname is its default
    unit = (m.units / "llmgw-agent.service").read_text()
    assert "KillMode=process" in unit and "LimitMEMLOCK=infinity" in unit
    assert "cp1 joined with llama.cpp b10991" in step(lines, 10)
    assert admin.url == "http://127.0.0.1:9090" and admin.token and admin.token.startswith("llmgw-admin-")
    again = run(m, no_model=True)
    assert "kept" in step(again, 10) and not system.ran("restart")


def test_the_self_nodes_certificate_is_reissued_with_the_node_mark_and_never_under_an_administrators_name(tmp_path):
    from llmgw.pki import PKIError, client_kind, init_ca
    from llmgw.testing.pki import issue_unmarked

    pki, etc = tmp_path / "pki", tmp_path / "etc"
    etc.mkdir()
    init_ca(pki)
    old = issue_unmarked(pki, tmp_path / "old", "cp1")
    old.cert.rename(etc / "agent.pem")
    old.key.rename(etc / "agent-key.pem")
    assert cluster.agent_certificate(pki, etc, "cp1", frozenset({"admin"})) == f"issued {etc / 'agent.pem'} for cp1"
    assert client_kind(load_cert(etc / "agent.pem")) == "node"
    assert cluster.agent_certificate(pki, etc, "cp1", frozenset({"admin"})) is None  # marked: kept
    before = (etc / "agent.pem").read_bytes()
    with pytest.raises(PKIError, match="'admin' is an administrator's name"):
        cluster.agent_certificate(pki, etc, "admin", frozenset({"admin"}))
    assert (etc / "agent.pem").read_bytes() == before


def test_a_node_whose_llamacpp_install_fails_stops_init_with_the_agents_reason(tmp_path):
    m, _, _ = systemd_machine(tmp_path, install="failed")
    with pytest.raises(InitError, match="could not install llamacpp: 404 from the mirror"):
        run(m, no_model=True)


def test_offline_the_starter_model_falls_back_to_the_tiny_model_pinned_here_with_a_cpu_profile(tmp_path, monkeypatch):
    m, _, admin = systemd_machine(tmp_path / "root", classes=["l4-24g"])
    monkeypatch.setattr(cluster, "fetch_into_mirror", lambda *a, **k: a[6]("huggingface.co did not answer") or None)
    tiny = tmp_path / "tiny.gguf"
    tiny.write_bytes(b"GGUF tiny")
    monkeypatch.setattr(cluster, "tiny_model_path", lambda: tiny)
    lines = run(m, llamacpp_archive=str(release_archive(tmp_path)))
    (model,) = admin.models
    assert model["name"] == "tiny-test" and model["source"] == "http://10.0.0.5:8081/tiny-test/v1/tiny.gguf"
    assert (tmp_path / "root/srv/models/tiny-test/v1/tiny.gguf").read_bytes() == b"GGUF tiny"
    pin = {"llmgw.control-plane": "true"}
    assert model["profiles"] == [
        {"engine": "llamacpp", "gpu_class": "l4-24g", "node_selector": pin},
        {"engine": "llamacpp", "name": "llamacpp-cpu", "node_selector": pin},
    ]
    assert "huggingface.co did not answer" in step(lines, 11) and "it serves" in step(lines, 11)
    again = run(m)
    assert "kept tiny-test" in step(again, 11) and len(admin.models) == 1


def test_without_a_node_here_the_starter_model_is_unpinned_and_not_waited_for(tmp_path, monkeypatch):
    m, _, admin = systemd_machine(tmp_path / "root")
    monkeypatch.setattr(cluster, "fetch_into_mirror", lambda *a, **k: "http://10.0.0.5:8081/qwen/starter/q.gguf")
    lines = run(m, no_node=True, llamacpp_archive=str(release_archive(tmp_path)))
    (model,) = admin.models
    assert model["name"] == "qwen2.5-0.5b-instruct" and model["profiles"] == [
        {"engine": "llamacpp", "name": "llamacpp-cpu"}
    ]
    assert "starts on the first node added" in step(lines, 11)
    assert ("GET", "/api/v1/replicas") not in admin.calls
