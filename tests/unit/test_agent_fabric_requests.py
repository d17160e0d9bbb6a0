"""The agent's side of the fabric work: declared fabrics on register, the subnet managers once
a minute on a heartbeat (infiniband-diags installed where it is missing), `ibnetdiscover` scans
and `ib_write_bw` tests asked over the stream.

Real agents talk to a small control plane of the test's own over a real WebSocket; the tools are
scripts on PATH, named as the real ones, printing the fixtures in the formats the tools print.
"""

from __future__ import annotations

import asyncio
import os
from collections import defaultdict
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from llmgw.agent import fabric_tools, service
from llmgw.agent.discovery import commands
from llmgw.agent.discovery.collect import DiscoveryOptions
from llmgw.agent.discovery.commands import CommandResult
from llmgw.agent.fabric_bench import parse_ib_write_bw
from llmgw.agent.identity import Identity
from llmgw.agent.provision import runner
from llmgw.agent.provision.os_packages import PackageInstaller
from llmgw.config.agent import parse_agent_config
from llmgw.protocol import (
    STREAM_PATH,
    FabricAttachment,
    FabricScanReply,
    FabricScanRequest,
    FabricTestReply,
    FabricTestRequest,
    Heartbeat,
    LogsReply,
    LogsRequest,
    Message,
    Register,
    decode,
    encode,
)
from llmgw.testing.ib_machine import FIXTURES, Tools, write_adapter
from llmgw.testing.waiting import async_until

FIX = FIXTURES
MASTER_GUID = "0x248a070300f7d3a0"


# ------------------------------------------------------------------ the machine


# Two InfiniBand adapters, one port each, under the same subnet manager.
GUIDS = {"mlx5_0": "0xa088c2030012f3a0", "mlx5_1": "0xa088c2030012f3a1"}


def _no_commands(argv, timeout) -> CommandResult:
    # Discovery's own commands (ip, nvidia-smi): none on this machine.
    return CommandResult(tuple(argv), None, missing=True)


# ------------------------------------------------------------------ the control plane


class ControlPlane:
    """Accepts agents' streams, keeps what each sent, sends them requests."""

    def __init__(self) -> None:
        self.received: dict[str, list[Message]] = defaultdict(list)
        self.streams: dict[str, web.WebSocketResponse] = {}
        self.server: TestServer | None = None

    async def start(self) -> ControlPlane:
        app = web.Application()
        app.router.add_get(STREAM_PATH, self._stream)
        self.server = TestServer(app, host="127.0.0.1")
        await self.server.start_server()
        return self

    async def _stream(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        node = ""
        async for frame in ws:
            msg = decode(frame.data, sender="agent")
            if isinstance(msg, Register):
                node = msg.node_id
                self.streams[node] = ws
            self.received[node].append(msg)
        return ws

    def of(self, node: str, kind: type[Message]) -> list:
        return [m for m in self.received[node] if isinstance(m, kind)]

    def answer(self, node: str, msg_id: str) -> Message | None:
        return next((m for m in self.received[node] if m.id == msg_id and not isinstance(m, Register)), None)

    async def send(self, node: str, msg: Message) -> None:
        await async_until(lambda: node in self.streams, 20, f"{node} to connect")
        await self.streams[node].send_bytes(encode(msg))

    async def ask(self, node: str, msg: Message, timeout: float = 20) -> Message:
        await self.send(node, msg)
        assert msg.id is not None
        return await async_until(lambda: self.answer(node, msg.id), timeout, f"{node}'s answer to {msg.id}")


@pytest.fixture
async def cp():
    plane = await ControlPlane().start()
    yield plane
    assert plane.server is not None
    await plane.server.close()


@pytest.fixture
def tools(tmp_path, monkeypatch) -> Tools:
    t = Tools(tmp_path)
    # Only the scripts are tools here: what this machine has installed must not answer.
    monkeypatch.setenv("PATH", str(t.bin))
    monkeypatch.setattr(commands, "SBIN_DIRS", ())
    return t


class Agents:
    def __init__(self, tmp_path: Path, cp: ControlPlane) -> None:
        self.tmp, self.cp = tmp_path, cp
        self.running: list[tuple[asyncio.Event, asyncio.Task]] = []

    async def start(
        self,
        node: str,
        *,
        ib: bool = True,
        roce_only: bool = False,
        os_id: str | None = None,
        packages: PackageInstaller | None = None,
        **extra,
    ) -> service.Agent:
        home = self.tmp / node
        ib_root = home / "ib"
        ib_root.mkdir(parents=True)
        if roce_only:
            write_adapter(ib_root, "mlx5_0", GUIDS["mlx5_0"], link_layer="Ethernet", sm_lid="0x0")
        elif ib:
            for hca, guid in GUIDS.items():
                write_adapter(ib_root, hca, guid)
        os_release = home / "os-release"
        if os_id:
            os_release.write_text(f"ID={os_id}\nVERSION_ID=12\n")
        assert self.cp.server is not None
        cfg = parse_agent_config(
            {
                "server": f"127.0.0.1:{self.cp.server.port}",
                "tls": None,
                "node_id": node,
                "heartbeat_interval": "50ms",
                "reconnect_base": "100ms",
                "reconnect_max": "500ms",
                "weights_cache": str(home / "weights"),
                "engines_dir": str(home / "engines"),
                "supervisor": {"work_dir": str(home / "state")},
                "discovery": {"skip_gpus": True},
                **extra,
            }
        )
        discovery = DiscoveryOptions(
            model_dirs=(str(home / "weights"),),
            ib_root=ib_root,
            skip_gpus=True,
            os_release=os_release,
            run=_no_commands,
            which=lambda name: None,
            nvml=None,
        )
        agent = service.Agent(cfg, Identity(node, "127.0.0.1", None), discovery, packages)
        stop = asyncio.Event()
        self.running.append((stop, asyncio.create_task(agent.run(stop), name=f"agent {node}")))
        await async_until(lambda: self.cp.of(node, Register), 20, f"{node} to register")
        return agent

    async def stop(self) -> None:
        for stop, _ in self.running:
            stop.set()
        await asyncio.gather(*(t for _, t in self.running))


@pytest.fixture
async def agents(tmp_path, cp, tools):
    a = Agents(tmp_path, cp)
    yield a
    await a.stop()


def readings(cp: ControlPlane, node: str) -> list[tuple[int, Heartbeat]]:
    """(position among the node's heartbeats, heartbeat) for those carrying subnet managers."""
    beats = [h for h in cp.of(node, Heartbeat) if h.memory is not None]  # full heartbeats, not provision news
    return [(i, h) for i, h in enumerate(beats) if h.subnet_managers is not None or h.subnet_managers_error]


# ------------------------------------------------------------------ register


async def test_register_carries_the_fabrics_agent_yaml_declares_usable_or_not(agents, cp):
    await agents.start(
        "gpu-a",
        fabrics=[
            {"name": "ib-a", "hcas": ["mlx5_0", "mlx5_1"], "rate_gbps": 400},
            {"name": "ib-b", "hcas": ["mlx5_9"]},  # not on this node: declared all the same
        ],
    )
    (reg,) = cp.of("gpu-a", Register)
    assert reg.declared_fabrics == [
        FabricAttachment(fabric="ib-a", hcas=["mlx5_0", "mlx5_1"], rate_gbps=400),
        FabricAttachment(fabric="ib-b", hcas=["mlx5_9"]),
    ]
    assert [f.fabric for f in reg.fabrics or ()] == ["ib-a"]
    assert "fabric-scan" in (reg.features or []) and "fabric-test" in (reg.features or [])


# ------------------------------------------------------------------ subnet managers


async def test_subnet_managers_come_on_one_heartbeat_then_not_again_until_the_interval_has_passed(agents, cp, tools):
    tools.add_diags()
    await agents.start("gpu-a", subnet_manager_interval="600ms")
    await async_until(lambda: len(readings(cp, "gpu-a")) >= 2, 20, "two readings of the subnet managers")
    (first_at, first), (second_at, _second) = readings(cp, "gpu-a")[:2]
    sm = first.subnet_managers
    assert sm is not None and sm.missing_tools is None and first.subnet_managers_error is None
    assert [(p.hca, p.port) for p in sm.ports or ()] == [("mlx5_0", 1), ("mlx5_1", 1)]
    a, b = sm.ports or ()
    assert a.master is not None and a.master.guid == MASTER_GUID and a.master.state == "SMINFO_MASTER"
    assert [(m.guid, m.state) for m in a.managers or ()] == [
        (MASTER_GUID, "SMINFO_MASTER"),
        ("0x248a070300f7d3c8", "SMINFO_STANDBY"),
    ]
    assert a.source == "saquery SMIR" and b.source == "as mlx5_0/1" and b.managers == a.managers
    # Every heartbeat in between said nothing of them (absent: no news); at 50 ms a beat, 600 ms is many.
    assert second_at - first_at >= 5
    # One saquery per subnet (not per port) each reading.
    assert tools.calls("saquery")[:2] == [["-C", "mlx5_0", "-P", "1", "SMIR"]] * 2


async def test_a_node_without_an_active_infiniband_port_runs_no_subnet_manager_tool(agents, cp, tools):
    tools.add_diags()
    await agents.start("roce-a", roce_only=True, subnet_manager_interval="100ms")
    await async_until(lambda: len(cp.of("roce-a", Heartbeat)) >= 8, 20, "several heartbeats")
    assert readings(cp, "roce-a") == []
    assert tools.calls("sminfo") == [] and tools.calls("saquery") == []


async def test_missing_diagnostics_are_reported_as_missing_tools_with_what_to_install(agents, cp):
    # No package manager this agent knows (no os-release), so nothing can be installed.
    await agents.start("gpu-a")
    await async_until(lambda: readings(cp, "gpu-a"), 20, "a reading of the subnet managers")
    _, beat = readings(cp, "gpu-a")[0]
    assert beat.subnet_managers is not None and beat.subnet_managers.missing_tools == ["sminfo", "saquery"]
    assert beat.subnet_managers_error == "sminfo and saquery are not installed on this node; install infiniband-diags"


class FakeApt:
    """dpkg-query and apt-get as a Debian machine runs them: installing infiniband-diags puts
    the scripts on PATH, or fails as a non-root apt-get does."""

    def __init__(self, tools: Tools, fails: bool = False) -> None:
        self.tools, self.fails = tools, fails
        self.installed: set[str] = set()
        self.commands: list[list[str]] = []

    async def __call__(self, argv, *, env=None, stdin=None, timeout=None) -> runner.CommandResult:
        argv = list(argv)
        self.commands.append(argv)
        if argv[0] == "dpkg-query":
            return runner.CommandResult(
                0 if argv[-1] in self.installed else 1, "ii " if argv[-1] in self.installed else ""
            )
        if self.fails:
            return runner.CommandResult(
                100, "E: Could not open lock file - open (13: Permission denied)\nare you root?"
            )
        if "install" in argv:
            packages = {a for a in argv if not a.startswith("-") and a not in ("apt-get", "install")}
            self.installed |= packages
            if "infiniband-diags" in packages:
                self.tools.add_diags()
            if "perftest" in packages:
                self.tools.add(
                    "ib_write_bw", "sys.stdout.write((FIX / 'fabric_test' / 'ib_ndr_client.stdout').read_text())\n"
                )
        return runner.CommandResult(0, "")

    def installs(self) -> list[list[str]]:
        return [c for c in self.commands if c[0] == "apt-get" and "install" in c]


def _packages(apt: FakeApt) -> PackageInstaller:
    return PackageInstaller(apt, which=lambda name: "/usr/bin/apt-get" if name == "apt-get" else None)


async def test_infiniband_diags_is_installed_where_there_are_adapters_and_then_read(agents, cp, tools):
    apt = FakeApt(tools)
    await agents.start("gpu-a", os_id="debian", packages=_packages(apt))
    await async_until(lambda: readings(cp, "gpu-a"), 20, "a reading of the subnet managers")
    _, beat = readings(cp, "gpu-a")[0]
    sm = beat.subnet_managers
    assert beat.subnet_managers_error is None and sm is not None and sm.missing_tools is None
    assert sm.ports and sm.ports[0].master is not None and sm.ports[0].master.guid == MASTER_GUID
    assert [c[-1] for c in apt.installs()] == ["infiniband-diags"]


async def test_a_failed_install_is_said_and_not_tried_again_every_minute(agents, cp, tools):
    apt = FakeApt(tools, fails=True)
    await agents.start("gpu-a", os_id="debian", packages=_packages(apt), subnet_manager_interval="100ms")
    await async_until(lambda: len(readings(cp, "gpu-a")) >= 3, 20, "three readings of the subnet managers")
    errors = [h.subnet_managers_error or "" for _, h in readings(cp, "gpu-a")]
    assert all(e.endswith("; install infiniband-diags") for e in errors)
    assert "installing infiniband-diags failed" in errors[0] and "needs root" in errors[0]
    # One attempt (it failed at `apt-get update`); the next waits INSTALL_RETRY_S.
    assert [c for c in apt.commands if c[0] == "apt-get"] == [["apt-get", "-o=DPkg::Lock::Timeout=600", "update"]]


async def test_when_the_infiniband_ports_go_down_an_empty_reading_is_sent_once(agents, cp, tools):
    tools.add_diags()
    await agents.start("gpu-a", subnet_manager_interval="100ms")
    await async_until(lambda: readings(cp, "gpu-a"), 20, "a reading of the subnet managers")
    for hca, guid in GUIDS.items():
        write_adapter(agents.tmp / "gpu-a" / "ib", hca, guid, state="1: DOWN")

    def emptied() -> list[int]:
        return [i for i, h in readings(cp, "gpu-a") if h.subnet_managers is not None and h.subnet_managers.ports == []]

    (at,) = await async_until(emptied, 20, "an empty reading")
    beats = len(cp.of("gpu-a", Heartbeat))
    await async_until(lambda: len(cp.of("gpu-a", Heartbeat)) >= beats + 8, 20, "several heartbeats more")
    assert readings(cp, "gpu-a")[-1][0] == at  # nothing more to say after it


# ------------------------------------------------------------------ fabric scan


async def test_a_scan_answers_with_what_ibnetdiscover_printed_whole(agents, cp, tools):
    tools.add("ibnetdiscover", "sys.stdout.write((FIX / 'fabric' / 'ibnetdiscover_fat_tree.txt').read_text())\n")
    await agents.start("gpu-a")
    reply = await cp.ask("gpu-a", FabricScanRequest(id="scan-1", hca="mlx5_0", port=1))
    assert isinstance(reply, FabricScanReply) and reply.error is None
    assert reply.output == (FIX / "fabric" / "ibnetdiscover_fat_tree.txt").read_text()
    assert reply.took_ms is not None and reply.took_ms >= 0
    assert tools.calls("ibnetdiscover") == [["-C", "mlx5_0", "-P", "1"]]


async def test_a_scan_that_cannot_give_a_whole_map_says_why_in_words(agents, cp, tools, monkeypatch):
    await agents.start("gpu-a")

    async def scan(n: int) -> FabricScanReply:
        reply = await cp.ask("gpu-a", FabricScanRequest(id=f"scan-{n}", hca="mlx5_0", port=1))
        assert isinstance(reply, FabricScanReply) and reply.output is None and reply.error
        return reply

    assert (await scan(1)).error == "ibnetdiscover is not installed on this node; install infiniband-diags"

    tools.add(
        "ibnetdiscover",
        "sys.stderr.write('ibwarn: [4242] mad_rpc_open_port: client_register for mgmt 1 failed\\n'"
        "'src/ibnetdisc.c:784; can\\'t open MAD port (mlx5_0:1)\\n')\nsys.exit(255)\n",
    )
    error = (await scan(2)).error
    assert error.startswith("`ibnetdiscover -C mlx5_0 -P 1` exited with status 255: ibwarn: [4242]")
    assert "can't open MAD port (mlx5_0:1)" in error

    monkeypatch.setattr(fabric_tools, "SCAN_OUTPUT_CAP", 4096)
    tools.add("ibnetdiscover", "sys.stdout.write((FIX / 'fabric' / 'ibnetdiscover_fat_tree.txt').read_text())\n")
    assert (await scan(3)).error == (
        "`ibnetdiscover -C mlx5_0 -P 1` printed more than 4096 bytes and was stopped; "
        "no map is sent rather than part of one"
    )


async def test_a_scan_that_hangs_is_stopped_and_the_stream_is_answered_meanwhile(agents, cp, tools, monkeypatch):
    monkeypatch.setattr(fabric_tools, "SCAN_TIMEOUT_S", 1.0)
    tools.add("ibnetdiscover", "import threading\nthreading.Event().wait()\n")
    await agents.start("gpu-a")
    await cp.send("gpu-a", FabricScanRequest(id="scan-1", hca="mlx5_0", port=1))
    await async_until(lambda: tools.calls("ibnetdiscover"), 20, "the scan to start")
    logs = await cp.ask("gpu-a", LogsRequest(id="logs-1", source="agent", lines=5))
    assert isinstance(logs, LogsReply)
    assert cp.answer("gpu-a", "scan-1") is None  # the scan is still running: it did not hold the stream
    reply = await async_until(lambda: cp.answer("gpu-a", "scan-1"), 20, "the scan's answer")
    assert reply.error == "`ibnetdiscover -C mlx5_0 -P 1` did not finish in 1 s" and reply.output is None


# ------------------------------------------------------------------ fabric test

# The server prints its banner and "Waiting for client to connect", then blocks on a FIFO until
# the client (or the test) writes to it, as the real one blocks on its TCP port, then prints the
# report. The client is refused the first time (the server not listening yet), then gets through.
IB_WRITE_BW = """
def server():
    lines = (FIX / 'fabric_test' / 'ib_ndr_server.stdout').read_text().splitlines(keepends=True)
    box = next(i for i, ln in enumerate(lines) if 'Waiting for client' in ln) + 2
    sys.stdout.write(''.join(lines[:box]))
    sys.stdout.flush()
    (HERE / 'fifo').read_text()
    sys.stdout.write(''.join(lines[box:]))


def client():
    count = HERE / 'client.count'
    n = int(count.read_text()) + 1 if count.exists() else 1
    count.write_text(str(n))
    if n == 1:
        sys.stdout.write((FIX / 'fabric_test' / 'retry_1_refused.stdout').read_text())
        sys.stderr.write((FIX / 'fabric_test' / 'retry_1_refused.stderr').read_text())
        sys.exit(1)
    (HERE / 'fifo').write_text('connected')
    sys.stdout.write((FIX / 'fabric_test' / 'retry_2_success.stdout').read_text())


client() if '127.0.0.1' in sys.argv else server()
"""


@pytest.fixture
def perftest(tools, monkeypatch) -> Tools:
    os.mkfifo(tools.bin / "fifo")
    tools.add("ib_write_bw", IB_WRITE_BW)
    monkeypatch.setattr(fabric_tools, "CLIENT_RETRY_S", 0.05)
    return tools


def _test(role: str, n: int, **kw) -> FabricTestRequest:
    fields = {"hca": "mlx5_0", "port": 1, "tcp_port": 18515, "seconds": 2, **kw}
    return FabricTestRequest(id=f"{role}-{n}", role=role, **fields)


async def test_a_server_and_a_client_measure_a_rail_the_client_retrying_until_the_server_listens(agents, cp, perftest):
    await agents.start("gpu-b")
    await agents.start("gpu-a")
    await cp.send("gpu-b", _test("server", 1))
    client = await cp.ask("gpu-a", _test("client", 1, peer="127.0.0.1"))
    server = await async_until(lambda: cp.answer("gpu-b", "server-1"), 20, "the server's answer")
    assert isinstance(server, FabricTestReply) and isinstance(client, FabricTestReply)
    assert server.error is None and server.gbps == pytest.approx(390.14)
    expected = parse_ib_write_bw((FIX / "fabric_test" / "retry_2_success.stdout").read_text(), "")
    assert client.error is None and client.gbps == pytest.approx(expected.bw_average_gbps)
    assert "BW average[Gb/sec]" in (client.output or "") and len((client.output or "").splitlines()) <= 20
    assert client.took_ms is not None and server.took_ms is not None
    calls = perftest.calls("ib_write_bw")
    server_argv = ["-d", "mlx5_0", "-i", "1", "-p", "18515", "-D", "2", "-F", "--report_gbits"]
    assert sorted(calls) == sorted([server_argv, [*server_argv, "127.0.0.1"], [*server_argv, "127.0.0.1"]])


async def test_a_second_test_while_one_runs_is_refused_at_once(agents, cp, perftest):
    await agents.start("gpu-b")
    await cp.send("gpu-b", _test("server", 1))
    await async_until(lambda: perftest.calls("ib_write_bw"), 20, "the server to start")
    busy = await cp.ask("gpu-b", _test("server", 2))
    assert isinstance(busy, FabricTestReply) and busy.gbps is None
    assert busy.error == "another fabric test is running on this node; one at a time"
    assert cp.answer("gpu-b", "server-1") is None
    await asyncio.to_thread((perftest.bin / "fifo").write_text, "connected")  # the client the server waited for
    done = await async_until(lambda: cp.answer("gpu-b", "server-1"), 20, "the first test's answer")
    assert done.gbps == pytest.approx(390.14)
    # The node is free again once the first has answered.
    await cp.send("gpu-b", _test("server", 3))
    await async_until(lambda: len(perftest.calls("ib_write_bw")) == 2, 20, "the next server to start")
    await asyncio.to_thread((perftest.bin / "fifo").write_text, "connected")
    again = await async_until(lambda: cp.answer("gpu-b", "server-3"), 20, "the next test's answer")
    assert again.error is None and again.gbps == pytest.approx(390.14)


async def test_a_server_no_client_reaches_is_stopped_after_its_seconds_and_the_margin(
    agents, cp, perftest, monkeypatch
):
    monkeypatch.setattr(fabric_tools, "TEST_MARGIN_S", 0.5)
    await agents.start("gpu-b")
    reply = await cp.ask("gpu-b", _test("server", 1, seconds=1))
    assert isinstance(reply, FabricTestReply) and reply.gbps is None
    assert reply.error == "no client connected within 1.5 s, so ib_write_bw's server was stopped"
    assert "Waiting for client to connect" in (reply.output or "")
    assert reply.took_ms is not None and reply.took_ms >= 1500


async def test_a_client_the_server_never_answers_gives_up_after_its_retries(agents, cp, tools, monkeypatch):
    monkeypatch.setattr(fabric_tools, "CLIENT_RETRY_S", 0.05)
    monkeypatch.setattr(fabric_tools, "CLIENT_RETRIES", 2)
    tools.add(
        "ib_write_bw",
        "sys.stderr.write((FIX / 'fabric_test' / 'retry_1_refused.stderr').read_text())\nsys.exit(1)\n",
    )
    await agents.start("gpu-a")
    reply = await cp.ask("gpu-a", _test("client", 1, peer="10.0.0.2"))
    assert reply.error == (
        "the peer's ib_write_bw server was not listening at 10.0.0.2:18515 (2 retries, 0.05 s apart)"
    )
    assert len(tools.calls("ib_write_bw")) == 3


async def test_without_ib_write_bw_and_no_way_to_install_it_the_reply_says_install_perftest(agents, cp):
    await agents.start("gpu-a")
    reply = await cp.ask("gpu-a", _test("client", 1, peer="10.0.0.2"))
    assert reply.error == "ib_write_bw is not installed on this node; install perftest" and reply.gbps is None


async def test_perftest_is_installed_the_first_time_a_test_needs_ib_write_bw(agents, cp, tools):
    apt = FakeApt(tools)
    await agents.start("gpu-a", ib=False, os_id="debian", packages=_packages(apt))
    reply = await cp.ask("gpu-a", _test("client", 1, peer="10.0.0.2"))
    assert reply.error is None and reply.gbps == pytest.approx(390.14)
    assert [c[-1] for c in apt.installs()] == ["perftest"]
