"""`llmgw up`."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

from llmgw.cli.common import fail


def up(
    model: str = typer.Option(None, "--model", "-m", help="A .gguf file to serve; default: the starter model (Qwen2.5 0.5B Instruct), downloaded once."),
    name: str = typer.Option(None, "--name", help="The model name clients send; default from the file."),
    llama_server: str = typer.Option(None, "--llama-server", help="Path of llama-server; default: PATH, then the cache, else it is built from source."),
    port: int = typer.Option(8080, "--port", "-p", help="Port of the OpenAI-compatible API."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address the API listens on; 0.0.0.0 for every interface."),
    admin_port: int = typer.Option(9090, "--admin-port", help="Port of the admin API and metrics (loopback)."),
    workdir: Path = typer.Option(None, "--dir", help="Where the store, server.yaml and logs go; default ~/.local/share/llmgw/up."),
    ctx_size: int = typer.Option(8192, "--ctx-size", help="Context pool of the engine, shared by its parallel slots."),
    parallel: int = typer.Option(2, "--parallel", help="Requests the engine works on at once."),
    offline: bool = typer.Option(False, "--offline", help="Do not try to download the starter model; use the tiny test model."),
) -> None:
    """Run everything on this machine, without root: a llama.cpp engine, the gateway in front of it and an API key. Ctrl-C stops it all."""
    from llmgw import up as upmod
    from llmgw.server.app import StartError, install_loop, setup_logging

    # soft_wrap: the printed commands must stay copy-pasteable on narrow terminals and in pipes.
    say = Console(stderr=True, highlight=False, soft_wrap=True).print
    wd = (workdir or upmod.default_dir()).expanduser()
    wd.mkdir(parents=True, exist_ok=True)
    engine = None
    try:
        upmod.check_port(host, port, "the API")
        upmod.check_port("127.0.0.1", admin_port, "the admin API")
        with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                      TimeRemainingColumn(), console=Console(stderr=True), transient=True) as bar:
            task = None

            def build_progress(phase: str, pct: float | None) -> None:
                nonlocal task
                if task is None:
                    task = bar.add_task(phase, total=100)
                bar.update(task, description=f"building llama-server: {phase}", completed=pct or 0)

            binary = upmod.find_or_build_llama_server(llama_server, say, build_progress)
        with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                      console=Console(stderr=True), transient=True) as bar:
            dl = None

            def download_progress(done: int, total: int | None) -> None:
                nonlocal dl
                if dl is None:
                    dl = bar.add_task(f"downloading {upmod.STARTER_FILE}", total=total)
                bar.update(dl, completed=done, total=total)

            choice = upmod.choose_model(model, name, say, download_progress, offline)
        say(f"starting llama-server with {choice.path.name} …")
        engine = upmod.Engine(binary, choice, upmod.free_port(), wd / "llama-server.log", ctx_size, parallel)
        engine.start()
        engine.wait_ready()
        config_path = upmod.write_config(wd, choice, engine, port, admin_port, host)
        base = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"

        def ready(secret: str) -> None:
            print(upmod.instructions(base, secret, choice.name, config_path))
            if choice.noise:
                say("note: this is the tiny test model; its replies are noise.")
            sys.stdout.flush()

        setup_logging("warning")
        install_loop()
        asyncio.run(upmod.run_gateway(config_path, f"llmgw up {upmod.started_at()}", ready))
        say("stopped.")
    except (upmod.UpError, StartError) as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        say("stopped.")
    finally:
        if engine is not None:
            engine.stop()
