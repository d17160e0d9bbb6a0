"""Converging on the wanted engines: states, reports, one install per engine, the timer."""

from __future__ import annotations

import asyncio

import pytest

from llmgw.agent.provision.host import HostFacts
from llmgw.agent.provision.manager import INSTALLABLE, ConvergeLoop, Installer, Want
from llmgw.agent.provision.status import InstallRecord, NotHere, ProvisionError, Reporter, Unsupported
from llmgw.protocol import ProvisionState, ProvisionStatus
from llmgw.testing.waiting import async_until

HOST = HostFacts(arch="amd64", os_id="ubuntu", cpu_flags=frozenset({"avx2"}))


class SlowLlama:
    """Stands in for LlamaCppInstaller: counts installs, can be held or made to fail."""

    def __init__(self):
        self.running = 0
        self.most = 0
        self.installs = 0
        self.release = asyncio.Event()
        self.release.set()
        self.error: Exception | None = None
        self.installed = False
        self.attempts = 0

    async def ensure(self, version, reporter, *, base_url=None):
        self.attempts += 1
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            reporter.update(variant="cpu")
            if not self.installed:
                reporter.installing(f"downloading llama-{version}.tar.gz")
                reporter.progress(0, 100)
                reporter.progress(50, 100)
                reporter.progress(100, 100)
                await self.release.wait()
                if self.error:
                    raise self.error
                self.installs += 1
                self.installed = True
            reporter.update(state=ProvisionState.READY, detail="llama-server version: 1", binary="/x/llama-server")
        finally:
            self.running -= 1


def make(llama=None):
    seen: list[InstallRecord] = []
    inst = Installer("/nonexistent/engines", HOST, on_status=seen.append, llamacpp=llama or SlowLlama())
    return inst, seen


async def test_an_engine_the_agent_cannot_install_says_so():
    inst, seen = make()
    [st] = await inst.converge([Want("tgi", "3.0.0")])
    assert st.state == ProvisionState.UNSUPPORTED and "install it by hand" in st.detail
    assert seen[-1] == st


async def test_an_empty_version_leaves_the_engine_to_the_operator():
    inst, _ = make()
    [st] = await inst.converge([Want("vllm", "")])
    assert st.state == ProvisionState.SKIPPED and "named in its configuration" in st.detail


async def test_states_and_progress_are_reported_as_they_change():
    inst, seen = make()
    [st] = await inst.converge([Want("llamacpp", "b1")])
    assert st.state == ProvisionState.READY and st.binary == "/x/llama-server"
    states = [(s.state.value, s.detail, s.bytes_done) for s in seen]
    assert states[0][0] == "installing"
    assert ("installing", "downloading llama-b1.tar.gz", 0) in states
    assert ("installing", "downloading llama-b1.tar.gz", 100) in states  # the last always goes out
    assert states[-1] == ("ready", "llama-server version: 1", None)
    assert inst.statuses["llamacpp"] == st


async def test_one_install_per_engine_at_a_time():
    llama = SlowLlama()
    llama.release.clear()
    inst, _ = make(llama)
    first = asyncio.create_task(inst.ensure(Want("llamacpp", "b1")))
    second = asyncio.create_task(inst.ensure(Want("llamacpp", "b1")))
    await async_until(lambda: llama.running, what="the first install running")
    await asyncio.sleep(0.05)  # a pause in which a second install would start, were it let
    assert llama.running == 1
    llama.release.set()
    a, b = await asyncio.gather(first, second)
    assert a.state == b.state == ProvisionState.READY
    assert llama.most == 1 and llama.installs == 1


async def test_failures_keep_the_agent_running_with_words():
    for error, state in [
        (ProvisionError("it broke"), ProvisionState.FAILED),
        (Unsupported("too old"), ProvisionState.UNSUPPORTED),
        (NotHere("not for this node"), ProvisionState.SKIPPED),
        (ValueError("a bug"), ProvisionState.FAILED),
    ]:
        llama = SlowLlama()
        llama.error = error
        inst, _seen = make(llama)
        [st] = await inst.converge([Want("llamacpp", "b1")])
        assert st.state == state and str(error) in st.detail
        assert st.binary == "" and st.bytes_done is None


async def test_a_broken_listener_does_not_fail_the_install():
    def listener(st):
        raise RuntimeError("listener bug")

    inst = Installer("/x", HOST, on_status=listener, llamacpp=SlowLlama())
    [st] = await inst.converge([Want("llamacpp", "b1")])
    assert st.state == ProvisionState.READY


def test_the_status_matches_the_protocol():
    st = InstallRecord(
        "llamacpp", "b1", ProvisionState.INSTALLING, "downloading x", "cpu", bytes_done=5, bytes_total=None
    )
    wire = st.to_wire()
    assert wire == {
        "engine": "llamacpp",
        "version": "b1",
        "variant": "cpu",
        "state": "installing",
        "detail": "downloading x",
        "progress": {"bytes_done": 5},
    }
    protocol = pytest.importorskip("llmgw.protocol")
    parsed = protocol.ProvisionStatus.model_validate(wire)
    assert parsed.state.value == "installing" and parsed.progress.bytes_total is None
    ready = InstallRecord("vllm", "0.30.0", ProvisionState.SKIPPED, "has none").to_wire()
    assert protocol.ProvisionStatus.model_validate(ready).detail == "has none"
    assert set(INSTALLABLE) == {"llamacpp", "vllm", "sglang"}


def test_progress_is_rate_limited_but_changes_of_words_are_not():
    now = [0.0]
    sent: list[InstallRecord] = []
    r = Reporter(
        InstallRecord("e", "1", ProvisionState.INSTALLING), sent.append, min_interval=1.0, clock=lambda: now[0]
    )
    r.installing("downloading a")
    for done in range(1, 10):
        r.progress(done, 100)  # same instant: only the first goes out
    assert [s.bytes_done for s in sent] == [None, 1]
    now[0] = 2.0
    r.progress(50, 100)
    r.progress(100, 100)
    assert [s.bytes_done for s in sent][-2:] == [50, 100]
    r.installing("unpacking a")
    assert sent[-1].detail == "unpacking a" and sent[-1].bytes_done is None
    r.installing("unpacking a")  # the same again says nothing
    assert sent[-1].detail == "unpacking a" and len([s for s in sent if s.detail == "unpacking a"]) == 1


def test_the_loop_backs_off_after_failure_and_rechecks_every_ten_minutes():
    loop = ConvergeLoop(Installer("/x", HOST, llamacpp=SlowLlama()))
    failed = [InstallRecord("llamacpp", "b1", ProvisionState.FAILED, "x")]
    ok = [InstallRecord("llamacpp", "b1", ProvisionState.READY, "x")]
    assert [loop.next_delay(failed) for _ in range(6)] == [60, 120, 240, 480, 600, 600]
    assert loop.next_delay(ok) == 600
    assert loop.next_delay(failed) == 60


async def test_the_loop_runs_a_pass_when_the_wanted_set_changes():
    llama = SlowLlama()
    inst, _seen = make(llama)
    loop = ConvergeLoop(inst, recheck=0.05)
    task = asyncio.create_task(loop.run())
    try:
        await asyncio.sleep(0.02)  # time passes to show nothing runs while nothing is wanted
        assert loop.passes == 0  # nothing wanted yet
        loop.want([Want("llamacpp", "b1")])
        await async_until(lambda: loop.passes >= 3, what="three passes of the loop")
        assert loop.passes >= 3, "the ten-minute recheck (here 50 ms) did not run"
        assert llama.installs == 1
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


def retry_at(inst: Installer) -> float | None:
    st = inst.statuses.get("llamacpp")
    return st.retry_at if st is not None else None


async def stop(task: asyncio.Task) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_failed_install_says_when_it_is_tried_again_and_an_attempt_under_way_does_not():
    llama = SlowLlama()
    llama.error = ProvisionError("no release for this CPU")
    inst, seen = make(llama)
    loop = ConvergeLoop(inst, retry_first=60, retry_max=600, wall=lambda: 1000.0)
    task = asyncio.create_task(loop.run())
    try:
        loop.want([Want("llamacpp", "b1")])
        await async_until(lambda: retry_at(inst) == 1060.0, what="the first retry scheduled")
        st = inst.statuses["llamacpp"]
        assert st.state == ProvisionState.FAILED and seen[-1] == st  # the listener (the stream) heard it
        wire = ProvisionStatus.model_validate(st.to_wire())
        assert wire.retry_at == 1060.0 and wire.detail == "no release for this CPU"

        # The next attempt (here brought forward by a new want) is under way: no time to come is claimed.
        llama.release.clear()
        loop.want([Want("llamacpp", "b1")])
        await async_until(lambda: llama.running, what="the second attempt running")
        assert inst.statuses["llamacpp"].retry_at is None and "retry_at" not in inst.statuses["llamacpp"].to_wire()
        llama.release.set()
        # It failed again: the backoff doubled, and the time says so.
        await async_until(lambda: retry_at(inst) == 1120.0, what="the backed-off retry")

        llama.error = None
        loop.want([Want("llamacpp", "b1")])
        await async_until(lambda: inst.statuses["llamacpp"].state == ProvisionState.READY, what="the install")
        assert inst.statuses["llamacpp"].retry_at is None and "retry_at" not in seen[-1].to_wire()
    finally:
        await stop(task)


async def test_a_restarted_agent_tries_a_failed_install_at_once_with_the_backoff_started_afresh():
    llama = SlowLlama()
    llama.error = ProvisionError("download refused")
    inst, _ = make(llama)
    # An hour's backoff: were any of it remembered, the new agent's first attempt would wait it out.
    first = ConvergeLoop(inst, retry_first=3600, retry_max=14400, wall=lambda: 0.0)
    task = asyncio.create_task(first.run())
    try:
        for n in (1, 2, 3):
            first.want([Want("llamacpp", "b1")])
            await async_until(lambda n=n: first.passes == n, what=f"pass {n}")
        assert first.next_delay(list(inst.statuses.values())) == 14400  # backed off to its ceiling
    finally:
        await stop(task)

    # The agent starts again: a new installer and loop, as AgentService.run builds them.
    attempts = llama.attempts
    again, _ = make(llama)
    loop = ConvergeLoop(again, retry_first=3600, retry_max=14400, wall=lambda: 0.0)
    task = asyncio.create_task(loop.run())
    try:
        loop.want([Want("llamacpp", "b1")])
        await async_until(lambda: llama.attempts > attempts, timeout=10, what="the new agent's first attempt")
        await async_until(lambda: retry_at(again) is not None, what="its retry scheduled")
        assert again.statuses["llamacpp"].retry_at == 3600.0  # the first step of the backoff, not the ceiling
    finally:
        await stop(task)


def test_the_retry_time_is_an_optional_wire_field_that_older_agents_leave_out():
    old = {"engine": "llamacpp", "version": "b1", "state": "failed", "detail": "it broke"}
    assert ProvisionStatus.model_validate(old).retry_at is None
    assert InstallRecord("llamacpp", "b1", ProvisionState.FAILED, "it broke").to_wire() == old
    new = InstallRecord("llamacpp", "b1", ProvisionState.FAILED, "it broke", retry_at=1700000000.5).to_wire()
    assert new == {**old, "retry_at": 1700000000.5}
    assert ProvisionStatus.model_validate(new).retry_at == 1700000000.5
    # Passed on by the control plane as the agent left it.
    assert ProvisionStatus.model_validate(new).model_dump(mode="json", exclude_none=True) == new
