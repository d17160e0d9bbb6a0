import time

from llmgw.server.gateway.endpoints import Endpoint, EndpointSet, parse_prometheus

VLLM = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:num_requests_waiting_by_reason{reason="capacity"} 9
vllm:e2e_request_latency_seconds_bucket{le="0.3",model_name="m"} 7.0
"""


def test_parse_sums_label_sets_and_ignores_others():
    v = parse_prometheus(VLLM, {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"})
    assert v == {"vllm:num_requests_running": 4.0, "vllm:num_requests_waiting": 2.0, "vllm:kv_cache_usage_perc": 0.5}


def test_parse_handles_no_labels_nan_and_timestamps():
    text = 'a 1\nb{x="a b"} 2 1700000000\nc NaN\n#a 7\n garbage\n'
    assert parse_prometheus(text, {"a", "b", "c"}) == {"a": 1.0, "b": 2.0}


def test_llamacpp_names_apply(tmp_path):
    ep = Endpoint("m", "http://x", "llamacpp", None)
    ep.apply_scrape(
        "llamacpp:requests_processing 2\nllamacpp:requests_deferred 5\nllamacpp:kv_cache_usage_ratio 0.25\n",
        time.monotonic(),
    )
    assert (ep.running, ep.waiting, ep.kv_usage) == (2.0, 5.0, 0.25)


def test_vllm_old_kv_name_and_percent_scale():
    ep = Endpoint("m", "http://x", "vllm", None)
    ep.apply_scrape("vllm:gpu_cache_usage_perc 40\n", time.monotonic())
    assert ep.kv_usage == 0.4


def test_openai_engine_has_no_metrics():
    ep = Endpoint("m", "http://x", "openai", None)
    ep.apply_scrape("vllm:num_requests_running 9\n", time.monotonic())
    assert ep.running is None
    assert not ep.metrics_stale(time.monotonic(), 5.0)


def _ready(*eps):
    for e in eps:
        e.healthy = True
    return EndpointSet(list(eps), 1.0, 5.0, 1.0)


def test_choose_least_loaded_uses_inflight_and_scrape():
    a, b = Endpoint("m", "http://a", "vllm", None), Endpoint("m", "http://b", "vllm", None)
    s = _ready(a, b)
    a.inflight = 3
    assert s.choose("m") is b
    now = time.monotonic()
    b.apply_scrape("vllm:num_requests_running 2\nvllm:num_requests_waiting 4\n", now)
    assert s.choose("m") is a  # b has 6 ahead as its engine says
    b.scraped_at = now - 60  # stale numbers are not trusted
    assert s.choose("m") is b


def test_choose_spreads_ties():
    eps = [Endpoint("m", f"http://{i}", "vllm", None) for i in range(3)]
    s = _ready(*eps)
    seen = {s.choose("m").url for _ in range(200)}
    assert len(seen) == 3


def test_choose_skips_excluded_unhealthy_and_other_models():
    a, b, c = (
        Endpoint("m", "http://a", "vllm", None),
        Endpoint("m", "http://b", "vllm", None),
        Endpoint("n", "http://c", "vllm", None),
    )
    s = _ready(a, b, c)
    b.healthy = False
    assert s.choose("m", (a,)) is None
    assert s.choose("m") is a
    assert s.choose("nope") is None


def test_breaker_opens_half_opens_and_closes():
    a = Endpoint("m", "http://a", "vllm", None, breaker_failures=2, breaker_cooldown=0.05)
    s = _ready(a)
    a.record_failure("x")
    assert s.choose("m") is a  # one failure is not enough
    a.record_failure("x")
    assert a.breaker_open and s.choose("m") is None
    time.sleep(0.06)  # the cooldown itself is under test: let it pass
    assert s.choose("m") is a  # half-open: one trial
    assert s.choose("m") is None  # ...and only one at a time
    a.record_failure("trial failed")
    assert s.choose("m") is None
    assert a.cooldown == 0.1  # a failed trial doubles the wait
    time.sleep(0.11)  # the doubled cooldown passes
    assert s.choose("m") is a
    a.record_success()
    assert not a.breaker_open and s.choose("m") is a and s.choose("m") is a


FIXTURES = __import__("pathlib").Path(__file__).resolve().parents[1] / "fixtures" / "metrics"


def test_captured_llamacpp_metrics():
    ep = Endpoint("m", "http://x", "llamacpp", None)
    ep.apply_scrape((FIXTURES / "llamacpp.txt").read_text(), time.monotonic())
    assert ep.running == 0.0 and ep.waiting == 0.0
    # This llama.cpp build no longer publishes KV-cache use: absent, not zero.
    assert ep.kv_usage is None


def test_vllm_metrics_fixture():
    ep = Endpoint("m", "http://x", "vllm", None)
    ep.apply_scrape((FIXTURES / "vllm.txt").read_text(), time.monotonic())
    assert ep.running is not None and ep.waiting is not None
    assert ep.kv_usage is not None and 0.0 <= ep.kv_usage <= 1.0
