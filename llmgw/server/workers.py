"""Workers: more than one process serving the client API, limits held across them.

`workers: N` (server.yaml) runs N processes on the client listener, every one binding it
with SO_REUSEPORT so the kernel spreads connections across them. The `llmgw server`
process is worker 0: it keeps everything else (control plane, admin API, agents' stream,
metrics listener) and supervises workers 1..N-1, each the same executable run as
`llmgw server --worker SLOT:FD:N:LIMITS_FD`, which serves the client API only.

What a worker holds of its own: a store connection, the key cache (polling the store as
any gateway's does, so a revoked key is refused as promptly as across two gateways), a
usage recorder writing its own rows with its own journal file (``usage-journal.worker-N``,
replayed when that slot starts again), and its own probes and scrapes of every engine (the scrape is a few hundred bytes a
second per engine and worker; receiving the server's would save that but make a worker's
view of an engine as old as two hops).

What it learns from the server process, over one socket pair per worker (JSON lines,
this module's Channel): the models served (after every catalog change) and the endpoint
set with each endpoint's key, measured capacity and weight, pushed on every add or remove
and checked for other changes every PUSH_CHECK_S; a worker routes to a replica the moment
its line arrives, as healthy as the server process saw it, its own probe watching from
then. Requests for a model loaded on demand are passed to the server process (`touch`,
`wait`). Pages and anything else that is not the API are forwarded to the server process
over loopback. The other way go snapshots of the worker's counters and histograms every
METRICS_EVERY_S and at stop, which the server's /metrics adds to its own.

Limits are not a worker's own: a second socket pair per worker carries every admission,
settlement and cancellation to the server process's accountant (gateway/worker_limits.py), so
a key's limits and budgets hold across the workers exactly as in one process.

A worker stops when its socket closes (the server process went away, however it died);
the server restarts a worker that exits on its own, after BACKOFF_S doubling to
MAX_BACKOFF_S while it keeps failing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
from aiohttp import web
from multidict import CIMultiDict
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.samples import Sample

from llmgw.config.server import ModelConfig
from llmgw.errors import LlmgwError
from llmgw.server.gateway.endpoints import Endpoint, EndpointSet
from llmgw.server.gateway.errors import error_response
from llmgw.server.gateway.usage_journal import JOURNAL_NAME
from llmgw.server.gateway.worker_limits import AccountantLink, serve_accountant

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from llmgw.server.app import Server

log = logging.getLogger("llmgw.server.workers")

PUSH_CHECK_S = 0.5  # capacity, weight or key changed in place: pushed this soon
METRICS_EVERY_S = 1.0  # a worker's counters reach the server's /metrics this often
BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
STEADY_S = 30.0  # a worker that ran this long before it died is restarted after BACKOFF_S again
TOUCH_EVERY_S = 1.0  # a worker tells the server a model is used at most this often
LINE_LIMIT = 64 * 1024 * 1024  # one message (an endpoint set, a metrics snapshot) at most
WORKER_HEADER = "X-Llmgw-Worker"  # a forwarded request: the secret the server gave its workers
PEER_HEADER = "X-Llmgw-Peer"  # and the client's address as the worker saw it
_HOP = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Transfer-Encoding",
        "Upgrade",
        "TE",
        "Trailer",
        "Proxy-Connection",
        "Content-Length",
        WORKER_HEADER,
        PEER_HEADER,
    )
)


class WorkerError(LlmgwError):
    """A worker could not be started or could not reach its server process."""


def journal_path(data_path: str, slot: int) -> Path:
    """The usage journal of one serving process: two processes never share one."""
    name = JOURNAL_NAME if slot == 0 else f"{JOURNAL_NAME}.worker-{slot}"
    return Path(data_path) / name


def leftover_journals(data_path: str, workers: int) -> list[Path]:
    """Journals of worker slots this run does not have (workers was larger before): the
    server process writes them to the store at start, or their rows would wait forever."""
    out = []
    for p in Path(data_path).glob(f"{JOURNAL_NAME}.worker-*"):
        n = p.name.rsplit("-", 1)[-1]
        if n.isdigit() and int(n) >= workers:
            out.append(p)
    return sorted(out)


def parse_worker_arg(value: str) -> tuple[int, int, int, int]:
    """`--worker SLOT:FD:N:LIMITS_FD` as the server process passes it: this worker's slot, its
    channel, how many serve, and the channel to the server's accountant."""
    try:
        slot, fd, count, limits_fd = (int(x) for x in value.split(":"))
    except ValueError:
        raise WorkerError(
            f"--worker {value!r}: expected SLOT:FD:N:LIMITS_FD; it is given by `llmgw server` itself"
        ) from None
    if not 1 <= slot < count or fd < 0 or limits_fd < 0:
        raise WorkerError(f"--worker {value!r}: expected a slot from 1 to N-1 and two file descriptors")
    return slot, fd, count, limits_fd


def worker_command(argv: list[str], slot: int, fd: int, count: int, limits_fd: int) -> list[str]:
    """This process's own command again, as worker ``slot`` of ``count`` talking on ``fd``, its
    limits on ``limits_fd``: the one-file build is its own executable, a Python install runs the module."""
    prefix = [sys.executable] if getattr(sys, "frozen", False) else [sys.executable, "-m", "llmgw.cli.main"]
    return [*prefix, *argv, "--worker", f"{slot}:{fd}:{count}:{limits_fd}"]


# -- the channel ------------------------------------------------------------------


class Channel:
    """JSON objects, one a line, both ways over a stream socket."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    @classmethod
    async def open(cls, sock: socket.socket) -> Channel:
        reader, writer = await asyncio.open_unix_connection(sock=sock, limit=LINE_LIMIT)
        return cls(reader, writer)

    @property
    def closed(self) -> bool:
        return self._writer.is_closing()

    def send(self, msg: dict[str, Any]) -> None:
        if not self._writer.is_closing():
            self._writer.write(orjson.dumps(msg) + b"\n")

    async def flush(self) -> None:
        with contextlib.suppress(ConnectionError):
            await self._writer.drain()

    async def receive(self) -> dict[str, Any] | None:
        """The next message; None once the other side has closed (or sent something broken)."""
        try:
            line = await self._reader.readline()
        except (ConnectionError, ValueError):  # ValueError: a line over LINE_LIMIT
            return None
        if not line.endswith(b"\n"):
            return None
        try:
            msg = orjson.loads(line)
        except orjson.JSONDecodeError:
            log.error("worker channel: a line that is not JSON; closing it")
            return None
        return msg if isinstance(msg, dict) else None

    async def close(self) -> None:
        self._writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await self._writer.wait_closed()


# -- what travels -----------------------------------------------------------------


def endpoint_rows(endpoints: EndpointSet) -> list[list[Any]]:
    return [
        [ep.model, ep.url, ep.engine, ep.upstream_model, ep.api_key, ep.capacity, ep.weight, ep.healthy]
        for ep in endpoints.endpoints
    ]


def apply_endpoints(endpoints: EndpointSet, rows: list[list[Any]], breaker: tuple[int, float]) -> None:
    """Make a worker's endpoint set equal to the server process's; endpoints it has keep
    their own in-flight counts, breakers and scrapes."""
    have = {(ep.model, ep.url): ep for ep in list(endpoints.endpoints)}
    want = {(r[0], r[1]): r for r in rows}
    for k, gone in have.items():
        if k not in want:
            endpoints.remove(gone)
    for k, (model, url, engine, upstream, key, capacity, weight, healthy) in want.items():
        ep: Endpoint | None = have.get(k)
        if ep is not None and (ep.engine, ep.upstream_model) != (engine, upstream):
            endpoints.remove(ep)
            ep = None
        if ep is None:
            ep = Endpoint(model, url, engine, upstream, breaker[0], breaker[1], api_key=key)
            # The server process saw it ready: routable from this moment, this worker's own probe watching on.
            ep.healthy = bool(healthy)
            ep.health_detail = "ready, as the server process saw it" if healthy else "not checked yet"
            endpoints.add(ep)
        elif ep.api_key != key:
            ep.api_key = key
        ep.capacity = capacity
        ep.weight = weight


def snapshot(registry: CollectorRegistry) -> list[list[Any]]:
    """A process's counters and histograms, as [name, type, help, [[sample, labels, value], ...]].
    Gauges are each process's own state (its in-flight, its view of an engine) and stay out."""
    out: list[list[Any]] = []
    for fam in registry.collect():
        if fam.type not in ("counter", "histogram"):
            continue
        samples = [[s.name, s.labels, s.value] for s in fam.samples if not s.name.endswith("_created")]
        out.append([fam.name, fam.type, fam.documentation, samples])
    return out


_Totals = dict[str, tuple[str, str, dict[tuple[str, tuple[tuple[str, str], ...]], float]]]


def add_snapshot(into: _Totals, snap: list[list[Any]]) -> None:
    for name, typ, doc, samples in snap:
        entry = into.setdefault(name, (typ, doc, {}))
        values = entry[2]
        for sname, labels, value in samples:
            k = (sname, tuple(sorted(labels.items())))
            values[k] = values.get(k, 0.0) + value


def merge_families(families: Iterable[Metric], extra: _Totals) -> list[Metric]:
    """The server process's families with the workers' counts added: a series both have is
    summed, one only a worker has is added."""
    out: list[Metric] = []
    seen: set[str] = set()
    for fam in families:
        add = extra.get(fam.name)
        if add is None or add[0] != fam.type:
            out.append(fam)
            continue
        seen.add(fam.name)
        merged = Metric(fam.name, fam.documentation, fam.type)
        values = dict(add[2])
        for s in fam.samples:
            k = (s.name, tuple(sorted(s.labels.items())))
            merged.samples.append(Sample(s.name, s.labels, s.value + values.pop(k, 0.0), s.timestamp, s.exemplar))
        merged.samples.extend(Sample(n, dict(lv), v) for (n, lv), v in sorted(values.items()))
        out.append(merged)
    for name, (typ, doc, values) in sorted(extra.items()):
        if name in seen or any(f.name == name for f in out):
            continue
        fam = Metric(name, doc, typ)
        fam.samples.extend(Sample(n, dict(lv), v) for (n, lv), v in sorted(values.items()))
        out.append(fam)
    return out


def requests_in(families: Iterable[Metric] | _Totals) -> float:
    """How many requests a process counted (llmgw_requests_total summed)."""
    if isinstance(families, dict):
        entry = families.get("llmgw_requests")
        return sum(v for (n, _), v in entry[2].items() if n == "llmgw_requests_total") if entry else 0.0
    return sum(s.value for f in families if f.name == "llmgw_requests" for s in f.samples if s.name.endswith("_total"))


# -- the server process's side ----------------------------------------------------


@dataclass
class _Slot:
    index: int
    proc: asyncio.subprocess.Process | None = None
    channel: Channel | None = None
    started: float = 0.0
    backoff: float = BACKOFF_S
    restarts: int = 0
    serving: bool = False  # it said it listens (and until its channel closes)
    limits: AccountantLink | None = None  # the server's accountant, answering this worker
    last: list[list[Any]] = field(default_factory=list)  # this run's latest snapshot
    base: _Totals = field(default_factory=dict)  # what earlier runs of the slot counted
    tasks: list[asyncio.Task] = field(default_factory=list)


class WorkerPool:
    """Workers 1..N-1 of a server process: started, fed, restarted, stopped."""

    def __init__(self, server: Server, count: int, argv: list[str]) -> None:
        self.server = server
        self.count = count
        self._argv = argv
        self.slots = [_Slot(i) for i in range(1, count)]
        self.secret = secrets.token_urlsafe(24)
        self._stopping = False
        self._pushed: list[list[Any]] | None = None
        self._models: list[dict[str, Any]] | None = None
        self._push_soon: asyncio.Handle | None = None
        self._watch: asyncio.Task | None = None
        self._supervisors: list[asyncio.Task] = []

    # state to send

    def _state(self) -> dict[str, Any]:
        s = self.server
        assert s.gateway is not None
        return {
            "models": [m.model_dump(mode="json") for m in s.gateway.model_configs],
            "endpoints": endpoint_rows(s.endpoints),
            "forward": [s.forward_port, self.secret],
        }

    def _spender(self) -> str | None:
        """With limits shared with other gateways: the name under which this server's spend is
        written, which workers write theirs below (so that its own reads skip them)."""
        shared = self.server.shared_limits
        return shared.spender if shared is not None else None

    def changed(self) -> None:
        """The endpoint set or the models changed: pushed on the next turn of the loop (a batch of
        changes goes as one message)."""
        if self._push_soon is None and not self._stopping:
            self._push_soon = asyncio.get_running_loop().call_soon(self._push)

    def _push(self) -> None:
        self._push_soon = None
        s = self.server
        assert s.gateway is not None
        rows = endpoint_rows(s.endpoints)
        models = [m.model_dump(mode="json") for m in s.gateway.model_configs]
        msg: dict[str, Any] = {}
        if rows != self._pushed:
            msg["endpoints"] = self._pushed = rows
        if models != self._models:
            msg["models"] = self._models = models
        if msg:
            for slot in self.slots:
                if slot.channel is not None:
                    slot.channel.send(msg)

    async def _check(self) -> None:
        while True:
            await asyncio.sleep(PUSH_CHECK_S)
            self._push()

    # life

    async def start(self) -> None:
        self.server.endpoints.on_change.append(self.changed)
        st = self._state()
        self._pushed, self._models = st["endpoints"], st["models"]
        for slot in self.slots:
            await self._spawn(slot)
            self._supervisors.append(asyncio.create_task(self._supervise(slot), name=f"worker {slot.index}"))
        self._watch = asyncio.create_task(self._check(), name="workers: push")
        log.info("serving %s with %d processes (workers: %d)", self.server.config.listen, self.count, self.count)

    async def _spawn(self, slot: _Slot) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        lparent, lchild = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            cmd = worker_command(self._argv, slot.index, child.fileno(), self.count, lchild.fileno())
            slot.proc = await asyncio.create_subprocess_exec(*cmd, pass_fds=(child.fileno(), lchild.fileno()))
        except OSError as exc:
            parent.close()
            lparent.close()
            raise WorkerError(f"worker {slot.index} could not be started: {exc.strerror or exc}") from None
        finally:
            child.close()
            lchild.close()
        slot.started = time.monotonic()
        accountant = self.server.local_accountant
        if accountant is not None:
            slot.limits = await serve_accountant(accountant, lparent, slot.index)
        else:
            lparent.close()  # no limits without auth: the worker does not ask
        slot.channel = await Channel.open(parent)
        # The worker serves this process's configuration as it is (`llmgw up` writes its own).
        slot.channel.send(
            {"config": self.server.config.model_dump(mode="json"), "spender": self._spender(), **self._state()}
        )
        slot.tasks = [asyncio.create_task(self._read(slot, slot.channel), name=f"worker {slot.index}: channel")]

    async def _read(self, slot: _Slot, channel: Channel) -> None:
        while (msg := await channel.receive()) is not None:
            if msg.get("serving"):
                slot.serving = True
                log.info("worker %d (pid %s) is serving", slot.index, slot.proc.pid if slot.proc else "?")
            if "metrics" in msg:
                slot.last = msg["metrics"]
            if "touch" in msg:
                demand = self.server.gateway.demand if self.server.gateway is not None else None
                if demand is not None:
                    demand.touch(msg["touch"])
            if "wait" in msg:
                slot.tasks.append(asyncio.create_task(self._answer_wait(channel, msg["wait"], msg.get("id"))))

    async def _answer_wait(self, channel: Channel, model: str, wid: Any) -> None:
        demand = self.server.gateway.demand if self.server.gateway is not None else None
        if demand is None:
            problem: str | None = "this control plane is a standby and loads no model on demand"
        else:
            try:
                problem = await demand.wait_ready(model)
            except Exception as exc:
                problem = f"the model could not be loaded: {exc}"
        # The endpoint the reconciler added reaches the worker before this answer does.
        self._push()
        channel.send({"ready": wid, "problem": problem})

    async def _supervise(self, slot: _Slot) -> None:
        while True:
            assert slot.proc is not None
            rc = await slot.proc.wait()
            await self._ended(slot)
            if self._stopping:
                return
            ran = time.monotonic() - slot.started
            slot.backoff = BACKOFF_S if ran >= STEADY_S else min(slot.backoff * 2, MAX_BACKOFF_S)
            wait = BACKOFF_S if ran >= STEADY_S else slot.backoff
            log.error("worker %d exited (status %s) after %.0fs; starting it again in %gs", slot.index, rc, ran, wait)
            await asyncio.sleep(wait)
            if self._stopping:
                return
            try:
                await self._spawn(slot)
                slot.restarts += 1
            except WorkerError as exc:
                log.error("%s; trying again in %gs", exc, slot.backoff)
                slot.proc = None
                await asyncio.sleep(slot.backoff)
                if self._stopping:
                    return
                await self._spawn(slot)
                slot.restarts += 1

    async def _ended(self, slot: _Slot) -> None:
        # Its last snapshot (sent at stop, or within METRICS_EVERY_S of a crash) counts on.
        for t in slot.tasks:
            if t.get_name().endswith(": channel"):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await asyncio.wait_for(asyncio.shield(t), 2.0)
        for t in slot.tasks:
            t.cancel()
        add_snapshot(slot.base, slot.last)
        slot.last = []
        slot.serving = False
        if slot.limits is not None:
            # What it had in progress is charged as estimated (worker_limits.py).
            slot.limits.close()
            slot.limits = None
        if slot.channel is not None:
            await slot.channel.close()
            slot.channel = None

    async def stop(self, timeout: float) -> None:
        """SIGTERM every worker (each drains and writes its usage), kill what is still running after ``timeout``."""
        self._stopping = True
        if self._watch is not None:
            self._watch.cancel()
        if self._push_soon is not None:
            self._push_soon.cancel()
        with contextlib.suppress(ValueError):
            self.server.endpoints.on_change.remove(self.changed)
        for slot in self.slots:
            if slot.proc is not None and slot.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    slot.proc.send_signal(signal.SIGTERM)
        if self._supervisors:
            _done, pending = await asyncio.wait(self._supervisors, timeout=timeout)
            for slot in self.slots:
                if slot.proc is not None and slot.proc.returncode is None:
                    log.error("worker %d did not stop within %gs; killed", slot.index, timeout)
                    with contextlib.suppress(ProcessLookupError):
                        slot.proc.kill()
            if pending:
                await asyncio.wait(pending, timeout=5.0)
            for t in pending:
                t.cancel()

    # metrics

    def totals(self) -> _Totals:
        out: _Totals = {}
        for slot in self.slots:
            add_snapshot(out, _as_snapshot(slot.base))
            add_snapshot(out, slot.last)
        return out

    def collector(self, registry: CollectorRegistry) -> _MergedRegistry:
        return _MergedRegistry(registry, self)


def _as_snapshot(t: _Totals) -> list[list[Any]]:
    return [[n, typ, doc, [[s, dict(lv), v] for (s, lv), v in values.items()]] for n, (typ, doc, values) in t.items()]


class _MergedRegistry:
    """What the server's /metrics renders with workers: its registry with every worker's counts added,
    and llmgw_worker_* about the workers themselves."""

    def __init__(self, registry: CollectorRegistry, pool: WorkerPool) -> None:
        self._registry = registry
        self._pool = pool

    def collect(self) -> Iterable[Metric]:
        own = list(self._registry.collect())
        pool = self._pool
        yield from merge_families(own, pool.totals())
        served = CounterMetricFamily(
            "llmgw_worker_requests",
            "Requests each serving process counted (worker 0 is the server process), restarts included.",
            labels=["worker"],
        )
        served.add_metric(["0"], requests_in(own))
        restarts = CounterMetricFamily(
            "llmgw_worker_restarts", "Times a worker was started again after it exited.", labels=["worker"]
        )
        up = 1
        for slot in pool.slots:
            t: _Totals = {}
            add_snapshot(t, _as_snapshot(slot.base))
            add_snapshot(t, slot.last)
            served.add_metric([str(slot.index)], requests_in(t))
            restarts.add_metric([str(slot.index)], slot.restarts)
            up += 1 if slot.serving and slot.proc is not None and slot.proc.returncode is None else 0
        yield served
        yield restarts
        yield GaugeMetricFamily(
            "llmgw_workers", "Processes serving the client API now, the server process included.", value=up
        )


def install_forward_peer(app: web.Application, secret: Callable[[], str | None]) -> None:
    """On the server process's client app: a request a worker forwarded (it carries the
    workers' secret) counts against the client's address, not the worker's."""

    @web.middleware
    async def peer(request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
        given = request.headers.get(WORKER_HEADER)
        if given is not None:
            want = secret()
            if want is not None and secrets.compare_digest(given, want):
                request = request.clone(remote=request.headers.get(PEER_HEADER) or "unknown")
        return await handler(request)

    app.middlewares.insert(0, peer)


# -- the worker's side ------------------------------------------------------------


class RemoteDemand:
    """Demand (proxy.Demand) of a worker: the server process's reconciler loads the model."""

    def __init__(self, channel: Channel) -> None:
        self._channel = channel
        self._touched: dict[str, float] = {}
        self._waits: dict[int, asyncio.Future[str | None]] = {}
        self._next = 0

    def touch(self, model: str) -> None:
        now = time.monotonic()
        if now - self._touched.get(model, -TOUCH_EVERY_S) >= TOUCH_EVERY_S:
            self._touched[model] = now
            self._channel.send({"touch": model})

    async def wait_ready(self, model: str) -> str | None:
        self._next += 1
        wid = self._next
        fut = self._waits[wid] = asyncio.get_running_loop().create_future()
        self._channel.send({"wait": model, "id": wid})
        try:
            return await fut
        finally:
            self._waits.pop(wid, None)

    def answered(self, wid: int, problem: str | None) -> None:
        fut = self._waits.get(wid)
        if fut is not None and not fut.done():
            fut.set_result(problem)

    def gone(self) -> None:
        for fut in self._waits.values():
            if not fut.done():
                fut.set_result("the server is stopping")


class WorkerLink:
    """A worker's end of its channel: applies what the server process sends, sends its metrics."""

    def __init__(
        self, server: Server, channel: Channel, stop: asyncio.Event, first: dict[str, Any], limits: socket.socket
    ) -> None:
        self._first = first
        self.limits_sock = limits  # to the server's accountant (worker_limits.py), opened by the gateway's start
        # Shared limits with other gateways: this worker's spend is written under the server's name.
        self.spender: str | None = first.get("spender")
        self.server = server
        self.channel = channel
        self.stop = stop
        self.demand = RemoteDemand(channel)
        self.forward_base: str | None = None
        self.secret: str | None = None
        self._tasks: list[asyncio.Task] = []
        b = server.config.router.breaker
        self._breaker = (b.failures, b.cooldown)

    async def first_state(self) -> None:
        """The models and endpoints to serve, before the worker listens."""
        self.apply(self._first)

    def apply(self, msg: dict[str, Any]) -> None:
        s = self.server
        if "forward" in msg:
            port, self.secret = msg["forward"]
            self.forward_base = f"http://127.0.0.1:{port}" if port else None
        if "models" in msg and s.gateway is not None:
            s.gateway.set_models([ModelConfig.model_validate(m) for m in msg["models"]])
        if "endpoints" in msg:
            apply_endpoints(s.endpoints, msg["endpoints"], self._breaker)
        if "ready" in msg:
            self.demand.answered(msg["ready"], msg.get("problem"))

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._read(), name="worker: channel"),
            asyncio.create_task(self._metrics(), name="worker: metrics"),
        ]

    async def _read(self) -> None:
        while (msg := await self.channel.receive()) is not None:
            try:
                self.apply(msg)
            except Exception:
                log.exception("worker: a message from the server process could not be applied")
        # The server process is gone (or closed the channel): this worker has no one to serve for.
        self.demand.gone()
        if not self.stop.is_set():
            log.warning("worker: the server process closed the channel; stopping")
            self.stop.set()

    async def _metrics(self) -> None:
        while True:
            await asyncio.sleep(METRICS_EVERY_S)
            self.send_metrics()

    def send_metrics(self) -> None:
        self.channel.send({"metrics": snapshot(self.server.metrics.registry)})

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.send_metrics()
        await self.channel.flush()
        await self.channel.close()


def forwarder(link: WorkerLink) -> Callable[[web.Request], Any]:
    """A worker's handler for what is not the API (pages, /ready): the server process answers it."""
    session: aiohttp.ClientSession | None = None

    async def forward(request: web.Request) -> web.StreamResponse:
        nonlocal session
        if link.forward_base is None or link.secret is None:
            return error_response(503, "the server is starting; try again", "starting")
        if session is None:
            session = aiohttp.ClientSession(auto_decompress=False, timeout=aiohttp.ClientTimeout(total=None))
        headers = CIMultiDict((k, v) for k, v in request.headers.items() if k.lower() not in _HOP)
        headers[WORKER_HEADER] = link.secret
        headers[PEER_HEADER] = request.remote or "unknown"
        body = await request.read()
        try:
            async with session.request(
                request.method,
                link.forward_base + request.path_qs,
                headers=headers,
                data=body or None,
                allow_redirects=False,
                skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
            ) as r:
                resp = web.StreamResponse(
                    status=r.status,
                    reason=r.reason,
                    headers=CIMultiDict((k, v) for k, v in r.headers.items() if k.lower() not in _HOP),
                )
                if r.content_length is not None:
                    resp.content_length = r.content_length
                await resp.prepare(request)
                async for chunk in r.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp
        except (aiohttp.ClientError, OSError) as exc:
            log.warning("worker: forwarding %s to the server process failed: %s", request.path, exc)
            return error_response(502, "the server could not answer this request; try again", "unavailable")

    async def close(_app: web.Application) -> None:
        if session is not None:
            await session.close()

    forward.close = close  # type: ignore[attr-defined]
    return forward


async def serve_worker(slot: int, fd: int, count: int, limits_fd: int, stop: asyncio.Event) -> None:
    """Worker ``slot`` of ``count``: serve the client API on the shared listener until the server
    process goes away or SIGTERM, then drain, write the last usage rows and the last metrics."""
    from llmgw.config.server import ServerConfig
    from llmgw.server.app import Server

    socks = []
    for f in (fd, limits_fd):
        with contextlib.suppress(OSError):
            os.set_inheritable(f, False)
        try:
            socks.append(socket.socket(fileno=f))
        except OSError as exc:
            raise WorkerError(f"--worker: file descriptor {f} is not the server process's socket: {exc}") from None
    sock, limits_sock = socks
    channel = await Channel.open(sock)
    try:
        async with asyncio.timeout(30.0):
            first = await channel.receive()
    except TimeoutError:
        first = None
    if first is None or "config" not in first or "endpoints" not in first:
        raise WorkerError("the server process sent nothing to serve; a worker is started by `llmgw server` itself")
    server = Server(ServerConfig.model_validate(first["config"]), workers=count, slot=slot)
    link = server.link = WorkerLink(server, channel, stop, first, limits_sock)
    await server.start()
    link.start()
    channel.send({"serving": True})  # listening now: the server counts it in llmgw_workers
    try:
        await stop.wait()
    finally:
        await server.stop()
        await link.close()
