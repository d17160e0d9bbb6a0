"""The control plane's fabrics: which physical fabric each port is on, each
InfiniBand fabric's map, rail-by-rail bandwidth tests, and NVLink racks.

This is where the pure parts meet the fleet. ``fabric_identity`` groups ports
into physical fabrics from what agents send; ``fabric_map`` reads what
`ibnetdiscover` prints; ``protocol.fabric_test`` grades a rail; ``nvlink``
draws racks. This service feeds the first from every registration and
heartbeat (``AgentService.on_report``), asks one node per InfiniBand fabric
for a scan every ``scan_interval`` (cluster.md §1.9), runs `ctl fabric-test`
(§6.2) over the agents' streams, and answers the admin API, the pages,
placement (``facts``) and the metrics.

Only the leader holds agents' streams, so a standby has no nodes here and
scans nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from llmgw.errors import LlmgwError
from llmgw.protocol import (
    FEATURE_FABRIC_SCAN,
    FEATURE_FABRIC_TEST,
    HCA,
    FabricScanReply,
    FabricScanRequest,
    FabricTestReply,
    FabricTestRequest,
    IBPort,
)
from llmgw.protocol.admin import (
    FabricMapSummary,
    FabricMemberRow,
    FabricProblemRow,
    FabricRow,
    FabricsReply,
    FabricTestView,
    MasterChangeRow,
    SubnetManagerRow,
)
from llmgw.protocol.doctor import SubnetManagers
from llmgw.protocol.fabric_test import Grade, RailResult, grade
from llmgw.server.control import fabric_map, nvlink
from llmgw.server.control.agents import AgentService, AgentServiceError, Node
from llmgw.server.control.fabric_identity import (
    INFINIBAND,
    FabricRegistry,
    NodeFabricReport,
    PhysicalFabric,
    Problem,
    SubnetManager,
)
from llmgw.server.control.placement import NodeFabricFacts

log = logging.getLogger("llmgw.server.control.fabrics")

SCAN_INTERVAL_S = 300.0  # the spec's five minutes
# The agent gives ibnetdiscover two minutes; the answer gets a little longer to travel.
SCAN_TIMEOUT_S = 150.0
# An unchanged report is still given to the registry this often, so what it
# remembers of a quiet fabric (its master, its SMs seen together) stays within
# the registry's day of history. Not more often: each update reads every node.
REPORT_REFRESH_S = 600.0
# Reports are given to the registry as they come, but its fabrics (a walk over every
# node) are derived at most this often: a fleet registering at once costs a derivation
# per second, not one per node. Reads derive at once, so they never see this delay.
SETTLE_SPACING_S = 1.0

DEFAULT_TEST_SECONDS = 3
MAX_TEST_SECONDS = 30
# perftest's out-of-band TCP port; each rail takes the next one, so a server
# still closing from the last rail never answers the next rail's client.
TEST_TCP_PORT = 18515
# Beyond the run itself: perftest's handshake, the client's ten retries a
# second apart, the agent installing perftest on first use.
TEST_MARGIN_S = 120.0


class FabricTestRefused(LlmgwError):
    """A fabric test that cannot run as asked: the message says why and what to ask instead."""

    def __init__(self, message: str, status: int = 409) -> None:
        super().__init__(message)
        self.status = status


class UnknownFabric(LlmgwError):
    """A fabric id that names no fabric the control plane knows."""


@dataclass(frozen=True)
class FabricScan:
    """The last map of one InfiniBand fabric, and the last scan's failure if it failed since."""

    fabric_id: str
    fmap: fabric_map.FabricMap | None = None
    scanned_at: float | None = None  # wall clock of the map
    node: str | None = None
    hca: str | None = None
    error: str | None = None
    error_at: float | None = None


def node_adapters(node: Node) -> list[HCA]:
    """The node's adapters as registered, with each port as its latest heartbeat read it."""
    fresh = {(p.hca, p.port): p for p in node.ib_ports or ()}
    out = []
    for h in (node.inventory.adapters if node.inventory else None) or ():
        ports = [fresh.get((p.hca, p.port), p) for p in h.ports or ()]
        out.append(h.model_copy(update={"ports": ports}))
    return out


def report_of(node: Node) -> NodeFabricReport:
    """What the registry is given for ``node``: its ports, SM reads and declared fabrics."""
    declared = node.declared_fabrics if node.declared_fabrics is not None else node.fabrics
    names = {f.fabric: tuple(f.hcas or ()) for f in declared or ()}
    error = node.subnet_managers_error
    sms = node.subnet_managers
    return NodeFabricReport(
        node=node.node_id,
        hcas=node_adapters(node),
        subnet_managers=sms,
        declared=names,
        # An error with no read behind it means the check could not run at all.
        checked=not (error and sms is None),
        error=error,
    )


class FabricService:
    def __init__(
        self,
        agents: AgentService,
        *,
        scan_interval: float = SCAN_INTERVAL_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.agents = agents
        self.scan_interval = scan_interval
        self.clock = clock
        self.registry = FabricRegistry()
        self._last_report: dict[str, tuple[tuple, float]] = {}
        self._sms_seen: dict[str, tuple[SubnetManagers | None, str | None]] = {}  # node -> (last read, its text)
        self._known_ib: set[str] = set()
        self._scans: dict[str, FabricScan] = {}
        self._scanning: set[str] = set()
        self._testing: set[str] = set()  # nodes in a fabric test now
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self._settle_handle: asyncio.Handle | None = None
        self._settled_at = float("-inf")  # the event loop's clock
        agents.on_report(self.report)

    # -- feeding the registry ---------------------------------------------------

    def report(self, node: Node) -> None:
        """A node registered or sent a heartbeat: give the registry what changed.

        Called on every heartbeat of every node, so what is compared is read off the
        record directly (ports' states and rates, not their counters; the SM read's
        text only when a new read came), and the registry, whose derivation reads every
        node, is given a report only when it changed, and derives at most once per
        SETTLE_SPACING_S for all the reports given since."""
        nid = node.node_id
        key = self._key(node)
        if key is None:
            return  # no adapter, never had one: nothing to say about fabrics
        now = self.clock()
        last = self._last_report.get(nid)
        if last is not None and last[0] == key and now - last[1] < REPORT_REFRESH_S:
            return
        self.registry.ingest(report_of(node), now)
        self._last_report[nid] = (key, now)
        self._settle_soon()

    def _settle_soon(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._settle()  # called outside the event loop: nothing would run it later
            return
        if self._settle_handle is None:
            wait = self._settled_at + SETTLE_SPACING_S - loop.time()
            self._settle_handle = loop.call_later(max(wait, 0.0), self._settle)

    def _settle(self) -> None:
        self._settle_handle = None
        try:
            self._settled_at = asyncio.get_running_loop().time()
        except RuntimeError:
            pass
        ib = {f.id for f in self.registry.fabrics() if f.kind == INFINIBAND}
        if ib - self._known_ib:
            self._wake.set()  # a fabric seen for the first time is mapped now, not in five minutes
        self._known_ib = ib

    def _key(self, node: Node) -> tuple | None:
        inv = node.inventory
        ports = node.ib_ports if node.ib_ports is not None else (inv.ib_ports if inv else [])
        if not ports and node.node_id not in self._last_report:
            return None
        sms = node.subnet_managers
        seen = self._sms_seen.get(node.node_id)
        if seen is None or seen[0] is not sms:  # a new read (about once a minute)
            seen = self._sms_seen[node.node_id] = (sms, sms.model_dump_json() if sms is not None else None)
        declared = node.declared_fabrics if node.declared_fabrics is not None else node.fabrics
        return (
            tuple((p.hca, p.port, p.state, p.link_layer, p.network, p.rate_gbps) for p in ports),
            seen[1],
            tuple((f.fabric, tuple(f.hcas or ())) for f in declared or ()),
            node.subnet_managers_error,
        )

    def _forget_removed(self) -> None:
        for nid in [n for n in self._last_report if self.agents.get(n) is None]:
            self.registry.remove(nid)
            del self._last_report[nid]
            self._sms_seen.pop(nid, None)

    # -- reading ----------------------------------------------------------------

    def fabrics(self) -> list[PhysicalFabric]:
        self._forget_removed()
        return self.registry.fabrics(self.clock())

    def problems(self) -> list[Problem]:
        self._forget_removed()
        return self.registry.problems(self.clock())

    def fabric(self, fabric_id: str) -> PhysicalFabric:
        fabrics = self.fabrics()
        for f in fabrics:
            if f.id == fabric_id:
                return f
        known = ", ".join(f.id for f in fabrics) or "none yet"
        raise UnknownFabric(f"no fabric {fabric_id!r} is known (known: {known}); GET /api/v1/fabrics lists them")

    def scan_of(self, fabric_id: str) -> FabricScan | None:
        return self._scans.get(fabric_id)

    def metrics(self) -> list[tuple[str, dict[str, str], float]]:
        self._forget_removed()
        return self.registry.metrics(self.clock())

    def reply(self) -> FabricsReply:
        """GET /api/v1/fabrics."""
        return FabricsReply(
            fabrics=[self._row(f) for f in self.fabrics()],
            problems=problem_rows(self.problems()),
        )

    def _row(self, f: PhysicalFabric) -> FabricRow:
        scan = self._scans.get(f.id)
        summary = None
        if f.kind == INFINIBAND:
            summary = FabricMapSummary()
            if scan is not None:
                summary = FabricMapSummary(
                    scanned_at=scan.scanned_at, node=scan.node, hca=scan.hca, error=scan.error, error_at=scan.error_at
                )
                if scan.fmap is not None:
                    t = scan.fmap.topology
                    summary = summary.model_copy(
                        update={
                            "switches": len(t.switches),
                            "adapters": len(t.adapters),
                            "cables": len(t.cables),
                            "degraded": len(scan.fmap.degraded),
                            "rails_aligned": scan.fmap.rail_aligned,
                        }
                    )
        return FabricRow(
            id=f.id,
            kind=f.kind,
            declared=list(f.declared),
            network=f.network,
            master=_sm_row(f.master) if f.master else None,
            managers=[_sm_row(m) for m in f.managers],
            managers_listed=f.managers_listed,
            members=[
                FabricMemberRow(node=m.node, hca=m.hca, port=m.port, rate_gbps=m.rate_gbps, master_guid=m.master_guid)
                for m in f.members
            ],
            master_changes=[
                MasterChangeRow(at=c.at, old_guid=c.old_guid, new_guid=c.new_guid) for c in f.master_changes
            ],
            map=summary,
        )

    def topology(self, fabric_id: str) -> dict[str, Any]:
        """GET /api/v1/fabrics/{id}/topology: the last map, with which node it belongs to."""
        f = self.fabric(fabric_id)
        scan = self._scans.get(f.id)
        body: dict[str, Any] = {
            "fabric": f.id,
            "scanned_at": scan.scanned_at if scan else None,
            "node": scan.node if scan else None,
            "hca": scan.hca if scan else None,
            "error": scan.error if scan else None,
            "error_at": scan.error_at if scan else None,
            "map": None,
        }
        if scan is not None and scan.fmap is not None:
            body["map"] = fabric_map.to_json(scan.fmap)
            body["llmgw_nodes"] = self._map_nodes(f, scan.fmap)
        return body

    def _map_nodes(self, f: PhysicalFabric, fmap: fabric_map.FabricMap) -> dict[str, str]:
        """Map adapter GUID -> llmgw node id, by the adapters' node GUIDs (a host's
        name in the node description may differ from its llmgw name)."""
        members = {m.node for m in f.members}
        out: dict[str, str] = {}
        by_guid = {}
        for nid in members:
            node = self.agents.get(nid)
            for h in (node.inventory.adapters if node and node.inventory else None) or ():
                if h.node_guid:
                    by_guid[h.node_guid.lower()] = nid
        for a in fmap.topology.adapters:
            if a.guid in by_guid:
                out[a.guid] = by_guid[a.guid]
        return out

    def facts(self) -> dict[str, NodeFabricFacts]:
        """Per node, what placement weighs beyond agent.yaml's names: the physical
        fabric under each declared name, each adapter's leaf switches, degraded cables."""
        fabrics = self.fabrics()
        physical: dict[str, dict[str, set[str]]] = {}
        for f in fabrics:
            for m in f.members:
                node = self.agents.get(m.node)
                for decl in (node.fabrics if node else None) or ():
                    if m.hca in (decl.hcas or ()):
                        physical.setdefault(m.node, {}).setdefault(decl.fabric, set()).add(f.id)
        leaves: dict[str, dict[str, tuple[str, ...]]] = {}
        degraded: dict[str, dict[str, str]] = {}
        for scan in self._scans.values():
            if scan.fmap is None:
                continue
            fmap = scan.fmap
            by_guid = {a.guid: a for a in fmap.topology.adapters}
            bad = {d.cable.a.guid: d.reason for d in fmap.degraded if d.cable.a.guid in by_guid}
            for node in self.agents.nodes():
                for h in (node.inventory.adapters if node.inventory else None) or ():
                    g = (h.node_guid or "").lower()
                    if g in fmap.adapter_leaves:
                        leaves.setdefault(node.node_id, {})[h.name] = fmap.adapter_leaves[g]
                    if g in bad:
                        degraded.setdefault(node.node_id, {})[h.name] = bad[g]
        out = {}
        for nid in set(physical) | set(leaves) | set(degraded):
            out[nid] = NodeFabricFacts(
                physical={k: frozenset(v) for k, v in physical.get(nid, {}).items()},
                leaves=leaves.get(nid, {}),
                degraded=degraded.get(nid, {}),
            )
        return out

    # -- scanning -----------------------------------------------------------------

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._scan_loop(), name="fabric scans")

    async def close(self) -> None:
        if self._settle_handle is not None:
            self._settle_handle.cancel()
            self._settle_handle = None
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _scan_loop(self) -> None:
        while True:
            try:
                await self.scan_due()
            except Exception:
                log.exception("fabric scans failed; trying again in %g s", self.scan_interval)
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=min(self.scan_interval, 30.0))
            except TimeoutError:
                pass

    async def scan_due(self) -> None:
        """Scan each InfiniBand fabric whose map is older than the interval (or missing), one at a time."""
        now = self.clock()
        for f in self.fabrics():
            if f.kind != INFINIBAND or f.id in self._scanning:
                continue
            last = self._scans.get(f.id)
            tried = max((t for t in (last.scanned_at, last.error_at) if t is not None), default=None) if last else None
            if tried is not None and now - tried < self.scan_interval:
                continue
            await self.scan(f)

    def _scanner(self, f: PhysicalFabric) -> tuple[str, IBPort] | None:
        """A connected node on ``f`` whose agent scans, and its ACTIVE port there; the last one used first."""
        last = self._scans.get(f.id)
        members = sorted(f.members, key=lambda m: (last is None or m.node != last.node, m.node, m.hca, m.port))
        for m in members:
            node = self.agents.get(m.node)
            if node is None or not self.agents.is_connected(m.node) or FEATURE_FABRIC_SCAN not in (node.features or ()):
                continue
            for h in node_adapters(node):
                for p in h.ports or ():
                    if p.hca == m.hca and p.port == m.port and p.active:
                        return m.node, p
        return None

    async def scan(self, f: PhysicalFabric) -> FabricScan:
        """Ask one node on ``f`` for `ibnetdiscover` and keep the map; a failed scan
        keeps the last map and says why the new one is missing."""
        last = self._scans.get(f.id) or FabricScan(fabric_id=f.id)
        chosen = self._scanner(f)
        now = self.clock()
        if chosen is None:
            scan = _failed(last, f"no connected node on {f.id} has an agent that scans fabrics", now)
            self._scans[f.id] = scan
            return scan
        nid, port = chosen
        self._scanning.add(f.id)
        try:
            reply = await self.agents.request(nid, FabricScanRequest(hca=port.hca, port=port.port), SCAN_TIMEOUT_S)
        except AgentServiceError as exc:
            scan = _failed(last, f"{nid} could not be asked: {exc}", self.clock(), nid, port.hca)
        else:
            scan = self._read_scan(f, last, nid, port, reply)
        finally:
            self._scanning.discard(f.id)
        self._scans[f.id] = scan
        return scan

    def _read_scan(self, f: PhysicalFabric, last: FabricScan, nid: str, port: IBPort, reply: Any) -> FabricScan:
        now = self.clock()
        if not isinstance(reply, FabricScanReply):
            why = getattr(reply, "error", None) or "it answered with something other than a scan"
            return _failed(last, f"{nid} refused the scan: {why}", now, nid, port.hca)
        if reply.error or reply.output is None:
            return _failed(last, f"{nid}: {reply.error or 'the scan printed nothing'}", now, nid, port.hca)
        try:
            fmap = fabric_map.analyse(fabric_map.parse_ibnetdiscover(reply.output))
        except fabric_map.FabricMapError as exc:
            # A format the parser does not know is a control-plane upgrade, never a half map.
            log.warning("the map of %s from %s could not be read: %s", f.id, nid, exc)
            return _failed(last, f"the map {nid} sent could not be read: {exc}", now, nid, port.hca)
        if last.fmap is None:
            log.info(
                "fabric %s mapped from %s: %d switches, %d adapters, %d cables",
                f.id,
                nid,
                len(fmap.topology.switches),
                len(fmap.topology.adapters),
                len(fmap.topology.cables),
            )
        return FabricScan(fabric_id=f.id, fmap=fmap, scanned_at=now, node=nid, hca=port.hca)

    # -- fabric tests ---------------------------------------------------------------

    async def fabric_test(self, a: str, b: str, fabric: str | None, seconds: int | None) -> FabricTestView:
        """`ctl fabric-test A B`: every rail of the fabric both share, one at a time."""
        seconds = DEFAULT_TEST_SECONDS if seconds is None else seconds
        if not 1 <= seconds <= MAX_TEST_SECONDS:
            raise FabricTestRefused(f"seconds must be from 1 to {MAX_TEST_SECONDS}, not {seconds}", 400)
        if a == b:
            raise FabricTestRefused(f"a fabric test needs two nodes; both are {a}", 400)
        na, nb = self._test_node(a), self._test_node(b)
        name = _shared_fabric(na, nb, fabric)
        busy = [n for n in (a, b) if n in self._testing]
        if busy:
            raise FabricTestRefused(f"{' and '.join(busy)} is already in a fabric test; wait for it to finish")
        started = time.monotonic()
        self._testing.update((a, b))
        try:
            rails, notes = await self._run_rails(na, nb, name, seconds)
        finally:
            self._testing.difference_update((a, b))
        return FabricTestView(
            a=a,
            b=b,
            fabric=name,
            took_s=round(time.monotonic() - started, 1),
            rails=rails,
            notes=notes,
            ok=bool(rails) and all(r.grade == Grade.OK for r in rails),
        )

    def _test_node(self, nid: str) -> Node:
        node = self.agents.get(nid)
        if node is None:
            raise FabricTestRefused(f"no node {nid!r} is known; `llmgw ctl nodes` lists them", 404)
        if not self.agents.is_connected(nid):
            raise FabricTestRefused(f"{nid}'s agent is not connected, so it cannot run its side of the test")
        if FEATURE_FABRIC_TEST not in (node.features or ()):
            raise FabricTestRefused(
                f"{nid}'s agent ({node.agent_version or 'an older version'}) does not run fabric tests; "
                "upgrade it to this control plane's version"
            )
        if not node.mgmt_addr:
            raise FabricTestRefused(f"{nid} reported no management address, which the other side would connect to")
        return node

    async def _run_rails(self, na: Node, nb: Node, name: str, seconds: int) -> tuple[list[RailResult], list[str]]:
        a_hcas = _adapters_on(na, name)
        b_hcas = set(_adapters_on(nb, name))
        notes: list[str] = []
        extra = sorted(b_hcas - set(a_hcas), key=fabric_map.natural_key)
        if extra:
            notes.append(f"{nb.node_id}'s {', '.join(extra)} on {name} has no same-named adapter on {na.node_id}")
        rails: list[RailResult] = []
        for i, hca in enumerate(a_hcas):
            pa = _active_port(na, hca)
            pb = _active_port(nb, hca) if hca in b_hcas else None
            rate = _link_rate(pa, pb, na, nb, name)
            if hca not in b_hcas:
                rails.append(_failed_rail(hca, rate, f"{nb.node_id} has no {hca} on {name}"))
                continue
            if pa is None or pb is None:
                who = na.node_id if pa is None else nb.node_id
                rails.append(_failed_rail(hca, rate, f"{who}'s {hca} has no ACTIVE port"))
                continue
            rails.append(await self._rail(na, nb, pa, pb, rate, TEST_TCP_PORT + i, seconds))
        return rails, notes

    async def _rail(
        self, na: Node, nb: Node, pa: IBPort, pb: IBPort, rate: float | None, tcp_port: int, seconds: int
    ) -> RailResult:
        timeout = seconds + TEST_MARGIN_S
        server_req = FabricTestRequest(
            role="server", hca=pb.hca, port=pb.port, tcp_port=tcp_port, seconds=seconds, gid_index=_gid(pb)
        )
        client_req = FabricTestRequest(
            role="client",
            hca=pa.hca,
            port=pa.port,
            peer=nb.mgmt_addr,
            tcp_port=tcp_port,
            seconds=seconds,
            gid_index=_gid(pa),
        )
        # The server first: it answers when the test is over, and the client retries until it listens.
        server_sent = asyncio.Event()
        server = asyncio.create_task(self._ask(nb.node_id, server_req, timeout, server_sent))
        await server_sent.wait()
        client = await self._ask(na.node_id, client_req, timeout)
        # Waited for even when the client failed: the server ends within its own bound, and
        # until it has the node would refuse the next rail's server as busy. Its words say why.
        served = await asyncio.gather(server, return_exceptions=True)
        server_reply = served[0] if isinstance(served[0], FabricTestReply) else None
        measured = client.gbps if client.gbps is not None else (server_reply.gbps if server_reply else None)
        detail = None
        if measured is None:
            why = [w for w in (client.error, server_reply.error if server_reply else None) if w]
            detail = "; ".join(dict.fromkeys(why)) or "nothing got through"
        if rate is None:
            note = "the link rate is not known, so the rail could not be graded against it"
            g = Grade.FAIL if measured is None else Grade.SLOW
            return RailResult(
                adapter=pa.hca,
                peer_adapter=pb.hca,
                measured_gbps=measured,
                grade=g,
                detail="; ".join(x for x in (detail, note) if x),
            )
        return RailResult(
            adapter=pa.hca,
            peer_adapter=pb.hca,
            link_rate_gbps=rate,
            measured_gbps=measured,
            grade=grade(measured, rate),
            detail=detail,
        )

    async def _ask(
        self, nid: str, req: FabricTestRequest, timeout: float, sent: asyncio.Event | None = None
    ) -> FabricTestReply:
        try:
            reply = await self.agents.request(nid, req, timeout, sent=sent)
        except AgentServiceError as exc:
            return FabricTestReply(error=f"{nid}: {exc}")
        finally:
            if sent is not None:
                sent.set()  # also when it never got onto the stream: the client's turn comes anyway
        if isinstance(reply, FabricTestReply):
            return reply
        return FabricTestReply(error=f"{nid} refused its side: {getattr(reply, 'error', None) or 'no reason given'}")

    # -- NVLink ---------------------------------------------------------------------

    def nvlink(self) -> dict[str, Any]:
        """GET /api/v1/nvlink: each multi-node NVLink domain as a rack, and GPUs in none."""
        views = [nvlink.from_node(n) for n in self.agents.nodes()]
        return nvlink.to_json(nvlink.racks(views), nvlink.unplaced(views))


def _failed(last: FabricScan, why: str, now: float, node: str | None = None, hca: str | None = None) -> FabricScan:
    log.warning("fabric %s: scan failed: %s", last.fabric_id, why)
    return FabricScan(
        fabric_id=last.fabric_id,
        fmap=last.fmap,
        scanned_at=last.scanned_at,
        node=last.node if last.fmap is not None else node,
        hca=last.hca if last.fmap is not None else hca,
        error=why,
        error_at=now,
    )


def _sm_row(m: SubnetManager) -> SubnetManagerRow:
    return SubnetManagerRow(guid=m.guid, lid=m.lid, priority=m.priority, state=m.state_label)


def _adapters_on(node: Node, name: str) -> list[str]:
    for f in node.fabrics or ():
        if f.fabric == name:
            return sorted(f.hcas or (), key=fabric_map.natural_key)
    return []


def _shared_fabric(na: Node, nb: Node, asked: str | None) -> str:
    a_names = [f.fabric for f in na.fabrics or ()]
    b_names = {f.fabric for f in nb.fabrics or ()}
    shared = [n for n in a_names if n in b_names]
    if asked is not None:
        if asked in shared:
            return asked
        for node, names in ((na, a_names), (nb, b_names)):
            if asked not in names:
                listed = ", ".join(sorted(names)) or "none"
                raise FabricTestRefused(
                    f"{node.node_id} does not advertise fabric {asked!r} (it advertises: {listed}); "
                    "`llmgw ctl nodes` shows why a declared fabric is left out"
                )
    if not shared:
        raise FabricTestRefused(
            f"{na.node_id} and {nb.node_id} share no fabric they advertise "
            f"({na.node_id}: {', '.join(a_names) or 'none'}; {nb.node_id}: {', '.join(sorted(b_names)) or 'none'})"
        )
    if len(shared) > 1:
        raise FabricTestRefused(
            f"{na.node_id} and {nb.node_id} share {len(shared)} fabrics ({', '.join(shared)}); choose one with --fabric",
            400,
        )
    return shared[0]


def _active_port(node: Node, hca: str) -> IBPort | None:
    for h in node_adapters(node):
        if h.name == hca:
            for p in sorted(h.ports or (), key=lambda p: p.port):
                if p.active:
                    return p
    return None


def _gid(p: IBPort) -> int | None:
    return p.gid_index if p.is_roce else None


def _link_rate(pa: IBPort | None, pb: IBPort | None, na: Node, nb: Node, name: str) -> float | None:
    """The slower end's rate; agent.yaml's rate_gbps where a port does not say."""
    rates = [p.rate_gbps for p in (pa, pb) if p is not None and p.rate_gbps]
    if rates:
        return min(rates)
    declared = [f.rate_gbps for n in (na, nb) for f in n.fabrics or () if f.fabric == name and f.rate_gbps]
    return min(declared) if declared else None


def _failed_rail(hca: str, rate: float | None, why: str) -> RailResult:
    return RailResult(adapter=hca, peer_adapter=hca, link_rate_gbps=rate, grade=Grade.FAIL, detail=why)


def problem_rows(problems: Iterable[Problem]) -> list[FabricProblemRow]:
    return [
        FabricProblemRow(fabric=p.fabric_id, node=p.node, kind=p.kind, level=p.level, message=p.message, fix=p.fix)
        for p in problems
    ]
