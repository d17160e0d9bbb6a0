"""`llmgw up`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TaskID, TextColumn, TimeRemainingColumn

from llmgw.cli.common import fail


def up(
    model: str = typer.Option(
        None,
        "--model",
        "-m",
        help="A .gguf file to serve where it is; default: the starter model (Qwen2.5 0.5B Instruct), fetched once into the mirror.",
    ),
    name: str = typer.Option(None, "--name", help="The model name clients send; default from the file."),
    llama_server: str = typer.Option(
        None,
        "--llama-server",
        help="Use this llama-server: the agent installs it instead of downloading llama.cpp's release.",
    ),
    release_url: str = typer.Option(
        None,
        "--release-url",
        help="A mirror of llama.cpp's release archives (TAG/ASSET); default GitHub, and a build from source when it cannot be reached.",
    ),
    port: int = typer.Option(8080, "--port", "-p", help="Port of the OpenAI-compatible API."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address the API listens on; 0.0.0.0 for every interface."),
    admin_port: int = typer.Option(9090, "--admin-port", help="Port of the admin API and metrics (loopback)."),
    workdir: Path = typer.Option(
        None,
        "--dir",
        help="Where certificates, configuration, the store, the mirror, engines and logs go; default ~/.local/share/llmgw/up.",
    ),
    ctx_size: int = typer.Option(8192, "--ctx-size", help="Context pool of the engine, shared by its parallel slots."),
    parallel: int = typer.Option(2, "--parallel", help="Requests the engine works on at once."),
    offline: bool = typer.Option(
        False, "--offline", help="Do not try to fetch the starter model; put the tiny test model into the mirror."
    ),
) -> None:
    """Run the whole system on this machine, without root: a control plane and gateway, a model mirror, a node agent
    connected over mutual TLS that installs llama.cpp and serves the model from the mirror, and an API key. Ctrl-C
    stops it all, engines included."""
    from llmgw.pki import PKIError
    from llmgw.server import StartError
    from llmgw.up import UpError
    from llmgw.up.main import Options, run

    # soft_wrap: the printed commands must stay copy-pasteable on narrow terminals and in pipes.
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    opts = Options(
        workdir=workdir,
        model=model,
        name=name,
        llama_server=llama_server,
        release_url=release_url,
        port=port,
        host=host,
        admin_port=admin_port,
        ctx_size=ctx_size,
        parallel=parallel,
        offline=offline,
    )
    try:
        run(opts, say=err.print, show=lambda text: print(text, flush=True), fetching=_download_bar)
    except (UpError, StartError, PKIError) as exc:
        fail(str(exc))


@contextmanager
def _download_bar(what: str) -> Iterator[Callable[[int, int | None], None]]:
    """A progress bar on stderr, shown from the first count and gone when done."""
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as bar:
        task: TaskID | None = None

        def progress(done: int, total: int | None) -> None:
            nonlocal task
            if task is None:
                task = bar.add_task(what, total=total)
            bar.update(task, completed=done, total=total)

        yield progress
