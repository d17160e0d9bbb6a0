"""Names in the mirror's layout: one directory level each, nothing hidden (inside: test_paths)."""

from __future__ import annotations

import pytest

from llmgw.mirror.layout import MirrorError, check_segment


@pytest.mark.parametrize("bad", ["", ".", "..", "a/b", "a\\b", "a\0b", ".hidden", "x" * 201])
def test_bad_segments_are_refused_naming_what(bad):
    with pytest.raises(MirrorError, match="--model"):
        check_segment(bad, "--model")


def test_plain_names_pass():
    assert check_segment("qwen2.5-0.5b", "--model") == "qwen2.5-0.5b"
    assert check_segment("x" * 200, "file name") == "x" * 200
