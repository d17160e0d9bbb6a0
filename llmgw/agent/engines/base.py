"""The shape every engine adapter has, and the steps they share."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from llmgw.agent.engines.common import common_problems, has_flag
from llmgw.agent.engines.plan import Command, HealthCheck, LaunchPlan, LaunchRefused, MetricNames
from llmgw.agent.engines.spec import GPU, EngineSettings, Group, NodeFacts, Profile, ShardLaunch


def probe_host(bind: str) -> str:
    """Where the agent reaches an engine bound to `bind` (a wildcard bind is reached on loopback)."""
    if bind in ("", "0.0.0.0", "*"):
        return "127.0.0.1"
    if bind in ("::", "[::]"):
        return "::1"
    return bind.strip("[]")


class EngineAdapter(ABC):
    name: ClassVar[str]
    label: ClassVar[str]  # what a person calls it, for messages
    metrics: ClassVar[MetricNames]
    health_path: ClassVar[str] = "/health"
    models_path: ClassVar[str] = "/v1/models"
    # A complete --help is far longer than this; shorter means it was cut.
    min_help_lines: ClassVar[int] = 150
    # Where the engine reads the replica's key. An environment variable keeps it out of
    # /proc/<pid>/cmdline, which every user on the node can read (environ is the owner's
    # alone); None: the engine takes it only as --api-key.
    api_key_env: ClassVar[str | None] = None
    # Whether --help names the environment variables it reads, so engine-check can prove
    # this build still reads api_key_env (one that did not would serve without a key).
    help_lists_env: ClassVar[bool] = False
    # Profile extra args that would set another key than the one the gateway sends.
    api_key_flags: ClassVar[tuple[str, ...]] = ("--api-key",)

    def plan(self, launch: ShardLaunch, settings: EngineSettings | None = None) -> LaunchPlan:
        """The processes for one shard, after every check; raises LaunchRefused with all the reasons."""
        settings = settings or EngineSettings()
        problems = common_problems(launch) + self.key_problems(launch)
        more, warnings = self.problems(launch, settings)
        problems += more
        if problems:
            raise LaunchRefused(launch.shard_id, problems)
        commands = self.commands(launch, settings)
        serves = self.serves_http(launch)
        health = (
            HealthCheck(
                probe_host(launch.host),
                launch.port,
                launch.served_name,
                self.health_path,
                self.models_path,
                launch.api_key,
            )
            if serves
            else None
        )
        return LaunchPlan(
            engine=self.name,
            shard_id=launch.shard_id,
            commands=tuple(commands),
            serves_http=serves,
            health=health,
            metrics=self.metrics,
            warnings=tuple(warnings),
        )

    def serves_http(self, launch: ShardLaunch) -> bool:
        # Both multi-node engines put the API server on rank 0 only.
        return launch.leader

    # --- the replica's key: only the process serving HTTP needs it ---

    def key_env(self, launch: ShardLaunch) -> dict[str, str]:
        if launch.api_key and self.api_key_env and self.serves_http(launch):
            return {self.api_key_env: launch.api_key}
        return {}

    def key_args(self, launch: ShardLaunch) -> list[str]:
        if launch.api_key and not self.api_key_env and self.serves_http(launch):
            return ["--api-key", launch.api_key]
        return []

    def key_problems(self, launch: ShardLaunch) -> list[str]:
        """A profile must not set the engine's key: the gateway sends the replica's own and
        would be refused, or, without one, the engine would answer anyone."""
        p = launch.profile
        out = [
            f"the profile's extra args set {f}, which llmgw sets itself (the replica's own key, which only the "
            "gateway sends); remove it from the profile"
            for f in self.api_key_flags
            if has_flag(p.extra_args, [f])
        ]
        if self.api_key_env and self.api_key_env in p.env:
            out.append(
                f"the profile's env sets {self.api_key_env}, the engine's key, which llmgw sets itself (the "
                "replica's own key, which only the gateway sends); remove it from the profile"
            )
        return out

    def checked_env(self) -> list[str]:
        """Environment variables engine-check looks for in the help (when the help lists them)."""
        return [self.api_key_env] if self.api_key_env and self.help_lists_env else []

    @abstractmethod
    def problems(self, launch: ShardLaunch, settings: EngineSettings) -> tuple[list[str], list[str]]:
        """Engine-specific refusals and warnings."""

    @abstractmethod
    def commands(self, launch: ShardLaunch, settings: EngineSettings) -> list[Command]:
        """The processes, sidecars first; assumes the launch passed the checks."""

    # --- engine-check ---

    @abstractmethod
    def help_commands(self, bin_path: str) -> list[list[str]]:
        """Ways to ask for the full --help, best first (a later one is tried when an earlier is refused)."""

    @abstractmethod
    def engine_args(self, argv: tuple[str, ...]) -> list[str]:
        """The part of a main command's argv the engine's own parser reads."""

    def help_problems(self, text: str) -> list[str]:
        """Signs particular to this engine's help that it is not the complete list."""
        return []

    def sample_launches(self) -> list[ShardLaunch]:
        """The widest launches llmgw builds (multi-node leader and worker where the engine spans nodes)."""
        gpus = [GPU(index=i, name="NVIDIA H100 80GB HBM3", compute_capability="9.0") for i in range(2)]
        return [
            ShardLaunch(
                shard_id="engine-check",
                engine=self.name,
                model="/models/m",
                served_name="m",
                port=8000,
                profile=Profile(
                    tp=4, nodes=2, gpu_ids=[0, 1], ctx_size=8192, parallel=8, dtype="bfloat16", quantization="fp8"
                ),
                group=Group(rank=rank, leader_addr="10.0.0.1", leader_port=29500),
                node=NodeFacts(gpus=gpus, interface="eth0"),
                fabric="ib",
                api_key="engine-check",
            )
            for rank in (0, 1)
        ]

    def check_flags(self) -> list[str]:
        """Every flag llmgw passes this engine, from the real builder so the two cannot drift."""
        settings = EngineSettings(vllm_launch_mode="mp")
        flags: list[str] = []
        for launch in self.sample_launches():
            for a in self.engine_args(self.commands(launch, settings)[-1].argv):
                name = a.split("=", 1)[0]
                if a.startswith("-") and not _number(a) and name not in flags:
                    flags.append(name)
        return flags


def _number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False
