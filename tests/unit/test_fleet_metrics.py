"""Fleet metrics: what a scrape says about nodes, GPUs and replicas, and what it leaves out."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest

from llmgw.protocol import (
    GPU,
    HCA,
    IMEX,
    PROTOCOL_VERSION,
    GPUUsage,
    Heartbeat,
    Host,
    IBPort,
    MemoryInfo,
    NodeInventory,
    NodeLoad,
    NVLinkPeer,
    ProvisionState,
    ProvisionStatus,
    Register,
    Storage,
)
from llmgw.server.control.agents import AgentService, NodeState
from llmgw.server.control.fleet_metrics import FleetCollector
from llmgw.server.control.reconciler import NodeMark, ReplicaState
from llmgw.server.metrics import GatewayMetrics

GiB = 1 << 30


@dataclass
class Rep:
    model: str
    state: ReplicaState
    node_ids: list[str] = field(default_factory=list)


def h100(index: int, **kw) -> GPU:
    return GPU(index=index, name="NVIDIA H100 80GB HBM3", memory_total_bytes=80 * GiB, **kw)


def fleet() -> AgentService:
    svc = AgentService()
    inv = NodeInventory(
        host=Host(cpus=64),
        memory=MemoryInfo(total_bytes=512 * GiB, available_bytes=400 * GiB),
        storage=[
            Storage(mount_point="/shared", shared=True, total_bytes=10, free_bytes=5),
            Storage(mount_point="/var/lib/llmgw", total_bytes=2000 * GiB, free_bytes=1500 * GiB),
        ],
        gpus=[
            h100(0, nvlink_peers=[NVLinkPeer(index=1, links=18)]),
            h100(1, nvlink_peers=[NVLinkPeer(index=0, links=18)], problems=["fell off the bus"]),
            GPU(index=2, name="NVIDIA L40S", memory_total_bytes=45 * GiB),
        ],
        adapters=[
            HCA(
                name="mlx5_0",
                ports=[IBPort(hca="mlx5_0", port=1, state="ACTIVE", phys_state="LinkUp", rate_gbps=400.0)],
            )
        ],
        imex=IMEX(state="active"),
    )
    svc._apply_register(Register(node_id="gpu-1", protocol_version=PROTOCOL_VERSION, inventory=inv), None)
    svc._apply_heartbeat(
        svc.get("gpu-1"),
        Heartbeat(
            memory=MemoryInfo(total_bytes=512 * GiB, available_bytes=300 * GiB),
            load=NodeLoad(cpu_percent=37.5, cpu_count=64, load1=1.5, load5=2.0, load15=None),
            gpus=[
                GPUUsage(index=0, utilization_percent=80),
                GPUUsage(index=1),
                GPUUsage(index=2, utilization_percent=0),
            ],
            ib_ports=[
                IBPort(hca="mlx5_0", port=1, state="DOWN", phys_state="Polling"),
                IBPort(
                    hca="mlx5_1",
                    port=1,
                    state="ACTIVE",
                    phys_state="LinkUp",
                    rate_gbps=200.0,
                    counters={"symbol_error": 12, "link_downed": 0, "port_xmit_data": 4096, "port_rcv_errors": 3},
                ),
            ],
            provision=[
                ProvisionStatus(engine="llamacpp", version="b1", state=ProvisionState.READY),
                ProvisionStatus(engine="vllm", state=ProvisionState.INSTALLING, detail="downloading"),
            ],
        ),
    )
    # A node that said almost nothing: an old agent on a CPU machine.
    svc._apply_register(Register(node_id="cpu-1", protocol_version=PROTOCOL_VERSION), None)
    return svc


def scrape(collector: FleetCollector) -> str:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(collector)
    return generate_latest(reg).decode()


def samples(text: str) -> dict[str, float]:
    """Each series line, name and labels exactly as rendered, with its value."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def names_for(text: str, node: str) -> set[str]:
    return {k.split("{")[0] for k in samples(text) if f'node="{node}"' in k}


def test_node_values_and_labels():
    s = samples(scrape(FleetCollector(fleet(), list)))
    assert s['llmgw_node_up{node="gpu-1",state="ready"}'] == 1
    assert 0 <= s['llmgw_node_last_seen_seconds{node="gpu-1"}'] < 5
    assert s['llmgw_node_memory_bytes{node="gpu-1"}'] == 512 * GiB
    assert s['llmgw_node_memory_available_bytes{node="gpu-1"}'] == 300 * GiB  # the heartbeat, not the registration
    assert s['llmgw_node_memory_used_bytes{node="gpu-1"}'] == 212 * GiB
    assert s['llmgw_node_cpu_utilization_percent{node="gpu-1"}'] == 37.5
    assert s['llmgw_node_cpus{node="gpu-1"}'] == 64
    assert s['llmgw_node_load{node="gpu-1",window="1m"}'] == 1.5
    assert s['llmgw_node_load{node="gpu-1",window="5m"}'] == 2.0
    assert 'llmgw_node_load{node="gpu-1",window="15m"}' not in s
    # The first filesystem of the node's own, not the shared one listed before it.
    assert s['llmgw_node_disk_free_bytes{node="gpu-1"}'] == 1500 * GiB
    assert s['llmgw_node_disk_total_bytes{node="gpu-1"}'] == 2000 * GiB
    assert s['llmgw_node_gpus{gpu_class="h100-80g",node="gpu-1"}'] == 2
    assert s['llmgw_node_gpus{gpu_class="l40s-45g",node="gpu-1"}'] == 1
    assert s['llmgw_imex_up{node="gpu-1"}'] == 1
    assert s['llmgw_node_provision{engine="llamacpp",node="gpu-1",state="ready"}'] == 1
    assert s['llmgw_node_provision{engine="vllm",node="gpu-1",state="installing"}'] == 1


def test_gpu_series_report_health_utilization_and_nvlink_peers_only_when_known():
    s = samples(scrape(FleetCollector(fleet(), list)))
    assert s['llmgw_gpu_healthy{gpu="0",node="gpu-1"}'] == 1
    assert s['llmgw_gpu_healthy{gpu="1",node="gpu-1"}'] == 0  # a problem at discovery keeps it out
    assert s['llmgw_gpu_utilization_percent{gpu="0",node="gpu-1"}'] == 80
    assert s['llmgw_gpu_utilization_percent{gpu="2",node="gpu-1"}'] == 0  # reported as 0: kept
    assert 'llmgw_gpu_utilization_percent{gpu="1",node="gpu-1"}' not in s  # not reported: absent
    assert s['llmgw_gpu_nvlink_peers{gpu="0",node="gpu-1"}'] == 1
    assert 'llmgw_gpu_nvlink_peers{gpu="2",node="gpu-1"}' not in s


def test_ib_ports_come_from_the_latest_heartbeat():
    s = samples(scrape(FleetCollector(fleet(), list)))
    assert s['llmgw_ib_port_active{hca="mlx5_0",node="gpu-1",phys_state="Polling",port="1",state="DOWN"}'] == 0
    assert s['llmgw_ib_port_active{hca="mlx5_1",node="gpu-1",phys_state="LinkUp",port="1",state="ACTIVE"}'] == 1
    assert s['llmgw_ib_port_rate_gbps{hca="mlx5_1",node="gpu-1",port="1"}'] == 200
    assert 'llmgw_ib_port_rate_gbps{hca="mlx5_0",node="gpu-1",port="1"}' not in s


def test_ib_error_counters_are_series_only_once_non_zero_and_traffic_is_not_an_error():
    s = samples(scrape(FleetCollector(fleet(), list)))
    assert s['llmgw_ib_port_counter_total{counter="symbol_error",hca="mlx5_1",node="gpu-1",port="1"}'] == 12
    assert s['llmgw_ib_port_counter_total{counter="port_rcv_errors",hca="mlx5_1",node="gpu-1",port="1"}'] == 3
    assert not [
        k for k in s if k.startswith("llmgw_ib_port_counter_total") and ("link_downed" in k or "xmit_data" in k)
    ]


def test_unreported_values_are_absent_not_zero():
    text = scrape(FleetCollector(fleet(), list))
    assert names_for(text, "cpu-1") == {"llmgw_node_up", "llmgw_node_last_seen_seconds"}


def test_ecc_errors_in_a_heartbeat_make_a_card_unhealthy():
    svc = fleet()
    svc._apply_heartbeat(svc.get("gpu-1"), Heartbeat(gpus=[GPUUsage(index=0, ecc_uncorrected=3)]))
    s = samples(scrape(FleetCollector(svc, list)))
    assert s['llmgw_gpu_healthy{gpu="0",node="gpu-1"}'] == 0


def test_a_stale_node_keeps_only_up_and_last_seen():
    svc = fleet()
    node = svc.get("gpu-1")
    node.last_seen = time.time() - 61
    node.state = NodeState.LOST
    text = scrape(FleetCollector(svc, list))
    assert names_for(text, "gpu-1") == {"llmgw_node_up", "llmgw_node_last_seen_seconds"}
    s = samples(text)
    assert s['llmgw_node_up{node="gpu-1",state="lost"}'] == 0
    assert 61 <= s['llmgw_node_last_seen_seconds{node="gpu-1"}'] < 70
    node.last_seen = time.time() - 59  # within the minute: everything again
    assert "llmgw_gpu_healthy" in names_for(scrape(FleetCollector(svc, list)), "gpu-1")


def test_cordoned_and_draining_nodes_do_not_take_work():
    svc = fleet()
    s = samples(scrape(FleetCollector(svc, list, lambda: {"gpu-1": NodeMark.CORDONED, "cpu-1": NodeMark.DRAINING})))
    assert s['llmgw_node_up{node="gpu-1",state="cordoned"}'] == 0
    assert s['llmgw_node_up{node="cpu-1",state="draining"}'] == 0
    assert not any(k.startswith("llmgw_node_up") and 'state="ready"' in k for k in s)
    svc.get("cpu-1").state = NodeState.UNREACHABLE  # an unreachable node says so, cordoned or not
    s = samples(scrape(FleetCollector(svc, list, lambda: {"cpu-1": NodeMark.CORDONED})))
    assert s['llmgw_node_up{node="cpu-1",state="unreachable"}'] == 0


def test_replicas_by_state_and_ready_per_model():
    reps = [
        Rep("qwen", ReplicaState.READY, ["gpu-1"]),
        Rep("qwen", ReplicaState.READY, ["gpu-1"]),
        Rep("qwen", ReplicaState.LOADING, ["gpu-1"]),
        Rep("llama", ReplicaState.FAILED, ["cpu-1"]),
    ]
    s = samples(scrape(FleetCollector(AgentService(), lambda: reps)))
    assert {st: s[f'llmgw_replicas{{state="{st}"}}'] for st in ReplicaState} == {
        "starting": 0,
        "loading": 1,
        "ready": 2,
        "failed": 1,
        "stopping": 0,
    }
    assert s['llmgw_model_replicas_ready{model="qwen"}'] == 2
    assert s['llmgw_model_replicas_ready{model="llama"}'] == 0
    assert not any(k.startswith("llmgw_model_replicas_ready") and "mistral" in k for k in s)
    empty = samples(scrape(FleetCollector(AgentService(), list)))
    assert all(empty[f'llmgw_replicas{{state="{st}"}}'] == 0 for st in ReplicaState)
    assert not any(k.startswith("llmgw_model_replicas_ready") for k in empty)


def test_gateway_metrics_export_the_fleet():
    m = GatewayMetrics()
    m.watch_fleet(FleetCollector(fleet(), lambda: [Rep("qwen", ReplicaState.READY, ["gpu-1"])]))
    text = m.render().decode()
    assert 'llmgw_node_up{node="gpu-1",state="ready"} 1.0' in text
    assert 'llmgw_model_replicas_ready{model="qwen"} 1.0' in text
    assert "# TYPE llmgw_gpu_healthy gauge" in text
