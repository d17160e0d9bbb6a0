"""Agents for the Fabrics and NVLink pages' tests (tests/unit/test_pages_fabrics.py and
tests/e2e/test_pages_fabrics_browser.py), speaking the real agent stream to a control plane.

What they report is the fixtures' real tool output read by the real parsers: InfiniBand
adapters carry the GUIDs `ibnetdiscover` printed for the fat tree
(tests/fixtures/fabric/), their subnet managers are doctor's `sminfo` and `saquery SMIR`
fixtures read by the agent's own collector, a scan is answered with an `ibnetdiscover`
fixture's text (the control plane parses it), and GB200 trays carry the GPUs of
`nvidia-smi -q` (tests/fixtures/discovery/smi_q_gb200.txt) read by the agent's fabric parser.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import aiohttp

from llmgw.agent.discovery.commands import CommandResult
from llmgw.agent.discovery.fabric import apply_fabric, parse_gpu_fabric
from llmgw.agent.discovery.subnet import collect_subnet_managers
from llmgw.protocol import (
    FEATURE_FABRIC_SCAN,
    GPU,
    HCA,
    IMEX,
    PROTOCOL_VERSION,
    STREAM_PATH,
    Ack,
    FabricAttachment,
    FabricScanReply,
    FabricScanRequest,
    Heartbeat,
    IBPort,
    NodeInventory,
    Register,
    decode,
    encode,
)
from llmgw.protocol.doctor import SubnetManagers
from llmgw.testing.ib_machine import SM_A, SM_B, map_guids, sminfo_text, smir_text

FIX = Path(__file__).resolve().parent.parent / "fixtures"
FAT_TREE = (FIX / "fabric" / "ibnetdiscover_fat_tree.txt").read_text()
DEGRADED = (FIX / "fabric" / "ibnetdiscover_fat_tree_degraded.txt").read_text()
SMINFO, SMIR = sminfo_text(), smir_text()
SMIR_MASTER_ONLY = (FIX / "doctor" / "saquery_smir_master_only.txt").read_text()
# After a failover: the standby (lid 2) is master, the old master its standby.
SMINFO_FAILED_OVER, SMIR_FAILED_OVER = sminfo_text(failed_over=True), smir_text(failed_over=True)
GB200 = (FIX / "discovery" / "smi_q_gb200.txt").read_text()
HGX = (FIX / "discovery" / "smi_q_hgx_h100.txt").read_text()
MASTER, STANDBY = SM_A, SM_B  # the doctor fixtures' two SMs
FABRIC = f"ib:{MASTER}"  # named by the lowest GUID among them
RACK = "76b1ad76-7c24-4b6b-9f6c-2a1e0d8c11aa"  # smi_q_gb200.txt's cluster UUID, as the rack is named
HEARTBEAT_EVERY = 0.3


def subnet_managers(ports: list[IBPort], sminfo: str = SMINFO, smir: str = SMIR) -> SubnetManagers | None:
    """What the agent's collector reads behind these ports, its tools printing doctor's fixtures."""

    def run(argv, timeout):
        return CommandResult(tuple(argv), 0, sminfo if argv[0].endswith("sminfo") else smir, "")

    return collect_subnet_managers(ports, run, lambda name: f"/usr/sbin/{name}")


def ib_adapters(host: str, text: str = FAT_TREE) -> list[HCA]:
    """The adapters sysfs would show on ``host`` of the map: mlx5_0..3, ACTIVE at 400 Gb/s."""
    out = []
    for device, guid in sorted(map_guids(text)[host].items()):
        port = IBPort(
            hca=device, port=1, state="ACTIVE", link_layer="InfiniBand", rate_gbps=400.0, node_guid=guid, sm_lid=1
        )
        out.append(HCA(name=device, node_guid=guid, ports=[port]))
    return out


def _gpus_of(smi_q: str) -> list[GPU]:
    """The cards of an `nvidia-smi -q` dump (index, UUID, name, bus id) with their Fabric block."""
    gpus = []
    for i, block in enumerate(re.split(r"^GPU (?=[0-9A-Fa-f]{4,8}:)", smi_q, flags=re.M)[1:]):
        bus = block.split("\n", 1)[0].strip()
        uuid = re.search(r"GPU UUID\s*:\s*(\S+)", block)
        name = re.search(r"Product Name\s*:\s*(.+)", block)
        gpus.append(
            GPU(
                index=i,
                pci_bus_id=bus,
                uuid=uuid.group(1) if uuid else None,
                name=name.group(1).strip() if name else None,
            )
        )
    apply_fabric(gpus, parse_gpu_fabric(smi_q))
    return gpus


def gb200_tray(tray: int, *, as_captured: bool = False) -> list[GPU]:
    """A compute tray's four GB200s. ``as_captured``: as the fixture has them (GPU 2 still joining,
    GPU 3 at degraded bandwidth); otherwise every card joined like its GPU 0. UUIDs carry the tray."""
    gpus = _gpus_of(GB200)
    joined = gpus[0].fabric
    out = []
    for g in gpus:
        uuid = (g.uuid or "")[:-6] + f"{tray:03d}" + (g.uuid or "")[-3:]
        out.append(g.model_copy(update={"uuid": uuid, "fabric": g.fabric if as_captured else joined}))
    return out


def hgx_gpus() -> list[GPU]:
    """An HGX H100 board: its NVSwitch names the all-zero cluster (no rack)."""
    return _gpus_of(HGX)


class FabricAgent:
    """One node's agent on the real stream: it registers its adapters or GPUs, beats, sends its subnet
    managers (``sminfo``/``smir``: what those tools print there; changed, the next heartbeat says so), and
    answers scans with ``scan`` (ibnetdiscover's text) or ``scan_error``. ``declared``: the adapters its
    agent.yaml puts on ``fabric`` (all of them unless given)."""

    def __init__(
        self,
        agent_url: str,
        node_id: str,
        *,
        adapters: list[HCA] | None = None,
        gpus: list[GPU] | None = None,
        imex: IMEX | None = None,
        fabric: str = "rail",
        declared: list[str] | None = None,
        scan: str | None = None,
    ) -> None:
        self.url = agent_url.rstrip("/") + STREAM_PATH
        self.node_id = node_id
        self.adapters = adapters or []
        self.gpus = gpus
        self.imex = imex
        self.fabric = fabric
        self.declared = declared if declared is not None else [h.name for h in self.adapters]
        self.sminfo, self.smir = SMINFO, SMIR
        self.scan: str | None = scan
        self.scan_error: str | None = None
        self.scans = 0  # scans answered
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> FabricAgent:
        self.http = aiohttp.ClientSession()
        self.ws = await self.http.ws_connect(self.url)
        ports = [p for h in self.adapters for p in h.ports or ()]
        attach = [FabricAttachment(fabric=self.fabric, hcas=self.declared, rate_gbps=400.0)]
        await self.ws.send_bytes(
            encode(
                Register(
                    node_id=self.node_id,
                    protocol_version=PROTOCOL_VERSION,
                    agent_version="9.9.9",
                    features=[FEATURE_FABRIC_SCAN] if self.scan is not None else [],
                    inventory=NodeInventory(adapters=self.adapters or None, gpus=self.gpus, imex=self.imex),
                    mgmt_addr="127.0.0.1",
                    fabrics=attach if ports else None,
                    declared_fabrics=attach if ports else None,
                )
            )
        )
        self._ports = ports
        self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._beat())]
        return self

    async def _beat(self) -> None:
        while not self._stop.is_set():
            sms = subnet_managers(self._ports, self.sminfo, self.smir) if self._ports else None
            await self.ws.send_bytes(encode(Heartbeat(node_id=self.node_id, subnet_managers=sms, imex=self.imex)))
            try:
                await asyncio.wait_for(self._stop.wait(), HEARTBEAT_EVERY)
            except TimeoutError:
                pass

    async def _read(self) -> None:
        async for frame in self.ws:
            if frame.type not in (aiohttp.WSMsgType.BINARY, aiohttp.WSMsgType.TEXT):
                continue
            msg = decode(frame.data, sender="control")
            if isinstance(msg, FabricScanRequest):
                self.scans += 1
                if self.scan_error is not None:
                    reply = FabricScanReply(id=msg.id, error=self.scan_error)
                else:
                    reply = FabricScanReply(id=msg.id, output=self.scan, took_ms=120)
                await self.ws.send_bytes(encode(reply))
            elif msg.id:
                await self.ws.send_bytes(encode(Ack(id=msg.id, ok=True)))

    async def stop(self) -> None:
        self._stop.set()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.ws.close()
        await self.http.close()


def control_config(tmp_path: Path, *, control: bool = True) -> dict:
    """server.yaml for a control plane on loopback whose fabrics are mapped every half second."""
    from llmgw.testing.ports import free_port

    return {
        "listen": f"127.0.0.1:{free_port()}",
        "admin_listen": f"127.0.0.1:{free_port()}",
        "metrics_listen": None,
        "agent_listen": f"127.0.0.1:{free_port()}",
        "agent_tls": None,
        "control": {
            "enabled": control,
            "unreachable_after": "30s",
            "lost_after": "60s",
            "interval": "200ms",
            "fabric_scan_interval": "500ms",
        },
        "auth": {"store": str(tmp_path / "gw.db"), "signup_open": True},
        "data_dir": str(tmp_path),
        "models": [{"name": "m", "endpoints": [{"url": "http://127.0.0.1:9", "engine": "openai"}]}],
    }


def rail_fat_tree(leaves: int = 32, spines: int = 16, hosts_per_leaf: int = 16, rails: int = 8) -> str:
    """ibnetdiscover's text for a large rail-aligned two-tier fat tree, in the fixtures' exact line
    formats: ``leaves // rails`` pods of ``hosts_per_leaf`` hosts, host h's adapter r on its pod's
    leaf r at port h + 1, every leaf with one uplink to every spine. For the layout at scale."""
    sw = {f"ib-spine-{i + 1:02d}": f"fc6a1c0301{i:06x}" for i in range(spines)}
    lf = {f"ib-leaf-{i + 1:02d}": f"fc6a1c0302{i:06x}" for i in range(leaves)}
    lid = {name: n + 1 for n, name in enumerate([*sw, *lf])}
    hosts = []  # (host, device, guid, leaf name, leaf port)
    for pod in range(leaves // rails):
        for h in range(hosts_per_leaf):
            host = f"gpu-{pod * hosts_per_leaf + h + 1:03d}"
            for r in range(rails):
                guid = f"a088c203{pod:02x}{h:02x}{r:02x}00"
                hosts.append((host, f"mlx5_{r}", guid, f"ib-leaf-{pod * rails + r + 1:02d}", h + 1))
    hlid = {h[2]: 1000 + n for n, h in enumerate(hosts)}
    out = [
        "#",
        "# Topology file: generated for the layout test",
        "#",
        f"# Initiated from node {hosts[0][2]} port {hosts[0][2]}",
        "",
    ]

    def switch_head(name: str, guid: str) -> list[str]:
        return [
            "vendid=0x2c9",
            "devid=0xd2f2",
            f"sysimgguid=0x{guid}",
            f"switchguid=0x{guid}({guid})",
            f'Switch\t65 "S-{guid}"\t\t# "MF0;{name}:MQM9700/U1" enhanced port 0 lid {lid[name]} lmc 0',
        ]

    leaf_names = list(lf)
    for s_i, (name, guid) in enumerate(sw.items()):
        out += switch_head(name, guid)
        for l_i, leaf in enumerate(leaf_names):
            out.append(f'[{l_i + 1}]\t"S-{lf[leaf]}"[{33 + s_i}]\t\t# "MF0;{leaf}:MQM9700/U1" lid {lid[leaf]} 4xNDR')
        out.append("")
    for l_i, (leaf, guid) in enumerate(lf.items()):
        out += switch_head(leaf, guid)
        for host, dev, hg, on, port in hosts:
            if on == leaf:
                out.append(f'[{port}]\t"H-{hg}"[1]({hg}) \t\t# "{host} {dev}" lid {hlid[hg]} 4xNDR')
        for s_i, (spine, sg) in enumerate(sw.items()):
            out.append(f'[{33 + s_i}]\t"S-{sg}"[{l_i + 1}]\t\t# "MF0;{spine}:MQM9700/U1" lid {lid[spine]} 4xNDR')
        out.append("")
    for host, dev, hg, on, port in hosts:
        out += [
            "vendid=0x2c9",
            "devid=0x1021",
            f"sysimgguid=0x{hg}",
            f"caguid=0x{hg}",
            f'Ca\t1 "H-{hg}"\t\t# "{host} {dev}"',
            f'[1]({hg}) \t"S-{lf[on]}"[{port}]\t\t# lid {hlid[hg]} lmc 0 "MF0;{on}:MQM9700/U1" lid {lid[on]} 4xNDR',
            "",
        ]
    return "\n".join(out)
