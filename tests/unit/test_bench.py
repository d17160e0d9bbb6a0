"""The load behind `llmgw ctl bench` (llmgw/bench.py) against the fake engine, whose slots,
time to first token and time per token make a latency target break at a level known
beforehand: with 4 slots and ~200 ms per reply, up to 4 clients are served at once and an
8th waits a whole reply for its first token."""

from __future__ import annotations

import httpx
import pytest

from llmgw.bench import (
    SLO,
    BenchConfig,
    BenchError,
    LoadNames,
    LoadReader,
    normalize_target,
    p99,
    parse_steps,
    run_bench,
)
from llmgw.protocol.prometheus import parse_prometheus
from llmgw.server.gateway.endpoints import ENGINE_METRICS
from llmgw.testing.fake_engine import FakeEngine

ENGINES = {e: LoadNames(n.waiting, n.kv_usage) for e, n in ENGINE_METRICS.items() if n is not None}


def prompts(fe: FakeEngine) -> list[str]:
    return [r.body["messages"][0]["content"] for r in fe.requests if r.path == "/v1/chat/completions"]


class Levels:
    """An observer that remembers what it was told, and may act as a level starts."""

    def __init__(self, on_start=None) -> None:
        self.started: list[tuple[int, int]] = []
        self.done: list[int] = []
        self.progress: dict[int, int] = {}
        self.on_start = on_start

    def level_started(self, concurrency: int, requests: int) -> None:
        self.started.append((concurrency, requests))
        if self.on_start is not None:
            self.on_start(concurrency)

    def request_done(self, concurrency: int, done: int, requests: int) -> None:
        self.progress[concurrency] = done

    def level_done(self, level) -> None:
        self.done.append(level.concurrency)


async def test_the_ramp_stops_at_the_first_level_past_the_ttft_target_and_the_last_that_held_is_the_capacity():
    async with FakeEngine(slots=4, tokens=8, token_ms=25) as fe:
        seen = Levels()
        cfg = BenchConfig(
            model="fake-model",
            target=fe.url,
            slo=SLO(ttft_p99=0.08, tpot_p99=1.0),
            steps=(1, 2, 4, 8, 16),
            requests_per_step=4,
        )
        res = await run_bench(cfg, observer=seen)

    assert [lv.concurrency for lv in res.levels] == [1, 2, 4, 8]  # 16 never ran
    assert [lv.held for lv in res.levels] == [True, True, True, False]
    assert res.concurrency == 4 and res.weight == 4 and res.held is res.levels[2]
    broke = res.broke
    assert broke is not None and broke.ttft_p99 > 0.08 and broke.why.startswith("TTFT p99 ")
    assert "is over the target 80 ms" in broke.why
    # Each level sent its requests (at least two per client), each client back to back.
    assert [lv.requests for lv in res.levels] == [4, 4, 8, 16] and not any(lv.failed for lv in res.levels)
    assert seen.started == [(1, 4), (2, 4), (4, 8), (8, 16)] and seen.done == [1, 2, 4, 8]
    assert seen.progress == {1: 4, 2: 4, 4: 8, 8: 16}
    assert len(prompts(fe)) == 1 + 4 + 4 + 8 + 16  # and one uncounted request before the ramp
    held = res.held
    assert held.tokens_per_s > 0 and held.ttft_p99 <= 0.08 and held.tpot_p99 >= 0.025
    out = res.to_json()
    assert (out["max_concurrency_at_slo"], out["weight"]) == (4, 4)
    assert [lv["held"] for lv in out["levels"]] == [True, True, True, False]


async def test_a_tpot_target_not_even_one_request_meets_is_concurrency_zero_with_no_weight():
    async with FakeEngine(tokens=6, token_ms=20) as fe:
        cfg = BenchConfig(
            model="fake-model", target=fe.url, slo=SLO(ttft_p99=5.0, tpot_p99=0.005), steps=(1, 2), requests_per_step=2
        )
        res = await run_bench(cfg)
    assert [lv.concurrency for lv in res.levels] == [1] and not res.levels[0].held
    assert res.held is None and res.concurrency == 0 and res.weight is None
    assert res.levels[0].why.startswith("TPOT p99 ") and "over the target 5 ms" in res.levels[0].why
    assert res.suggested_waiting is None and res.suggested_kv is None


async def test_a_level_with_a_failed_request_does_not_hold_and_the_level_before_it_stands():
    async with FakeEngine(tokens=4) as fe:
        # The engine refuses one request of the second level, as an overloaded engine would.
        seen = Levels(on_start=lambda c: fe.fail_next(1, status=503) if c == 2 else None)
        cfg = BenchConfig(model="fake-model", target=fe.url, steps=(1, 2, 4), requests_per_step=4)
        res = await run_bench(cfg, observer=seen)
    assert [(lv.concurrency, lv.held, lv.failed) for lv in res.levels] == [(1, True, 0), (2, False, 1)]
    assert res.concurrency == 1
    assert res.levels[1].why.startswith("1 of 4 requests failed (answered 503")


async def test_a_wrong_key_is_said_before_any_level_runs_and_nothing_is_measured():
    async with FakeEngine(api_key="engine-secret") as fe:
        cfg = BenchConfig(model="fake-model", target=fe.url, steps=(1, 2), requests_per_step=2, key="guess")
        with pytest.raises(BenchError, match=r"the first request to http://127\.0\.0\.1:\d+ failed, so nothing was"):
            await run_bench(cfg)
        assert fe.unauthorized == 1  # the one request, not a ramp of them
        right = BenchConfig(model="fake-model", target=fe.url, steps=(1,), requests_per_step=2, key="engine-secret")
        assert (await run_bench(right)).concurrency == 1
        assert all(r.headers.get("Authorization") == "Bearer engine-secret" for r in fe.requests[-3:])


async def test_each_request_gets_a_prompt_of_its_own_from_a_set_of_varied_lengths_unless_same_prompt_is_asked():
    async with FakeEngine(tokens=2) as fe:
        cfg = BenchConfig(model="fake-model", target=fe.url, steps=(1, 4), requests_per_step=12)
        await run_bench(cfg)
        sent = prompts(fe)
        assert len(sent) == 1 + 12 + 12
        # No two share a first line an engine could have cached.
        assert len({p.split(" ", 1)[0] for p in sent}) == len(sent)
        lengths = sorted(len(p) for p in sent)
        assert lengths[0] < 150 and lengths[-1] > 3000, lengths
        body = fe.requests[-1].body
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["max_tokens"] == 128 and body["model"] == "fake-model"

        fe.requests.clear()
        same = BenchConfig(model="fake-model", target=fe.url, steps=(1, 2), requests_per_step=4, same_prompt=True)
        await run_bench(same)
        assert len(prompts(fe)) == 9 and len(set(prompts(fe))) == 1


async def test_time_to_first_token_and_time_per_output_token_are_timed_from_the_stream():
    async with FakeEngine(ttft_ms=60, token_ms=15, tokens=5) as fe:
        cfg = BenchConfig(model="fake-model", target=fe.url, steps=(1,), requests_per_step=3, max_tokens=64)
        (level,) = (await run_bench(cfg)).levels
    assert 0.06 <= level.ttft_p99 < 0.5
    assert 0.015 <= level.tpot_p99 < 0.1
    # 5 tokens a reply, counted from the usage chunk, over the level's time.
    assert level.tokens_per_s == pytest.approx(3 * 5 / level.seconds)


async def test_the_engines_queue_and_cache_use_are_read_from_its_metrics_by_the_series_it_publishes():
    async with httpx.AsyncClient() as client:
        async with FakeEngine(metrics="llamacpp") as fe:
            reader = LoadReader(fe.url + "/metrics", ENGINES, parse_prometheus)
            fe.waiting = 3
            assert await reader.read(client) == (3.0, None)  # llama.cpp publishes no cache use any more
            assert reader.engine == "llamacpp"
        async with FakeEngine(metrics="vllm", kv_capacity_tokens=100) as fe:
            reader = LoadReader(fe.url + "/metrics", ENGINES, parse_prometheus)
            fe.waiting, fe.kv_tokens = 2, 25
            assert await reader.read(client) == (2.0, 0.25)
            assert reader.engine == "vllm"
        async with FakeEngine(api_key="k") as fe:
            reader = LoadReader(fe.url + "/metrics", ENGINES, parse_prometheus)
            assert await reader.read(client) == (None, None)
            assert reader.gone == f"{fe.url}/metrics answered 401"
            assert await reader.read(client) == (None, None) and fe.unauthorized == 1  # left alone after
    with pytest.raises(BenchError, match="--engine should be one of llamacpp, sglang, vllm"):
        LoadReader("http://x/metrics", ENGINES, parse_prometheus, engine="tgi")


async def test_the_heaviest_queue_seen_at_the_level_that_held_is_the_suggested_one():
    async with FakeEngine(slots=1, tokens=10, token_ms=40) as fe:
        cfg = BenchConfig(
            model="fake-model", target=fe.url, slo=SLO(ttft_p99=30.0, tpot_p99=1.0), steps=(3,), requests_per_step=6
        )
        res = await run_bench(cfg, load=LoadReader(fe.url + "/metrics", ENGINES, parse_prometheus))
    # One slot and three clients: two wait behind it for most of the level (about 2.4 s).
    (level,) = res.levels
    assert level.held and level.waiting_max >= 2.0 and res.suggested_waiting >= 2
    assert level.kv_max is None and res.suggested_kv is None


def test_steps_targets_and_percentiles_are_read_as_an_operator_writes_them():
    assert parse_steps("1,2,4,8") == (1, 2, 4, 8) and parse_steps(" 3 ") == (3,)
    for bad in ("4,2", "0,1", "a,b", "", "2,2"):
        with pytest.raises(BenchError, match="--steps"):
            parse_steps(bad)
    assert normalize_target("http://10.0.0.5:20001/") == "http://10.0.0.5:20001"
    assert normalize_target("https://gw.example/v1") == "https://gw.example"
    with pytest.raises(BenchError, match="--target should be an http:// or https:// URL"):
        normalize_target("10.0.0.5:20001")
    assert p99([]) is None and p99([3.0, 1.0, 2.0]) == 3.0
    assert p99([float(i) for i in range(1, 201)]) == 198.0  # nearest rank: the 198th of 200
    with pytest.raises(BenchError, match="--max-tokens"):
        BenchConfig(model="m", target="http://x", max_tokens=1)
