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
    model: str = typer.Option(None, "--model", "-m", help="A .gguf file to serve where it is; default: the starter model (Qwen2.5 0.5B Instruct), fetched once into the mirror."),
    name: str = typer.Option(None, "--name", help="The model name clients send; default from the file."),
    llama_server: str = typer.Option(None, "--llama-server", help="Use this llama-server: the agent installs it instead of downloading llama.cpp's release."),
    release_url: str = typer.Option(None, "--release-url", help="A mirror of llama.cpp's release archives (TAG/ASSET); default GitHub, and a build from source when it cannot be reached."),
    port: int = typer.Option(8080, "--port", "-p", help="Port of the OpenAI-compatible API."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address the API listens on; 0.0.0.0 for every interface."),
    admin_port: int = typer.Option(9090, "--admin-port", help="Port of the admin API and metrics (loopback)."),
    workdir: Path = typer.Option(None, "--dir", help="Where certificates, configuration, the store, the mirror, engines and logs go; default ~/.local/share/llmgw/up."),
    ctx_size: int = typer.Option(8192, "--ctx-size", help="Context pool of the engine, shared by its parallel slots."),
    parallel: int = typer.Option(2, "--parallel", help="Requests the engine works on at once."),
    offline: bool = typer.Option(False, "--offline", help="Do not try to fetch the starter model; put the tiny test model into the mirror."),
) -> None:
    """Run the whole system on this machine, without root: a control plane and gateway, a model mirror, a node agent
    connected over mutual TLS that installs llama.cpp and serves the model from the mirror, and an API key. Ctrl-C
    stops it all, engines included."""
    from llmgw import up as upmod
    from llmgw.pki import PKIError
    from llmgw.server.app import StartError, install_loop, setup_logging

    # soft_wrap: the printed commands must stay copy-pasteable on narrow terminals and in pipes.
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    say = err.print
    wd = (workdir or upmod.default_dir()).expanduser().resolve()
    wd.mkdir(parents=True, exist_ok=True)
    release = None
    mirror = upmod.MirrorProcess(wd / "mirror", wd / "mirror.log", *upmod.mirror_ports(wd))
    try:
        upmod.check_port(host, port, "the API")
        upmod.check_port("127.0.0.1", admin_port, "the admin API")
        binary = upmod.check_llama_server(llama_server) if llama_server else None
        own = upmod.own_model(model, name) if model else None
        # The mirror starts while the certificates are looked at: both take a moment.
        mirror.start()
        say(f"starting the model mirror on {mirror.base} (its files: {mirror.root}, its log: {mirror.log_path})")
        pki, made = upmod.ensure_pki(wd)
        say(f"certificates in {pki.dir}: " + (f"made the {', '.join(made)}" if made else "reused"))
        mirror.wait_ready()
        if own is not None:
            choice = own
        else:
            with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                          console=Console(stderr=True), transient=True) as bar:
                dl = None

                def fetch_progress(done: int, total: int | None) -> None:
                    nonlocal dl
                    if dl is None:
                        dl = bar.add_task(f"the mirror is fetching {upmod.STARTER_FILE}", total=total)
                    bar.update(dl, completed=done, total=total)

                choice = upmod.mirrored_model(mirror, name, say, fetch_progress, offline)
            say(f"the mirror holds {choice.file}: {choice.source}")
        if binary is not None:
            release = upmod.LocalRelease(binary)
            release_url = release.start()
            say(f"the agent installs {binary} (offered as llama.cpp {release.tag} on {release_url})")
        agent_port = upmod.free_port()
        config_path = upmod.write_server_config(wd, choice, pki, port=port, admin_port=admin_port, agent_port=agent_port,
                                                host=host, ctx_size=ctx_size, parallel=parallel, release_url=release_url,
                                                mirror_api=mirror.api, mirror_token_file=mirror.token_file)
        agent_config = upmod.write_agent_config(wd, pki, agent_port)
        agent = upmod.AgentProcess(agent_config, wd / "agent.log")
        base = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"
        say(f"starting the control plane and the local agent (its log: {agent.log_path}); serving {choice.file} …")

        def status(words: str) -> None:
            say(f"  {words}")

        def ready(secret: str) -> None:
            print(upmod.instructions(base, secret, choice.name, config_path))
            if choice.noise:
                say("note: this is the tiny test model; its replies are noise.")
            sys.stdout.flush()

        setup_logging("warning")
        install_loop()
        asyncio.run(upmod.run_system(config_path, agent, choice.name, f"llmgw up {upmod.started_at()}", status, ready,
                                     mirror=mirror))
        say("stopped.")
    except (upmod.UpError, StartError, PKIError) as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        say("stopped.")
    finally:
        if release is not None:
            release.stop()
        mirror.stop(timeout=10.0)
