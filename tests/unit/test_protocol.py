"""The agent <-> control plane messages: round trips, compatibility rules, errors."""

from __future__ import annotations

import orjson
import pytest

from llmgw import protocol as p
from llmgw.protocol import (
    FEATURES,
    GPU,
    HCA,
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    Ack,
    DrainShard,
    EngineProfile,
    EngineWant,
    FabricAttachment,
    FabricScanReply,
    FabricScanRequest,
    FabricTestReply,
    FabricTestRequest,
    FetchProgress,
    GPUFabric,
    GPUUsage,
    Heartbeat,
    Host,
    IBPort,
    LogsReply,
    LogsRequest,
    MemoryInfo,
    NodeInventory,
    NodeLoad,
    NVLinkPeer,
    Pace,
    ProtocolError,
    Provision,
    ProvisionState,
    ProvisionStatus,
    Register,
    RemoveWeights,
    RunningShard,
    ShardLoad,
    ShardState,
    ShardStatus,
    StartShard,
    StopShard,
    Storage,
    decode,
    encode,
)
from llmgw.protocol.doctor import PortSubnetManagers, SMRecord, SubnetManagers


def _inventory() -> NodeInventory:
    return NodeInventory(
        host=Host(
            hostname="gpu01",
            os_id="ubuntu",
            os_version="24.04",
            family="debian",
            arch="amd64",
            cpus=224,
            cpu_flags=["avx2", "avx512f"],
            nvidia_driver="550.90.07",
        ),
        memory=MemoryInfo(total_bytes=2 << 40, available_bytes=1 << 40),
        storage=[
            Storage(
                mount_point="/mnt/lustre",
                fstype="lustre",
                shared=True,
                total_bytes=10,
                free_bytes=5,
                dirs=["/mnt/lustre/models"],
            )
        ],
        gpus=[
            GPU(
                index=0,
                name="NVIDIA H100 80GB HBM3",
                memory_total_bytes=81559 << 20,
                compute_capability="9.0",
                nvlink_peers=[NVLinkPeer(index=1, links=18)],
                nic_paths={"mlx5_0": "PXB"},
                fabric=GPUFabric(state="Completed", cluster_uuid="00000000-0000-0000-0000-000000000000"),
            )
        ],
        gpu_source="nvml",
        adapters=[
            HCA(
                name="mlx5_0",
                node_guid="0x0c42a1030045bd6c",
                ports=[IBPort(hca="mlx5_0", port=1, state="ACTIVE", rate_gbps=400.0, counters={"symbol_error": 0})],
            )
        ],
    )


def _every_message() -> list[p.Message]:
    start = StartShard(
        id="s-1",
        shard_id="r1-0",
        replica_id="r1",
        model="qwen",
        engine="vllm",
        engine_version="0.30.0",
        source="Qwen/Qwen2.5-7B-Instruct",
        gpus=[0, 1],
        http_port=8001,
        rank=0,
        nnodes=2,
        leader_addr="10.0.0.1",
        leader_port=29500,
        hcas=["mlx5_0"],
        profile=EngineProfile(tensor_parallel=2, args=["--enforce-eager"], env={"NCCL_DEBUG": "INFO"}),
        pool="ib-a/h100-80g",
        fabric="ib-a",
        profile_fp="abc123",
    )
    return [
        Register(
            id="reg-1",
            node_id="gpu01",
            protocol_version=PROTOCOL_VERSION,
            agent_version="0.1.0",
            features=list(FEATURES),
            inventory=_inventory(),
            installable_engines=["llamacpp", "vllm"],
            engine_versions={},
            labels={"rack": "r12"},
            mgmt_addr="10.0.0.1",
            mgmt_interface="bond0",
            fabrics=[FabricAttachment(fabric="ib-a", hcas=["mlx5_0"], rate_gbps=400)],
            declared_fabrics=[FabricAttachment(fabric="ib-a", hcas=["mlx5_0"], rate_gbps=400)],
            shards=[
                RunningShard(
                    shard_id="r1-0", state=ShardState.READY, pid=4242, spec=start.model_copy(update={"id": None})
                )
            ],
        ),
        Heartbeat(
            node_id="gpu01",
            memory=MemoryInfo(total_bytes=100, available_bytes=40),
            load=NodeLoad(
                cpu_percent=12.5, cpu_count=224, load1=1.0, shards=[ShardLoad(shard_id="r1-0", cpu_cores=2.5)]
            ),
            gpus=[GPUUsage(index=0, memory_used_bytes=1 << 30, utilization_percent=40)],
            subnet_managers=SubnetManagers(
                ports=[
                    PortSubnetManagers(
                        hca="mlx5_0", port=1, master=SMRecord(guid="0x248a070300f7d3a0", lid=1, state="SMINFO_MASTER")
                    )
                ]
            ),
            provision=[
                ProvisionStatus(engine="llamacpp", version="b10991", state="installing", progress={"bytes_done": 10})
            ],
            shards=[],
        ),
        ShardStatus(
            shard_id="r1-0",
            state="failed",
            reason="exited with status 1",
            output_tail=["CUDA out of memory"],
            fetch=FetchProgress(source="http://mirror/x.gguf", bytes_done=5, bytes_total=10),
        ),
        start,
        StopShard(id="s-2", shard_id="r1-0", reason="scaled to zero", timeout_s=60),
        DrainShard(shard_id="r1-0", timeout_s=300),
        Provision(
            id="p-1", engines=[EngineWant(engine="llamacpp", version="b10991", source_url="http://mirror/releases")]
        ),
        LogsRequest(id="l-1", source="agent", lines=200),
        LogsReply(id="l-1", lines=["a", "b"], sources=["agent", "r1-0"]),
        RemoveWeights(id="w-1", paths=["/var/lib/llmgw-weights/abc.gguf"]),
        Pace(heartbeat_interval=40.0),
        FabricScanRequest(id="f-1", hca="mlx5_0", port=1),
        FabricScanReply(id="f-1", output="# Topology file\n", took_ms=840),
        FabricTestRequest(
            id="t-1", role="client", hca="mlx5_0", port=1, peer="10.0.0.2", tcp_port=18515, seconds=3, gid_index=3
        ),
        FabricTestReply(id="t-1", gbps=390.14, output="...", took_ms=5200),
        Ack(id="s-1", ok=False, error="no GPU 7 on this node"),
    ]


def test_every_message_type_has_a_round_trip_here():
    assert {type(m) for m in _every_message()} == set(MESSAGE_TYPES)
    assert len({c.TYPE for c in MESSAGE_TYPES}) == len(MESSAGE_TYPES)


@pytest.mark.parametrize("msg", _every_message(), ids=lambda m: m.TYPE)
def test_a_message_survives_the_wire(msg):
    data = encode(msg)
    assert isinstance(data, bytes)
    env = orjson.loads(data)
    assert env["type"] == msg.TYPE
    assert ("id" in env) == (msg.id is not None)
    back = decode(data)
    assert type(back) is type(msg)
    assert back == msg
    assert back.id == msg.id
    # A second encode is byte-identical: nothing is lost or invented on the way.
    assert encode(back) == data


def test_none_fields_are_left_out_of_the_wire():
    env = orjson.loads(encode(ShardStatus(shard_id="a", state="ready")))
    assert env == {"type": "shard_status", "payload": {"shard_id": "a", "state": "ready"}}


def test_unknown_fields_from_a_newer_peer_are_ignored_at_every_level():
    data = orjson.dumps(
        {
            "type": "heartbeat",
            "id": "h1",
            "sent_at": "2030-01-01T00:00:00Z",  # envelope field this side does not know
            "payload": {
                "node_id": "gpu01",
                "quantum_load": 0.5,
                "load": {"cpu_percent": 50.0, "cpu_temperature_c": 71},
                "gpus": [{"index": 0, "utilization_percent": 3, "power_watts": 700}],
                "provision": [{"engine": "vllm", "state": "ready", "eta_s": 0}],
            },
        }
    )
    hb = decode(data)
    assert isinstance(hb, Heartbeat)
    assert hb.id == "h1" and hb.node_id == "gpu01"
    assert hb.load.cpu_percent == 50.0
    assert hb.gpus[0].utilization_percent == 3
    assert hb.provision[0].state is ProvisionState.READY
    assert "quantum_load" not in orjson.loads(encode(hb))["payload"]


def test_an_absent_field_is_unknown_not_a_default():
    hb = decode(b'{"type":"heartbeat","payload":{"node_id":"n1","load":{},"gpus":[{"index":0}]}}')
    assert hb.memory is None and hb.storage is None and hb.provision is None and hb.shards is None
    assert hb.load.cpu_percent is None and hb.load.load1 is None and hb.load.cpu_count is None
    g = hb.gpus[0]
    assert g.memory_used_bytes is None and g.utilization_percent is None and g.ecc_uncorrected is None
    # Empty and absent stay distinct: [] is "none", None is "no news".
    hb2 = decode(b'{"type":"heartbeat","payload":{"provision":[]}}')
    assert hb2.provision == [] and hb2.shards is None
    reg = decode(b'{"type":"register","payload":{"node_id":"n1","protocol_version":1}}')
    assert reg.engine_versions is None and reg.features is None and reg.inventory is None
    # A message whose fields are all optional may leave its payload out.
    assert decode(b'{"type":"heartbeat"}') == Heartbeat()


def test_every_optional_field_of_every_model_defaults_to_none():
    models = set(MESSAGE_TYPES) | {
        NodeInventory,
        Host,
        MemoryInfo,
        NodeLoad,
        ShardLoad,
        Storage,
        GPU,
        GPUUsage,
        GPUFabric,
        NVLinkPeer,
        HCA,
        IBPort,
        p.IMEX,
        p.NodeSample,
        ProvisionStatus,
        EngineWant,
        EngineProfile,
        FabricAttachment,
        RunningShard,
        FetchProgress,
        p.LocalWeights,
        p.ByteProgress,
    }
    for model in models:
        for name, field in model.model_fields.items():
            if not field.is_required():
                assert field.default is None, f"{model.__name__}.{name} defaults to {field.default!r}"


@pytest.mark.parametrize(
    "data, words",
    [
        (b"{not json", "not valid JSON"),
        (b"", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b'"register"', "must be a JSON object"),
        (b'{"payload": {}}', 'has no "type"'),
        (b'{"type": "reboot_node", "id": "7"}', 'unknown message type "reboot_node"'),
        (b'{"type": "register", "payload": {"protocol_version": 1}}', "field node_id is required but missing"),
        (
            b'{"type": "register", "payload": {"node_id": "n", "protocol_version": "1"}}',
            'field protocol_version: Input should be a valid integer (got "1")',
        ),
        (b'{"type": "heartbeat", "payload": {"gpus": [{"index": 0}, {"index": "one"}]}}', "field gpus[1].index"),
        (b'{"type": "heartbeat", "payload": {"load": {"cpu_percent": true}}}', "field load.cpu_percent"),
        (b'{"type": "shard_status", "payload": {"shard_id": "a", "state": "exploded"}}', "field state"),
        (b'{"type": "start_shard", "payload": {"shard_id": "a", "engine": "vllm", "http_port": 0}}', "field http_port"),
        (b'{"type": "register", "id": 7, "payload": {"node_id": "n", "protocol_version": 1}}', "envelope field id"),
        (b'{"type": "provision", "payload": []}', "payload"),
        (b'{"type": "ack", "payload": {"ok": true}}', "ack message has no id"),
        (b'{"type": "ack", "id": "1", "payload": {"ok": true, "error": "boom"}}', "ok=false"),
        (b'{"type": "logs_request", "payload": {"source": "agent"}}', "logs_request message has no id"),
    ],
)
def test_bad_input_is_a_protocol_error_that_says_what_is_wrong(data, words):
    with pytest.raises(ProtocolError) as err:
        decode(data)
    assert words in str(err.value)


def test_a_rejected_request_still_names_its_type_and_id_so_it_can_be_acked():
    with pytest.raises(ProtocolError) as err:
        decode(b'{"type": "start_shard", "id": "req-9", "payload": {"shard_id": "a", "engine": "vllm", "gpus": ["0"]}}')
    assert err.value.msg_type == "start_shard" and err.value.msg_id == "req-9"
    assert str(err.value).startswith("start_shard message req-9: field gpus[0]")
    nack = Ack(id=err.value.msg_id, ok=False, error=str(err.value))
    assert decode(encode(nack)).error == str(err.value)


def test_each_side_refuses_the_other_sides_messages():
    down = encode(StartShard(shard_id="a", engine="llamacpp"))
    up = encode(ShardStatus(shard_id="a", state="ready"))
    assert isinstance(decode(down, sender="control"), StartShard)
    assert isinstance(decode(up, sender="agent"), ShardStatus)
    with pytest.raises(ProtocolError, match="start_shard is sent by the control plane"):
        decode(down, sender="agent")
    with pytest.raises(ProtocolError, match="shard_status is sent by an agent"):
        decode(up, sender="control")
    ack = encode(Ack(id="1", ok=True))
    assert decode(ack, sender="agent").ok and decode(ack, sender="control").ok


def test_decode_takes_text_and_memoryview():
    data = encode(LogsRequest(id="x", lines=5))
    assert decode(data.decode()) == decode(memoryview(data)) == decode(bytearray(data))


def test_a_reply_without_an_id_is_refused_before_it_is_sent():
    with pytest.raises(ProtocolError, match="ack needs an id"):
        encode(Ack(ok=True))
    with pytest.raises(ProtocolError, match="only protocol messages"):
        encode(GPU(index=0))  # type: ignore[arg-type]


def test_ack_answering_a_request():
    req = decode(encode(StopShard(id="q1", shard_id="a")))
    assert Ack.answering(req) == Ack(id="q1", ok=True)
    assert Ack.answering(req, "no such shard") == Ack(id="q1", ok=False, error="no such shard")


def test_progress_without_a_total_invents_no_percentage():
    assert FetchProgress(bytes_done=5).percent is None
    assert FetchProgress(bytes_done=5, bytes_total=20).percent == 25.0
    with pytest.raises(ProtocolError, match="bytes_done"):
        decode(b'{"type":"shard_status","payload":{"shard_id":"a","state":"starting","fetch":{"bytes_done":-1}}}')


def test_helpers_on_the_inventory_models():
    assert MemoryInfo(total_bytes=10, available_bytes=4).used_bytes == 6
    assert MemoryInfo(total_bytes=10).used_bytes is None
    joined = GPUFabric(
        state="Completed", status="Success", cluster_uuid="76B1AD76-7c24-4b6b-9f6c-2a1e0d8c11aa", clique_id="32766"
    )
    assert joined.domain == "76b1ad76-7c24-4b6b-9f6c-2a1e0d8c11aa/32766"
    assert GPUFabric(state="In Progress", cluster_uuid="76b1ad76-7c24").domain is None
    assert (
        GPUFabric(state="Completed", cluster_uuid="00000000-0000-0000-0000-000000000000", clique_id="0").domain is None
    )
    inv = _inventory()
    assert [x.hca for x in inv.ib_ports] == ["mlx5_0"] and inv.ib_ports[0].active
    assert IBPort(hca="mlx5_2", port=1, link_layer="Ethernet").is_roce


def test_version_and_features_are_declared():
    assert isinstance(PROTOCOL_VERSION, int) and PROTOCOL_VERSION >= 1
    assert isinstance(FEATURES, tuple) and all(isinstance(f, str) and f for f in FEATURES)
