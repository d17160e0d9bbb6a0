"""What an adapter hands the supervisor: processes to run, how to tell they are ready, what to scrape."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmgw.agent.engines.errors import EngineError


class LaunchRefused(EngineError, ValueError):
    """A shard that must not be started, with every reason found (not just the first)."""

    def __init__(self, shard_id: str, reasons: list[str]):
        self.shard_id = shard_id
        self.reasons = list(reasons)
        super().__init__(f"shard {shard_id} not started: " + "; ".join(self.reasons))


@dataclass(frozen=True, slots=True)
class Command:
    """One process of a shard.

    `env` holds only what llmgw sets; the supervisor lays it over the agent's
    own environment. No shell is involved: argv items reach the engine as they are.
    """

    argv: tuple[str, ...]
    env: dict[str, str] = field(repr=False)  # may hold the engine's key
    # A sidecar lives as long as the shard and dies with it; the last command
    # of a plan is never one, and its exit is the shard's.
    sidecar: bool = False
    # (host, port) that must accept connections before this starts: a Ray join
    # finds no head otherwise and exits, failing the replica.
    wait_for: tuple[str, int] | None = None


@dataclass(frozen=True, slots=True)
class MetricNames:
    """Prometheus series meaning running, waiting and KV-cache use (0-1).

    Each tuple lists names an engine has used across versions, newest first;
    an empty tuple means the engine publishes no such series.
    """

    running: tuple[str, ...]
    waiting: tuple[str, ...]
    kv_usage: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class HealthCheck:
    """Readiness is two questions: is the process up (/health), are the weights loaded (/v1/models lists the name)."""

    host: str
    port: int
    model: str
    health_path: str = "/health"
    models_path: str = "/v1/models"
    # The engine's key: /v1/models and /metrics want it (llama-server leaves /health open).
    api_key: str | None = field(default=None, repr=False)

    def url(self, path: str) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}{path}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(frozen=True, slots=True)
class LaunchPlan:
    engine: str
    shard_id: str
    commands: tuple[Command, ...]
    # Only the leader of a multi-node replica serves HTTP; a worker is judged
    # by staying alive, and `health` is None for it.
    serves_http: bool
    health: HealthCheck | None
    metrics: MetricNames
    warnings: tuple[str, ...] = field(default_factory=tuple)

    @property
    def main(self) -> Command:
        return self.commands[-1]

    @property
    def sidecars(self) -> tuple[Command, ...]:
        return self.commands[:-1]
