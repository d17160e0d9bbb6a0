"""Waking when a file is written, as the kernel says so (Linux inotify), rather than on a timer.

The agent's supervisor uses it to hear an engine's output: an engine says it is ready by
writing a line ("server is listening", "Application startup complete"), and checking its
health the moment it writes anything learns readiness in milliseconds however long the
wait between timed checks has grown. Where inotify cannot be had (another OS, a kernel
limit on watches), ``FileWrites.open`` returns None and the caller keeps its timer.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import logging
import os
from pathlib import Path

log = logging.getLogger("llmgw.filewatch")

_IN_MODIFY = 0x00000002
_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = os.O_CLOEXEC
COALESCE_S = 0.05  # a burst of lines is one write: a chatty load costs at most 20 probes a second


@functools.cache
def _lib() -> ctypes.CDLL | None:
    # The C library this process already runs on (dlopen of the program itself): no search, no subprocess.
    try:
        lib = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    return lib if hasattr(lib, "inotify_init1") and hasattr(lib, "inotify_add_watch") else None


class FileWrites:
    """One file watched for writes while this object is open; ``wait`` returns at the next one."""

    def __init__(self, fd: int, path: Path) -> None:
        self._fd = fd
        self.path = path
        self._written = asyncio.Event()
        asyncio.get_running_loop().add_reader(fd, self._readable)

    @classmethod
    def open(cls, path: Path) -> FileWrites | None:
        """A watch on ``path`` (which must exist), or None where the kernel gives none."""
        lib = _lib()
        if lib is None:
            return None
        fd = lib.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if fd < 0:
            log.debug("inotify_init1: %s", os.strerror(ctypes.get_errno()))
            return None
        if lib.inotify_add_watch(fd, os.fsencode(path), _IN_MODIFY) < 0:
            log.debug("inotify_add_watch %s: %s", path, os.strerror(ctypes.get_errno()))
            os.close(fd)
            return None
        return cls(fd, path)

    def _readable(self) -> None:
        # The events themselves say only "modified": read them off so the fd quiets down.
        with contextlib.suppress(BlockingIOError, OSError):
            while os.read(self._fd, 4096):
                pass
        self._written.set()

    async def wait(self, timeout: float) -> bool:
        """True when the file was written (since the last wait) within ``timeout``, False when not."""
        if not self._written.is_set():
            try:
                await asyncio.wait_for(self._written.wait(), timeout)
            except TimeoutError:
                return False
        await asyncio.sleep(COALESCE_S)
        self._written.clear()
        return True

    def close(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(ValueError, RuntimeError):
                asyncio.get_running_loop().remove_reader(self._fd)
            os.close(self._fd)
            self._fd = -1
