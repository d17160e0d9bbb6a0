"""Free and total space per filesystem holding the model directories.

Reported per filesystem, not per directory: two directories on one disk are
one pool of bytes, and adding them up would let a 40 GB model be placed on a
node with 24 GB free. Network and cluster filesystems are marked shared: their
space is everyone's, and twenty nodes each reporting the same free terabyte
would have the scheduler place twenty models into room for one.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from llmgw.protocol import Storage

# Filesystem types (as /proc/mounts names them) whose contents and space are
# shared with other machines. Kept to the certain ones: a filer read as local
# costs a needless copy, but a local disk read as shared makes the cluster
# believe a model is everywhere when it is on one node. (9p and virtiofs are a
# VM host's directory, not a network's.)
SHARED_FSTYPES: frozenset[str] = frozenset(
    {
        "nfs",
        "nfs4",
        "cifs",
        "smb3",
        "smbfs",
        "lustre",
        "gpfs",
        "beegfs",
        "ceph",
        "cephfs",
        "glusterfs",
        "panfs",
        "wekafs",
        "orangefs",
        "pvfs2",
        "afs",
        "ocfs2",
        "gfs2",
    }
)
# FUSE filesystems carry their driver's name after "fuse."; these are network ones.
SHARED_FUSE: frozenset[str] = frozenset(
    {
        "ceph-fuse",
        "cephfs",
        "glusterfs",
        "sshfs",
        "juicefs",
        "s3fs",
        "gcsfuse",
        "mountpoint-s3",
        "rclone",
        "lizardfs",
        "moosefs",
        "mfs",
    }
)


def is_shared_fstype(fstype: str) -> bool:
    t = fstype.lower()
    if t in SHARED_FSTYPES:
        return True
    if t.startswith("fuse."):
        return t.removeprefix("fuse.") in SHARED_FUSE
    return False


@dataclass(frozen=True, slots=True)
class Mount:
    source: str
    mount_point: str
    fstype: str


def _unescape(field: str) -> str:
    # /proc/mounts writes space, tab, newline and backslash as octal escapes.
    return field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def parse_mounts(text: str) -> list[Mount]:
    out = []
    for line in text.splitlines():
        f = line.split()
        if len(f) >= 3:
            out.append(Mount(_unescape(f[0]), _unescape(f[1]), f[2]))
    return out


def mount_for(path: str, mounts: Iterable[Mount]) -> Mount | None:
    """The mount a path is on: the longest mount point containing it; of equal
    ones the last listed, which is the one on top (autofs, then its NFS)."""
    best: Mount | None = None
    for m in mounts:
        mp = m.mount_point.rstrip("/") or "/"
        inside = mp == "/" or path == mp or path.startswith(mp + "/")
        if inside and (best is None or len(mp) >= len(best.mount_point.rstrip("/") or "/")):
            best = m
    return best


def collect_storage(
    dirs: Iterable[str | os.PathLike[str]],
    *,
    mounts_file: Path = Path("/proc/mounts"),
    warnings: list[str] | None = None,
) -> list[Storage]:
    """One entry per filesystem holding any of ``dirs``, in the order the
    directories were given. A directory that does not exist is skipped, not
    reported as full: it is what an unmounted filer looks like."""
    try:
        mounts = parse_mounts(mounts_file.read_text())
    except OSError:
        mounts = []
    by_dev: dict[int, Storage] = {}
    for d in dirs:
        path = os.path.realpath(os.fspath(d))
        try:
            st = os.stat(path)
            vfs = os.statvfs(path)
        except FileNotFoundError:
            continue
        except OSError as exc:
            if warnings is not None:
                warnings.append(f"could not read the space on {d}: {exc.strerror or exc}")
            continue
        if st.st_dev in by_dev:
            entry = by_dev[st.st_dev]
            if path not in (entry.dirs or []):
                entry.dirs = [*(entry.dirs or []), path]
            continue
        m = mount_for(path, mounts)
        fstype = m.fstype if m else None
        by_dev[st.st_dev] = Storage(
            mount_point=m.mount_point if m else path,
            fstype=fstype,
            shared=is_shared_fstype(fstype) if fstype else None,
            total_bytes=vfs.f_blocks * vfs.f_frsize,
            free_bytes=vfs.f_bavail * vfs.f_frsize,
            dirs=[path],
        )
    return list(by_dev.values())
