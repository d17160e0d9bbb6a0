"""engine-check: every flag llmgw passes, looked for in the engine's real (or realistic) --help."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from llmgw.agent.engines import UnknownEngine, adapter_for, engine_check, flag_present, run_engine_check

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "engines"
LLAMA_SERVER = Path.home() / ".cache/llmgw/llama-server-0.3.36/bin/llama-server"


def fixture(name: str) -> str:
    return (FIX / name).read_text()


def script(tmp_path: Path, name: str, body: str) -> str:
    p = tmp_path / name
    p.write_text("#!/bin/sh\n" + body + "\n")
    p.chmod(0o755)
    return str(p)


def test_the_flags_checked_come_from_the_builders():
    assert adapter_for("llamacpp").check_flags() == [
        "--model",
        "--host",
        "--port",
        "--alias",
        "--ctx-size",
        "--parallel",
        "--jinja",
        "--metrics",
    ]
    vllm = adapter_for("vllm").check_flags()
    # Multi-node flags too: a flag used only there is the one nobody notices has gone.
    for f in (
        "--served-model-name",
        "--tensor-parallel-size",
        "--distributed-executor-backend",
        "--nnodes",
        "--node-rank",
        "--master-addr",
        "--master-port",
        "--headless",
        "--quantization",
    ):
        assert f in vllm
    sglang = adapter_for("sglang").check_flags()
    for f in ("--model-path", "--tp-size", "--enable-metrics", "--nnodes", "--node-rank", "--dist-init-addr"):
        assert f in sglang
    assert "-m" not in sglang  # the interpreter's, not SGLang's


def test_the_real_llama_server_help_accepts_every_flag():
    result = engine_check("llamacpp", fixture("llama-server-help.txt"))
    assert result.ok and result.missing == [] and result.warnings == []


def test_a_truncated_help_reports_the_flags_past_the_cut_and_says_it_was_cut():
    result = engine_check("llamacpp", fixture("llama-server-help-truncated.txt"))
    # LLAMA_API_KEY, the variable the engine's key goes in, is past the cut too.
    assert result.missing == ["--host", "--port", "--alias", "--parallel", "--jinja", "--metrics", "LLAMA_API_KEY"]
    assert result.problems[0] == (
        "--host is not in llama.cpp's --help: llmgw passes it, so this build would refuse "
        "to start a shard (renamed or removed in this version?)"
    )
    assert len(result.warnings) == 1
    w = result.warnings[0]
    assert w.startswith("the help looks cut short (it is 400 lines, and a complete llama.cpp help is over 500")
    assert 'it has no "example-specific params" section' in w
    assert "so the flags reported missing may be there" in w


def test_flags_match_on_a_word_boundary():
    assert not flag_present("--port", "--portable  keep it portable\n--port-range A-B\n")
    assert not flag_present("--jinja", "--no-jinja   turn templates off\n")
    assert not flag_present("--model", "--model-path PATH\n--draft-model PATH\n")
    for text in (
        "--port PORT  the port\n",
        "-p, --port N\n",
        "[--port PORT]\n",
        "--port=PORT\n",
        "--jinja, --no-jinja\n",
        "  --tp-size TP_SIZE, --tensor-parallel-size TP_SIZE\n",
    ):
        flag = "--tp-size" if "tp-size" in text else ("--jinja" if "jinja" in text else "--port")
        assert flag_present(flag, text), text


def test_a_renamed_flag_is_caught_even_when_a_longer_one_shares_its_start():
    help_text = fixture("llama-server-help.txt").replace("--port PORT", "--port-number PORT")
    result = engine_check("llamacpp", help_text)
    assert result.missing == ["--port"]


def test_a_help_cut_mid_line_is_warned_about():
    text = fixture("llama-server-help.txt")
    result = engine_check("llamacpp", text[: len(text) - 20])
    assert result.ok
    assert "it ends in the middle of a line" in result.warnings[0]
    assert "so this check may have missed something" in result.warnings[0]


def test_an_empty_help_is_a_problem():
    result = engine_check("llamacpp", "")
    assert result.problems == ["the help is empty, so none of llmgw's 8 flags could be checked"]


def test_vllm_full_help_accepts_every_flag():
    result = engine_check("vllm", fixture("vllm-serve-help-all.txt"))
    assert result.ok and result.warnings == []


def test_vllm_short_help_is_recognised_for_what_it_is():
    result = engine_check("vllm", fixture("vllm-serve-help-short.txt"))
    assert "--tensor-parallel-size" in result.missing
    assert (
        "it is vLLM's short help, which lists option groups and not their flags; run `vllm serve --help=all`"
        in result.warnings[0]
    )


def test_sglang_help_accepts_every_flag_and_catches_a_missing_one():
    text = fixture("sglang-launch-server-help.txt")
    assert engine_check("sglang", text).ok
    result = engine_check("sglang", text.replace("--enable-metrics", "--enable-prometheus"))
    assert result.missing == ["--enable-metrics"]


def test_ansi_colours_do_not_hide_flags():
    text = fixture("sglang-launch-server-help.txt").replace("--tp-size", "\x1b[36m--tp-size\x1b[0m")
    assert engine_check("sglang", text).ok


def test_an_unknown_engine_is_named():
    with pytest.raises(UnknownEngine, match='unknown engine "ollama"'):
        engine_check("ollama", "")


# --- running the help ---


@pytest.mark.skipif(not LLAMA_SERVER.exists(), reason="the test llama-server is not built")
def test_run_against_the_real_llama_server():
    report = run_engine_check("llamacpp", str(LLAMA_SERVER))
    assert report.ok, report.problems
    assert report.warnings == []
    assert report.exit_code == 0 and report.help_lines > 500
    assert report.command == [str(LLAMA_SERVER), "--help"]
    assert report.to_dict()["ok"] is True


def test_vllm_falls_back_to_plain_help_on_a_release_without_help_all(tmp_path: Path):
    full = FIX / "vllm-serve-help-all.txt"
    bin_path = script(
        tmp_path,
        "vllm",
        f"""
if [ "$2" = "--help=all" ]; then echo "vllm serve: error: argument -h/--help: ignored explicit argument 'all'" >&2; exit 2; fi
[ "$1 $2" = "serve --help" ] && cat '{full}'""",
    )
    report = run_engine_check("vllm", bin_path)
    assert report.ok, report.problems
    assert report.command == [bin_path, "serve", "--help"] and report.exit_code == 0


def test_vllm_is_asked_for_the_whole_help_first(tmp_path: Path):
    full = FIX / "vllm-serve-help-all.txt"
    bin_path = script(tmp_path, "vllm", f"""[ "$2" = "--help=all" ] && cat '{full}' && exit 0; exit 1""")
    report = run_engine_check("vllm", bin_path)
    assert report.ok and report.command == [bin_path, "serve", "--help=all"]


def test_a_missing_binary_says_what_to_pass(tmp_path: Path):
    report = run_engine_check("vllm", str(tmp_path / "nope"))
    assert report.problems == [
        f"{tmp_path / 'nope'} was not found; pass --bin with the path of the vllm executable of a vLLM environment"
    ]
    p = tmp_path / "llama-server"
    p.write_text("not a program")
    report = run_engine_check("llamacpp", str(p))
    assert report.problems == [f"{p} is not executable; pass --bin with the path of the llama-server binary"]


def test_sglang_that_will_not_import_is_reported_in_its_words(tmp_path: Path):
    py = script(
        tmp_path,
        "python3",
        """echo "$1 $2 $3" > /dev/null
echo "/usr/bin/python3: Error while finding module specification for 'sglang.launch_server' (ModuleNotFoundError: No module named 'sglang')" >&2
exit 1""",
    )
    report = run_engine_check("sglang", py)
    assert report.command == [py, "-m", "sglang.launch_server", "--help"]
    assert report.problems == [
        f"{py} -m sglang.launch_server --help exited with status 1: /usr/bin/python3: Error "
        "while finding module specification for 'sglang.launch_server' "
        "(ModuleNotFoundError: No module named 'sglang')"
    ]


def test_help_printed_to_stderr_still_counts(tmp_path: Path):
    bin_path = script(tmp_path, "llama-server", f"cat '{FIX / 'llama-server-help.txt'}' >&2")
    assert run_engine_check("llamacpp", bin_path).ok


def test_a_help_that_never_finishes_is_stopped_and_warned_about(tmp_path: Path):
    bin_path = script(tmp_path, "llama-server", f"head -n 400 '{FIX / 'llama-server-help.txt'}'; exec sleep 30")
    started = time.monotonic()
    report = run_engine_check("llamacpp", bin_path, timeout=1)
    assert time.monotonic() - started < 10
    assert report.exit_code is None and report.help_lines == 400
    assert "it had not finished after 1 s and was stopped" in report.warnings[0]
    assert "--port" in report.missing


def test_a_bare_name_is_looked_up_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    script(tmp_path, "llama-server", f"cat '{FIX / 'llama-server-help.txt'}'")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    report = run_engine_check("llamacpp", "llama-server")
    assert report.ok and report.command == [str(tmp_path / "llama-server"), "--help"]


def test_a_help_that_exits_non_zero_is_still_checked(tmp_path: Path):
    bin_path = script(tmp_path, "llama-server", f"cat '{FIX / 'llama-server-help.txt'}'; exit 1")
    report = run_engine_check("llamacpp", bin_path)
    assert report.ok and report.exit_code == 1
    assert report.warnings == [f"{bin_path} --help exited with status 1 after printing its help"]
