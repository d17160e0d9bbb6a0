"""`llmgw server` in its own process in front of a real llama-server: streams the client cuts are
charged what the engine generated (llama-server's own counter is the truth)."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest
from harness import Gateway, wait_until
from test_gateway_e2e import _usage_rows as _rows

from llmgw.protocol.prometheus import parse_prometheus

pytestmark = pytest.mark.e2e

TOKENS = 400  # a stream: the tiny model never stops early, so it runs to max_tokens
CUT_AT = 396  # 99%


def _gauge(engine_url: str, name: str) -> float:
    return parse_prometheus(httpx.get(engine_url + "/metrics", timeout=10).text, {name})[name]


def _predicted(engine_url: str) -> float:
    return _gauge(engine_url, "llamacpp:tokens_predicted_total")


def test_50_streams_cut_at_99_percent_are_charged_what_llama_server_generated(engines, tmp_path):
    (engine,) = engines("tiny", n=1)
    gw = Gateway(
        tmp_path,
        models=[{"name": "tiny", "endpoints": [{"url": engine.url, "engine": "llamacpp"}]}],
        auth={"pricing": {"tiny": {"prompt_per_1k": 1.0, "completion_per_1k": 2.0}}},
    ).wait_up()
    try:
        made = gw.keys("create", "--name", "cut")
        assert made.returncode == 0, made.stderr
        secret = made.stdout.strip().splitlines()[-1]
        key_id = re.search(r"^id (key-\S+)$", made.stderr, re.MULTILINE).group(1)
        cap = 10**8
        limited = gw.keys("limits", "--scope", "key", "--id", key_id, "--tpm", str(cap), "--budget", "1000")
        assert limited.returncode == 0, limited.stderr
        auth = {"Authorization": f"Bearer {secret}"}

        def limited_probe() -> httpx.Response | None:
            if httpx.get(gw.url + "/v1/models", headers=auth).status_code != 200:
                return None
            r = httpx.post(
                gw.url + "/v1/chat/completions",
                headers=auth,
                timeout=30,
                json={"model": "tiny", "messages": [{"role": "user", "content": "probe"}], "max_tokens": 1},
            )
            return r if "x-ratelimit-limit-tokens" in r.headers else None

        probe = wait_until(limited_probe, 5, "the key's limits to be loaded", [gw])
        before = _predicted(engine.url)
        n_rows_before = len(_rows(gw.store))

        async def cut(http: httpx.AsyncClient, i: int) -> int:
            got = 0
            body = {
                "model": "tiny",
                "messages": [{"role": "user", "content": f"tell me about {i}"}],
                "max_tokens": TOKENS,
                "stream": True,
            }
            async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if '"content":"' in line:
                        got += 1
                        if got == CUT_AT:
                            break  # leaving the block drops the connection
            return got

        async def run() -> list[int]:
            async with httpx.AsyncClient(base_url=gw.url, headers=auth, timeout=120) as http:
                return await asyncio.gather(*(cut(http, i) for i in range(50)))

        received = asyncio.run(run())
        assert min(received) >= CUT_AT * 0.95, received  # a token may be two in one event (UTF-8)

        def all_rows():
            rows = _rows(gw.store)
            return rows if len(rows) >= n_rows_before + 50 else None

        rows = wait_until(all_rows, 10, "the usage rows of the 50 streams", [gw])
        # The engine has noticed every dropped connection once it runs nothing: its count is final.
        wait_until(
            lambda: _gauge(engine.url, "llamacpp:requests_processing") == 0,
            10,
            "the engine to stop generating for the cut streams",
            [gw, engine],
        )
        generated = _predicted(engine.url) - before
        streams = [r for r in rows if r.stream]
        assert len(streams) == 50
        charged = sum(r.completion_tokens for r in streams)
        cut_short = sum(1 for r in streams if r.status == 499)
        print(
            f"charged {charged} completion tokens for {generated:.0f} generated; "
            f"{cut_short} of 50 streams cut before the engine's usage event"
        )
        assert abs(charged - generated) <= 0.1 * generated, (charged, generated)
        assert all(r.prompt_tokens > 0 and r.completion_tokens > 0 and r.cost_micros > 0 for r in streams)
        # The token pool holds what the rows say (the probe's own tokens aside).
        after = httpx.post(
            gw.url + "/v1/chat/completions",
            headers=auth,
            timeout=30,
            json={"model": "tiny", "messages": [{"role": "user", "content": "probe"}], "max_tokens": 1},
        )
        pool_charged = cap - int(after.headers["x-ratelimit-remaining-tokens"])
        own = after.json()["usage"]["total_tokens"] + probe.json()["usage"]["total_tokens"]
        in_rows = sum(r.prompt_tokens + r.completion_tokens for r in streams)
        assert abs(pool_charged - own - in_rows) <= 0.01 * in_rows, (pool_charged, own, in_rows)
    finally:
        assert gw.stop() == 0, gw.text()
