"""Converging on the wanted engines: states, reports, one install per engine, the timer."""

from __future__ import annotations

import asyncio

import pytest

from llmgw.agent.provision.host import HostFacts
from llmgw.agent.provision.manager import INSTALLABLE, ConvergeLoop, Installer, Want
from llmgw.agent.provision.status import InstallRecord, NotHere, ProvisionError, Reporter, Unsupported
from llmgw.protocol import ProvisionState
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

    async def ensure(self, version, reporter, *, base_url=None):
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
