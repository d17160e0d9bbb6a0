"""Memory, CPU use and load from /proc."""

from __future__ import annotations

from pathlib import Path

from llmgw.agent.discovery.proc import (
    LoadSampler,
    parse_loadavg,
    parse_meminfo,
    parse_pid_stat,
    parse_proc_stat,
    read_memory,
)

FIX = Path(__file__).parent.parent / "fixtures" / "discovery"
PAGE = 4096


class FakeProc:
    """A /proc with two CPUs, load averages, memory and processes."""

    def __init__(self, root: Path):
        self.root = root
        self.write("loadavg", "1.50 0.75 0.25 2/300 4242\n")
        self.write("meminfo", "MemTotal:        8000000 kB\nMemFree:         1000000 kB\nMemAvailable:    3000000 kB\n")

    def write(self, name: str, body: str) -> None:
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body)

    def cpu(self, user: int, idle: int, iowait: int = 0) -> None:
        self.write(
            "stat",
            f"cpu  {user} 0 0 {idle} {iowait} 0 0 0 0 0\n"
            "cpu0 0 0 0 0 0 0 0 0 0 0\ncpu1 0 0 0 0 0 0 0 0 0 0\n"
            "intr 12345 0 0\nctxt 999\nbtime 1700000000\nprocesses 4242\n",
        )

    def proc(self, pid: int, pgrp: int, jiffies: int, rss_pages: int, state: str = "S") -> None:
        # The name holds a space and a parenthesis, as real ones can.
        self.write(
            f"{pid}/stat",
            f"{pid} (llama-server (x)) {state} 1 {pgrp} {pgrp} 0 -1 4194560 0 0 0 0 {jiffies} 0 0 0 20 0 1 0 100 "
            f"1000000 {rss_pages} 18446744073709551615 0 0 0 0 0 0 0 0 0 0 0 0 17 3 0 0 0 0 0\n",
        )


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_memory_total_and_available_in_bytes():
    mem = parse_meminfo((FIX / "meminfo").read_text())
    assert mem.total_bytes == 2113266788 * 1024
    assert mem.available_bytes == 2070183612 * 1024
    assert mem.used_bytes == (2113266788 - 2070183612) * 1024


def test_an_old_kernel_without_memavailable_leaves_it_unknown():
    mem = parse_meminfo("MemTotal:  1000 kB\nMemFree:  500 kB\n")
    assert mem.total_bytes == 1024000 and mem.available_bytes is None and mem.used_bytes is None


def test_no_meminfo_is_no_memory_not_zero(tmp_path):
    assert read_memory(tmp_path) is None
    (tmp_path / "meminfo").write_text("garbage\n")
    assert read_memory(tmp_path) is None


def test_load_is_the_difference_between_two_readings(tmp_path):
    p = FakeProc(tmp_path)
    clock = Clock()
    s = LoadSampler(tmp_path, clock=clock, clock_ticks=100, page_size=PAGE)
    p.cpu(user=100, idle=900)
    p.proc(42, 42, jiffies=1000, rss_pages=10)
    p.proc(43, 42, jiffies=500, rss_pages=5)  # a worker in the engine's group
    p.proc(7, 7, jiffies=99999, rss_pages=1)  # something else entirely

    first = s.sample({"shard-a": 42})
    # The first reading has nothing to compare with: no utilisation, but the
    # load averages and CPU count are already known.
    assert first.cpu_percent is None
    assert (first.cpu_count, first.load1, first.load5, first.load15) == (2, 1.5, 0.75, 0.25)
    assert first.shards[0].cpu_cores is None and first.shards[0].memory_rss_bytes == 15 * PAGE

    # Two seconds later 300 of the 400 jiffies that passed were busy (iowait
    # counts as idle), and the engine's group used 400 of them.
    clock.now += 2
    p.cpu(user=400, idle=950, iowait=50)
    p.proc(42, 42, jiffies=1300, rss_pages=10)
    p.proc(43, 42, jiffies=600, rss_pages=6)
    load = s.sample({"shard-a": 42, "gone": 999})
    assert load.cpu_percent == 75.0
    assert len(load.shards) == 1  # the shard whose process is gone is left out
    sh = load.shards[0]
    assert sh.shard_id == "shard-a"
    assert sh.cpu_cores == 2.0  # 400 jiffies over 2 s at 100 a second
    assert sh.memory_rss_bytes == 16 * PAGE


def test_a_zombie_counts_for_nothing(tmp_path):
    p = FakeProc(tmp_path)
    p.cpu(1, 1)
    p.proc(42, 42, jiffies=10, rss_pages=10, state="Z")
    load = LoadSampler(tmp_path, clock_ticks=100, page_size=PAGE).sample({"a": 42})
    assert load.shards == []


def test_no_proc_means_no_load_not_zeros(tmp_path):
    s = LoadSampler(tmp_path / "missing")
    assert s.sample() is None
    assert s.sample() is None


def test_no_loadavg_leaves_the_averages_unknown(tmp_path):
    p = FakeProc(tmp_path)
    p.cpu(1, 1)
    (tmp_path / "loadavg").unlink()
    load = LoadSampler(tmp_path).sample()
    assert load.load1 is None and load.cpu_count == 2


def test_parsers_on_real_shapes():
    times, count = parse_proc_stat("cpu  4705 356 584 3699176 23060 0 277 0 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n")
    assert times.total == 4705 + 356 + 584 + 3699176 + 23060 + 277
    assert times.idle == 3699176 + 23060
    assert count == 1
    assert parse_proc_stat("intr 1\n") == (None, None)
    assert parse_loadavg("0.08 0.03 0.01 1/177 2213\n") == (0.08, 0.03, 0.01)
    assert parse_loadavg("") is None
    st = parse_pid_stat("4242 (python3 -m (vllm)) R 1 4242 4242 0 -1 0 0 0 0 0 150 50 0 0 20 0 12 0 100 1 777 0\n")
    assert (st.pid, st.pgrp, st.jiffies, st.rss_pages, st.state) == (4242, 4242, 200, 777, "R")
    assert parse_pid_stat("garbage") is None
