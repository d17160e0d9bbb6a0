"""Memory, CPU use and load from /proc, re-read for every heartbeat.

Memory is the one figure every node has and every placement needs (a CPU
profile has no card to be free), so it is read first and on its own, before
anything that can fail.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from llmgw.protocol import MemoryInfo, NodeLoad, ShardLoad


def parse_meminfo(text: str) -> MemoryInfo:
    """MemTotal and MemAvailable, in bytes. A kernel too old for MemAvailable
    (before 3.14) leaves it unknown rather than guessed."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, sep, rest = line.partition(":")
        if not sep:
            continue
        fields = rest.split()
        if not fields:
            continue
        try:
            n = int(fields[0])
        except ValueError:
            continue
        unit = fields[1].lower() if len(fields) > 1 else ""
        values[key.strip()] = n * 1024 if unit == "kb" else n
    return MemoryInfo(total_bytes=values.get("MemTotal"), available_bytes=values.get("MemAvailable"))


def read_memory(proc_root: Path = Path("/proc")) -> MemoryInfo | None:
    try:
        text = (proc_root / "meminfo").read_text()
    except OSError:
        return None
    mem = parse_meminfo(text)
    return mem if mem.total_bytes else None


@dataclass(frozen=True, slots=True)
class CPUTimes:
    total: int
    idle: int  # idle + iowait: a core waiting on the disk is not doing work


def parse_proc_stat(text: str) -> tuple[CPUTimes | None, int | None]:
    """The aggregate "cpu" line's times and the number of "cpuN" lines."""
    times: CPUTimes | None = None
    count = 0
    for line in text.splitlines():
        if line.startswith("cpu ") and times is None:
            fields = line.split()[1:]
            try:
                # user nice system idle iowait irq softirq steal; guest and
                # guest_nice are already counted in user and nice.
                nums = [int(v) for v in fields[:8]]
            except ValueError:
                continue
            if len(nums) >= 4:
                idle = nums[3] + (nums[4] if len(nums) > 4 else 0)
                times = CPUTimes(total=sum(nums), idle=idle)
        elif line.startswith("cpu") and line[3:4].isdigit():
            count += 1
    return times, (count or None)


def parse_loadavg(text: str) -> tuple[float, float, float] | None:
    fields = text.split()
    try:
        return float(fields[0]), float(fields[1]), float(fields[2])
    except (IndexError, ValueError):
        return None


@dataclass(frozen=True, slots=True)
class ProcStat:
    pid: int
    pgrp: int
    jiffies: int  # utime + stime
    rss_pages: int
    state: str


def parse_pid_stat(text: str) -> ProcStat | None:
    """/proc/<pid>/stat. The command name is in parentheses and may itself hold
    spaces and parentheses, so fields are counted from the last ')'."""
    close = text.rfind(")")
    open_ = text.find("(")
    if close < 0 or open_ < 0:
        return None
    try:
        pid = int(text[:open_].strip())
        f = text[close + 1 :].split()
        # After the name: state(0) ppid(1) pgrp(2) ... utime(11) stime(12) ... rss(21)
        return ProcStat(pid=pid, pgrp=int(f[2]), jiffies=int(f[11]) + int(f[12]), rss_pages=int(f[21]), state=f[0])
    except (IndexError, ValueError):
        return None


@dataclass(frozen=True, slots=True)
class _GroupUse:
    jiffies: int
    rss_pages: int


class LoadSampler:
    """CPU utilisation is a difference between two readings, so the sampler
    keeps the previous one. The first reading reports load averages and a
    CPU count but no utilisation; a machine without /proc reports nothing."""

    def __init__(
        self,
        proc_root: Path = Path("/proc"),
        *,
        clock: Callable[[], float] = time.monotonic,
        clock_ticks: int | None = None,
        page_size: int | None = None,
    ):
        self.proc_root = Path(proc_root)
        self._clock = clock
        self._hz = clock_ticks or os.sysconf("SC_CLK_TCK")
        self._page = page_size or os.sysconf("SC_PAGE_SIZE")
        self._lock = threading.Lock()
        self._prev_at: float | None = None
        self._prev_cpu: CPUTimes | None = None
        self._prev_groups: dict[int, _GroupUse] = {}

    def sample(self, shards: Mapping[str, int] | None = None) -> NodeLoad | None:
        """Read the machine, and the process groups led by ``shards``' pids
        (shard id -> pid): an engine leads its own group, so its workers count with it."""
        try:
            stat_text = (self.proc_root / "stat").read_text()
        except OSError:
            return None
        cpu, count = parse_proc_stat(stat_text)
        if cpu is None:
            return None
        groups = self._groups() if shards else {}
        now = self._clock()
        with self._lock:
            prev_at, prev_cpu, prev_groups = self._prev_at, self._prev_cpu, self._prev_groups
            self._prev_at, self._prev_cpu, self._prev_groups = now, cpu, groups

        percent = None
        if prev_cpu is not None and cpu.total > prev_cpu.total:
            d_total = cpu.total - prev_cpu.total
            d_busy = d_total - max(cpu.idle - prev_cpu.idle, 0)
            percent = round(min(max(100.0 * d_busy / d_total, 0.0), 100.0), 2)

        try:
            avg = parse_loadavg((self.proc_root / "loadavg").read_text())
        except OSError:
            avg = None

        shard_loads = None
        if shards:
            secs = now - prev_at if prev_at is not None else 0.0
            shard_loads = []
            for shard_id, pid in sorted(shards.items()):
                use = groups.get(pid)
                if pid <= 0 or use is None:
                    continue  # the process is gone; its status says so elsewhere
                cores = None
                before = prev_groups.get(pid)
                if before is not None and secs > 0 and use.jiffies >= before.jiffies:
                    cores = round((use.jiffies - before.jiffies) / self._hz / secs, 3)
                shard_loads.append(
                    ShardLoad(shard_id=shard_id, cpu_cores=cores, memory_rss_bytes=use.rss_pages * self._page)
                )

        return NodeLoad(
            cpu_percent=percent,
            cpu_count=count,
            load1=avg[0] if avg else None,
            load5=avg[1] if avg else None,
            load15=avg[2] if avg else None,
            shards=shard_loads,
        )

    def _groups(self) -> dict[int, _GroupUse]:
        """CPU time and resident pages summed per process group, in one pass over /proc."""
        out: dict[int, _GroupUse] = {}
        try:
            entries = os.listdir(self.proc_root)
        except OSError:
            return out
        for name in entries:
            if not name.isdigit():
                continue
            try:
                st = parse_pid_stat((self.proc_root / name / "stat").read_text())
            except OSError:
                continue  # exited while we looked
            if st is None or st.state == "Z":
                continue
            g = out.get(st.pgrp)
            out[st.pgrp] = _GroupUse((g.jiffies if g else 0) + st.jiffies, (g.rss_pages if g else 0) + st.rss_pages)
        return out
