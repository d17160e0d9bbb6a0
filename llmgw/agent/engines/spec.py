"""What one shard launch needs to know, independent of the wire protocol.

The agent's protocol handler maps a start-shard message plus this node's
discovered facts onto a `ShardLaunch`; everything in this package reads only
that. Keeping the protocol out means the command builders can be tested (and
shown by doctor) without a control plane.
"""

from __future__ import annotations

import os
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from llmgw.config.agent import EnginesConfig

ENGINE_NAMES = ("llamacpp", "vllm", "sglang")

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_CC = re.compile(r"^\d+\.\d+$")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GPU(_Model):
    """One GPU on this node, as discovery reported it."""

    index: int = Field(ge=0, description="nvidia-smi's index (PCI bus order).")
    name: str = Field(min_length=1, description='The driver\'s name, e.g. "NVIDIA H100 80GB HBM3".')
    compute_capability: str | None = Field(default=None, description='"major.minor", e.g. "8.9"; None when unknown.')

    @field_validator("compute_capability")
    @classmethod
    def _cc(cls, v: str | None) -> str | None:
        if v is not None and not _CC.match(v.strip()):
            raise ValueError(f'"{v}" is not a compute capability; write major.minor, e.g. "8.9"')
        return v.strip() if v else v

    def cc(self) -> tuple[int, int] | None:
        if not self.compute_capability:
            return None
        major, minor = self.compute_capability.split(".")
        return int(major), int(minor)


class Adapter(_Model):
    """An InfiniBand/RoCE adapter port of the fabric chosen for this replica."""

    name: str = Field(min_length=1, description="e.g. mlx5_0")
    port: int | None = Field(default=None, ge=1, description="Port number; None lets NCCL use any port of the adapter.")
    link_layer: Literal["InfiniBand", "Ethernet"] = Field(default="InfiniBand", description="Ethernet means RoCE.")
    gid_index: int | None = Field(
        default=None,
        description="RoCE only: the RoCE v2 GID index holding an IPv4 address; None or -1 when there is none.",
    )

    @property
    def roce(self) -> bool:
        return self.link_layer == "Ethernet"


class NodeFacts(_Model):
    """What this node knows about itself that a launch depends on."""

    gpus: list[GPU] = Field(default_factory=list, description="Every GPU on this node.")
    nvlink_domain: str | None = Field(
        default=None, description='Multi-node NVLink domain "<cluster uuid>/<clique id>", None outside one.'
    )
    fabric_adapters: list[Adapter] = Field(
        default_factory=list, description="The chosen fabric's adapters on this node, and no others."
    )
    interface: str | None = Field(default=None, description="This node's own management interface, e.g. ens3.")
    address: str | None = Field(default=None, description="This node's management address.")


class Group(_Model):
    """This shard's place in its replica."""

    rank: int = Field(default=0, ge=0, description="0 is the leader, the only rank serving HTTP.")
    leader_addr: str | None = Field(default=None, description="The leader's management address (rendezvous).")
    leader_port: int | None = Field(default=None, ge=1, le=65535, description="The leader's rendezvous port.")
    gpu_names: list[str] = Field(
        default_factory=list,
        description="GPU names of the other shards of the replica, when the control plane sends them.",
    )


class Profile(_Model):
    """How the catalog asks the model to be run."""

    tp: int = Field(default=1, ge=1, description="Tensor-parallel size across the whole replica.")
    nodes: int = Field(default=1, ge=1, description="Nodes the replica spans.")
    gpu_ids: list[int] = Field(default_factory=list, description="GPU indexes on this node; empty means CPU.")
    ctx_size: int | None = Field(default=None, ge=1, description="Context length (llama.cpp: shared across its slots).")
    parallel: int | None = Field(default=None, ge=1, description="Requests served at once.")
    dtype: str | None = Field(default=None, description="vLLM/SGLang --dtype, e.g. bfloat16.")
    quantization: str | None = Field(default=None, description="vLLM/SGLang --quantization, e.g. fp8, awq.")
    extra_args: list[str] = Field(
        default_factory=list, description="Passed to the engine as they are, after llmgw's own."
    )
    env: dict[str, str] = Field(default_factory=dict, description="Set last, overriding anything llmgw sets.")

    @field_validator("gpu_ids")
    @classmethod
    def _gpu_ids(cls, v: list[int]) -> list[int]:
        seen: set[int] = set()
        for i in v:
            if i < 0:
                raise ValueError(f"GPU index {i} is negative; use nvidia-smi's indexes (0, 1, ...)")
            if i in seen:
                raise ValueError(f"GPU {i} is listed twice")
            seen.add(i)
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for k in v:
            if not _ENV_NAME.match(k):
                raise ValueError(
                    f'"{k}" is not an environment variable name (letters, digits and _, not starting with a digit)'
                )
        return v


class ShardLaunch(_Model):
    """One shard to start on this node."""

    shard_id: str = Field(min_length=1)
    engine: str = Field(description="llamacpp, vllm or sglang.")
    model: str = Field(min_length=1, description="A local file or directory, or (vLLM/SGLang) a model repo id.")
    served_name: str = Field(min_length=1, description="The name clients ask for; what /v1/models must list.")
    host: str = Field(default="0.0.0.0", min_length=1, description="Address the engine's HTTP server binds.")
    port: int = Field(ge=1, le=65535, description="The engine's HTTP port.")
    profile: Profile = Field(default_factory=Profile)
    group: Group = Field(default_factory=Group)
    node: NodeFacts = Field(default_factory=NodeFacts)
    fabric: str | None = Field(
        default=None,
        description='The replica\'s fabric as placed: a fabric name, or "nvl:<domain>" inside an NVLink domain.',
    )
    api_key: str | None = Field(
        default=None,
        repr=False,
        description="The replica's secret, which the engine requires on every request; None: the engine asks for none.",
    )

    @property
    def multi_node(self) -> bool:
        return self.profile.nodes > 1

    @property
    def leader(self) -> bool:
        return self.group.rank == 0

    @property
    def in_nvlink_domain(self) -> bool:
        return self.multi_node and (self.fabric or "").startswith("nvl:")

    def gpus(self) -> list[GPU]:
        """This shard's GPUs, in the profile's order (unknown indexes left out; validation names them)."""
        by_index = {g.index: g for g in self.node.gpus}
        return [by_index[i] for i in self.profile.gpu_ids if i in by_index]


class EngineSettings(_Model):
    """Where this node's engines are and node-wide defaults (agent.yaml `engines:` plus what was installed)."""

    llamacpp_bin: str = "llama-server"
    llamacpp_parallel: int = Field(default=4, ge=1, description="--parallel when a profile does not say.")
    vllm_bin: str = "vllm"
    vllm_launch_mode: Literal["mp", "ray"] = "mp"
    ray_bin: str | None = Field(default=None, description="Default: `ray` beside vllm_bin, else on PATH.")
    sglang_python: str = "python3"

    @classmethod
    def from_config(
        cls, engines: EnginesConfig | None = None, installed: dict[str, str] | None = None
    ) -> EngineSettings:
        """agent.yaml's binaries first (they are used "instead of installing one"), then
        installed builds (they were seen to run), then PATH."""
        engines = engines or EnginesConfig()
        installed = installed or {}
        return cls(
            llamacpp_bin=engines.llamacpp.bin or installed.get("llamacpp") or "llama-server",
            llamacpp_parallel=engines.llamacpp.parallel,
            vllm_bin=engines.vllm.bin or installed.get("vllm") or "vllm",
            vllm_launch_mode=engines.vllm.launch_mode,
            sglang_python=engines.sglang.python or installed.get("sglang") or "python3",
        )

    def ray(self) -> str:
        if self.ray_bin:
            return self.ray_bin
        # Ray comes with vLLM's own environment; the one on PATH may be another version.
        if os.sep in self.vllm_bin:
            return os.path.join(os.path.dirname(self.vllm_bin), "ray")
        return "ray"
