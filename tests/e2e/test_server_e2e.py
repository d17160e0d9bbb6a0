"""`llmgw server` start-up: the shipped example, refusals of bad files, PostgreSQL as the store, clean stop."""

from __future__ import annotations

import asyncio
import shutil
import subprocess

import httpx
import openai
import pytest
from harness import REPO, Gateway, Proc, llmgw_cmd, wait_http

from llmgw.testing.waiting import until

pytestmark = pytest.mark.e2e


def test_shipped_example_starts(tmp_path):
    # As shipped: its own ports, and its store (./llmgw.db) beside the working directory.
    shutil.copy(REPO / "examples" / "server.yaml", tmp_path / "server.yaml")
    p = Proc(llmgw_cmd("server", "--config", "server.yaml"), tmp_path / "log.txt", cwd=tmp_path)
    try:
        wait_http("http://127.0.0.1:8080/health", p.proc, 30, p.log)
        # The admin listener wants the admin token the first start made beside the store.
        wait_http("http://127.0.0.1:9090/metrics", p.proc, 5, p.log, status=401)
        token = (tmp_path / "admin-token").read_text().strip()
        assert (
            httpx.get("http://127.0.0.1:9090/metrics", headers={"Authorization": f"Bearer {token}"}).status_code == 200
        )
        wait_http("http://127.0.0.1:9091/metrics", p.proc, 5, p.log)
        # No engine runs at the example's addresses, so it is up but not ready.
        assert httpx.get("http://127.0.0.1:8080/ready").status_code == 503
        assert (tmp_path / "llmgw.db").exists()
    finally:
        assert p.stop() == 0, p.text()


def test_bad_config_refused_at_start_with_the_key_path(tmp_path):
    cfg = tmp_path / "server.yaml"
    cfg.write_text("models:\n  - name: a\n    endpoints:\n      - {url: 'http://x:1', engine: ollama}\n")
    r = subprocess.run(llmgw_cmd("server", "--config", str(cfg)), capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "models[0].endpoints[0].engine:" in r.stderr


def test_port_in_use_is_a_clear_error(tmp_path):
    first = Gateway(tmp_path, models=[]).wait_up(ready=False)
    try:
        second = Gateway(tmp_path, models=[], listen=f"127.0.0.1:{first.port}")
        rc = second.proc.wait(30)
        assert rc == 1
        assert f"listen 127.0.0.1:{first.port}: the address is already in use" in second.text()
    finally:
        assert first.stop() == 0


def test_postgresql_store_keys_usage_and_revocation(engines, tmp_path, pg_address):
    (engine,) = engines("tiny")
    dsn_file = tmp_path / "store-dsn"
    dsn_file.write_text(pg_address + "\n")
    gw = Gateway(
        tmp_path,
        models=[{"name": "tiny", "endpoints": [{"url": engine.url, "engine": "llamacpp"}]}],
        store=f"@{dsn_file}",
    ).wait_up()
    try:
        key = gw.create_key("pg")
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
        for _ in range(3):
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=3)
        listing = gw.keys("list")
        assert listing.returncode == 0 and "pg" in listing.stdout

        from llmgw.store import Store

        async def rows():
            s = await Store.open(pg_address)
            try:
                return await s.list_usage()
            finally:
                await s.close()

        until(lambda: len(asyncio.run(rows())) >= 3, 10, "usage rows to reach PostgreSQL", [gw], interval=0.1)
        assert gw.keys("revoke", key[:14]).returncode == 0

        def refused() -> bool:
            try:
                client.models.list()
            except openai.AuthenticationError:
                return True
            return False

        until(refused, 10, "the revoked key to be refused", [gw])
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
    finally:
        assert gw.stop() == 0, gw.text()


def test_sigterm_drains_and_writes_usage(engines, tmp_path):
    (engine,) = engines("tiny")
    gw = Gateway(
        tmp_path,
        models=[{"name": "tiny", "endpoints": [{"url": engine.url, "engine": "llamacpp"}]}],
        usage={"flush_interval": "1h"},
    ).wait_up()
    key = gw.create_key()
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=3)
    assert gw.stop() == 0, gw.text()

    from llmgw.store import Store

    async def count():
        s = await Store.open(gw.store)
        try:
            return await s.count_usage()
        finally:
            await s.close()

    # The hour-long flush interval never came round: the row was written on the way out.
    assert asyncio.run(count()) == 1
