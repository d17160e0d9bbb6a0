"""Engine adapters: the exact command and environment for a shard, checks before launch, health and metric names.

    plan = plan_shard(ShardLaunch(...), EngineSettings.from_config(cfg.engines, installed))
    for cmd in plan.commands: ...   # sidecars first; the last one's exit is the shard's

Nothing here starts a process except `run_engine_check`, which runs an
engine's --help.
"""

from llmgw.agent.engines.base import EngineAdapter, probe_host
from llmgw.agent.engines.check import (
    EngineCheck,
    EngineCheckReport,
    engine_check,
    flag_present,
    run_engine_check,
    truncation_signs,
)
from llmgw.agent.engines.common import nccl_env, quantization_of
from llmgw.agent.engines.errors import EngineError
from llmgw.agent.engines.health import Readiness, listed_models, lists_model, probe
from llmgw.agent.engines.llamacpp import resolve_gguf
from llmgw.agent.engines.plan import Command, HealthCheck, LaunchPlan, LaunchRefused, MetricNames
from llmgw.agent.engines.registry import ADAPTERS, UnknownEngine, adapter_for, metric_names, plan_shard
from llmgw.agent.engines.spec import (
    ENGINE_NAMES,
    GPU,
    Adapter,
    EngineSettings,
    Group,
    NodeFacts,
    Profile,
    ShardLaunch,
)

__all__ = [
    "ADAPTERS",
    "ENGINE_NAMES",
    "GPU",
    "Adapter",
    "Command",
    "EngineAdapter",
    "EngineCheck",
    "EngineCheckReport",
    "EngineError",
    "EngineSettings",
    "Group",
    "HealthCheck",
    "LaunchPlan",
    "LaunchRefused",
    "MetricNames",
    "NodeFacts",
    "Profile",
    "Readiness",
    "ShardLaunch",
    "UnknownEngine",
    "adapter_for",
    "engine_check",
    "flag_present",
    "listed_models",
    "lists_model",
    "metric_names",
    "nccl_env",
    "plan_shard",
    "probe",
    "probe_host",
    "quantization_of",
    "resolve_gguf",
    "run_engine_check",
    "truncation_signs",
]
