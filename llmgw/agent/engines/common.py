"""What every engine shares: the NCCL environment, GPU visibility, checks before launch, extra-arg handling."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from llmgw.agent.engines.spec import ShardLaunch

# fp8 kernels need Ada (8.9) or newer; below that engines either refuse late or
# fall back to a slower path without saying so.
FP8_MIN_CC = (8, 9)


def hostport(addr: str, port: int) -> str:
    """addr:port, bracketing an IPv6 address."""
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"


# --- extra args -------------------------------------------------------------


def flag_index(args: Sequence[str], names: Iterable[str]) -> int | None:
    names = tuple(names)
    for i, a in enumerate(args):
        if a in names or any(a.startswith(n + "=") for n in names if n.startswith("--")):
            return i
    return None


def has_flag(args: Sequence[str], names: Iterable[str]) -> bool:
    return flag_index(args, names) is not None


def flag_value(args: Sequence[str], names: Iterable[str]) -> str | None:
    """The value given to a flag as `--f v` or `--f=v`; None when absent or dangling."""
    i = flag_index(args, names)
    if i is None:
        return None
    a = args[i]
    if "=" in a and a.startswith("--"):
        return a.split("=", 1)[1] or None
    if i + 1 < len(args) and not args[i + 1].startswith("-"):
        return args[i + 1]
    return None


def owned_flag_problems(extra: Sequence[str], owned: dict[str, str]) -> list[str]:
    """Refuse extra args that would fight the flags llmgw wires itself (ports, ranks, names)."""
    out = []
    for flag, source in owned.items():
        if has_flag(extra, [flag]):
            out.append(
                f"the profile's extra args set {flag}, which llmgw sets itself ({source}); remove it from the profile"
            )
    return out


def twice_problems(extra: Sequence[str], fields: Iterable[tuple[Sequence[str], object, str]]) -> list[str]:
    """A flag backed by a profile field may be given either way, not both.

    Which one would win depends on the engine's parser, so neither is guessed.
    """
    return [
        f"{names[0]} is set twice, as the profile's {field} and in its extra args; keep one"
        for names, value, field in fields
        if value is not None and has_flag(extra, names)
    ]


def field_args(extra: Sequence[str], fields: Iterable[tuple[Sequence[str], object, str]]) -> list[str]:
    """Flags for the profile fields that are set and not already in the extra args."""
    out: list[str] = []
    for names, value, _field in fields:
        if value is not None and not has_flag(extra, names):
            out += [names[0], str(value)]
    return out


def quantization_of(launch: ShardLaunch, flags: Sequence[str] = ("--quantization",)) -> str | None:
    """The quantization asked for, by the profile's field or its extra args."""
    return launch.profile.quantization or flag_value(launch.profile.extra_args, flags)


# --- environment ------------------------------------------------------------


def gpu_env(launch: ShardLaunch) -> dict[str, str]:
    """Which cards the engine may touch."""
    ids = launch.profile.gpu_ids
    return {
        # CUDA numbers cards fastest-first by default; nvidia-smi and placement
        # number them by PCI bus. Without this, "GPU 1" can be someone else's card.
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        # Empty for a CPU shard: a CUDA build would otherwise take memory on
        # every card, including ones other replicas hold.
        "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in ids),
    }


def nccl_env(launch: ShardLaunch) -> dict[str, str]:
    """The NCCL/Gloo environment a shard is given (also what doctor shows)."""
    env: dict[str, str] = {}
    # A single-node shard has no use for the fabric: its collectives stay in the box.
    adapters = launch.node.fabric_adapters if launch.multi_node else []
    if adapters:
        seen: list[str] = []
        for a in adapters:
            item = a.name if a.port is None else f"{a.name}:{a.port}"
            if item not in seen:
                seen.append(item)
        # Only the chosen fabric's adapters: left open, NCCL may pick an adapter
        # on a fabric where the peer is unreachable and hang instead of failing.
        # The leading "=" makes NCCL match names exactly; without it "mlx5_1"
        # is a prefix and also selects mlx5_10..mlx5_19.
        env["NCCL_IB_HCA"] = "=" + ",".join(seen)
        env["NCCL_IB_DISABLE"] = "0"
        gids = {a.gid_index for a in adapters if a.roce and a.gid_index is not None and a.gid_index >= 0}
        if len(gids) == 1:
            # NCCL's default GID is a RoCE v1 link-local entry on most hosts,
            # which does not route; InfiniBand needs none and gets none.
            env["NCCL_IB_GID_INDEX"] = str(gids.pop())
    else:
        env["NCCL_IB_DISABLE"] = "1"
    if launch.in_nvlink_domain:
        # NCCL carries collectives over NVLink between nodes only when told
        # to, and needs cuMem allocations (IMEX) for it.
        env["NCCL_MNNVL_ENABLE"] = "1"
        env["NCCL_CUMEM_ENABLE"] = "1"
    if launch.node.interface:
        # Bootstrap always runs over this node's own management network; left
        # to choose, NCCL and Gloo can pick a docker or virtual bridge. A plain
        # name, not NCCL's "=" exact form: vLLM and others read this variable
        # as an interface name to find the node's own address.
        env["NCCL_SOCKET_IFNAME"] = launch.node.interface
        env["GLOO_SOCKET_IFNAME"] = launch.node.interface
    return env


def finish_env(launch: ShardLaunch, *parts: dict[str, str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for p in parts:
        env.update(p)
    # The profile's env is the operator's last word on everything llmgw set.
    env.update(launch.profile.env)
    return env


# --- checks before launch ---------------------------------------------------


def _gpu_list(ids: Iterable[int]) -> str:
    return ",".join(str(i) for i in ids)


def common_problems(launch: ShardLaunch) -> list[str]:
    """Refusals that do not depend on the engine."""
    problems: list[str] = []
    p, g, node = launch.profile, launch.group, launch.node

    if launch.model.startswith("-"):
        problems.append(
            f'model source "{launch.model}" starts with "-" and would be read as a flag; give a path or repo id'
        )
    if not launch.served_name.strip():
        problems.append("served name is blank; give the name clients ask for")
    if "CUDA_VISIBLE_DEVICES" in p.env:
        problems.append(
            "the profile's env sets CUDA_VISIBLE_DEVICES; GPUs are chosen by placement "
            "(it would run on cards another replica holds); remove it from the profile"
        )

    if g.rank >= p.nodes:
        problems.append(f"rank {g.rank} is outside a {p.nodes}-node replica (ranks 0-{p.nodes - 1})")
    if launch.multi_node:
        if not g.leader_addr or g.leader_port is None:
            problems.append(
                f"a {p.nodes}-node replica needs the leader's address and rendezvous port, and this shard has "
                f"{'no address' if not g.leader_addr else 'no port'}"
            )
        elif launch.leader and g.leader_port == launch.port:
            problems.append(f"the leader's rendezvous port {g.leader_port} is also its HTTP port; they must differ")
        if not node.interface:
            problems.append(
                "this node's management interface is unknown, so NCCL and Gloo would pick one themselves "
                "(often a docker or virtual bridge, which hangs the group); set mgmt_interface in agent.yaml"
            )

    known = {gpu.index for gpu in node.gpus}
    missing = [i for i in p.gpu_ids if i not in known]
    if missing:
        have = _gpu_list(sorted(known)) if known else "none"
        problems.append(
            f"GPU {_gpu_list(missing)} {'is' if len(missing) == 1 else 'are'} not on this node (it has GPUs: {have})"
        )

    gpus = launch.gpus()
    names = sorted({gpu.name for gpu in gpus})
    if len(names) > 1:
        detail = ", ".join(f"GPU {gpu.index} is {gpu.name}" for gpu in gpus)
        problems.append(
            f"GPUs of different types in one group ({detail}); a group runs at the pace of its slowest "
            "card and may not fit at all; give the profile GPUs of one type"
        )
    others = sorted({n for n in g.gpu_names if n} - set(names))
    if names and others:
        problems.append(
            f"GPUs of different types in one group: this node's are {names[0]}, other shards have "
            f"{', '.join(others)}; place the replica on GPUs of one type"
        )

    if launch.in_nvlink_domain:
        want = (launch.fabric or "")[4:].lower()
        have_dom = (node.nvlink_domain or "").lower()
        if have_dom != want:
            where = f"NVLink domain {node.nvlink_domain}" if node.nvlink_domain else "no NVLink domain"
            problems.append(
                f"the replica was placed in NVLink domain {want}, but this node is in {where}; NCCL would "
                "try NVLink to nodes it cannot reach and hang on the first all-reduce"
            )

    if launch.multi_node and node.fabric_adapters and "NCCL_IB_HCA" not in p.env:
        kinds = {a.link_layer for a in node.fabric_adapters}
        if len(kinds) > 1:
            ib = ",".join(a.name for a in node.fabric_adapters if not a.roce)
            roce = ",".join(a.name for a in node.fabric_adapters if a.roce)
            problems.append(
                f"the fabric's adapters mix InfiniBand ({ib}) and RoCE ({roce}); a fabric is one or the "
                "other, so check the fabrics in agent.yaml"
            )
        elif "NCCL_IB_GID_INDEX" not in p.env and kinds == {"Ethernet"}:
            none = [a.name for a in node.fabric_adapters if a.gid_index is None or a.gid_index < 0]
            gids = {a.gid_index for a in node.fabric_adapters if a.gid_index is not None and a.gid_index >= 0}
            if none:
                problems.append(
                    f"RoCE adapter {','.join(none)} has no RoCE v2 GID holding an IPv4 address, and NCCL "
                    "would fall back to a link-local entry that does not route and hang; give the port's "
                    "interface an IPv4 address, or set NCCL_IB_GID_INDEX in the profile's env"
                )
            elif len(gids) > 1:
                detail = ", ".join(f"{a.name}: {a.gid_index}" for a in node.fabric_adapters)
                problems.append(
                    f"the RoCE adapters disagree on their GID index ({detail}) and NCCL takes one for all; "
                    "set NCCL_IB_GID_INDEX in the profile's env"
                )
    return problems


def gpu_engine_problems(launch: ShardLaunch, engine_label: str) -> list[str]:
    """Arithmetic a GPU-only engine needs to add up."""
    p = launch.profile
    if not p.gpu_ids:
        return [
            f"{engine_label} needs GPUs and this shard was given none; give the profile a GPU class, "
            "or use llamacpp to serve on CPU"
        ]
    n = len(p.gpu_ids)
    if p.tp % p.nodes:
        return [f"tp {p.tp} cannot be split evenly across {p.nodes} nodes; make tp a multiple of nodes"]
    per_node = p.tp // p.nodes
    if n != per_node:
        need = f"{per_node} GPU{'' if per_node == 1 else 's'}"
        where = f"over {p.nodes} nodes needs {need} on each node" if p.nodes > 1 else f"needs {need}"
        return [
            f"tp {p.tp} {where}, and this shard was given {n} (GPUs {_gpu_list(p.gpu_ids)}); "
            f"make tp equal GPUs per node x nodes"
        ]
    return []


def fp8_problems(launch: ShardLaunch, quantization: str | None) -> tuple[list[str], list[str]]:
    if not quantization or "fp8" not in quantization.lower():
        return [], []
    old, unknown = [], []
    for gpu in launch.gpus():
        cc = gpu.cc()
        if cc is None:
            unknown.append(gpu)
        elif cc < FP8_MIN_CC:
            old.append(gpu)
    problems = []
    if old:
        detail = ", ".join(f"GPU {g.index} ({g.name}) is {g.compute_capability}" for g in old)
        problems.append(
            f"{quantization} needs compute capability 8.9 or newer (Ada, Hopper, Blackwell): {detail}; the "
            "engine would refuse late or silently run a slower path; use a bf16/fp16 or int8/int4 build "
            "of the model, or place it on newer GPUs"
        )
    warnings = [
        f"GPU {g.index} ({g.name}) did not report its compute capability, so {quantization} support was not checked"
        for g in unknown
    ]
    return problems, warnings


def python_engine_problems(
    launch: ShardLaunch,
    engine_label: str,
    owned: dict[str, str],
    fields: Iterable[tuple[Sequence[str], object, str]],
    quant_flags: Sequence[str],
) -> tuple[list[str], list[str]]:
    """The checks vLLM and SGLang share: GPUs, flags llmgw owns or that a profile field sets, fp8."""
    extra = launch.profile.extra_args
    out = gpu_engine_problems(launch, engine_label)
    out += owned_flag_problems(extra, owned)
    out += twice_problems(extra, fields)
    fp8, warnings = fp8_problems(launch, quantization_of(launch, quant_flags))
    return out + fp8, warnings
