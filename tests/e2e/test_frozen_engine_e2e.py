"""A frozen engine (SIGSTOP: it accepts connections and sends nothing) does not hold requests:
after timeouts.first_byte they go to the other replica, and its breaker counts the failure."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from llmgw.protocol.prometheus import parse_prometheus
from llmgw.testing.waiting import async_until
from tests.e2e.harness import Gateway, free_port, wait_http

pytestmark = pytest.mark.e2e

FIRST_BYTE = 3.0
BUSY = "llamacpp:requests_processing"


def _engine(port: int, log) -> subprocess.Popen:
    # A slow-ish answer, so requests are still in flight on the engine when it is stopped.
    return subprocess.Popen(
        [sys.executable, "-m", "llmgw.testing.fake_engine", "--port", str(port), "--ttft-ms", "300", "--tokens", "4"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def test_requests_on_a_stopped_engine_are_answered_by_the_other_replica_within_the_first_byte_timeout(tmp_path):
    ports = [free_port(), free_port()]
    engines = []
    for p in ports:
        # The engine holds its own copy of the descriptor; ours can close once it is started.
        with open(tmp_path / f"engine-{p}.log", "w") as log:
            engines.append(_engine(p, log))
    gw = None
    try:
        for p, e in zip(ports, engines, strict=True):
            wait_http(f"http://127.0.0.1:{p}/health", e, 30)
        gw = Gateway(
            tmp_path,
            models=[
                {
                    "name": "m",
                    "routing": "round_robin",
                    "endpoints": [{"url": f"http://127.0.0.1:{p}", "engine": "llamacpp"} for p in ports],
                }
            ],
            timeouts={"first_byte": f"{FIRST_BYTE}s"},
            router={"scrape_interval": "250ms", "retries": 2, "breaker": {"failures": 1, "cooldown": "60s"}},
        ).wait_up()
        key = gw.create_key()

        async def burst() -> list[tuple[int, float, str]]:
            async with httpx.AsyncClient(
                base_url=gw.url, timeout=60, headers={"Authorization": f"Bearer {key}"}
            ) as http:

                async def one(i: int) -> tuple[int, float, str]:
                    t0 = time.monotonic()
                    body = {"model": "m", "messages": [{"role": "user", "content": f"hi {i}"}], "stream": i % 2 == 0}
                    r = await http.post("/v1/chat/completions", json=body)
                    return r.status_code, time.monotonic() - t0, r.text

                tasks = [asyncio.create_task(one(i)) for i in range(8)]
                # Stop the engine once requests are inside it, waiting for their first byte.
                async with httpx.AsyncClient() as probe:

                    async def busy() -> bool:
                        text = (await probe.get(f"http://127.0.0.1:{ports[0]}/metrics")).text
                        return parse_prometheus(text, {BUSY}).get(BUSY, 0.0) >= 1

                    await async_until(busy, 10, "a request to reach the first engine")
                os.kill(engines[0].pid, signal.SIGSTOP)
                return await asyncio.gather(*tasks)

        results = asyncio.run(burst())
        assert all(status == 200 for status, _, _ in results), results
        # Nobody waited for timeouts.generation (600 s): at most the first-byte timeout, a
        # probe round and the answer from the other replica.
        assert max(t for _, t, _ in results) < FIRST_BYTE + 5, results
        status = {
            s["url"]: s for s in httpx.get(gw.admin + "/api/v1/endpoints", headers=gw.admin_auth).json()["endpoints"]
        }
        frozen = status[f"http://127.0.0.1:{ports[0]}"]
        assert frozen["consecutive_failures"] >= 1 and not frozen["available"], frozen
        assert "sent nothing" in gw.text()
    finally:
        os.kill(engines[0].pid, signal.SIGCONT)
        if gw is not None:
            gw.stop()
        for e in engines:
            e.terminate()
            e.wait(10)
