"""vLLM: `vllm serve`, on one node or across several (its own mp launch, or Ray)."""

from __future__ import annotations

import re

from llmgw.agent.engines.base import EngineAdapter
from llmgw.agent.engines.common import (
    field_args,
    finish_env,
    gpu_env,
    hostport,
    nccl_env,
    python_engine_problems,
)
from llmgw.agent.engines.plan import Command, MetricNames
from llmgw.agent.engines.spec import EngineSettings, ShardLaunch

_OWNED = {
    "--model": "the model source",
    "--host": "the shard's address",
    "--port": "the shard's port",
    "--served-model-name": "the served name",
    "--tensor-parallel-size": "the profile's tp",
    "-tp": "the profile's tp",
    "--distributed-executor-backend": "the launch mode",
    "--nnodes": "the profile's nodes",
    "--node-rank": "the shard's rank",
    "--master-addr": "the leader's address",
    "--master-port": "the leader's port",
    "--headless": "the shard's rank",
}
_DTYPE = ("--dtype",)
_QUANT = ("--quantization", "-q")
_CTX = ("--max-model-len",)
_PARALLEL = ("--max-num-seqs",)


def _fields(launch: ShardLaunch) -> list[tuple[tuple[str, ...], object, str]]:
    p = launch.profile
    return [
        (_DTYPE, p.dtype, "dtype"),
        (_QUANT, p.quantization, "quantization"),
        (_CTX, p.ctx_size, "ctx_size"),
        (_PARALLEL, p.parallel, "parallel"),
    ]


# vLLM reports usage to its makers unless told not to; nothing leaves the cluster.
_QUIET = {
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    # Engine output is the only diagnosis when loading fails; see it as it happens.
    "PYTHONUNBUFFERED": "1",
}


class VLLM(EngineAdapter):
    name = "vllm"
    label = "vLLM"
    metrics = MetricNames(
        running=("vllm:num_requests_running",),
        waiting=("vllm:num_requests_waiting",),
        kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    )
    # `serve --help` of recent releases is an 80-line list of groups;
    # `--help=all` runs to well over a thousand.
    min_help_lines = 150
    # Read since 0.4.1 when --api-key is not given; its help does not list variables.
    api_key_env = "VLLM_API_KEY"

    def problems(self, launch: ShardLaunch, settings: EngineSettings) -> tuple[list[str], list[str]]:
        return python_engine_problems(launch, self.label, _OWNED, _fields(launch), _QUANT)

    def commands(self, launch: ShardLaunch, settings: EngineSettings) -> list[Command]:
        p, g = launch.profile, launch.group
        base_env = {**finish_env(launch, _QUIET, gpu_env(launch), nccl_env(launch)), **self.key_env(launch)}
        args = [
            settings.vllm_bin,
            "serve",
            launch.model,
            "--host",
            launch.host,
            "--port",
            str(launch.port),
            "--served-model-name",
            launch.served_name,
            "--tensor-parallel-size",
            str(p.tp),
        ]
        args += field_args(p.extra_args, _fields(launch))

        if not launch.multi_node:
            return [Command(argv=tuple(args + p.extra_args), env=base_env)]

        assert g.leader_addr is not None and g.leader_port is not None  # checked before
        if settings.vllm_launch_mode == "mp":
            # vLLM's own multi-node launch: the same serve on every node with its
            # rank and the leader's address; workers run headless (their GPUs,
            # no API server). VLLM_HOST_IP is this node's own address for vLLM
            # to find itself, so it is left to vLLM: giving workers the
            # leader's made every worker announce itself as the leader.
            args += [
                "--distributed-executor-backend",
                "mp",
                "--nnodes",
                str(p.nodes),
                "--node-rank",
                str(g.rank),
                "--master-addr",
                g.leader_addr,
                "--master-port",
                str(g.leader_port),
            ]
            if not launch.leader:
                args.append("--headless")
            return [Command(argv=tuple(args + p.extra_args), env=base_env)]

        # Ray: the leader runs a Ray head beside the server; a worker runs only
        # the Ray join, and vLLM's workers on it are spawned by that raylet,
        # inheriting its environment, which is why the join gets NCCL's too.
        head = hostport(g.leader_addr, g.leader_port)
        ray_env = {"RAY_USAGE_STATS_ENABLED": "0"}
        ray = settings.ray()
        leader_port = (g.leader_addr, g.leader_port)
        if launch.leader:
            sidecar = Command(
                argv=(
                    ray,
                    "start",
                    "--head",
                    "--node-ip-address",
                    g.leader_addr,
                    "--port",
                    str(g.leader_port),
                    "--num-gpus",
                    str(len(p.gpu_ids)),
                    "--block",
                    "--disable-usage-stats",
                ),
                env=finish_env(
                    launch, _QUIET, ray_env, gpu_env(launch), nccl_env(launch), {"VLLM_HOST_IP": g.leader_addr}
                ),
                sidecar=True,
            )
            serve = Command(
                argv=tuple(args + ["--distributed-executor-backend", "ray"] + p.extra_args),
                env={
                    **finish_env(
                        launch,
                        _QUIET,
                        gpu_env(launch),
                        nccl_env(launch),
                        {"VLLM_HOST_IP": g.leader_addr, "RAY_ADDRESS": head},
                    ),
                    **self.key_env(launch),
                },
                wait_for=leader_port,
            )
            return [sidecar, serve]
        join = [ray, "start", "--address", head, "--num-gpus", str(len(p.gpu_ids)), "--block", "--disable-usage-stats"]
        own = {}
        if launch.node.address:
            # Each node's own address: the leader's here would make two nodes claim one IP.
            join += ["--node-ip-address", launch.node.address]
            own = {"VLLM_HOST_IP": launch.node.address}
        return [
            Command(
                argv=tuple(join),
                env=finish_env(launch, _QUIET, ray_env, gpu_env(launch), nccl_env(launch), own),
                wait_for=leader_port,
            )
        ]

    def help_commands(self, bin_path: str) -> list[list[str]]:
        # Recent vLLM prints only its option groups for a bare --help; older
        # releases reject "--help=all" and print everything for --help.
        return [[bin_path, "serve", "--help=all"], [bin_path, "serve", "--help"]]

    def engine_args(self, argv: tuple[str, ...]) -> list[str]:
        return list(argv[3:])

    def help_problems(self, text: str) -> list[str]:
        if "--help=all" in text and not re.search(r"(?<![\w-])--tensor-parallel-size(?![\w-])", text):
            return [
                "it is vLLM's short help, which lists option groups and not their flags; run `vllm serve --help=all`"
            ]
        return []
