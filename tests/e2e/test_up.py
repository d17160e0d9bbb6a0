"""`llmgw up` as a user runs it: engine, gateway and key on one machine; Ctrl-C stops it all."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import httpx
import openai
import pytest

from harness import free_port, llmgw_cmd

pytestmark = pytest.mark.e2e


def test_up_falls_back_to_tiny_model_serves_and_stops_on_ctrl_c(llama_server_bin, tiny_model, tmp_path):
    port, admin = free_port(), free_port()
    # Nothing listens on this port: the starter download fails at once, as it does offline.
    env = {**os.environ, "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"}
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen(llmgw_cmd("up", "--llama-server", str(llama_server_bin), "--port", str(port),
                                          "--admin-port", str(admin), "--dir", str(tmp_path / "up"),
                                          "--ctx-size", "2048"),
                                stdout=o, stderr=e, stdin=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + 90
        while "Press Ctrl-C" not in out.read_text():
            assert proc.poll() is None, f"llmgw up exited {proc.returncode}:\n{err.read_text()}"
            assert time.monotonic() < deadline, f"llmgw up did not come up:\n{err.read_text()}"
            time.sleep(0.2)
        text, errtext = out.read_text(), err.read_text()
        key = re.search(r"API key\s+(llmgw-\S+)", text).group(1)
        base = re.search(r"base URL\s+(\S+)", text).group(1)
        assert base == f"http://127.0.0.1:{port}/v1"
        assert "could not be downloaded" in errtext and "replies are noise" in errtext
        assert f'-H "Authorization: Bearer {key}"' in text and 'OpenAI(base_url="' in text
        client = openai.OpenAI(base_url=base, api_key=key, max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny-test"]
        reply = client.chat.completions.create(model="tiny-test", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=4)
        assert reply.usage.completion_tokens == 4
        engine_url = httpx.get(f"http://127.0.0.1:{admin}/api/v1/endpoints").json()["endpoints"][0]["url"]
        # A key made with the printed command works on the running gateway.
        r = subprocess.run(llmgw_cmd("keys", "list", "--config", str(tmp_path / "up" / "server.yaml")),
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "llmgw up" in r.stdout
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert rc == 0, err.read_text()
    with pytest.raises(httpx.HTTPError):
        httpx.get(engine_url + "/health", timeout=2)  # the engine it started is gone too


def test_up_refuses_a_missing_model_file(tmp_path, llama_server_bin):
    r = subprocess.run(llmgw_cmd("up", "--model", str(tmp_path / "nope.gguf"), "--llama-server", str(llama_server_bin),
                                 "--port", str(free_port()), "--admin-port", str(free_port()), "--dir", str(tmp_path)),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "no such file" in r.stderr
