"""Who may use the mirror's management API: the token (or a listed certificate), never a web page,
never a request for another host name; and the token file itself."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer
from test_mirror_serve_fake import FakeManager

from llmgw.mirror.api import ApiAccess, api_app, check_token_place, default_token_file, ensure_token
from llmgw.mirror.layout import MirrorError
from llmgw.mirror.serve import parse_allow

TOKEN = "llmgw-mirror-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ACCESS = ApiAccess(token=TOKEN, token_file="/srv/models.api-token", names=("models.internal",))
FETCH = {"source": "https://h/q.gguf", "model": "qwen", "version": "v1"}


@pytest.fixture
async def api(tmp_path):
    mgr = FakeManager(tmp_path)
    mgr.put("qwen", "v0", "q.gguf", b"abc")
    app = api_app(mgr, tmp_path, "http://models.internal:8081", ACCESS)
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield client, mgr, app


def management_routes(app) -> list[tuple[str, str]]:
    """(method, path) of every route the app has, path parameters filled in: a route added
    later is in this list without anyone remembering to add it."""
    out = []
    for route in app.router.routes():
        if route.method == "HEAD":
            continue  # aiohttp's automatic twin of each GET
        path = re.sub(r"\{[^}]+\}", "x", route.resource.canonical)
        out.append((route.method, path))
    assert ("POST", "/v1/models") in out and len(out) >= 5
    return out


async def test_every_management_route_refuses_a_request_without_the_token_and_says_where_it_is(api):
    client, mgr, app = api
    for method, path in management_routes(app):
        r = await client.request(method, path, json={} if method == "POST" else None)
        if path == "/v1/health":
            assert r.status == 200, "the probe stays open"
            continue
        body = await r.json()
        assert r.status == 401, (method, path, r.status)
        assert "/srv/models.api-token" in body["error"]["message"] and body["error"]["code"] == "credential_required"
        assert r.headers["WWW-Authenticate"].startswith("Bearer")
    assert mgr.fetched == []


async def test_a_wrong_token_is_refused_and_the_right_one_opens_every_route(api):
    client, _, app = api
    for method, path in management_routes(app):
        for header in ("Bearer nope", f"Basic {TOKEN}", f"Bearer {TOKEN}x", "Bearer é"):
            r = await client.request(
                method, path, headers={"Authorization": header}, json={} if method == "POST" else None
            )
            assert r.status == (200 if path == "/v1/health" else 401), (method, path, header)
        r = await client.request(method, path, headers=AUTH, json=FETCH if method == "POST" else None)
        assert r.status not in (401, 403, 415, 421), (method, path, r.status)


async def test_a_cross_origin_text_plain_post_is_refused_and_nothing_is_fetched(api):
    client, mgr, _ = api
    import orjson

    body = orjson.dumps(FETCH)
    # What a web page can send without a CORS preflight, even carrying the token.
    for headers, status in (
        ({"Origin": "http://evil.example", "Content-Type": "text/plain"}, 403),
        ({"Origin": "null", "Content-Type": "application/json"}, 403),
        ({"Sec-Fetch-Site": "cross-site", "Content-Type": "application/json"}, 403),
        ({"Content-Type": "text/plain"}, 415),
        ({"Content-Type": "application/x-www-form-urlencoded"}, 415),
        ({"Origin": "http://[::1", "Content-Type": "application/json"}, 403),
    ):
        r = await client.post("/v1/models", data=body, headers={**AUTH, **headers})
        assert r.status == status, (headers, r.status, await r.text())
    r = await client.delete("/v1/models/qwen/v0", headers={**AUTH, "Origin": "http://evil.example"})
    assert r.status == 403 and mgr.status("qwen", "v0") is not None
    assert mgr.fetched == []
    # The listener's own origin is not foreign.
    own = f"http://{client.host}:{client.port}"
    r = await client.post("/v1/models", json=FETCH, headers={**AUTH, "Origin": own})
    assert r.status == 202 and len(mgr.fetched) == 1


async def test_a_host_name_that_is_not_this_machine_is_refused_as_a_rebinding_page_would_send(api):
    client, _, _ = api
    r = await client.get("/v1/models", headers={**AUTH, "Host": "evil.example:8082"})
    assert r.status == 421 and "--api-name" in (await r.json())["error"]["message"]
    for host in ("models.internal:8082", "localhost:8082", "10.1.2.3:8082", "[::1]:8082"):
        r = await client.get("/v1/models", headers={**AUTH, "Host": host})
        assert r.status == 200, host


async def test_being_on_loopback_or_an_allowed_network_is_not_a_credential(tmp_path):
    app = api_app(FakeManager(tmp_path), tmp_path, "http://m:8081", ACCESS, allow=parse_allow(["10.9.9.9"]))
    async with TestClient(TestServer(app, host="127.0.0.1")) as c:
        assert (await c.get("/v1/models")).status == 401
        assert (await c.get("/v1/models", headers=AUTH)).status == 200


def test_the_token_file_lives_beside_the_directory_never_inside_it(tmp_path):
    assert default_token_file("/srv/models") == default_token_file("/srv/models/") == Path("/srv/models.api-token")
    with pytest.raises(MirrorError, match="pass --api-token-file"):
        default_token_file("/")
    root = tmp_path / "models"
    root.mkdir()
    for inside in (root / "t", root / "m" / "v" / ".token", root):
        with pytest.raises(MirrorError, match="inside the mirror's directory"):
            check_token_place(inside, root)
    os.symlink(root, tmp_path / "alias")
    with pytest.raises(MirrorError, match="inside the mirror's directory"):
        check_token_place(tmp_path / "alias" / "t", root)
    assert check_token_place(tmp_path / "t", root) == tmp_path / "t"


def test_the_token_is_made_once_for_its_owner_only_and_an_exposed_one_is_refused(tmp_path):
    path = tmp_path / "models.api-token"
    token, made = ensure_token(path)
    assert made and token.startswith("llmgw-mirror-") and len(token) > 40
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert ensure_token(path) == (token, False)
    path.chmod(0o644)
    with pytest.raises(MirrorError, match="others can read it.*chmod 600"):
        ensure_token(path)
    with pytest.raises(MirrorError, match="cannot create the API token file"):
        (tmp_path / "file").write_text("")
        ensure_token(tmp_path / "file" / "token")
