"""ldd output turned into words, from captured and realistic outputs."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.agent.provision.verify import ldd_findings, version_line

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "provision"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def test_the_locally_built_llama_server_needs_nothing_missing():
    # Captured from ~/.cache/llmgw/llama-server-0.3.36/bin/llama-server on Debian 12.
    out = fixture("ldd-llama-server-0.3.36-debian12.txt")
    assert "libgomp.so.1 =>" in out
    assert ldd_findings(out) == []


def test_a_missing_driver_library_is_named_with_its_cause():
    assert ldd_findings(fixture("ldd-cuda-build-without-driver.txt")) == [
        "libcuda.so.1 not found: the NVIDIA driver is not installed"
    ]


def test_a_missing_openmp_runtime_says_which_package():
    [finding] = ldd_findings(fixture("ldd-cloud-image-without-libgomp.txt"))
    assert finding.startswith("libgomp.so.1 not found: install libgomp1")


def test_a_library_too_old_is_said_once_not_as_missing():
    out = fixture("ldd-rhel9-glibcxx-too-old.txt")
    assert out.count("GLIBCXX_3.4.30") == 3
    assert ldd_findings(out) == ["libstdc++.so.6 is too old (needs GLIBCXX_3.4.30)"]


@pytest.mark.parametrize(
    "out, expected",
    [
        # The seeds' shape: no program prefix.
        (
            "\t/lib64/libstdc++.so.6: version `GLIBCXX_3.4.30' not found (required by /x/libllama.so)\n",
            ["libstdc++.so.6 is too old (needs GLIBCXX_3.4.30)"],
        ),
        (
            "./llama-server: /lib/x86_64-linux-gnu/libc.so.6: version `GLIBC_2.34' not found "
            "(required by ./llama-server)\n",
            ["libc.so.6 is too old (needs GLIBC_2.34)"],
        ),
        ("\tlibfoo.so.3 => not found\n\tlibfoo.so.3 => not found\n", ["libfoo.so.3 is not installed"]),
        ("\tnot a dynamic executable\n", []),
        ("", []),
    ],
)
def test_each_shape_of_ldd_complaint_becomes_one_finding_in_words(out, expected):
    assert ldd_findings(out) == expected


def test_the_version_line_is_picked_out_of_an_engines_version_output():
    assert version_line("version: 10991 (abc)\nbuilt with GNU 12.2.0 for Linux x86_64\n") == "version: 10991 (abc)"
    assert version_line("INFO 10-01 noise\n0.30.0\n") == "0.30.0"
    assert version_line("sglang 0.5.20\n") == "sglang 0.5.20"
    assert version_line("") == ""
