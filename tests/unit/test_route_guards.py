"""Every route of every listener of `llmgw server`, with the guard that stands in front of it.

The table below is the list: a route added without being listed here fails the
first test, so nothing can be added open by accident. The other tests then
check each guard by calling every route it covers.
"""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest

from llmgw.config.server import parse_server_config
from llmgw.files import write_secret_file
from llmgw.server.app import Server
from llmgw.testing.admin import admin_headers
from llmgw.testing.ports import free_port as _port

ADMIN = "admin credential"  # admin token or listed client certificate; browser refusals first
PROBE = "open probe"  # answers without a credential; tells nothing but up/ready
API_KEY = "API key"  # Authorization: Bearer <key>
CLAIM = "claim token in the URL"  # the link's own random token is the credential
AGENT = "agent mutual TLS"  # the fleet's client certificate, naming the node (agent_tls)
NETWORK = "network (metrics only)"  # Prometheus' listener: read-only numbers; firewall it
PAGE = "open page"  # anyone; the session is read when there is one; a POST needs the form's token
SESSION = "browser session"  # the session cookie (never an API key); a POST needs the session's CSRF token
ADMIN_SESSION = "administrator's session"  # a session of an administrator (403 for others) + CSRF for POST
STATIC = "static file"  # the pages' hashed static files: public, read-only
FORWARDED = "forwarded"  # a worker's catch-all: the server process answers it, under that route's own guard

GUARDS: dict[tuple[str, str, str], str] = {
    ("listen", "POST", "/v1/chat/completions"): API_KEY,
    ("listen", "POST", "/v1/completions"): API_KEY,
    ("listen", "POST", "/v1/embeddings"): API_KEY,
    ("listen", "GET", "/v1/models"): API_KEY,
    ("listen", "GET", "/v1/models/{model}"): API_KEY,
    ("listen", "POST", "/v1/responses"): API_KEY,
    ("listen", "POST", "/v1/messages"): API_KEY,  # x-api-key too
    ("listen", "POST", "/v1/messages/count_tokens"): API_KEY,
    ("listen", "GET", "/v1/threads/{thread}"): API_KEY,
    ("listen", "DELETE", "/v1/threads/{thread}"): API_KEY,
    ("listen", "POST", "/v1/memory"): API_KEY,
    ("listen", "GET", "/v1/memory"): API_KEY,
    ("listen", "GET", "/v1/memory/{note}"): API_KEY,
    ("listen", "PATCH", "/v1/memory/{note}"): API_KEY,
    ("listen", "DELETE", "/v1/memory/{note}"): API_KEY,
    ("listen", "POST", "/v1/mcp"): API_KEY,
    ("listen", "GET", "/v1/mcp"): API_KEY,
    ("listen", "DELETE", "/v1/mcp"): API_KEY,
    ("listen", "GET", "/claim/{token}"): CLAIM,
    ("listen", "POST", "/claim/{token}"): CLAIM,
    ("listen", "GET", "/health"): PROBE,
    ("listen", "GET", "/"): PAGE,
    ("listen", "GET", "/about"): PAGE,
    ("listen", "GET", "/login"): PAGE,
    ("listen", "POST", "/login"): PAGE,
    ("listen", "GET", "/signup"): PAGE,
    ("listen", "POST", "/signup"): PAGE,
    ("listen", "POST", "/logout"): SESSION,
    ("listen", "GET", "/chat"): SESSION,
    ("listen", "POST", "/chat"): SESSION,
    ("listen", "POST", "/chat/send"): SESSION,
    ("listen", "POST", "/chat/render"): SESSION,
    ("listen", "POST", "/chat/wake"): SESSION,
    ("listen", "GET", "/chat/model-status"): SESSION,
    ("listen", "GET", "/static/{name}"): STATIC,
    # the administrator's Mirror page, mounted with a mirror: block (admin_mirror.py), and /org (org.py)
    ("listen", "GET", "/admin/mirror"): ADMIN_SESSION,
    ("listen", "POST", "/admin/mirror/fetch"): ADMIN_SESSION,
    ("listen", "POST", "/admin/mirror/serve"): ADMIN_SESSION,
    ("listen", "POST", "/admin/mirror/remove"): ADMIN_SESSION,
    ("listen", "GET", "/admin/mirror/repo"): ADMIN_SESSION,
    ("listen", "GET", "/org"): SESSION,
    # the administrator's Cluster, node, node logs and People pages (admin_cluster.py, admin_people.py)
    ("listen", "GET", "/admin"): ADMIN_SESSION,
    ("listen", "GET", "/admin/nodes/{node}"): ADMIN_SESSION,
    ("listen", "GET", "/admin/nodes/{node}/logs"): ADMIN_SESSION,
    # the Fabrics and NVLink pages (admin_fabrics.py)
    ("listen", "GET", "/admin/fabrics"): ADMIN_SESSION,
    ("listen", "GET", "/admin/nvlink"): ADMIN_SESSION,
    ("listen", "GET", "/admin/users"): ADMIN_SESSION,
    ("listen", "POST", "/admin/users/approve"): ADMIN_SESSION,
    ("listen", "POST", "/admin/users/reject"): ADMIN_SESSION,
    ("listen", "POST", "/admin/users/state"): ADMIN_SESSION,
    ("listen", "POST", "/admin/users/remove"): ADMIN_SESSION,
    ("listen", "POST", "/admin/users/promote"): ADMIN_SESSION,
    ("listen", "POST", "/admin/users/join"): ADMIN_SESSION,
    ("listen", "POST", "/admin/users/leave"): ADMIN_SESSION,
    ("listen", "POST", "/admin/users/revoke-key"): ADMIN_SESSION,
    ("listen", "POST", "/admin/tree/add"): ADMIN_SESSION,
    ("listen", "POST", "/admin/tree/rename"): ADMIN_SESSION,
    ("listen", "POST", "/admin/tree/remove"): ADMIN_SESSION,
    # the account page (/profile) and the editor setup script curl fetches without a session
    ("listen", "GET", "/profile"): SESSION,
    ("listen", "POST", "/profile"): SESSION,
    ("listen", "GET", "/setup/{tool}"): PAGE,
    # the administrator's Quotas and Usage pages (admin_limits.py, admin_usage.py)
    ("listen", "GET", "/admin/quotas"): ADMIN_SESSION,
    ("listen", "POST", "/admin/quotas"): ADMIN_SESSION,
    ("listen", "GET", "/admin/usage"): ADMIN_SESSION,
    ("listen", "GET", "/ready"): PROBE,
    ("admin_listen", "GET", "/health"): PROBE,
    ("admin_listen", "GET", "/ready"): PROBE,
    ("admin_listen", "GET", "/metrics"): ADMIN,
    ("admin_listen", "GET", "/api/v1/endpoints"): ADMIN,
    ("admin_listen", "GET", "/api/v1/status"): ADMIN,
    ("admin_listen", "GET", "/api/v1/nodes"): ADMIN,
    ("admin_listen", "DELETE", "/api/v1/nodes/{node}"): ADMIN,
    ("admin_listen", "GET", "/api/v1/nodes/{node}/logs"): ADMIN,
    ("admin_listen", "POST", "/api/v1/nodes/{node}/cordon"): ADMIN,
    ("admin_listen", "POST", "/api/v1/nodes/{node}/uncordon"): ADMIN,
    ("admin_listen", "POST", "/api/v1/nodes/{node}/drain"): ADMIN,
    ("admin_listen", "GET", "/api/v1/replicas"): ADMIN,
    ("admin_listen", "GET", "/api/v1/mirror"): ADMIN,
    ("admin_listen", "POST", "/api/v1/mirror/fetch"): ADMIN,
    ("admin_listen", "GET", "/api/v1/mirror/{model}/{version}"): ADMIN,
    ("admin_listen", "DELETE", "/api/v1/mirror/{model}/{version}"): ADMIN,
    ("admin_listen", "POST", "/api/v1/mirror/{model}/{version}/serve"): ADMIN,
    ("admin_listen", "GET", "/api/v1/models"): ADMIN,
    ("admin_listen", "POST", "/api/v1/models"): ADMIN,
    ("admin_listen", "DELETE", "/api/v1/models/{name}"): ADMIN,
    ("admin_listen", "PUT", "/api/v1/models/{name}/scale"): ADMIN,
    ("admin_listen", "GET", "/api/v1/models/{name}/placement"): ADMIN,
    ("admin_listen", "GET", "/api/v1/fabrics"): ADMIN,
    ("admin_listen", "GET", "/api/v1/fabrics/{fabric}/topology"): ADMIN,
    ("admin_listen", "POST", "/api/v1/fabric-test"): ADMIN,
    ("admin_listen", "GET", "/api/v1/nvlink"): ADMIN,
    # ctl status, usage and weights (admin/ops.py)
    ("admin_listen", "GET", "/api/v1/cluster"): ADMIN,
    ("admin_listen", "GET", "/api/v1/usage"): ADMIN,
    ("admin_listen", "GET", "/api/v1/weights"): ADMIN,
    ("admin_listen", "POST", "/api/v1/weights/collect"): ADMIN,
    # measured capacity: ctl bench --save and ctl capacity (admin/capacity_api.py)
    ("admin_listen", "GET", "/api/v1/capacity"): ADMIN,
    ("admin_listen", "PUT", "/api/v1/models/{model}/capacity"): ADMIN,
    # does a model fit: ctl plan (admin/plan.py)
    ("admin_listen", "GET", "/api/v1/plan"): ADMIN,
    ("metrics_listen", "GET", "/metrics"): NETWORK,
    ("agent_listen", "GET", "/v1/agent/stream"): AGENT,
}


@pytest.fixture
async def server(tmp_path):
    mirror_token = tmp_path / "mirror.token"
    write_secret_file(mirror_token, "mirror-secret")
    cfg = parse_server_config(
        {
            "listen": f"127.0.0.1:{_port()}",
            "admin_listen": f"127.0.0.1:{_port()}",
            "metrics_listen": f"127.0.0.1:{_port()}",
            "agent_listen": f"127.0.0.1:{_port()}",
            "agent_tls": None,
            "control": {"enabled": True},
            "auth": {"store": str(tmp_path / "gw.db")},
            "mirror": {"api": f"http://127.0.0.1:{_port()}", "token_file": str(mirror_token)},
            "models": [{"name": "m", "endpoints": [{"url": "http://127.0.0.1:9", "engine": "openai"}]}],
        }
    )
    s = Server(cfg)
    await s.start()
    yield s
    await s.stop()


def _routes(server: Server) -> set[tuple[str, str, str]]:
    out = set()
    for listener, app in server.apps.items():
        for route in app.router.routes():
            if route.method == "HEAD":
                continue  # aiohttp adds one beside every GET; it runs the GET's handler and guard
            out.add((listener, route.method, route.resource.canonical))
    return out


def _concrete(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "x", path)


def _base(server: Server, listener: str) -> str:
    addr = getattr(server.config, listener)
    return f"http://127.0.0.1:{addr.port}"


async def test_every_route_of_every_listener_is_listed_with_its_guard(server):
    routes = _routes(server)
    unlisted = sorted(routes - GUARDS.keys())
    assert not unlisted, f"routes without a guard in this test's table (add them, with their guard): {unlisted}"
    gone = sorted(GUARDS.keys() - routes)
    assert not gone, f"listed routes that no longer exist (remove them from the table): {gone}"


async def test_every_admin_route_answers_401_without_a_credential(server):
    async with httpx.AsyncClient() as http:
        for (listener, method, path), guard in GUARDS.items():
            if guard != ADMIN:
                continue
            r = await http.request(method, _base(server, listener) + _concrete(path), json={})
            assert r.status_code == 401, (method, path, r.status_code, r.text)
            body = r.json()["error"]
            assert body["code"] == "admin_credential_required"
            assert "llmgw ctl token create" in body["message"] and str(server.admin_token_file) in body["message"]
            assert r.headers["WWW-Authenticate"].startswith("Bearer")


async def test_admin_routes_refuse_what_only_a_browser_or_a_rebinding_page_sends(server):
    auth = admin_headers(server)
    base = _base(server, "admin_listen")
    async with httpx.AsyncClient() as http:
        for listener, method, path in GUARDS:
            if listener != "admin_listen":
                continue
            url = base + _concrete(path)
            r = await http.request(method, url, headers={**auth, "Origin": "https://evil.example"}, json={})
            assert r.status_code == 403 and r.json()["error"]["code"] == "cross_origin", (method, path)
            r = await http.request(
                method, url, headers={**auth, "Host": f"evil.example:{server.config.admin_listen.port}"}
            )
            assert r.status_code == 421 and r.json()["error"]["code"] == "host_not_allowed", (method, path)
            if method in ("POST", "PUT"):
                r = await http.request(method, url, headers={**auth, "Content-Type": "text/plain"}, content=b"{}")
                assert r.status_code == 415, (method, path, r.status_code)


async def test_a_cross_origin_text_plain_post_changes_nothing(server):
    """The attack that was found: a page posts a model whose profile carries LD_PRELOAD."""
    base = _base(server, "admin_listen")
    body = (
        b'{"model": {"name": "evil", "source": "/x.gguf", "profiles": [{"engine": "llamacpp", '
        b'"env": {"LD_PRELOAD": "/tmp/x.so"}}]}, "source_check": false}'
    )
    async with httpx.AsyncClient() as http:
        # Without the token, as a page would send it (it cannot read the token file).
        r = await http.post(
            base + "/api/v1/models",
            content=body,
            headers={"Content-Type": "text/plain", "Origin": "http://evil.example"},
        )
        assert r.status_code in (401, 403, 415)
        # Even a page that somehow had the token is refused for its origin and content type.
        r = await http.post(
            base + "/api/v1/models",
            content=body,
            headers={**admin_headers(server), "Content-Type": "text/plain", "Origin": "http://evil.example"},
        )
        assert r.status_code == 403
    assert server.catalog.get("evil") is None


async def test_a_same_origin_or_originless_request_with_the_token_is_served(server):
    base = _base(server, "admin_listen")
    async with httpx.AsyncClient(headers=admin_headers(server)) as http:
        assert (await http.get(base + "/api/v1/status")).status_code == 200
        own = f"http://127.0.0.1:{server.config.admin_listen.port}"
        assert (await http.get(base + "/api/v1/status", headers={"Origin": own})).status_code == 200
        assert (
            await http.get(base + "/api/v1/status", headers={"Host": f"localhost:{server.config.admin_listen.port}"})
        ).status_code == 200


async def test_a_revoked_or_foreign_token_is_refused_and_an_api_key_never_opens_the_admin_api(server):
    base = _base(server, "admin_listen")
    secret, rec = await server.store.create_admin_token("ops")
    api_key, _ = await server.store.create_key("client")
    async with httpx.AsyncClient() as http:
        ok = await http.get(base + "/api/v1/status", headers={"Authorization": f"Bearer {secret}"})
        assert ok.status_code == 200
        await server.store.revoke_admin_token(rec.id)
        r = await http.get(base + "/api/v1/status", headers={"Authorization": f"Bearer {secret}"})
        assert r.status_code == 401
        r = await http.get(base + "/api/v1/status", headers={"Authorization": f"Bearer {api_key}"})
        assert r.status_code == 401
        r = await http.get(
            base + "/api/v1/status", headers={"Authorization": "Bearer llmgw-admin-\u00e9t\u00e9".encode("latin-1")}
        )
        assert r.status_code == 401


async def test_client_api_routes_need_an_api_key(server):
    async with httpx.AsyncClient() as http:
        for (listener, method, path), guard in GUARDS.items():
            if guard != API_KEY:
                continue
            r = await http.request(method, _base(server, listener) + _concrete(path), json={"model": "m"})
            assert r.status_code == 401, (method, path, r.status_code)


async def test_open_probes_answer_without_a_credential(server):
    async with httpx.AsyncClient() as http:
        for (listener, method, path), guard in GUARDS.items():
            if guard in (PROBE, NETWORK):
                r = await http.request(method, _base(server, listener) + path)
                assert r.status_code in (200, 503), (listener, path, r.status_code)


async def test_the_first_admin_token_file_is_owner_only_and_survives_a_restart(server, tmp_path):
    path = server.admin_token_file
    assert path == tmp_path / "admin-token"
    assert path.stat().st_mode & 0o777 == 0o600
    first = path.read_text()
    again = Server(server.config)
    # A second start (same data_dir, same store) keeps the token it finds.
    from llmgw.server.admin.access import ensure_first_token

    assert await ensure_first_token(server.store, again.config) == path
    assert path.read_text() == first
    assert [t.name for t in await server.store.list_admin_tokens()] == [f"first token ({path})"]


async def test_on_a_tls_admin_listener_only_a_listed_administrators_certificate_opens_it_never_a_nodes_named_admin(
    tmp_path, caplog
):
    import logging
    import ssl

    from llmgw.pki import init_ca, issue_admin, issue_client, issue_server
    from llmgw.testing.pki import issue_unmarked

    pki = tmp_path / "pki"
    ca = init_ca(pki)
    srv = issue_server(pki, pki, ["127.0.0.1", "localhost"])
    admin = issue_admin(pki, pki / "admins", "admin")
    # A node named admin, made as issue-client would make it if the name were not reserved.
    node_named_admin = issue_client(pki, pki / "nodes", "admin", admin_names=())
    node = issue_client(pki, pki, "node-a", admin_names={"admin"})
    unlisted_admin = issue_admin(pki, pki / "admins", "ops-bob")
    # An administrator's certificate from before the marks: it cannot be told from a node's named admin.
    old_admin = issue_unmarked(pki, pki / "old", "admin")
    cfg = parse_server_config(
        {
            "listen": f"127.0.0.1:{_port()}",
            "admin_listen": f"127.0.0.1:{_port()}",
            "metrics_listen": None,
            "admin_tls": {"ca": str(ca.cert), "cert": str(srv.cert), "key": str(srv.key)},
            "auth": {"store": str(tmp_path / "gw.db")},
        }
    )
    s = Server(cfg)
    await s.start()
    url = f"https://127.0.0.1:{cfg.admin_listen.port}/api/v1/status"

    def ctx(client=None) -> ssl.SSLContext:
        c = ssl.create_default_context(cafile=str(ca.cert))
        if client is not None:
            c.load_cert_chain(str(client.cert), str(client.key))
        return c

    try:
        async with httpx.AsyncClient(verify=ctx(admin)) as http:
            assert (await http.get(url)).status_code == 200
        async with httpx.AsyncClient(verify=ctx(node_named_admin)) as http:
            r = await http.get(url)
            assert r.status_code == 401, r.text
            assert r.json()["error"]["code"] == "admin_certificate_refused"
            assert "is a node's" in r.json()["error"]["message"]
            assert "llmgw ctl cert issue-admin admin" in r.json()["error"]["message"]
        async with httpx.AsyncClient(verify=ctx(node)) as http:
            r = await http.get(url)
            assert r.status_code == 401 and "issued to admin" in r.json()["error"]["message"]
        async with httpx.AsyncClient(verify=ctx(unlisted_admin)) as http:
            assert (await http.get(url)).status_code == 401  # marked, but not listed
        with caplog.at_level(logging.WARNING, "llmgw.server.admin"):
            for _ in range(2):
                async with httpx.AsyncClient(verify=ctx(old_admin)) as http:
                    r = await http.get(url)
                    assert r.status_code == 401
                    assert "has no administrator's mark" in r.json()["error"]["message"]
                    assert "llmgw ctl cert issue-admin admin" in r.json()["error"]["message"]
        said = [m for m in caplog.messages if "no administrator's mark" in m]
        assert len(said) == 1 and "issue it again with `llmgw ctl cert issue-admin admin`" in said[0]
        async with httpx.AsyncClient(verify=ctx(), headers=admin_headers(s)) as http:
            assert (await http.get(url)).status_code == 200  # a token works over TLS too
        async with httpx.AsyncClient(verify=ctx(node_named_admin), headers=admin_headers(s)) as http:
            assert (await http.get(url)).status_code == 200  # and beside a refused certificate
    finally:
        await s.stop()


PAGE_GUARDS = {PAGE: "open", SESSION: "session", ADMIN_SESSION: "admin"}


async def test_every_page_route_carries_the_session_guard_this_table_names(server):
    app = server.apps["listen"]
    for route in app.router.routes():
        guard = GUARDS.get(("listen", route.method, route.resource.canonical))
        if guard in PAGE_GUARDS:
            assert getattr(route.handler, "llmgw_guard", None) == PAGE_GUARDS[guard], (route.method, route.resource)


async def test_every_session_page_refuses_without_a_session_even_with_an_api_key(server):
    api_key, _ = await server.store.create_key("client")
    base = _base(server, "listen")
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {api_key}"}) as http:
        for (_, method, path), guard in GUARDS.items():
            if guard not in (SESSION, ADMIN_SESSION):
                continue
            r = await http.request(method, base + _concrete(path), data={})
            if method == "GET":
                assert r.status_code == 303 and r.headers["location"].startswith("/login"), (method, path)
            else:
                assert r.status_code == 401, (method, path, r.status_code)


async def test_every_page_form_refuses_a_post_without_its_token(server):
    base = _base(server, "listen")
    async with httpx.AsyncClient() as http:
        for (_, method, path), guard in GUARDS.items():
            if guard == PAGE and method == "POST":
                r = await http.post(base + path, data={"email": "a@example.com", "password": "x"})
                assert r.status_code == 403 and "security token" in r.text, (path, r.status_code)


async def test_a_workers_listener_serves_only_the_api_and_its_probe_and_forwards_the_rest(server):
    # A worker (workers > 1) builds its own client listener: every route on it must be the
    # server process's API route with the same guard, the open probe, or the forwarder, which
    # hands the request to the server process, where the table above applies.
    import socket

    from llmgw.server.workers import Channel, WorkerLink

    a, b = socket.socketpair()
    near, far = await Channel.open(a), await Channel.open(b)
    cfg = server.config.model_copy(update={"listen": parse_server_config({"listen": f"127.0.0.1:{_port()}"}).listen})
    worker = Server(cfg, workers=2, slot=1)
    limits_near, limits_far = socket.socketpair()  # the worker's line to the server's accountant
    worker.link = WorkerLink(worker, far, asyncio.Event(), {"endpoints": []}, limits_far)
    await worker.start()
    try:
        routes = _routes(worker)
    finally:
        await worker.stop()
        await near.close()
        await far.close()
        limits_near.close()
    want = {k: g for k, g in GUARDS.items() if k[0] == "listen" and g == API_KEY}
    want[("listen", "GET", "/health")] = PROBE
    want[("listen", "*", "/{tail}")] = FORWARDED
    assert routes == want.keys(), f"unlisted: {sorted(routes - want.keys())}; missing: {sorted(want.keys() - routes)}"
