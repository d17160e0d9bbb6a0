import time

import pytest

from llmgw.config import ConfigError, parse_server_config
from llmgw.config.server import ServerConfig
from llmgw.server.gateway.endpoints import Endpoint, EndpointSet
from llmgw.server.gateway.routing import (
    PrefixLRU,
    Router,
    RouterCollector,
    block_hashes,
    prompt_text,
)

SYSTEM_A = "You are a careful assistant for the Acme support desk. " * 40  # ~2.2 KB
SYSTEM_B = "You translate legal contracts from German into plain English. " * 40


def _chat(system, *turns):
    msgs = [{"role": "system", "content": system}]
    for i, t in enumerate(turns):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": t})
    return {"model": "m", "messages": msgs}


def _blocks(body, n=256):
    return block_hashes(prompt_text("chat", body), n)


def _set(*eps, strategy="prefix", factor=1.25):
    for e in eps:
        e.healthy = True
    s = EndpointSet(list(eps), 1.0, 5.0, 1.0)
    s.router.configure(strategy, factor, 256, 4096)
    return s


def _eps(n):
    return [Endpoint("m", f"http://e{i}", "openai", None) for i in range(n)]


# -- block hashing --------------------------------------------------------


def test_shared_system_prompt_shares_leading_blocks():
    a = _blocks(_chat(SYSTEM_A, "How do I reset my password?"))
    b = _blocks(_chat(SYSTEM_A, "Where is my parcel? " * 30))
    full = len(prompt_text("chat", {"messages": [{"role": "system", "content": SYSTEM_A}]})) // 256
    assert full >= 8
    assert a[:full] == b[:full]
    assert a[full:] != b[full:]


def test_different_prompts_share_nothing():
    a = _blocks(_chat(SYSTEM_A, "hi"))
    b = _blocks(_chat(SYSTEM_B, "hi"))
    assert a and b and not set(a) & set(b)


def test_chained_hash_covers_everything_before():
    # Same 2nd block text, different 1st block: the 2nd hashes differ too.
    x = "a" * 256 + "z" * 256
    y = "b" * 256 + "z" * 256
    assert block_hashes(x)[1] != block_hashes(y)[1]


def test_next_turn_extends_previous_turn():
    t1 = _chat(SYSTEM_A, "first question " * 20)
    t2 = _chat(SYSTEM_A, "first question " * 20, "an answer " * 20, "second question")
    b1, b2 = _blocks(t1), _blocks(t2)
    assert b2[: len(b1)] == b1


def test_only_whole_blocks_and_short_prompts():
    assert block_hashes("x" * 255) == ()
    assert len(block_hashes("x" * 767)) == 2


def test_prompt_text_shapes():
    parts = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "he"}, {"type": "text", "text": "llo"}]}]
    }
    plain = {"messages": [{"role": "user", "content": "hello"}]}
    assert prompt_text("chat", parts) == prompt_text("chat", plain)
    # The role is part of the text: the same words from another role are another prompt.
    assert prompt_text("chat", plain) != prompt_text("chat", {"messages": [{"role": "system", "content": "hello"}]})
    assert prompt_text("completions", {"prompt": "abc"}) == "abc"
    assert prompt_text("completions", {"prompt": ["abc", "def"]}) == "abc"
    assert prompt_text("completions", {"prompt": [1, 2, 3]}) == ""
    assert prompt_text("embeddings", {"input": "abc"}) == ""
    assert prompt_text("chat", {"messages": "nope"}) == ""


# -- the LRU ----------------------------------------------------------------


def test_lru_is_bounded_and_keeps_prefixes():
    lru = PrefixLRU(capacity=100)
    for k in range(50):
        lru.record(block_hashes(f"{k:04d}" * 64 * 10))  # 10 blocks each
        assert len(lru) <= 100
    assert len(lru) == 100
    last = block_hashes(f"{49:04d}" * 64 * 10)
    assert lru.match(last) == 10
    assert lru.match(block_hashes(f"{0:04d}" * 64 * 10)) == 0


def test_lru_evicts_deep_blocks_first():
    lru = PrefixLRU(capacity=12)
    shared = "S" * 256 * 4
    first = block_hashes(shared + "a" * 256 * 6)
    lru.record(first)
    lru.record(block_hashes("x" * 256 * 4))  # 14 blocks recorded: 2 evicted
    # What was evicted are the deep ends of the first prompt, not its beginning.
    assert lru.match(first) == 8
    lru.record(block_hashes(shared + "b" * 256 * 2))
    assert lru.match(first) >= 4


def test_lru_match_counts_leading_blocks_only():
    lru = PrefixLRU()
    b = block_hashes("q" * 256 * 5)
    lru.record(b[1:])
    assert lru.match(b) == 0


# -- the choice --------------------------------------------------------------


def test_prefix_goes_back_to_the_same_endpoint():
    eps = _eps(3)
    s = _set(*eps)
    first = _blocks(_chat(SYSTEM_A, "q1"))
    chosen = s.choose("m", (), first)
    for k in range(20):
        assert s.choose("m", (), _blocks(_chat(SYSTEM_A, f"question {k} " * 5))) is chosen
    assert s.router.stats.prefix_hits["m"] == 20


def test_prefix_preferred_within_load_factor():
    a, b, c = _eps(3)
    s = _set(a, b, c)
    blocks = _blocks(_chat(SYSTEM_A, "hello"))
    a.prefixes = None
    s.choose("m", (), blocks)  # records on someone
    holder = next(e for e in (a, b, c) if e.prefixes is not None and e.prefixes.match(blocks))
    others = [e for e in (a, b, c) if e is not holder]
    # Least load 3 elsewhere; the holder at 5 is within (3 + 1) * 1.25 = 5.
    for e in others:
        e.inflight = 3
    holder.inflight = 5
    assert s.choose("m", (), blocks) is holder
    # At 6 it is not: the least loaded wins.
    holder.inflight = 6
    got = s.choose("m", (), blocks)
    assert got in others


def test_prefix_idle_pool_tolerates_one_request():
    a, b = _eps(2)
    s = _set(a, b)
    blocks = _blocks(_chat(SYSTEM_B, "x"))
    holder = s.choose("m", (), blocks)
    other = b if holder is a else a
    holder.inflight = 1  # (0 + 1) * 1.25 = 1.25: still preferred
    assert s.choose("m", (), blocks) is holder
    holder.inflight = 2
    assert s.choose("m", (), blocks) is other


def test_longest_match_wins_then_least_loaded():
    a, b, c = _eps(3)
    s = _set(a, b, c)
    short = _blocks(_chat(SYSTEM_A, "q"))
    long_ = _blocks(_chat(SYSTEM_A, "q" + "z" * 2000))
    for e in (a, b, c):
        e.prefixes = None
    from llmgw.server.gateway.routing import PrefixLRU as L

    a.prefixes, b.prefixes = L(), L()
    a.prefixes.record(short)
    b.prefixes.record(long_)
    assert s.choose("m", (), long_) is b
    # Equal matches: the less loaded one.
    c.prefixes = L()
    c.prefixes.record(long_)
    b.inflight = 1
    assert s.choose("m", (), long_) is c


def test_no_match_is_least_loaded_and_spreads():
    eps = _eps(3)
    s = _set(*eps)
    eps[0].inflight = 2
    seen = set()
    for k in range(60):
        seen.add(s.choose("m", (), _blocks(_chat(f"{k} unique system prompt " * 40, "q"))).url)
    # Nothing shared: new prompts go by load; the idle two are never both starved.
    assert seen == {"http://e1", "http://e2"}


def test_prefix_respects_exclude_and_breaker():
    a, b = _eps(2)
    s = _set(a, b)
    blocks = _blocks(_chat(SYSTEM_A, "q"))
    holder = s.choose("m", (), blocks)
    other = b if holder is a else a
    assert s.choose("m", (holder,), blocks) is other
    for _ in range(3):
        holder.record_failure("boom")
    assert holder.breaker_open
    assert s.choose("m", (), blocks) is other
    holder.healthy = False
    holder.failures = 0
    assert s.choose("m", (), blocks) is other
    assert s.choose("m", (other,), blocks) is None


def test_half_open_trial_still_single_with_prefix():
    a, b = _eps(2)
    s = _set(a, b)
    b.healthy = False
    blocks = _blocks(_chat(SYSTEM_A, "q"))
    for _ in range(3):
        a.record_failure("x")
    a.open_until = time.monotonic() - 1
    assert s.choose("m", (), blocks) is a
    assert s.choose("m", (), blocks) is None


def test_round_robin_order_and_exclude():
    eps = _eps(3)
    s = _set(*eps, strategy="round_robin")
    eps[0].inflight = 10  # load does not matter
    got = [s.choose("m").url for _ in range(6)]
    assert got == ["http://e0", "http://e1", "http://e2"] * 2
    assert s.choose("m", (eps[0], eps[1])) is eps[2]
    eps[1].healthy = False
    assert {s.choose("m").url for _ in range(4)} == {"http://e0", "http://e2"}


def test_round_robin_is_per_model():
    a = Endpoint("m", "http://a", "openai", None)
    b = Endpoint("m", "http://b", "openai", None)
    c = Endpoint("n", "http://c", "openai", None)
    d = Endpoint("n", "http://d", "openai", None)
    s = _set(a, b, c, d, strategy="round_robin")
    assert s.choose("m") is a
    assert s.choose("n") is c
    assert s.choose("m") is b
    assert s.choose("n") is d


def test_least_loaded_ignores_prefix():
    a, b = _eps(2)
    s = _set(a, b, strategy="least_loaded")
    blocks = _blocks(_chat(SYSTEM_A, "q"))
    assert s.router.blocks_for("m", "chat", _chat(SYSTEM_A, "q")) == ()
    first = s.choose("m", (), blocks)
    first.inflight = 1
    assert s.choose("m", (), blocks) is not first


def test_per_model_override():
    r = Router("least_loaded")
    r.set_model_strategies({"m": "prefix", "n": None})
    assert r.strategy("m") == "prefix" and r.strategy("n") == "least_loaded"
    assert r.blocks_for("m", "chat", _chat(SYSTEM_A, "q"))
    assert r.blocks_for("n", "chat", _chat(SYSTEM_A, "q")) == ()
    with pytest.raises(ValueError, match="least_loaded, prefix, round_robin"):
        r.configure("random", 1.25, 256, 100)


def test_collector_reports_counts():
    eps = _eps(2)
    s = _set(*eps)
    for _ in range(3):
        s.choose("m", (), _blocks(_chat(SYSTEM_A, "q")))
    fams = {f.name: f for f in RouterCollector(s.router).collect()}
    hits = fams["llmgw_router_prefix_hits"].samples
    assert [(x.labels, x.value) for x in hits if x.name.endswith("_total")] == [({"model": "m"}, 2)]


# -- configuration -----------------------------------------------------------


def _err(data):
    with pytest.raises(ConfigError) as exc:
        parse_server_config(data, "server.yaml")
    return str(exc.value)


def test_config_defaults_and_override():
    cfg = ServerConfig.model_validate(
        {
            "models": [
                {"name": "a", "endpoints": [{"url": "http://x:1", "engine": "vllm"}], "routing": "round_robin"},
                {"name": "b", "endpoints": [{"url": "http://x:2", "engine": "vllm"}]},
            ]
        }
    )
    assert cfg.router.routing == "prefix" and cfg.router.session_load_factor == 1.25
    assert cfg.models[0].routing == "round_robin" and cfg.models[1].routing is None


def test_unknown_strategy_refused_with_allowed_values():
    msg = _err({"router": {"routing": "random"}})
    assert "router.routing:" in msg
    for v in ("least_loaded", "prefix", "round_robin"):
        assert v in msg
    msg = _err({"models": [{"name": "a", "endpoints": [{"url": "http://x:1", "engine": "vllm"}], "routing": "sticky"}]})
    assert "models[0].routing:" in msg and "least_loaded" in msg
    msg = _err({"router": {"session_load_factor": 0.5}})
    assert "router.session_load_factor:" in msg
