"""Names in the mirror's layout: one directory level each, nothing hidden, nothing outside."""

from __future__ import annotations

import pytest

from llmgw.mirror.layout import MirrorError, check_segment, resolve_inside


@pytest.mark.parametrize("bad", ["", ".", "..", "a/b", "a\\b", "a\0b", ".hidden", "x" * 201])
def test_bad_segments_are_refused_naming_what(bad):
    with pytest.raises(MirrorError, match="--model"):
        check_segment(bad, "--model")


def test_plain_names_pass():
    assert check_segment("qwen2.5-0.5b", "--model") == "qwen2.5-0.5b"
    assert check_segment("x" * 200, "file name") == "x" * 200


def test_resolve_inside_follows_links_and_refuses_escapes(tmp_path):
    root = tmp_path / "root"
    (root / "m" / "v").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (root / "m" / "escape").symlink_to(tmp_path / "outside")
    assert resolve_inside(root, "m", "v") == (root / "m" / "v").resolve()
    assert resolve_inside(root, "m", "escape") is None
    assert resolve_inside(root, "..", "outside") is None
