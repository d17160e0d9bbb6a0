"""The bodies of the admin API (/api/v1 on admin_listen): what `llmgw ctl` sends and reads.

The server writes replies with ``exclude_unset``: a field it did not set is
absent, one it set to None is null. That keeps the shapes the CLI, the docs
and other clients know, where some fields are left out rather than null (a
placement profile's ``error``, a run-time model's ``created_at``). The
mirror's routes answer the mirror API's own bodies (``mirror_api``).

A reader ignores fields it does not know, and most fields are optional,
because `llmgw ctl` of one release talks to servers of another.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import ConfigDict, Field, StrictInt, field_serializer

from .base import WireModel
from .fabric_test import RailResult
from .inventory import MemoryInfo
from .messages import ProvisionStatus, ShardStatus

# ------------------------------------------------------------------ the gateway


class EndpointRow(WireModel):
    """One engine endpoint the gateway routes to, with its health and scraped load."""

    model: str
    url: str
    engine: str | None = None
    healthy: bool | None = None
    health: str | None = None  # words for a person
    available: bool | None = None
    breaker_open: bool | None = None
    consecutive_failures: int | None = None
    inflight: int | None = None
    # None while the engine's metrics are stale.
    waiting: float | None = None
    running: float | None = None
    kv_cache_usage: float | None = None
    metrics_stale: bool | None = None
    # From the measured capacity of its replica's profile (`ctl bench --save`): the requests in
    # flight at which admission counts it full, and its share in routing (1: the default).
    capacity: int | None = None
    weight: float | None = None


class EndpointsReply(WireModel):
    endpoints: list[EndpointRow]


class UsageCounts(WireModel):
    pending: int
    written: int
    dropped: int


class StatusReply(WireModel):
    version: str
    uptime_seconds: float | None = None
    models: int | None = None
    endpoints: int | None = None
    ready: bool | None = None
    api_keys: int | None = None
    auth_enabled: bool | None = None
    usage: UsageCounts | None = None  # None without a usage writer


class Removed(WireModel):
    """What a DELETE removed: a node, a model, a mirror version (MODEL/VERSION)."""

    removed: str


# ------------------------------------------------------------------ nodes


class NodeRow(WireModel):
    node_id: str
    state: str  # ready, cordoned, draining, unreachable, lost...
    connected: bool | None = None
    last_seen: float | None = None  # wall clock
    last_seen_ago_s: float | None = None
    heartbeat_pace_s: float | None = None  # the interval the control plane asked the agent for; None: its own
    agent_version: str | None = None
    mgmt_addr: str | None = None
    mgmt_interface: str | None = None
    labels: dict[str, str] | None = None
    engines: dict[str, str] | None = None  # installed engine -> version
    provision: dict[str, ProvisionStatus] | None = None  # by engine
    memory: MemoryInfo | None = None
    gpus_total: int | None = None
    gpus_free: int | None = None  # healthy and claimed by no shard
    classes: list[str] | None = None
    fabrics: list[str] | None = None
    disk_free_bytes: int | None = None  # of the weights filesystem
    disk_total_bytes: int | None = None
    replicas: list[str] | None = None
    warnings: list[str] | None = None
    shards: dict[str, ShardStatus] | None = None  # by shard id

    # The agent's own messages, passed on as the agent leaves them: an unknown
    # figure is left out, not null.
    @field_serializer("provision", "shards")
    def _agent_statuses(
        self,
        value: dict[str, ProvisionStatus] | dict[str, ShardStatus] | None,
    ) -> dict[str, dict[str, Any]] | None:
        if value is None:
            return None
        return {k: v.model_dump(mode="json", exclude_none=True) for k, v in value.items()}

    @field_serializer("memory")
    def _agent_memory(self, value: MemoryInfo | None) -> dict[str, Any] | None:
        return None if value is None else value.model_dump(mode="json", exclude_none=True)


class NodesReply(WireModel):
    nodes: list[NodeRow]


class NodeAction(WireModel):
    """The reply to cordon, uncordon and drain."""

    node: str
    state: str | None = None  # None when the node is not known (any more)
    message: str | None = None  # the control plane's sentence about it


class NodeLogs(WireModel):
    source: str | None = None
    lines: list[str] | None = None
    sources: list[str] | None = None  # every log the node can show


# ------------------------------------------------------------------ replicas


class ShardFetch(WireModel):
    """A shard's weights download."""

    source: str | None = None
    bytes_done: int | None = None
    bytes_total: int | None = None  # None when the length is not known
    percent: float | None = None


class ReplicaShard(WireModel):
    node: str | None = None
    shard_id: str
    rank: int | None = None
    gpus: list[int] | None = None
    state: str | None = None
    pid: int | None = None
    fetch: ShardFetch | None = None


class ReplicaRow(WireModel):
    id: str
    model: str
    profile: str | None = None
    state: str
    pool: str | None = None
    stale: bool | None = None  # started from an older version of its profile
    adopted: bool | None = None
    age_s: float | None = None
    idle_s: float | None = None  # since the model's last request
    endpoint: str | None = None
    reason: str | None = None  # why it failed or is stopping
    replaces: str | None = None
    replaced_by: str | None = None
    shards: list[ReplicaShard] | None = None


class ReplicasReply(WireModel):
    replicas: list[ReplicaRow]


# ------------------------------------------------------------------ the catalog
#
# A catalog model is a model as server.yaml or a model file gives it
# (config.ModelConfig, which this layer cannot import), plus what the catalog
# adds. The fields `llmgw ctl` reads are named here; the rest of the spec
# travels as extra fields, unchanged.


class CatalogScaling(WireModel):
    model_config = ConfigDict(extra="allow")

    min: int | None = None
    max: int | None = None
    idle_timeout: float | None = None  # seconds
    state: str | None = None  # added by the catalog: fixed, on demand, stopped...


class CatalogProfile(WireModel):
    model_config = ConfigDict(extra="allow")

    name: str | None = None
    engine: str | None = None
    gpu_class: str | None = None  # None: CPU
    min_memory_gb: float | None = None
    fingerprint: str | None = None  # added by the catalog


class ModelBackoff(WireModel):
    """A model whose replicas keep failing to start: when it is tried again."""

    failures: int
    retry_in_s: float
    last_failure: str | None = None


class ModelStatus(WireModel):
    target: int | None = None  # replicas wanted now; None for a model served from static endpoints
    replicas: dict[str, int] | None = None  # state -> how many
    problem: str | None = None
    backoff: ModelBackoff | None = None


class CatalogModel(WireModel):
    model_config = ConfigDict(extra="allow")

    name: str
    source: str | None = None
    scaling: CatalogScaling | None = None
    profiles: list[CatalogProfile] | None = None
    declared: bool | None = None  # in server.yaml, rather than added at run time
    managed: bool | None = None  # placed by the control plane (has profiles)
    created_at: str | None = None  # run-time models only (ISO 8601)
    updated_at: str | None = None
    status: ModelStatus | None = None  # managed models, on a control plane


class ModelsReply(WireModel):
    models: list[CatalogModel]
    problems: list[str] | None = None  # stored models that could not be loaded, in words


class ModelReply(WireModel):
    """The model as the catalog now holds it: after add, scale, or serve from the mirror."""

    model: CatalogModel


class ModelAddRequest(WireModel):
    # A model as a model file holds it; the catalog validates it (config.ModelConfig).
    model: dict[str, Any]
    source_check: bool = True  # check first that the source can be read


class ScaleRequest(WireModel):
    min: StrictInt
    max: StrictInt | None = None  # left out: the same as min, or 1 when min is 0


class MirrorServeRequest(WireModel):
    """Add a catalog model from a present mirror version; what is left out is worked out."""

    name: str | None = None  # default: the mirror's model name
    gpu_class: str | None = None  # default: CPU
    engine: str | None = None  # default: from the file type
    scaling: dict[str, Any] | None = None  # as a model file's scaling:
    description: str | None = None
    source_check: bool = True


# ------------------------------------------------------------------ placement


class NodeVerdict(WireModel):
    node: str
    chosen: bool
    reasons: list[str]


class ProfilePlacement(WireModel):
    profile: str
    error: str | None = None  # set (and nodes empty) when the profile cannot be placed at all
    nodes: list[NodeVerdict]
    capacity: str | None = None  # what a replica of it was measured to serve (`ctl bench --save`), in words


class PlacementReply(WireModel):
    model: str
    profiles: list[ProfilePlacement]


# ------------------------------------------------------------------ fabrics


class SubnetManagerRow(WireModel):
    guid: str
    lid: int | None = None
    priority: int | None = None
    state: str  # master, standby, discovering, not_active, unknown


class FabricMemberRow(WireModel):
    node: str
    hca: str
    port: int
    rate_gbps: float | None = None
    master_guid: str | None = None  # the master this port's sminfo named


class MasterChangeRow(WireModel):
    at: float  # wall clock
    old_guid: str
    new_guid: str


class FabricMapSummary(WireModel):
    """The last `ibnetdiscover` map of a fabric, counted; the map itself is at .../topology."""

    scanned_at: float | None = None  # wall clock of the map shown
    node: str | None = None  # the node whose agent ran the scan
    hca: str | None = None
    error: str | None = None  # the last scan's failure (the map shown, if any, is older)
    error_at: float | None = None
    switches: int | None = None
    adapters: int | None = None
    cables: int | None = None
    degraded: int | None = None
    rails_aligned: bool | None = None


class FabricRow(WireModel):
    id: str  # ib:<lowest SM GUID> or roce:<network>
    kind: str  # infiniband or roce
    declared: list[str]  # the agent.yaml names its ports are declared under
    network: str | None = None  # RoCE
    master: SubnetManagerRow | None = None
    managers: list[SubnetManagerRow] = Field(default_factory=list)
    managers_listed: bool = False  # False: standbys are not known (no saquery answer)
    members: list[FabricMemberRow] = Field(default_factory=list)
    master_changes: list[MasterChangeRow] = Field(default_factory=list)  # the last day's, oldest first
    map: FabricMapSummary | None = None  # InfiniBand only


class FabricProblemRow(WireModel):
    fabric: str | None = None
    node: str | None = None
    kind: str  # no_standby, master_disagreement, ... (docs/fabrics.md)
    level: str  # fail or warn
    message: str
    fix: str


class FabricsReply(WireModel):
    fabrics: list[FabricRow]
    problems: list[FabricProblemRow]


class FabricTestRun(WireModel):
    """POST /api/v1/fabric-test: measure the rails between two nodes."""

    a: str
    b: str
    fabric: str | None = None  # default: the one fabric both advertise
    seconds: int | None = None  # 3 when absent, at most 30


class FabricTestView(WireModel):
    a: str
    b: str
    fabric: str
    took_s: float
    rails: list[RailResult]
    notes: list[str] = Field(default_factory=list)
    ok: bool


# ------------------------------------------------------------------ ctl status, usage, weights (admin/ops.py)


class ClusterModel(WireModel):
    """One catalog model (or, on a plain gateway, one model of server.yaml) in `ctl status`."""

    name: str
    managed: bool | None = None  # placed by the control plane; False: static endpoints
    target: int | None = None  # replicas wanted now (managed models)
    ready: int | None = None  # replicas ready, or for static endpoints those the router may use
    replicas: dict[str, int] | None = None  # state -> how many
    scaling: str | None = None  # the catalog's words: fixed, on demand, stopped...
    endpoints: int | None = None  # static endpoints declared


class ClusterFabric(WireModel):
    """A fabric the nodes advertise, and the models whose replicas have shards on its nodes."""

    fabric: str
    models: list[str]
    nodes_used: int  # of its nodes, those running a shard of a live replica
    nodes_total: int


class ClusterTrouble(WireModel):
    kind: str  # replica, node, engine, model, catalog
    subject: str | None = None  # the replica, node or model it is about
    message: str


class ClusterStatus(WireModel):
    """GET /api/v1/cluster: the cluster on one screen."""

    version: str
    control_plane: bool
    standby: str | None = None  # why this control plane places nothing, when it is a standby
    endpoints: int | None = None  # every endpoint the gateway routes to
    endpoints_available: int | None = None
    nodes: dict[str, int] | None = None  # state -> how many (control plane only)
    models: list[ClusterModel] = Field(default_factory=list)
    fabrics: list[ClusterFabric] = Field(default_factory=list)
    failing: list[ClusterTrouble] = Field(default_factory=list)


class UsageGroup(WireModel):
    id: str | None = None  # None: usage outside any group of this level (see label)
    label: str
    requests: int
    tokens_in: int
    tokens_out: int
    spend_micros: int
    budget_micros: int | None = None  # the budget this very level sets, when it sets one
    budget_period: str | None = None  # day or month


class UsageReply(WireModel):
    """GET /api/v1/usage?by=org|team|project|person&since=ISO-8601: usage summed per group."""

    by: str
    since: str  # ISO 8601, UTC
    until: str
    priced: bool  # whether any model has a price (else spend is 0 throughout)
    groups: list[UsageGroup]


class WeightsFile(WireModel):
    path: str
    size_bytes: int | None = None
    shared: bool | None = None  # on a network filesystem other nodes also see
    used_by: list[str] = Field(default_factory=list)  # models (or replicas) needing it; empty: none does


class NodeWeights(WireModel):
    node: str
    connected: bool | None = None
    files: list[WeightsFile]


class WeightsReply(WireModel):
    """GET /api/v1/weights: what each node's weights cache holds (files llmgw fetched), and who needs it."""

    nodes: list[NodeWeights]


class WeightsAsked(WireModel):
    node: str
    paths: list[str]
    size_bytes: int
    sent: bool | None = None  # False: the node could not be asked (error says why)
    error: str | None = None  # why it could not be asked, or what the node kept and why


class WeightsCollectReply(WireModel):
    """POST /api/v1/weights/collect: which nodes were asked to remove which unneeded files."""

    nodes: list[WeightsAsked]


# ------------------------------------------------------------------ measured capacity (ctl bench --save, ctl capacity)


class CapacitySLO(WireModel):
    """The latency targets a capacity was measured against, in seconds (p99 of each)."""

    ttft_p99: float = Field(gt=0)  # time to first token
    tpot_p99: float = Field(gt=0)  # time per output token after the first


class Capacity(WireModel):
    """What one replica of a model on one profile served while it met ``slo`` (`llmgw ctl bench`):
    the body and reply of PUT /api/v1/models/{model}/capacity. Measuring again replaces it.
    Throughput and latencies are those of the last level that held, not of the peak."""

    model: str
    profile: str
    max_concurrency_at_slo: StrictInt = Field(ge=0)  # 0: not even one request at a time met the SLO
    throughput_tok_per_sec: float = Field(ge=0)  # output tokens per second at that level
    ttft_p99: float | None = Field(default=None, ge=0)  # seconds, at that level; None when none held
    tpot_p99: float | None = Field(default=None, ge=0)
    # The engine's own queue and KV-cache use seen at that level: what admission may treat as
    # healthy for this model (None: the engine publishes no such figure).
    suggested_target_waiting: StrictInt | None = Field(default=None, ge=0)
    suggested_kv_ceiling: float | None = Field(default=None, ge=0, le=1)
    slo: CapacitySLO
    target: str  # the endpoint the load went to
    measured_at: datetime


class CapacityView(Capacity):
    measured_by: str | None = None  # the admin credential that saved it


class CapacityReply(WireModel):
    """GET /api/v1/capacity: every measurement, by model and profile."""

    capacity: list[CapacityView]


# ------------------------------------------------------------------ plan (`llmgw ctl plan`)


class PlanArchitecture(WireModel):
    """What GET /api/v1/plan read of a model, and where (server/control/sizing.py counts it)."""

    read_from: str  # in words: "config.json of m/v in the mirror (URL)", "the GGUF header of …"
    format: str  # config.json or gguf
    name: str  # LlamaForCausalLM, or a GGUF's architecture (llama)
    model_type: str | None = None
    parameters: int | None = None  # None: the header did not say enough to count them
    active_parameters: int | None = None  # per token, for a mixture of experts
    layers: int
    hidden_size: int
    attention_heads: int
    kv_heads: int
    head_dim: int
    intermediate_size: int | None = None
    vocab_size: int | None = None
    experts: int | None = None
    experts_per_token: int | None = None
    shared_experts: int | None = None
    tied_embeddings: bool | None = None
    latent_attention: bool = False  # DeepSeek's MLA: the KV cache holds the latent
    max_context: int | None = None
    kv_elements_per_token: int  # all layers together
    checkpoint: str | None = None  # the checkpoint's own precision (torch_dtype, quantization_config, GGUF type)
    file_bytes: int | None = None  # a GGUF's size (all its parts)
    notes: list[str] = Field(default_factory=list)


class PlanRow(WireModel):
    """One precision on one GPU class (or CPU node size); ``pool`` "-" for the figures alone."""

    precision: str  # bf16, fp8, int8, int4 (vLLM); f16, q8_0, q4_k_m (llama.cpp); a GGUF's own type
    engine: str  # vllm or llamacpp
    pool: str  # h100-80g, cpu-64g, or "-"
    gpu: bool
    memory_bytes: int | None = None  # per GPU, or the CPU node's
    fits: bool | None = None  # None for the figures alone
    gpus_per_replica: int | None = None  # 0 on a CPU node; None where no layout of the class would do
    tensor_parallel: int | None = None  # what the profile's tp says (GPUs across its nodes)
    nodes: int | None = None  # what the profile's nodes says
    weights_bytes: int
    kv_cache_bytes: int
    headroom_bytes: int | None = None
    total_bytes: int | None = None  # weights + KV cache + headroom
    free_bytes: int | None = None  # what the replica's GPUs (or node) have left; None where it does not fit
    reason: str | None = None  # why it does not fit
    checkpoint: bool = False  # the precision the checkpoint itself is in


class PlanReply(WireModel):
    """GET /api/v1/plan?model=M[&context=N][&concurrency=N][&kv_cache=fp16|fp8]."""

    model: str
    context: int
    concurrency: int
    kv_cache: str
    architecture: PlanArchitecture
    rows: list[PlanRow]  # every precision on every pool of the fleet
    figures: list[PlanRow]  # every precision's weights and KV cache, whatever the fleet
    headroom: str  # the rule, in words
    notes: list[str] = Field(default_factory=list)
