import asyncio
import hashlib
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import pytest

from llmgw.server.gateway.auth import AuthError, KeyCache
from llmgw.server.gateway.usage import UsageRecorder
from llmgw.store import UsageRow
from llmgw.testing.waiting import async_until


def _h(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class Source:
    def __init__(self):
        self.generation = 1
        self.active = []
        self.revoked = []
        self.fail = False
        self.loads = 0

    async def keys_generation(self):
        if self.fail:
            raise ConnectionError("store is down")
        return self.generation

    async def active_keys(self):
        self.loads += 1
        return self.active

    async def revoked_key_hashes(self):
        return self.revoked


def _key(secret, kid="key-1", expires=None):
    return SimpleNamespace(hash=_h(secret), id=kid, prefix=secret[:14], project="p", expires_at=expires)


async def test_the_key_cache_accepts_good_bearer_keys_and_names_each_kind_of_refusal():
    src = Source()
    past = datetime.now(UTC) - timedelta(minutes=1)
    src.active = [_key("llmgw-good"), _key("llmgw-old", "key-2", expires=past)]
    src.revoked = [(_h("llmgw-gone"), datetime(2026, 1, 2, 3, 4, tzinfo=UTC))]
    cache = KeyCache(src)
    await cache.load()
    assert cache.authenticate("Bearer llmgw-good").key_id == "key-1"
    assert cache.authenticate("bearer  llmgw-good").project == "p"
    for header, code in [
        (None, "missing_api_key"),
        ("", "missing_api_key"),
        ("Basic abc", "invalid_api_key"),
        ("Bearer ", "invalid_api_key"),
        ("Bearer llmgw-nope", "invalid_api_key"),
        ("Bearer llmgw-gone", "revoked_api_key"),
        ("Bearer llmgw-old", "expired_api_key"),
    ]:
        with pytest.raises(AuthError) as ei:
            cache.authenticate(header)
        assert ei.value.code == code, header
    with pytest.raises(AuthError, match="revoked on 2026-01-02 03:04 UTC"):
        cache.authenticate("Bearer llmgw-gone")


async def test_reload_only_on_generation_change_and_survives_store_outage():
    src = Source()
    src.active = [_key("llmgw-a")]
    cache = KeyCache(src, poll_interval=0.02)
    await cache.load()
    cache.start()
    try:
        await asyncio.sleep(0.1)  # several polls pass, to show they reload nothing
        assert src.loads == 1  # nothing changed: nothing reloaded
        src.active = [_key("llmgw-b")]
        src.generation = 2
        await async_until(lambda: src.loads >= 2, what="a reload after the generation changed")
        assert src.loads == 2
        with pytest.raises(AuthError):
            cache.authenticate("Bearer llmgw-a")
        src.fail = True
        await async_until(lambda: cache.reload_failures > 0, what="a failed reload counted")
        assert cache.reload_failures > 0
        assert cache.authenticate("Bearer llmgw-b").key_id == "key-1"  # still serving from memory
    finally:
        await cache.stop()


async def test_a_key_made_after_the_last_poll_is_looked_up_in_the_store_before_it_is_refused():
    src = Source()
    src.active = [_key("llmgw-a")]
    cache = KeyCache(src, poll_interval=3600)  # no poll comes: only the lookup on a miss can find the key
    await cache.load()
    src.active = [_key("llmgw-a"), _key("llmgw-new", "key-2")]
    src.generation = 2
    assert (await cache.authenticate_current("Bearer llmgw-new")).key_id == "key-2"
    assert src.loads == 2
    # Unknown keys at once share one generation check, and reload nothing when nothing changed.
    calls = 0
    real = src.keys_generation

    async def counted():
        nonlocal calls
        calls += 1
        return await real()

    src.keys_generation = counted
    results = await asyncio.gather(
        *(cache.authenticate_current(f"Bearer llmgw-bad{i}") for i in range(50)), return_exceptions=True
    )
    assert all(isinstance(r, AuthError) and r.code == "invalid_api_key" for r in results)
    assert calls == 1 and src.loads == 2
    # A malformed header is refused without asking the store.
    with pytest.raises(AuthError, match="Bearer <key>"):
        await cache.authenticate_current("Basic abc")
    assert calls == 1


def _row(i=0):
    return UsageRow(model="m", endpoint="http://e", status=200, latency_ms=1.0, key_id=f"k{i}")


class Sink:
    def __init__(self):
        self.batches = []
        self.fail = 0

    async def insert_usage(self, rows):
        if self.fail:
            self.fail -= 1
            raise ConnectionError("down")
        self.batches.append(list(rows))


async def test_usage_batches_and_retries_after_failure():
    sink = Sink()
    rec = UsageRecorder(sink, flush_interval=10, batch_size=3, queue_limit=100)
    for i in range(7):
        rec.record(_row(i))
    sink.fail = 1
    await rec.flush()
    assert rec.pending == 7 and rec.failures == 1 and sink.batches == []
    await rec.flush()
    assert [len(b) for b in sink.batches] == [3, 3, 1]
    assert [r.key_id for b in sink.batches for r in b] == [f"k{i}" for i in range(7)]  # order kept
    assert rec.pending == 0 and rec.written == 7


async def test_usage_queue_is_bounded():
    rec = UsageRecorder(Sink(), queue_limit=100)
    for i in range(150):
        rec.record(_row(i))
    assert rec.pending == 100 and rec.dropped == 50


async def test_stopping_the_usage_recorder_writes_what_is_still_pending():
    sink = Sink()
    rec = UsageRecorder(sink, flush_interval=3600)
    rec.start()
    rec.record(_row())
    await rec.stop()
    assert len(sink.batches) == 1
