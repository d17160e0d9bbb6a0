"""Waking on a file's writes (inotify), the supervisor's way of hearing an engine speak."""

import asyncio

from llmgw.filewatch import FileWrites


async def test_a_watch_wakes_on_a_write_and_says_when_none_came(tmp_path):
    path = tmp_path / "engine.log"
    path.write_text("")
    watch = FileWrites.open(path)
    assert watch is not None  # Linux, as the agent requires
    try:
        assert await watch.wait(0.05) is False
        waiting = asyncio.create_task(watch.wait(30.0))
        with path.open("a") as f:
            f.write("server is listening\n")
        assert await asyncio.wait_for(waiting, 10) is True
        # The write was taken: the next wait waits for a new one.
        assert await watch.wait(0.05) is False
    finally:
        watch.close()


def test_a_file_that_is_not_there_gives_no_watch(tmp_path):
    async def go():
        return FileWrites.open(tmp_path / "missing.log")

    assert asyncio.run(go()) is None
