"""The messages on the agent stream.

Up (agent -> control plane): register (first, on every connection),
heartbeat, shard_status, logs_reply, fabric_scan_reply, fabric_test_reply,
ack. Down: start_shard, stop_shard, drain_shard, provision, logs_request,
fabric_scan_request, fabric_test_request, remove_weights, ack.

Request and reply are paired by the envelope's ``id``: a message sent with an
id expects an answer carrying the same id (an ``ack``, or a ``logs_reply`` for
a ``logs_request``); one sent without an id expects none.

In a heartbeat, an absent list means "no news" and an empty one means
"none": ``provision=[]`` says there is nothing to install, ``provision=None``
says nothing changed. A heartbeat may therefore be sent early carrying only
what changed.

Enum values (shard and provision states) are part of the protocol version: a
sender only uses values its peer's ``protocol_version`` knows.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, ClassVar, Literal

from pydantic import Field, model_validator

from .base import WireModel
from .doctor import SubnetManagers
from .inventory import (
    IMEX,
    GPUUsage,
    IBPort,
    MemoryInfo,
    NodeInventory,
    NodeLoad,
    NonNegInt,
    Storage,
)

# The HTTP path of the WebSocket that carries these messages: agents dial it,
# the control plane serves it.
STREAM_PATH = "/v1/agent/stream"

Direction = Literal["up", "down", "both"]
Port = Annotated[int, Field(ge=1, le=65535)]


class Message(WireModel):
    """A payload that travels in an envelope of its own."""

    TYPE: ClassVar[str]
    DIRECTION: ClassVar[Direction]
    # Whether the message is meaningless without an id (replies, and requests
    # that must be answered).
    NEEDS_ID: ClassVar[bool] = False

    # The envelope's id, kept on the message so a handler can answer it; not
    # part of the payload.
    id: str | None = Field(default=None, exclude=True)


# ------------------------------------------------------------------ shards


class ShardState(StrEnum):
    """The one shard state: the agent's supervisor keeps it and the stream carries it."""

    PENDING = "pending"  # accepted; waiting (for the weights, the leader's port) before anything runs
    STARTING = "starting"  # processes run; the engine's HTTP server does not answer yet
    # It answers, but /health is not 200 or the model is not listed yet (a 70B load takes minutes).
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"
    STOPPED = "stopped"

    @property
    def running(self) -> bool:
        """Not finished: a process runs or is about to."""
        return self not in (ShardState.FAILED, ShardState.STOPPED)


class ByteProgress(WireModel):
    """Bytes done out of a total; the total is None when the length is not
    known, and then no percentage should be invented."""

    bytes_done: NonNegInt
    bytes_total: NonNegInt | None = None

    @property
    def percent(self) -> float | None:
        if not self.bytes_total:
            return None
        return min(100.0, 100.0 * self.bytes_done / self.bytes_total)


class FetchProgress(ByteProgress):
    source: str | None = None  # fetches are shared per source, so progress is keyed by it


class ShardStatus(Message):
    """A shard's state. A status repeating the state the shard is already in,
    with ``fetch`` set, is progress, not a transition: it must not reset a
    startup timer."""

    TYPE: ClassVar[str] = "shard_status"
    DIRECTION: ClassVar[Direction] = "up"

    shard_id: str
    replica_id: str | None = None
    state: ShardState
    reason: str | None = None  # words for a person, on failed and stopped
    # The engine's last lines of output; on failure the only diagnosis there is.
    output_tail: list[str] | None = None
    fetch: FetchProgress | None = None
    pid: int | None = None


class EngineProfile(WireModel):
    """How an engine is run for a model; the agent validates it before launching."""

    name: str | None = None
    tensor_parallel: Annotated[int, Field(ge=1)] | None = None
    pipeline_parallel: Annotated[int, Field(ge=1)] | None = None
    context_size: Annotated[int, Field(ge=1)] | None = None
    parallel: Annotated[int, Field(ge=1)] | None = None  # concurrent requests (llama.cpp slots)
    dtype: str | None = None
    quantization: str | None = None  # e.g. fp8 (refused below compute capability 8.9)
    args: list[str] | None = None  # extra engine arguments, e.g. --no-jinja
    env: dict[str, str] | None = None  # overrides the NCCL variables the agent sets
    launch_mode: str | None = None  # vLLM multi-node: mp or ray


class StartShard(Message):
    """Launch one shard. Idempotent by shard_id: a repeat (the control plane
    retries) must not start a second process."""

    TYPE: ClassVar[str] = "start_shard"
    DIRECTION: ClassVar[Direction] = "down"

    shard_id: str
    replica_id: str | None = None
    model: str | None = None  # the name the engine serves it under
    engine: str  # llamacpp, vllm, sglang
    engine_version: str | None = None
    source: str | None = None  # weights: a URL, a set URL ending in /, a path or a model id
    gpus: list[NonNegInt] | None = None
    http_port: Port | None = None
    # Multi-node: this node's rank (0 leads and serves HTTP), the rendezvous.
    rank: NonNegInt | None = None
    nnodes: Annotated[int, Field(ge=1)] | None = None
    leader_addr: str | None = None
    leader_port: Port | None = None
    hcas: list[str] | None = None  # the chosen fabric's adapters on this node
    mgmt_interface: str | None = None  # the agent replaces it with its own
    profile: EngineProfile | None = None
    # The replica's own secret: the engine requires it and only the gateway sends it,
    # so nobody reaches the engine around the gateway's keys and limits. The same on
    # every shard of a replica; echoed back in RunningShard, so an adopted engine keeps
    # its key. Never logged (repr=False keeps it out of any repr); None: none was made
    # (a control plane from before keys), and the engine then answers anyone.
    api_key: str | None = Field(default=None, repr=False)
    # Never interpreted by the agent; echoed back in RunningShard after a restart.
    pool: str | None = None
    fabric: str | None = None  # "nvl:<domain>" inside a multi-node NVLink domain
    profile_fp: str | None = None


class StopShard(Message):
    TYPE: ClassVar[str] = "stop_shard"
    DIRECTION: ClassVar[Direction] = "down"

    shard_id: str
    reason: str | None = None
    # Grace between SIGTERM and SIGKILL; None means the agent's stop_timeout.
    timeout_s: Annotated[float, Field(ge=0)] | None = None


class DrainShard(Message):
    """Stop a shard once what it is serving has finished (or the deadline passed)."""

    TYPE: ClassVar[str] = "drain_shard"
    DIRECTION: ClassVar[Direction] = "down"

    shard_id: str
    reason: str | None = None
    timeout_s: Annotated[float, Field(ge=0)] | None = None


class RunningShard(WireModel):
    """A shard the agent runs, described back in full on every registration:
    the control plane keeps no replica state across its own restart."""

    shard_id: str
    replica_id: str | None = None
    state: ShardState | None = None
    pid: int | None = None
    spec: StartShard | None = None  # as received, so pool/fabric/profile_fp survive


# ------------------------------------------------------------ provisioning


class ProvisionState(StrEnum):
    INSTALLING = "installing"
    READY = "ready"
    FAILED = "failed"
    UNSUPPORTED = "unsupported"  # cannot run here (old driver, old GPU, unknown engine)
    SKIPPED = "skipped"  # not meant for this node (vLLM without a GPU): nothing is wrong


class EngineWant(WireModel):
    engine: str  # llamacpp, vllm, sglang
    version: str  # b10991, 0.30.0
    source_url: str | None = None  # base URL of release archives (a mirror); None = upstream


class Provision(Message):
    """The engines this node should have; sent on every connection and when it changes."""

    TYPE: ClassVar[str] = "provision"
    DIRECTION: ClassVar[Direction] = "down"

    engines: list[EngineWant]


class ProvisionStatus(WireModel):
    engine: str
    version: str | None = None
    variant: str | None = None  # cpu, cuda-12.8, cu13
    state: ProvisionState
    detail: str | None = None  # words for a person
    progress: ByteProgress | None = None  # while downloading
    # Failed: when the agent tries again (wall clock, epoch seconds); None when
    # no attempt is scheduled yet, or from an agent that does not say.
    retry_at: float | None = None


# ------------------------------------------------------- node-level messages


class FabricAttachment(WireModel):
    """A declared fabric this node is usably on (cannot be read off the wire)."""

    fabric: str
    hcas: list[str] | None = None
    rate_gbps: float | None = None  # the slowest active port among them


class LocalWeights(WireModel):
    path: str
    size_bytes: NonNegInt | None = None
    shared: bool | None = None  # on a network filesystem other nodes also see


class Register(Message):
    """The first message on every connection."""

    TYPE: ClassVar[str] = "register"
    DIRECTION: ClassVar[Direction] = "up"

    node_id: str = Field(min_length=1)
    protocol_version: Annotated[int, Field(ge=1)]
    agent_version: str | None = None
    # Requests this agent answers beyond the base set (see FEATURES); the
    # control plane sends no others rather than waiting on a silent agent.
    features: list[str] | None = None
    inventory: NodeInventory | None = None
    installable_engines: list[str] | None = None
    # None: not probed yet; {}: probed, nothing installed.
    engine_versions: dict[str, str] | None = None
    labels: dict[str, str] | None = None
    mgmt_addr: str | None = None
    mgmt_interface: str | None = None
    fabrics: list[FabricAttachment] | None = None  # the declared ones usable now
    fabric_problems: list[str] | None = None  # why a declared fabric is not advertised
    # agent.yaml's fabrics as declared, usable or not: the control plane tells an
    # adapter nobody declared from one whose fabric is down.
    declared_fabrics: list[FabricAttachment] | None = None
    shards: list[RunningShard] | None = None  # all of them, every time
    weights: list[LocalWeights] | None = None
    # agent.yaml's heartbeat_interval: a pace no longer than it is not sent.
    heartbeat_interval: float | None = Field(default=None, gt=0)
    # The pace the agent kept on its previous connection: after a control-plane restart, how
    # large the fleet was, before the registry has filled again.
    heartbeat_pace: float | None = Field(default=None, gt=0)


class Heartbeat(Message):
    TYPE: ClassVar[str] = "heartbeat"
    DIRECTION: ClassVar[Direction] = "up"

    node_id: str | None = None
    # Re-read every time (NodeSample's fields).
    memory: MemoryInfo | None = None
    load: NodeLoad | None = None
    storage: list[Storage] | None = None
    gpus: list[GPUUsage] | None = None
    ib_ports: list[IBPort] | None = None
    imex: IMEX | None = None
    # Sent when changed; None = no news.
    engine_versions: dict[str, str] | None = None
    provision: list[ProvisionStatus] | None = None
    shards: list[ShardStatus] | None = None
    fabrics: list[FabricAttachment] | None = None  # replaces the node's fabrics
    fabric_problems: list[str] | None = None  # sent with fabrics: [] when nothing keeps one out
    weights: list[LocalWeights] | None = None
    # The subnet managers behind the node's ACTIVE InfiniBand ports, read once a
    # minute (absent in between: no news). ``subnet_managers_error`` instead when
    # the read could not run at all (e.g. "install infiniband-diags").
    subnet_managers: SubnetManagers | None = None
    subnet_managers_error: str | None = None


class LogsRequest(Message):
    TYPE: ClassVar[str] = "logs_request"
    DIRECTION: ClassVar[Direction] = "down"
    NEEDS_ID: ClassVar[bool] = True

    source: str | None = None  # "agent" (the default) or a shard id
    lines: NonNegInt | None = None


class LogsReply(Message):
    TYPE: ClassVar[str] = "logs_reply"
    DIRECTION: ClassVar[Direction] = "up"
    NEEDS_ID: ClassVar[bool] = True

    source: str | None = None
    lines: list[str] | None = None
    sources: list[str] | None = None  # every log this node can show
    error: str | None = None  # e.g. an unknown source


class FabricScanRequest(Message):
    """Run `ibnetdiscover -C hca -P port` and send back what it printed (the
    control plane parses it: a format it does not know is its upgrade, not the agent's)."""

    TYPE: ClassVar[str] = "fabric_scan_request"
    DIRECTION: ClassVar[Direction] = "down"
    NEEDS_ID: ClassVar[bool] = True

    hca: str = Field(min_length=1)
    port: Annotated[int, Field(ge=1)]


class FabricScanReply(Message):
    TYPE: ClassVar[str] = "fabric_scan_reply"
    DIRECTION: ClassVar[Direction] = "up"
    NEEDS_ID: ClassVar[bool] = True

    output: str | None = None  # ibnetdiscover's stdout, whole; absent when it failed
    error: str | None = None  # why there is no map, in words
    took_ms: NonNegInt | None = None


class FabricTestRequest(Message):
    """One side of one rail of `ctl fabric-test`: ``server`` runs `ib_write_bw`
    listening and answers when the test is over; ``client`` runs it against
    ``peer`` (the server's management address), retrying while the server is not
    listening yet. Both take the same ``tcp_port`` and ``seconds``."""

    TYPE: ClassVar[str] = "fabric_test_request"
    DIRECTION: ClassVar[Direction] = "down"
    NEEDS_ID: ClassVar[bool] = True

    role: Literal["server", "client"]
    hca: str = Field(min_length=1)
    port: Annotated[int, Field(ge=1)]
    peer: str | None = None  # the client's only
    tcp_port: Port
    seconds: Annotated[int, Field(ge=1, le=30)]
    gid_index: NonNegInt | None = None  # RoCE: the port's RoCE v2 GID index


class FabricTestReply(Message):
    TYPE: ClassVar[str] = "fabric_test_reply"
    DIRECTION: ClassVar[Direction] = "up"
    NEEDS_ID: ClassVar[bool] = True

    gbps: Annotated[float, Field(ge=0)] | None = None  # the BW average column, in Gbit/s
    output: str | None = None  # what ib_write_bw printed (its last lines)
    error: str | None = None  # why nothing was measured, in words
    took_ms: NonNegInt | None = None


class RemoveWeights(Message):
    """Delete fetched weights; the agent re-checks each path is one it fetched."""

    TYPE: ClassVar[str] = "remove_weights"
    DIRECTION: ClassVar[Direction] = "down"

    paths: list[str]


class Pace(Message):
    """How often the control plane asks this agent to heartbeat: no more often than
    ``heartbeat_interval`` seconds (the agent keeps its own interval when that is longer).
    A large fleet is asked to report less often so that the heartbeats the control plane
    takes each second stay bounded; it waits longer before calling a node unreachable in
    proportion. ``None``: the agent's own interval again. Sent only to agents that list
    the ``pace`` feature."""

    TYPE: ClassVar[str] = "pace"
    DIRECTION: ClassVar[Direction] = "down"

    heartbeat_interval: float | None = Field(default=None, gt=0)


class Ack(Message):
    """The answer to a message sent with an id: ok, or the error in words."""

    TYPE: ClassVar[str] = "ack"
    DIRECTION: ClassVar[Direction] = "both"
    NEEDS_ID: ClassVar[bool] = True

    ok: bool
    error: str | None = None

    @model_validator(mode="after")
    def _error_means_not_ok(self) -> Ack:
        if self.ok and self.error:
            raise ValueError("an ack with an error must have ok=false")
        return self

    @classmethod
    def answering(cls, request: Message, error: str | None = None) -> Ack:
        """The ack for ``request``: ok when there is no error."""
        return cls(id=request.id, ok=error is None, error=error)


MESSAGE_TYPES: tuple[type[Message], ...] = (
    Register,
    Heartbeat,
    ShardStatus,
    LogsReply,
    FabricScanReply,
    FabricTestReply,
    StartShard,
    StopShard,
    DrainShard,
    Provision,
    LogsRequest,
    FabricScanRequest,
    FabricTestRequest,
    RemoveWeights,
    Pace,
    Ack,
)
