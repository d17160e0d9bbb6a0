"""The engine supervisor, with small fake engines (Python scripts) as the processes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from llmgw.agent.supervisor import (
    ENV_SHARD_ID,
    ENV_STATE_DIR,
    Role,
    ShardSpec,
    Supervisor,
    SupervisorError,
    UnknownShardError,
    alive,
    describe_exit_code,
    parse_stat,
    read_environ,
    read_stat,
)
from llmgw.protocol import ShardState
from llmgw.testing.waiting import async_until

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the supervisor reads /proc")

# A fake engine: prints, optionally waits before listening, answers /health with
# 503 while "loading", lists a model, can fail, ignore SIGTERM, fork a worker
# into its group, or burn CPU.
ENGINE = r"""
import argparse, http.server, json, os, signal, subprocess, sys, threading, time

p = argparse.ArgumentParser()
p.add_argument("--port", type=int, default=0)
p.add_argument("--model", default="tiny")
p.add_argument("--delay", type=float, default=0.0)
p.add_argument("--load", type=float, default=0.0)
p.add_argument("--say-ready", action="store_true")
p.add_argument("--exit", type=int, default=None)
p.add_argument("--suicide", default=None)
p.add_argument("--ignore-term", action="store_true")
p.add_argument("--worker-file", default=None)
p.add_argument("--started-file", default=None)
p.add_argument("--busy", action="store_true")
p.add_argument("--spam", type=int, default=0)
p.add_argument("--say", default=None)
p.add_argument("--hits", default=None)
a = p.parse_args()

if a.ignore_term:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if a.started_file:
    with open(a.started_file, "a") as f:
        f.write(f"{os.getpid()}\n")
print(a.say or f"engine {os.getpid()} starting", flush=True)
if a.worker_file:
    # A worker in the engine's own process group that ignores SIGTERM, as an
    # engine's forked ranks can: only a signal to the group's SIGKILL ends it.
    w = subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"])
    with open(a.worker_file, "w") as f:
        f.write(str(w.pid))
for i in range(a.spam):
    print(f"spam line {i:06d} " + "x" * 100)
if a.spam:
    print("spam done", flush=True)
if a.busy:
    def burn():
        while True:
            pass
    threading.Thread(target=burn, daemon=True).start()
time.sleep(a.delay)
if a.exit is not None:
    print("loading weights", flush=True)
    print("error: CUDA out of memory while loading the model", file=sys.stderr, flush=True)
    sys.exit(a.exit)
if a.suicide:
    os.kill(os.getpid(), getattr(signal, a.suicide))
if not a.port:
    while True:
        time.sleep(1)
ready_at = time.monotonic() + a.load
if a.say_ready:
    import threading

    # The engine's own line at the moment its load ends (ready_at), as a real engine prints one.
    say = threading.Timer(a.load, lambda: print("model loaded; serving", flush=True))
    say.daemon = True
    say.start()

class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass
    def _send(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        loading = time.monotonic() < ready_at
        if a.hits:
            with open(a.hits, "a") as f:
                f.write(f"{self.path} {'loading' if loading else 'ready'}\n")
        if self.path == "/health":
            self._send(503 if loading else 200, {"status": "loading" if loading else "ok"})
        elif self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [] if loading else [{"id": a.model, "object": "model"}]})
        else:
            self._send(404, {})

srv = http.server.ThreadingHTTPServer(("127.0.0.1", a.port), H)
print(f"listening on {a.port}", flush=True)
srv.serve_forever()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def engine_py(tmp_path: Path) -> Path:
    p = tmp_path / "engine.py"
    p.write_text(ENGINE)
    return p


@pytest.fixture
def state_dir(tmp_path: Path):
    d = tmp_path / "state"
    yield d
    # Whatever a test left running from this state directory is killed, pass or fail.
    for name in os.listdir("/proc"):
        if name.isdigit():
            env = read_environ(int(name)) or {}
            if env.get(ENV_STATE_DIR, "").startswith(str(tmp_path)):
                with contextlib.suppress(OSError):
                    os.kill(int(name), signal.SIGKILL)


@pytest.fixture
async def make_sup(state_dir: Path):
    made: list[Supervisor] = []

    def make(**kw) -> Supervisor:
        opts = dict(
            health_interval=0.05,
            poll_interval=0.05,
            log_interval=0.05,
            worker_settle=0.2,
            sweep_grace=1.0,
            stop_timeout=5.0,
            http_timeout=1.0,
        )
        opts.update(kw)
        s = Supervisor(state_dir, **opts)
        made.append(s)
        return s

    yield make
    for s in made:
        await s.close()


def leader(engine_py: Path, shard_id: str = "s1", port: int | None = None, *extra: str, **kw) -> ShardSpec:
    port = port or free_port()
    return ShardSpec(
        shard_id=shard_id,
        argv=[sys.executable, str(engine_py), "--port", str(port), *extra],
        base_url=f"http://127.0.0.1:{port}",
        model="tiny",
        **kw,
    )


def worker(engine_py: Path, shard_id: str = "w1", *extra: str, **kw) -> ShardSpec:
    return ShardSpec(shard_id=shard_id, role=Role.WORKER, argv=[sys.executable, str(engine_py), *extra], **kw)


def record(state_dir: Path, shard_id: str) -> dict:
    return orjson.loads((state_dir / "shards" / f"{shard_id}.json").read_bytes())


# ------------------------------------------------------------------ states


async def test_a_starting_engine_is_known_ready_soon_after_it_is_not_a_health_interval_later(
    make_sup, engine_py, tmp_path
):
    # Ten minutes between checks: were they that far apart from the start, READY would not come in the wait.
    sup = make_sup(health_interval=600.0)
    hits = tmp_path / "hits"
    await sup.start(leader(engine_py, "s1", None, "--delay", "0.3", "--load", "0.5", "--hits", str(hits)))
    st = await sup.wait("s1", ShardState.READY, timeout=20)
    assert st.state is ShardState.READY, st
    assert hits.read_text().splitlines()[-2:] == ["/health ready", "/v1/models ready"]


async def test_an_engine_saying_it_is_ready_is_checked_at_once_not_at_the_next_timed_probe(
    make_sup, engine_py, tmp_path
):
    # The first timed probe after the first comes 30 s later: READY in the wait is the engine's lines' doing.
    sup = make_sup(health_first=30.0, health_interval=600.0)
    hits = tmp_path / "hits"
    spec = leader(engine_py, "s1", None, "--delay", "0.3", "--load", "0.5", "--say-ready", "--hits", str(hits))
    await sup.start(spec)
    st = await sup.wait("s1", ShardState.READY, timeout=20)
    assert st.state is ShardState.READY, st
    assert hits.read_text().splitlines()[-2:] == ["/health ready", "/v1/models ready"]


async def test_a_leader_goes_through_every_state_to_ready(make_sup, engine_py, state_dir):
    seen: list[ShardState] = []
    sup = make_sup(on_change=lambda st: seen.append(st.state))
    st = await sup.start(leader(engine_py, "s1", None, "--delay", "0.4", "--load", "0.5"))
    assert st.state is ShardState.STARTING and st.pid
    st = await sup.wait("s1", ShardState.READY, timeout=20)
    assert st.state is ShardState.READY, st
    assert st.detail == "serving tiny"
    await async_until(lambda: ShardState.READY in seen, what="the ready report")
    assert seen == [ShardState.PENDING, ShardState.STARTING, ShardState.LOADING, ShardState.READY]
    rec = record(state_dir, "s1")
    assert rec["pid"] == st.pid
    assert rec["start_time"] == read_stat(st.pid).start_time
    assert (
        rec["fingerprint"]
        == st.fingerprint
        == leader(engine_py, "s1", 1).model_copy(update={"argv": rec["spec"]["argv"]}).fingerprint
    )
    # The engine leads its own session and group, away from the agent's.
    assert os.getpgid(st.pid) == st.pid and os.getsid(st.pid) == st.pid
    assert os.getpgid(st.pid) != os.getpgid(0)
    assert read_environ(st.pid)[ENV_SHARD_ID] == "s1"


async def test_a_model_that_is_not_listed_keeps_the_shard_loading(make_sup, engine_py):
    sup = make_sup()
    spec = leader(engine_py, "s1").model_copy(update={"model": "other"})
    await sup.start(spec)
    st = await sup.wait("s1", ShardState.LOADING, timeout=10)
    await asyncio.sleep(0.3)  # time passes to show the shard stays loading, not a wait for something
    st = sup.status("s1")
    assert st.state is ShardState.LOADING
    assert "lists tiny, not other" in st.detail


async def test_a_failed_engine_reports_its_tail_and_exit_status(make_sup, engine_py, state_dir):
    sup = make_sup()
    await sup.start(leader(engine_py, "bad", None, "--exit", "3"))
    st = await sup.wait("bad", ShardState.FAILED, timeout=10)
    assert st.state is ShardState.FAILED
    assert st.exit == "exited with status 3"
    assert "exited with status 3" in st.detail
    assert any("CUDA out of memory" in line for line in st.tail), st.tail
    assert any("loading weights" in line for line in st.tail)
    assert not (state_dir / "shards" / "bad.json").exists()
    assert "CUDA out of memory" in (state_dir / "logs" / "bad.log").read_text()


async def test_death_by_signal_is_said_in_words(make_sup, engine_py):
    sup = make_sup()
    await sup.start(leader(engine_py, "seg", None, "--suicide", "SIGKILL"))
    st = await sup.wait("seg", ShardState.FAILED, timeout=10)
    assert st.exit == "was killed by SIGKILL (signal 9)"
    assert describe_exit_code(-15) == "was killed by SIGTERM (signal 15)"


async def test_a_missing_program_fails_with_the_reason(make_sup, tmp_path):
    sup = make_sup()
    st = await sup.start(
        ShardSpec(shard_id="x", argv=[str(tmp_path / "no-such-engine")], base_url="http://127.0.0.1:1")
    )
    assert st.state is ShardState.FAILED
    assert "No such file or directory" in st.detail and "no-such-engine" in st.detail
    assert st.pid is None


# ------------------------------------------------------------------ stopping


async def test_stop_sends_sigterm_and_the_engine_goes(make_sup, engine_py, state_dir):
    sup = make_sup()
    st = await sup.start(leader(engine_py))
    await sup.wait("s1", timeout=10)
    t0 = time.monotonic()
    st = await sup.stop("s1")
    assert st.state is ShardState.STOPPED and st.detail == "stopped"
    assert st.exit == "was killed by SIGTERM (signal 15)"
    assert time.monotonic() - t0 < 3
    assert not alive(st.pid)
    assert not (state_dir / "shards" / "s1.json").exists()
    assert (await sup.stop("s1")).state is ShardState.STOPPED  # twice is fine
    with pytest.raises(UnknownShardError, match="no shard 'nope'"):
        await sup.stop("nope")


async def test_stop_escalates_to_sigkill_for_the_whole_group(make_sup, engine_py, tmp_path):
    sup = make_sup()
    wfile = tmp_path / "worker.pid"
    st = await sup.start(leader(engine_py, "s1", None, "--ignore-term", "--worker-file", str(wfile), stop_timeout=0.7))
    await sup.wait("s1", timeout=10)
    await async_until(lambda: wfile.exists() and wfile.read_text(), what="the worker pid")
    wpid = int(wfile.read_text())
    assert os.getpgid(wpid) == st.pid  # the forked worker is in the engine's group
    t0 = time.monotonic()
    st = await sup.stop("s1")
    took = time.monotonic() - t0
    assert st.state is ShardState.STOPPED
    assert "SIGKILL" in st.detail and "0.7s" in st.detail
    assert st.exit == "was killed by SIGKILL (signal 9)"
    assert 0.6 < took < 5
    assert not alive(st.pid)
    await async_until(lambda: not alive(wpid), timeout=5, what="the worker gone")


async def test_a_worker_left_behind_in_the_group_is_killed_when_the_engine_dies(make_sup, engine_py, tmp_path):
    sup = make_sup()
    wfile = tmp_path / "worker.pid"
    st = await sup.start(worker(engine_py, "w1", "--worker-file", str(wfile), "--delay", "0.5", "--exit", "1"))
    await async_until(lambda: wfile.exists() and wfile.read_text(), what="the worker pid")
    wpid = int(wfile.read_text())
    st = await sup.wait("w1", ShardState.FAILED, timeout=10)
    assert st.state is ShardState.FAILED
    await async_until(lambda: not alive(wpid), timeout=5, what="the orphaned rank gone")


# ------------------------------------------------------------------ sidecars and workers


async def test_a_sidecar_and_an_engine_both_run_under_one_shard(make_sup, engine_py):
    # Order is deliberately not asserted: spawning is not sequencing.
    sup = make_sup()
    side = [sys.executable, str(engine_py), "--say", "sidecar up"]
    spec = leader(engine_py, "s1", None, "--say", "engine up", sidecars=[side])
    st = await sup.start(spec)
    st = await sup.wait("s1", timeout=10)
    assert st.state is ShardState.READY
    await async_until(
        lambda: any(line == "[sidecar 0] sidecar up" for line in sup.tail("s1")), what="the sidecar's line"
    )
    assert "engine up" in sup.tail("s1")  # the engine's lines carry no prefix: distinguishable
    sidecar_pid = sup._shards["s1"].sidecars[0].pid
    assert st.pid != sidecar_pid  # the shard's pid is the engine's
    assert alive(sidecar_pid)
    await sup.stop("s1")
    assert not alive(sidecar_pid)


async def test_a_sidecar_dies_with_a_failed_engine(make_sup, engine_py):
    sup = make_sup()
    side = [sys.executable, str(engine_py), "--say", "sidecar up", "--ignore-term"]
    await sup.start(leader(engine_py, "s1", None, "--delay", "0.5", "--exit", "2", sidecars=[side]))
    sidecar_pid = sup._shards["s1"].sidecars[0].pid
    st = await sup.wait("s1", ShardState.FAILED, timeout=10)
    assert st.state is ShardState.FAILED
    await async_until(lambda: not alive(sidecar_pid), timeout=5, what="the sidecar gone")


async def test_a_workers_only_process_waits_for_the_leader(make_sup, engine_py):
    seen: list[tuple[ShardState, float]] = []

    async def report(st):  # the callback may be a coroutine (the agent sends it upstream)
        seen.append((st.state, time.monotonic()))

    sup = make_sup(on_change=report)
    port = free_port()
    listener: list[socket.socket] = []

    async def open_later():
        await asyncio.sleep(0.5)  # the behaviour under test: the leader listens late
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()
        listener.append(s)

    t0 = time.monotonic()
    opener = asyncio.create_task(open_later())
    st = await sup.start(worker(engine_py, "w1", wait_for=f"127.0.0.1:{port}"))
    assert st.state is ShardState.PENDING and st.pid is None
    assert "waiting for the leader" in sup.status("w1").detail or sup.status("w1").detail == "accepted"
    st = await sup.wait("w1", ShardState.READY, timeout=10)
    await opener
    listener[0].close()
    assert st.state is ShardState.READY and st.detail == "worker alive"
    await async_until(lambda: any(s is ShardState.STARTING for s, _ in seen), what="the starting report")
    started_at = next(t for s, t in seen if s is ShardState.STARTING)
    assert started_at - t0 >= 0.45, "the worker started before the leader was listening"


async def test_a_leaders_engine_waits_for_its_own_sidecar(make_sup, engine_py, tmp_path):
    # The Ray shape on the leader: the head is a sidecar, and the server must not
    # start before the head listens; waiting before the sidecar would deadlock.
    port = free_port()
    started = tmp_path / "engine.started"
    head = [sys.executable, str(engine_py), "--port", str(port), "--delay", "0.5", "--say", "head up"]
    spec = leader(
        engine_py,
        "s1",
        None,
        "--started-file",
        str(started),
        sidecars=[{"argv": head, "env": {"RAY": "1"}}],
        wait_for=f"127.0.0.1:{port}",
    )
    sup = make_sup()
    t0 = time.monotonic()
    st = await sup.start(spec)
    assert st.state is ShardState.PENDING and st.pid is None
    sidecar = sup._shards["s1"].sidecars[0].pid
    assert read_environ(sidecar)["RAY"] == "1"
    st = await sup.wait("s1", ShardState.READY, timeout=10)
    assert st.state is ShardState.READY
    assert time.monotonic() - t0 >= 0.45
    assert "RAY" not in read_environ(st.pid)  # the sidecar's environment is its own
    assert started.read_text().strip() == str(st.pid)
    await sup.stop("s1")
    assert not alive(sidecar)


async def test_stopping_while_waiting_ends_the_sidecars(make_sup, engine_py):
    sup = make_sup()
    side = [sys.executable, str(engine_py), "--say", "head up"]
    st = await sup.start(leader(engine_py, "s1", sidecars=[side], wait_for=f"127.0.0.1:{free_port()}"))
    assert st.state is ShardState.PENDING
    sidecar = sup._shards["s1"].sidecars[0].pid
    st = await sup.stop("s1")
    assert st.state is ShardState.STOPPED and st.pid is None
    assert not alive(sidecar)


async def test_a_leader_that_never_listens_fails_the_worker(make_sup, engine_py):
    sup = make_sup()
    port = free_port()
    await sup.start(worker(engine_py, "w1", wait_for=f"127.0.0.1:{port}", wait_timeout=0.4))
    st = await sup.wait("w1", ShardState.FAILED, timeout=5)
    assert st.state is ShardState.FAILED
    assert st.detail == f"the leader at 127.0.0.1:{port} did not accept connections within 0.4s"


async def test_a_pending_worker_can_be_stopped(make_sup, engine_py):
    sup = make_sup()
    await sup.start(worker(engine_py, "w1", wait_for=f"127.0.0.1:{free_port()}"))
    st = await sup.stop("w1")
    assert st.state is ShardState.STOPPED and st.pid is None


async def test_a_worker_that_dies_early_is_not_ready(make_sup, engine_py):
    sup = make_sup(worker_settle=1.0)
    await sup.start(worker(engine_py, "w1", "--exit", "1"))
    st = await sup.wait("w1", ShardState.READY, timeout=5)
    assert st.state is ShardState.FAILED


# ------------------------------------------------------------------ adoption


async def test_an_engine_is_adopted_by_a_new_supervisor(make_sup, engine_py, tmp_path, state_dir):
    started = tmp_path / "started"
    sup1 = make_sup()
    spec = leader(engine_py, "s1", None, "--started-file", str(started))
    st1 = await sup1.start(spec)
    await sup1.wait("s1", timeout=10)
    await sup1.close()  # the agent goes away; the engine must not
    assert alive(st1.pid)

    seen: list[ShardState] = []
    sup2 = make_sup(on_change=lambda st: seen.append(st.state))
    report = await sup2.adopt(desired={"s1": spec})
    assert report.adopted == ["s1"] and report.dropped == [] and report.stale == [] and report.killed == []
    st2 = await sup2.wait("s1", ShardState.READY, timeout=10)
    assert st2.state is ShardState.READY and st2.adopted
    assert st2.pid == st1.pid
    assert started.read_text().splitlines() == [str(st1.pid)]  # never restarted
    # Earlier output comes back from the log file, and the log says what happened.
    assert any("listening on" in line for line in sup2.tail("s1"))
    assert any("adopted pid" in line for line in sup2.tail("s1"))
    # The control plane repeating its start is answered with the adopted shard.
    assert (await sup2.start(spec)).pid == st1.pid
    assert not sup2.is_stale(spec)
    # An adopted engine is stopped by signalling its group.
    st = await sup2.stop("s1")
    assert st.state is ShardState.STOPPED
    assert not alive(st1.pid)
    assert not (state_dir / "shards" / "s1.json").exists()


async def test_an_adopted_worker_is_ready_at_once_and_its_death_is_noticed(make_sup, engine_py):
    sup1 = make_sup()
    st1 = await sup1.start(worker(engine_py, "w1"))
    await sup1.wait("w1", timeout=10)
    await sup1.close()
    sup2 = make_sup()
    await sup2.adopt()
    st = await sup2.wait("w1", ShardState.READY, timeout=5)
    assert st.state is ShardState.READY and st.pid == st1.pid
    os.kill(st1.pid, signal.SIGKILL)  # it stays a zombie of this test process: dead all the same
    st = await sup2.wait("w1", ShardState.FAILED, timeout=5)
    assert st.state is ShardState.FAILED
    assert "exit status is unknown" in st.detail


async def test_adoption_keeps_sidecars_and_stops_them_with_the_shard(make_sup, engine_py):
    sup1 = make_sup()
    side = [sys.executable, str(engine_py), "--say", "sidecar up"]
    await sup1.start(leader(engine_py, "s1", sidecars=[side]))
    await sup1.wait("s1", timeout=10)
    sidecar_pid = sup1._shards["s1"].sidecars[0].pid
    await sup1.close()
    sup2 = make_sup()
    await sup2.adopt()
    await sup2.wait("s1", timeout=10)
    assert [p.pid for p in sup2._shards["s1"].sidecars] == [sidecar_pid]
    await sup2.stop("s1")
    assert not alive(sidecar_pid)


async def test_a_changed_spec_is_reported_as_stale(make_sup, engine_py):
    sup1 = make_sup()
    spec = leader(engine_py, "s1")
    await sup1.start(spec)
    await sup1.wait("s1", timeout=10)
    await sup1.close()
    changed = spec.model_copy(update={"argv": [*spec.argv, "--say", "new flag"]})
    sup2 = make_sup()
    report = await sup2.adopt(desired={"s1": changed})
    assert report.adopted == ["s1"] and report.stale == ["s1"]
    assert sup2.is_stale(changed) and not sup2.is_stale(spec)
    with pytest.raises(SupervisorError, match="different command line; stop it first"):
        await sup2.start(changed)


def _write_record(state_dir: Path, shard_id: str, pid: int, start_time: int, argv: list[str]) -> Path:
    spec = ShardSpec(shard_id=shard_id, argv=argv, base_url="http://127.0.0.1:9")
    d = state_dir / "shards"
    d.mkdir(parents=True, exist_ok=True)
    p = d / f"{shard_id}.json"
    p.write_bytes(
        orjson.dumps(
            {
                "version": 1,
                "spec": spec.model_dump(mode="json"),
                "fingerprint": spec.fingerprint,
                "pid": pid,
                "start_time": start_time,
                "sidecars": [],
            }
        )
    )
    return p


async def test_a_zombie_is_dead(make_sup, state_dir):
    argv = [sys.executable, "-c", "pass"]
    # Popen, not asyncio's: asyncio's child watcher would reap the child, and the test needs it a zombie.
    child = subprocess.Popen(argv)  # noqa: ASYNC220  # fork+exec, no wait; see above
    try:
        await async_until(lambda: (read_stat(child.pid) or parse_stat("1 (x) Z")).state == "Z", what="a zombie")
        assert not alive(child.pid)  # kill(pid, 0) would still say yes
        os.kill(child.pid, 0)
        path = _write_record(state_dir, "z", child.pid, read_stat(child.pid).start_time, argv)
        sup = make_sup()
        report = await sup.adopt()
        assert report.adopted == []
        assert report.dropped == [("z", f"process {child.pid} has exited (a zombie nobody reaped)")]
        assert not path.exists()
    finally:
        child.wait()


async def test_a_reused_pid_is_left_alone(make_sup, state_dir):
    other = await asyncio.create_subprocess_exec("sleep", "60")
    try:
        st = read_stat(other.pid)
        # Same pid, another start time: the recorded engine is gone and the pid was reused.
        _write_record(state_dir, "a", other.pid, st.start_time + 1, ["sleep", "60"])
        # Same pid and start time, another command line and no marker: not ours either.
        _write_record(state_dir, "b", other.pid, st.start_time, ["llama-server", "--port", "1"])
        sup = make_sup()
        report = await sup.adopt()
        assert report.adopted == []
        reasons = dict(report.dropped)
        assert "start time differs" in reasons["a"]
        assert "different command line" in reasons["b"]
        assert report.killed == []
        assert alive(other.pid)  # never touched
        assert list((state_dir / "shards").iterdir()) == []
    finally:
        other.kill()
        await other.wait()


async def test_a_gone_engine_is_dropped(make_sup, state_dir):
    p = await asyncio.create_subprocess_exec("true")
    await p.wait()
    _write_record(state_dir, "g", p.pid, 1, ["true"])
    sup = make_sup()
    report = await sup.adopt()
    assert report.dropped and report.dropped[0][0] == "g"


async def test_a_corrupt_record_is_cleaned_up(make_sup, state_dir):
    d = state_dir / "shards"
    d.mkdir(parents=True)
    (d / "c.json").write_text("{not json")
    (d / "c.json.tmp123").write_text("half")
    (d / "d.json").write_bytes(orjson.dumps({"spec": {"shard_id": "d"}, "pid": 1}))
    sup = make_sup()
    report = await sup.adopt()
    reasons = dict(report.dropped)
    assert "unreadable" in reasons["c"] and "unreadable" in reasons["d"]
    assert list(d.iterdir()) == []


async def test_engines_nothing_accounts_for_are_swept(make_sup, engine_py, state_dir, tmp_path):
    ours = {**os.environ, ENV_SHARD_ID: "ghost", ENV_STATE_DIR: str(state_dir.resolve())}
    theirs = {**os.environ, ENV_SHARD_ID: "ghost", ENV_STATE_DIR: str(tmp_path / "another-agent")}
    up = tmp_path / "stubborn.up"  # written once SIGTERM is ignored
    stubborn = await asyncio.create_subprocess_exec(
        sys.executable,
        str(engine_py),
        "--ignore-term",
        "--started-file",
        str(up),
        env=ours,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
    )
    plain = await asyncio.create_subprocess_exec("sleep", "60", env=ours, start_new_session=True)
    foreign = await asyncio.create_subprocess_exec("sleep", "60", env=theirs, start_new_session=True)
    try:
        await async_until(up.exists, what="the stubborn engine up")
        sup = make_sup()
        report = await sup.adopt()
        assert sorted(k.pid for k in report.killed) == sorted([stubborn.pid, plain.pid])
        assert all(k.shard_id == "ghost" for k in report.killed)
        # Ignored SIGTERM, got SIGKILL after the grace.
        assert await asyncio.wait_for(stubborn.wait(), 5) == -signal.SIGKILL
        assert await asyncio.wait_for(plain.wait(), 5) == -signal.SIGTERM
        assert foreign.returncode is None and alive(foreign.pid)  # another agent's engine is not ours to kill
    finally:
        for p in (stubborn, plain, foreign):
            try:
                p.kill()
            except ProcessLookupError:  # asyncio's kill() of one already reaped
                pass
            await p.wait()


async def test_the_sweep_spares_running_shards_and_their_children(make_sup, engine_py, tmp_path):
    sup = make_sup()
    wfile = tmp_path / "worker.pid"
    st = await sup.start(leader(engine_py, "s1", None, "--worker-file", str(wfile)))
    await sup.wait("s1", timeout=10)
    await async_until(lambda: wfile.exists() and wfile.read_text(), what="the worker pid")
    assert await sup.sweep() == []
    assert alive(st.pid) and alive(int(wfile.read_text()))


# ------------------------------------------------------------------ the rest


async def test_one_supervisor_per_state_directory(make_sup):
    make_sup()
    with pytest.raises(SupervisorError, match="in use by another supervisor"):
        make_sup()


async def test_starting_twice_is_answered_with_the_running_shard(make_sup, engine_py, state_dir):
    sup = make_sup()
    spec = leader(engine_py)
    st1 = await sup.start(spec)
    st2 = await sup.start(spec)
    assert st1.pid == st2.pid
    with pytest.raises(SupervisorError, match="still running"):
        sup.forget("s1")
    await sup.stop("s1")
    st3 = await sup.start(spec)  # a finished shard's id can be started again
    assert st3.pid != st1.pid
    await sup.stop("s1")
    sup.forget("s1")
    assert list((state_dir / "logs").iterdir()) == []
    with pytest.raises(UnknownShardError):
        sup.status("s1")


async def test_load_is_measured_per_process_group(make_sup, engine_py):
    sup = make_sup()
    await sup.start(worker(engine_py, "busy", "--busy"))
    await sup.start(worker(engine_py, "idle"))
    await sup.wait("busy", timeout=5)
    await sup.wait("idle", timeout=5)
    first = sup.usage()
    assert first["busy"].cpu_cores is None  # a rate needs two readings
    assert first["busy"].rss_bytes > 1 << 20 and first["busy"].processes == 1
    await asyncio.sleep(0.5)  # the window the CPU rate is measured over
    second = sup.usage()
    # Loose bounds: other tests may share the machine's cores.
    assert 0.05 < second["busy"].cpu_cores < (os.cpu_count() or 1) + 0.5, second
    assert second["idle"].cpu_cores < 0.05, second


async def test_the_log_file_is_capped(make_sup, engine_py, state_dir):
    sup = make_sup(log_max_bytes=64 << 10, tail_lines=50)
    await sup.start(worker(engine_py, "w1", "--spam", "5000"))
    await async_until(lambda: "spam done" in sup.tail("w1"), what="the last line in the tail")
    tail = sup.tail("w1", 5)
    assert tail[-1] == "spam done" and len(tail) == 5
    assert len(sup.tail("w1", 1000)) == 50
    # The follower rotates as it reads: poll it until the rotated copy is there.
    await async_until(lambda: sup.tail("w1") and (state_dir / "logs" / "w1.log.1").exists(), what="the log rotated")
    log_file = state_dir / "logs" / "w1.log"
    assert log_file.stat().st_size <= 64 << 10
    assert (state_dir / "logs" / "w1.log.1").exists()


def test_specs_are_checked():
    with pytest.raises(ValueError, match="shard id"):
        ShardSpec(shard_id="../x", argv=["a"], base_url="http://h:1")
    with pytest.raises(ValueError, match="a leader needs base_url"):
        ShardSpec(shard_id="x", argv=["a"])
    with pytest.raises(ValueError, match="a worker is judged by staying alive"):
        ShardSpec(shard_id="x", argv=["a"], role="worker", base_url="http://h:1")
    with pytest.raises(ValueError, match="not host:port"):
        ShardSpec(shard_id="x", argv=["a"], role="worker", wait_for="leader")
    with pytest.raises(ValueError, match="out of range"):
        ShardSpec(shard_id="x", argv=["a"], role="worker", wait_for="h:70000")
    with pytest.raises(ValueError, match="not a valid variable name"):
        ShardSpec(shard_id="x", argv=["a"], role="worker", env={"A=B": "1"})
    with pytest.raises(ValueError, match="set by the supervisor"):
        ShardSpec(shard_id="x", argv=["a"], role="worker", env={ENV_SHARD_ID: "y"})
    with pytest.raises(ValueError, match="argv"):
        ShardSpec(shard_id="x", argv=[], role="worker")
    with pytest.raises(ValueError, match="sidecar 0 has an empty command"):
        ShardSpec(shard_id="x", argv=["a"], role="worker", sidecars=[()])
    with pytest.raises(ValueError, match="sidecar 0 has an empty command"):
        ShardSpec(shard_id="x", argv=["a"], role="worker", sidecars=[[]])
    a = ShardSpec(shard_id="x", argv=["a"], role="worker", env={"K": "1"})
    assert a.fingerprint != a.model_copy(update={"env": {"K": "2"}}).fingerprint
    assert a.fingerprint == a.model_copy(update={"meta": {"profile": "p"}}).fingerprint


def test_stat_lines_with_awkward_names_parse():
    raw = "4242 (my ) (engine) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 3 0 987654 1000000 2560 18446744073709551615"
    st = parse_stat(raw + " 0" * 30)
    assert (st.pid, st.state, st.ppid, st.pgrp, st.jiffies, st.start_time, st.rss_pages) == (
        4242,
        "S",
        1,
        4242,
        300,
        987654,
        2560,
    )
    assert parse_stat("garbage") is None
