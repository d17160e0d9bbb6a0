"""`llmgw ctl plan MODEL`: does a model fit the fleet, at which precision, on how many GPUs.

The control plane reads the model's architecture (the mirror's copy of its config.json or GGUF
header, or Hugging Face through mirror.registry) and its fleet's inventory; the figures come from
``GET /api/v1/plan`` (llmgw/server/admin/plan.py, arithmetic in llmgw/server/control/sizing.py).
"""

from __future__ import annotations

import json
from urllib.parse import urlencode

import typer

from llmgw.cli.admin_client import JsonOpt, ServerOpt, TokenFileOpt, connect
from llmgw.cli.ctl import _print_rows, _size, call
from llmgw.protocol.admin import PlanArchitecture, PlanReply, PlanRow

# Annotated: llmgw.cli.ctl imports this module at its end, a cycle mypy cannot infer through.
app: typer.Typer = typer.Typer()

# Reading Hugging Face through the control plane may take its registry's time.
PLAN_TIMEOUT_S = 90.0


def count_words(n: int | None) -> str:
    """8030261248 → "8.03 billion"; 494032768 → "494 million"."""
    if n is None:
        return "an uncounted number of"
    if n >= 1e9:
        return f"{n / 1e9:.3g} billion"
    if n >= 1e6:
        return f"{n / 1e6:.3g} million"
    return f"{n:,}"


def describe(a: PlanArchitecture) -> list[str]:
    """The lines naming what was read: the architecture, its parameters, and where from."""
    kind = a.name if not a.model_type or a.model_type == a.name else f"{a.name} ({a.model_type})"
    params = f"{count_words(a.parameters)} parameters"
    if a.parameters is not None and a.parameters >= 1e6:
        params += f" ({a.parameters:,})"
    if a.active_parameters is not None:
        params += f", {count_words(a.active_parameters)} active per token"
    lines = [f"{kind}, {params}, read from {a.read_from}"]
    shape = [f"{a.layers} layers", f"hidden {a.hidden_size}"]
    if a.latent_attention:
        shape.append(f"{a.attention_heads} heads with latent attention")
    else:
        shape.append(f"{a.attention_heads} heads ({a.kv_heads} KV heads of {a.head_dim})")
    if a.experts:
        shared = f" + {a.shared_experts} shared" if a.shared_experts else ""
        shape.append(f"{a.experts} experts{shared}, {a.experts_per_token or '?'} per token")
    if a.vocab_size:
        shape.append(f"vocab {a.vocab_size}")
    if a.tied_embeddings:
        shape.append("tied embeddings")
    if a.max_context:
        shape.append(f"up to {a.max_context} tokens")
    if a.checkpoint:
        shape.append(f"checkpoint {a.checkpoint}")
    lines.append(", ".join(shape))
    return lines


def _gpus(r: PlanRow) -> str:
    if not r.gpu:
        return "CPU" if r.gpus_per_replica is not None else "-"
    if r.gpus_per_replica is None:
        return "-"
    if r.nodes and r.nodes > 1:
        return f"{r.gpus_per_replica} on {r.nodes} nodes"
    return str(r.gpus_per_replica)


def _fits(r: PlanRow) -> str:
    return "-" if r.fits is None else "yes" if r.fits else "no"


def _precision(r: PlanRow) -> str:
    return r.precision + (" *" if r.checkpoint else "")


def render(p: PlanReply) -> None:
    for line in describe(p.architecture):
        typer.echo(line)
    seqs = f"{p.concurrency} sequence{'s' if p.concurrency != 1 else ''}"
    typer.echo(f"context {p.context} tokens × {seqs}, KV cache {p.kv_cache}")
    typer.echo("")
    if p.rows:
        rows = []
        for r in p.rows:
            free = _size(r.free_bytes) if r.free_bytes is not None else "-"
            cells = [
                _precision(r),
                r.pool,
                _fits(r),
                _gpus(r),
                _size(r.weights_bytes),
                _size(r.kv_cache_bytes),
                _size(r.total_bytes),
                free,
            ]
            rows.append((cells, [f"  {r.precision} on {r.pool}: {r.reason}"] if r.reason else []))
        _print_rows(
            ["PRECISION", "CLASS", "FITS", "GPUS PER REPLICA", "WEIGHTS", "KV CACHE", "TOTAL", "FREE LEFT"], rows
        )
    else:
        rows = [([_precision(r), r.engine, _size(r.weights_bytes), _size(r.kv_cache_bytes)], []) for r in p.figures]
        _print_rows(["PRECISION", "ENGINE", "WEIGHTS", "KV CACHE"], rows)
    typer.echo("")
    if any(r.checkpoint for r in [*p.rows, *p.figures]):
        typer.echo("* the precision of the checkpoint as it is")
    typer.echo(p.headroom)
    for note in [*p.architecture.notes, *p.notes]:
        typer.echo(f"note: {note}")


@app.command("plan")
def plan(
    model: str = typer.Argument(
        ..., help="A catalog model, a mirror version (M/V or M/V/FILE), or a Hugging Face name (hf:ORG/NAME)."
    ),
    context: int | None = typer.Option(
        None, "--context", min=1, help="Tokens per sequence; default the model's maximum, else 8192."
    ),
    concurrency: int = typer.Option(1, "--concurrency", min=1, help="Sequences held in the KV cache at once."),
    kv_cache: str = typer.Option("fp16", "--kv-cache", help="The KV cache's element type: fp16 or fp8."),
    server: ServerOpt = None,
    token_file: TokenFileOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Whether a model fits each GPU class in the fleet (or a CPU node) at bf16, fp8, int8 and int4
    (a GGUF: its own type), with the KV cache for --context × --concurrency, and on how many GPUs."""
    query: dict[str, str | int] = {"model": model, "concurrency": concurrency, "kv_cache": kv_cache}
    if context is not None:
        query["context"] = context
    reply = call(
        "GET", connect(server, token_file), f"/api/v1/plan?{urlencode(query)}", PlanReply, timeout=PLAN_TIMEOUT_S
    )
    if as_json:
        typer.echo(json.dumps(reply.model_dump(mode="json"), indent=2))
        return
    render(reply)
