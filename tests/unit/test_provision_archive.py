"""Unpacking release archives: what is kept, and what is refused before writing."""

from __future__ import annotations

import io
import os
import stat
import tarfile
import zipfile
from pathlib import Path

import pytest

from llmgw.agent.provision.archive import ArchiveError, clean_name, detect_format, unpack


def write_tar(path: Path, entries: list[tarfile.TarInfo | tuple[str, bytes, int]]) -> Path:
    with tarfile.open(path, "w:gz") as tf:
        for e in entries:
            if isinstance(e, tarfile.TarInfo):
                tf.addfile(e)
            else:
                name, data, mode = e
                ti = tarfile.TarInfo(name)
                ti.size, ti.mode = len(data), mode
                tf.addfile(ti, io.BytesIO(data))
    return path


def link(name: str, target: str, kind=tarfile.SYMTYPE) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type, ti.linkname = kind, target
    return ti


def test_a_release_tree_is_unpacked_with_links_and_modes(tmp_path):
    arc = write_tar(
        tmp_path / "a.tar.gz",
        [
            ("./rel/bin/llama-server", b"#!/bin/sh\n", 0o4755),  # setuid bit dropped
            ("rel/lib/libggml.so.0.1", b"so", 0o644),
            link("rel/lib/libggml.so.0", "libggml.so.0.1"),
            link("rel/lib/libggml.so", "libggml.so.0"),
            link("rel/bin/lib", "../lib"),
            link("rel/lib/copy", "rel/lib/libggml.so.0.1", tarfile.LNKTYPE),
        ],
    )
    dest = tmp_path / "out"
    names = unpack(arc, dest)
    assert "rel/bin/llama-server" in names
    mode = (dest / "rel/bin/llama-server").stat().st_mode
    assert mode & 0o777 == 0o755 and not mode & stat.S_ISUID
    assert (dest / "rel/lib/libggml.so").resolve() == (dest / "rel/lib/libggml.so.0.1").resolve()
    assert (dest / "rel/bin/lib/libggml.so.0.1").read_bytes() == b"so"
    # A hard link inside becomes a copy: nothing shared outside the tree.
    copy = dest / "rel/lib/copy"
    assert copy.read_bytes() == b"so" and not copy.is_symlink()
    assert copy.stat().st_ino != (dest / "rel/lib/libggml.so.0.1").stat().st_ino


def test_a_zip_keeps_links_and_execute_bits(tmp_path):
    path = tmp_path / "a.zip"
    with zipfile.ZipFile(path, "w") as zf:
        zi = zipfile.ZipInfo("bin/llama-server")
        zi.external_attr = 0o100755 << 16
        zf.writestr(zi, "#!/bin/sh\n")
        zi = zipfile.ZipInfo("bin/readme.txt")  # no Unix mode: made elsewhere
        zf.writestr(zi, "hello")
        zi = zipfile.ZipInfo("bin/server")
        zi.external_attr = 0o120777 << 16
        zf.writestr(zi, "llama-server")
    unpack(path, tmp_path / "out")
    assert os.access(tmp_path / "out/bin/llama-server", os.X_OK)
    assert (tmp_path / "out/bin/readme.txt").read_text() == "hello"
    assert os.readlink(tmp_path / "out/bin/server") == "llama-server"


def test_nothing_is_written_when_a_later_entry_is_refused(tmp_path):
    arc = write_tar(tmp_path / "a.tar.gz", [("ok/file", b"x", 0o644), ("../evil", b"x", 0o644)])
    dest = tmp_path / "out"
    with pytest.raises(ArchiveError, match="'../evil' climbs out"):
        unpack(arc, dest)
    assert list(dest.iterdir()) == []
    assert not (tmp_path / "evil").exists()


@pytest.mark.parametrize(
    "name, words",
    [
        ("/etc/cron.d/x", "is an absolute path"),
        ("a/../../x", "climbs out"),
        ("..", "climbs out"),
        ("a\\..\\..\\x", "backslash"),
    ],
)
def test_bad_names_are_refused(name, words):
    with pytest.raises(ArchiveError, match=words):
        clean_name("r.tar.gz", name)


def test_archive_member_names_are_normalised():
    assert clean_name("r", "./a//b/./c") == "a/b/c"
    assert clean_name("r", "./") == ""


@pytest.mark.parametrize(
    "mode, words",
    [
        (0o020644, "is a device file"),
        (0o060644, "is a device file"),
        (0o010644, "is a FIFO"),
        (0o140644, "is a socket"),
    ],
)
def test_special_files_in_a_zip_are_refused(tmp_path, mode, words):
    path = tmp_path / "a.zip"
    with zipfile.ZipFile(path, "w") as zf:
        zi = zipfile.ZipInfo("dev/thing")
        zi.external_attr = mode << 16
        zf.writestr(zi, "")
    with pytest.raises(ArchiveError, match=words):
        unpack(path, tmp_path / "out")
    assert not (tmp_path / "out" / "dev").exists()


def test_a_hard_link_to_something_not_in_the_archive_is_refused(tmp_path):
    arc = write_tar(tmp_path / "a.tar.gz", [link("x", "etc/passwd", tarfile.LNKTYPE)])
    with pytest.raises(ArchiveError, match="not a file earlier in the archive"):
        unpack(arc, tmp_path / "out")


def test_the_same_file_twice_is_refused(tmp_path):
    arc = write_tar(tmp_path / "a.tar.gz", [("a", b"1", 0o644), ("a", b"2", 0o644)])
    with pytest.raises(ArchiveError, match="appears twice"):
        unpack(arc, tmp_path / "out")


def test_a_decompression_bomb_is_refused(tmp_path):
    arc = write_tar(tmp_path / "a.tar.gz", [("big", b"\0" * 4096, 0o644)])
    with pytest.raises(ArchiveError, match="unpacks to more than"):
        unpack(arc, tmp_path / "out", max_unpacked=1024)


def test_a_second_archive_cannot_write_through_a_link_left_by_the_first(tmp_path):
    dest = tmp_path / "out"
    unpack(write_tar(tmp_path / "a.tar.gz", [link("lib", ".")]), dest)
    (dest / "inner").mkdir()
    # Writing to "lib/x" lands inside (lib -> .); refused only if it left.
    unpack(write_tar(tmp_path / "b.tar.gz", [("lib/x", b"x", 0o644)]), dest)
    assert (dest / "x").read_bytes() == b"x"
    # A file already unpacked is not overwritten by the next archive.
    with pytest.raises(ArchiveError, match="would overwrite"):
        unpack(write_tar(tmp_path / "c.tar.gz", [("x", b"y", 0o644)]), dest)


def test_not_an_archive(tmp_path):
    p = tmp_path / "page.tar.gz"
    p.write_text("<html>rate limited</html>")
    with pytest.raises(ArchiveError, match="neither a zip nor a tar"):
        detect_format(p)
    p.write_bytes(b"\x1f\x8b\x08\x00garbage")
    with pytest.raises(ArchiveError):
        unpack(p, tmp_path / "out")
