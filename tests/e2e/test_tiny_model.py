"""The tiny model in a real llama-server, driven with the official openai SDK.

Needs the llama-server built by ``scripts/build-llama-server`` (or one named by
``$LLMGW_LLAMA_SERVER`` or on PATH); skips otherwise. Run with
``LLMGW_UPDATE_FIXTURES=1`` to refresh tests/fixtures/metrics/llamacpp.txt
from the live server.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
from pathlib import Path

import httpx
import pytest

from llmgw.agent.provision.llamacpp_source import find_llama_server
from llmgw.testing.waiting import until

pytestmark = pytest.mark.e2e

openai = pytest.importorskip("openai")

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "metrics" / "llamacpp.txt"
ALIAS = "tiny"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory):
    binary = find_llama_server(os.environ.get("LLMGW_LLAMA_SERVER"))
    if binary is None:
        pytest.skip("llama-server is not built: run scripts/build-llama-server (or set LLMGW_LLAMA_SERVER)")
    from llmgw.up.tiny_model import tiny_model_path

    model = tiny_model_path()
    port = _free_port()
    log_path = tmp_path_factory.mktemp("llama-server") / "server.log"
    cmd = [
        str(binary),
        "-m",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--alias",
        ALIAS,
        "--jinja",
        "--metrics",
        "--embeddings",
        "--pooling",
        "mean",
        "--threads",
        "2",
        "--parallel",
        "2",
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        until(
            lambda: httpx.get(url + "/health", timeout=1).status_code == 200,
            60,
            "llama-server to be healthy",
            detail=lambda: f"exit status {proc.poll()}\n{log_path.read_text()[-3000:]}",
            alive=[proc],
            ignore=(httpx.HTTPError,),
            interval=0.1,
        )
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def client(llama_server):
    with openai.OpenAI(base_url=llama_server + "/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


def test_the_tiny_model_answers_a_chat_completion_to_max_tokens_with_usage(client):
    r = client.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": "Say hello"}], max_tokens=8)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert isinstance(r.choices[0].message.content, str)
    # EOS is never picked by the tiny model, so it always runs to max_tokens.
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8
    assert r.usage.prompt_tokens > 3
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8


def test_chat_completion_content_parts_and_system(client):
    def prompt_tokens(content) -> int:
        r = client.chat.completions.create(
            model=ALIAS,
            messages=[{"role": "system", "content": "You are terse."}, {"role": "user", "content": content}],
            max_tokens=3,
        )
        assert r.usage.completion_tokens == 3
        return r.usage.prompt_tokens

    # The template uses content as a string; llama-server joins text parts with "\n".
    parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]
    assert prompt_tokens(parts) == prompt_tokens("Hi\nthere")
    assert prompt_tokens(parts) > prompt_tokens("Hi")


def test_chat_completion_stream_with_usage(client):
    stream = client.chat.completions.create(
        model=ALIAS,
        messages=[{"role": "user", "content": "Count"}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 6
    finishes = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason]
    assert finishes == ["length"]
    text = "".join(ch.delta.content or "" for c in chunks for ch in c.choices)
    assert text


def test_the_tiny_model_answers_a_text_completion_with_the_tokens_asked_for(client):
    r = client.completions.create(model=ALIAS, prompt="Once upon a time", max_tokens=5)
    assert r.object == "text_completion"
    assert r.usage.completion_tokens == 5
    assert isinstance(r.choices[0].text, str)


def test_the_tiny_model_embeds_each_input_in_64_distinct_dimensions(client):
    r = client.embeddings.create(model=ALIAS, input=["hello", "hello world"])
    assert [d.index for d in r.data] == [0, 1]
    assert all(len(d.embedding) == 64 for d in r.data)
    assert r.data[0].embedding != r.data[1].embedding
    assert r.usage.prompt_tokens > 0


def test_the_tiny_model_server_lists_only_its_alias(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == [ALIAS]


_METRIC_LINE = re.compile(r"^(llamacpp:[a-z_]+)(?:\{[^}]*\})? (\S+)$")


def _names(text: str) -> set[str]:
    return {m.group(1) for line in text.splitlines() if (m := _METRIC_LINE.match(line))}


def test_metrics_match_fixture(client, llama_server):
    client.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": "x"}], max_tokens=2)
    r = httpx.get(llama_server + "/metrics", timeout=5)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    live = r.text
    for name in (
        "llamacpp:requests_processing",
        "llamacpp:requests_deferred",
        "llamacpp:prompt_tokens_total",
        "llamacpp:tokens_predicted_total",
    ):
        assert name in _names(live)
    if os.environ.get("LLMGW_UPDATE_FIXTURES"):
        FIXTURE.parent.mkdir(parents=True, exist_ok=True)
        FIXTURE.write_text(live if live.endswith("\n") else live + "\n")
    assert _names(live) == _names(FIXTURE.read_text())
