"""Messages between the node agent and the control plane (pydantic), shared by both sides.

JSON over one WebSocket, one message per frame, in an envelope
``{"type", "id", "payload"}`` (see ``codec``). Compatibility rules, because a
fleet is upgraded one machine at a time:

* fields are only ever added; an absent field means unknown, never a default;
* unknown fields are ignored;
* ``PROTOCOL_VERSION`` goes up when a message type or an enum value is added,
  and each side only sends what the other's version knows;
* ``FEATURES`` lists the requests an agent answers beyond register and
  heartbeat, so a control plane never waits on an agent that cannot answer.
"""

from .codec import ProtocolError, Sender, decode, encode
from .inventory import (
    GPU,
    HCA,
    IMEX,
    LINK_ETHERNET,
    LINK_INFINIBAND,
    NIC_PATH_ORDER,
    GPUFabric,
    GPUUsage,
    Host,
    IBPort,
    MemoryInfo,
    NodeInventory,
    NodeLoad,
    NodeSample,
    NVLinkPeer,
    ShardLoad,
    Storage,
)
from .messages import (
    MESSAGE_TYPES,
    STREAM_PATH,
    Ack,
    ByteProgress,
    DrainShard,
    EngineProfile,
    EngineWant,
    FabricAttachment,
    FabricScanReply,
    FabricScanRequest,
    FabricTestReply,
    FabricTestRequest,
    FetchProgress,
    Heartbeat,
    LocalWeights,
    LogsReply,
    LogsRequest,
    Message,
    Pace,
    Provision,
    ProvisionState,
    ProvisionStatus,
    Register,
    RemoveWeights,
    RunningShard,
    ShardState,
    ShardStatus,
    StartShard,
    StopShard,
)

# 2: fabric_scan_* and fabric_test_* (sent only to agents listing their features).
PROTOCOL_VERSION = 3  # 3: pace

FEATURE_LOGS = "logs"
FEATURE_REMOVE_WEIGHTS = "remove-weights"
FEATURE_DRAIN = "drain"
FEATURE_FABRIC_SCAN = "fabric-scan"
FEATURE_FABRIC_TEST = "fabric-test"
FEATURE_PACE = "pace"  # the agent heartbeats at the interval a Pace message asks for
# What this build's agent answers. A request whose feature the agent did not
# list is not sent to it.
FEATURES: tuple[str, ...] = (
    FEATURE_LOGS,
    FEATURE_REMOVE_WEIGHTS,
    FEATURE_DRAIN,
    FEATURE_FABRIC_SCAN,
    FEATURE_FABRIC_TEST,
    FEATURE_PACE,
)

__all__ = [
    "FEATURES",
    "FEATURE_DRAIN",
    "FEATURE_FABRIC_SCAN",
    "FEATURE_FABRIC_TEST",
    "FEATURE_LOGS",
    "FEATURE_PACE",
    "FEATURE_REMOVE_WEIGHTS",
    "GPU",
    "HCA",
    "IMEX",
    "LINK_ETHERNET",
    "LINK_INFINIBAND",
    "MESSAGE_TYPES",
    "NIC_PATH_ORDER",
    "PROTOCOL_VERSION",
    "STREAM_PATH",
    "Ack",
    "ByteProgress",
    "DrainShard",
    "EngineProfile",
    "EngineWant",
    "FabricAttachment",
    "FabricScanReply",
    "FabricScanRequest",
    "FabricTestReply",
    "FabricTestRequest",
    "FetchProgress",
    "GPUFabric",
    "GPUUsage",
    "Heartbeat",
    "Host",
    "IBPort",
    "LocalWeights",
    "LogsReply",
    "LogsRequest",
    "MemoryInfo",
    "Message",
    "NVLinkPeer",
    "NodeInventory",
    "NodeLoad",
    "NodeSample",
    "Pace",
    "ProtocolError",
    "Provision",
    "ProvisionState",
    "ProvisionStatus",
    "Register",
    "RemoveWeights",
    "RunningShard",
    "Sender",
    "ShardLoad",
    "ShardState",
    "ShardStatus",
    "StartShard",
    "StopShard",
    "Storage",
    "decode",
    "encode",
]
