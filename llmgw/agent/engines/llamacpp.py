"""llama.cpp's llama-server: one process, one node, CPU or the GPUs it is given."""

from __future__ import annotations

import os

from llmgw.agent.engines.base import EngineAdapter
from llmgw.agent.engines.common import field_args, finish_env, gpu_env, has_flag, owned_flag_problems, twice_problems
from llmgw.agent.engines.errors import EngineError
from llmgw.agent.engines.plan import Command, MetricNames
from llmgw.agent.engines.spec import EngineSettings, Profile, ShardLaunch

_OWNED = {
    "--model": "the model source",
    "-m": "the model source",
    "--host": "the shard's address",
    "--port": "the shard's port",
    "--alias": "the served name",
    "-a": "the served name",
}
_CTX = ("--ctx-size", "-c")
_PARALLEL = ("--parallel", "-np")


class NoWeights(EngineError, ValueError):
    pass


def resolve_gguf(path: str) -> str:
    """The file llama-server is given for a model source.

    A multi-file model arrives as the directory it was fetched into; given the
    first part of a split GGUF, llama.cpp finds the rest beside it, and parts
    are named -00001-of-0000N so the lexically first is the first part. A file
    passes through, and so does a path that is not there: the engine's own
    "no such file" names it as well as anything here could.
    """
    if not os.path.isdir(path):
        return path
    names = sorted(e.name for e in os.scandir(path) if e.is_file() and e.name.lower().endswith(".gguf"))
    if not names:
        raise NoWeights(
            f"{path} holds no .gguf file, and llama.cpp loads only GGUF models; "
            "point the model's source at a .gguf file or a directory holding one"
        )
    return os.path.join(path, names[0])


class LlamaCpp(EngineAdapter):
    name = "llamacpp"
    label = "llama.cpp"
    # kv_cache_usage_ratio is published by older builds only.
    metrics = MetricNames(
        running=("llamacpp:requests_processing",),
        waiting=("llamacpp:requests_deferred",),
        kv_usage=("llamacpp:kv_cache_usage_ratio",),
    )
    # The real help is about 730 lines; the first incident was one cut to 400.
    min_help_lines = 500
    api_key_env = "LLAMA_API_KEY"
    help_lists_env = True  # "(env: LLAMA_API_KEY)" under --api-key
    api_key_flags = ("--api-key", "--api-key-file")

    def problems(self, launch: ShardLaunch, settings: EngineSettings) -> tuple[list[str], list[str]]:
        p = launch.profile
        out: list[str] = []
        # llama.cpp splits across local GPUs by its own mechanism, not the one
        # placement counts; accepting these would start a replica that serves
        # from one machine while the catalog believes it spans several.
        if p.nodes > 1:
            out.append(
                f"llama.cpp cannot span nodes and this profile asks for {p.nodes}; "
                "use vllm or sglang for a multi-node replica, or set nodes to 1"
            )
        if p.tp > 1:
            out.append(
                f"llama.cpp does not do tensor parallelism the way llmgw places it, and this profile asks for "
                f"tp {p.tp}; set tp to 1 (llama.cpp still spreads layers over every GPU it is given) "
                "or use vllm or sglang"
            )
        if p.quantization:
            out.append(
                f"llama.cpp takes its quantization from the GGUF file, so quantization {p.quantization} "
                "cannot be applied; remove it from the profile and pick a GGUF of that quantization"
            )
        if p.dtype:
            out.append(
                f"llama.cpp takes its types from the GGUF file, so dtype {p.dtype} cannot be applied; "
                "remove it from the profile"
            )
        if "," in launch.served_name:
            out.append(
                f'served name "{launch.served_name}" contains a comma, which llama.cpp reads as several '
                "names; choose a name without one"
            )
        out += owned_flag_problems(p.extra_args, _OWNED)
        out += twice_problems(p.extra_args, [(_CTX, p.ctx_size, "ctx_size"), (_PARALLEL, p.parallel, "parallel")])
        parallel = p.parallel or settings.llamacpp_parallel
        if p.ctx_size is not None and p.ctx_size < parallel:
            out.append(
                f"ctx_size {p.ctx_size} is smaller than parallel {parallel}: llama.cpp divides its context "
                "among its slots and each would get nothing; raise ctx_size or lower parallel"
            )
        try:
            resolve_gguf(launch.model)
        except (NoWeights, OSError) as exc:
            out.append(str(exc))
        return out, []

    def commands(self, launch: ShardLaunch, settings: EngineSettings) -> list[Command]:
        p = launch.profile
        extra = p.extra_args
        args = [
            settings.llamacpp_bin,
            "--model",
            resolve_gguf(launch.model),
            "--host",
            launch.host,
            "--port",
            str(launch.port),
            # /v1/models lists this name, which is how readiness finds the model.
            "--alias",
            launch.served_name,
        ]
        args += field_args(extra, [(_CTX, p.ctx_size, "ctx_size")])
        if not has_flag(extra, _PARALLEL):
            # llama.cpp's own default would serve requests one at a time.
            args += ["--parallel", str(p.parallel or settings.llamacpp_parallel)]
        if not has_flag(extra, ("--jinja", "--no-jinja")):
            # Pins chat templating to the model's own template; a profile may turn it off with --no-jinja.
            args.append("--jinja")
        if not has_flag(extra, ("--metrics",)):
            # Without it there is no /metrics, and the router cannot see the load.
            args.append("--metrics")
        args += extra
        return [Command(argv=tuple(args), env={**finish_env(launch, gpu_env(launch)), **self.key_env(launch)})]

    def sample_launches(self) -> list[ShardLaunch]:
        base = super().sample_launches()[0]
        return [
            base.model_copy(
                update={
                    "profile": Profile(ctx_size=8192, parallel=4, gpu_ids=[0]),
                    "group": base.group.model_copy(update={"rank": 0}),
                }
            )
        ]

    def help_commands(self, bin_path: str) -> list[list[str]]:
        return [[bin_path, "--help"]]

    def engine_args(self, argv: tuple[str, ...]) -> list[str]:
        return list(argv[1:])

    def help_problems(self, text: str) -> list[str]:
        # The server's own flags (--host, --port, --metrics...) are in the last section.
        if "params -----" in text and "example-specific params" not in text:
            return ['it has no "example-specific params" section, where llama-server lists its own flags']
        return []
