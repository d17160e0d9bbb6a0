"""`llmgw node add [user@]host …`: each machine made a node in the spec's order, each step through ``Steps``.

0. the authority and server.yaml read before any machine is touched;
1. SSH (waits for it; host keys learned once, a changed one refused; sudo checked), the
   host name read with stderr kept apart, the architecture from ``uname -m``;
2. this machine's own frozen ``llmgw`` pushed over SFTP and checked by sha256 there
   (another architecture: the release's binary, checked against its checksums.txt);
3. ``llmgw doctor --json`` there, stopping on a FAIL with each fix before anything changes;
4. which fabric the node's active adapters are on (--fabric, or asked in a terminal);
5. the node's certificate (CN = node id) and the CA, trusted system-wide;
6. agent.yaml with only what the node cannot find for itself, the unit, the agent (re)started;
7. until the node has heartbeated since that restart and has llama.cpp (--wait: and vLLM).
"""

from __future__ import annotations

import asyncio
import platform
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from pydantic import ValidationError

from llmgw.admin_api import AdminAPI
from llmgw.config import ConfigError, ServerConfig, load_server_config
from llmgw.config.agent import DEFAULT_AGENT_CONFIG_PATH
from llmgw.files import SecretFileError, read_secret_file, sha256_file
from llmgw.init import InitError
from llmgw.init.cluster import agent_config_data, agent_config_text, wait_for_node
from llmgw.init.machine import DEFAULT_BINARY
from llmgw.init.units import AGENT_DIRS, AGENT_UNIT, agent_unit_text
from llmgw.onboard import OnboardError
from llmgw.onboard.ssh import DEFAULT_KNOWN_HOSTS, Session, Target, connect
from llmgw.pki import (
    CA_CERT,
    PKIError,
    check_not_admin_name,
    issue_client,
    load_ca,
    load_cert,
    san_names,
    validate_node_id,
)
from llmgw.progress import Status, Steps
from llmgw.protocol.doctor import DoctorReport, Level

ETC = "/etc/llmgw"
REMOTE_CA = f"{ETC}/ca.pem"
REMOTE_CERT = f"{ETC}/agent.pem"
REMOTE_KEY = f"{ETC}/agent-key.pem"
UNIT_PATH = f"/etc/systemd/system/{AGENT_UNIT}"
# Where the CA goes to be trusted system-wide, by family: the directory and the command that reads it.
TRUST = (
    ("/usr/local/share/ca-certificates", "llmgw-ca.crt", "update-ca-certificates"),
    ("/etc/pki/ca-trust/source/anchors", "llmgw-ca.pem", "update-ca-trust"),
)


@dataclass
class Fabric:
    name: str
    hcas: list[str]

    @classmethod
    def parse(cls, text: str) -> Fabric:
        name, sep, hcas = text.partition(":")
        items = [h.strip() for h in hcas.split(",") if h.strip()]
        if not sep or not name.strip() or not items:
            raise OnboardError(f"--fabric {text!r} is not NAME:hca1,hca2 (e.g. ib-a:mlx5_0,mlx5_1)")
        return cls(name.strip(), items)


@dataclass
class AddOptions:
    hosts: list[str]
    port: int = 22
    identity: str | None = None
    fabrics: list[Fabric] = field(default_factory=list)
    ignore_checks: bool = False
    wait_vllm: bool = False
    no_wait: bool = False
    node_id: str | None = None
    server: str | None = None  # the URL agents dial; default this machine's address on the route to each
    pki: Path = Path(f"{ETC}/pki")
    config: Path = Path(f"{ETC}/server.yaml")
    binary: Path | None = None  # this machine's own frozen llmgw
    release_url: str | None = None  # llmgw's releases, for a node of another architecture
    known_hosts: str = DEFAULT_KNOWN_HOSTS
    ssh_wait: float = 120.0
    join_timeout: float = 600.0


@dataclass
class Outcome:
    host: str
    node_id: str | None = None
    error: str | None = None


@dataclass
class ControlPlane:
    """What step 0 reads on this machine before touching any other."""

    cfg: ServerConfig
    cert_names: list[str]
    api: AdminAPI


def read_control_plane(opts: AddOptions, admin: Callable[[str, str | None], AdminAPI] = AdminAPI) -> ControlPlane:
    try:
        load_ca(opts.pki)
    except PKIError as exc:
        raise OnboardError(
            f"the authority in {opts.pki} cannot be read ({exc}); node add runs on the control plane that holds it "
            "(`sudo llmgw node add …` there), or give --pki DIR where it was moved"
        ) from None
    try:
        cfg = load_server_config(opts.config)
    except ConfigError as exc:
        raise OnboardError(
            f"{opts.config}: {exc}; node add runs on a control plane made by `llmgw server init`"
        ) from None
    if cfg.agent_tls is None or not cfg.control.enabled:
        raise OnboardError(f"{opts.config} has no agent_tls or control plane: agents could not join it")
    try:
        names = san_names(load_cert(cfg.agent_tls.cert))
    except PKIError as exc:
        raise OnboardError(f"the server certificate {cfg.agent_tls.cert}: {exc}") from None
    from llmgw.config.server import ADMIN_TOKEN_FILE

    try:
        token: str | None = read_secret_file(Path(cfg.data_path) / ADMIN_TOKEN_FILE)
    except SecretFileError:
        token = None
    host = cfg.admin_listen.connect_host
    url = f"http://{f'[{host}]' if ':' in host else host}:{cfg.admin_listen.port}"
    return ControlPlane(cfg, names, admin(url, token))


def route_address(host: str) -> str:
    """This machine's address on the route to ``host`` (what the kernel would send from)."""
    try:
        infos = socket.getaddrinfo(host, 22, type=socket.SOCK_DGRAM)
    except OSError as exc:
        raise OnboardError(f"cannot resolve {host} ({exc}); give its address") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect(addr)  # UDP: no packet is sent, the route is looked up
        except OSError as exc:
            raise OnboardError(f"no route to {host} ({exc})") from None
        return str(s.getsockname()[0])


def dial_url(cp: ControlPlane, opts: AddOptions, host: str) -> str:
    """The URL the node's agent dials, its host checked against the server certificate first."""
    port = cp.cfg.agent_listen.port
    if opts.server:
        url = opts.server if "://" in opts.server else f"https://{opts.server}"
        from urllib.parse import urlsplit

        parts = urlsplit(url)
        dialled = parts.hostname or ""
        if parts.port is None:
            url = f"{parts.scheme}://{f'[{dialled}]' if ':' in dialled else dialled}:{port}{parts.path}"
    else:
        dialled = route_address(host)
        url = f"https://{f'[{dialled}]' if ':' in dialled else dialled}:{port}"
    if dialled not in cp.cert_names:
        raise OnboardError(
            f"{dialled}, the address {host} would dial, is not in the certificate {cp.cfg.agent_tls.cert if cp.cfg.agent_tls else ''} "
            f"(it names {', '.join(cp.cert_names)}); run `sudo llmgw server init --host {dialled}`, or give "
            "--server with a name it holds"
        )
    return url


def own_binary(explicit: Path | None) -> Path:
    import sys

    if explicit is not None:
        return explicit
    if getattr(sys, "frozen", False):
        return Path(sys.executable).resolve()
    raise OnboardError(
        "node add pushes this machine's own frozen llmgw, and this one runs from Python; run the executable "
        "`scripts/build-binary` makes (installed as /usr/local/bin/llmgw by the release)"
    )


def uname_to_release(machine: str) -> str:
    return {"aarch64": "arm64", "arm64": "arm64", "x86_64": "x86_64", "amd64": "x86_64"}.get(machine, machine)


def release_binary(url: str, arch: str, cache: Path) -> Path:
    """llmgw's release for ``arch`` from ``url`` (llmgw-linux-<arch> and checksums.txt), checked, cached."""
    name = f"llmgw-linux-{arch}"
    base = url.rstrip("/")
    try:
        sums = httpx.get(f"{base}/checksums.txt", timeout=30, follow_redirects=True)
        sums.raise_for_status()
    except httpx.HTTPError as exc:
        raise OnboardError(f"{base}/checksums.txt: {exc}") from None
    want = next((ln.split()[0] for ln in sums.text.splitlines() if ln.split()[1:2] in ([name], [f"*{name}"])), None)
    if want is None:
        raise OnboardError(f"{base}/checksums.txt lists no {name}: that release has no build for {arch}")
    target = cache / f"{name}-{want[:16]}"
    if target.is_file() and sha256_file(target) == want:
        return target
    cache.mkdir(parents=True, exist_ok=True)
    part = target.with_name(target.name + ".part")
    try:
        with httpx.stream("GET", f"{base}/{name}", timeout=60, follow_redirects=True) as r:
            r.raise_for_status()
            with open(part, "wb") as f:
                for chunk in r.iter_bytes(1 << 20):
                    f.write(chunk)
    except httpx.HTTPError as exc:
        raise OnboardError(f"{base}/{name}: {exc}") from None
    if sha256_file(part) != want:
        part.unlink()
        raise OnboardError(f"{base}/{name} does not match its checksum in checksums.txt; nothing was pushed")
    part.rename(target)
    return target


def fabric_groups(report: DoctorReport) -> dict[str, list[str]]:
    """The node's active adapters grouped by what they report: the subnet manager's GUID for InfiniBand
    (the lowest among those listed together, which survives a master change), the IP network for RoCE."""
    groups: dict[str, list[str]] = {}
    inv = report.facts.inventory
    sms = (
        {(p.hca, p.port): p for p in (report.facts.subnet_managers.ports or [])} if report.facts.subnet_managers else {}
    )
    for p in inv.ib_ports if inv else []:
        if p.state != "ACTIVE":
            continue
        if (p.link_layer or "").lower() == "ethernet":
            key = f"RoCE network {p.network or p.netdev or 'unknown'}"
        else:
            sm = sms.get((p.hca, p.port))
            guids = sorted(m.guid for m in (sm.managers or []) if m.guid) if sm else []
            if not guids and sm and sm.master and sm.master.guid:
                guids = [sm.master.guid]
            key = f"InfiniBand subnet manager {guids[0]}" if guids else f"InfiniBand subnet {p.gid_prefix or 'unknown'}"
        if p.hca not in groups.setdefault(key, []):
            groups[key].append(p.hca)
    return groups


class Adder:
    """Adds the machines in turn; what a name given for one fabric group is reused for the next node."""

    def __init__(self, opts: AddOptions, steps: Steps, cp: ControlPlane) -> None:
        self.opts = opts
        self.steps = steps
        self.cp = cp
        self.fabric_names: dict[str, str] = {}

    def step(self, host: str, title: str) -> str:
        key = f"{host} {title}"
        self.steps.begin(key, title)
        return key

    @contextmanager
    def failing(self, key: str) -> Iterator[None]:
        """The step ``key`` marked FAILED with the reason when what runs inside stops the host."""
        try:
            yield
        except (OnboardError, InitError) as exc:
            self.steps.end(key, Status.FAILED, str(exc))
            raise OnboardError(str(exc)) from None

    async def add(self, text: str) -> Outcome:
        target = Target.parse(text, self.opts.port)
        out = Outcome(target.host)
        key = self.step(target.host, "address")
        with self.failing(key):
            url = dial_url(self.cp, self.opts, target.host)
        self.steps.end(key, Status.KEPT, f"its agent will dial {url} (in the server certificate)")
        key = self.step(target.host, "ssh")
        with self.failing(key):
            session, learned = await connect(
                target, identity=self.opts.identity, known_hosts=self.opts.known_hosts, wait=self.opts.ssh_wait
            )
        try:
            return await self._on(session, target, url, out, key, learned)
        finally:
            await session.close()

    async def _on(self, s: Session, target: Target, url: str, out: Outcome, key: str, learned: str | None) -> Outcome:
        host = target.host
        with self.failing(key):
            await s.check_sudo()
            hostname = (await s.must("hostname", "reading the host name")).strip()
            machine = (await s.must("uname -m", "reading the architecture")).strip()
        node_id = self.opts.node_id or hostname
        try:
            # A host named like an administrator is stopped here, before anything on it changes.
            check_not_admin_name(validate_node_id(node_id), self.cp.cfg.admin_names)
        except PKIError as exc:
            self.steps.end(key, Status.FAILED, f"{exc}; give --node ID")
            raise OnboardError(f"{host}: {exc}; give --node ID") from None
        out.node_id = node_id
        words = [f"connected as {target.user}" + (" (sudo)" if s.sudo else ""), f"host name {hostname}", machine]
        if learned:
            words.insert(1, learned)
        self.steps.end(key, Status.KEPT, "; ".join(words))

        # 2. this machine's llmgw, or the release's for another architecture
        key = self.step(host, "llmgw")
        with self.failing(key):
            local = own_binary(self.opts.binary)
            here = uname_to_release(platform.machine())
            there = uname_to_release(machine)
            if there != here:
                if not self.opts.release_url:
                    raise OnboardError(
                        f"{host} is {machine} and this llmgw is built for {platform.machine()}; give --release-url URL "
                        f"where llmgw's release for {machine} is (llmgw-linux-{there} and checksums.txt)"
                    )
                local = release_binary(self.opts.release_url, there, Path(tempfile.gettempdir()) / "llmgw-releases")
            sent = await s.push(local, DEFAULT_BINARY)
        sha = sha256_file(local)[:12]
        self.steps.end(
            key,
            Status.CHANGED if sent else Status.KEPT,
            (
                f"pushed {local.name} to {DEFAULT_BINARY} (sha256 {sha}… checked there)"
                if sent
                else f"{DEFAULT_BINARY} is already this llmgw (sha256 {sha}…)"
            ),
        )

        # 3. doctor, before anything is changed
        key = self.step(host, "doctor")
        report = await self._doctor(s, host, key)

        # 4. fabrics
        key = self.step(host, "fabric")
        fabrics = self._fabrics(report, host, key)

        # 5. certificate and CA
        key = self.step(host, "certificate")
        with self.failing(key):
            await self._certificate(s, node_id)
        self.steps.end(
            key, Status.CHANGED, f"installed {REMOTE_CERT} for {node_id} and the cluster's CA (trusted system-wide)"
        )

        # 6. agent.yaml, the unit, the agent
        key = self.step(host, "agent")
        with self.failing(key):
            since = await self._agent(s, url, node_id if node_id != hostname else None, fabrics)
        self.steps.end(
            key, Status.CHANGED, f"wrote {DEFAULT_AGENT_CONFIG_PATH} and {UNIT_PATH}; (re)started {AGENT_UNIT}"
        )

        # 7. joined
        key = self.step(host, "join")
        if self.opts.no_wait:
            self.steps.end(key, Status.SKIPPED, "not waited for (--no-wait); see `llmgw ctl nodes`")
            return out
        engines = ("llamacpp", "vllm") if self.opts.wait_vllm else ("llamacpp",)
        with self.failing(key):
            row = await asyncio.to_thread(
                wait_for_node,
                self.cp.api,
                node_id,
                since,
                self.steps,
                key,
                engines=engines,
                timeout=self.opts.join_timeout,
            )
        versions = ", ".join(f"{e} {(row.engines or {}).get(e, '')}".strip() for e in engines)
        self.steps.end(key, Status.KEPT, f"{node_id} joined ({row.state}) with {versions}")
        return out

    async def _doctor(self, s: Session, host: str, key: str) -> DoctorReport:
        r = await s.run(f"{DEFAULT_BINARY} doctor --json", timeout=120)
        try:
            report = DoctorReport.model_validate_json(r.stdout)
        except (ValidationError, ValueError):
            msg = f"`llmgw doctor --json` on {host} gave no report (exit {r.status}): {r.words()}"
            self.steps.end(key, Status.FAILED, msg)
            raise OnboardError(msg) from None
        fails = [f for f in report.findings if f.level == Level.FAIL]
        warns = [f for f in report.findings if f.level == Level.WARN]
        listing = "; ".join(
            f"{f.level.value} {f.area}: {f.message}" + (f" (fix: {f.fix})" if f.fix else "") for f in fails + warns
        )
        if not fails:
            self.steps.end(key, Status.WARNED if warns else Status.KEPT, listing or "nothing to fix")
            return report
        if self.opts.ignore_checks:
            self.steps.end(key, Status.WARNED, f"going on past it (--ignore-checks): {listing}")
            return report
        answer = self.steps.ask(
            f"doctor found {len(fails)} problem(s) on {host}: {listing}. Go on anyway?", ["stop", "go on"], "stop"
        )
        if answer == "go on":
            self.steps.end(key, Status.WARNED, f"going on past it (asked): {listing}")
            return report
        msg = f"doctor on {host} found what must be fixed first, before anything was changed: {listing}. Fix it and run node add again, or give --ignore-checks"
        self.steps.end(key, Status.FAILED, msg)
        raise OnboardError(msg)

    def _fabrics(self, report: DoctorReport, host: str, key: str) -> list[dict[str, Any]]:
        if self.opts.fabrics:
            decl = [{"name": f.name, "hcas": f.hcas} for f in self.opts.fabrics]
            self.steps.end(
                key, Status.KEPT, "declared " + "; ".join(f"{f.name}: {', '.join(f.hcas)}" for f in self.opts.fabrics)
            )
            return decl
        groups = fabric_groups(report)
        if not groups:
            self.steps.end(key, Status.SKIPPED, "no active InfiniBand or RoCE adapter")
            return []
        decl = []
        undeclared = []
        for group, hcas in groups.items():
            name = self.fabric_names.get(group)
            if name is None:
                name = self.steps.ask(
                    f"{host}: which fabric are {', '.join(hcas)} on ({group})? A name, the same on every node on it; "
                    "empty to leave them undeclared",
                    [],
                    "",
                )
                if name is None:  # nobody to ask
                    undeclared.append(f"{', '.join(hcas)} ({group})")
                    continue
                name = name.strip()
                self.fabric_names[group] = name
            if name:
                decl.append({"name": name, "hcas": hcas})
        words = "; ".join(f"{d['name']}: {', '.join(d['hcas'])}" for d in decl)
        if undeclared:
            self.steps.end(
                key,
                Status.WARNED,
                (f"declared {words}; " if words else "")
                + f"active but undeclared: {'; '.join(undeclared)} — give --fabric NAME:hca,… to use them for multi-node replicas",
            )
        else:
            self.steps.end(
                key, Status.KEPT if decl else Status.SKIPPED, f"declared {words}" if decl else "left undeclared"
            )
        return decl

    async def _certificate(self, s: Session, node_id: str) -> None:
        with tempfile.TemporaryDirectory(prefix="llmgw-node-cert-") as tmp:
            issue_client(self.opts.pki, tmp, node_id, admin_names=self.cp.cfg.admin_names)
            cert = (Path(tmp) / f"{node_id}.pem").read_bytes()
            key = (Path(tmp) / f"{node_id}-key.pem").read_bytes()
        ca = (self.opts.pki / CA_CERT).read_bytes()
        await s.write(REMOTE_CA, ca, 0o644)
        await s.write(REMOTE_CERT, cert, 0o644)
        await s.write(REMOTE_KEY, key, 0o600)
        for directory, name, command in TRUST:
            r = await s.run(f"test -d {directory} && command -v {command}")
            if r.ok:
                await s.write(f"{directory}/{name}", ca, 0o644)
                await s.must(command, "trusting the cluster's CA system-wide")
                break

    async def _agent(self, s: Session, url: str, node_id: str | None, fabrics: list[dict[str, Any]]) -> float:
        data = agent_config_data(
            [url], ca=REMOTE_CA, cert=REMOTE_CERT, key=REMOTE_KEY, node_id=node_id, fabrics=fabrics or None
        )
        await s.write(DEFAULT_AGENT_CONFIG_PATH, agent_config_text(data, "node add").encode(), 0o644)
        await s.write(UNIT_PATH, agent_unit_text(binary=DEFAULT_BINARY).encode(), 0o644)
        dirs = " ".join(AGENT_DIRS)
        await s.must(
            f"mkdir -p {dirs} && systemctl daemon-reload && systemctl enable --quiet {AGENT_UNIT}",
            f"enabling {AGENT_UNIT}",
        )
        # A heartbeat after this moment is the new agent's: the wait counts only those.
        since = time.time()
        await s.must(f"systemctl restart {AGENT_UNIT}", f"starting {AGENT_UNIT}")
        return since


def add_nodes(opts: AddOptions, steps: Steps, admin: Callable[[str, str | None], AdminAPI] = AdminAPI) -> list[Outcome]:
    """Every host in turn, then a summary; the outcomes say which were added."""
    if opts.node_id and len(opts.hosts) > 1:
        raise OnboardError("--node names one node; add the hosts one at a time to give each its id")
    key = "authority"
    steps.begin(key, "authority and server.yaml")
    try:
        cp = read_control_plane(opts, admin)
    except OnboardError as exc:
        steps.end(key, Status.FAILED, str(exc))
        raise
    if opts.node_id:
        # Said before any SSH: the id given cannot be a node's, whichever machine it is for.
        try:
            check_not_admin_name(validate_node_id(opts.node_id), cp.cfg.admin_names)
        except PKIError as exc:
            steps.end(key, Status.FAILED, f"--node {opts.node_id}: {exc}")
            raise OnboardError(f"--node {opts.node_id}: {exc}") from None
    steps.end(key, Status.KEPT, f"read the authority in {opts.pki} and {opts.config}")
    adder = Adder(opts, steps, cp)
    outcomes: list[Outcome] = []
    for text in opts.hosts:
        try:
            outcomes.append(asyncio.run(adder.add(text)))
        except OnboardError as exc:
            outcomes.append(Outcome(text.rpartition("@")[2], error=str(exc)))
    added = [o.node_id or o.host for o in outcomes if o.error is None]
    failed = [o for o in outcomes if o.error is not None]
    steps.note(f"added: {', '.join(added) if added else 'none'}")
    for o in failed:
        steps.note(f"not added: {o.host}: {o.error}")
    if failed:
        steps.note("Fix what is said and run node add again for those: a rerun is safe on every machine.")
    return outcomes
