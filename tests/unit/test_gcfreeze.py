"""The collector kept off a growing registry (llmgw.gcfreeze), alone and in the agent service."""

from __future__ import annotations

import gc
import weakref

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from llmgw.gcfreeze import GcFreezer
from llmgw.protocol import PROTOCOL_VERSION, STREAM_PATH, Register, encode
from llmgw.server.control.agents import AgentService
from llmgw.testing.waiting import async_until


@pytest.fixture(autouse=True)
def unfrozen():
    """The collector is the test process's: every test leaves nothing frozen."""
    gc.unfreeze()
    yield
    gc.unfreeze()


class Stream:
    """Stands for a closed stream's objects: alive only through a cycle of its own."""

    def __init__(self) -> None:
        self.me = self


def test_the_heap_is_frozen_each_time_the_registry_grows_a_step_and_not_before():
    f = GcFreezer(first=10, growth=1.0)
    assert not f.grew(9) and gc.get_freeze_count() == 0
    assert f.grew(10) and gc.get_freeze_count() > 0 and f.frozen_size == 10
    # The step is the larger of first and growth times what was frozen: 10 more, then 20 more.
    assert not f.grew(19)
    assert f.grew(20) and f.frozen_size == 20
    assert not f.grew(39)
    assert f.grew(40) and (f.frozen_size, f.freezes) == (40, 3)


async def test_a_cycle_frozen_outlives_full_collections_until_a_steps_worth_released_thaws_it():
    kept = Stream()
    dropped = Stream()
    gone = weakref.ref(dropped)
    f = GcFreezer(first=2, settle=0)
    await f.start()
    try:
        f.grew(2)
        del dropped
        gc.collect()
        assert gone() is not None, "a frozen cycle is out of the collector's sight"
        assert not f.released() and not f.due  # one of the step's two: no thaw is asked for
        assert gone() is not None and f.thaws == 0
        assert f.released()
        await async_until(lambda: gone() is None, what="the thaw to collect the cycle left behind")
        assert f.thaws == 1
        # What is alive is frozen again, and the count starts over.
        assert gc.get_freeze_count() > 0 and f.released_since == 0
        assert kept.me is kept
    finally:
        await f.close()


def test_nothing_is_thawed_while_nothing_was_frozen():
    f = GcFreezer(first=5)
    assert not f.released() and f.released_since == 0
    f.thaw()
    assert (f.thaws, gc.get_freeze_count()) == (0, 0)


def test_the_periodic_check_thaws_only_once_something_was_let_go_and_frees_what_it_left():
    f = GcFreezer(first=5)
    dropped = Stream()
    gone = weakref.ref(dropped)
    f.grew(5)
    del dropped
    assert not f.periodic() and f.thaws == 0 and gone() is not None  # nothing let go: no pause
    assert not f.released() and not f.due  # one, below the step of five
    assert f.periodic() and f.thaws == 1 and f.released_since == 0
    assert gone() is None


async def test_the_thaw_loop_runs_the_periodic_check_every_interval():
    f = GcFreezer(first=5, thaw_interval=0.05)
    dropped = Stream()
    gone = weakref.ref(dropped)
    f.grew(5)
    del dropped
    f.released()  # below the step: only the periodic check thaws
    await f.start()
    try:
        await async_until(lambda: gone() is None, what="the periodic thaw to collect the frozen cycle")
        assert f.thaws >= 1 and f.released_since == 0
    finally:
        await f.close()


@pytest.mark.parametrize(
    "kw, words",
    [
        ({"first": 0}, "first must be at least 1"),
        ({"growth": -1}, "growth"),
        ({"thaw_interval": 0}, "thaw_interval"),
        ({"settle": -1}, "settle"),
    ],
)
def test_bad_settings_are_refused_naming_the_setting(kw, words):
    with pytest.raises(ValueError, match=words):
        GcFreezer(**kw)


async def test_the_agent_service_freezes_as_agents_register_and_thaws_once_their_streams_close():
    freezer = GcFreezer(first=2, settle=0.5)
    svc = AgentService(freezer=freezer)
    app = web.Application()
    svc.add_routes(app)
    server = TestServer(app)
    await server.start_server()
    http = aiohttp.ClientSession()
    try:
        streams = []
        for node in ("n1", "n2"):
            ws = await http.ws_connect(server.make_url(STREAM_PATH))
            await ws.send_bytes(encode(Register(node_id=node, protocol_version=PROTOCOL_VERSION, agent_version="t")))
            streams.append(ws)
        await async_until(lambda: svc.is_connected("n1") and svc.is_connected("n2"))
        assert freezer.freezes == 1 and freezer.frozen_size == 2
        # The server's side of a stream is held by cycles of aiohttp's: frozen, only a thaw frees it.
        server_side = [weakref.ref(svc._conns[n].ws) for n in ("n1", "n2")]
        await streams[0].close()
        await async_until(lambda: not svc.is_connected("n1"))
        assert freezer.thaws == 0 and freezer.released_since == 1
        await streams[1].close()
        await async_until(lambda: freezer.thaws == 1, what="a thaw once both streams closed")
        await async_until(
            lambda: all(ref() is None for ref in server_side), what="the closed streams collected by the thaw"
        )
    finally:
        await http.close()
        await server.close()
