"""Does a model fit? Weights plus KV cache against the fleet's GPUs and memory (`llmgw ctl plan`).

Pure arithmetic: the admin API (``llmgw/server/admin/plan.py``) reads a model's ``config.json``
(Hugging Face layout) or its GGUF header and the fleet's inventory, and this module turns them
into figures. Nothing here does I/O.

The rules, also in docs/operations.md ("Choosing what to run"):

* **Parameters** from ``config.json``: the embeddings (vocab × hidden); per layer, attention
  (q and o: hidden × heads × head_dim each; k and v: hidden × kv_heads × head_dim each, so
  grouped-query attention counts its fewer KV heads; DeepSeek's latent attention its low-rank
  projections), the MLP (three hidden × intermediate matrices for a gated MLP, two for a plain
  one; for a mixture of experts every expert, the shared experts and the router) and two norms;
  a final norm; and lm_head (vocab × hidden) unless ``tie_word_embeddings``. Biases are left out
  but for Qwen2's q/k/v and ``attention_bias``: they are a few parts in a million.
* **Weights** = parameters × bits per parameter of the precision. The quantised precisions vLLM
  serves (fp8, int8 W8A8, AWQ/GPTQ int4) quantise the linear layers only: the embeddings and
  lm_head stay at 16 bits, so they are counted at 16 bits. llama.cpp's GGUF types (what a CPU
  node runs) quantise those too. A GGUF's weights are its file's size.
* **KV cache** = 2 (K and V) × layers × kv_heads × head_dim × context × concurrency × bytes per
  element (fp16: 2; fp8: 1; llama.cpp's nearest to fp8 is q8_0, 34 bytes per 32). Latent
  attention (DeepSeek V2/V3) caches kv_lora_rank + qk_rope_head_dim per token and layer instead.
  Sliding-window layers are counted at the full context, which over-counts Gemma and old Mistral.
* **Headroom** per GPU: 10 % of the card, because vLLM plans with ``gpu_memory_utilization``
  0.9 by default and what is left is the CUDA context, cuBLAS and NCCL workspaces and the
  allocator's slack; plus 2 GiB for the activations of a prefill batch and the CUDA graphs,
  which vLLM's profiling run measures at about 1 to 2 GiB for 7–70B models. A CPU node keeps
  the same 10 % and 2 GiB for the system, page cache and llama.cpp's compute buffers.
* **GPUs per replica**, as a profile says it (``tp``, ``nodes``): vLLM's tensor parallel over 1,
  2, 4 or 8 GPUs of one node, then 16, 32… over whole nodes of 8 (powers of two, no more than
  the fleet's nodes of the class hold, dividing the attention heads); the smallest that leaves
  every GPU its headroom. Tensor parallel splits the weights and the KV heads (a GPU holds at
  least one KV head, so past kv_heads ranks the KV cache is copied); latent attention's cache is
  copied on every rank. llama.cpp runs a replica on one GPU (or a CPU node): a profile gives it
  no tensor parallelism (config/server.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from llmgw.errors import LlmgwError

GiB = 1 << 30
DEFAULT_CONTEXT = 8192  # when the model does not say its own
HEADROOM_FRACTION = 0.10  # of each GPU (vLLM's gpu_memory_utilization 0.9) or each CPU node's memory
HEADROOM_BYTES = 2 * GiB  # activations and CUDA graphs per GPU; compute buffers on a CPU node
TENSOR_PARALLEL = (1, 2, 4, 8)
MAX_NODES = 64  # the most nodes a profile may span (config/server.py: nodes ≤ 64)

VLLM, LLAMACPP = "vllm", "llamacpp"
KV_TYPES = ("fp16", "fp8")

# Bits per parameter of the KV cache's elements, by engine: llama.cpp has no fp8 cache; its q8_0
# (a 16-bit scale per 32 8-bit values) is what -ctk/-ctv offer instead.
_KV_BITS = {(VLLM, "fp16"): 16.0, (VLLM, "fp8"): 8.0, (LLAMACPP, "fp16"): 16.0, (LLAMACPP, "fp8"): 8.5}

# Model types whose MLP is two matrices (up, down) rather than the gated three (gate, up, down).
_PLAIN_MLP = frozenset(
    {
        "gpt2",
        "gpt_neo",
        "gpt_neox",
        "gptj",
        "gpt_bigcode",
        "codegen",
        "falcon",
        "phi",
        "opt",
        "bloom",
        "mpt",
        "starcoder2",
    }
)
# Qwen2's q, k and v projections carry biases though its config says nothing of them.
_QKV_BIAS = frozenset({"qwen2", "qwen2_moe", "qwen2_vl", "qwen2_5_vl"})


class SizingError(LlmgwError):
    """A config.json or GGUF header that does not say enough to size the model; the message says what is missing."""


@dataclass(frozen=True)
class Precision:
    """How a precision stores weights: bits per parameter in the blocks' linear layers, and in the
    embeddings and lm_head (kept at 16 bits by vLLM's quantised checkpoints)."""

    name: str  # bf16, fp8, int8, int4 (on GPUs); f16, q8_0, q4_k_m (llama.cpp); a GGUF's own type
    engine: str
    bits: float
    embedding_bits: float


# vLLM on GPUs. int4: 4-bit weights with a 16-bit scale and a 4-bit zero per group of 128
# (AWQ, GPTQ): 4 + 16/128 + 4/128 = 4.15625 bits.
GPU_PRECISIONS = (
    Precision("bf16", VLLM, 16.0, 16.0),
    Precision("fp8", VLLM, 8.0, 16.0),
    Precision("int8", VLLM, 8.0, 16.0),
    Precision("int4", VLLM, 4.15625, 16.0),
)
# llama.cpp on CPU nodes, as GGUF types: q8_0 is 34 bytes per 32 weights; q4_k_m mixes Q4_K
# (4.5 bits) with Q6_K for some tensors, about 4.9 bits on average (llama.cpp's quantize reports
# 4.89 for Llama-3-8B).
CPU_PRECISIONS = (
    Precision("f16", LLAMACPP, 16.0, 16.0),
    Precision("q8_0", LLAMACPP, 8.5, 8.5),
    Precision("q4_k_m", LLAMACPP, 4.9, 4.9),
)


@dataclass(frozen=True)
class Architecture:
    """What sizing needs of a model, read from its config.json or GGUF header."""

    name: str  # the architecture as the file names it: LlamaForCausalLM, or a GGUF's "llama"
    model_type: str | None
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    kv_per_token: int  # KV cache elements per token, all layers together
    kv_split: str  # how tensor parallel divides the KV cache: "heads", "copied" (latent) or "layers"
    parameters: int | None  # None: the header did not say enough to count them
    active_parameters: int | None = None  # a mixture of experts' per token; None for a dense model
    embedding_parameters: int = 0  # embeddings and lm_head (counted at 16 bits by vLLM's quantised formats)
    intermediate: int | None = None
    vocab: int | None = None
    experts: int = 0
    experts_per_token: int = 0
    shared_experts: int = 0
    tied: bool = False
    max_context: int | None = None
    checkpoint: str | None = None  # the checkpoint's own precision: bf16, fp8, int4 (awq)…, a GGUF's type
    file_bytes: int | None = None  # a GGUF: its size, which is the weights as they are
    notes: tuple[str, ...] = ()

    @property
    def gguf(self) -> bool:
        return self.file_bytes is not None


# ------------------------------------------------------------------ counting


def _int(cfg: Mapping[str, Any], *keys: str) -> int | None:
    """The first of ``keys`` that holds a whole number (not a bool)."""
    for k in keys:
        v = cfg.get(k)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


@dataclass(frozen=True)
class _Shape:
    """The figures parameter counting works from, whatever file they came from."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int | None
    tied: bool
    gated: bool = True
    qkv_bias: bool = False
    o_bias: bool = False
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0  # all shared experts together
    shared_gate: bool = False  # Qwen2-MoE's one-output gate on its shared expert
    dense_layers: int = 0  # leading layers with a dense MLP in a mixture of experts (DeepSeek's first_k_dense_replace)
    moe_every: int = 1  # every n-th layer (after the dense ones) is a mixture of experts
    # Latent attention (DeepSeek V2/V3): q_lora_rank (0: none), kv_lora_rank, the head widths.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope: int = 0
    qk_rope: int = 0
    v_head: int = 0


def _attention(s: _Shape) -> int:
    h = s.hidden
    if s.kv_lora_rank:
        qk = s.qk_nope + s.qk_rope
        # q: down, its norm and up with a q_lora_rank; one projection without.
        q = (h + 1 + s.heads * qk) * s.q_lora_rank if s.q_lora_rank else h * s.heads * qk
        kv = h * (s.kv_lora_rank + s.qk_rope) + s.kv_lora_rank + s.kv_lora_rank * s.heads * (s.qk_nope + s.v_head)
        return q + kv + s.heads * s.v_head * h
    q = o = h * s.heads * s.head_dim
    k = v = h * s.kv_heads * s.head_dim
    bias = (s.heads + 2 * s.kv_heads) * s.head_dim if s.qkv_bias else 0
    return q + k + v + o + bias + (h if s.o_bias else 0)


def _mlp(hidden: int, intermediate: int, gated: bool) -> int:
    return (3 if gated else 2) * hidden * intermediate


def _layer_is_moe(s: _Shape, i: int) -> bool:
    return s.experts > 0 and i >= s.dense_layers and (i - s.dense_layers) % max(s.moe_every, 1) == 0


def _count(s: _Shape) -> tuple[int | None, int | None, int]:
    """(parameters, active parameters for a mixture of experts or None, embedding parameters)."""
    embed = 0 if s.vocab is None else s.vocab * s.hidden * (1 if s.tied else 2)
    total = active = 0
    for i in range(s.layers):
        base = _attention(s) + 2 * s.hidden  # and its two norms
        if _layer_is_moe(s, i):
            one = _mlp(s.hidden, s.expert_intermediate, s.gated)
            shared = _mlp(s.hidden, s.shared_intermediate, s.gated) if s.shared_intermediate else 0
            fixed = base + shared + s.hidden * s.experts + (s.hidden if s.shared_gate else 0)
            total += fixed + s.experts * one
            active += fixed + max(s.experts_per_token, 1) * one
        else:
            dense = base + _mlp(s.hidden, s.intermediate, s.gated)
            total += dense
            active += dense
    total += s.hidden + embed  # the final norm, embeddings and lm_head
    active += s.hidden + embed
    if s.vocab is None:
        return None, None, 0
    return total, (active if s.experts else None), embed


# ------------------------------------------------------------------ config.json


def _checkpoint_of(cfg: Mapping[str, Any]) -> str | None:
    """The checkpoint's own precision: its quantization_config's method and bits, else torch_dtype."""
    q = cfg.get("quantization_config")
    if isinstance(q, dict):
        method = str(q.get("quant_method") or "quantised").lower()
        bits = _int(q, "bits", "w_bit", "num_bits")
        if method == "fp8" or "fp8" in str(q.get("fmt", "")).lower():
            return "fp8"
        if bits in (4, 8):
            return f"int{bits} ({method})"
        return method
    dtype = cfg.get("torch_dtype") or cfg.get("dtype")
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(str(dtype))


def from_config(config: Mapping[str, Any]) -> Architecture:
    """A model's architecture from its Hugging Face ``config.json``; SizingError when it lacks the basics."""
    if not isinstance(config, Mapping):
        raise SizingError("config.json is not a JSON object")
    notes: list[str] = []
    cfg: dict[str, Any] = dict(config)
    text = config.get("text_config")
    if isinstance(text, dict):
        # A model with a vision or audio tower: the language model is what takes the memory.
        cfg = {**cfg, **text}
        notes.append("the language model of text_config is counted; a vision or audio tower is not")
    archs = config.get("architectures")
    name = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    model_type = cfg.get("model_type") if isinstance(cfg.get("model_type"), str) else None

    hidden = _int(cfg, "hidden_size", "d_model", "n_embd", "dim")
    layers = _int(cfg, "num_hidden_layers", "n_layer", "num_layers", "n_layers")
    heads = _int(cfg, "num_attention_heads", "n_head", "n_heads", "num_heads")
    missing = [
        k for k, v in (("hidden_size", hidden), ("num_hidden_layers", layers), ("num_attention_heads", heads)) if not v
    ]
    if missing:
        raise SizingError(f"config.json does not say {', '.join(missing)}, so the model cannot be sized")
    assert hidden and layers and heads
    kv_heads = _int(cfg, "num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num")
    if not kv_heads:
        kv_heads = 1 if cfg.get("multi_query") else heads
    head_dim = _int(cfg, "head_dim") or hidden // heads
    vocab = _int(cfg, "vocab_size", "padded_vocab_size")
    if vocab is None:
        notes.append("config.json has no vocab_size: the embeddings are not counted")
    intermediate = _int(cfg, "intermediate_size", "ffn_hidden_size", "n_inner", "ffn_dim") or 4 * hidden
    if "tie_word_embeddings" in cfg:
        tied = bool(cfg["tie_word_embeddings"])
    else:
        tied = False
        notes.append("tie_word_embeddings is not stated: lm_head is counted on its own (the larger figure)")

    experts = _int(cfg, "num_local_experts", "n_routed_experts", "num_experts") or 0
    per_token = _int(cfg, "num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts") or 0
    expert_inter = _int(cfg, "moe_intermediate_size", "expert_intermediate_size") or intermediate
    shared = _int(cfg, "n_shared_experts", "num_shared_experts") or 0
    shared_inter = shared * expert_inter
    shared_gate = False
    if _int(cfg, "shared_expert_intermediate_size"):
        shared_inter = _int(cfg, "shared_expert_intermediate_size") or 0
        shared, shared_gate = max(shared, 1), True
    dense_layers = _int(cfg, "first_k_dense_replace") or 0
    moe_every = _int(cfg, "moe_layer_freq", "decoder_sparse_step", "interleave_moe_layer_step") or 1

    kv_lora = _int(cfg, "kv_lora_rank") or 0
    shape = _Shape(
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate=intermediate,
        vocab=vocab,
        tied=tied,
        gated=model_type not in _PLAIN_MLP,
        qkv_bias=bool(cfg.get("attention_bias")) or model_type in _QKV_BIAS,
        o_bias=bool(cfg.get("attention_bias")),
        experts=experts,
        experts_per_token=per_token,
        expert_intermediate=expert_inter,
        shared_intermediate=shared_inter,
        shared_gate=shared_gate,
        dense_layers=dense_layers if experts else 0,
        moe_every=moe_every,
        kv_lora_rank=kv_lora,
        q_lora_rank=_int(cfg, "q_lora_rank") or 0,
        qk_nope=_int(cfg, "qk_nope_head_dim") or 0,
        qk_rope=_int(cfg, "qk_rope_head_dim") or 0,
        v_head=_int(cfg, "v_head_dim") or head_dim,
    )
    params, active, embed = _count(shape)
    if kv_lora:
        kv_per_token, split = layers * (kv_lora + shape.qk_rope), "copied"
    else:
        kv_per_token, split = 2 * layers * kv_heads * head_dim, "heads"
    if cfg.get("sliding_window") and cfg.get("use_sliding_window", True):
        notes.append("sliding-window layers are counted at the full context (the KV figure is the larger one)")
    return Architecture(
        name=name or model_type or "unknown",
        model_type=model_type,
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        kv_per_token=kv_per_token,
        kv_split=split,
        parameters=params,
        active_parameters=active,
        embedding_parameters=embed,
        intermediate=intermediate,
        vocab=vocab,
        experts=experts,
        experts_per_token=per_token,
        shared_experts=shared,
        tied=tied,
        max_context=_int(cfg, "max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"),
        checkpoint=_checkpoint_of(cfg),
        notes=tuple(notes),
    )


# ------------------------------------------------------------------ GGUF


def gguf_type_name(file_type: object) -> str | None:
    """A GGUF's ``general.file_type`` as llama.cpp names it, lower case: 15 → q4_k_m."""
    if not isinstance(file_type, int) or isinstance(file_type, bool):
        return None
    from gguf import LlamaFileType  # the gguf package's own table, so new types are named

    try:
        name = LlamaFileType(file_type).name
    except ValueError:
        return f"type {file_type}"
    return name.lower().removeprefix("mostly_").replace("all_", "")


def from_gguf(metadata: Mapping[str, Any], file_bytes: int) -> Architecture:
    """A model's architecture from its GGUF header's metadata (``llmgw.gguf.parse_header``);
    ``file_bytes`` is the file's size (all its shards), which is the weights."""
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise SizingError("the GGUF header names no general.architecture")
    p = arch + "."
    notes: list[str] = []
    layers = _int(metadata, p + "block_count")
    hidden = _int(metadata, p + "embedding_length")
    heads = _int(metadata, p + "attention.head_count")
    missing = [
        p + k
        for k, v in (("block_count", layers), ("embedding_length", hidden), ("attention.head_count", heads))
        if not v
    ]
    if missing:
        raise SizingError(
            f"the GGUF header does not say {', '.join(missing)} (as a single number), so its KV cache cannot be sized"
        )
    assert layers and hidden and heads
    kv_heads = _int(metadata, p + "attention.head_count_kv")
    if not kv_heads:
        if p + "attention.head_count_kv" in metadata:
            notes.append("the KV heads are given per layer; the KV cache is counted with every head")
        kv_heads = heads
    key_len = _int(metadata, p + "attention.key_length")
    value_len = _int(metadata, p + "attention.value_length")
    head_dim = key_len or hidden // heads
    kv_lora = _int(metadata, p + "attention.kv_lora_rank")
    rope = _int(metadata, p + "rope.dimension_count") or 0
    # With latent attention llama.cpp caches the latent, as vLLM does; else K and V of every KV head.
    kv_per_token = layers * (kv_lora + rope) if kv_lora else layers * kv_heads * (head_dim + (value_len or head_dim))
    tokens = metadata.get("tokenizer.ggml.tokens")
    vocab = _int(metadata, p + "vocab_size") or (len(tokens) if isinstance(tokens, list) else None)
    ff = _int(metadata, p + "feed_forward_length")
    experts = _int(metadata, p + "expert_count") or 0
    expert_ff = _int(metadata, p + "expert_feed_forward_length") or ff or 0
    shared = _int(metadata, p + "expert_shared_count") or 0
    shared_ff = _int(metadata, p + "expert_shared_feed_forward_length") or shared * expert_ff
    params = active = None
    embed = 0
    if ff or experts:
        shape = _Shape(
            hidden=hidden,
            layers=layers,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate=ff or expert_ff,
            vocab=vocab,
            tied=False,  # the header does not say; counted untied, the larger figure
            experts=experts,
            experts_per_token=_int(metadata, p + "expert_used_count") or 0,
            expert_intermediate=expert_ff,
            shared_intermediate=shared_ff,
            dense_layers=_int(metadata, p + "leading_dense_block_count") or 0,
        )
        if not kv_lora:
            params, active, embed = _count(shape)
    if params is None:
        notes.append("the parameters are not counted from this header; the file's size stands for the weights")
    return Architecture(
        name=arch,
        model_type=arch,
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        kv_per_token=kv_per_token,
        kv_split="layers",
        parameters=params,
        active_parameters=active,
        embedding_parameters=embed,
        intermediate=ff,
        vocab=vocab,
        experts=experts,
        experts_per_token=_int(metadata, p + "expert_used_count") or 0,
        shared_experts=shared,
        max_context=_int(metadata, p + "context_length"),
        checkpoint=gguf_type_name(metadata.get("general.file_type")),
        file_bytes=file_bytes,
        notes=tuple(notes),
    )


# ------------------------------------------------------------------ the fleet


@dataclass(frozen=True)
class Machine:
    """One node as sizing sees it: its GPUs (class and memory of each) and its main memory."""

    node_id: str
    gpus: tuple[tuple[str, int | None], ...] = ()  # (gpu_class, memory in bytes or None)
    memory_bytes: int | None = None


@dataclass(frozen=True)
class Pool:
    """A GPU class across the fleet (or CPU nodes of one memory size): what one replica may use."""

    name: str  # h100-80g, or cpu-64g
    gpu: bool
    memory_bytes: int  # per GPU; per node for CPU nodes (the smallest of the class's)
    per_node: int  # the most of its GPUs on one node (1 for CPU)
    nodes: int  # nodes that have it


def pools(machines: Iterable[Machine]) -> tuple[list[Pool], list[str]]:
    """The fleet's GPU classes and CPU node sizes, and what could not be counted (in words)."""
    memory: dict[str, int] = {}
    per_node: dict[str, int] = {}
    nodes: dict[str, int] = {}
    cpu: dict[str, list[int]] = {}
    unsized: list[str] = []
    for m in machines:
        if m.gpus:
            here: dict[str, int] = {}
            for cls, mem in m.gpus:
                if mem is None:
                    unsized.append(f"{m.node_id}: a {cls} GPU does not report its memory, so it is left out")
                    continue
                here[cls] = here.get(cls, 0) + 1
                memory[cls] = min(memory.get(cls, mem), mem)
            for cls, n in here.items():
                per_node[cls] = max(per_node.get(cls, 0), n)
                nodes[cls] = nodes.get(cls, 0) + 1
        elif m.memory_bytes:
            cpu.setdefault(f"cpu-{round(m.memory_bytes / GiB)}g", []).append(m.memory_bytes)
        else:
            unsized.append(f"{m.node_id}: no GPUs and no memory figure, so it is left out")
    out = [Pool(c, True, memory[c], per_node[c], nodes[c]) for c in sorted(memory)]
    out += [Pool(c, False, min(v), 1, len(v)) for c, v in sorted(cpu.items(), key=lambda kv: min(kv[1]))]
    return out, unsized


# ------------------------------------------------------------------ fitting


def headroom(memory_bytes: int) -> int:
    """What a GPU (or CPU node) keeps back from the model: 10 % of it and 2 GiB."""
    return math.ceil(memory_bytes * HEADROOM_FRACTION) + HEADROOM_BYTES


def kv_bytes(arch: Architecture, context: int, concurrency: int, kv_type: str, engine: str) -> int:
    """2 × layers × kv_heads × head_dim (or the latent's width) × context × concurrency × bytes per element."""
    return math.ceil(arch.kv_per_token * context * concurrency * _KV_BITS[(engine, kv_type)] / 8)


def weights_bytes(arch: Architecture, precision: Precision) -> int:
    """The file's size for a GGUF; else the parameters at the precision's bits (embeddings at theirs)."""
    if arch.file_bytes is not None:
        return arch.file_bytes
    if arch.parameters is None:
        raise SizingError("the parameters could not be counted, so the weights cannot be sized")
    body = arch.parameters - arch.embedding_parameters
    return math.ceil((body * precision.bits + arch.embedding_parameters * precision.embedding_bits) / 8)


@dataclass(frozen=True)
class Fit:
    """One precision on one pool: the figures, and whether and how a replica fits."""

    precision: str
    engine: str
    pool: str  # the GPU class or CPU node size; "-" for the figures alone
    gpu: bool
    memory_bytes: int  # per GPU, or the node's
    weights_bytes: int
    kv_cache_bytes: int  # as the replica holds it: a copy on each rank where tensor parallel cannot split it
    fits: bool | None  # None: figures alone, no pool to fit
    tp: int = 0  # the replica's GPUs, its profile's tp (0 on a CPU node, or where no layout would do)
    nodes: int = 1  # nodes it spans, its profile's nodes (tp / nodes GPUs on each)
    headroom_bytes: int = 0  # all the replica's GPUs (or its node) together
    total_bytes: int = 0  # weights + KV cache + headroom
    free_bytes: int | None = None  # the replica's memory less the total; None where it does not fit
    reason: str | None = None  # why it does not fit, in words
    checkpoint: bool = False  # the precision the checkpoint itself is in


def _kv_share(arch: Architecture, kv: int, tp: int) -> float:
    """The part of the KV cache one tensor-parallel rank holds."""
    if arch.kv_split == "heads":
        return kv * math.ceil(arch.kv_heads / tp) / arch.kv_heads  # at least one KV head a rank
    if arch.kv_split == "copied":
        return float(kv)  # latent attention: every rank holds all of it
    return kv / tp


def _per_gpu(arch: Architecture, weights: int, kv: int, tp: int, memory: int) -> int:
    """What each GPU of a replica over ``tp`` GPUs needs, headroom included."""
    return math.ceil(weights / tp + _kv_share(arch, kv, tp)) + headroom(memory)


def _layouts(arch: Architecture, engine: str, per_node: int, nodes: int) -> list[tuple[int, int]]:
    """(tp, nodes) a replica may take, fewest GPUs first: llama.cpp one GPU; vLLM powers of two up
    to one node's cards, then whole nodes of that many, dividing the attention heads."""
    if engine != VLLM:
        return [(1, 1)]
    width = max((t for t in TENSOR_PARALLEL if t <= per_node), default=1)
    out = []
    tp = 1
    while tp <= width * nodes:
        if arch.heads % tp == 0:
            out.append((tp, max(1, tp // width)))
        tp *= 2
    return out or [(1, 1)]


def _layout(
    arch: Architecture, weights: int, kv: int, engine: str, memory: int, per_node: int, nodes: int
) -> tuple[int, int] | None:
    """The smallest (tp, nodes) that fits ``per_node`` GPUs on each of ``nodes`` nodes, else None."""
    for tp, n in _layouts(arch, engine, per_node, nodes):
        if _per_gpu(arch, weights, kv, tp, memory) <= memory:
            return tp, n
    return None


def _is_checkpoint(arch: Architecture, precision: Precision) -> bool:
    if arch.gguf or arch.checkpoint is None:
        return arch.gguf
    own = arch.checkpoint.split(" ")[0]
    return precision.engine == VLLM and (own == precision.name or (own == "fp16" and precision.name == "bf16"))


def _replica_words(tp: int, nodes: int) -> str:
    if nodes > 1:
        return f"{tp} GPUs ({tp // nodes} on each of {nodes} nodes)"
    return f"{tp} GPU{'s' if tp != 1 else ''}"


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def fit(arch: Architecture, precision: Precision, pool: Pool, context: int, concurrency: int, kv_type: str) -> Fit:
    """Whether one replica at ``precision`` fits ``pool``, on how many GPUs, and what is left."""
    engine = LLAMACPP if arch.gguf else precision.engine
    weights = weights_bytes(arch, precision)
    kv = kv_bytes(arch, context, concurrency, kv_type, engine)
    if not pool.gpu:
        spare = headroom(pool.memory_bytes)
        total = weights + kv + spare
        ok = total <= pool.memory_bytes
        tp, n, held = 0, 1, kv
        reason = None if ok else f"a {pool.name} node is {_gb(total - pool.memory_bytes)} short"
    else:
        got = _layout(arch, weights, kv, engine, pool.memory_bytes, pool.per_node, pool.nodes)
        ok, reason = got is not None, None
        if got is None:
            # What it would take with whole nodes of this class, to say how far the fleet is from it.
            want = _layout(arch, weights, kv, engine, pool.memory_bytes, max(TENSOR_PARALLEL), MAX_NODES)
            has = f"{pool.nodes} node{'s' if pool.nodes != 1 else ''} with at most {pool.per_node} of them"
            if want is None and engine != VLLM:
                short = _per_gpu(arch, weights, kv, 1, pool.memory_bytes) - pool.memory_bytes
                reason = f"llama.cpp runs a replica on one GPU, and one {pool.name} is {_gb(short)} short"
                got = (1, 1)
            elif want is None:
                most = max(t for t, _ in _layouts(arch, engine, max(TENSOR_PARALLEL), MAX_NODES))
                reason = f"does not fit even {most} {pool.name} GPUs"
                got = (0, 1)
            else:
                reason = f"needs {_replica_words(*want)}; the fleet has {has}"
                got = want
        tp, n = got
        spare = headroom(pool.memory_bytes) * tp
        held = math.ceil(_kv_share(arch, kv, tp) * tp) if tp else kv
        total = weights + held + spare
    return Fit(
        precision=precision.name,
        engine=engine,
        pool=pool.name,
        gpu=pool.gpu,
        memory_bytes=pool.memory_bytes,
        weights_bytes=weights,
        kv_cache_bytes=held,
        fits=ok,
        tp=tp,
        nodes=n,
        headroom_bytes=spare,
        total_bytes=total,
        free_bytes=(pool.memory_bytes * max(tp, 1) - total) if ok else None,
        reason=reason,
        checkpoint=_is_checkpoint(arch, precision),
    )


def precisions_for(arch: Architecture, gpu: bool) -> Sequence[Precision]:
    """The precisions worth a row: a GGUF's own; else vLLM's on GPUs, llama.cpp's on CPU nodes."""
    if arch.gguf:
        name = arch.checkpoint or "gguf"
        return (Precision(name, LLAMACPP, 0.0, 0.0),)  # its weights are its file
    return GPU_PRECISIONS if gpu else CPU_PRECISIONS


@dataclass(frozen=True)
class Plan:
    arch: Architecture
    context: int
    concurrency: int
    kv_type: str
    fits: list[Fit] = field(default_factory=list)  # every precision on every pool of the fleet
    figures: list[Fit] = field(default_factory=list)  # every precision's weights and KV cache, fleet or not
    notes: list[str] = field(default_factory=list)


def plan(
    arch: Architecture,
    machines: Iterable[Machine],
    *,
    context: int | None = None,
    concurrency: int = 1,
    kv_type: str = "fp16",
) -> Plan:
    """Every precision against every pool of the fleet, for ``context`` tokens (default the model's
    own maximum, else 8192) for each of ``concurrency`` sequences at once."""
    if kv_type not in KV_TYPES:
        raise SizingError(f"the KV cache is fp16 or fp8, not {kv_type!r}")
    if concurrency < 1:
        raise SizingError("the concurrency is at least 1")
    if context is not None and context < 1:
        raise SizingError("the context is at least 1 token")
    ctx = context or arch.max_context or DEFAULT_CONTEXT
    found, notes = pools(machines)
    if arch.max_context and ctx > arch.max_context:
        notes.append(f"the context asked, {ctx} tokens, is more than the model's own maximum of {arch.max_context}")
    out = Plan(arch, ctx, concurrency, kv_type, notes=notes)
    for pool in found:
        out.fits.extend(fit(arch, p, pool, ctx, concurrency, kv_type) for p in precisions_for(arch, pool.gpu))
    seen: set[tuple[str, str]] = set()
    for gpu in (True, False):
        for p in precisions_for(arch, gpu):
            engine = LLAMACPP if arch.gguf else p.engine
            if (p.name, engine) in seen:
                continue
            seen.add((p.name, engine))
            out.figures.append(
                Fit(
                    precision=p.name,
                    engine=engine,
                    pool="-",
                    gpu=gpu,
                    memory_bytes=0,
                    weights_bytes=weights_bytes(arch, p),
                    kv_cache_bytes=kv_bytes(arch, ctx, concurrency, kv_type, engine),
                    fits=None,
                    checkpoint=_is_checkpoint(arch, p),
                )
            )
    return out
