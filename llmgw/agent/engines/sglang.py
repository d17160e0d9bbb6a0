"""SGLang: `python -m sglang.launch_server`, on one node or across several."""

from __future__ import annotations

from llmgw.agent.engines.base import EngineAdapter
from llmgw.agent.engines.common import (
    field_args,
    finish_env,
    gpu_env,
    has_flag,
    hostport,
    nccl_env,
    python_engine_problems,
)
from llmgw.agent.engines.plan import Command, MetricNames
from llmgw.agent.engines.spec import EngineSettings, ShardLaunch

_OWNED = {
    "--model-path": "the model source",
    "--model": "the model source",
    "--host": "the shard's address",
    "--port": "the shard's port",
    "--served-model-name": "the served name",
    # --tp is no flag of SGLang's: argparse takes it as an abbreviation of --tp-size.
    "--tp-size": "the profile's tp",
    "--tensor-parallel-size": "the profile's tp",
    "--tp": "the profile's tp",
    "--nnodes": "the profile's nodes",
    "--node-rank": "the shard's rank",
    "--dist-init-addr": "the leader's address and port",
    "--nccl-init-addr": "the leader's address and port",
}
_DTYPE = ("--dtype",)
_QUANT = ("--quantization",)
_CTX = ("--context-length",)
_PARALLEL = ("--max-running-requests",)


def _fields(launch: ShardLaunch) -> list[tuple[tuple[str, ...], object, str]]:
    p = launch.profile
    return [
        (_DTYPE, p.dtype, "dtype"),
        (_QUANT, p.quantization, "quantization"),
        (_CTX, p.ctx_size, "ctx_size"),
        (_PARALLEL, p.parallel, "parallel"),
    ]


_QUIET = {"DO_NOT_TRACK": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "PYTHONUNBUFFERED": "1"}


class SGLang(EngineAdapter):
    name = "sglang"
    label = "SGLang"
    metrics = MetricNames(
        running=("sglang:num_running_reqs",), waiting=("sglang:num_queue_reqs",), kv_usage=("sglang:token_usage",)
    )
    min_help_lines = 150

    def problems(self, launch: ShardLaunch, settings: EngineSettings) -> tuple[list[str], list[str]]:
        return python_engine_problems(launch, self.label, _OWNED, _fields(launch), _QUANT)

    def commands(self, launch: ShardLaunch, settings: EngineSettings) -> list[Command]:
        p, g = launch.profile, launch.group
        args = [
            settings.sglang_python,
            "-m",
            "sglang.launch_server",
            "--model-path",
            launch.model,
            "--host",
            launch.host,
            "--port",
            str(launch.port),
            "--served-model-name",
            launch.served_name,
            # The flag's real name; "--tp" only works as an argparse abbreviation.
            "--tp-size",
            str(p.tp),
        ]
        if not has_flag(p.extra_args, ("--enable-metrics",)):
            # SGLang serves /metrics only when asked.
            args.append("--enable-metrics")
        args += field_args(p.extra_args, _fields(launch))
        if launch.multi_node:
            assert g.leader_addr is not None and g.leader_port is not None  # checked before
            # Rank 0 holds the rendezvous and the only API server; the others
            # join it and serve nothing over HTTP.
            args += [
                "--nnodes",
                str(p.nodes),
                "--node-rank",
                str(g.rank),
                "--dist-init-addr",
                hostport(g.leader_addr, g.leader_port),
            ]
        # SGLang reads its key from no environment variable, so it is on the command line;
        # the supervisor masks it wherever it shows one.
        args += self.key_args(launch)
        args += p.extra_args
        return [Command(argv=tuple(args), env=finish_env(launch, _QUIET, gpu_env(launch), nccl_env(launch)))]

    def help_commands(self, bin_path: str) -> list[list[str]]:
        return [[bin_path, "-m", "sglang.launch_server", "--help"]]

    def engine_args(self, argv: tuple[str, ...]) -> list[str]:
        return list(argv[3:])
