import asyncio
import importlib.util
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import BUILD_TIMEOUT, REPO, LlamaServer, Proc, free_port, require, wait_http

SPEC = REPO / "build" / "pyinstaller.spec"

# Seconds a test marked slow may take before pytest-timeout stops it with a stack.
SLOW_TIMEOUT = 900


@pytest.fixture(scope="session")
def llama_server_bin() -> Path:
    from llmgw.agent.provision.llamacpp_source import find_llama_server

    path = find_llama_server()
    if path is None:
        require("llama-server", "llama-server is not built; run scripts/build-llama-server (the test command does)")
    return path


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from llmgw.up.tiny_model import tiny_model_path

    try:
        return tiny_model_path()
    except Exception as exc:  # the vocabulary comes from the llama-cpp-python sdist
        require("the tiny model", f"the tiny test model could not be written: {exc}")


@pytest.fixture
def fake_engine(tmp_path):
    """The fake engine (llmgw.testing.fake_engine) in its own process, and the models entry that
    serves it as model "fake"."""
    port = free_port()
    proc = Proc([sys.executable, "-m", "llmgw.testing.fake_engine", "--port", str(port)], tmp_path / "engine.log")
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc.proc, 30, proc.log)
        yield (
            proc,
            [
                {
                    "name": "fake",
                    "endpoints": [{"url": f"http://127.0.0.1:{port}", "engine": "llamacpp", "model": "fake-model"}],
                }
            ],
        )
    finally:
        proc.kill()


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


@pytest.fixture(scope="session")
def frozen_llmgw(tmp_path_factory) -> Path:
    """The one-file llmgw built from build/pyinstaller.spec, once a session (a few minutes). Whichever test
    asks first builds it in its setup, so every test using it carries BUILD_TIMEOUT's timeout marker."""
    if importlib.util.find_spec("PyInstaller") is None:
        reason = "PyInstaller is not installed (pip install -e '.[test]')"
        if os.environ.get("LLMGW_REQUIRE_E2E") == "1":
            pytest.fail(f"PyInstaller is required for this run: {reason}")
        pytest.skip(reason)
    out = tmp_path_factory.mktemp("frozen")
    dist, work = out / "dist", out / "work"
    cmd = [
        sys.executable,
        "-m",
        "PyInstaller",
        str(SPEC),
        "--noconfirm",
        "--distpath",
        str(dist),
        "--workpath",
        str(work),
    ]
    started = time.monotonic()
    try:
        r = subprocess.run(
            cmd, cwd=REPO, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=BUILD_TIMEOUT
        )
    except subprocess.TimeoutExpired as exc:
        tail = ((exc.stdout or "") + (exc.stderr or ""))[-6000:]
        pytest.fail(f"the PyInstaller build did not finish within {BUILD_TIMEOUT}s:\n{tail}")
    took = time.monotonic() - started
    binary = dist / "llmgw"
    assert r.returncode == 0 and binary.is_file(), (
        f"the PyInstaller build failed (exit {r.returncode}):\n{(r.stdout + r.stderr)[-6000:]}"
    )
    print(f"\nfrozen llmgw built in {took:.0f}s, {binary.stat().st_size / 2**20:.1f} MiB")
    return binary


@pytest.fixture(scope="session")
def machine_root() -> Path:
    """The Debian root the onboarding tests boot machines from (tests/e2e/machines.py), built once."""
    import machines

    reason = machines.unavailable()
    if reason is not None:
        require("machines booted with systemd-nspawn", reason)
    try:
        return machines.build_root()
    except subprocess.CalledProcessError as exc:
        require("the test machine root", f"scripts/build-test-machine-root failed: {exc.stderr[-2000:]}")


@pytest.fixture
def machines(machine_root, tmp_path):
    """Boot machines with ``machines.boot("a", "b")``; all are powered off, and the bridge removed, after."""
    from machines import Machines

    with Machines(machine_root, tmp_path / "machines") as m:
        yield m


@pytest.fixture
def pg_address():
    """A throwaway PostgreSQL database on 127.0.0.1:5432, dropped afterwards."""
    asyncpg = pytest.importorskip("asyncpg")
    name = f"llmgw_e2e_{secrets.token_hex(4)}"

    async def admin(sql: str) -> None:
        conn = await asyncpg.connect("postgresql://postgres@127.0.0.1:5432/postgres", timeout=5)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    try:
        asyncio.run(admin(f'CREATE DATABASE "{name}"'))
    except (OSError, asyncpg.PostgresError) as exc:
        require("PostgreSQL", f"no PostgreSQL answered on 127.0.0.1:5432 ({exc})")
    yield f"postgres://postgres@127.0.0.1:5432/{name}"
    asyncio.run(admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def pytest_collection_modifyitems(config, items):
    # Everything under tests/e2e runs real processes: mark it e2e even where a module forgets to,
    # so `-m "not e2e"` always leaves only the fast, self-contained tests.
    here = Path(__file__).resolve().parent
    for item in items:
        if here in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.e2e)
            # A slow test outlives the default timeout (pyproject.toml) on two loaded cores; one that
            # names its own (the frozen-binary build) keeps it.
            if item.get_closest_marker("slow") and item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT))


@pytest.fixture
def browser():
    """Headless Chromium (Debian's, through Playwright); the pages' browser tests use it."""
    chromium = shutil.which("chromium")
    if chromium is None:
        require("Debian's chromium", "chromium is not installed (apt-get install chromium; scripts/test does)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        require("Playwright", "playwright is not installed (pip install -e '.[test]')")
    with sync_playwright() as p:
        # --no-sandbox: the tests run as root, where Chromium's sandbox refuses to start.
        b = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()
