"""`llmgw server`: builds the gateway from server.yaml and runs its listeners until told to stop."""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import secrets
import ssl
import time
from collections.abc import Awaitable, Callable, Coroutine
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware
from cryptography import x509

from llmgw import __version__
from llmgw.config.server import EndpointConfig, ServerConfig, resolve_workers
from llmgw.config.types import ListenAddress
from llmgw.files import SecretFileError
from llmgw.gcfreeze import GcFreezer
from llmgw.gguf import check_gguf_url
from llmgw.httpserve import Runner, begin_drain, drain
from llmgw.pki import PKIError, peer_certificate, server_context
from llmgw.server import StartError
from llmgw.server.admin.access import AccessError, AdminAccess, ensure_first_token
from llmgw.server.admin.api import AdminAPI, NoMirror, NotControlPlane, dumps
from llmgw.server.control.agents import AgentService
from llmgw.server.control.capacity import Capacities
from llmgw.server.control.catalog import HF_ENDPOINT, Catalog, check_source, hf_file_url
from llmgw.server.control.fabrics import FabricService
from llmgw.server.control.fleet_metrics import FabricCollector, FleetCollector
from llmgw.server.control.leadership import Leadership, LeadershipCollector, holder_words
from llmgw.server.control.mirror_client import MirrorClient, MirrorUnavailable
from llmgw.server.control.reconciler import Reconciler
from llmgw.server.control.shared_endpoints import SharedEndpoints
from llmgw.server.gateway.auth import KeyCache
from llmgw.server.gateway.checks import BadInput
from llmgw.server.gateway.conversations import Conversations
from llmgw.server.gateway.endpoints import Endpoint, EndpointSet, read_endpoint_key
from llmgw.server.gateway.errors import error_body, error_body_for, error_response, refuse_input, speaks_anthropic
from llmgw.server.gateway.limits import Accountant
from llmgw.server.gateway.proxy import Gateway
from llmgw.server.gateway.shared_limits import SharedLimits, SpendTally, shared_limits_for
from llmgw.server.gateway.usage import JournalError, UsageRecorder, UsageSink
from llmgw.server.gateway.usage_journal import UsageJournal
from llmgw.server.gateway.worker_limits import WorkerAccountant
from llmgw.server.metrics import GatewayMetrics
from llmgw.server.pages.admin_cluster import AdminPages
from llmgw.server.pages.admin_limits import LimitsPages
from llmgw.server.pages.admin_mirror import MirrorPages
from llmgw.server.pages.chat import ChatPage
from llmgw.server.pages.claim import ClaimPage
from llmgw.server.pages.profile import ProfilePage
from llmgw.server.pages.site import Site
from llmgw.server.workers import (
    WorkerError,
    WorkerLink,
    WorkerPool,
    forwarder,
    install_forward_peer,
    journal_path,
    leftover_journals,
)
from llmgw.store import PublishedEndpoint, Store
from llmgw.store.agents import Quota

log = logging.getLogger("llmgw.server")
LISTEN_BACKLOG = 4096  # connections the kernel queues before the server accepts them


def _endpoint_key(model: str, e: EndpointConfig) -> str | None:
    try:
        return read_endpoint_key(e.api_key)
    except SecretFileError as exc:
        raise StartError(f"model {model}, endpoint {e.url}: api_key: {exc}") from None


class Server:
    """Every part of a running gateway, started and stopped in order.

    ``workers``: how many processes serve the client listener (server.yaml's workers, resolved);
    ``slot``: which one this is. Slot 0 is the server process with everything; a worker (slot 1
    and up, llmgw/server/workers.py) serves the client API only, fed by slot 0 through ``link``."""

    def __init__(self, config: ServerConfig, *, workers: int = 1, slot: int = 0) -> None:
        self.config = config
        self.workers = workers
        self.slot = slot
        self.link: WorkerLink | None = None  # a worker's channel to the server process
        self.pool: WorkerPool | None = None  # the server process's workers
        self.forward_port = 0  # where workers forward pages to (loopback), with workers
        self.store: Store | None = None
        self.keys: KeyCache | None = None
        self.usage: UsageRecorder | None = None
        self.shared_limits: SharedLimits | None = None  # limits held across gateways on one store
        self.metrics = GatewayMetrics()
        eps = [
            Endpoint(
                m.name,
                e.url,
                e.engine,
                e.model,
                config.router.breaker.failures,
                config.router.breaker.cooldown,
                api_key=_endpoint_key(m.name, e),
            )
            for m in config.models
            for e in m.endpoints
            if slot == 0  # a worker serves the server process's endpoints, as it sends them
        ]
        self.endpoints = EndpointSet(
            eps, config.router.scrape_interval, config.router.metrics_stale_after, config.timeouts.connect
        )
        self.endpoints.workers = workers
        # Engines run outside llmgw, by (model, url): those of models added at run time come and go.
        self._static = {(ep.model, ep.url): ep for ep in eps}
        self.gateway: Gateway | None = None
        self.conversations: Conversations | None = None
        self.agents: AgentService | None = None
        self.fabrics: FabricService | None = None
        self.catalog: Catalog | None = None
        self.reconciler: Reconciler | None = None
        self.capacity: Capacities | None = None  # measured capacity (ctl bench --save), on a control plane
        self.leadership: Leadership | None = None
        self.shared: SharedEndpoints | None = None
        self._leading_lock = asyncio.Lock()
        self.mirror: MirrorClient | None = None
        self._runners: list[web.AppRunner] = []
        self.started_at = time.time()
        self.admin_token_file: Path | None = None
        # Each listener's application by its server.yaml key, so every route can be listed with its guard.
        self.apps: dict[str, web.Application] = {}

    async def start(self) -> None:
        cfg = self.config
        try:
            self.store = await Store.open(cfg.auth.store)
        except Exception as exc:
            raise StartError(f"auth.store: {exc}") from exc
        try:
            if self.slot == 0:
                self.admin_token_file = await ensure_first_token(self.store, cfg)
        except AccessError as exc:
            await self.store.close()
            self.store = None
            raise StartError(str(exc)) from None
        # Limits held across gateways on this store: its tally counts the usage rows written.
        # The server process holds them for its workers too, whose accountant is its own.
        if self.slot == 0:
            self.shared_limits = shared_limits_for(cfg.auth, self.store, self.metrics.registry)
        # Before anything serves or reads usage: rows an earlier run could not write, so the
        # budgets restored below count them.
        self.usage = UsageRecorder(
            self._usage_sink(),
            cfg.usage.flush_interval,
            cfg.usage.batch_size,
            cfg.usage.queue_limit,
            journal=UsageJournal(journal_path(cfg.data_path, self.slot)),
            final_flush=cfg.usage.final_flush,
        )
        try:
            await self.usage.replay_journal()
            if self.slot == 0:
                await self._replay_leftover_journals()
        except JournalError as exc:
            await self.store.close()
            self.store = None
            raise StartError(str(exc)) from None
        self.keys = KeyCache(self.store, default_rpm=cfg.auth.default_rpm, default_tpm=cfg.auth.default_tpm)
        await self.keys.load()
        if cfg.mirror is not None:
            try:
                self.mirror = MirrorClient(cfg.mirror)
            except MirrorUnavailable as exc:
                raise StartError(str(exc)) from None
        if cfg.control.enabled and self.slot == 0:
            self.catalog = Catalog(cfg.models, self.store)
            await self.catalog.load()
            for problem in self.catalog.problems:
                log.warning("catalog: %s", problem)
        self.metrics.watch(self.endpoints, self.usage)
        self.gateway = Gateway(cfg, self.keys, self.endpoints, self.usage, self.metrics)
        self.conversations = Conversations(
            self.store, self.keys, cfg.threads, cfg.auth.enabled, Quota(cfg.agents.quota_items, cfg.agents.quota_bytes)
        )
        self.gateway.agents.keep(self.conversations)
        if self.gateway.accountant is not None and self.link is not None:
            # A worker asks the server process's accountant (gateway/worker_limits.py).
            self.gateway.accountant = await WorkerAccountant.connect(
                self.gateway.accountant.pricing, self.link.limits_sock
            )
        elif (acc := self.local_accountant) is not None:
            if self.shared_limits is not None:
                await self.shared_limits.read_baseline()  # before the usage rows that hold it
            await self._restore_budgets(acc)
            if self.shared_limits is not None:
                await self.shared_limits.start(acc)
        if self.catalog is not None:
            self.models_changed()
        if self.link is not None:
            # What to serve, from the server process, before the first probe and the first request.
            self.gateway.demand = self.link.demand
            await self.link.first_state()
        await self.gateway.start()
        await self.endpoints.start()
        self.keys.start()
        self.usage.start()
        self.conversations.start()
        if self.slot > 0:
            try:
                await self._listen(cfg.listen, "listen", self._worker_app(), reuse_port=True)
            except StartError:
                await self.stop()
                raise
            log.info("worker %d of %d serving %s", self.slot, self.workers, cfg.listen)
            return
        try:
            runner = await self._listen(cfg.listen, "listen", self._client_app(), reuse_port=self.workers > 1)
            if self.workers > 1:
                # Workers forward pages here; loopback, on a port the kernel picks.
                forward = web.TCPSite(runner, "127.0.0.1", 0)
                await forward.start()
                self.forward_port = forward._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            await self._listen(cfg.admin_listen, "admin_listen", self._admin_app(), self._admin_tls())
            if cfg.metrics_listen is not None:
                await self._listen(cfg.metrics_listen, "metrics_listen", self._metrics_app())
            if cfg.control.enabled:
                agent_app = self._agent_app()
                assert self.agents is not None and self.catalog is not None
                self.reconciler = Reconciler(cfg, self.catalog, self.agents, self.endpoints, self.store)
                rec = self.reconciler
                assert self.fabrics is not None
                rec.fabric_facts = self.fabrics.facts
                # Measured capacity (ctl bench --save): read now, again every 30 s and on each save,
                # and given to the replicas' endpoints for admission and routing (control/capacity.py).
                self.capacity = rec.capacity = Capacities(self.store, self.catalog)
                self.capacity.replicas = lambda: rec.replicas.values()
                await self.capacity.start()
                assert self.leadership is not None
                await self.leadership.start()
                if self.leadership.is_leader():
                    await self._lead(True, catalog_read=True)  # read a moment ago, above
                self.leadership.on_change(self._lead)
                self.metrics.watch_fleet(LeadershipCollector(self.leadership))
                if self.leadership.enabled:
                    self.shared = SharedEndpoints(
                        self.store,
                        self.leadership,
                        self.endpoints,
                        lambda: [
                            PublishedEndpoint(r.id, r.model, r.endpoint.url, r.engine, r.api_key)
                            for r in rec.replicas.values()
                            if r.endpoint is not None
                        ],
                        settle=rec.settle,
                        breaker=(cfg.router.breaker.failures, cfg.router.breaker.cooldown),
                        follow_catalog=self._follow_catalog,
                    )
                    await self.shared.start()
                self.metrics.watch_fleet(
                    FleetCollector(self.agents, lambda: list(rec.replicas.values()), lambda: dict(rec.marks))
                )
                self.metrics.watch_fleet(FabricCollector(self.fabrics.metrics))
                await self._listen(cfg.agent_listen, "agent_listen", agent_app, self._agent_tls())
        except StartError:
            await self.stop()
            raise
        if not cfg.auth.enabled:
            log.warning("auth.enabled is false: anyone who reaches %s can use every model", cfg.listen)
        log.info(
            "llmgw %s serving %d model(s) on %s (admin %s%s); %d API key(s) loaded",
            __version__,
            len(cfg.models),
            cfg.listen,
            cfg.admin_listen,
            f", metrics {cfg.metrics_listen}" if cfg.metrics_listen else "",
            len(self.keys),
        )

    async def stop(self) -> None:
        # Listeners first (running requests get timeouts.drain to finish), then the
        # background work, then one last usage flush (usage.final_flush; what the store
        # does not take by then goes to the journal), then the store. Every listener drains
        # at once, and from the first moment its responses say `Connection: close`, so no
        # client reuses a connection that is about to go.
        begin_drain(self._runners)
        if self.reconciler is not None:
            # Engines keep running: a control plane that stops leaves its fleet serving,
            # and adopts it again when it comes back.
            await self.reconciler.stop()
        if self.capacity is not None:
            await self.capacity.stop()
        if self.shared is not None:
            await self.shared.stop()
        if self.leadership is not None:
            # Released now, so a standby takes over within a third of the TTL, not the whole of it.
            await self.leadership.stop()
        await drain(self._runners)
        self._runners = []
        await self.endpoints.stop()
        if self.keys is not None:
            await self.keys.stop()
        if self.gateway is not None:
            await self.gateway.stop()
        if self.usage is not None:
            await self.usage.stop()
        if self.gateway is not None and isinstance(self.gateway.accountant, WorkerAccountant):
            await self.gateway.accountant.aclose()  # the last settlements reach the server process
        if self.conversations is not None:
            # The turns whose replies were sent, written before the store closes.
            await self.conversations.stop()
        if self.shared_limits is not None:
            await self.shared_limits.stop()
            self.shared_limits = None
        if self.store is not None:
            await self.store.close()
            self.store = None

    async def _restore_budgets(self, accountant: Accountant) -> None:
        """Budgets survive a restart: this month's and today's spend, folded back into every pool."""
        assert self.store is not None
        now = datetime.now(UTC)
        today = now.replace(hour=0, minute=0, second=0, microsecond=0)
        month = today.replace(day=1)
        rows: list[tuple[str | None, str | None, str | None, str | None, str | None, int, datetime]] = []
        # Two reads, so daily budgets see only today while monthly ones see the whole month.
        for since, until, at in ((month, today, month), (today, None, now)):
            if since == until:
                continue
            rows.extend(
                (r.key_id, r.user_id, r.project_id, r.team_id, r.org_id, r.cost_micros, at)
                for r in await self.store.usage_cost_since(since, until)
            )
        accountant.restore(rows)
        if rows:
            log.info("budgets restored from %d usage total(s) of this month", len(rows))

    async def source_check(self, source: str) -> str | None:
        """Why a model's source cannot be served, or None; hf: sources are looked up in
        mirror.registry when one is set."""
        return await check_source(source, hf_endpoint=self._hf_endpoint())

    def model_check(self, profiles: list) -> Callable[[str], Awaitable[str | None]]:
        """The source check for a model being added: the source must exist, and a GGUF
        that a llama.cpp profile would load must be one the pinned llama.cpp can load."""
        llamacpp = any(isinstance(p, dict) and p.get("engine") == "llamacpp" for p in profiles or ())

        async def check(source: str) -> str | None:
            problem = await self.source_check(source)
            if problem is not None or not llamacpp:
                return problem
            url = hf_file_url(source, self._hf_endpoint()) if source.startswith("hf:") else source
            if url.startswith(("http://", "https://")) and not url.endswith("/") and ".gguf" in url.lower():
                return await check_gguf_url(url)
            return None

        return check

    def _hf_endpoint(self) -> str:
        m = self.config.mirror
        return m.registry if m is not None and m.registry else HF_ENDPOINT

    def models_changed(self) -> None:
        """The catalog changed: the gateway serves its models, the reconciler acts at once."""
        if self.catalog is None or self.gateway is None:
            return
        models = [e.model for e in self.catalog.models()]
        self.gateway.set_models(models)
        b = self.config.router.breaker
        wanted = {(m.name, e.url): e for m in models for e in m.endpoints}
        for key in [k for k in self._static if k not in wanted]:
            self.endpoints.remove(self._static.pop(key))
        for (name, url), e in wanted.items():
            try:
                engine_key = _endpoint_key(name, e)
            except StartError as exc:
                # The rest of the catalog still serves; this engine would refuse every request.
                log.error("%s; it is not served until the file can be read and the catalog changes", exc)
                continue
            if (name, url) in self._static:
                self._static[(name, url)].api_key = engine_key  # a key file rewritten since is taken up
            else:
                ep = Endpoint(name, url, e.engine, e.model, b.failures, b.cooldown, api_key=engine_key)
                self._static[(name, url)] = ep
                self.endpoints.add(ep)
        if self.reconciler is not None:
            self.reconciler.wake()
        if self.pool is not None:
            self.pool.changed()

    @property
    def local_accountant(self) -> Accountant | None:
        """The accountant this process keeps (the server process's, which its workers ask)."""
        acc = self.gateway.accountant if self.gateway is not None else None
        return acc if isinstance(acc, Accountant) else None

    def _usage_sink(self) -> UsageSink:
        """Where usage rows go: with limits shared with other gateways, through a tally of their
        spend, which a worker writes under its server's name (workers.py) so that the server's
        own reads of the others' spend skip it: its accountant counted that spend already."""
        assert self.store is not None
        if self.shared_limits is not None:
            return self.shared_limits.tally
        if self.link is not None and self.link.spender is not None:
            return SpendTally(self.store, f"{self.link.spender}/{secrets.token_hex(4)}")
        return self.store

    async def _replay_leftover_journals(self) -> None:
        """Usage journals of worker slots this run does not have (workers was larger): written now."""
        assert self.usage is not None
        cfg = self.config
        for path in leftover_journals(cfg.data_path, self.workers):
            sink = self.shared_limits.tally if self.shared_limits is not None else self.store
            assert sink is not None
            rec = UsageRecorder(sink, cfg.usage.flush_interval, cfg.usage.batch_size, journal=UsageJournal(path))
            await rec.replay_journal()

    async def _listen(
        self,
        addr: ListenAddress,
        key: str,
        app: web.Application,
        ssl_context: ssl.SSLContext | None = None,
        *,
        reuse_port: bool = False,
    ) -> web.AppRunner:
        # The client listener serves OpenAI's API and Anthropic's: a failure is answered in the
        # shape of the one the request was made to.
        runner = Runner(
            app,
            error_body,
            error_body_for if key == "listen" else None,
            handler_cancellation=True,
            shutdown_timeout=self.config.timeouts.drain,
        )
        await runner.setup()
        self._runners.append(runner)
        site = web.TCPSite(
            runner,
            addr.bind_host,
            addr.port,
            reuse_address=True,
            reuse_port=reuse_port or None,
            ssl_context=ssl_context,
            # A control-plane restart has every agent dialling at once (and clients, a burst of
            # connections): at the default 128 the kernel drops SYNs and each dropped dial waits
            # out TCP's 1 s retry. The kernel caps this at net.core.somaxconn.
            backlog=LISTEN_BACKLOG,
        )
        try:
            await site.start()
            return runner
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise StartError(
                    f"{key} {addr}: the address is already in use by another process; "
                    f"stop it or change {key} in server.yaml"
                ) from None
            if exc.errno in (errno.EACCES, errno.EPERM):
                raise StartError(
                    f"{key} {addr}: permission denied; ports below 1024 need root, choose another"
                ) from None
            raise StartError(f"{key} {addr}: cannot listen: {exc.strerror or exc}") from None

    # -- applications -------------------------------------------------------

    def _worker_app(self) -> web.Application:
        """A worker's client listener: the API served here, everything else (pages, /ready)
        answered by the server process."""
        assert self.gateway is not None and self.link is not None
        app = web.Application(
            client_max_size=self.config.router.max_body_bytes, middlewares=[_server_timing, _json_errors]
        )
        self.gateway.add_routes(app)
        app.router.add_get("/health", self._health)
        forward = forwarder(self.link)
        app.on_cleanup.append(forward.close)  # type: ignore[attr-defined]
        app.router.add_route("*", "/{tail:.*}", forward)
        self.apps["listen"] = app
        return app

    def _client_app(self) -> web.Application:
        assert self.gateway is not None
        # aiohttp refuses larger bodies itself too; the gateway answers in OpenAI's shape first.
        app = web.Application(
            client_max_size=self.config.router.max_body_bytes, middlewares=[_server_timing, _json_errors]
        )
        self.gateway.add_routes(app)
        assert self.store is not None
        ClaimPage(self.store).add_routes(app)
        self.site = Site(self.store, self.config)
        ChatPage(self.site, self.gateway).add_routes()
        AdminPages(self.site, self).add_routes()
        LimitsPages(self.site, self).add_routes()
        ProfilePage(self.site, self.gateway).add_routes()
        MirrorPages(self.site, self).add_routes()
        self.site.add_routes(app)
        app.router.add_get("/health", self._health)
        app.router.add_get("/ready", self._ready)
        if self.workers > 1:
            install_forward_peer(app, lambda: self.pool.secret if self.pool is not None else None)
        self.apps["listen"] = app
        return app

    def _admin_app(self) -> web.Application:
        assert self.store is not None
        # The guard comes first: without a credential not even an unknown path is told apart.
        app = web.Application(
            middlewares=[AdminAccess(self.store, self.config).guard.middleware(), _standby_writes(self), _json_errors]
        )
        app.router.add_get("/health", self._health)
        app.router.add_get("/ready", self._ready)
        app.router.add_get("/metrics", self._metrics)
        AdminAPI(self).add_routes(app)
        self.apps["admin_listen"] = app
        return app

    def _admin_tls(self) -> ssl.SSLContext | None:
        tls = self.config.admin_tls
        if tls is None:
            return None
        try:
            return server_context(tls.ca, tls.cert, tls.key, require_client=False)
        except PKIError as exc:
            raise StartError(
                f"admin_tls: {exc} (create them with `llmgw ctl cert init-ca` and "
                "`llmgw ctl cert issue-server NAME...`)"
            ) from None

    def _agent_tls(self) -> ssl.SSLContext | None:
        tls = self.config.agent_tls
        if tls is None:
            log.warning(
                "agent_tls is null: agents connect in plaintext on %s; for one trusted machine only",
                self.config.agent_listen,
            )
            return None
        try:
            return server_context(tls.ca, tls.cert, tls.key)
        except PKIError as exc:
            raise StartError(
                f"agent_tls: {exc} (create them with `llmgw ctl cert init-ca` and "
                "`llmgw ctl cert issue-server NAME...`)"
            ) from None

    def _agent_app(self) -> web.Application:
        c = self.config.control
        mtls = self.config.agent_tls is not None
        self.leadership = Leadership(self.store, c.lease_ttl, holder_words(self.config.admin_listen))
        self.agents = AgentService(
            leadership=self.leadership if self.leadership.enabled else None,
            identity=_client_certificate if mtls else None,
            require_identity=mtls,
            require_node_mark=self.config.agent_tls is not None and self.config.agent_tls.require_node_mark,
            unreachable_after=c.unreachable_after,
            lost_after=c.lost_after,
            heartbeat_rate=c.heartbeat_rate,
            freezer=GcFreezer(),
        )
        fabrics = self.fabrics = FabricService(self.agents, scan_interval=c.fabric_scan_interval)
        app = web.Application()
        self.agents.add_routes(app)
        app.on_startup.append(lambda _app: fabrics.start())
        app.on_shutdown.append(lambda _app: fabrics.close())
        self.apps["agent_listen"] = app
        return app

    def _metrics_app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        self.apps["metrics_listen"] = app
        return app

    async def _lead(self, leading: bool, *, catalog_read: bool = False) -> None:
        """Start or stop acting as the leader: placing, on-demand loading, agents' streams."""
        assert self.reconciler is not None and self.gateway is not None and self.agents is not None
        async with self._leading_lock:
            if leading:
                if not catalog_read and self.leadership is not None and self.leadership.enabled:
                    await self._follow_catalog()  # as the previous leader left it
                self.gateway.demand = self.reconciler
                await self.reconciler.start()
            else:
                # A standby loads nothing on demand: only the leader places replicas.
                self.gateway.demand = None
                await self.reconciler.stop()
                # What it ran is the new leader's now: served from the list the leader publishes.
                self.reconciler.forget()
                await self.agents.check()  # closes the agents' streams so they move to the leader

    async def _follow_catalog(self) -> None:
        """Read the catalog again (another control plane may have changed it); the gateway and
        the reconciler hear of it only when a model changed."""
        assert self.catalog is not None
        before = [e.model.model_dump_json() for e in self.catalog.models()]
        try:
            await self.catalog.load()
        except Exception as exc:  # the store away: the catalog stays as it was
            log.warning("could not read the catalog from the store: %s", exc)
            return
        if [e.model.model_dump_json() for e in self.catalog.models()] != before:
            self.models_changed()

    def standby_reason(self) -> str | None:
        """Why this process takes no control-plane work, or None when it leads (or is no control plane)."""
        lead = self.leadership
        if lead is None or lead.is_leader():
            return None
        who = lead.leader_holder
        return "this control plane is a standby; " + (f"{who} leads" if who else "no control plane leads right now")

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "version": __version__}, dumps=dumps)

    async def _ready(self, request: web.Request) -> web.Response:
        standby = self.standby_reason()
        if standby is not None:
            # A load balancer or keepalived sends clients to the leader (deploy/ha/).
            return web.json_response({"status": "standby", "reason": standby}, status=503, dumps=dumps)
        if self.endpoints.any_ready():
            return web.json_response({"status": "ready"}, dumps=dumps)
        return web.json_response(
            {"status": "not ready", "reason": "no endpoint of any model passes its health check"},
            status=503,
            dumps=dumps,
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
        )


def _client_certificate(request: web.Request) -> x509.Certificate | None:
    """The client certificate the TLS handshake verified."""
    return peer_certificate(request.transport.get_extra_info("ssl_object") if request.transport else None)


@web.middleware
async def _server_timing(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Every client response says how long the gateway itself took; the proxy sets a
    finer value (its own time apart from the engine's) on the responses it forwards."""
    t0 = time.perf_counter()
    resp = await handler(request)
    if not resp.prepared and "Server-Timing" not in resp.headers:
        resp.headers["Server-Timing"] = f"gateway;dur={(time.perf_counter() - t0) * 1000:.3f}"
    return resp


def _standby_writes(server: Server) -> Middleware:
    """A standby changes nothing through the admin API: the leader's copy of the fleet and the
    catalog is the one that acts, so a write here would be lost or fought over."""

    @web.middleware
    async def refuse(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if request.method not in ("GET", "HEAD", "OPTIONS"):
            standby = server.standby_reason()
            if standby is not None:
                return error_response(503, f"{standby}: send changes to its admin API", "standby")
        return await handler(request)

    return refuse


@web.middleware
async def _json_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """aiohttp's own refusals (unknown path, wrong method) and input no route can take (checks.py),
    in the JSON shape of the API the request was made to."""
    try:
        return await handler(request)
    except BadInput as exc:
        return refuse_input(request, exc, anthropic=speaks_anthropic(request))
    except NoMirror:
        return error_response(404, "this control plane has no mirror; set mirror.api in server.yaml", "no_mirror")
    except NotControlPlane:
        return error_response(
            404, "this server is not a control plane; set control.enabled: true in server.yaml", "not_a_control_plane"
        )
    except web.HTTPMethodNotAllowed as exc:
        return error_response(
            405,
            f"{request.method} is not allowed on {request.path}; use {', '.join(sorted(exc.allowed_methods))}",
            "method_not_allowed",
            anthropic=speaks_anthropic(request),
        )
    except web.HTTPNotFound:
        return error_response(
            404, f"there is nothing at {request.path}", "not_found", anthropic=speaks_anthropic(request)
        )
    except web.HTTPRequestEntityTooLarge as exc:
        return error_response(
            413,
            exc.text or "the request body is too large",
            "request_too_large",
            anthropic=speaks_anthropic(request),
        )


async def serve_until_stopped(
    config: ServerConfig, stop: asyncio.Event, on_started: Callable[[Server], Coroutine[Any, Any, None]] | None = None
) -> None:
    """Run until ``stop`` is set (llmgw.runtime sets it on SIGTERM or SIGINT), then drain and stop;
    with workers (server.yaml), their processes alongside (server/workers.py)."""
    workers = resolve_workers(config.workers)
    server = Server(config, workers=workers)
    await server.start()
    if workers > 1:
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()
        server.pool = WorkerPool(server, workers, ["server", "--log-level", level])
        server.metrics.merged = server.pool.collector(server.metrics.registry)
        try:
            await server.pool.start()
        except WorkerError as exc:
            await asyncio.gather(server.pool.stop(5.0), server.stop())
            raise StartError(str(exc)) from None
    # What exists now (imported modules, configuration) lives as long as the process:
    # moving it out of the collector's sight stops full collections from walking it,
    # which were 50-70 ms pauses every second under load.
    gc.collect()
    gc.freeze()
    try:
        if on_started is not None:
            # A long on_started (watching an install) must not hold off Ctrl-C.
            started = asyncio.create_task(on_started(server))
            stopping = asyncio.create_task(stop.wait())
            await asyncio.wait({started, stopping}, return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            if not started.done():
                started.cancel()
                await asyncio.gather(started, return_exceptions=True)
            else:
                started.result()
        await stop.wait()
        log.info("stopping: finishing running requests (up to %gs)", config.timeouts.drain)
    finally:
        if server.pool is not None:
            # Each worker drains and writes its usage as this process does, at the same time.
            t = config.timeouts.drain + config.usage.final_flush + 10.0
            await asyncio.gather(server.pool.stop(t), server.stop())
        else:
            await server.stop()
