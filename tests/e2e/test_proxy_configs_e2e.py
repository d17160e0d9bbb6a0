"""The configurations shipped in deploy/, run by the real programs: Debian's nginx and Caddy in front of
a real `llmgw server`, and keepalived checking its /ready.

Each proxy runs the shipped file itself. The test renders it by replacing only the values an operator
replaces (the host name, the certificate, the ports, the gateway's address), each counted so that a
changed file fails here instead of being tested half-rendered; what a deployment supplies around the
file (nginx's http block, Caddy's global options) the test writes, saying where it differs.
"""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import json
import os
import re
import secrets
import shlex
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from aiohttp import web
from harness import REPO, Gateway, Proc, free_port, require, wait_http, wait_until

from llmgw.config.server import ServerConfig
from llmgw.pki.ca import init_ca, issue_server

pytestmark = pytest.mark.e2e

DEPLOY = REPO / "deploy"
LIMIT = 32 * 1024 * 1024  # router.max_body_bytes' default; both proxies must refuse exactly what it refuses
TOKENS, TOKEN_MS = 8, 200  # the fake engine's stream: eight tokens 200 ms apart, 1.4 s from first to last
FORGED = {
    "X-Forwarded-For": "6.6.6.6",
    "X-Real-IP": "6.6.6.6",
    "X-Forwarded-Host": "evil.example",
    "X-Forwarded-Proto": "http",
    "Forwarded": "for=6.6.6.6;host=evil.example;proto=http",
}


def render(text: str, values: dict[str, tuple[str, int]]) -> str:
    """``text`` with each shipped value replaced, after checking it occurs exactly as often as expected."""
    for shipped, (value, count) in values.items():
        assert text.count(shipped) == count, f"{shipped!r} occurs {text.count(shipped)} times, not {count}"
        text = text.replace(shipped, value)
    return text


def which(program: str) -> str:
    # nginx and keepalived are in /usr/sbin, which is not on every user's PATH.
    path = shutil.which(program, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))
    if path is None:
        require(program, f"{program} is not installed (apt-get install {program}; scripts/test does)")
    assert path is not None
    return path


def trusting(ca: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(ca))


# ---- the proxies -----------------------------------------------------------------------------------

# Around the shipped site file, what Debian's /etc/nginx/nginx.conf gives it, with this test's paths.
NGINX_MAIN = """\
daemon off;
master_process on;
worker_processes 1;
{user}
pid {home}/nginx.pid;
error_log stderr notice;
events {{
    worker_connections 256;
}}
http {{
    include /etc/nginx/mime.types;
    default_type application/octet-stream;
    access_log {home}/access.log;
    client_body_temp_path {home}/client_body;
    proxy_temp_path {home}/proxy;
    fastcgi_temp_path {home}/fastcgi;
    uwsgi_temp_path {home}/uwsgi;
    scgi_temp_path {home}/scgi;
    # Debian turns compression on in the http block, and an operator may add event streams to its types:
    # the site's `gzip off` has to hold against both.
    gzip on;
    gzip_types text/event-stream application/json;
    include {home}/llmgw.conf;
}}
"""

# Before the shipped site block, the global options where the test differs from a deployment: no admin
# endpoint (its fixed port would be shared by parallel runs), ports of its own, and the certificate from
# Caddy's local authority instead of Let's Encrypt (there is no internet here; the test trusts that
# authority, the system never does). No HTTP/3: its UDP port is not one free_port() checked.
CADDY_GLOBALS = """\
{{
\tadmin off
\thttp_port {http_port}
\tlocal_certs
\tskip_install_trust
\tservers {{
\t\tprotocols h1 h2
\t}}
}}

"""


class Nginx(Proc):
    name = "nginx"

    def __init__(self, workdir: Path, upstream: int, pki: Path) -> None:
        binary = which("nginx")
        self.port, self.http_port = free_port(), free_port()
        self.url = f"https://localhost:{self.port}"
        self.ca = pki / "ca.pem"
        self.home = workdir / f"nginx-{self.port}"
        self.home.mkdir()
        site = render(
            (DEPLOY / "proxy" / "nginx.conf").read_text(),
            {
                "ssl_certificate /etc/letsencrypt/live/llm.example.com/fullchain.pem;": (
                    f"ssl_certificate {pki / 'server.pem'};",
                    1,
                ),
                "ssl_certificate_key /etc/letsencrypt/live/llm.example.com/privkey.pem;": (
                    f"ssl_certificate_key {pki / 'server-key.pem'};",
                    1,
                ),
                "server_name llm.example.com;": ("server_name localhost;", 2),
                "listen 443 ssl http2;": (f"listen 127.0.0.1:{self.port} ssl http2;", 1),
                "listen 80;": (f"listen 127.0.0.1:{self.http_port};", 1),
                "server 127.0.0.1:8080;": (f"server 127.0.0.1:{upstream};", 1),
            },
        )
        (self.home / "llmgw.conf").write_text(site)
        # As root the workers would become nobody, who cannot enter pytest's private temporary directory.
        user = "user root root;" if os.geteuid() == 0 else ""
        main = self.home / "nginx.conf"
        main.write_text(NGINX_MAIN.format(home=self.home, user=user))
        cmd = [binary, "-p", str(self.home), "-e", "stderr", "-c", str(main)]
        super().__init__(cmd, workdir / f"nginx-{self.port}.log")

    def logs(self) -> str:
        access = self.home / "access.log"
        return self.text() + (access.read_text(errors="replace") if access.exists() else "")


class Caddy(Proc):
    name = "caddy"

    def __init__(self, workdir: Path, upstream: int, pki: Path) -> None:
        binary = which("caddy")
        self.port, self.http_port = free_port(), free_port()
        self.url = f"https://localhost:{self.port}"
        self.home = workdir / f"caddy-{self.port}"
        self.home.mkdir()
        site = render(
            (DEPLOY / "proxy" / "Caddyfile").read_text(),
            {
                "llm.example.com {": (f"localhost:{self.port} {{", 1),
                "reverse_proxy 127.0.0.1:8080 {": (f"reverse_proxy 127.0.0.1:{upstream} {{", 1),
            },
        )
        config = self.home / "Caddyfile"
        config.write_text(CADDY_GLOBALS.format(http_port=self.http_port) + site)
        # Caddy keeps its authority and certificates under XDG_DATA_HOME: this test's, not the machine's.
        env = {
            **os.environ,
            "HOME": str(self.home),
            "XDG_DATA_HOME": str(self.home / "data"),
            "XDG_CONFIG_HOME": str(self.home / "config"),
        }
        self.ca = self.home / "data" / "caddy" / "pki" / "authorities" / "local" / "root.crt"
        cmd = [binary, "run", "--config", str(config), "--adapter", "caddyfile"]
        super().__init__(cmd, workdir / f"caddy-{self.port}.log", env=env)

    def logs(self) -> str:
        return self.text()


Proxy = Nginx | Caddy


@pytest.fixture(params=["nginx", "caddy"])
def proxy(request, tmp_path):
    """Start the shipped configuration of one proxy in front of ``upstream`` (a port); stopped after."""
    kind = {"nginx": Nginx, "caddy": Caddy}[request.param]
    which(request.param)  # skip (or fail under scripts/test) before any gateway is started
    pki = tmp_path / "pki"
    init_ca(pki)
    issue_server(pki, pki, ["localhost", "127.0.0.1"])
    started: list[Proxy] = []

    def start(upstream: int) -> Proxy:
        p = kind(tmp_path, upstream, pki)
        started.append(p)

        def handshakes() -> bool:
            # A TLS handshake the test's authority vouches for, and no request: the upstream sees none.
            with socket.create_connection(("127.0.0.1", p.port), timeout=2) as raw:
                trusting(p.ca).wrap_socket(raw, server_hostname="localhost").close()
            return True

        wait_until(handshakes, 30, f"{p.name} to serve TLS on {p.url}", alive=[p], ignore=(OSError,))
        return p

    yield start
    for p in started:
        # One that died early has already failed its test, with its log.
        if p.alive():
            assert p.stop() == 0, p.text()[-3000:]


# ---- what the proxies are put in front of ----------------------------------------------------------


class FakeEngine(Proc):
    """`python -m llmgw.testing.fake_engine` serving model "fake", TOKENS tokens an answer."""

    def __init__(self, workdir: Path, token_ms: int = 0) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "llmgw.testing.fake_engine", "--port", str(port), "--model", "fake"]
        cmd += ["--tokens", str(TOKENS), "--token-ms", str(token_ms)]
        super().__init__(cmd, workdir / f"fake-engine-{port}.log")
        wait_http(self.url + "/health", self.proc, 30, self.log)

    def model(self) -> dict:
        return {"name": "fake", "endpoints": [{"url": self.url, "engine": "llamacpp"}]}


@pytest.fixture
def gateway(tmp_path) -> Iterator[Gateway]:
    """`llmgw server` serving model "fake" from a fake engine that streams a token every TOKEN_MS."""
    engine = FakeEngine(tmp_path, TOKEN_MS)
    gw = Gateway(tmp_path, models=[engine.model()])
    try:
        yield gw.wait_up()
    finally:
        try:
            assert gw.stop() == 0, gw.text()[-3000:]
        finally:
            engine.kill()


class Echo:
    """An upstream that answers every request with the headers it received, in order and repeated as
    received, and the length of the body it read: what the gateway would be told, seen directly."""

    def __init__(self) -> None:
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        self.bodies: list[int] = []
        self.acks = threading.Semaphore(0)  # events the client has received (the /events stream)
        self.stalled = False  # an event was not received within 10 s of being sent
        started = threading.Event()

        async def echo(request: web.Request) -> web.Response:
            body = await request.read()
            self.bodies.append(len(body))
            return web.json_response({"headers": list(request.headers.items()), "length": len(body)})

        async def events(request: web.Request) -> web.StreamResponse:
            # Server-Sent Events without the X-Accel-Buffering: no the gateway sends with its own
            # streams, so whether this is held back is up to the proxy alone. Lockstep: each event
            # goes only once the client has the one before (acks), so a proxy that holds events
            # back stalls the stream, and nothing depends on timing.
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)
            loop = asyncio.get_running_loop()
            for i in range(TOKENS):
                await resp.write(f"data: {i}\n\n".encode())
                if i + 1 < TOKENS and not await loop.run_in_executor(None, self.acks.acquire, True, 10):
                    self.stalled = True
                    break
            await resp.write_eof()
            return resp

        async def serve() -> None:
            # Larger than any body a proxy should let through, so the proxy's limit is the one that acts.
            app = web.Application(client_max_size=2 * LIMIT)
            app.router.add_get("/events", events)
            app.router.add_route("*", "/{tail:.*}", echo)
            self.runner = web.AppRunner(app, access_log=None)
            await self.runner.setup()
            await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
            started.set()

        def run() -> None:
            self.loop.run_until_complete(serve())
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert started.wait(10), "the echo upstream did not start"

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def echo() -> Iterator[Echo]:
    e = Echo()
    try:
        yield e
    finally:
        e.close()


# ---- streaming -------------------------------------------------------------------------------------


def assert_spread(arrivals: list[float]) -> None:
    """Arrivals over the source's whole stream, most a token's time apart: not held back and sent at once."""
    assert len(arrivals) == TOKENS, arrivals
    assert arrivals[-1] - arrivals[0] > 0.7 * TOKEN_MS * (TOKENS - 1) / 1000, arrivals
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert sum(g > TOKEN_MS / 2000 for g in gaps) >= TOKENS - 2, gaps


def stream_arrivals(client: openai.OpenAI) -> tuple[list[float], str]:
    """Seconds from sending to each chunk with text, and the text, of one streamed chat completion."""
    # A one-token request first, so neither route's measurement includes a TLS handshake or a new connection.
    client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    t0 = time.monotonic()
    times, text = [], []
    stream = client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "say something"}], stream=True
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.monotonic() - t0)
            text.append(chunk.choices[0].delta.content)
    return times, "".join(text)


def test_each_proxy_passes_a_stream_through_chunk_by_chunk_as_soon_as_the_gateway_sends_it(proxy, gateway):
    key = gateway.create_key()
    p = proxy(gateway.port)
    direct, direct_text = stream_arrivals(openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0))
    with httpx.Client(verify=trusting(p.ca), timeout=60) as http:
        proxied, proxied_text = stream_arrivals(
            openai.OpenAI(base_url=p.url + "/v1", api_key=key, http_client=http, max_retries=0)
        )
    assert proxied_text == direct_text and len(direct) == TOKENS
    # Unbuffered: spread over the engine's 1.4 s, not all at the end (a buffering proxy sends them at once).
    assert_spread(proxied)
    # And the first one about as soon as without the proxy: within a second on two loaded cores.
    assert proxied[0] < direct[0] + 1.0, (direct, proxied)
    # The access log records the request and never the key that made it.
    assert "/v1/chat/completions" in p.logs() and key not in p.logs()


def test_each_proxy_holds_back_no_stream_even_one_without_x_accel_buffering(proxy, echo):
    p = proxy(echo.port)
    arrivals = []
    with httpx.Client(verify=trusting(p.ca), timeout=30) as http, http.stream("GET", p.url + "/events") as r:
        assert r.status_code == 200
        # Not compressed either: the test's http block compresses event streams, the site turns that off.
        assert "content-encoding" not in r.headers, r.headers
        for piece in r.iter_raw():
            got = piece.count(b"data: ")
            arrivals += [piece] * got
            for _ in range(got):
                echo.acks.release()
    # Every event reached the client before the upstream sent the next: nothing was held back.
    assert not echo.stalled and len(arrivals) == TOKENS, arrivals


# ---- the body limit ----------------------------------------------------------------------------------


def chat_body(size: int) -> bytes:
    """A one-token chat request padded with JSON whitespace to exactly ``size`` bytes."""
    body = json.dumps({"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()
    return body + b" " * (size - len(body))


def test_each_proxy_refuses_a_body_over_32_mib_and_passes_one_of_exactly_32_mib_to_the_gateway(proxy, gateway):
    key = gateway.create_key()
    p = proxy(gateway.port)
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    with httpx.Client(base_url=p.url, verify=trusting(p.ca), timeout=120, headers=headers) as http:
        # Exactly the gateway's limit goes through, and the gateway answers it (Server-Timing is its mark).
        r = http.post("/v1/chat/completions", content=chat_body(LIMIT))
        assert r.status_code == 200 and "server-timing" in r.headers, r.text[:500]
        assert r.json()["choices"][0]["message"]["content"]
        # One byte more is the proxy's refusal: the gateway's own 413 would carry Server-Timing and its
        # error naming router.max_body_bytes.
        r = http.post("/v1/chat/completions", content=chat_body(LIMIT + 1))
        assert r.status_code == 413, r.text[:500]
        assert "server-timing" not in r.headers and "max_body_bytes" not in r.text, (r.headers, r.text[:500])


def chunks(size: int, piece: int = 1024 * 1024) -> Iterator[bytes]:
    """``size`` bytes as a generator, so httpx sends them chunked, without a Content-Length."""
    while size > 0:
        n = min(piece, size)
        yield b" " * n
        size -= n


def test_each_proxy_cuts_off_a_chunked_body_that_passes_32_mib(proxy, echo):
    p = proxy(echo.port)
    with httpx.Client(base_url=p.url, verify=trusting(p.ca), timeout=120) as http:
        r = http.post("/upload", content=chunks(LIMIT))
        assert r.status_code == 200 and r.json()["length"] == LIMIT, r.text[:500]
        # No length to refuse up front: the proxy counts as it forwards and stops where the limit is passed.
        r = http.post("/upload", content=chunks(LIMIT + 64 * 1024))
        assert r.status_code == 413, r.text[:500]
    # The upstream never read the whole of the larger body.
    assert max(echo.bodies) == LIMIT, echo.bodies


# ---- forwarded headers -------------------------------------------------------------------------------


def test_each_proxy_replaces_forwarded_headers_so_a_forged_client_address_never_reaches_the_upstream(proxy, echo):
    p = proxy(echo.port)
    with httpx.Client(verify=trusting(p.ca), timeout=30) as http:
        r = http.get(p.url + "/v1/models", headers=FORGED)
    assert r.status_code == 200, r.text
    received = r.json()["headers"]

    def values(name: str) -> list[str]:
        return [v for k, v in received if k.lower() == name.lower()]

    # One value each, the proxy's own: the client's address (this machine), the scheme and the address used.
    assert values("X-Forwarded-For") == ["127.0.0.1"], received
    assert values("X-Real-IP") == ["127.0.0.1"], received
    assert values("X-Forwarded-Proto") == ["https"], received
    assert values("X-Forwarded-Host") == [f"localhost:{p.port}"], received
    assert values("Host") == [f"localhost:{p.port}"], received
    assert values("Forwarded") == [], received
    forged = [(k, v) for k, v in received if "6.6.6.6" in v or "evil.example" in v]
    assert forged == [], forged


def test_each_proxy_gives_the_gateway_pages_the_address_and_scheme_people_used_not_forged_ones(proxy, gateway):
    p = proxy(gateway.port)
    with httpx.Client(base_url=p.url, verify=trusting(p.ca), timeout=30, headers=FORGED) as http:
        landing = http.get("/")
    # The landing page tells people the API's address from X-Forwarded-Host and -Proto.
    assert landing.status_code == 200, landing.text[:500]
    assert f"https://localhost:{p.port}/v1" in landing.text and "evil.example" not in landing.text
    # Its form cookie (a first visit gets one) is Secure because the proxy, not the client, says the
    # request came over https.
    cookies = landing.headers.get_list("set-cookie")
    assert cookies and all("secure" in c.lower() for c in cookies), cookies


def test_each_proxy_sends_plain_http_to_https(proxy, echo):
    p = proxy(echo.port)
    r = httpx.get(f"http://localhost:{p.http_port}/v1/models?x=1", timeout=10)
    assert r.status_code in (301, 308), r.text[:300]
    assert r.headers["location"].startswith("https://localhost") and r.headers["location"].endswith("/v1/models?x=1")
    assert echo.bodies == []  # nothing went upstream in clear text


# ---- keepalived ------------------------------------------------------------------------------------

KEEPALIVED = DEPLOY / "ha" / "keepalived.conf.example"


def config_test(path: Path) -> subprocess.CompletedProcess:
    # keepalived 2.2.7 (Debian 12) ends its configuration check by sending itself SIGTERM, whatever it
    # found; what it found is on stderr.
    r = subprocess.run(
        [which("keepalived"), "--config-test", "-f", str(path)], capture_output=True, text=True, timeout=30
    )
    assert r.returncode in (0, -15), (r.returncode, r.stderr)
    return r


def test_keepalived_example_passes_keepalived_config_test(tmp_path):
    assert config_test(KEEPALIVED).stderr == ""
    # The check reads the file: a misspelt keyword in a copy of it is named.
    bad = tmp_path / "keepalived.conf"
    bad.write_text(KEEPALIVED.read_text().replace("    interval 2\n", "    intervall 2\n", 1))
    assert "intervall" in config_test(bad).stderr


def keepalived_check() -> list[str]:
    """The command keepalived's vrrp_script check_llmgw runs, as keepalived splits it."""
    block = re.search(r"vrrp_script check_llmgw \{(.*?)\n\}", KEEPALIVED.read_text(), re.S)
    assert block, "no vrrp_script check_llmgw block"
    script = re.search(r'^\s*script "([^"]+)"', block.group(1), re.M)
    assert script, "check_llmgw has no script line"
    return shlex.split(script.group(1))


def run_check(argv: list[str], gateway_port: int) -> int:
    default = ServerConfig().listen
    # The example checks the gateway's default client listener; the test's gateway is on a port of its own.
    shipped = f"http://127.0.0.1:{default.port}/ready"
    assert argv[-1] == shipped, argv
    argv = [*argv[:-1], f"http://127.0.0.1:{gateway_port}/ready"]
    # As keepalived runs it: script_user nobody.
    user = "nobody" if os.geteuid() == 0 else None
    return subprocess.run(argv, user=user, capture_output=True, timeout=30).returncode


def test_keepalived_check_passes_only_while_the_gateway_is_ready(tmp_path):
    argv = keepalived_check()
    engine = FakeEngine(tmp_path)
    gw = Gateway(tmp_path, models=[engine.model()])
    try:
        gw.wait_up()
        assert run_check(argv, gw.port) == 0
        # Its one engine gone, the gateway has nothing to serve: /ready says 503 and the check fails.
        engine.kill()
        wait_http(gw.url + "/ready", gw.proc, 30, gw.log, status=503)
        assert run_check(argv, gw.port) != 0
        assert gw.stop() == 0, gw.text()[-3000:]
        # Nothing listening fails it too.
        assert run_check(argv, gw.port) != 0
    finally:
        gw.kill()
        engine.kill()


def second_machine(config: str) -> str:
    """The example as the second machine runs it: each line marked `# SECOND: VALUE` given that value."""
    edited, n = re.subn(r"^(\s*\w+) \S+(\s+)# SECOND: (\S+)$", r"\1 \3", config, flags=re.M)
    assert n == 2, f"{n} lines are marked SECOND, not state and priority"
    return edited


class Machine:
    """A network namespace standing in for one control plane: its own loopback (so the gateway has the
    example's 127.0.0.1:8080 to itself) and an eth0 on a link it shares with the other machine."""

    def __init__(self, name: str, workdir: Path) -> None:
        self.name, self.home = name, workdir / name
        self.home.mkdir()
        self.procs: list[Proc] = []

    def run(self, *cmd: str) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.name, *cmd], capture_output=True, text=True, timeout=30)

    def start(self, what: str, cmd: list[str]) -> Proc:
        # `ip netns exec` execs the command: the process and its pid are the command's own.
        p = Proc(["ip", "netns", "exec", self.name, *cmd], self.home / f"{what}.log")
        self.procs.append(p)
        return p

    def ready_status(self) -> int:
        r = self.run("curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", f"http://{LISTEN}/ready")
        return int(r.stdout or 0)

    def addresses(self) -> str:
        return self.run("ip", "-4", "-o", "addr", "show", "dev", "eth0").stdout


LISTEN = f"127.0.0.1:{ServerConfig().listen.port}"  # the gateway's default client port, the example's check
ENGINE = "127.0.0.1:8001"  # each machine's engine, in its own namespace


@pytest.fixture
def two_machines(tmp_path) -> Iterator[tuple[Machine, Machine, str]]:
    """Two namespaces joined by a veth pair on the example's floating address's network; the address."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        require("network namespaces", "the failover test makes network namespaces: it needs root and ip")
    which("keepalived")
    which("curl")
    text = KEEPALIVED.read_text()
    vip = ipaddress.ip_interface(re.search(r"virtual_ipaddress \{\s*(\S+)", text).group(1))  # type: ignore[union-attr]
    assert re.search(r"^\s*interface eth0\b", text, re.M), "the example no longer names eth0"
    tag = f"{os.getpid() % 100000}{secrets.token_hex(2)}"
    a, b = Machine(f"llmgw-{tag}-a", tmp_path), Machine(f"llmgw-{tag}-b", tmp_path)
    hosts = iter(vip.network.hosts())
    made: list[str] = []
    try:
        for m in (a, b):
            subprocess.run(["ip", "netns", "add", m.name], check=True, capture_output=True)
            made.append(m.name)
        subprocess.run(
            ["ip", "link", "add", f"lg{tag}a", "type", "veth", "peer", "name", f"lg{tag}b"],
            check=True,
            capture_output=True,
        )
        for m, end in ((a, f"lg{tag}a"), (b, f"lg{tag}b")):
            subprocess.run(["ip", "link", "set", end, "netns", m.name], check=True, capture_output=True)
            address = next(hosts)
            for cmd in (
                ["ip", "link", "set", "lo", "up"],
                ["ip", "link", "set", end, "name", "eth0"],
                ["ip", "addr", "add", f"{address}/{vip.network.prefixlen}", "dev", "eth0"],
                ["ip", "link", "set", "eth0", "up"],
            ):
                r = m.run(*cmd)
                assert r.returncode == 0, (cmd, r.stderr)
        yield a, b, str(vip.ip)
    finally:
        for m in (a, b):
            for p in reversed(m.procs):
                p.kill()
        for name in made:  # the veth pair goes with its namespaces
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def start_gateway(m: Machine) -> Proc:
    config = m.home / "server.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "listen": LISTEN,
                "admin_listen": "127.0.0.1:9090",
                "metrics_listen": None,
                "auth": {"enabled": True, "store": str(m.home / "llmgw.db")},
                "data_dir": str(m.home),
                "router": {"scrape_interval": "250ms"},
                "models": [{"name": "fake", "endpoints": [{"url": f"http://{ENGINE}", "engine": "llamacpp"}]}],
            }
        )
    )
    return m.start("gateway", [sys.executable, "-m", "llmgw.cli.main", "server", "--config", str(config)])


def start_engine(m: Machine) -> Proc:
    port = ENGINE.rsplit(":", 1)[1]
    return m.start("engine", [sys.executable, "-m", "llmgw.testing.fake_engine", "--port", port, "--model", "fake"])


def start_keepalived(m: Machine, config: str) -> Proc:
    path = m.home / "keepalived.conf"
    path.write_text(config)
    # In the foreground, logging to its output, VRRP only, with pid files of its own (not /run's).
    cmd = [which("keepalived"), "-n", "-l", "-D", "-G", "-P", "-f", str(path)]
    cmd += ["-p", str(m.home / "keepalived.pid"), "-r", str(m.home / "vrrp.pid")]
    return m.start("keepalived", cmd)


@pytest.mark.slow
def test_keepalived_example_moves_the_floating_address_to_the_machine_whose_gateway_is_ready(two_machines):
    a, b, vip = two_machines
    engine_a = start_engine(a)
    gateways = [start_gateway(a), start_gateway(b)]
    wait_until(lambda: a.ready_status() == 200, 60, "the first gateway to be ready", [engine_a, *gateways])
    # The second has no engine yet: up, answering /ready with 503, as a standby does.
    wait_until(lambda: b.ready_status() == 503, 60, "the second gateway to answer /ready", gateways)

    text = KEEPALIVED.read_text()
    keepers = [start_keepalived(a, text), start_keepalived(b, second_machine(text))]
    procs = [*keepers, *gateways]

    def holder() -> str:
        on = [m.name for m in (a, b) if f" {vip}/" in m.addresses()]
        return on[0] if len(on) == 1 else f"{len(on)} machines"

    wait_until(lambda: holder() == a.name, 60, f"{vip} on the first machine alone", procs, detail=holder)
    # The first machine's gateway loses its engine and the second's gets one: the address follows
    # whichever can serve, though the first has the higher configured priority.
    engine_a.kill()
    engine_b = start_engine(b)
    wait_until(lambda: a.ready_status() == 503, 30, "the first gateway to stop being ready", procs)
    wait_until(lambda: b.ready_status() == 200, 30, "the second gateway to be ready", [engine_b, *procs])
    wait_until(lambda: holder() == b.name, 60, f"{vip} to move to the second machine", procs, detail=holder)
    for k in keepers:
        assert k.stop() == 0, k.text()[-3000:]
