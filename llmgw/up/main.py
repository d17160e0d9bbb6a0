"""`llmgw up` from its first check to Ctrl-C: the mirror, the certificates, the model, the configuration,
then the control plane in this process and the agent beside it until a signal."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING

from llmgw.config import load_server_config
from llmgw.runtime import run_until_stopped, setup_logging
from llmgw.up import UpError
from llmgw.up.config import check_port, default_dir, free_port, mirror_ports, write_agent_config, write_server_config
from llmgw.up.engine import LocalRelease, check_llama_server
from llmgw.up.model import STARTER_FILE, OnBytes, mirrored_model, own_model
from llmgw.up.pki import ensure_pki
from llmgw.up.processes import AgentProcess, Child, MirrorProcess, kill_leftovers
from llmgw.up.watch import engine_pids, wait_until_served

if TYPE_CHECKING:
    from llmgw.server.app import Server

log = logging.getLogger("llmgw.up")

Say = Callable[[str], None]


@dataclass(frozen=True, kw_only=True)
class Options:
    """What `llmgw up` was asked for: its command-line flags (their defaults are the CLI's)."""

    workdir: Path | None
    model: str | None
    name: str | None
    llama_server: str | None
    release_url: str | None
    port: int
    host: str
    admin_port: int
    ctx_size: int
    parallel: int
    offline: bool


def run(opts: Options, say: Say, show: Say, fetching: Callable[[str], AbstractContextManager[OnBytes]]) -> None:
    """The whole system on this machine until Ctrl-C; everything it started is stopped on the way out.

    ``say``: progress and notes (stderr); ``show``: how to use it, once it is up (stdout);
    ``fetching(what)``: a progress display around the mirror's download. UpError, StartError or
    PKIError when it cannot go on.
    """
    wd = (opts.workdir or default_dir()).expanduser().resolve()
    wd.mkdir(parents=True, exist_ok=True)
    release = None
    release_url = opts.release_url
    mirror = MirrorProcess(wd / "mirror", wd / "mirror.log", *mirror_ports(wd))
    agent: AgentProcess | None = None
    try:
        check_port(opts.host, opts.port, "the API")
        check_port("127.0.0.1", opts.admin_port, "the admin API")
        binary = check_llama_server(opts.llama_server) if opts.llama_server else None
        own = own_model(opts.model, opts.name) if opts.model else None
        # The mirror starts while the certificates are looked at and the control plane's code is
        # loaded (a second or more): each process takes a moment, and they overlap.
        mirror.start()
        say(f"starting the model mirror on {mirror.base} (its files: {mirror.root}, its log: {mirror.log_path})")
        pki, made = ensure_pki(wd)
        say(f"certificates in {pki.dir}: " + (f"made the {', '.join(made)}" if made else "reused"))
        agent_port = free_port()
        agent = AgentProcess(write_agent_config(wd, pki, agent_port), wd / "agent.log")
        if own is not None or opts.offline:
            # No download stands before the control plane: the agent goes through its own start-up
            # now, beside the mirror's and this process's, and dials as the control plane listens.
            # (Before a download it would only redial, filling its log, until the download ends.)
            agent.start()
        import_module("llmgw.server.app")
        mirror.wait_ready()
        if own is not None:
            choice = own
        else:
            with fetching(f"the mirror is fetching {STARTER_FILE}") as progress:
                choice = mirrored_model(mirror, opts.name, say, progress, opts.offline)
            say(f"the mirror holds {choice.file}: {choice.source}")
        if binary is not None:
            release = LocalRelease(binary)
            release_url = release.start()
            say(f"the agent installs {binary} (offered as llama.cpp {release.tag} on {release_url})")
        config_path = write_server_config(
            wd,
            choice,
            pki,
            port=opts.port,
            admin_port=opts.admin_port,
            agent_port=agent_port,
            host=opts.host,
            ctx_size=opts.ctx_size,
            parallel=opts.parallel,
            release_url=release_url,
            mirror_api=mirror.api,
            mirror_token_file=mirror.token_file,
        )
        if agent.pid is None:
            agent.start()
        base = f"http://{'127.0.0.1' if opts.host in ('0.0.0.0', '') else opts.host}:{opts.port}"
        say(f"starting the control plane and the local agent (its log: {agent.log_path}); serving {choice.file} …")

        def status(words: str) -> None:
            say(f"  {words}")

        def ready(secret: str) -> None:
            show(instructions(base, secret, choice.name, config_path))
            if choice.noise:
                say("note: this is the tiny test model; its replies are noise.")

        setup_logging("warning")
        run_until_stopped(
            partial(
                run_system, config_path, agent, choice.name, f"llmgw up {started_at()}", status, ready, mirror=mirror
            )
        )
        say("stopped.")
    except KeyboardInterrupt:
        say("stopped.")
    finally:
        if agent is not None:
            agent.stop()  # when the control plane never started; stopped already otherwise
        if release is not None:
            release.stop()
        mirror.stop(timeout=10.0)


async def run_system(
    config_path: Path,
    agent: AgentProcess,
    model: str,
    key_name: str,
    status: Say,
    on_ready: Say,
    stop: asyncio.Event,
    mirror: Child | None = None,
) -> None:
    """The control plane and gateway in this process, beside the agent (started by the caller, which
    also stops it should this never run); serve until ``stop`` is set.

    Stops in order: the agent first (it stops its engines), then any engine
    still running (the last guard), then the control plane. The mirror, started
    before, is watched here and stopped by the caller.
    """

    from llmgw.server.app import serve_until_stopped

    async def alongside(server: Server) -> None:
        # Cancelled by the server when `stop` is set; its `finally` stops the agent before the server stops.
        pids: set[int] = set()
        try:
            await wait_until_served(server, model, agent, status, pids)
            assert server.store is not None and server.keys is not None
            secret, _ = await server.store.create_key(key_name)
            await server.keys.load()
            on_ready(secret)
            while not stop.is_set():
                await asyncio.sleep(1.0)
                if server.reconciler is not None:
                    pids |= engine_pids(server.reconciler.replica_rows(model))
                rc = agent.exited()
                if rc is not None and not stop.is_set():
                    raise UpError(
                        f"the agent exited with status {rc}; its last lines ({agent.log_path}):\n{agent.tail()}"
                    )
                rc = mirror.exited() if mirror is not None else None
                if mirror is not None and rc is not None and not stop.is_set():
                    raise UpError(
                        f"the mirror exited with status {rc}; its last lines ({mirror.log_path}):\n{mirror.tail()}"
                    )
        finally:
            status("stopping the agent and its engines")
            await asyncio.to_thread(agent.stop)
            left = await asyncio.to_thread(kill_leftovers, pids)
            if left:
                log.warning("engine(s) %s outlived the agent and were stopped", ", ".join(map(str, left)))

    await serve_until_stopped(load_server_config(config_path), stop, on_started=alongside)


def instructions(base: str, key: str, model: str, config_path: Path) -> str:
    return f"""
llmgw is up.

  base URL  {base}/v1
  API key   {key}
  model     {model}

Try it:

  curl {base}/v1/chat/completions \\
    -H "Authorization: Bearer {key}" \\
    -H "Content-Type: application/json" \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}]}}'

  from openai import OpenAI
  client = OpenAI(base_url="{base}/v1", api_key="{key}")
  reply = client.chat.completions.create(model="{model}", messages=[{{"role": "user", "content": "Hello!"}}])
  print(reply.choices[0].message.content)

More keys: llmgw keys create --name NAME --config {config_path}
The cluster: llmgw ctl replicas (it finds the admin token, {config_path.parent / "admin-token"}, by itself
             when --dir is the default; else add --token-file)
Press Ctrl-C to stop.
"""


def started_at() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%d %H:%M")
