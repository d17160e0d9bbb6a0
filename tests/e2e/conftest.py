from pathlib import Path

import pytest

from harness import LlamaServer, require


@pytest.fixture(scope="session")
def llama_server_bin() -> Path:
    from llmgw.agent.provision.llamacpp_source import find_llama_server

    path = find_llama_server()
    if path is None:
        require("llama-server", "llama-server is not built; run scripts/build-llama-server (the test command does)")
    return path


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from llmgw.testing.tiny_model import tiny_model_path

    try:
        return tiny_model_path()
    except Exception as exc:  # the vocabulary comes from the llama-cpp-python sdist
        require("the tiny model", f"the tiny test model could not be written: {exc}")


@pytest.fixture
def engines(llama_server_bin, tiny_model, tmp_path):
    """Start llama-server processes on demand; all are stopped after the test."""
    started: list[LlamaServer] = []

    def start(alias: str = "tiny", n: int = 1, extra: tuple[str, ...] = ()) -> list[LlamaServer]:
        new = [LlamaServer(llama_server_bin, tiny_model, tmp_path, alias, extra) for _ in range(n)]
        started.extend(new)
        return [e.wait_ready() for e in new]

    yield start
    for e in started:
        e.kill()
