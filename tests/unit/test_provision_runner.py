"""The real command runner: what a failure to start, a timeout and input look like."""

from __future__ import annotations

import time

from llmgw.agent.provision.runner import NOT_FOUND, TIMED_OUT, last_lines, run_command


async def test_output_and_exit_status_together():
    r = await run_command(["sh", "-c", "echo out; echo err >&2; exit 3"])
    assert r.returncode == 3 and not r.ok
    assert "out" in r.output and "err" in r.output


async def test_a_missing_program_is_exit_127_with_words():
    r = await run_command(["/nonexistent/llama-server", "--version"])
    assert r.returncode == NOT_FOUND and "not found" in r.output


async def test_a_file_that_is_not_a_program(tmp_path):
    p = tmp_path / "llama-server"
    p.write_bytes(b"\x7fELF garbage")
    p.chmod(0o755)
    r = await run_command([str(p), "--version"])
    assert r.returncode == NOT_FOUND and "cannot be run" in r.output


async def test_a_timeout_kills_the_command_and_what_it_started():
    t = time.monotonic()
    r = await run_command(["sh", "-c", "sleep 30 & sleep 30"], timeout=0.3)
    assert r.returncode == TIMED_OUT and "did not finish within" in r.output
    assert time.monotonic() - t < 5


async def test_input_and_environment():
    r = await run_command(
        ["sh", "-c", 'cat; echo "$LLMGW_TEST_VALUE"'], stdin="vllm==0.30.0\n", env={"LLMGW_TEST_VALUE": "seen"}
    )
    assert r.ok and r.output.split() == ["vllm==0.30.0", "seen"]


def test_last_lines_joins_the_last_four_non_empty_lines():
    assert last_lines("a\n\nb\nc\nd\ne\n") == "b / c / d / e"
    assert last_lines("") == ""
