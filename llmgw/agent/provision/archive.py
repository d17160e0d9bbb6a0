"""Unpacking release archives (zip, tar.gz) without letting them write outside.

A release archive is somebody else's file unpacked by an agent running as
root: an entry named ``../../etc/cron.d/x``, an absolute path, a link to
``/etc`` followed by a file "inside" it, or a device node would all be
written where nobody meant. So every entry is checked before anything is
written, files are never written through a link, links are created last,
and each link is resolved once more on disk at the end (a chain of links
that each look harmless can still point out together).
"""

from __future__ import annotations

import functools
import os
import posixpath
import shutil
import stat
import tarfile
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from llmgw.paths import PathRefused, inside, relative_path

from .status import ProvisionError

# Release archives are tens to hundreds of MB unpacked (the CUDA runtime is
# the largest); far beyond that is a decompression bomb, not a release.
DEFAULT_MAX_UNPACKED = 16 << 30
_MAX_LINK_TARGET = 4096


class ArchiveError(ProvisionError):
    """The archive is refused; nothing from it should be kept."""


@dataclass
class _Entry:
    name: str  # cleaned, relative, posix
    kind: str  # "file", "dir", "symlink", "hardlink"
    mode: int
    size: int = 0
    link: str = ""  # symlink target as written, or the hard link's cleaned source
    open: Callable[[], IO[bytes] | None] | None = None


def detect_format(path: Path) -> str:
    """``zip`` or ``tar``, from the file's contents rather than its name."""
    with open(path, "rb") as f:
        head = f.read(6)
    if head.startswith((b"PK\x03\x04", b"PK\x05\x06")):
        return "zip"
    # gzip, bzip2, xz; tarfile itself recognises an uncompressed tar.
    if head.startswith((b"\x1f\x8b", b"BZh", b"\xfd7zXZ")) or tarfile.is_tarfile(path):
        return "tar"
    raise ArchiveError(f"{path.name} is neither a zip nor a tar archive")


def unpack(
    archive: Path, dest: Path, *, max_unpacked: int = DEFAULT_MAX_UNPACKED, label: str | None = None
) -> list[str]:
    """Unpack ``archive`` into the directory ``dest``; returns the entry names.

    Raises :class:`ArchiveError` naming the first entry refused and why.
    Entries are all checked before the first is written, so a refused archive
    normally writes nothing; ``dest`` should still be a scratch directory the
    caller throws away on any error (the final link check runs after writing).
    """
    label = label or archive.name
    dest.mkdir(parents=True, exist_ok=True)
    fmt = detect_format(archive)
    try:
        if fmt == "zip":
            with zipfile.ZipFile(archive) as zf:
                entries = list(_zip_entries(zf, label))
                _check_all(entries, label, max_unpacked)
                _write_all(entries, dest, label)
        else:
            with tarfile.open(archive, "r:*") as tf:
                entries = list(_tar_entries(tf, label))
                _check_all(entries, label, max_unpacked)
                _write_all(entries, dest, label)
    except ArchiveError:
        raise
    except OSError as e:
        if e.errno is not None:  # the disk, not the archive: full, read-only
            raise ProvisionError(f"unpacking {label} into {dest} failed: {e}") from None
        raise ArchiveError(f"{label} is damaged and cannot be unpacked: {e}") from None
    except (tarfile.TarError, zipfile.BadZipFile, zlib.error, EOFError) as e:
        # A truncated or corrupt archive (its checksum matched, so it was
        # published that way, or the checksum was given wrong).
        raise ArchiveError(f"{label} is damaged and cannot be unpacked: {e}") from None
    return [e.name for e in entries]


# ------------------------------------------------------------------ reading


def _refuse(label: str, name: str, why: str) -> ArchiveError:
    return ArchiveError(f"{label} is refused: entry {name!r} {why}")


def clean_name(label: str, raw: str) -> str:
    """The entry's path relative to the archive root, or a refusal."""
    try:
        return relative_path(raw, within="the install directory")
    except PathRefused as e:
        raise _refuse(label, raw, str(e)) from None


def _tar_entries(tf: tarfile.TarFile, label: str) -> Iterator[_Entry]:
    for m in tf:
        name = clean_name(label, m.name)
        if not name:
            continue  # "./": the root itself
        if m.isreg():
            yield _Entry(name, "file", m.mode, m.size, open=functools.partial(tf.extractfile, m))
        elif m.isdir():
            yield _Entry(name, "dir", m.mode)
        elif m.issym():
            yield _Entry(name, "symlink", 0o777, link=m.linkname)
        elif m.islnk():
            try:
                source = clean_name(label, m.linkname)
            except ArchiveError:
                raise _refuse(
                    label, m.name, f"is a hard link to {m.linkname!r}, outside the install directory"
                ) from None
            yield _Entry(name, "hardlink", m.mode, link=source)
        elif m.ischr() or m.isblk():
            raise _refuse(label, m.name, "is a device file")
        elif m.isfifo():
            raise _refuse(label, m.name, "is a FIFO")
        else:
            raise _refuse(label, m.name, "is not a file, directory or link")


def _zip_entries(zf: zipfile.ZipFile, label: str) -> Iterator[_Entry]:
    for info in zf.infolist():
        name = clean_name(label, info.filename)
        if not name:
            continue
        mode = info.external_attr >> 16
        fmt = stat.S_IFMT(mode)
        if info.is_dir() or fmt == stat.S_IFDIR:
            yield _Entry(name, "dir", mode & 0o7777)
        elif fmt == stat.S_IFLNK:
            # zip keeps a link's target as the entry's contents.
            if info.file_size > _MAX_LINK_TARGET:
                raise _refuse(label, info.filename, "is a link with an implausibly long target")
            target = zf.read(info).decode("utf-8", errors="replace")
            yield _Entry(name, "symlink", 0o777, link=target)
        elif fmt in (stat.S_IFCHR, stat.S_IFBLK):
            raise _refuse(label, info.filename, "is a device file")
        elif fmt == stat.S_IFIFO:
            raise _refuse(label, info.filename, "is a FIFO")
        elif fmt == stat.S_IFSOCK:
            raise _refuse(label, info.filename, "is a socket")
        else:
            # fmt 0: made on a system that records no Unix mode; a plain file.
            yield _Entry(name, "file", (mode & 0o7777) or 0o644, info.file_size, open=functools.partial(zf.open, info))


# ------------------------------------------------------------------ checking


def _check_all(entries: list[_Entry], label: str, max_unpacked: int) -> None:
    kinds: dict[str, str] = {}
    links = set()
    total = 0
    for e in entries:
        # Nothing may be written beneath a link: the link could point
        # anywhere by the time the file is written.
        parent = posixpath.dirname(e.name)
        while parent:
            if parent in links:
                raise _refuse(label, e.name, f"lies beneath the link {parent!r}")
            if kinds.get(parent, "dir") != "dir":
                raise _refuse(label, e.name, f"lies beneath {parent!r}, which is not a directory")
            parent = posixpath.dirname(parent)
        previous = kinds.get(e.name)
        if previous is not None and not (previous == "dir" and e.kind == "dir"):
            if "dir" in (previous, e.kind):
                raise _refuse(label, e.name, f"is both a directory and a {e.kind if previous == 'dir' else previous}")
            raise _refuse(label, e.name, "appears twice")
        kinds[e.name] = e.kind
        # Directories implied by a path count as directories.
        parent = posixpath.dirname(e.name)
        while parent and parent not in kinds:
            kinds[parent] = "dir"
            parent = posixpath.dirname(parent)
        if e.kind == "symlink":
            _check_link_target(label, e)
            links.add(e.name)
        elif e.kind == "hardlink" and kinds.get(e.link) != "file":
            raise _refuse(label, e.name, f"is a hard link to {e.link!r}, which is not a file earlier in the archive")
        total += e.size
        if total > max_unpacked:
            raise ArchiveError(f"{label} is refused: it unpacks to more than {max_unpacked / (1 << 30):.0f} GB")


def _check_link_target(label: str, e: _Entry) -> None:
    if not e.link:
        raise _refuse(label, e.name, "is a link with an empty target")
    if "\x00" in e.link:
        raise _refuse(label, e.name, "is a link whose target has a NUL byte")
    if e.link.startswith("/"):
        raise _refuse(label, e.name, f"is a link to the absolute path {e.link!r}")
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(e.name), e.link))
    if resolved == ".." or resolved.startswith("../"):
        raise _refuse(label, e.name, f"is a link to {e.link!r}, outside the install directory")


# ------------------------------------------------------------------ writing


def _write_all(entries: list[_Entry], dest: Path, label: str) -> None:
    for e in entries:
        target = dest / e.name
        # The parent, resolved on disk, must still be inside: a link left by
        # an earlier archive unpacked into the same tree counts too.
        if not inside(dest, target.parent):
            raise _refuse(label, e.name, "would be written outside the install directory")
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            if e.kind == "dir":
                target.mkdir(exist_ok=True)
                os.chmod(target, 0o755)
            elif e.kind == "file":
                assert e.open is not None
                _write_file(e.open(), target, e.mode)
            elif e.kind == "hardlink":
                # A copy rather than a link: nothing shared with anything else.
                with open(dest / e.link, "rb") as src:
                    _write_file(src, target, e.mode)
        except FileExistsError:
            raise _refuse(label, e.name, "would overwrite something already unpacked") from None
    for e in entries:
        if e.kind == "symlink":
            target = dest / e.name
            try:
                os.symlink(e.link, target)
            except FileExistsError:
                raise _refuse(label, e.name, "is a link where a file already exists") from None
    # Resolved on disk, every link must end inside: catches chains such as
    # a -> "b/.." with b -> ".", which look harmless one at a time.
    for e in entries:
        if e.kind == "symlink" and not inside(dest, dest / e.name):
            raise _refuse(label, e.name, f"is a link to {e.link!r}, which leads outside the install directory")


def _write_file(src: IO[bytes] | None, target: Path, mode: int) -> None:
    if src is None:
        raise ArchiveError(f"cannot read {target.name} from the archive")
    # Keep execute bits, drop setuid/setgid/sticky and write for others.
    perm = (mode & 0o755) | 0o600
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(target, flags, perm)
    with src, os.fdopen(fd, "wb") as out:
        shutil.copyfileobj(src, out, 1 << 20)
    os.chmod(target, perm)


def pack_llama_server(binary: Path, tag: str) -> bytes:
    """A llama-server built here as a release archive (.tar.gz) of tag ``tag``: what an agent installs
    like any release. The shared libraries beside it travel with it (a release's do)."""
    import io

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        tf.add(binary, arcname=f"llama-{tag}/llama-server")
        for lib in sorted(binary.parent.glob("lib*.so*")):
            tf.add(lib, arcname=f"llama-{tag}/{lib.name}")
    return buf.getvalue()


def find_llama_server_in(archive: Path, scratch: Path) -> str:
    """The path of the llama-server inside a release archive (unpacked into ``scratch`` with the
    agent's checks); ArchiveError or ProvisionError when it is not one."""
    names = unpack(archive, scratch)
    for name in names:
        p = scratch / name
        if posixpath.basename(name) == "llama-server" and p.is_file() and os.access(p, os.X_OK):
            return name
    raise ProvisionError(f"{archive.name} holds no executable llama-server, so it is not a llama.cpp release archive")
