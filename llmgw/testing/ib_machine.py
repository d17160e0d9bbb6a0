"""A machine with InfiniBand adapters, for tests on machines without any: a sysfs
tree laid out as the kernel lays out /sys/class/infiniband, and executable
scripts named as infiniband-diags' and perftest's tools that print the
fixtures (tests/fixtures/doctor, fabric, fabric_test) in the formats the real
tools print. Put ``tools.bin`` first on the agent's PATH and ``ib_root`` in
its ``discovery.ib_root``, and the agent runs them as it would the real ones.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures"

# The doctor fixtures' two subnet managers: A the master (LID 1, priority 15), B its standby.
SM_A, SM_B = "0x248a070300f7d3a0", "0x248a070300f7d3c8"


def sminfo_text(failed_over: bool = False) -> str:
    """What `sminfo` prints on a port of the fixtures' subnet: A master, or B after a failover."""
    if failed_over:
        text = (FIXTURES / "doctor" / "sminfo_lid2_standby.txt").read_text()
        return text.replace("state 2 SMINFO_STANDBY", "state 3 SMINFO_MASTER")
    return (FIXTURES / "doctor" / "sminfo_master.txt").read_text()


def smir_text(failed_over: bool = False) -> str:
    """What `saquery SMIR` prints there: the two SMs, their states swapped after a failover."""
    text = (FIXTURES / "doctor" / "saquery_smir_master_standby.txt").read_text()
    if failed_over:
        text = (
            text.replace("SMState...............3", "@")
            .replace("SMState...............2", "SMState...............3")
            .replace("@", "SMState...............2")
        )
    return text


def map_guids(ibnetdiscover: str) -> dict[str, dict[str, str]]:
    """host -> device -> adapter GUID, as an `ibnetdiscover` fixture printed them."""
    from llmgw.server.control import fabric_map

    out: dict[str, dict[str, str]] = {}
    for a in fabric_map.parse_ibnetdiscover(ibnetdiscover).adapters:
        if a.node and a.device:
            out.setdefault(a.node, {})[a.device] = a.guid
    return out


def sysfs_guid(guid: str) -> str:
    """0xa088c2030012f3a0 -> a088:c203:0012:f3a0, as node_guid reads in sysfs."""
    h = guid.removeprefix("0x")
    return ":".join(h[i : i + 4] for i in range(0, 16, 4))


def write_adapter(
    ib_root: Path,
    hca: str,
    node_guid: str,
    *,
    port: int = 1,
    state: str = "4: ACTIVE",
    rate: str = "400 Gb/sec (4X NDR)",
    link_layer: str = "InfiniBand",
    sm_lid: str = "0x1",
    counters: Mapping[str, int] | None = None,
) -> None:
    """One adapter with one port under ``ib_root`` (/sys/class/infiniband)."""
    base = ib_root / hca
    files = {
        "node_guid": sysfs_guid(node_guid),
        "fw_ver": "28.39.1002",
        f"ports/{port}/state": state,
        f"ports/{port}/phys_state": "5: LinkUp" if "ACTIVE" in state else "2: Polling",
        f"ports/{port}/rate": rate,
        f"ports/{port}/link_layer": link_layer,
        f"ports/{port}/lid": "0x1a",
        f"ports/{port}/sm_lid": sm_lid,
        f"ports/{port}/gids/0": "fe80:0000:0000:0000:" + sysfs_guid(node_guid),
    }
    for name, value in (counters or {}).items():
        files[f"ports/{port}/counters/{name}"] = str(value)
    for rel, body in files.items():
        p = base / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(body + "\n")


class Tools:
    """Scripts standing in for the real tools in ``root/bin``; each appends its arguments to
    ``<name>.calls`` there, and reads its fixtures from ``FIXTURES``."""

    def __init__(self, root: Path) -> None:
        self.bin = root / "bin"
        self.bin.mkdir(parents=True, exist_ok=True)

    def add(self, name: str, body: str) -> Path:
        path = self.bin / name
        path.write_text(
            f"#!{sys.executable}\n"
            "import os, pathlib, sys\n"
            f"FIX = pathlib.Path({str(FIXTURES)!r})\n"
            f"HERE = pathlib.Path({str(self.bin)!r})\n"
            f"with open(HERE / {name + '.calls'!r}, 'a') as f:\n"
            "    f.write(' '.join(sys.argv[1:]) + '\\n')\n" + body
        )
        path.chmod(0o755)
        return path

    def calls(self, name: str) -> list[list[str]]:
        f = self.bin / f"{name}.calls"
        return [ln.split() for ln in f.read_text().splitlines()] if f.exists() else []

    def add_diags(self, master_file: Path | None = None) -> None:
        """sminfo and saquery SMIR printing the doctor fixtures' two SMs. With
        ``master_file``, the file holding "B" means the standby took over."""
        pick = (
            f"FAILED_OVER = pathlib.Path({str(master_file)!r}).read_text().strip() == 'B'\n"
            if master_file is not None
            else "FAILED_OVER = False\n"
        )
        use = "from llmgw.testing.ib_machine import sminfo_text, smir_text\n"
        self.add("sminfo", pick + use + "sys.stdout.write(sminfo_text(FAILED_OVER))\n")
        self.add(
            "saquery",
            pick + use + "if 'SMIR' not in sys.argv:\n    sys.exit(1)\nsys.stdout.write(smir_text(FAILED_OVER))\n",
        )

    def add_ibnetdiscover(self, fixture: str = "ibnetdiscover_fat_tree.txt") -> None:
        self.add("ibnetdiscover", f"sys.stdout.write((FIX / 'fabric' / {fixture!r}).read_text())\n")

    def add_ib_write_bw(self, slow: tuple[str, ...] = (), refuse_first: bool = False) -> None:
        """ib_write_bw: the server's report (no host argument), the client's NDR report,
        or the slow rail's on an adapter in ``slow``; with ``refuse_first``, each
        adapter's first client run finds no server listening yet (perftest's words)."""
        self.add(
            "ib_write_bw",
            f"SLOW = {list(slow)!r}\n"
            f"REFUSE_FIRST = {refuse_first!r}\n"
            "args = sys.argv[1:]\n"
            "dev = args[args.index('-d') + 1]\n"
            "client = not args[-1].startswith('-') and args[-2] not in ('-d', '-i', '-p', '-D', '-x')\n"
            "T = FIX / 'fabric_test'\n"
            "if not client:\n"
            "    sys.stdout.write((T / 'ib_ndr_server.stdout').read_text()); sys.exit(0)\n"
            "seen = HERE / f'client-{dev}.count'\n"
            "n = int(seen.read_text()) if seen.exists() else 0\n"
            "seen.write_text(str(n + 1))\n"
            "if REFUSE_FIRST and n == 0:\n"
            "    sys.stdout.write((T / 'retry_1_refused.stdout').read_text())\n"
            "    sys.stderr.write((T / 'retry_1_refused.stderr').read_text()); sys.exit(1)\n"
            "name = 'ib_ndr_slow_client.stdout' if dev in SLOW else 'ib_ndr_client.stdout'\n"
            "sys.stdout.write((T / name).read_text())\n",
        )
