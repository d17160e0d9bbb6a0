import json
import re
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from typer.testing import CliRunner

from llmgw import __version__
from llmgw.cli.main import COMMANDS, app, wanted

runner = CliRunner()


def run(*args):
    return runner.invoke(app, list(args))


def test_cli_version_prints_llmgw_and_the_package_version():
    r = run("--version")
    assert r.exit_code == 0
    assert re.fullmatch(r"llmgw v\d+\.\d+\.\d+\n", r.output) and r.output.split()[-1] == f"v{__version__}"


def test_the_command_named_first_is_the_only_one_loaded_and_help_or_a_typo_loads_them_all():
    assert wanted(["up", "--port", "8081"]) == ("up",)
    assert wanted(["ctl", "nodes", "--help"]) == ("ctl",)
    every = tuple(COMMANDS)
    assert wanted([]) == wanted(["--help"]) == wanted(["-h", "up"]) == wanted(["nosuch"]) == every
    assert {c.name for c in app.registered_commands} | {g.name for g in app.registered_groups} == set(every)


def test_llmgw_up_starts_without_loading_the_other_commands_or_the_server():
    # up loads the server's code while its mirror and agent start, so its own start must not.
    probe = (
        "import sys\n"
        "from llmgw.cli.main import build, wanted\n"
        "build(wanted(sys.argv[1:]))\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('llmgw.'))))"
    )
    out = subprocess.run([sys.executable, "-c", probe, "up", "--offline"], capture_output=True, text=True, check=True)
    loaded = set(out.stdout.split())
    assert "llmgw.cli.up" in loaded
    assert not loaded & {"llmgw.cli.ctl", "llmgw.cli.agent", "llmgw.cli.server", "llmgw.server.app"}, loaded


def test_every_command_has_help():
    for args in [
        (),
        ("server",),
        ("keys",),
        ("keys", "create"),
        ("keys", "list"),
        ("keys", "revoke"),
        ("up",),
        ("agent",),
        ("agent", "inventory"),
        ("agent", "engine-check"),
        ("ctl",),
        ("ctl", "cert"),
        ("ctl", "nodes"),
        ("ctl", "models"),
        ("ctl", "model", "add"),
        ("ctl", "scale"),
        ("ctl", "logs"),
        ("ctl", "explain-placement"),
        ("ctl", "replicas"),
        ("ctl", "cordon"),
        ("ctl", "uncordon"),
        ("ctl", "drain"),
        ("node", "remove"),
    ]:
        r = run(*args, "--help")
        assert r.exit_code == 0, args
        assert len(r.output.strip()) > 40


def test_keys_create_list_revoke(tmp_path):
    store = str(tmp_path / "k.db")
    r = run("keys", "create", "--name", "ci-bot", "--project", "web", "--store", store)
    assert r.exit_code == 0, r.output
    secret = r.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"llmgw-[A-Za-z0-9_-]{40}", secret)
    assert r.stdout.strip() == secret  # stdout holds the secret alone; the rest went to stderr
    r = run("keys", "list", "--store", store)
    assert r.exit_code == 0 and "ci-bot" in r.stdout and secret[:14] in r.stdout and secret not in r.stdout
    assert "active" in r.stdout and "web" in r.stdout
    r = run("keys", "revoke", secret[:14], "--store", store)
    assert r.exit_code == 0, r.output
    assert "ci-bot" not in run("keys", "list", "--store", store).stdout
    assert "revoked" in run("keys", "list", "--all", "--store", store).stdout
    r = run("keys", "revoke", secret[:14], "--store", store)
    assert r.exit_code == 1 and "already revoked" in r.output


def test_keys_commands_fail_in_words_on_bad_ids_lifetimes_stores_and_configs(tmp_path):
    store = str(tmp_path / "k.db")
    r = run("keys", "revoke", "key-000000000000", "--store", store)
    assert r.exit_code == 1 and "error:" in r.output
    r = run("keys", "create", "--name", "x", "--expires-in", "soon", "--store", store)
    assert r.exit_code == 1 and "not a lifetime" in r.output
    r = run("keys", "create", "--name", "x", "--store", "mysql://nope/db")
    assert r.exit_code == 1 and "--store" in r.output
    cfg = tmp_path / "s.yaml"
    cfg.write_text("auth: {stor: x}\n")
    r = run("keys", "list", "--config", str(cfg))
    assert r.exit_code == 1 and "auth.stor: unknown key" in r.output


def test_keys_use_the_store_of_the_config(tmp_path):
    cfg = tmp_path / "s.yaml"
    cfg.write_text(f"auth: {{store: {tmp_path / 'from-config.db'}}}\n")
    r = run("keys", "create", "--name", "a", "--config", str(cfg))
    assert r.exit_code == 0
    assert (tmp_path / "from-config.db").exists()
    r = run("keys", "create", "--name", "a", "--expires-in", "30d", "--config", str(cfg))
    assert r.exit_code == 0 and "expires" in r.output


# -- ctl against a stub admin API ----------------------------------------------


class StubAdmin:
    """An admin API answering canned JSON per (method, path), recording each request."""

    def __init__(self) -> None:
        self.routes: dict[tuple[str, str], tuple[int, object]] = {}
        self.seen: list[tuple[str, str]] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                stub.seen.append((self.command, self.path))
                status, body = stub.routes.get(
                    (self.command, self.path), (404, {"error": {"message": f"no route {self.path}"}})
                )
                raw = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            do_GET = do_POST = _answer

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def admin():
    stub = StubAdmin()
    yield stub
    stub.close()


def ctl(admin: StubAdmin, *args):
    return run("ctl", *args, "--admin", admin.url)


def node(node_id: str, **kw) -> dict:
    base = {
        "node_id": node_id,
        "state": "ready",
        "connected": True,
        "last_seen": time.time() - 3,
        "agent_version": "0.1.0",
        "mgmt_addr": "10.0.0.1",
        "labels": {},
        "engines": {},
        "provision": {},
        "memory": {"total_bytes": 512 * 2**30, "available_bytes": 400 * 2**30},
        "gpus_total": 0,
        "gpus_free": 0,
        "classes": [],
        "fabrics": [],
        "disk_free_bytes": None,
        "disk_total_bytes": None,
        "replicas": [],
        "warnings": [],
    }
    base.update(kw)
    return base


NODES = [
    node(
        "gpu-1",
        labels={"rack": "a1", "zone": "west"},
        engines={"llamacpp": "b5000"},
        provision={
            "llamacpp": {"engine": "llamacpp", "version": "b5000", "state": "ready", "detail": None, "progress": None},
            "vllm": {
                "engine": "vllm",
                "version": "0.9.0",
                "state": "installing",
                "detail": "downloading wheels",
                "progress": {"bytes_done": 400, "bytes_total": 1000},
            },
        },
        gpus_total=8,
        gpus_free=6,
        classes=["h100-80g"],
        fabrics=["ib0"],
        disk_free_bytes=1_500_000_000_000,
        disk_total_bytes=2_000_000_000_000,
        replicas=["qwen-1a2b"],
        warnings=["GPU 3: 2 uncorrected ECC errors"],
    ),
    node("gpu-2", state="cordoned", labels={"rack": "b2"}, gpus_total=4, gpus_free=4, classes=["l40s-45g"]),
    node(
        "cpu-1",
        state="unreachable",
        connected=False,
        memory=None,
        last_seen=None,
        labels={"zone": "east"},
        provision={
            "llamacpp": {
                "engine": "llamacpp",
                "version": None,
                "state": "failed",
                "detail": "no release for this CPU",
                "progress": None,
            }
        },
    ),
]


def rows(output: str) -> dict[str, str]:
    """Table lines by their first word."""
    return {line.split()[0]: line for line in output.splitlines() if line.strip() and not line.startswith(" ")}


def test_ctl_nodes_table(admin):
    # last_seen is relative to now, not to when this module was imported.
    fresh = [{**n, "last_seen": time.time() - 3} if n["last_seen"] else n for n in NODES]
    admin.routes[("GET", "/api/v1/nodes")] = (200, {"nodes": fresh})
    r = ctl(admin, "nodes")
    assert r.exit_code == 0, r.output
    t = rows(r.stdout)
    assert t["NODE"].split() == [
        "NODE",
        "STATE",
        "GPUS",
        "MEM",
        "DISK",
        "ENGINES",
        "CLASSES",
        "FABRICS",
        "REPLICAS",
        "LAST",
        "SEEN",
    ]
    g1 = t["gpu-1"]
    for want in (
        "ready",
        "6/8",
        "400/512 GiB free",
        "1.5 TB free of 2.0 TB",
        "llamacpp b5000",
        "vllm installing: downloading wheels 40%",
        "h100-80g",
        "ib0",
        "qwen-1a2b",
    ):
        assert want in g1, want
    # Seen 3 s before the listing; a loaded machine may take a few seconds to print it.
    import re

    assert 3 <= int(re.search(r"(\d+)s ago", g1).group(1)) <= 30, g1
    assert "  warning: GPU 3: 2 uncorrected ECC errors" in r.stdout
    assert "cordoned" in t["gpu-2"] and "4/4" in t["gpu-2"] and "l40s-45g" in t["gpu-2"]
    c1 = t["cpu-1"]
    assert "unreachable (disconnected)" in c1 and "llamacpp failed: no release for this CPU" in c1
    # Columns line up: every row's GPUS cell starts where the header's does.
    col = t["NODE"].index("GPUS")
    assert g1[col:].startswith("6/8") and c1[col:].startswith("-")


@pytest.mark.parametrize(
    "args, shown",
    [
        (("--state", "read"), {"gpu-1"}),
        (("--state", "un"), {"cpu-1"}),
        (("--class", "l40s-45g"), {"gpu-2"}),
        (("--fabric", "ib0"), {"gpu-1"}),
        (("--label", "rack"), {"gpu-1", "gpu-2"}),
        (("--label", "rack=b2"), {"gpu-2"}),
        (("--label", "rack", "--label", "zone=west"), {"gpu-1"}),
    ],
)
def test_ctl_nodes_filters(admin, args, shown):
    admin.routes[("GET", "/api/v1/nodes")] = (200, {"nodes": NODES})
    r = ctl(admin, "nodes", *args)
    assert r.exit_code == 0, r.output
    assert set(rows(r.stdout)) - {"NODE"} == shown
    r = ctl(admin, "nodes", *args, "--json")
    assert r.exit_code == 0, r.output
    assert {n["node_id"] for n in json.loads(r.stdout)} == shown


def test_ctl_nodes_nothing_matches(admin):
    admin.routes[("GET", "/api/v1/nodes")] = (200, {"nodes": NODES})
    r = ctl(admin, "nodes", "--class", "b200-180g")
    assert r.exit_code == 0 and r.stdout.strip() == "no nodes match"
    admin.routes[("GET", "/api/v1/nodes")] = (200, {"nodes": []})
    assert "no nodes have joined" in ctl(admin, "nodes").stdout


def test_ctl_nodes_says_when_a_failed_install_is_tried_again(admin):
    now = time.time()

    def failed(engine: str, **kw) -> dict:
        return {engine: {"engine": engine, "version": "b1", "state": "failed", "detail": "no release", **kw}}

    soon = now + 240
    admin.routes[("GET", "/api/v1/nodes")] = (
        200,
        {
            "nodes": [
                node("a", provision=failed("llamacpp", retry_at=soon)),
                node("b", provision=failed("llamacpp", retry_at=now - 300)),
                node("c", provision=failed("llamacpp")),  # an older agent, or no attempt scheduled yet
            ]
        },
    )
    r = ctl(admin, "nodes")
    assert r.exit_code == 0, r.output
    t = rows(r.stdout)
    at = time.strftime("%H:%M:%S", time.localtime(soon))
    assert f"llamacpp failed: no release; next try in 4m ({at})" in t["a"]
    assert f"next try was due at {time.strftime('%H:%M:%S', time.localtime(now - 300))}" in t["b"]
    assert "llamacpp failed: no release" in t["c"] and "next try" not in t["c"]
    r = ctl(admin, "nodes", "--json")
    assert r.exit_code == 0, r.output
    by_id = {n["node_id"]: n for n in json.loads(r.stdout)}
    assert by_id["a"]["provision"]["llamacpp"]["retry_at"] == soon
    assert "retry_at" not in by_id["c"]["provision"]["llamacpp"]


def replica(rid: str, **kw) -> dict:
    base = {
        "id": rid,
        "model": "qwen",
        "profile": "default",
        "state": "ready",
        "pool": "default",
        "stale": False,
        "age_s": 3700,
        "idle_s": 30,
        "endpoint": "http://10.0.0.1:8001",
        "reason": None,
        "shards": [
            {"node": "gpu-1", "shard_id": f"{rid}-0", "rank": 0, "gpus": [0], "state": "running", "fetch": None}
        ],
    }
    base.update(kw)
    return base


REPLICAS = [
    replica("qwen-1a2b", stale=True),
    replica(
        "qwen-3c4d",
        state="loading",
        endpoint=None,
        idle_s=None,
        age_s=40,
        shards=[
            {
                "node": "gpu-2",
                "shard_id": "s0",
                "rank": 0,
                "gpus": [0, 1],
                "state": "pending",
                "fetch": {
                    "source": "http://mirror:8081/qwen/",
                    "bytes_done": 504_000_000,
                    "bytes_total": 1_200_000_000,
                    "percent": 42.0,
                },
            }
        ],
    ),
    replica(
        "llama-5e6f",
        model="llama",
        state="starting",
        endpoint=None,
        idle_s=None,
        age_s=10,
        shards=[
            {
                "node": "gpu-1",
                "shard_id": "s1",
                "rank": 0,
                "gpus": [2],
                "state": "pending",
                "fetch": {"source": "hf:meta/llama", "bytes_done": 300_000_000, "bytes_total": None, "percent": None},
            }
        ],
    ),
    replica(
        "tiny-7a8b",
        model="tiny",
        state="failed",
        endpoint=None,
        idle_s=None,
        age_s=5,
        reason="llama-server exited with status 1: out of memory",
        shards=[],
    ),
]


def test_ctl_replicas_table(admin):
    admin.routes[("GET", "/api/v1/replicas")] = (200, {"replicas": REPLICAS})
    r = ctl(admin, "replicas")
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["REPLICA", "MODEL", "PROFILE", "STATE", "POOL", "NODES", "ENDPOINT", "AGE", "IDLE"]
    t = rows(r.stdout)
    assert "ready (stale profile)" in t["qwen-1a2b"] and "http://10.0.0.1:8001" in t["qwen-1a2b"]
    assert t["qwen-1a2b"].split()[-2:] == ["62m", "30s"]
    assert "loading" in t["qwen-3c4d"] and "stale" not in t["qwen-3c4d"] and "gpu-2" in t["qwen-3c4d"]
    # Under a fetching shard, its download; the total unknown says how much so far.
    assert lines[lines.index(t["qwen-3c4d"]) + 1] == "  fetching http://mirror:8081/qwen/: 42% of 1.2 GB"
    assert lines[lines.index(t["llama-5e6f"]) + 1] == "  fetching hf:meta/llama: 300 MB so far"
    assert lines[lines.index(t["tiny-7a8b"]) + 1] == "  llama-server exited with status 1: out of memory"
    assert len(lines) == 1 + len(REPLICAS) + 3


def test_ctl_replicas_model_filter_and_json(admin):
    admin.routes[("GET", "/api/v1/replicas?model=qwen")] = (200, {"replicas": REPLICAS[:2]})
    r = ctl(admin, "replicas", "--model", "qwen", "--json")
    assert r.exit_code == 0, r.output
    assert [x["id"] for x in json.loads(r.stdout)] == ["qwen-1a2b", "qwen-3c4d"]
    assert admin.seen[-1] == ("GET", "/api/v1/replicas?model=qwen")
    admin.routes[("GET", "/api/v1/replicas?model=none")] = (200, {"replicas": []})
    assert ctl(admin, "replicas", "--model", "none").stdout.strip() == "no replicas of none"


@pytest.mark.parametrize("action, state", [("cordon", "cordoned"), ("uncordon", "ready"), ("drain", "draining")])
def test_ctl_cordon_uncordon_drain(admin, action, state):
    message = f"gpu-1 is {state}"
    admin.routes[("POST", f"/api/v1/nodes/gpu-1/{action}")] = (
        200,
        {"node": "gpu-1", "state": state, "message": message},
    )
    r = ctl(admin, action, "gpu-1")
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == message
    assert admin.seen == [("POST", f"/api/v1/nodes/gpu-1/{action}")]


def test_ctl_node_action_errors(admin):
    admin.routes[("POST", "/api/v1/nodes/ghost/drain")] = (
        404,
        {"error": {"message": "no node named ghost is known", "type": "not_found_error"}},
    )
    r = ctl(admin, "drain", "ghost")
    assert r.exit_code == 1
    assert "answered 404: no node named ghost is known" in r.output
    r = run("ctl", "cordon", "gpu-1", "--admin", "http://127.0.0.1:1")
    assert r.exit_code == 1 and "cannot reach the control plane's admin API" in r.output


def test_ctl_models_shows_ready_over_target_and_why_not(admin):
    admin.routes[("GET", "/api/v1/models")] = (
        200,
        {
            "problems": [],
            "models": [
                {
                    "name": "qwen",
                    "declared": True,
                    "source": "hf:q/q/q.gguf",
                    "scaling": {"min": 2, "max": 2, "state": "fixed"},
                    "profiles": [{"name": "llamacpp-cpu", "engine": "llamacpp"}],
                    "status": {
                        "target": 2,
                        "replicas": {"ready": 1, "starting": 1},
                        "problem": None,
                        "backoff": {"failures": 2, "retry_in_s": 18.0, "last_failure": "node n1 refused it"},
                    },
                },
                {
                    "name": "big",
                    "declared": False,
                    "source": "org/big",
                    "scaling": {"min": 1, "max": 1, "state": "fixed"},
                    "profiles": [{"name": "vllm-h100-80g", "engine": "vllm"}],
                    "status": {
                        "target": 1,
                        "replicas": {},
                        "problem": "cannot place big:\n  n1 has no GPUs",
                        "backoff": None,
                    },
                },
                {
                    "name": "ext",
                    "declared": True,
                    "endpoints": [{"url": "http://x:1", "engine": "openai"}],
                    "profiles": [],
                },
            ],
        },
    )
    r = ctl(admin, "models")
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["MODEL", "FROM", "SCALING", "READY", "PROFILES", "SOURCE"]
    assert "1/2" in lines[1] and "0/1" in lines[2] and lines[3].split()[0] == "ext"
    assert "qwen: 2 failed start(s) in a row, next attempt in 18s; last: node n1 refused it" in r.stdout
    assert "big: cannot place big:\n  n1 has no GPUs" in r.stdout


def test_ctl_mirror_list_and_status_show_sizes_from_the_mirrors_shape(admin):
    present = {
        "model": "qwen",
        "version": "v1",
        "state": "present",
        "bytes": 4_000_000_000,
        "used_by": ["qwen"],
        "files": [{"name": "q.gguf", "state": "present", "bytes": 4_000_000_000, "sha256": "ab" * 32}],
    }
    fetching = {
        "model": "big",
        "version": "v2",
        "state": "fetching",
        "bytes": 0,
        "used_by": [],
        "files": [
            {
                "name": "b.gguf",
                "state": "fetching",
                "bytes": None,
                "bytes_done": 300_000_000,
                "bytes_total": 1_200_000_000,
            }
        ],
    }
    admin.routes[("GET", "/api/v1/mirror")] = (200, {"base": "http://m:8081", "models": [present, fetching]})
    admin.routes[("GET", "/api/v1/mirror/qwen/v1")] = (200, present)
    r = ctl(admin, "mirror", "list")
    assert r.exit_code == 0, r.output
    t = rows(r.stdout)
    assert "4.0 GB" in t["qwen"] and "qwen" in t["qwen"].split()[-1]
    assert "300 MB of 1.2 GB (25%)" in t["big"]
    r = ctl(admin, "mirror", "status", "qwen", "v1")
    assert r.exit_code == 0 and "q.gguf  present  4.0 GB  sha256 " in r.stdout, r.output
