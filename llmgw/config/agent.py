"""agent.yaml: where the control plane is and the TLS files; everything else is found.

A plain node's file holds only `server`/`servers` and `tls`. Every other key is
an override of something the agent finds out for itself, so it defaults to
None ("find it") rather than to a guess.
"""

from __future__ import annotations

import os
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from llmgw.config.loading import read_yaml, validate
from llmgw.config.types import Duration

DEFAULT_AGENT_CONFIG_PATH = "/etc/llmgw/agent.yaml"
# Where a node keeps fetched weights and installed engines unless agent.yaml says otherwise.
DEFAULT_WEIGHTS_CACHE = "/var/lib/llmgw-weights"
DEFAULT_ENGINES_DIR = "/opt/llmgw/engines"


class _Block(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AgentTLS(_Block):
    """The node's certificate from the fleet's authority; its common name is the node id."""

    ca: str = Field(default="/etc/llmgw/ca.pem", description="The fleet's certificate authority.")
    cert: str = Field(default="/etc/llmgw/agent.pem", description="This node's client certificate.")
    key: str = Field(default="/etc/llmgw/agent-key.pem", description="Its private key.")


class FabricDecl(_Block):
    """A fabric this node's adapters belong to."""

    name: str = Field(description="The fabric's name, the same on every node attached to it.")
    hcas: list[str] = Field(description="Adapters on this fabric, e.g. [mlx5_0, mlx5_1].")
    rate_gbps: float | None = Field(
        default=None,
        gt=0,
        description="The link rate its ports should train to, in Gbit/s; advertised when the ports do not say.",
    )

    @field_validator("hcas")
    @classmethod
    def _hcas(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("lists no adapters; name at least one, e.g. [mlx5_0]")
        return v


class DiscoveryConfig(_Block):
    """How the machine is examined."""

    nvidia_smi: str | None = Field(default=None, description="Path of nvidia-smi; default: found on PATH.")
    ib_root: str = Field(default="/sys/class/infiniband", description="Where InfiniBand and RoCE adapters are listed.")
    prefer_nvml: bool = Field(default=True, description="Ask the driver through NVML first, nvidia-smi second.")
    skip_gpus: bool = Field(default=False, description="Do not look for GPUs (for a broken driver).")


class LlamacppEngineConfig(_Block):
    """llama.cpp on this node."""

    bin: str | None = Field(default=None, description="Use this llama-server instead of installing one.")
    parallel: int = Field(default=4, ge=1, description="Requests served at once when a profile does not say.")


class VllmEngineConfig(_Block):
    """vLLM on this node."""

    bin: str | None = Field(default=None, description="Use this vllm instead of installing one.")
    launch_mode: Literal["mp", "ray"] = Field(default="mp", description="How multi-node replicas start.")


class SglangEngineConfig(_Block):
    """SGLang on this node."""

    python: str | None = Field(
        default=None, description="Interpreter of an SGLang environment to use instead of installing one."
    )


class EnginesConfig(_Block):
    """Engines this node uses as they are instead of installing them."""

    def configured(self) -> dict[str, str]:
        """Engine -> the binary (or interpreter) agent.yaml names for it."""
        out = {"llamacpp": self.llamacpp.bin, "vllm": self.vllm.bin, "sglang": self.sglang.python}
        return {k: v for k, v in out.items() if v}

    llamacpp: LlamacppEngineConfig = Field(default_factory=LlamacppEngineConfig)
    vllm: VllmEngineConfig = Field(default_factory=VllmEngineConfig)
    sglang: SglangEngineConfig = Field(default_factory=SglangEngineConfig)


class SupervisorConfig(_Block):
    """Engine processes."""

    work_dir: str = Field(default="/var/lib/llmgw-agent", description="Shard records, logs and state.")
    log_lines: int = Field(default=512, ge=10, description="Lines of each engine's output kept for reports.")
    stop_timeout: Duration = Field(default=60.0, description="Grace after SIGTERM before SIGKILL.")
    health_interval: Duration = Field(
        default=2.0,
        description="The longest wait between health checks of a starting engine: they begin 50ms apart and "
        "grow by a quarter each time up to this, so an engine that loads in a moment is known ready in a "
        "moment. A ready engine is watched by the gateway's own checks.",
    )
    rendezvous_timeout: Duration = Field(default=600.0, description="How long a worker waits for its leader's port.")
    stop_engines_on_exit: bool = Field(
        default=False,
        description="Stop every engine when the agent stops (`llmgw up` sets it); by default engines keep serving "
        "and a restarted agent adopts them.",
    )


class AgentConfig(_Block):
    """agent.yaml."""

    server: str | None = Field(default=None, description="The control plane's agent address, e.g. cp.example:7443.")
    servers: list[str] = Field(
        default_factory=list, description="Several control planes, tried in turn (after `server`)."
    )
    tls: AgentTLS | None = Field(
        default_factory=AgentTLS,
        description="Mutual TLS with the control plane; null means plaintext, for one trusted machine only.",
    )
    node_id: str | None = Field(default=None, description="Default: the hostname (the certificate's common name).")
    mgmt_addr: str | None = Field(
        default=None, description="Default: the address the kernel uses towards the control plane."
    )
    mgmt_interface: str | None = Field(default=None, description="Default: the interface holding mgmt_addr.")
    labels: dict[str, str] = Field(default_factory=dict, description="Free-form labels for profiles' node_selector.")
    model_dirs: list[str] = Field(
        default_factory=list, description="Where weights may already be; the weights cache is always added."
    )
    weights_cache: str = Field(default=DEFAULT_WEIGHTS_CACHE, description="Where fetched weights land.")
    engines_dir: str = Field(default=DEFAULT_ENGINES_DIR, description="Where engines are installed.")
    fabrics: list[FabricDecl] = Field(default_factory=list, description="Fabrics this node's adapters belong to.")
    heartbeat_interval: Duration = Field(default=5.0, description="How often the node reports.")
    subnet_manager_interval: Duration = Field(
        default=60.0,
        gt=0,
        description="How often the subnet managers behind the node's ACTIVE InfiniBand ports are read "
        "(sminfo, saquery) and reported with the next heartbeat.",
    )
    reconnect_base: Duration = Field(
        default=1.0,
        description="First wait before reconnecting (jittered); also the most a lost session waits before its first redial.",
    )
    reconnect_max: Duration = Field(default=30.0, description="Longest wait before reconnecting.")
    release_base: str | None = Field(
        default=None,
        description="Where llama.cpp release archives are fetched; default GitHub or what the control plane names.",
    )
    discovery: DiscoveryConfig = Field(default_factory=DiscoveryConfig)
    engines: EnginesConfig = Field(default_factory=EnginesConfig)
    supervisor: SupervisorConfig = Field(default_factory=SupervisorConfig)

    @model_validator(mode="after")
    def _checks(self) -> AgentConfig:
        try:
            addresses = self.addresses()
        except ValueError as exc:
            raise ValueError(f"server/servers: {exc}") from None
        if not addresses:
            raise ValueError("server: no control plane address; set server: HOST:7443 (or servers: [...])")
        seen: dict[str, str] = {}
        for i, f in enumerate(self.fabrics):
            for hca in f.hcas:
                if hca in seen:
                    raise ValueError(
                        f"fabrics[{i}].hcas: {hca} is already on fabric {seen[hca]}; an adapter belongs to one fabric"
                    )
                seen[hca] = f.name
        return self

    def addresses(self) -> list[str]:
        """server first, then servers, duplicates removed, scheme added per the TLS setting."""
        out: list[str] = []
        scheme = "https" if self.tls is not None else "http"
        for raw in [*([self.server] if self.server else []), *self.servers]:
            addr = raw.strip().rstrip("/")
            if "://" not in addr:
                addr = f"{scheme}://{addr}"
            parts = urlsplit(addr)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f'"{raw}" is not a control plane address; write host:port, e.g. cp.example:7443')
            if parts.scheme != scheme:
                raise ValueError(
                    f'"{raw}" is {parts.scheme} but TLS is {"configured" if self.tls else "off (tls: null)"}; '
                    "every address must match the TLS setting"
                )
            if addr not in out:
                out.append(addr)
        return out


def parse_agent_config(data: Any, source: str = "agent.yaml") -> AgentConfig:
    return validate(AgentConfig, data, source, "server:, tls:")


def load_agent_config(path: str | os.PathLike[str]) -> AgentConfig:
    return parse_agent_config(
        read_yaml(path, "agent.yaml", empty="write at least `server: HOST:7443` in it"), str(path)
    )
