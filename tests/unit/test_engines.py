"""Engine adapters: the exact command and environment per mode, and every refusal before launch."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from llmgw.agent.engines import (
    GPU,
    Adapter,
    EngineSettings,
    Group,
    LaunchRefused,
    NodeFacts,
    Profile,
    ShardLaunch,
    UnknownEngine,
    adapter_for,
    metric_names,
    nccl_env,
    plan_shard,
    quantization_of,
    resolve_gguf,
)
from llmgw.config.agent import EnginesConfig, LlamacppEngineConfig, VllmEngineConfig

H100 = "NVIDIA H100 80GB HBM3"
A100 = "NVIDIA A100-SXM4-80GB"
L40S = "NVIDIA L40S"


def gpus(name: str = H100, cc: str | None = "9.0", n: int = 8) -> list[GPU]:
    return [GPU(index=i, name=name, compute_capability=cc) for i in range(n)]


IB = [Adapter(name="mlx5_0"), Adapter(name="mlx5_1")]
ROCE = [
    Adapter(name="mlx5_0", link_layer="Ethernet", gid_index=3),
    Adapter(name="mlx5_1", link_layer="Ethernet", gid_index=3),
]


def launch(
    engine: str = "vllm",
    *,
    model: str = "/models/llama-70b",
    profile: dict | None = None,
    node: dict | None = None,
    group: dict | None = None,
    **kw,
) -> ShardLaunch:
    node = {"gpus": gpus(), "interface": "ens3", **(node or {})}
    return ShardLaunch(
        shard_id="s1",
        engine=engine,
        model=model,
        served_name="llama-70b",
        port=8001,
        profile=Profile(**(profile or {})),
        node=NodeFacts(**node),
        group=Group(**(group or {})),
        **kw,
    )


def multi(
    rank: int,
    engine: str = "vllm",
    *,
    adapters=IB,
    fabric: str = "ib-a",
    profile: dict | None = None,
    node: dict | None = None,
    group: dict | None = None,
) -> ShardLaunch:
    return launch(
        engine,
        profile={"tp": 8, "nodes": 2, "gpu_ids": [0, 1, 2, 3], **(profile or {})},
        node={"fabric_adapters": adapters, **(node or {})},
        group={"rank": rank, "leader_addr": "10.0.0.10", "leader_port": 20001, **(group or {})},
        fabric=fabric,
    )


def refusal(lnch: ShardLaunch, settings: EngineSettings | None = None) -> str:
    with pytest.raises(LaunchRefused) as exc:
        plan_shard(lnch, settings)
    return str(exc.value)


GPU_ENV_0123 = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
QUIET_VLLM = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "PYTHONUNBUFFERED": "1"}
IB_ENV = {
    "NCCL_IB_HCA": "=mlx5_0,mlx5_1",
    "NCCL_IB_DISABLE": "0",
    "NCCL_SOCKET_IFNAME": "ens3",
    "GLOO_SOCKET_IFNAME": "ens3",
}


# --- llama.cpp ---------------------------------------------------------------


def test_llamacpp_cpu_command_and_environment_are_exact():
    plan = plan_shard(
        launch("llamacpp", model="/w/qwen.gguf", node={"gpus": []}, profile={"ctx_size": 8192, "parallel": 2}),
        EngineSettings(llamacpp_bin="/opt/llmgw/engines/llamacpp/b1-cpu/llama-server"),
    )
    assert len(plan.commands) == 1
    cmd = plan.main
    assert cmd.argv == (
        "/opt/llmgw/engines/llamacpp/b1-cpu/llama-server",
        "--model",
        "/w/qwen.gguf",
        "--host",
        "0.0.0.0",
        "--port",
        "8001",
        "--alias",
        "llama-70b",
        "--ctx-size",
        "8192",
        "--parallel",
        "2",
        "--jinja",
        "--metrics",
    )
    # A CPU shard hides every card: a CUDA build would otherwise take memory on all of them.
    assert cmd.env == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": ""}
    assert not cmd.sidecar and cmd.wait_for is None
    assert plan.serves_http


def test_llamacpp_gpu_shard_sees_only_its_cards_and_gets_no_nccl():
    cmd = plan_shard(launch("llamacpp", model="/w/m.gguf", profile={"gpu_ids": [2, 3]})).main
    assert cmd.env == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "2,3"}


def test_llamacpp_parallel_defaults_to_the_agent_setting_and_ctx_size_is_left_to_the_model():
    argv = plan_shard(launch("llamacpp", model="/w/m.gguf"), EngineSettings(llamacpp_parallel=6)).main.argv
    assert argv == (
        "llama-server",
        "--model",
        "/w/m.gguf",
        "--host",
        "0.0.0.0",
        "--port",
        "8001",
        "--alias",
        "llama-70b",
        "--parallel",
        "6",
        "--jinja",
        "--metrics",
    )


def test_llamacpp_lets_a_profile_turn_the_template_off():
    argv = plan_shard(
        launch("llamacpp", model="/w/m.gguf", profile={"extra_args": ["--no-jinja", "--metrics"]})
    ).main.argv
    assert "--jinja" not in argv
    assert argv[-2:] == ("--no-jinja", "--metrics") and argv.count("--metrics") == 1


def test_llamacpp_takes_parallel_from_extra_args_when_the_profile_has_none():
    argv = plan_shard(launch("llamacpp", model="/w/m.gguf", profile={"extra_args": ["-np", "3"]})).main.argv
    assert "--parallel" not in argv and argv[-2:] == ("-np", "3")


def test_llamacpp_refuses_multi_node():
    msg = refusal(
        launch(
            "llamacpp",
            model="/w/m.gguf",
            profile={"nodes": 2},
            group={"leader_addr": "10.0.0.10", "leader_port": 20001},
        )
    )
    assert (
        "llama.cpp cannot span nodes and this profile asks for 2; use vllm or sglang for a multi-node replica, or set nodes to 1"
        in msg
    )


def test_llamacpp_refuses_tensor_parallel():
    msg = refusal(launch("llamacpp", model="/w/m.gguf", profile={"tp": 2, "gpu_ids": [0, 1]}))
    assert (
        "llama.cpp does not do tensor parallelism the way llmgw places it, and this profile asks for tp 2; set tp to 1"
        in msg
    )


def test_llamacpp_refuses_what_only_a_gguf_can_say():
    msg = refusal(launch("llamacpp", model="/w/m.gguf", profile={"quantization": "fp8", "dtype": "bfloat16"}))
    assert "llama.cpp takes its quantization from the GGUF file, so quantization fp8 cannot be applied" in msg
    assert "llama.cpp takes its types from the GGUF file, so dtype bfloat16 cannot be applied" in msg


def test_llamacpp_refuses_a_served_name_it_would_split():
    lnch = launch("llamacpp", model="/w/m.gguf").model_copy(update={"served_name": "a,b"})
    assert 'served name "a,b" contains a comma, which llama.cpp reads as several names' in refusal(lnch)


def test_llamacpp_refuses_extra_args_that_rewire_it():
    msg = refusal(launch("llamacpp", model="/w/m.gguf", profile={"extra_args": ["--port", "9000"]}))
    assert (
        "the profile's extra args set --port, which llmgw sets itself (the shard's port); remove it from the profile"
        in msg
    )


def test_llamacpp_refuses_a_flag_given_twice():
    msg = refusal(launch("llamacpp", model="/w/m.gguf", profile={"ctx_size": 4096, "extra_args": ["--ctx-size=8192"]}))
    assert "--ctx-size is set twice, as the profile's ctx_size and in its extra args; keep one" in msg


def test_llamacpp_refuses_a_context_smaller_than_its_slots():
    msg = refusal(launch("llamacpp", model="/w/m.gguf", profile={"ctx_size": 2, "parallel": 4}))
    assert "ctx_size 2 is smaller than parallel 4" in msg


def test_a_set_directory_resolves_to_its_first_part(tmp_path: Path):
    # Out of order on purpose: readdir order is not shard order.
    for n in ("q-00003-of-00003.gguf", "q-00001-of-00003.gguf", "q-00002-of-00003.gguf", "config.json"):
        (tmp_path / n).write_bytes(b"x")
    assert resolve_gguf(str(tmp_path)) == str(tmp_path / "q-00001-of-00003.gguf")
    argv = plan_shard(launch("llamacpp", model=str(tmp_path))).main.argv
    assert argv[argv.index("--model") + 1] == str(tmp_path / "q-00001-of-00003.gguf")


def test_a_plain_file_path_is_untouched(tmp_path: Path):
    p = tmp_path / "model.gguf"
    p.write_bytes(b"x")
    assert resolve_gguf(str(p)) == str(p)


def test_a_missing_path_is_left_to_the_engine():
    assert resolve_gguf("/nonexistent/model.gguf") == "/nonexistent/model.gguf"


def test_a_directory_with_no_weights_says_so(tmp_path: Path):
    (tmp_path / "config.json").write_text("{}")
    msg = refusal(launch("llamacpp", model=str(tmp_path)))
    assert f"{tmp_path} holds no .gguf file, and llama.cpp loads only GGUF models" in msg


def test_llamacpp_health_and_metric_names():
    plan = plan_shard(launch("llamacpp", model="/w/m.gguf"))
    assert plan.health is not None
    assert (plan.health.host, plan.health.port, plan.health.model) == ("127.0.0.1", 8001, "llama-70b")
    assert plan.health.url(plan.health.health_path) == "http://127.0.0.1:8001/health"
    assert plan.health.url(plan.health.models_path) == "http://127.0.0.1:8001/v1/models"
    assert plan.metrics.running == ("llamacpp:requests_processing",)
    assert plan.metrics.waiting == ("llamacpp:requests_deferred",)


# --- vLLM ----------------------------------------------------------------------


def test_vllm_single_node_command_and_environment_are_exact():
    plan = plan_shard(
        launch(
            profile={
                "tp": 4,
                "gpu_ids": [0, 1, 2, 3],
                "dtype": "bfloat16",
                "ctx_size": 32768,
                "parallel": 64,
                "extra_args": ["--enable-prefix-caching"],
            }
        ),
        EngineSettings(vllm_bin="/opt/llmgw/engines/vllm/0.30.0-cu13/bin/vllm"),
    )
    assert len(plan.commands) == 1
    assert plan.main.argv == (
        "/opt/llmgw/engines/vllm/0.30.0-cu13/bin/vllm",
        "serve",
        "/models/llama-70b",
        "--host",
        "0.0.0.0",
        "--port",
        "8001",
        "--served-model-name",
        "llama-70b",
        "--tensor-parallel-size",
        "4",
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "32768",
        "--max-num-seqs",
        "64",
        "--enable-prefix-caching",
    )
    # One node: its collectives stay in the box, so InfiniBand is off.
    assert plan.main.env == {
        **QUIET_VLLM,
        **GPU_ENV_0123,
        "NCCL_IB_DISABLE": "1",
        "NCCL_SOCKET_IFNAME": "ens3",
        "GLOO_SOCKET_IFNAME": "ens3",
    }
    assert plan.serves_http and plan.health is not None
    assert plan.metrics.running == ("vllm:num_requests_running",)
    assert plan.metrics.waiting == ("vllm:num_requests_waiting",)
    assert plan.metrics.kv_usage[0] == "vllm:kv_cache_usage_perc"


def test_vllm_mp_every_rank_serves_with_its_rank_and_workers_are_headless():
    settings = EngineSettings(vllm_launch_mode="mp")
    leader = plan_shard(multi(0), settings)
    worker = plan_shard(multi(1), settings)
    common = (
        "vllm",
        "serve",
        "/models/llama-70b",
        "--host",
        "0.0.0.0",
        "--port",
        "8001",
        "--served-model-name",
        "llama-70b",
        "--tensor-parallel-size",
        "8",
        "--distributed-executor-backend",
        "mp",
        "--nnodes",
        "2",
    )
    assert leader.main.argv == common + ("--node-rank", "0", "--master-addr", "10.0.0.10", "--master-port", "20001")
    assert worker.main.argv == common + (
        "--node-rank",
        "1",
        "--master-addr",
        "10.0.0.10",
        "--master-port",
        "20001",
        "--headless",
    )
    for plan in (leader, worker):
        assert len(plan.commands) == 1
        # A worker told the leader's address as its own announces itself as the leader.
        assert "VLLM_HOST_IP" not in plan.main.env
        assert plan.main.env == {**QUIET_VLLM, **GPU_ENV_0123, **IB_ENV}
    assert leader.serves_http and leader.health is not None
    assert not worker.serves_http and worker.health is None


def test_multi_node_vllm_defaults_to_its_own_launch():
    plan = plan_shard(multi(1))
    assert len(plan.commands) == 1 and plan.main.argv[0] == "vllm"
    assert "--headless" in plan.main.argv and "mp" in plan.main.argv


def test_vllm_ray_leader_runs_a_head_then_the_server():
    settings = EngineSettings(vllm_launch_mode="ray", vllm_bin="/opt/v/bin/vllm")
    plan = plan_shard(multi(0), settings)
    head, serve = plan.commands
    assert head.sidecar and not serve.sidecar
    assert head.argv == (
        "/opt/v/bin/ray",
        "start",
        "--head",
        "--node-ip-address",
        "10.0.0.10",
        "--port",
        "20001",
        "--num-gpus",
        "4",
        "--block",
        "--disable-usage-stats",
    )
    # vLLM's workers are spawned by the raylet and inherit its environment.
    assert head.env == {
        **QUIET_VLLM,
        "RAY_USAGE_STATS_ENABLED": "0",
        **GPU_ENV_0123,
        **IB_ENV,
        "VLLM_HOST_IP": "10.0.0.10",
    }
    assert serve.argv == (
        "/opt/v/bin/vllm",
        "serve",
        "/models/llama-70b",
        "--host",
        "0.0.0.0",
        "--port",
        "8001",
        "--served-model-name",
        "llama-70b",
        "--tensor-parallel-size",
        "8",
        "--distributed-executor-backend",
        "ray",
    )
    assert serve.env == {
        **QUIET_VLLM,
        **GPU_ENV_0123,
        **IB_ENV,
        "VLLM_HOST_IP": "10.0.0.10",
        "RAY_ADDRESS": "10.0.0.10:20001",
    }
    assert serve.wait_for == ("10.0.0.10", 20001)
    assert plan.serves_http


def test_vllm_ray_worker_runs_only_the_join_and_waits_for_the_head():
    settings = EngineSettings(vllm_launch_mode="ray")
    plan = plan_shard(multi(1, node={"address": "10.0.0.11"}), settings)
    assert len(plan.commands) == 1
    join = plan.main
    assert join.argv == (
        "ray",
        "start",
        "--address",
        "10.0.0.10:20001",
        "--num-gpus",
        "4",
        "--block",
        "--disable-usage-stats",
        "--node-ip-address",
        "10.0.0.11",
    )
    assert join.wait_for == ("10.0.0.10", 20001)
    assert join.env["VLLM_HOST_IP"] == "10.0.0.11"
    assert join.env["NCCL_IB_HCA"] == "=mlx5_0,mlx5_1"
    assert not plan.serves_http and plan.health is None
    # Without its own address the worker is told nothing rather than the leader's.
    join = plan_shard(multi(1), settings).main
    assert "VLLM_HOST_IP" not in join.env and "--node-ip-address" not in join.argv


def test_vllm_refuses_extra_args_that_rewire_the_group():
    msg = refusal(multi(1, profile={"extra_args": ["--node-rank", "0", "--headless"]}))
    assert "the profile's extra args set --node-rank, which llmgw sets itself (the shard's rank)" in msg
    assert "the profile's extra args set --headless, which llmgw sets itself (the shard's rank)" in msg


def test_vllm_quantization_from_either_place():
    argv = plan_shard(launch(profile={"gpu_ids": [0], "extra_args": ["--quantization", "awq"]})).main.argv
    assert argv.count("--quantization") == 1 and argv[-2:] == ("--quantization", "awq")
    argv = plan_shard(launch(profile={"gpu_ids": [0], "quantization": "awq"})).main.argv
    assert argv[argv.index("--quantization") + 1] == "awq"
    msg = refusal(launch(profile={"gpu_ids": [0], "quantization": "awq", "extra_args": ["-q", "gptq"]}))
    assert "--quantization is set twice, as the profile's quantization and in its extra args; keep one" in msg


def test_ray_bin_follows_vllm_unless_named():
    assert EngineSettings(vllm_bin="/opt/v/bin/vllm").ray() == "/opt/v/bin/ray"
    assert EngineSettings().ray() == "ray"
    assert EngineSettings(vllm_bin="/opt/v/bin/vllm", ray_bin="/usr/bin/ray").ray() == "/usr/bin/ray"


# --- SGLang --------------------------------------------------------------------


QUIET_SGL = {"DO_NOT_TRACK": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "PYTHONUNBUFFERED": "1"}


def test_sglang_single_node_command_is_exact():
    plan = plan_shard(
        launch("sglang", profile={"tp": 2, "gpu_ids": [4, 5], "ctx_size": 16384, "parallel": 32}),
        EngineSettings(sglang_python="/opt/llmgw/engines/sglang/0.5.20-cu13/bin/python"),
    )
    assert plan.main.argv == (
        "/opt/llmgw/engines/sglang/0.5.20-cu13/bin/python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/models/llama-70b",
        "--host",
        "0.0.0.0",
        "--port",
        "8001",
        "--served-model-name",
        "llama-70b",
        "--tp-size",
        "2",
        "--enable-metrics",
        "--context-length",
        "16384",
        "--max-running-requests",
        "32",
    )
    assert plan.main.env == {
        **QUIET_SGL,
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": "4,5",
        "NCCL_IB_DISABLE": "1",
        "NCCL_SOCKET_IFNAME": "ens3",
        "GLOO_SOCKET_IFNAME": "ens3",
    }
    assert plan.metrics.running == ("sglang:num_running_reqs",)
    assert plan.metrics.waiting == ("sglang:num_queue_reqs",)
    assert plan.metrics.kv_usage == ("sglang:token_usage",)


def test_sglang_multi_node_ranks_share_the_leaders_rendezvous():
    for rank in (0, 1):
        plan = plan_shard(multi(rank, "sglang"))
        assert plan.main.argv == (
            "python3",
            "-m",
            "sglang.launch_server",
            "--model-path",
            "/models/llama-70b",
            "--host",
            "0.0.0.0",
            "--port",
            "8001",
            "--served-model-name",
            "llama-70b",
            "--tp-size",
            "8",
            "--enable-metrics",
            "--nnodes",
            "2",
            "--node-rank",
            str(rank),
            "--dist-init-addr",
            "10.0.0.10:20001",
        )
        assert plan.main.env == {**QUIET_SGL, **GPU_ENV_0123, **IB_ENV}
        assert plan.serves_http == (rank == 0)


def test_sglang_brackets_an_ipv6_leader():
    argv = plan_shard(multi(1, "sglang", group={"leader_addr": "fd00::10"})).main.argv
    assert argv[argv.index("--dist-init-addr") + 1] == "[fd00::10]:20001"


def test_sglang_refuses_the_tp_abbreviation_in_extra_args():
    msg = refusal(launch("sglang", profile={"gpu_ids": [0], "extra_args": ["--tp", "2"]}))
    assert "the profile's extra args set --tp, which llmgw sets itself (the profile's tp)" in msg


# --- NCCL environment -----------------------------------------------------------


def test_only_the_chosen_fabrics_adapters_matched_exactly():
    env = nccl_env(multi(0, adapters=[Adapter(name="mlx5_0", port=1), Adapter(name="mlx5_1", port=1)]))
    # "=" is exact match: a bare "mlx5_1" would also select mlx5_10..19.
    assert env == {
        "NCCL_IB_HCA": "=mlx5_0:1,mlx5_1:1",
        "NCCL_IB_DISABLE": "0",
        "NCCL_SOCKET_IFNAME": "ens3",
        "GLOO_SOCKET_IFNAME": "ens3",
    }


def test_roce_gets_its_gid_index_and_infiniband_none():
    assert nccl_env(multi(0, adapters=ROCE))["NCCL_IB_GID_INDEX"] == "3"
    assert plan_shard(multi(0, adapters=ROCE)).main.env["NCCL_IB_GID_INDEX"] == "3"
    assert "NCCL_IB_GID_INDEX" not in nccl_env(multi(0))


def test_roce_without_a_routable_gid_is_refused():
    bad = [Adapter(name="mlx5_0", link_layer="Ethernet", gid_index=-1)]
    msg = refusal(multi(0, adapters=bad))
    assert "RoCE adapter mlx5_0 has no RoCE v2 GID holding an IPv4 address" in msg
    assert "set NCCL_IB_GID_INDEX in the profile's env" in msg
    # The operator's word settles it.
    plan = plan_shard(multi(0, adapters=bad, profile={"env": {"NCCL_IB_GID_INDEX": "5"}}))
    assert plan.main.env["NCCL_IB_GID_INDEX"] == "5"


def test_roce_adapters_disagreeing_on_the_gid_are_refused():
    split = [
        Adapter(name="mlx5_0", link_layer="Ethernet", gid_index=3),
        Adapter(name="mlx5_1", link_layer="Ethernet", gid_index=5),
    ]
    msg = refusal(multi(0, adapters=split))
    assert "the RoCE adapters disagree on their GID index (mlx5_0: 3, mlx5_1: 5) and NCCL takes one for all" in msg


def test_a_fabric_mixing_infiniband_and_roce_is_refused():
    msg = refusal(
        multi(0, adapters=[Adapter(name="mlx5_0"), Adapter(name="mlx5_2", link_layer="Ethernet", gid_index=3)])
    )
    assert "the fabric's adapters mix InfiniBand (mlx5_0) and RoCE (mlx5_2)" in msg


def test_a_replica_in_an_nvlink_domain_is_told_to_use_it():
    dom = "76b1ad76-7c24-4b6b-9f6c-2a1e0d8c11aa/7"
    env = plan_shard(multi(0, adapters=[], fabric=f"nvl:{dom}", node={"nvlink_domain": dom})).main.env
    assert env["NCCL_MNNVL_ENABLE"] == "1" and env["NCCL_CUMEM_ENABLE"] == "1"
    assert env["NCCL_IB_DISABLE"] == "1"
    assert "NCCL_MNNVL_ENABLE" not in plan_shard(multi(0)).main.env


def test_a_node_outside_the_replicas_nvlink_domain_is_refused():
    msg = refusal(multi(1, adapters=[], fabric="nvl:aaaa/1", node={"nvlink_domain": "bbbb/1"}))
    assert "the replica was placed in NVLink domain aaaa/1, but this node is in NVLink domain bbbb/1" in msg
    msg = refusal(multi(1, adapters=[], fabric="nvl:aaaa/1"))
    assert "but this node is in no NVLink domain" in msg


def test_a_single_node_shard_uses_no_fabric():
    env = nccl_env(launch(profile={"gpu_ids": [0]}, node={"fabric_adapters": IB}, fabric="nvl:x/1"))
    assert env["NCCL_IB_DISABLE"] == "1"
    assert "NCCL_IB_HCA" not in env and "NCCL_MNNVL_ENABLE" not in env


def test_the_profiles_env_wins():
    plan = plan_shard(
        multi(0, profile={"env": {"NCCL_IB_HCA": "=mlx5_4", "NCCL_SOCKET_IFNAME": "bond0", "NCCL_DEBUG": "INFO"}})
    )
    assert plan.main.env["NCCL_IB_HCA"] == "=mlx5_4"
    assert plan.main.env["NCCL_SOCKET_IFNAME"] == "bond0"
    assert plan.main.env["NCCL_DEBUG"] == "INFO"
    assert plan.main.env["GLOO_SOCKET_IFNAME"] == "ens3"


def test_a_multi_node_shard_without_its_interface_is_refused():
    msg = refusal(multi(0, node={"interface": None}))
    assert "this node's management interface is unknown" in msg and "set mgmt_interface in agent.yaml" in msg


# --- validation -----------------------------------------------------------------


def test_mixed_gpu_types_in_a_group_are_refused():
    node = {
        "gpus": [GPU(index=0, name=H100, compute_capability="9.0"), GPU(index=1, name=A100, compute_capability="8.0")]
    }
    msg = refusal(launch(profile={"tp": 2, "gpu_ids": [0, 1]}, node=node))
    assert f"GPUs of different types in one group (GPU 0 is {H100}, GPU 1 is {A100})" in msg
    msg = refusal(multi(1, group={"gpu_names": [A100]}))
    assert f"this node's are {H100}, other shards have {A100}" in msg


def test_tp_must_match_the_gpus_given():
    assert (
        "tp 2 needs 2 GPUs, and this shard was given 4 (GPUs 0,1,2,3); make tp equal GPUs per node x nodes"
        in refusal(launch(profile={"tp": 2, "gpu_ids": [0, 1, 2, 3]}))
    )
    assert "tp 8 over 2 nodes needs 4 GPUs on each node, and this shard was given 2 (GPUs 0,1)" in refusal(
        multi(0, profile={"gpu_ids": [0, 1]})
    )
    assert "tp 6 cannot be split evenly across 4 nodes; make tp a multiple of nodes" in refusal(
        multi(0, profile={"tp": 6, "nodes": 4})
    )


def test_gpu_engines_need_gpus():
    assert (
        "vLLM needs GPUs and this shard was given none; give the profile a GPU class, or use llamacpp to serve on CPU"
        in refusal(launch())
    )
    assert "SGLang needs GPUs" in refusal(launch("sglang"))


def test_fp8_is_refused_below_compute_capability_8_9():
    msg = refusal(launch(profile={"gpu_ids": [0], "quantization": "fp8"}, node={"gpus": gpus(A100, "8.0")}))
    assert f"fp8 needs compute capability 8.9 or newer (Ada, Hopper, Blackwell): GPU 0 ({A100}) is 8.0" in msg
    # Given in extra args it is caught all the same.
    msg = refusal(
        launch(profile={"gpu_ids": [0], "extra_args": ["--quantization=fp8"]}, node={"gpus": gpus(A100, "8.0")})
    )
    assert "fp8 needs compute capability 8.9 or newer" in msg
    assert plan_shard(launch(profile={"gpu_ids": [0], "quantization": "fp8"}, node={"gpus": gpus(L40S, "8.9")}))


def test_fp8_on_a_gpu_of_unknown_capability_is_a_warning():
    plan = plan_shard(
        launch("sglang", profile={"gpu_ids": [0], "quantization": "fp8"}, node={"gpus": gpus(H100, None)})
    )
    assert plan.warnings == (f"GPU 0 ({H100}) did not report its compute capability, so fp8 support was not checked",)


def test_quantization_is_read_from_the_profile_or_its_extra_args():
    assert quantization_of(launch(profile={"quantization": "fp8"})) == "fp8"
    assert quantization_of(launch(profile={"extra_args": ["--quantization", "awq"]})) == "awq"
    assert quantization_of(launch(profile={"extra_args": ["--quantization=gptq"]})) == "gptq"
    assert quantization_of(launch(profile={"extra_args": ["-q", "fp8"]}), ("--quantization", "-q")) == "fp8"
    # A dangling flag yields nothing.
    assert quantization_of(launch(profile={"extra_args": ["--quantization"]})) is None
    assert quantization_of(launch(profile={"extra_args": ["--quantization", "--enforce-eager"]})) is None


def test_an_unknown_engine_is_refused_with_the_names_it_could_be():
    msg = refusal(launch("tgi"))
    assert 'unknown engine "tgi": llmgw runs llamacpp, vllm, sglang; fix the profile\'s engine' in msg
    with pytest.raises(UnknownEngine):
        adapter_for("tgi")
    with pytest.raises(UnknownEngine):
        metric_names("tgi")


def test_group_arithmetic_and_rendezvous():
    assert "GPU 9 is not on this node (it has GPUs: 0,1,2,3,4,5,6,7)" in refusal(launch(profile={"gpu_ids": [9]}))
    assert "rank 2 is outside a 2-node replica (ranks 0-1)" in refusal(multi(2))
    assert "a 2-node replica needs the leader's address and rendezvous port, and this shard has no address" in refusal(
        multi(1, group={"leader_addr": None})
    )
    assert "the leader's rendezvous port 8001 is also its HTTP port; they must differ" in refusal(
        multi(0, group={"leader_port": 8001})
    )


def test_placement_owns_the_visible_devices():
    msg = refusal(launch(profile={"gpu_ids": [0], "env": {"CUDA_VISIBLE_DEVICES": "3"}}))
    assert "the profile's env sets CUDA_VISIBLE_DEVICES; GPUs are chosen by placement" in msg


def test_every_reason_is_reported_at_once():
    with pytest.raises(LaunchRefused) as exc:
        plan_shard(
            launch(
                "llamacpp",
                model="/w/m.gguf",
                profile={"tp": 2, "nodes": 2, "gpu_ids": [0, 1]},
                group={"leader_addr": "10.0.0.10", "leader_port": 20001},
            )
        )
    assert len(exc.value.reasons) == 2 and exc.value.shard_id == "s1"
    assert str(exc.value).startswith("shard s1 not started: llama.cpp cannot span nodes")


def test_malformed_input_is_named():
    with pytest.raises(ValidationError, match='"8" is not a compute capability; write major.minor'):
        GPU(index=0, name=H100, compute_capability="8")
    with pytest.raises(ValidationError, match="GPU 1 is listed twice"):
        Profile(gpu_ids=[1, 1])
    with pytest.raises(ValidationError, match='"NCCL-DEBUG" is not an environment variable name'):
        Profile(env={"NCCL-DEBUG": "INFO"})
    with pytest.raises(ValidationError):
        Profile(tp=0)


def test_settings_prefer_configured_then_installed():
    # agent.yaml's binary is used "instead of installing one"; an installed build next.
    cfg = EnginesConfig(
        llamacpp=LlamacppEngineConfig(bin="/usr/local/bin/llama-server", parallel=8),
        vllm=VllmEngineConfig(launch_mode="ray"),
    )
    installed = {
        "vllm": "/opt/llmgw/engines/vllm/0.30.0-cu13/bin/vllm",
        "llamacpp": "/opt/llmgw/engines/llamacpp/b1/llama-server",
    }
    s = EngineSettings.from_config(cfg, installed)
    assert s.llamacpp_bin == "/usr/local/bin/llama-server" and s.llamacpp_parallel == 8
    assert s.vllm_bin == "/opt/llmgw/engines/vllm/0.30.0-cu13/bin/vllm" and s.vllm_launch_mode == "ray"
    assert s.sglang_python == "python3"
    assert cfg.configured() == {"llamacpp": "/usr/local/bin/llama-server"}
    assert EngineSettings.from_config().vllm_launch_mode == "mp"


def test_one_gpu_too_many_is_counted_in_words():
    assert "tp 1 needs 1 GPU, and this shard was given 2 (GPUs 0,1)" in refusal(launch(profile={"gpu_ids": [0, 1]}))
