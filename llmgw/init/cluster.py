"""The steps of `server init` past the control plane itself: the mirror beside it, llama.cpp in that
mirror, this machine as a node, the starter model. Each looks before it acts, like those in steps.py.

Nodes need nothing from the internet: the control plane obtains llama.cpp once
(GitHub's release through the mirror, the archive the operator gave with
``--llamacpp-archive``, or a build from source) and its mirror offers it under
the names agents ask for, with its sha256; ``engines.release_url`` points there.
"""

from __future__ import annotations

import hashlib
import platform
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from llmgw.admin_api import AdminAPI, AdminAPIError
from llmgw.agent.provision.archive import ArchiveError, find_llama_server_in, pack_llama_server
from llmgw.agent.provision.host import HostFacts
from llmgw.agent.provision.llamacpp_release import DEFAULT_BASE_URL, choose_build
from llmgw.agent.provision.status import ProvisionError
from llmgw.config import ServerConfig
from llmgw.config.agent import DEFAULT_AGENT_CONFIG_PATH
from llmgw.config.server import ADMIN_TOKEN_FILE
from llmgw.files import SecretFileError, read_secret_file, write_atomic
from llmgw.init import InitError
from llmgw.init.machine import USER, Machine
from llmgw.init.plan import (
    CONTROL_PLANE_LABEL,
    ENGINE_MODEL,
    MIRROR_API,
    MIRROR_API_LISTEN,
    MirrorPlan,
    bracket,
    plan_of,
    primary_address,
)
from llmgw.init.steps import Done, await_health
from llmgw.init.units import AGENT_DIRS, AGENT_UNIT, agent_unit_text
from llmgw.mirror.layout import MirrorError
from llmgw.mirror.systemd import UNIT_NAME as MIRROR_UNIT
from llmgw.mirror.systemd import init_mirror
from llmgw.pki import (
    CA_CERT,
    PKIError,
    client_kind,
    common_name,
    issue_client,
    load_cert,
    load_pair,
    near_end,
    verify_issued_by,
)
from llmgw.progress import Steps
from llmgw.protocol.admin import ModelAddRequest, ModelReply, ModelsReply, NodeRow, NodesReply, ReplicasReply
from llmgw.units import write_unit
from llmgw.up.model import (
    STARTER_FILE,
    STARTER_NAME,
    STARTER_SOURCE,
    STARTER_VERSION,
    TINY_NAME,
    TINY_VERSION,
    TINY_WORDS,
    fetch_into_mirror,
    place_in_mirror,
)
from llmgw.up.tiny_model import tiny_model_path

# ------------------------------------------------------------------ the mirror beside it


def mirror(m: Machine, cfg: ServerConfig, *, manage_user: bool) -> Done:
    """The mirror server.yaml names: beside this machine (user, /srv/models, token, unit started,
    its API answering), or another machine's (its token copied here and its API answering)."""
    plan = plan_of(m, cfg)
    if plan.api is None:
        return Done("mirror", "skipped", "none: server.yaml names no mirror (--no-mirror)")
    if not plan.here:
        tf = plan.token_file
        if tf and not Path(tf).exists():
            raise InitError(
                f"the mirror at {plan.api} needs its management API token here: copy the file beside its directory "
                f"on the mirror machine (/srv/models.api-token) to {tf}, mode 0600, owned by {USER}, "
                "and run init again"
            )
        if tf:
            m.give(Path(tf))
        health = f"{plan.api}/v1/health"
        if not m.health(health):
            raise InitError(
                f"the mirror's API at {plan.api} does not answer ({health}); start it there, or check the URL"
            )
        return Done("mirror", "kept", f"using the mirror at {plan.api} (its API answers)")
    assert plan.dir is not None and plan.base is not None

    def run(argv: list[str]) -> tuple[int, str]:
        # Not as root for real (--root trials): the user and its files are left alone, as in step 1.
        if not manage_user and argv[0] in ("id", "useradd", "chown"):
            return 0, ""
        return m.run(argv)

    try:
        res = init_mirror(
            control_plane="127.0.0.1",
            dir=str(plan.dir),
            unit_path=str(m.units / MIRROR_UNIT),
            user=USER,
            base=plan.base,
            binary=m.binary,
            run=run,
            api_listen=MIRROR_API_LISTEN,
            start=m.systemd,
        )
    except MirrorError as exc:
        raise InitError(f"the mirror beside the control plane: {exc}") from None
    words = [*res.changed] or ["kept /srv/models, its API token and its unit"]
    if m.systemd:
        await_health(m, f"{MIRROR_API}/v1/health", MIRROR_UNIT)
        words.append(f"serving {plan.base} to nodes, its API on {MIRROR_API}")
    else:
        words.append(f"not started: systemd is not running here; start {MIRROR_UNIT} where it runs")
    return Done("mirror", "changed" if res.changed else "kept", "; ".join(words))


# ------------------------------------------------------------------ llama.cpp in the mirror


def go_arch(machine: str) -> str:
    """uname -m as llama.cpp's release names call it (amd64/arm64, HostFacts' spelling)."""
    return {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(machine, machine)


def cpu_asset_stem(tag: str, arch: str) -> str:
    """The CPU archive an agent on ``arch`` asks for (without suffix): the agent's own naming."""
    try:
        return choose_build(tag, HostFacts(arch=arch), "cpu").assets[0]
    except ProvisionError as exc:
        raise InitError(f"llama.cpp {tag}: {exc}") from None


def _archive_suffix(name: str) -> str:
    return ".zip" if name.endswith(".zip") else ".tar.gz"


def _sidecar(path: Path, sha: str) -> None:
    write_atomic(path.with_name(path.name + ".sha256"), f"{sha}  {path.name}\n".encode(), 0o644)


def _present(vdir: Path, stem: str) -> Path | None:
    for suffix in (".tar.gz", ".zip"):
        p = vdir / (stem + suffix)
        if p.is_file() and p.with_name(p.name + ".sha256").is_file():
            return p
    return None


def _place(m: Machine, vdir: Path, name: str, data: bytes) -> str:
    vdir.mkdir(parents=True, exist_ok=True)
    target = vdir / name
    sha = hashlib.sha256(data).hexdigest()
    write_atomic(target, data, 0o644)
    _sidecar(target, sha)
    for p in (vdir.parent, vdir, target, target.with_name(target.name + ".sha256")):
        m.give(p)
    return sha


BuildFromSource = Callable[[Callable[[str, float | None], None]], Path]


def _source_build(progress: Callable[[str, float | None], None]) -> Path:
    from llmgw.agent.provision.llamacpp_source import build_llama_server

    return build_llama_server(progress)


def llamacpp(
    m: Machine,
    cfg: ServerConfig,
    steps: Steps,
    key: str,
    *,
    archive: str | None,
    token: Callable[[], str | None],
    build_from_source: BuildFromSource | None = None,
) -> Done:
    """llama.cpp's release archive for this machine's architecture in the mirror, with its sha256, where
    ``engines.release_url`` says: the given archive, else GitHub's through the mirror, else a source build."""
    plan = plan_of(m, cfg)
    tag = cfg.engines.llamacpp
    if not tag:
        return Done("llama.cpp", "skipped", "engines.llamacpp is empty in server.yaml: engines are installed by hand")
    if not plan.here or plan.dir is None or not plan.release_url or cfg.engines.release_url != plan.release_url:
        where = cfg.engines.release_url or DEFAULT_BASE_URL
        if archive:
            raise InitError(
                f"--llamacpp-archive needs the mirror beside the control plane, and server.yaml's "
                f"engines.release_url is {where}; put the archive on that mirror as {ENGINE_MODEL}/{tag}/<asset>"
            )
        return Done("llama.cpp", "skipped", f"nodes install llama.cpp {tag} from {where}")
    arch = go_arch(platform.machine())
    stem = cpu_asset_stem(tag, arch)
    vdir = plan.dir / ENGINE_MODEL / tag
    have = _present(vdir, stem)
    if have is not None and not archive:
        return Done("llama.cpp", "kept", f"kept {have.name} in the mirror ({plan.release_url}/{tag}/)")
    if archive:
        src = Path(archive).expanduser()
        if not src.is_file():
            raise InitError(f"--llamacpp-archive {archive}: no such file")
        with tempfile.TemporaryDirectory(prefix="llmgw-archive-") as scratch:
            try:
                find_llama_server_in(src, Path(scratch))
            except (ArchiveError, ProvisionError) as exc:
                raise InitError(f"--llamacpp-archive {archive}: {exc}") from None
        data = src.read_bytes()
        name = stem + _archive_suffix(src.name)
        target = vdir / name
        if target.is_file() and target.read_bytes() == data and _present(vdir, stem) == target:
            return Done("llama.cpp", "kept", f"kept {name} in the mirror: the same as {archive}")
        sha = _place(m, vdir, name, data)
        return Done(
            "llama.cpp", "made", f"put {archive} into the mirror as {ENGINE_MODEL}/{tag}/{name} (sha256 {sha[:12]}…)"
        )
    if not m.health(f"{MIRROR_API}/v1/health"):
        if not m.systemd:
            return Done(
                "llama.cpp",
                "skipped",
                "not fetched: the mirror is not running here (no systemd); rerun init where it runs, "
                "or give --llamacpp-archive FILE",
            )
        raise InitError(f"the mirror's API at {MIRROR_API} does not answer; see `journalctl -u {MIRROR_UNIT}`")
    # GitHub's release, fetched by the mirror (it records the checksum and serves the sidecar).
    url = f"{DEFAULT_BASE_URL}/{tag}/{stem}.tar.gz"
    notes: list[str] = []

    def progress(done: int, total: int | None) -> None:
        steps.progress(key, done, total, f"fetching {stem}.tar.gz")

    got = fetch_into_mirror(MIRROR_API, plan.base or "", url, ENGINE_MODEL, tag, progress, notes.append, token=token())
    if got is not None:
        return Done("llama.cpp", "made", f"the mirror fetched {url} ({plan.release_url}/{tag}/)")
    # Releases out of reach: build llama-server from source (PyPI's llama-cpp-python sdist) and offer it.
    why = notes[-1] if notes else "the mirror could not fetch it"
    try:
        binary = (build_from_source or _source_build)(
            lambda phase, pct: steps.progress(key, int(pct or 0), 100, f"building llama.cpp: {phase}")
        )
    except (ProvisionError, OSError) as exc:
        raise InitError(
            f"llama.cpp {tag} could not be had: {why}; and building it from source failed: {exc}. Give a release "
            f"archive with --llamacpp-archive FILE (e.g. {stem}.tar.gz from {DEFAULT_BASE_URL}/{tag}/, copied here)"
        ) from None
    data = pack_llama_server(binary, tag)
    name = stem + ".tar.gz"
    sha = _place(m, vdir, name, data)
    return Done(
        "llama.cpp",
        "warned",
        f"{why}; built llama-server from source and put it into the mirror as {ENGINE_MODEL}/{tag}/{name} "
        f"(sha256 {sha[:12]}…)",
    )


# ------------------------------------------------------------------ this machine as a node


def admin_api(m: Machine, cfg: ServerConfig) -> AdminAPI:
    host = cfg.admin_listen.connect_host
    token_path = Path(cfg.data_path) / ADMIN_TOKEN_FILE
    try:
        token: str | None = read_secret_file(token_path)
    except SecretFileError:
        token = None
    return m.admin(f"http://{bracket(host)}:{cfg.admin_listen.port}", token)


def nvidia_note(m: Machine) -> str:
    """What the NVIDIA driver says, when there is a card: a card whose driver does not answer is named."""
    rc, out = m.run(["nvidia-smi", "-L"])
    if rc == 0:
        gpus = [line for line in out.splitlines() if line.startswith("GPU ")]
        return f"{len(gpus)} NVIDIA GPU(s)" if gpus else ""
    rc_pci, pci = m.run(["lspci", "-nn"])
    card = rc_pci == 0 and any(
        "NVIDIA" in line and ("3D controller" in line or "VGA" in line) for line in pci.splitlines()
    )
    if card:
        return "an NVIDIA card is on the PCI bus but its driver does not answer (nvidia-smi); install the driver and run init again to serve on it"
    return ""


def agent_config_data(
    servers: list[str],
    *,
    ca: str,
    cert: str,
    key: str,
    node_id: str | None = None,
    labels: dict[str, str] | None = None,
    fabrics: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """agent.yaml with only what the node cannot find for itself (node id, addresses, engines it finds)."""
    data: dict[str, Any] = {"server": servers[0]} if len(servers) == 1 else {"servers": servers}
    data["tls"] = {"ca": ca, "cert": cert, "key": key}
    if node_id:
        data["node_id"] = node_id
    if labels:
        data["labels"] = labels
    if fabrics:
        data["fabrics"] = fabrics
    return data


AGENT_HEADER = (
    "# Written by llmgw ({by}); only what this node cannot find for itself. Every key: docs/configuration.md.\n"
)


def agent_config_text(data: dict[str, Any], by: str) -> str:
    return AGENT_HEADER.format(by=by) + yaml.safe_dump(data, sort_keys=False)


def agent_certificate(pki: Path, etc: Path, node_id: str, admin_names: frozenset[str]) -> str | None:
    """etc/agent.pem and agent-key.pem for ``node_id`` from the authority; None when the ones there are
    already right (issued by it, for this node, marked a node's, not near their end), else what was done.
    ``node_id`` in ``admin_names`` is refused (PKIError) before anything is written."""
    cert, key = etc / "agent.pem", etc / "agent-key.pem"
    if cert.exists() and key.exists():
        try:
            verify_issued_by(pki / CA_CERT, cert)
            load_pair(cert, key)
            c = load_cert(cert)
            # One issued before node certificates were marked is issued again, marked.
            if common_name(c) == node_id and client_kind(c) == "node" and not near_end(c):
                return None
        except PKIError:
            pass
    with tempfile.TemporaryDirectory(dir=etc, prefix=".agent-cert-") as tmp:
        issue_client(pki, tmp, node_id, admin_names=admin_names)
        shutil.move(str(Path(tmp) / f"{node_id}-key.pem"), key)
        shutil.move(str(Path(tmp) / f"{node_id}.pem"), cert)
    key.chmod(0o600)
    return f"issued {cert} for {node_id}"


def wait_for_node(
    api: AdminAPI,
    node_id: str,
    since: float,
    steps: Steps,
    key: str,
    *,
    engines: tuple[str, ...] = ("llamacpp",),
    timeout: float,
    interval: float = 1.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> NodeRow:
    """Until ``node_id`` has heartbeated since ``since`` (wall clock) and has ``engines`` installed.

    Joining means a heartbeat since the restart: a node re-added would otherwise count at once.
    An engine install that failed stops the wait with the agent's own reason.
    """
    deadline = clock() + timeout
    row: NodeRow | None = None
    while True:
        try:
            rows = api.call("GET", "/api/v1/nodes", NodesReply).nodes
        except AdminAPIError as exc:
            rows = []
            last_error = str(exc)
        else:
            last_error = ""
        row = next((r for r in rows if r.node_id == node_id), None)
        joined = row is not None and bool(row.connected) and (row.last_seen or 0) >= since
        if joined and row is not None:
            missing = [e for e in engines if e not in (row.engines or {})]
            if not missing:
                return row
            for e in missing:
                st = (row.provision or {}).get(e)
                if st is None:
                    continue
                if st.state == "failed":
                    raise InitError(
                        f"{node_id} could not install {e}: {st.detail or 'no reason given'}; see "
                        f"`journalctl -u {AGENT_UNIT}` on it"
                    )
                if st.progress is not None:
                    steps.progress(key, st.progress.bytes_done, st.progress.bytes_total, f"{node_id} installs {e}")
        if clock() > deadline:
            if not joined:
                why = f" (the admin API: {last_error})" if last_error else ""
                raise InitError(
                    f"{node_id} did not join within {timeout:g} s{why}; see `journalctl -u {AGENT_UNIT} -n 50` on it: "
                    "usually it cannot reach the control plane's agent port"
                )
            raise InitError(
                f"{node_id} joined but did not install {', '.join(engines)} within {timeout:g} s; see "
                f"`llmgw ctl nodes` and `journalctl -u {AGENT_UNIT}` on it"
            )
        sleep(interval)


def this_node(m: Machine, cfg: ServerConfig, steps: Steps, key: str, *, hosts: list[str]) -> Done:
    """This machine as a node: its certificate, agent.yaml labelled as the control plane, the agent unit
    started; then until it registers and has llama.cpp."""
    node_id = m.names[0]
    words: list[str] = []
    gpu = nvidia_note(m)
    try:
        issued = agent_certificate(m.pki, m.etc, node_id, cfg.admin_names)
    except PKIError as exc:
        raise InitError(
            f"this machine cannot be a node under its host name: {exc}; or run server init with --no-node and "
            "add this machine with `llmgw node add --node ID`"
        ) from None
    if issued:
        words.append(issued)
    server = f"https://{bracket(primary_address(m, hosts))}:{cfg.agent_listen.port}"
    data = agent_config_data(
        [server],
        ca=str(m.etc / CA_CERT),
        cert=str(m.etc / "agent.pem"),
        key=str(m.etc / "agent-key.pem"),
        labels={CONTROL_PLANE_LABEL: "true"},
    )
    path = m.path(DEFAULT_AGENT_CONFIG_PATH)
    if path.exists():
        words.append(f"kept {path} (never overwritten)")
    else:
        write_atomic(path, agent_config_text(data, "server init").encode(), 0o644)
        words.append(f"wrote {path} (dials {server})")
    for d in AGENT_DIRS:
        m.path(d).mkdir(parents=True, exist_ok=True)
    unit = m.units / AGENT_UNIT
    wrote = write_unit(unit, agent_unit_text(binary=m.binary, config=DEFAULT_AGENT_CONFIG_PATH))
    if wrote:
        words.append(f"{wrote} {unit}")
    if not m.systemd:
        words.append(f"not started: systemd is not running here; start {AGENT_UNIT} where it runs")
        return Done("node", "made" if (issued or wrote) else "kept", "; ".join(words))
    if wrote:
        _must(m, ["systemctl", "daemon-reload"], "reloading systemd")
    since = time.time()
    active = m.run(["systemctl", "is-active", "--quiet", AGENT_UNIT])[0] == 0
    if not active:
        _must(m, ["systemctl", "enable", "--now", AGENT_UNIT], f"starting {AGENT_UNIT}")
        words.append(f"started {AGENT_UNIT}")
    elif issued or wrote:
        _must(m, ["systemctl", "restart", AGENT_UNIT], f"restarting {AGENT_UNIT}")
        words.append(f"restarted {AGENT_UNIT}")
    else:
        since = 0.0  # nothing changed: the running agent counts
    row = wait_for_node(admin_api(m, cfg), node_id, since, steps, key, timeout=m.node_timeout)
    version = (row.engines or {}).get("llamacpp", "")
    words.append(f"{node_id} joined with llama.cpp {version}".rstrip())
    if gpu:
        words.append(gpu)
    changed = bool(issued or wrote or not active)
    status = "warned" if "does not answer" in gpu else ("changed" if changed else "kept")
    return Done("node", status, "; ".join(words))


def _must(m: Machine, argv: list[str], doing: str) -> None:
    rc, out = m.run(argv)
    if rc != 0:
        raise InitError(f"{doing} failed ({' '.join(argv)}): {out or f'exit status {rc}'}")


# ------------------------------------------------------------------ the starter model


def starter_model(
    m: Machine, cfg: ServerConfig, steps: Steps, key: str, *, node_here: bool, offline: bool = False
) -> Done:
    """The starter model in the mirror (the tiny test model when it cannot be had) and in the catalog:
    a llama.cpp profile per GPU class this node has and a CPU one as the fallback, pinned to this
    node (unpinned without one); then until it serves, when it is pinned here."""
    api = admin_api(m, cfg)
    plan = plan_of(m, cfg)
    try:
        catalog = api.call("GET", "/api/v1/models", ModelsReply).models
    except AdminAPIError as exc:
        raise InitError(f"the catalog: {exc}") from None
    known = {c.name for c in catalog}
    for name in (STARTER_NAME, TINY_NAME):
        if name in known:
            if node_here:
                _wait_serving(api, name, steps, key, m.model_timeout)
            return Done("starter model", "kept", f"kept {name} in the catalog" + (" (serving)" if node_here else ""))
    notes: list[str] = []
    name, source, noise = STARTER_NAME, None, False
    if plan.here and plan.dir is not None and plan.base:
        if not offline:

            def progress(done: int, total: int | None) -> None:
                steps.progress(key, done, total, f"fetching {STARTER_FILE}")

            source = fetch_into_mirror(
                MIRROR_API,
                plan.base,
                STARTER_SOURCE,
                STARTER_NAME,
                STARTER_VERSION,
                progress,
                notes.append,
                token=_mirror_token(plan),
            )
        if source is None:
            tiny = tiny_model_path()
            source = place_in_mirror(plan.dir, plan.base, tiny, TINY_NAME, TINY_VERSION)
            for p in (
                plan.dir / TINY_NAME,
                plan.dir / TINY_NAME / TINY_VERSION,
                plan.dir / TINY_NAME / TINY_VERSION / tiny.name,
            ):
                m.give(p)
            name, noise = TINY_NAME, True
    else:
        source = STARTER_SOURCE  # no mirror here: nodes fetch it from Hugging Face
    classes: list[str] = []
    if node_here:
        try:
            rows = api.call("GET", "/api/v1/nodes", NodesReply).nodes
        except AdminAPIError:
            rows = []
        row = next((r for r in rows if r.node_id == m.names[0]), None)
        classes = list((row.classes or []) if row else [])
    pin = {CONTROL_PLANE_LABEL: "true"} if node_here else {}
    profiles: list[dict[str, Any]] = [
        {"engine": "llamacpp", "gpu_class": c, **({"node_selector": pin} if pin else {})} for c in classes
    ]
    profiles.append({"engine": "llamacpp", "name": "llamacpp-cpu", **({"node_selector": pin} if pin else {})})
    model = {
        "name": name,
        "description": "Random-weight test model: its replies are noise"
        if noise
        else f"{STARTER_FILE}, the starter model",
        "source": source,
        "scaling": {"min": 1},
        "profiles": profiles,
    }
    try:
        api.call("POST", "/api/v1/models", ModelReply, ModelAddRequest(model=model))
    except AdminAPIError as exc:
        raise InitError(f"adding {name} to the catalog: {exc}") from None
    words = [
        f"added {name} to the catalog ({', '.join(p.get('gpu_class') or 'cpu' for p in profiles)}"
        + (", pinned to this node)" if pin else ", unpinned: it starts on the first node added)")
    ]
    if noise:
        words.insert(0, (notes[-1] + "; " if notes else "") + TINY_WORDS)
    if node_here:
        _wait_serving(api, name, steps, key, m.model_timeout)
        words.append("it serves")
    return Done("starter model", "warned" if noise else "made", "; ".join(words))


def _mirror_token(plan: MirrorPlan) -> str | None:
    if not plan.token_file:
        return None
    try:
        return read_secret_file(plan.token_file)
    except SecretFileError:
        return None


def mirror_token(m: Machine, cfg: ServerConfig) -> str | None:
    return _mirror_token(plan_of(m, cfg))


def _wait_serving(api: AdminAPI, name: str, steps: Steps, key: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        try:
            replicas = [r for r in api.call("GET", "/api/v1/replicas", ReplicasReply).replicas if r.model == name]
        except AdminAPIError as exc:
            replicas, last = [], str(exc)
        if any(r.state == "ready" for r in replicas):
            return
        for r in replicas:
            for s in r.shards or []:
                if s.fetch is not None and s.fetch.bytes_done is not None:
                    steps.progress(key, s.fetch.bytes_done, s.fetch.bytes_total, f"the node fetches {name}")
            if r.reason:
                last = r.reason
        if time.monotonic() > deadline:
            raise InitError(
                f"{name} is in the catalog but did not start serving within {timeout:g} s"
                + (f" ({last})" if last else "")
                + f"; see `llmgw ctl replicas` and `llmgw ctl explain-placement {name}`"
            )
        time.sleep(1.0)
