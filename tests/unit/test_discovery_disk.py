"""Disk space per filesystem holding the model directories."""

from __future__ import annotations

import os
from pathlib import Path

from llmgw.agent.discovery.disk import collect_storage, is_shared_fstype, mount_for, parse_mounts

FIX = Path(__file__).parent.parent / "fixtures" / "discovery"


def test_mounts_are_parsed_with_their_escapes():
    mounts = parse_mounts((FIX / "proc_mounts").read_text())
    by_point = {m.mount_point: m.fstype for m in mounts}
    assert by_point["/mnt/lustre"] == "lustre"
    assert by_point["/srv/model store"] == "ext4"  # \040 is a space
    assert by_point["/mnt/ceph"] == "fuse.ceph-fuse"


def test_a_path_is_on_its_longest_mount_and_the_top_one_of_a_stack():
    mounts = parse_mounts((FIX / "proc_mounts").read_text())
    assert mount_for("/mnt/lustre/models/qwen", mounts).fstype == "lustre"
    assert mount_for("/var/lib/llmgw-weights", mounts).fstype == "xfs"
    assert mount_for("/var/lib/other", mounts).mount_point == "/"
    # autofs is listed first and the NFS it mounted on top of it after.
    assert mount_for("/mnt/models/llama", mounts).fstype == "nfs4"
    assert mount_for("/mnt/lustrex", mounts).mount_point == "/"  # a prefix of a name is not a parent


def test_network_filesystems_are_shared_and_local_ones_are_not():
    for t in ("nfs", "nfs4", "cifs", "lustre", "gpfs", "beegfs", "ceph", "fuse.ceph-fuse", "fuse.glusterfs", "wekafs"):
        assert is_shared_fstype(t), t
    for t in ("ext4", "xfs", "btrfs", "zfs", "tmpfs", "overlay", "fuse.gvfsd-fuse", "9p", "virtiofs"):
        assert not is_shared_fstype(t), t


def test_space_is_reported_per_filesystem_and_missing_dirs_are_skipped(tmp_path):
    a = tmp_path / "models"
    b = tmp_path / "weights"
    a.mkdir()
    b.mkdir()
    mounts = tmp_path / "mounts"
    mounts.write_text(f"/dev/root / ext4 rw 0 0\nfiler:/m {tmp_path} nfs4 rw 0 0\n")
    storage = collect_storage([a, b, tmp_path / "not-mounted-yet"], mounts_file=mounts)
    # Two directories on one filesystem are one pool of bytes.
    assert len(storage) == 1
    s = storage[0]
    assert s.mount_point == str(tmp_path) and s.fstype == "nfs4" and s.shared is True
    assert s.dirs == [os.path.realpath(a), os.path.realpath(b)]
    vfs = os.statvfs(a)
    assert s.total_bytes == vfs.f_blocks * vfs.f_frsize
    assert 0 < s.free_bytes <= s.total_bytes


def test_nothing_exists_yet_is_an_empty_list_not_a_full_disk(tmp_path):
    assert collect_storage([tmp_path / "a", tmp_path / "b"], mounts_file=tmp_path / "none") == []


def test_without_proc_mounts_the_type_is_unknown_not_local(tmp_path):
    (tmp_path / "m").mkdir()
    [s] = collect_storage([tmp_path / "m"], mounts_file=tmp_path / "none")
    assert s.fstype is None and s.shared is None and s.total_bytes > 0
