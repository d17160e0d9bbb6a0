"""`llmgw agent`: discovery, the stream to the control plane, and what the stream asks for.

The agent registers with everything it knows (inventory, engines, running
shards) on every connection, since the control plane keeps no replica state
across its own restart; it heartbeats (with the subnet managers behind its
InfiniBand ports once a minute); and it carries out start, stop, drain,
provision, logs, remove-weights, fabric-scan and fabric-test requests. Bad input (a malformed message,
an unknown engine, a missing file) is answered with its reason and logged;
the agent keeps running. Engines outlive the agent: on start-up it adopts
those still running.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ipaddress
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from llmgw import __version__
from llmgw.agent import fabric_tools
from llmgw.agent.client import ControlPlaneLink
from llmgw.agent.discovery.collect import Discovery, DiscoveryOptions
from llmgw.agent.engines import LaunchRefused, UnknownEngine, adapter_for, metric_names, plan_shard
from llmgw.agent.engines.spec import GPU as LaunchGPU
from llmgw.agent.engines.spec import Adapter, EngineSettings, Group, NodeFacts, Profile, ShardLaunch
from llmgw.agent.fabrics import FabricCheck, check_fabrics
from llmgw.agent.identity import Identity, resolve_identity
from llmgw.agent.provision.host import HostFacts
from llmgw.agent.provision.manager import ConvergeLoop, Installer, Want
from llmgw.agent.provision.os_packages import PackageInstaller
from llmgw.agent.provision.status import InstallRecord
from llmgw.agent.supervisor import (
    Role,
    ShardSpec,
    Sidecar,
    SupervisedShard,
    Supervisor,
    SupervisorError,
    UnknownShardError,
)
from llmgw.agent.weights import WeightsCache, WeightsError
from llmgw.config.agent import AgentConfig
from llmgw.errors import LlmgwError
from llmgw.protocol import (
    FEATURES,
    PROTOCOL_VERSION,
    Ack,
    DrainShard,
    FabricAttachment,
    FabricScanReply,
    FabricScanRequest,
    FabricTestReply,
    FabricTestRequest,
    FetchProgress,
    Heartbeat,
    IBPort,
    LocalWeights,
    LogsReply,
    LogsRequest,
    Message,
    Pace,
    ProtocolError,
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
    decode,
    encode,
)
from llmgw.protocol.doctor import SubnetManagers
from llmgw.protocol.inventory import NodeInventory
from llmgw.protocol.prometheus import parse_prometheus

log = logging.getLogger("llmgw.agent")

# The agent's own recent log lines, for a logs request with source "agent".
_AGENT_LOG: collections.deque[str] = collections.deque(maxlen=2000)


class _RingHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        _AGENT_LOG.append(self.format(record))


def capture_agent_log() -> None:
    h = _RingHandler()
    h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger("llmgw").addHandler(h)


async def serve_until_stopped(cfg: AgentConfig, stop: asyncio.Event) -> None:
    """`llmgw agent`: the agent of ``cfg`` until ``stop`` is set, its own log lines kept for logs requests."""
    capture_agent_log()
    await Agent(cfg, resolve_identity(cfg)).run(stop)


class Agent:
    def __init__(
        self,
        cfg: AgentConfig,
        identity: Identity,
        discovery: DiscoveryOptions | None = None,
        packages: PackageInstaller | None = None,
    ) -> None:
        self.cfg = cfg
        self.identity = identity
        self.discovery = Discovery(
            discovery
            or DiscoveryOptions(
                model_dirs=(*cfg.model_dirs, cfg.weights_cache),
                nvidia_smi=cfg.discovery.nvidia_smi,
                ib_root=Path(cfg.discovery.ib_root),
                prefer_nvml=cfg.discovery.prefer_nvml,
                skip_gpus=cfg.discovery.skip_gpus,
            )
        )
        self.inventory: NodeInventory | None = None
        self.supervisor: Supervisor | None = None
        self.weights: WeightsCache | None = None
        self.installer: Installer | None = None
        self._converge: ConvergeLoop | None = None
        self._outbox: asyncio.Queue[Message] | None = None
        # The heartbeat interval the control plane asked for (Pace): a large fleet reports less often.
        self._pace: float | None = None
        self._kept_pace: float | None = None  # the pace of the previous connection
        self._pace_changed = asyncio.Event()
        self._specs: dict[str, StartShard] = {}  # as received, echoed back in registrations
        self._starting: dict[str, asyncio.Task] = {}
        self._fabrics_sent: FabricCheck | None = None  # the last fabrics check sent
        self._tasks: set[asyncio.Task] = set()
        self._packages = packages  # None: the machine's own package manager
        self._diags = fabric_tools.PackageOnDemand(
            fabric_tools.DIAGS, fabric_tools.DIAGS_PACKAGES, self._install_packages
        )
        self._perftest = fabric_tools.PackageOnDemand(
            fabric_tools.PERFTEST, fabric_tools.PERFTEST_PACKAGES, self._install_packages
        )
        self._sm_due = 0.0  # when the subnet managers are read next (monotonic)
        self._sm_reading: asyncio.Task | None = None
        self._sm_done: tuple[SubnetManagers | None, str | None] | None = None  # for the next heartbeat
        self._sm_had_ports = False  # the last reading sent listed ports
        self._fabric_testing = False

    # -- lifecycle ----------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        cfg = self.cfg
        for d in (cfg.weights_cache, cfg.engines_dir, cfg.supervisor.work_dir):
            Path(d).mkdir(parents=True, exist_ok=True)
        self.inventory = await asyncio.to_thread(self.discovery.inventory)
        for w in self.inventory.warnings or ():
            log.warning("discovery: %s", w)
        sv = cfg.supervisor
        self.supervisor = Supervisor(
            Path(sv.work_dir),
            on_change=self._shard_changed,
            tail_lines=sv.log_lines,
            stop_timeout=sv.stop_timeout,
            rendezvous_timeout=sv.rendezvous_timeout,
            health_interval=sv.health_interval,
        )
        report = await self.supervisor.adopt()
        for st in self.supervisor.statuses():
            spec = _spec_from_meta(st.meta)
            if spec is not None:
                self._specs[st.shard_id] = spec
        if report.adopted:
            log.info("adopted %d running engine(s): %s", len(report.adopted), ", ".join(report.adopted))
        self.weights = WeightsCache(Path(cfg.weights_cache))
        self.installer = Installer(
            root=Path(cfg.engines_dir),
            host=HostFacts.from_inventory(self.inventory.host, self.inventory.gpus or ()),
            on_status=self._provision_changed,
            packages=self._packages,
        )
        self._converge = ConvergeLoop(self.installer)
        converge = asyncio.create_task(self._converge.run(), name="provision")
        link = ControlPlaneLink(cfg, self._session)
        try:
            await link.run(stop)
        finally:
            converge.cancel()
            for t in [*self._starting.values(), *self._tasks]:
                t.cancel()
            await asyncio.gather(converge, *self._starting.values(), *self._tasks, return_exceptions=True)
            # Engines keep serving while the agent restarts (close() leaves them running),
            # unless the agent was told they end with it (`llmgw up` does).
            if cfg.supervisor.stop_engines_on_exit:
                await self.supervisor.stop_all()
            await self.supervisor.close()
            await self.weights.aclose()
            await asyncio.to_thread(self.discovery.close)
            log.info(
                "agent stopped; engines left running: %d", sum(1 for s in self.supervisor.statuses() if s.state.running)
            )

    # -- the session --------------------------------------------------------

    async def _session(self, ws: aiohttp.ClientWebSocketResponse, addr: str) -> None:
        self._outbox = asyncio.Queue()
        # Each control plane (or restart of one) says its own; the last one kept is said at
        # registration, so a restarted control plane paces the fleet before it has it all back.
        self._kept_pace, self._pace = self._pace, None
        await ws.send_bytes(encode(self._register()))
        # A control plane newly connected to learns the subnet managers with the first heartbeat.
        self._sm_due = 0.0
        self._read_subnet_managers_when_due(self.inventory.ib_ports if self.inventory else None)
        sender = asyncio.create_task(self._send_loop(ws), name="send")
        beat = asyncio.create_task(self._heartbeat_loop(), name="heartbeat")
        try:
            async for frame in ws:
                if frame.type in (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY):
                    self._handle(frame.data)
                elif frame.type == aiohttp.WSMsgType.ERROR:
                    raise ConnectionError(f"the stream broke: {ws.exception()}")
        finally:
            beat.cancel()
            sender.cancel()
            await asyncio.gather(beat, sender, return_exceptions=True)
            self._outbox = None

    def send(self, msg: Message) -> None:
        """Queue a message for the control plane; dropped when not connected (a
        registration on the next connection says everything again)."""
        if self._outbox is not None:
            self._outbox.put_nowait(msg)

    async def _send_loop(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        assert self._outbox is not None
        while True:
            msg = await self._outbox.get()
            await ws.send_bytes(encode(msg))

    async def _heartbeat_loop(self) -> None:
        # Due one interval after the last report (the registration first); a pace that arrives
        # meanwhile moves the due time at once, so the first report after a pace is already paced
        # (a restarted control plane asks for it while every agent is registering).
        last = time.monotonic()
        while True:
            wait = last + self.heartbeat_interval - time.monotonic()
            if wait > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._pace_changed.wait(), wait)
                self._pace_changed.clear()
                continue
            self.send(await self._heartbeat())
            last = time.monotonic()

    @property
    def heartbeat_interval(self) -> float:
        """agent.yaml's heartbeat_interval, or the longer one the control plane asked for."""
        return max(self.cfg.heartbeat_interval, self._pace or 0.0)

    def _set_pace(self, msg: Pace) -> None:
        before = self.heartbeat_interval
        self._pace = msg.heartbeat_interval
        self._pace_changed.set()
        if self.heartbeat_interval != before:
            log.info(
                "the control plane asks for a heartbeat every %gs; reporting every %gs (heartbeat_interval %gs)",
                msg.heartbeat_interval or self.cfg.heartbeat_interval,
                self.heartbeat_interval,
                self.cfg.heartbeat_interval,
            )

    def _register(self) -> Register:
        inv = self.inventory
        assert inv is not None and self.supervisor is not None and self.installer is not None
        fabrics = self._fabrics_now(inv.ib_ports if inv.adapters is not None else None, force=True)
        assert fabrics is not None
        return Register(
            node_id=self.identity.node_id,
            protocol_version=PROTOCOL_VERSION,
            agent_version=__version__,
            features=list(FEATURES),
            inventory=inv,
            installable_engines=self.installer.installable(),
            engine_versions=self._engine_versions(),
            labels=dict(self.cfg.labels),
            mgmt_addr=self.identity.mgmt_addr,
            mgmt_interface=self.identity.mgmt_interface,
            fabrics=list(fabrics.advertised),
            heartbeat_interval=self.cfg.heartbeat_interval,
            heartbeat_pace=self._kept_pace,
            fabric_problems=list(fabrics.problems),
            declared_fabrics=[
                FabricAttachment(fabric=f.name, hcas=list(f.hcas), rate_gbps=f.rate_gbps) for f in self.cfg.fabrics
            ],
            shards=self._running_shards(),
            weights=self._weights_held(),
        )

    def _running_shards(self) -> list[RunningShard]:
        assert self.supervisor is not None
        out = [
            RunningShard(
                shard_id=s.shard_id,
                replica_id=(self._specs.get(s.shard_id) or _NO_SPEC).replica_id,
                state=s.state,
                pid=s.pid,
                spec=self._specs.get(s.shard_id),
            )
            for s in self.supervisor.statuses()
        ]
        # A shard still fetching its weights has no process yet but will start one:
        # left out, a control plane reconnecting mid-download would let it go and
        # the engine would later run unknown to anyone.
        listed = {r.shard_id for r in out}
        for sid in self._starting:
            spec = self._specs.get(sid)
            if sid not in listed and spec is not None:
                out.append(RunningShard(shard_id=sid, replica_id=spec.replica_id, state=ShardState.PENDING, spec=spec))
        return out

    async def _heartbeat(self) -> Heartbeat:
        assert self.supervisor is not None and self.installer is not None
        pids = {s.shard_id: s.pid for s in self.supervisor.statuses() if s.pid}
        sample = await asyncio.to_thread(self.discovery.sample, pids)
        fabrics = self._fabrics_now(sample.ib_ports) if self.cfg.fabrics else None
        managers, managers_error = self._sm_done or (None, None)
        self._sm_done = None
        self._read_subnet_managers_when_due(sample.ib_ports)
        return Heartbeat(
            node_id=self.identity.node_id,
            memory=sample.memory,
            load=sample.load,
            storage=sample.storage,
            gpus=sample.gpus,
            ib_ports=sample.ib_ports,
            engine_versions=self._engine_versions(),
            provision=[_provision_msg(s) for s in self.installer.statuses.values()],
            shards=[self._status_msg(s) for s in self.supervisor.statuses()],
            weights=self._weights_held(),
            fabrics=list(fabrics.advertised) if fabrics is not None else None,
            fabric_problems=list(fabrics.problems) if fabrics is not None else None,
            subnet_managers=managers,
            subnet_managers_error=managers_error,
        )

    def _read_subnet_managers_when_due(self, ports: list[IBPort] | None) -> None:
        """Start a read of the subnet managers when the interval has passed; its result goes
        on the heartbeat after it finishes (the tools may take seconds: heartbeats do not wait)."""
        now = time.monotonic()
        if self._sm_reading is not None or now < self._sm_due:
            return
        self._sm_due = now + self.cfg.subnet_manager_interval
        if not (fabric_tools.infiniband_ports(ports) or self._sm_had_ports):
            return
        t = asyncio.create_task(self._read_subnet_managers(list(ports or ())), name="subnet managers")
        self._sm_reading = t
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _read_subnet_managers(self, ports: list[IBPort]) -> None:
        try:
            managers, error = await fabric_tools.read_subnet_managers(ports, self._diags)
        except Exception as exc:  # a parser's or installer's bug must not stop the heartbeats
            log.exception("reading the subnet managers failed")
            managers, error = None, f"reading the subnet managers failed: {exc!r}"
        finally:
            self._sm_reading = None
        if managers is None and error is None:
            # No InfiniBand port is ACTIVE any more: said once, so the control plane
            # does not keep showing managers this node can no longer see.
            managers = SubnetManagers(ports=[])
        self._sm_had_ports = bool(managers and managers.ports)
        self._sm_done = (managers, error)

    async def _install_packages(self, by_family: Mapping[str, Sequence[str]]) -> list[str]:
        assert self.installer is not None
        return await self.installer.install_packages(by_family, lambda detail: log.info("%s", detail))

    def _fabrics_now(self, ports: list[IBPort] | None, force: bool = False) -> FabricCheck | None:
        """agent.yaml's fabrics checked against the ports read now; None when nothing changed since
        the last one sent (a change is sent once), unless ``force`` (a registration says it all)."""
        check = check_fabrics(self.cfg.fabrics, ports)
        if check == self._fabrics_sent and not force:
            return None
        for problem in check.problems:
            if self._fabrics_sent is None or problem not in self._fabrics_sent.problems:
                log.warning("%s", problem)
        if self._fabrics_sent is not None and check.advertised != self._fabrics_sent.advertised:
            log.info("fabrics advertised now: %s", ", ".join(f.fabric for f in check.advertised) or "none")
        self._fabrics_sent = check
        return check

    def _engine_versions(self) -> dict[str, str]:
        assert self.installer is not None
        out = {
            name: s.version
            for name, s in self.installer.statuses.items()
            if s.state == ProvisionState.READY and s.version
        }
        # A binary agent.yaml names is this node's engine, whatever the control plane
        # would install: reported so placement counts the node as having it.
        for engine in self.cfg.engines.configured():
            out[engine] = "configured"
        return out

    def _weights_held(self) -> list[LocalWeights]:
        assert self.weights is not None
        return [LocalWeights(path=str(w.path), size_bytes=w.bytes) for w in self.weights.fetched() if w.complete]

    # -- requests from the control plane ------------------------------------

    def _handle(self, data: str | bytes) -> None:
        try:
            msg = decode(data, sender="control")
        except ProtocolError as exc:
            log.error("a message from the control plane was refused: %s", exc)
            if exc.msg_id:
                self.send(Ack(id=exc.msg_id, ok=False, error=str(exc)))
            return
        if isinstance(msg, StartShard):
            self._start(msg)
        elif isinstance(msg, DrainShard):
            self._spawn(self._drain(msg))
        elif isinstance(msg, StopShard):
            self._spawn(self._stop(msg))
        elif isinstance(msg, Provision):
            assert self._converge is not None
            configured = self.cfg.engines.configured()
            for w in msg.engines:
                if w.engine in configured:
                    log.info(
                        "not installing %s %s: agent.yaml names %s for it", w.engine, w.version, configured[w.engine]
                    )
            self._converge.want(
                [Want(w.engine, w.version, w.source_url) for w in msg.engines if w.engine not in configured]
            )
            self._ack(msg)
        elif isinstance(msg, LogsRequest):
            self.send(self._logs(msg))
        elif isinstance(msg, RemoveWeights):
            self._remove_weights(msg)
        elif isinstance(msg, FabricScanRequest):
            self._spawn(self._fabric_scan(msg))
        elif isinstance(msg, FabricTestRequest):
            self._fabric_test(msg)
        elif isinstance(msg, Pace):
            self._set_pace(msg)
        elif isinstance(msg, Ack):
            if not msg.ok:
                log.warning("the control plane refused message %s: %s", msg.id, msg.error)
        else:
            log.warning("ignoring a %s message, which the agent does not handle", msg.TYPE)

    def _ack(self, msg: Message, error: str | None = None) -> None:
        if msg.id:
            self.send(Ack(id=msg.id, ok=error is None, error=error))

    def _spawn(self, coro) -> None:
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    def _start(self, msg: StartShard) -> None:
        assert self.supervisor is not None
        current = self._status_or_none(msg.shard_id)
        if msg.shard_id in self._starting or (current is not None and current.state.running):
            # The control plane retries; a repeat must not start a second process.
            self._ack(msg)
            return
        self._specs[msg.shard_id] = msg
        task = asyncio.create_task(self._launch(msg), name=f"start {msg.shard_id}")
        self._starting[msg.shard_id] = task
        sid = msg.shard_id
        task.add_done_callback(lambda _t: self._starting.pop(sid, None))
        self._ack(msg)

    async def _launch(self, msg: StartShard) -> None:
        assert self.supervisor is not None and self.weights is not None
        sid = msg.shard_id
        self.send(ShardStatus(shard_id=sid, replica_id=msg.replica_id, state=ShardState.PENDING))
        try:
            adapter_for(msg.engine)  # an unknown engine is refused before any download
            if msg.http_port is None and (msg.rank or 0) == 0:
                raise _Refused("the start request names no http_port for the engine")
            model = msg.source or msg.model
            if not model:
                raise _Refused("the start request names no source (weights) and no model")
            last = 0.0

            def progress(done: int, total: int | None) -> None:
                nonlocal last
                now = time.monotonic()
                if now - last >= 1.0 or (total is not None and done >= total):
                    last = now
                    self.send(
                        ShardStatus(
                            shard_id=sid,
                            replica_id=msg.replica_id,
                            state=ShardState.PENDING,
                            fetch=FetchProgress(source=msg.source, bytes_done=done, bytes_total=total),
                        )
                    )

            if msg.source:
                model = await self.weights.resolve(msg.source, progress)
            plan = plan_shard(self._launch_spec(msg, model), self._engine_settings())
            for w in plan.warnings:
                log.warning("shard %s: %s", sid, w)
            if not msg.api_key and plan.serves_http:
                log.warning(
                    "shard %s: the control plane sent no key for its engine (it predates engine keys), so the "
                    "engine answers anyone who reaches port %s; upgrade the control plane",
                    sid,
                    msg.http_port,
                )
            main = plan.main
            spec = ShardSpec(
                shard_id=sid,
                argv=list(main.argv),
                env=dict(main.env),
                role=Role.LEADER if plan.serves_http else Role.WORKER,
                base_url=f"http://127.0.0.1:{plan.health.port}" if plan.health else None,
                model=plan.health.model if plan.health else None,
                sidecars=[Sidecar(argv=list(c.argv), env=dict(c.env)) for c in plan.commands[:-1]],
                wait_for=f"{main.wait_for[0]}:{main.wait_for[1]}" if main.wait_for else None,
                meta={"start_shard": msg.model_dump(mode="json", exclude_none=True)},
                api_key=msg.api_key,
            )
            await self.supervisor.start(spec)
        except asyncio.CancelledError:
            raise
        except LaunchRefused as exc:
            self._failed(msg, "; ".join(exc.reasons))
        except (_Refused, UnknownEngine, WeightsError, SupervisorError, ValueError, OSError) as exc:
            self._failed(msg, str(exc))
        except Exception as exc:  # the agent keeps running whatever one shard does
            log.exception("starting shard %s failed unexpectedly", sid)
            self._failed(msg, f"internal error: {exc!r}")

    def _status_or_none(self, sid: str) -> SupervisedShard | None:
        assert self.supervisor is not None
        try:
            return self.supervisor.status(sid)
        except UnknownShardError:
            return None

    def _failed(self, msg: StartShard, reason: str) -> None:
        if msg.api_key:  # a validation error may quote the environment it was given
            reason = reason.replace(msg.api_key, "[hidden]")
        log.error("shard %s cannot start: %s", msg.shard_id, reason)
        self.send(ShardStatus(shard_id=msg.shard_id, replica_id=msg.replica_id, state=ShardState.FAILED, reason=reason))

    def _engine_settings(self) -> EngineSettings:
        assert self.installer is not None
        installed = {
            name: str(s.binary)
            for name, s in self.installer.statuses.items()
            if s.state == ProvisionState.READY and s.binary
        }
        return EngineSettings.from_config(self.cfg.engines, installed=installed)

    def _launch_spec(self, msg: StartShard, model: str) -> ShardLaunch:
        inv = self.inventory or NodeInventory()
        p = msg.profile
        gpus = [
            LaunchGPU(index=g.index, name=g.name or f"GPU {g.index}", compute_capability=g.compute_capability)
            for g in inv.gpus or ()
        ]
        domains = {g.fabric.domain for g in inv.gpus or () if g.fabric is not None and g.fabric.domain}
        wanted = set(msg.hcas or ())
        adapters = [
            Adapter(
                name=port.hca,
                port=port.port,
                link_layer="Ethernet" if port.is_roce else "InfiniBand",
                gid_index=port.gid_index,
            )
            for port in inv.ib_ports
            if port.hca in wanted
        ]
        return ShardLaunch(
            shard_id=msg.shard_id,
            engine=msg.engine,
            model=model,
            served_name=msg.model or msg.shard_id,
            port=msg.http_port or 1,
            host=_engine_host(self.identity.mgmt_addr),
            profile=Profile(
                tp=(p.tensor_parallel if p else None) or 1,
                nodes=msg.nnodes or 1,
                gpu_ids=list(msg.gpus or ()),
                ctx_size=p.context_size if p else None,
                parallel=p.parallel if p else None,
                dtype=p.dtype if p else None,
                quantization=p.quantization if p else None,
                extra_args=list(p.args or ()) if p else [],
                env=dict(p.env or {}) if p else {},
            ),
            group=Group(rank=msg.rank or 0, leader_addr=msg.leader_addr, leader_port=msg.leader_port),
            node=NodeFacts(
                gpus=gpus,
                nvlink_domain=next(iter(domains)) if len(domains) == 1 else None,
                fabric_adapters=adapters,
                interface=self.identity.mgmt_interface,
                address=self.identity.mgmt_addr,
            ),
            fabric=msg.fabric,
            api_key=msg.api_key,
        )

    async def _stop(self, msg: StopShard | DrainShard) -> None:
        assert self.supervisor is not None
        sid = msg.shard_id
        starting = self._starting.pop(sid, None)
        if starting is not None:
            starting.cancel()
        if self._status_or_none(sid) is None:
            self._ack(msg, None if starting else f"no shard {sid} runs on this node")
            if starting:
                self.send(ShardStatus(shard_id=sid, state=ShardState.STOPPED, reason=msg.reason or "stopped"))
            return
        try:
            await self.supervisor.stop(sid, timeout=msg.timeout_s)
        except Exception as exc:
            log.exception("stopping shard %s failed", sid)
            self._ack(msg, str(exc))
            return
        self.supervisor.forget(sid)
        self._specs.pop(sid, None)
        self._ack(msg)

    async def _drain(self, msg: DrainShard) -> None:
        """Wait until the engine has nothing running or waiting (or the deadline passes), then stop it."""
        spec = self._specs.get(msg.shard_id)
        deadline = time.monotonic() + (msg.timeout_s if msg.timeout_s is not None else self.cfg.supervisor.stop_timeout)
        if spec is not None and spec.http_port and (spec.rank or 0) == 0:
            names = metric_names(spec.engine)
            wanted = {*names.running, *names.waiting}
            url = f"http://127.0.0.1:{spec.http_port}/metrics"
            # llama-server wants the key for /metrics.
            auth = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else None
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
                while time.monotonic() < deadline:
                    try:
                        async with http.get(url, headers=auth) as r:
                            text = await r.text()
                    except (TimeoutError, aiohttp.ClientError):
                        break  # nothing answers: nothing to wait for
                    values = parse_prometheus(text, wanted)
                    if not values or sum(values.values()) == 0:
                        break
                    await asyncio.sleep(0.5)
            if time.monotonic() >= deadline:
                log.warning("shard %s still had requests when its drain deadline passed; stopping it", msg.shard_id)
        # Drained (or out of time): a short grace is enough for an idle engine.
        await self._stop(StopShard(id=msg.id, shard_id=msg.shard_id, reason=msg.reason or "drained", timeout_s=10.0))

    def _logs(self, msg: LogsRequest) -> LogsReply:
        assert self.supervisor is not None
        n = msg.lines or 200
        sources = ["agent", *(s.shard_id for s in self.supervisor.statuses())]
        source = msg.source or "agent"
        if source == "agent":
            return LogsReply(id=msg.id, source=source, lines=list(_AGENT_LOG)[-n:], sources=sources)
        if source not in sources:
            return LogsReply(
                id=msg.id,
                source=source,
                sources=sources,
                error=f"no log named {source}; this node has: {', '.join(sources)}",
            )
        return LogsReply(id=msg.id, source=source, lines=self.supervisor.tail(source, n), sources=sources)

    async def _fabric_scan(self, msg: FabricScanRequest) -> None:
        try:
            reply = await fabric_tools.fabric_scan(msg, self._diags)
        except Exception as exc:  # answered anyway: the control plane would otherwise wait it out
            log.exception("the fabric scan failed unexpectedly")
            reply = FabricScanReply(id=msg.id, error=f"internal error: {exc!r}")
        self.send(reply)

    def _fabric_test(self, msg: FabricTestRequest) -> None:
        # Refused at once: two tests would share the adapter and each measure half.
        if self._fabric_testing:
            self.send(FabricTestReply(id=msg.id, error="another fabric test is running on this node; one at a time"))
            return
        self._fabric_testing = True
        self._spawn(self._run_fabric_test(msg))

    async def _run_fabric_test(self, msg: FabricTestRequest) -> None:
        try:
            reply = await fabric_tools.fabric_test(msg, self._perftest)
        except Exception as exc:
            log.exception("the fabric test failed unexpectedly")
            reply = FabricTestReply(id=msg.id, error=f"internal error: {exc!r}")
        finally:
            self._fabric_testing = False
        self.send(reply)

    def _remove_weights(self, msg: RemoveWeights) -> None:
        assert self.weights is not None
        errors = []
        for p in msg.paths:
            try:
                self.weights.remove_path(Path(p))
            except WeightsError as exc:
                errors.append(str(exc))
        self._ack(msg, "; ".join(errors) or None)

    # -- reports --------------------------------------------------------------

    def _status_msg(self, st: SupervisedShard) -> ShardStatus:
        spec = self._specs.get(st.shard_id)
        return ShardStatus(
            shard_id=st.shard_id,
            replica_id=spec.replica_id if spec else None,
            state=st.state,
            reason=st.detail or None,
            output_tail=list(st.tail) if st.tail else None,
            pid=st.pid,
        )

    def _shard_changed(self, st: SupervisedShard) -> None:
        self.send(self._status_msg(st))

    def _provision_changed(self, status: InstallRecord) -> None:
        self.send(Heartbeat(node_id=self.identity.node_id, provision=[_provision_msg(status)]))


def _provision_msg(status: InstallRecord) -> ProvisionStatus:
    """The installer's record as the protocol carries it (the binary's path stays here)."""
    return ProvisionStatus.model_validate(status.to_wire())


def _engine_host(mgmt_addr: str | None) -> str:
    """Where engines listen: every interface, so the gateway reaches them by the node's address
    (each requires its replica's key, which only the gateway sends); loopback alone when the node
    reaches its control plane over loopback (one machine, `llmgw up`), where nothing else needs them."""
    try:
        if mgmt_addr and ipaddress.ip_address(mgmt_addr).is_loopback:
            return "127.0.0.1"
    except ValueError:
        pass
    return "0.0.0.0"


class _Refused(LlmgwError):
    pass


_NO_SPEC = StartShard(shard_id="-", engine="-")


def _spec_from_meta(meta: Mapping[str, Any] | None) -> StartShard | None:
    raw = (meta or {}).get("start_shard")
    if not raw:
        return None
    try:
        return StartShard.model_validate(raw)
    except ValueError:
        return None
