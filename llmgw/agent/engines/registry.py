"""Engine names to adapters, and the one call the agent makes to plan a shard."""

from __future__ import annotations

from llmgw.agent.engines.base import EngineAdapter
from llmgw.agent.engines.errors import EngineError
from llmgw.agent.engines.llamacpp import LlamaCpp
from llmgw.agent.engines.plan import LaunchPlan, LaunchRefused, MetricNames
from llmgw.agent.engines.sglang import SGLang
from llmgw.agent.engines.spec import EngineSettings, ShardLaunch
from llmgw.agent.engines.vllm import VLLM

ADAPTERS: dict[str, EngineAdapter] = {a.name: a for a in (LlamaCpp(), VLLM(), SGLang())}


class UnknownEngine(EngineError, ValueError):
    def __init__(self, engine: str):
        self.engine = engine
        super().__init__(f'unknown engine "{engine}": llmgw runs {", ".join(ADAPTERS)}; fix the profile\'s engine')


def adapter_for(engine: str) -> EngineAdapter:
    try:
        return ADAPTERS[engine]
    except KeyError:
        raise UnknownEngine(engine) from None


def plan_shard(launch: ShardLaunch, settings: EngineSettings | None = None) -> LaunchPlan:
    """Check a launch and build its processes; raises LaunchRefused naming every reason."""
    try:
        adapter = adapter_for(launch.engine)
    except UnknownEngine as exc:
        raise LaunchRefused(launch.shard_id, [str(exc)]) from None
    return adapter.plan(launch, settings)


def metric_names(engine: str) -> MetricNames:
    return adapter_for(engine).metrics
