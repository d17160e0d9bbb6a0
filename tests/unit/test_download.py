"""The download rules both HTTP clients follow (llmgw.download): ranges, answers, lengths, names."""

from __future__ import annotations

from collections import namedtuple
from pathlib import Path

import pytest

from llmgw import download
from llmgw.download import Answer, ContentRange, Step, parse_content_range, read_answer


@pytest.mark.parametrize(
    ("value", "parsed"),
    [
        ("bytes 0-9/10", ContentRange(0, 9, 10)),
        ("bytes 100-199/1000", ContentRange(100, 199, 1000)),
        ("  bytes 5-9/*  ", ContentRange(5, 9, None)),
        ("Bytes 5-9/10", ContentRange(5, 9, 10)),
        ("bytes */1000", ContentRange(None, None, 1000)),
    ],
)
def test_content_ranges_are_read(value, parsed):
    assert parse_content_range(value) == parsed


@pytest.mark.parametrize(
    "value",
    [
        None,
        "",
        "bytes",
        "bytes 5-/10",
        "bytes -5/10",
        "items 0-9/10",
        "bytes 9-5/10",
        "bytes 0-10/10",
        "bytes */*",
        "bytes 0-9/10, 20-29/30",
    ],
)
def test_what_is_not_a_content_range_is_none(value):
    assert parse_content_range(value) is None


def test_lengths():
    assert download.parse_length("1234") == 1234
    assert download.parse_length(" 7 ") == 7
    for bad in (None, "", "-1", "12a", "1e3"):
        assert download.parse_length(bad) is None


def test_a_request_asks_for_stored_bytes_and_resumes_with_a_range():
    assert download.request_headers(0) == {"Accept-Encoding": "identity"}
    assert download.request_headers(500) == {"Accept-Encoding": "identity", "Range": "bytes=500-"}


def test_part_names():
    assert download.part_path(Path("/d/model.gguf")) == Path("/d/model.gguf.part")
    assert download.part_path(Path("/d/model.gguf"), hidden=True) == Path("/d/.model.gguf.part")


def test_a_partial_longer_than_the_file_is_no_prefix_of_it(tmp_path):
    part = tmp_path / "x.part"
    assert download.resume_from(part, 10) == 0  # nothing there
    part.write_bytes(b"12345")
    assert download.resume_from(part, None) == 5
    assert download.resume_from(part, 5) == 5
    assert download.resume_from(part, 4) == 0
    assert not part.exists()


# ---------------------------------------------------------------- answers


def test_a_200_is_the_whole_file_from_the_start():
    assert read_answer(200, 0, None, "10") == Answer(Step.WRITE, total=10)
    # A server that ignored the Range: the partial is not kept.
    assert read_answer(200, 4, None, "10") == Answer(Step.WRITE, total=10, have=0)
    assert read_answer(200, 0, None, None, expected=7) == Answer(Step.WRITE, total=7)
    assert read_answer(200, 0, None, None) == Answer(Step.WRITE, total=None)


def test_a_206_from_where_the_partial_ends_is_appended():
    assert read_answer(206, 4, "bytes 4-9/10", "6") == Answer(Step.APPEND, total=10, have=4)
    assert read_answer(206, 4, "bytes 4-9/*", None, expected=10) == Answer(Step.APPEND, total=10, have=4)


@pytest.mark.parametrize("content_range", ["bytes 0-9/10", "bytes 5-9/10"])
def test_a_206_from_elsewhere_starts_again(content_range):
    answer = read_answer(206, 4, content_range, None)
    assert answer.step is Step.RESTART and "not 4" in answer.why


@pytest.mark.parametrize("content_range", [None, "garbage", "bytes */10"])
def test_a_206_without_a_readable_range_starts_again(content_range):
    answer = read_answer(206, 4, content_range, None)
    assert answer.step is Step.RESTART and "unreadable Content-Range" in answer.why


def test_a_416_to_a_whole_partial_means_it_is_done():
    assert read_answer(416, 10, "bytes */10", "0") == Answer(Step.WHOLE, total=10, have=10)
    assert read_answer(416, 10, "bytes */10", None, expected=10).step is Step.WHOLE


@pytest.mark.parametrize(
    ("content_range", "expected"),
    [
        ("bytes */12", None),  # the file is longer: what we hold is not it
        (None, None),
        ("bytes */10", 12),  # whole for the server, short for the caller's list
    ],
)
def test_any_other_416_to_a_resume_starts_again(content_range, expected):
    answer = read_answer(416, 10, content_range, None, expected)
    assert answer.step is Step.RESTART and "refused to resume at byte 10" in answer.why


@pytest.mark.parametrize("status", [416, 404, 500, 204, 302])
def test_other_statuses_are_the_callers(status):
    assert read_answer(status, 0, None, None).step is Step.OTHER


def test_a_length_other_than_the_one_promised_is_wrong():
    assert read_answer(200, 0, None, "900", expected=1000) == Answer(Step.WRONG_LENGTH, total=900)
    assert read_answer(206, 4, "bytes 4-8/9", None, expected=10) == Answer(Step.WRONG_LENGTH, total=9, have=4)


# ---------------------------------------------------------------- lengths


def test_space_is_checked_against_what_is_needed(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(download.shutil, "disk_usage", lambda _path: usage(100, 50, 50))
    assert download.lacking_space(tmp_path, 50) is None
    assert download.lacking_space(tmp_path, 51) == 50


def test_a_chunk_past_the_promised_length_overruns():
    assert not download.overruns(0, 10, 10)
    assert download.overruns(5, 6, 10)
    assert not download.overruns(5, 10**9, None)
