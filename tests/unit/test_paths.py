"""The one check of names from outside (llmgw.paths): plain names, relative paths, inside a directory."""

from __future__ import annotations

import pytest

from llmgw.paths import PathRefused, inside, relative_path, resolve_inside, segment_problem


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("", "is not a name"),
        (".", "is not a name"),
        ("..", "is not a name"),
        ("a/b", "path separator"),
        ("a\\b", "path separator"),
        ("/etc", "path separator"),
        ("a\0b", "control characters"),
        ("a\nb", "control characters"),
        ("x" * 256, "too long"),
        ("é" * 128, "too long"),  # 256 bytes in UTF-8
        ("\ud800", "not valid text"),
    ],
)
def test_what_is_not_one_plain_name_says_why(name, words):
    why = segment_problem(name)
    assert why is not None and words in why


def test_plain_names_pass():
    for name in ("model.gguf", ".hidden", "x" * 255, "é" * 127, "a b", "Qwen2.5-0.5B"):
        assert segment_problem(name) is None


def test_room_for_a_suffix_counts_against_the_limit():
    assert segment_problem("x" * 250, room=5) is None
    assert "too long" in (segment_problem("x" * 251, room=5) or "")


@pytest.mark.parametrize(
    ("raw", "clean"),
    [
        ("a/b/c", "a/b/c"),
        ("./a//b/./c", "a/b/c"),
        ("./", ""),
        ("", ""),
        ("a/b/", "a/b"),
        ("..a/b..", "..a/b.."),  # dots inside a name are not a step up
    ],
)
def test_relative_paths_are_cleaned(raw, clean):
    assert relative_path(raw) == clean


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        ("/etc/passwd", "is an absolute path"),
        ("a/../../x", "climbs out"),
        ("..", "climbs out"),
        ("a\\..\\x", "backslash"),
        ("a\0b", "NUL"),
    ],
)
def test_paths_that_could_lead_elsewhere_are_refused(raw, words):
    with pytest.raises(PathRefused, match=words):
        relative_path(raw)


def test_the_refusal_names_the_directory():
    with pytest.raises(PathRefused, match="climbs out of the install directory"):
        relative_path("../x", within="the install directory")


def test_inside_follows_links(tmp_path):
    root = tmp_path / "root"
    (root / "a").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (root / "escape").symlink_to(tmp_path / "outside")
    (root / "loop").symlink_to(root / "a")
    assert inside(root, root)
    assert inside(root, root / "a" / "not-yet")
    assert inside(root, root / "loop")
    assert not inside(root, root / "escape")
    assert not inside(root, root / ".." / "outside")
    assert not inside(root / "a", root)
    # A sibling sharing the root's name as a prefix is not inside it.
    (tmp_path / "root2").mkdir()
    assert not inside(root, tmp_path / "root2")


def test_resolve_inside_follows_links_and_refuses_escapes(tmp_path):
    root = tmp_path / "root"
    (root / "m" / "v").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (root / "m" / "escape").symlink_to(tmp_path / "outside")
    assert resolve_inside(root, "m", "v") == (root / "m" / "v").resolve()
    assert resolve_inside(root, "m", "escape") is None
    assert resolve_inside(root, "..", "outside") is None
