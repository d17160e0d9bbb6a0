"""Where `server init` puts the mirror and what server.yaml says of it: decided before server.yaml is
written (step 4), read back from server.yaml on every later step and rerun."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from llmgw.config import ServerConfig
from llmgw.init.machine import Machine
from llmgw.mirror.api import default_token_file

MIRROR_DIR = "/srv/models"
MIRROR_BYTES = ":8081"
# The management API on loopback: only this machine's control plane uses it, so it needs no certificate.
MIRROR_API_LISTEN = "127.0.0.1:8082"
MIRROR_API = "http://127.0.0.1:8082"
ENGINE_MODEL = "llama.cpp"  # the mirror's model directory holding llama.cpp's release archives
# The label on the control plane's own node: the starter model is pinned to it.
CONTROL_PLANE_LABEL = "llmgw.control-plane"


def primary_address(m: Machine, hosts: list[str]) -> str:
    """The address nodes reach this machine at: its first address that is not loopback, else the
    first --host, else loopback (a one-machine cluster)."""
    for a in m.addresses:
        if not (a.startswith("127.") or a == "::1"):
            return a
    return hosts[0] if hosts else "127.0.0.1"


def bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


@dataclass(frozen=True)
class MirrorPlan:
    """Where this control plane's mirror is, as server.yaml will say it."""

    here: bool  # run beside the control plane (else another machine's, or none)
    api: str | None
    token_file: str | None
    base: str | None  # the byte listener nodes fetch from; None when not known here
    dir: Path | None

    @property
    def release_url(self) -> str | None:
        return f"{self.base}/{ENGINE_MODEL}" if self.base else None


def mirror_plan(m: Machine, hosts: list[str], mirror_url: str | None, no_mirror: bool) -> MirrorPlan:
    if no_mirror:
        return MirrorPlan(False, None, None, None, None)
    if mirror_url:
        # Another machine's: its token is copied here by the operator (`llmgw mirror init` says how).
        return MirrorPlan(False, mirror_url.rstrip("/"), str(m.etc / "mirror-token"), None, None)
    d = m.path(MIRROR_DIR)
    base = f"http://{bracket(primary_address(m, hosts))}{MIRROR_BYTES}"
    return MirrorPlan(True, MIRROR_API, str(default_token_file(d)), base, d)


def plan_of(m: Machine, cfg: ServerConfig) -> MirrorPlan:
    """The mirror as an existing server.yaml names it (a rerun goes by the file, never by flags)."""
    if cfg.mirror is None:
        return MirrorPlan(False, None, None, None, None)
    here = cfg.mirror.api.rstrip("/") == MIRROR_API
    base = None
    if cfg.engines.release_url and cfg.engines.release_url.endswith(f"/{ENGINE_MODEL}"):
        base = cfg.engines.release_url[: -len(ENGINE_MODEL) - 1]
    d = m.path(MIRROR_DIR) if here else None
    return MirrorPlan(here, cfg.mirror.api, cfg.mirror.token_file, base, d)
