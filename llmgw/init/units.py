"""The control plane's and the node's units, hardened; written through :mod:`llmgw.units`
like the mirror's (:func:`llmgw.mirror.systemd.unit_text`)."""

from __future__ import annotations

from llmgw.config.agent import DEFAULT_AGENT_CONFIG_PATH, DEFAULT_ENGINES_DIR, DEFAULT_WEIGHTS_CACHE
from llmgw.init.machine import USER
from llmgw.units import quote, unit_text

SERVER_UNIT = "llmgw-server.service"
AGENT_UNIT = "llmgw-agent.service"


def server_unit_text(*, binary: str, config: str, data_dir: str) -> str:
    """The gateway and control plane: its own user, writing only its data directory."""
    return unit_text(
        description="llmgw gateway and control plane",
        exec_start=[[binary, "server", "--config", config]],
        service=[
            f"User={USER}",
            f"Group={USER}",
            "Restart=on-failure",
            "RestartSec=2s",
            "NoNewPrivileges=yes",
            "ProtectSystem=strict",
            "ProtectHome=true",
            "PrivateTmp=true",
            f"ReadWritePaths={quote(data_dir)}",
        ],
    )


# The directories the agent writes, which must exist before it starts (systemd refuses a missing
# ReadWritePaths): made by whoever installs the unit (server init, node add).
AGENT_DIRS = (DEFAULT_WEIGHTS_CACHE, DEFAULT_ENGINES_DIR)
# What the agent writes besides its own directories: it installs engines' OS packages (libgomp1,
# infiniband-diags, vLLM's runtime) with the machine's package manager. "-": a path this distribution
# does not have is skipped rather than failing the unit.
PACKAGE_PATHS = (
    "/usr",
    "/etc",
    "/var/lib/dpkg",
    "/var/lib/apt",
    "/var/cache/apt",
    "-/var/lib/dnf",
    "-/var/cache/dnf",
    "-/var/lib/rpm",
    "/var/log",
)


def agent_unit_text(*, binary: str, config: str = DEFAULT_AGENT_CONFIG_PATH) -> str:
    """The node agent: root (it drives GPUs and installs engines), KillMode=process so engines
    outlive an agent restart and are adopted, and memlock unlimited for RDMA. No ProtectHome:
    the engines it starts (vLLM, triton, torch) keep their caches under the home directory."""
    writes = [quote(DEFAULT_WEIGHTS_CACHE), quote(DEFAULT_ENGINES_DIR), "/var/lib/llmgw-agent", "/tmp", *PACKAGE_PATHS]
    return unit_text(
        description="llmgw node agent",
        exec_start=[[binary, "agent", "--config", config]],
        service=[
            "KillMode=process",
            "Restart=on-failure",
            "RestartSec=2s",
            "LimitMEMLOCK=infinity",
            "StateDirectory=llmgw-agent",
            "NoNewPrivileges=yes",
            "ProtectSystem=strict",
            f"ReadWritePaths={' '.join(writes)}",
        ],
    )
