"""`llmgw up`'s pieces: certificates made once and reused, the two configuration files, progress in words."""

from __future__ import annotations

import hashlib
import io
import stat
import sys
import tarfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from llmgw.config.agent import load_agent_config
from llmgw.config.server import DEFAULT_LLAMACPP, load_server_config
from llmgw.pki import common_name, init_ca, load_cert, san_names, verify_issued_by
from llmgw.protocol import ByteProgress, ProvisionState, ProvisionStatus
from llmgw.up import UpError
from llmgw.up.config import mirror_ports, write_agent_config, write_server_config
from llmgw.up.engine import LocalRelease, check_llama_server
from llmgw.up.model import Choice
from llmgw.up.pki import ensure_pki
from llmgw.up.processes import MirrorProcess, agent_command, kill_leftovers, mirror_command
from llmgw.up.watch import describe, engine_pids


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_certificates_are_made_private_and_signed_by_their_own_authority(tmp_path):
    pki, made = ensure_pki(tmp_path)
    assert len(made) == 3 and pki.dir == tmp_path / "pki"
    for cert in (pki.server, pki.client):
        verify_issued_by(pki.ca, cert)
    assert {"127.0.0.1", "localhost"} <= set(san_names(load_cert(pki.server)))
    assert common_name(load_cert(pki.client)) == "local"
    for key in (pki.dir / "ca-key.pem", pki.server_key, pki.client_key):
        assert _mode(key) == 0o600
    assert _mode(pki.dir) == 0o700


def test_certificates_are_reused_on_a_later_run(tmp_path):
    pki, _ = ensure_pki(tmp_path)
    before = {p: p.read_bytes() for p in pki.dir.iterdir()}
    pki.client_key.chmod(0o644)
    again, made = ensure_pki(tmp_path)
    assert made == [] and again == pki
    assert {p: p.read_bytes() for p in pki.dir.iterdir()} == before
    assert _mode(pki.client_key) == 0o600  # put right on reuse too


def test_certificates_from_another_authority_are_issued_again(tmp_path):
    pki, _ = ensure_pki(tmp_path)
    # The authority is replaced (say, restored from elsewhere): its leaves no longer verify.
    init_ca(pki.dir, force=True)
    ca = pki.ca.read_bytes()
    _, made = ensure_pki(tmp_path)
    assert made == ["control plane certificate", "agent certificate (local)"]
    assert pki.ca.read_bytes() == ca
    verify_issued_by(pki.ca, pki.server)
    verify_issued_by(pki.ca, pki.client)


def test_a_missing_key_is_issued_again(tmp_path):
    pki, _ = ensure_pki(tmp_path)
    pki.server_key.unlink()
    _, made = ensure_pki(tmp_path)
    assert made == ["control plane certificate"]


def test_a_broken_authority_is_replaced_with_everything_it_signed(tmp_path):
    pki, _ = ensure_pki(tmp_path)
    pki.ca.write_text("not a certificate")
    _, made = ensure_pki(tmp_path)
    assert made == ["certificate authority", "control plane certificate", "agent certificate (local)"]


def _choice(tmp_path: Path, noise: bool = False) -> Choice:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + b"\0" * 16)
    return Choice(str(model.resolve()), "my-model", model.name, noise=noise)


def test_server_config_runs_the_model_through_the_control_plane(tmp_path):
    pki, _ = ensure_pki(tmp_path)
    path = write_server_config(
        tmp_path,
        _choice(tmp_path),
        pki,
        port=18080,
        admin_port=19090,
        agent_port=17443,
        host="127.0.0.1",
        ctx_size=2048,
        parallel=3,
    )
    cfg = load_server_config(path)
    assert cfg.control.enabled and str(cfg.agent_listen) == "127.0.0.1:17443"
    assert cfg.agent_tls.ca == str(pki.ca) and cfg.agent_tls.cert == str(pki.server)
    assert cfg.agent_tls.require_node_mark  # ensure_pki never leaves up's node certificate unmarked
    assert cfg.auth.store == str(tmp_path / "llmgw.db") and cfg.metrics_listen is None
    assert cfg.engines.llamacpp == DEFAULT_LLAMACPP and cfg.engines.release_url is None
    assert cfg.mirror is None
    (m,) = cfg.models
    assert m.name == "my-model" and m.source == str((tmp_path / "m.gguf").resolve()) and m.scaling.min == 1
    (p,) = m.profiles
    assert p.engine == "llamacpp" and p.gpu_class is None
    assert p.args == ["--ctx-size", "2048", "--parallel", "3"]


def test_server_config_can_name_a_release_mirror(tmp_path):
    pki, _ = ensure_pki(tmp_path)
    path = write_server_config(
        tmp_path,
        _choice(tmp_path),
        pki,
        port=1,
        admin_port=2,
        agent_port=3,
        host="",
        ctx_size=1,
        parallel=1,
        release_url="http://127.0.0.1:9/",
    )
    assert load_server_config(path).engines.release_url == "http://127.0.0.1:9/"


def test_server_config_names_ups_mirror_and_its_source(tmp_path):
    pki, _ = ensure_pki(tmp_path)
    choice = Choice("http://127.0.0.1:18081/tiny-test/v1/t.gguf", "tiny-test", "t.gguf", noise=True)
    path = write_server_config(
        tmp_path,
        choice,
        pki,
        port=1,
        admin_port=2,
        agent_port=3,
        host="",
        ctx_size=1,
        parallel=1,
        mirror_api="http://127.0.0.1:18082",
        mirror_token_file=tmp_path / "mirror.api-token",
    )
    cfg = load_server_config(path)
    assert cfg.mirror.api == "http://127.0.0.1:18082" and cfg.mirror.tls is None
    assert cfg.mirror.token_file == str(tmp_path / "mirror.api-token")
    (m,) = cfg.models
    assert m.source == "http://127.0.0.1:18081/tiny-test/v1/t.gguf" and "noise" in m.description


def test_mirror_ports_are_kept_while_free(tmp_path):
    import socket

    first = mirror_ports(tmp_path)
    assert first[0] != first[1] and mirror_ports(tmp_path) == first  # the same source URL on the next run
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", first[1]))
        again = mirror_ports(tmp_path)
    assert again != first and again[1] != first[1]
    assert mirror_ports(tmp_path) == again
    (tmp_path / "mirror.json").write_text("not json")
    assert len(set(mirror_ports(tmp_path))) == 2


def test_agent_config_keeps_everything_under_the_data_directory(tmp_path):
    pki, _ = ensure_pki(tmp_path)
    cfg = load_agent_config(write_agent_config(tmp_path, pki, 17443))
    assert cfg.addresses() == ["https://127.0.0.1:17443"] and cfg.node_id == "local"
    assert (cfg.tls.ca, cfg.tls.cert, cfg.tls.key) == (str(pki.ca), str(pki.client), str(pki.client_key))
    for d in (cfg.weights_cache, cfg.engines_dir, cfg.supervisor.work_dir):
        assert Path(d).is_relative_to(tmp_path)
    assert cfg.supervisor.stop_engines_on_exit


def test_the_agent_command_runs_this_python_or_the_frozen_binary(monkeypatch, tmp_path):
    cfg = tmp_path / "agent.yaml"
    assert agent_command(cfg) == [sys.executable, "-m", "llmgw.cli.main", "agent", "--config", str(cfg)]
    monkeypatch.setattr(sys, "frozen", True, raising=False)
    assert agent_command(cfg) == [sys.executable, "agent", "--config", str(cfg)]


def test_the_mirror_command_runs_this_python_or_the_frozen_binary(monkeypatch, tmp_path):
    args = [
        "mirror",
        "--dir",
        str(tmp_path),
        "serve",
        "--listen",
        "127.0.0.1:1",
        "--api-listen",
        "127.0.0.1:2",
        "--base",
        "http://127.0.0.1:1",
        "--api-allow",
        "127.0.0.1",
        "--api-token-file",
        str(tmp_path / "t"),
    ]
    assert mirror_command(tmp_path, "127.0.0.1:1", "127.0.0.1:2", "http://127.0.0.1:1", tmp_path / "t") == [
        sys.executable,
        "-m",
        "llmgw.cli.main",
        *args,
    ]
    monkeypatch.setattr(sys, "frozen", True, raising=False)
    m = MirrorProcess(tmp_path / "mirror", tmp_path / "mirror.log", 18081, 18082)
    assert m.cmd[0] == sys.executable and m.cmd[1] == "mirror" and "llmgw.cli.main" not in m.cmd
    assert (m.base, m.api) == ("http://127.0.0.1:18081", "http://127.0.0.1:18082")


def test_a_given_llama_server_is_offered_as_a_release(tmp_path):
    binary = tmp_path / "llama-server"
    binary.write_bytes(b"#!/bin/sh\n")
    binary.chmod(0o755)
    rel = LocalRelease(binary, "b1")
    asset = "llama-b1-bin-ubuntu-x64.tar.gz"
    archive = rel.body(f"/b1/{asset}")
    assert rel.body(f"/b1/{asset}.sha256").decode() == f"{hashlib.sha256(archive).hexdigest()}  {asset}\n"
    with tarfile.open(fileobj=io.BytesIO(archive)) as tf:
        assert tf.getnames() == ["llama-b1/llama-server"]
    assert rel.body("/b2/" + asset) is None and rel.body(f"/b1/{asset[:-7]}.zip") is None
    assert rel.body("/b1/cudart-llama-b1-bin-ubuntu-cuda-12.8-x64.tar.gz") == rel.extra


def _node(state=None, detail=None, progress=None, connected=True):
    prov = (
        {}
        if state is None
        else {
            "llamacpp": ProvisionStatus(engine="llamacpp", version="b1", state=state, detail=detail, progress=progress)
        }
    )
    return SimpleNamespace(connected=connected, provision=prov)


def test_progress_in_words():
    assert "connect" in describe(None, []).words
    p = describe(_node(ProvisionState.INSTALLING, "building llama-server from source: build 40%"), [])
    assert p.words == "installing llama.cpp: building llama-server from source: build 40%" and p.failure is None
    p = describe(_node(ProvisionState.INSTALLING, "downloading x", ByteProgress(bytes_done=5, bytes_total=10)), [])
    assert p.words == "installing llama.cpp: downloading x (50%)"
    assert "placing" in describe(_node(ProvisionState.READY), []).words
    row = {
        "state": "starting",
        "shards": [{"state": "pending", "pid": None, "fetch": {"percent": 25.0, "bytes_done": 1, "bytes_total": 4}}],
    }
    assert describe(_node(ProvisionState.READY), [row]).words == "fetching the weights 25%"
    row = {"state": "starting", "shards": [{"state": "loading", "pid": 7}]}
    assert "starting llama-server" in describe(_node(ProvisionState.READY), [row]).words
    assert engine_pids([row]) == {7}


def test_failures_in_words():
    p = describe(_node(ProvisionState.FAILED, "no compiler"), [])
    assert p.failure == "installing llama.cpp failed: no compiler"
    row = {"state": "failed", "reason": "llama-server exited with status 1", "shards": []}
    p = describe(_node(ProvisionState.READY), [row])
    assert p.failure == "the engine failed to start: llama-server exited with status 1"
    status = {"backoff": {"failures": 1, "retry_in_s": 5.0, "last_failure": "shard x failed: exited with status 1"}}
    p = describe(_node(ProvisionState.READY), [], status)
    assert p.failure == "the engine failed to start: shard x failed: exited with status 1"
    assert "no node has" in describe(_node(ProvisionState.READY), [], {"problem": "no node has room"}).words
    # A replacement already on its way: not the end.
    assert describe(_node(ProvisionState.READY), [row, {"state": "starting", "shards": []}]).failure is None


def test_kill_leftovers_ignores_gone_processes():
    assert kill_leftovers({2**22 + 12345}) == []


def test_check_llama_server(tmp_path):
    with pytest.raises(UpError, match="not an executable"):
        check_llama_server(str(tmp_path / "nope"))


def test_an_agent_certificate_from_before_node_marks_is_issued_again_marked(tmp_path):
    from llmgw.pki import client_kind
    from llmgw.testing.pki import issue_unmarked

    pki, _ = ensure_pki(tmp_path)
    assert client_kind(load_cert(pki.client)) == "node"
    issue_unmarked(pki.dir, pki.dir, "local")
    _, made = ensure_pki(tmp_path)
    assert made == ["agent certificate (local)"] and client_kind(load_cert(pki.client)) == "node"
