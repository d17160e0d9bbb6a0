"""The one atomic write and the one durable rename (llmgw.files)."""

from __future__ import annotations

import os
import stat

import pytest

from llmgw import files


def test_write_atomic_replaces_the_whole_file_with_its_mode(tmp_path):
    target = tmp_path / "sub" / "f.json"
    files.write_atomic(target, b"old")
    files.write_atomic(target, b"new", 0o600)
    assert target.read_bytes() == b"new"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert os.listdir(target.parent) == ["f.json"]  # no temporary file left beside it


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "f"
    target.write_bytes(b"old")

    def broken(_tmp, _target):
        raise OSError("disk gone")

    monkeypatch.setattr(files, "replace_durably", broken)
    with pytest.raises(OSError, match="disk gone"):
        files.write_atomic(target, b"new")
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["f"]


def test_replace_durably_syncs_before_and_after_the_rename(tmp_path, monkeypatch):
    part, target = tmp_path / "f.part", tmp_path / "f"
    part.write_bytes(b"whole")
    target.write_bytes(b"old")
    order: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(files.os, "fsync", lambda fd: (order.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(files.os, "replace", lambda a, b: (order.append("replace"), real_replace(a, b))[1])
    files.replace_durably(part, target)
    assert target.read_bytes() == b"whole" and not part.exists()
    assert order == ["fsync", "replace", "fsync"]  # the file, the rename, the directory
