"""`llmgw ctl bench` and `llmgw ctl capacity`: measure what a replica of a model serves at a
latency target, keep it for admission and routing, and read it back.

The load itself is llmgw/bench.py; this module parses, shows progress, prints and saves.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from llmgw.admin_api import AdminAPIError, error_message, request
from llmgw.bench import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_REQUESTS_PER_STEP,
    DEFAULT_STEPS,
    DEFAULT_TIMEOUT,
    DEFAULT_TPOT_P99,
    DEFAULT_TTFT_P99,
    SLO,
    BenchConfig,
    BenchError,
    BenchResult,
    Level,
    LoadNames,
    LoadReader,
    latency_words,
    normalize_target,
    parse_steps,
    run_bench,
)
from llmgw.cli.admin_client import Admin, ServerOpt, TokenFileOpt, connect
from llmgw.cli.common import err, fail
from llmgw.cli.ctl import _duration, _print_rows, call
from llmgw.protocol.admin import Capacity, CapacityReply, CapacitySLO, CapacityView, ReplicasReply
from llmgw.protocol.prometheus import parse_prometheus

# Annotated: llmgw.cli.ctl imports this module at its end, a cycle mypy cannot infer through.
# Added to `ctl` without a name, so these are `ctl bench` and `ctl capacity`.
app: typer.Typer = typer.Typer()

NOTHING_MEASURED = "Nothing has been measured. Run `llmgw ctl bench <model> --target <replica> --save`."
LEVEL_HEADER = (
    f"{'CONCURRENT':>10}  {'REQUESTS':>8}  {'TTFT p99':>9}  {'TPOT p99':>9}  {'TOK/S':>7}  WAIT  KV    RESULT"
)


def _seconds(flag: str, text: str) -> float:
    """Seconds from 2, 0.5, 500ms or 2s."""
    from llmgw.config.types import parse_duration

    try:
        value = float(text)
        if value > 0:
            return value
    except ValueError:
        try:
            return parse_duration(text)
        except ValueError:
            pass
    fail(f"{flag} should be a time longer than 0, in seconds (2, 0.5) or as 500ms, 2s; not {text!r}")


def _engines() -> dict[str, LoadNames]:
    """The engines' queue and KV-cache series, as the gateway reads them."""
    from llmgw.server.gateway.endpoints import ENGINE_METRICS

    return {e: LoadNames(n.waiting, n.kv_usage) for e, n in ENGINE_METRICS.items() if n is not None}


def _level_row(lv: Level) -> str:
    wait = "-" if lv.waiting_max is None else f"{lv.waiting_max:.0f}"
    kv = "-" if lv.kv_max is None else f"{lv.kv_max * 100:.0f}%"
    verdict = "held" if lv.held else f"broke: {lv.why}"
    return (
        f"{lv.concurrency:>10}  {lv.requests:>8}  {latency_words(lv.ttft_p99):>9}  {latency_words(lv.tpot_p99):>9}  "
        f"{lv.tokens_per_s:>7.0f}  {wait:>4}  {kv:<4}  {verdict}"
    )


class _Display:
    """Each level's line on stdout as it ends; while one runs, a progress bar on stderr (a terminal only)."""

    def __init__(self, rows: bool) -> None:
        self.rows = rows
        self.live = sys.stderr.isatty()
        self._bar: Progress | None = None
        self._task: TaskID | None = None

    def level_started(self, concurrency: int, requests: int) -> None:
        if not self.live:
            return
        self._bar = Progress(
            TextColumn("concurrency {task.fields[c]}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("requests"),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            transient=True,
            redirect_stdout=False,
            redirect_stderr=False,
        )
        self._bar.start()
        self._task = self._bar.add_task("level", total=requests, c=concurrency)

    def request_done(self, concurrency: int, done: int, requests: int) -> None:
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, completed=done)

    def level_done(self, level: Level) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        if self.rows:
            typer.echo(_level_row(level))


def _conclusion(res: BenchResult) -> list[str]:
    slo = f"TTFT p99 {latency_words(res.slo.ttft_p99)}, TPOT p99 {latency_words(res.slo.tpot_p99)}"
    held, broke = res.held, res.broke
    out = [""]
    if held is None:
        out.append(f"no level held at the SLO ({slo}): not even one request at a time met it")
    else:
        out.append(
            f"last level that held: {held.concurrency} concurrent, {held.tokens_per_s:.0f} tok/s, "
            f"TTFT p99 {latency_words(held.ttft_p99)}, TPOT p99 {latency_words(held.tpot_p99)} (SLO: {slo})"
        )
    if broke is not None:
        out.append(f"broke at {broke.concurrency} concurrent: {broke.why}")
    elif res.levels:
        out.append(f"every level held, up to {res.levels[-1].concurrency}: add higher --steps to find where it breaks")
    if res.weight is None:
        out.append("weight: none (nothing held at the SLO, so a replica of this profile cannot carry it)")
    else:
        out.append(f"weight: {res.weight}  (for the profile: its share of the model's traffic, in requests at the SLO)")
    return out


def _try(method: str, admin: Admin, path: str, body: dict | None = None) -> dict:
    """One admin call that raises AdminAPIError instead of exiting: saving is not fatal."""
    attempts: list[tuple[str, str] | None] = list(admin.tokens) or [None]
    r = None
    for cred in attempts:
        r = request(method, admin.url + path, cred[0] if cred else None, body, verify=admin.verify, timeout=60)
        if r.status_code != 401:
            break
    assert r is not None
    if not 200 <= r.status_code < 300:
        raise AdminAPIError(f"{admin.url}{path} answered {r.status_code}: {error_message(r)}", r.status_code)
    return r.json() if r.content else {}


def same_endpoint(a: str, b: str) -> bool:
    """Two base URLs, a trailing slash not counting: one is what the control plane recorded, the
    other what somebody typed or pasted."""
    return a.rstrip("/") == b.rstrip("/")


def _save(res: BenchResult, model: str, target: str, admin: Admin) -> None:
    """File the conclusion under the profile of the replica at ``target`` (looked up, not asked:
    the control plane knows which profile answers there, and a number filed under the wrong one
    is worse than none). Every failure is said on stderr; none ends the command."""
    from urllib.parse import quote, urlencode

    try:
        try:
            got = ReplicasReply.model_validate(_try("GET", admin, "/api/v1/replicas?" + urlencode({"model": model})))
        except ValueError as exc:
            raise AdminAPIError(
                f"{admin.url}/api/v1/replicas answered in a shape this llmgw does not read ({exc})"
            ) from None
        replica = next((r for r in got.replicas if r.endpoint and same_endpoint(r.endpoint, res.target)), None)
        if replica is None or not replica.profile:
            raise AdminAPIError(
                f"{target} is not a replica of {model}, so this run measures the path rather than the hardware; "
                "point --target at a replica endpoint from `llmgw ctl replicas`"
            )
        held = res.held
        body = Capacity(
            model=replica.model,
            profile=replica.profile,
            max_concurrency_at_slo=res.concurrency,
            throughput_tok_per_sec=round(held.tokens_per_s, 2) if held else 0.0,
            ttft_p99=held.ttft_p99 if held else None,
            tpot_p99=held.tpot_p99 if held else None,
            suggested_target_waiting=res.suggested_waiting,
            suggested_kv_ceiling=res.suggested_kv,
            slo=CapacitySLO(ttft_p99=res.slo.ttft_p99, tpot_p99=res.slo.tpot_p99),
            target=res.target,
            measured_at=res.ran_at,
        )
        path = f"/api/v1/models/{quote(replica.model, safe='')}/capacity"
        answer = _try("PUT", admin, path, body.model_dump(mode="json", exclude_none=True))
        try:
            saved = CapacityView.model_validate(answer)
        except ValueError as exc:
            raise AdminAPIError(f"{admin.url}{path} answered in a shape this llmgw does not read ({exc})") from None
    except AdminAPIError as exc:
        err.print(f"the measurement was not saved: {exc}", markup=False)
        return
    err.print(
        f"saved: {saved.model} on profile {saved.profile}, {saved.max_concurrency_at_slo} concurrent at the SLO",
        markup=False,
    )


@contextmanager
def _interrupts() -> Iterator[None]:
    try:
        yield
    except KeyboardInterrupt:
        fail("interrupted; nothing was saved", code=130)


@app.command("bench")
def bench(
    model: str = typer.Argument(..., help="The model, by the name the endpoint serves it under (its catalog name)."),
    target: str = typer.Option(
        ...,
        "--target",
        help="Where the load goes: a replica's endpoint (ENDPOINT in `llmgw ctl replicas`) to measure the "
        "hardware, or the gateway's URL to measure the whole path (which --save does not keep).",
    ),
    ttft_p99: str = typer.Option(
        f"{DEFAULT_TTFT_P99:g}s",
        "--ttft-p99",
        help="The target for the 99th percentile of time to first token: seconds, or 500ms, 2s.",
        show_default=True,
    ),
    tpot_p99: str = typer.Option(
        f"{DEFAULT_TPOT_P99 * 1000:g}ms",
        "--tpot-p99",
        help="The target for the 99th percentile of time per output token after the first.",
        show_default=True,
    ),
    steps: str = typer.Option(
        ",".join(map(str, DEFAULT_STEPS)), "--steps", help="Concurrency levels to ramp through, rising."
    ),
    requests_per_step: int = typer.Option(
        DEFAULT_REQUESTS_PER_STEP,
        "--requests-per-step",
        min=1,
        help="Requests at each level (at least two per client).",
    ),
    max_tokens: int = typer.Option(DEFAULT_MAX_TOKENS, "--max-tokens", min=2, help="max_tokens of each request."),
    same_prompt: bool = typer.Option(
        False,
        "--same-prompt",
        help="Send every request the same prompt, measuring the cached case instead of the hardware.",
    ),
    key: str | None = typer.Option(
        None,
        "--key",
        envvar="LLMGW_BENCH_KEY",
        show_envvar=False,
        help="Sent as 'Authorization: Bearer KEY': a replica's engine key (on its node, api_key in the agent's "
        "<work_dir>/shards/<shard>.json, readable by root), or an API key when --target is the gateway. "
        "LLMGW_BENCH_KEY keeps it off the command line.",
    ),
    metrics_url: str | None = typer.Option(
        None, "--metrics-url", help="Where the engine publishes its queue and KV-cache use; default TARGET/metrics."
    ),
    engine: str | None = typer.Option(
        None, "--engine", help="Whose metric names to read there: llamacpp, vllm or sglang; default: found from them."
    ),
    timeout: float = typer.Option(DEFAULT_TIMEOUT, "--timeout", min=1, help="Seconds one request may take."),
    save: bool = typer.Option(
        False,
        "--save",
        help="Keep the result as the capacity of MODEL on the profile of the replica at --target, looked up "
        "from the control plane's replicas; admission and routing then use it. Re-measuring replaces it.",
    ),
    server: ServerOpt = None,
    token_file: TokenFileOpt = None,
    as_json: bool = typer.Option(False, "--json", help="Print every level and the conclusion as JSON."),
) -> None:
    """Ramp concurrency against an OpenAI-compatible endpoint until the latency target breaks.

    Prints each level (p99 of time to first token and per output token, tokens per second, the
    engine's queue and KV-cache use when it publishes them), the last level that held, and the
    `weight` to put in the profile. It drives real traffic: run it before users do, or expect
    theirs to slow down. Defaults: TTFT p99 2s, TPOT p99 100ms."""
    try:
        cfg = BenchConfig(
            model=model,
            target=normalize_target(target),
            slo=SLO(_seconds("--ttft-p99", ttft_p99), _seconds("--tpot-p99", tpot_p99)),
            steps=parse_steps(steps),
            requests_per_step=requests_per_step,
            max_tokens=max_tokens,
            same_prompt=same_prompt,
            key=key or None,
            timeout=timeout,
        )
        load = LoadReader(
            metrics_url or cfg.target + "/metrics", _engines(), parse_prometheus, engine=engine, key=cfg.key
        )
    except BenchError as exc:
        fail(str(exc))
    admin = connect(server, token_file) if save else None  # a bad --token-file is said before the run
    if not as_json:
        typer.echo(f"{cfg.model} at {cfg.target}: ramping {', '.join(map(str, cfg.steps))} until the SLO breaks")
        typer.echo(LEVEL_HEADER)
    with _interrupts():
        try:
            res = asyncio.run(run_bench(cfg, observer=_Display(rows=not as_json), load=load))
        except BenchError as exc:
            fail(str(exc))
    if as_json:
        typer.echo(json.dumps(res.to_json(), indent=2))
    else:
        for line in _conclusion(res):
            typer.echo(line)
    if admin is not None:
        _save(res, model, target, admin)


@app.command("capacity")
def capacity(
    server: ServerOpt = None,
    token_file: TokenFileOpt = None,
    as_json: bool = typer.Option(False, "--json", help="Print the measurements as JSON."),
) -> None:
    """What a replica of each model was measured to serve at its latency target (`llmgw ctl bench --save`).

    One row per model and profile: the same model on a CPU and on a GPU are two numbers. The age
    is there to be read: hardware and engine builds change, so a measurement is an observation
    with a date on it."""
    data = call("GET", connect(server, token_file), "/api/v1/capacity", CapacityReply).capacity
    if as_json:
        typer.echo(json.dumps([c.model_dump(mode="json") for c in data], indent=2))
        return
    if not data:
        typer.echo(NOTHING_MEASURED)
        return
    now = time.time()
    rows: list[tuple[list[str], list[str]]] = [
        (
            [
                c.model,
                c.profile,
                str(c.max_concurrency_at_slo) if c.max_concurrency_at_slo > 0 else "none at SLO",
                f"{c.throughput_tok_per_sec:.0f}",
                latency_words(c.ttft_p99),
                latency_words(c.tpot_p99),
                "-" if c.suggested_target_waiting is None else str(c.suggested_target_waiting),
                "-" if c.suggested_kv_ceiling is None else f"{c.suggested_kv_ceiling * 100:.0f}%",
                f"{_duration(now - c.measured_at.timestamp())} ago",
                c.measured_by or "-",
            ],
            [],
        )
        for c in data
    ]
    _print_rows(
        ["MODEL", "PROFILE", "CONCURRENT", "TOK/S", "TTFT p99", "TPOT p99", "WAIT", "KV", "MEASURED", "BY"], rows
    )
