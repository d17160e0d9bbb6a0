"""Where `up` keeps everything, the ports it uses, and the two configuration files it writes each run."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from llmgw.config.server import DEFAULT_LLAMACPP
from llmgw.files import write_atomic
from llmgw.up import UpError

if TYPE_CHECKING:  # kept light: the admin client imports default_dir from here
    from llmgw.up.model import Choice
    from llmgw.up.pki import Pki


def default_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(Path.home(), ".local", "share")
    return Path(base) / "llmgw" / "up"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_free(port: object) -> bool:
    if not isinstance(port, int) or not 1024 <= port <= 65535:
        return False
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def check_port(host: str, port: int, what: str) -> None:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host or "0.0.0.0", port))
        except OSError:
            raise UpError(
                f"port {port} ({what}) is already in use; choose another with "
                f"{'--port' if what == 'the API' else '--admin-port'}"
            ) from None


def mirror_ports(workdir: Path) -> tuple[int, int]:
    """The mirror's two loopback ports (bytes, API): the last run's while they are free, so the catalog
    source stays the same URL and the agent's cached copy of the weights is used again; new ones
    otherwise. Remembered in ``workdir``/mirror.json."""
    path = workdir / "mirror.json"
    try:
        kept = json.loads(path.read_text())
        ports = (kept["listen"], kept["api"])
    except (OSError, ValueError, KeyError, TypeError):
        ports = (None, None)
    if ports[0] != ports[1] and all(_port_free(p) for p in ports):
        return ports  # type: ignore[return-value]
    listen = free_port()
    api = free_port()
    while api == listen:
        api = free_port()
    write_atomic(path, (json.dumps({"listen": listen, "api": api}) + "\n").encode())
    return listen, api


def _write_yaml(path: Path, data: dict[str, Any]) -> Path:
    text = "# Written by `llmgw up`; rewritten on each run.\n" + yaml.safe_dump(data, sort_keys=False)
    write_atomic(path, text.encode())
    return path


def write_server_config(
    workdir: Path,
    model: Choice,
    pki: Pki,
    *,
    port: int,
    admin_port: int,
    agent_port: int,
    host: str,
    ctx_size: int,
    parallel: int,
    release_url: str | None = None,
    llamacpp: str = DEFAULT_LLAMACPP,
    mirror_api: str | None = None,
    mirror_token_file: Path | None = None,
) -> Path:
    """server.yaml: the gateway, the control plane with the agent listener on loopback, the model in its catalog,
    and up's mirror (its management API on loopback, with its token), so `llmgw ctl mirror …` works against it."""
    cfg = {
        "listen": f"{host}:{port}",
        "admin_listen": f"127.0.0.1:{admin_port}",
        "metrics_listen": None,
        # One serving process: up's engine is llama.cpp on this same machine, and it, not the gateway,
        # bounds what is served; a second process would take a second of CPU from start-up (on two
        # cores, most of a second to the key) and memory from the engine.
        "workers": 1,
        "agent_listen": f"127.0.0.1:{agent_port}",
        # ensure_pki reissues an unmarked node certificate, so up's one node always has the mark.
        "agent_tls": {
            "ca": str(pki.ca),
            "cert": str(pki.server),
            "key": str(pki.server_key),
            "require_node_mark": True,
        },
        # One node on loopback, heartbeating every 2s: react within a second. The one agent is known,
        # so the control plane places as soon as it has registered rather than waiting out the settle
        # time (unreachable_after) for others to come back.
        "control": {
            "enabled": True,
            "interval": "1s",
            "expected_nodes": [pki.node_id],
            "unreachable_after": "5s",
            "lost_after": "20s",
            "base_backoff": "5s",
            "max_backoff": "60s",
        },
        "engines": {"llamacpp": llamacpp, "release_url": release_url},
        "auth": {"enabled": True, "store": str(workdir / "llmgw.db")},
        "mirror": {"api": mirror_api, "token_file": str(mirror_token_file) if mirror_token_file else None}
        if mirror_api
        else None,
        "models": [
            {
                "name": model.name,
                "description": (
                    "Random-weight test model: its replies are noise"
                    if model.noise
                    else f"{model.file}, served by llama.cpp"
                ),
                # A mirror URL is fetched by the agent like any node's weights; a path (the user's own
                # file) is never fetched: the node, this machine, loads it where it is.
                "source": model.source,
                "scaling": {"min": 1},
                "profiles": [
                    {"engine": "llamacpp", "args": ["--ctx-size", str(ctx_size), "--parallel", str(parallel)]}
                ],
            }
        ],
    }
    return _write_yaml(workdir / "server.yaml", cfg)


def write_agent_config(workdir: Path, pki: Pki, agent_port: int) -> Path:
    """agent.yaml: dial the control plane on loopback; everything it keeps lives under ``workdir``."""
    cfg = {
        "server": f"127.0.0.1:{agent_port}",
        "node_id": pki.node_id,
        "tls": {"ca": str(pki.ca), "cert": str(pki.client), "key": str(pki.client_key)},
        "weights_cache": str(workdir / "weights"),
        "engines_dir": str(workdir / "engines"),
        "heartbeat_interval": "2s",
        # Started beside the control plane, it may dial before it listens: try again soon (loopback, one agent).
        "reconnect_base": "100ms",
        "reconnect_max": "1s",
        "supervisor": {"work_dir": str(workdir / "agent"), "stop_timeout": "15s", "stop_engines_on_exit": True},
    }
    return _write_yaml(workdir / "agent.yaml", cfg)
