"""The shared until(): what it returns, and what its failures say."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from llmgw.testing.waiting import async_until, until


class FakeProc:
    def __init__(self, tmp_path, text: str, alive: bool = True) -> None:
        self.log = tmp_path / "proc.log"
        self.log.write_text(text)
        self._alive = alive

    def alive(self) -> bool:
        return self._alive

    def text(self) -> str:
        return self.log.read_text()


def test_until_returns_the_first_true_value_of_the_condition():
    seen = iter([0, None, [], "got it"])
    assert until(lambda: next(seen), 5, "the fourth value", interval=0) == "got it"


def test_a_timeout_names_what_was_awaited_the_last_value_the_detail_and_the_process_log(tmp_path):
    proc = FakeProc(tmp_path, "x" * 5000 + "the last line of the log")
    with pytest.raises(AssertionError) as ei:
        until(lambda: 0, 0.05, "the answer", [proc], lambda: "replicas: none")
    msg = str(ei.value)
    assert msg.startswith("timed out after 0.05s waiting for the answer")
    assert "last value: 0" in msg and "replicas: none" in msg
    assert str(proc.log) in msg and msg.endswith("the last line of the log") and "x" * 3000 not in msg


def test_an_ignored_error_counts_as_not_yet_and_is_shown_on_timeout():
    calls = []

    def cond():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("not up yet")
        return True

    assert until(cond, 5, "the server", ignore=(ConnectionError,), interval=0)
    with pytest.raises(AssertionError, match=r"last error: ConnectionError\('refused'\)"):
        until(lambda: (_ for _ in ()).throw(ConnectionError("refused")), 0.05, "x", ignore=(ConnectionError,))
    with pytest.raises(KeyError):  # an error not named is a bug in the test, raised at once
        until(lambda: {}["k"], 5, "x")


def test_a_process_that_must_stay_alive_fails_the_wait_at_once_with_its_log(tmp_path):
    dead = FakeProc(tmp_path, "Traceback: boom", alive=False)
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match="exited while waiting for the agent to register") as ei:
        until(lambda: False, 30, "the agent to register", alive=[dead])
    assert time.monotonic() - t0 < 5 and "Traceback: boom" in str(ei.value)
    popen = subprocess.Popen([sys.executable, "-c", "pass"])
    popen.wait()
    with pytest.raises(AssertionError, match="exited while waiting"):
        until(lambda: False, 30, "x", alive=[popen])


async def test_async_until_polls_without_blocking_the_loop_and_awaits_a_coroutine_condition():
    import asyncio

    box: list[int] = []
    asyncio.get_running_loop().call_later(0.05, box.append, 1)
    assert await async_until(lambda: box, 5, "the callback") == [1]

    async def cond():
        return "ready" if box else None

    assert await async_until(cond, 5, "a coroutine condition") == "ready"
    with pytest.raises(AssertionError, match=r"timed out after 0\.05s waiting for nothing"):
        await async_until(lambda: False, 0.05, "nothing")
