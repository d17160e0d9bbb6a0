"""The mirror fetches nothing from this machine or from link-local addresses unless told to:
checked on the address each connection goes to, every redirect hop included."""

from __future__ import annotations

import httpcore
import httpx
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from llmgw.mirror.api import ApiAccess, api_app
from llmgw.mirror.fetcher import Manager
from llmgw.mirror.layout import MirrorError
from llmgw.mirror.sources import GuardedTransport, SourcePolicy, SourceRefused, local_kind

TOKEN = "llmgw-mirror-test-token"


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1",
        "127.8.9.10",
        "::1",
        "::ffff:127.0.0.1",
        "0.0.0.0",
        "0.1.2.3",
        "::",
        "169.254.169.254",
        "fe80::1",
        "fe80::1%eth0",
    ],
)
def test_loopback_link_local_and_unspecified_addresses_are_local(address):
    assert local_kind(address) is not None


@pytest.mark.parametrize(
    "address",
    ["10.0.0.5", "192.168.1.7", "172.16.0.1", "8.8.8.8", "fd00::5", "2001:db8::1", "::ffff:10.0.0.5", "not-an-address"],
)
def test_internal_networks_and_public_addresses_are_not_local(address):
    # An internal Hugging Face mirror or file server on 10/8 is an ordinary source.
    assert local_kind(address) is None


class Site:
    """A file server on loopback that counts what it was asked; /go/<where> redirects to <where>."""

    def __init__(self) -> None:
        self.asked: list[str] = []
        app = web.Application()
        app.router.add_get("/{tail:.*}", self.handle)
        self.server = TestServer(app, host="127.0.0.1")

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.asked.append(request.path_qs)
        if request.path.startswith("/go/"):
            raise web.HTTPFound(request.query["to"])
        return web.Response(body=b"loopback-only secret", content_type="application/octet-stream")

    def url(self, path: str) -> str:
        return str(self.server.make_url(path))


@pytest.fixture
async def site():
    s = Site()
    await s.server.start_server()
    yield s
    await s.server.close()


class StandInNetwork(httpcore.AsyncNetworkBackend):
    """A network where each of ``routes`` (an address the policy approved) is really a loopback port,
    so a "public" source can be served by a test server; what was connected to is kept."""

    def __init__(self, routes: dict[str, int]) -> None:
        self.routes, self.connected = routes, []
        self._real = httpcore.AnyIOBackend()

    async def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        self.connected.append((host, port))
        return await self._real.connect_tcp(
            "127.0.0.1", self.routes.get(host, port), timeout, local_address, socket_options
        )

    async def sleep(self, seconds):
        await self._real.sleep(seconds)


def names(table: dict[str, list[list[str]]]):
    """A resolver answering each name from its list of answers, one per lookup (the last repeats)."""

    async def resolve(host, port):
        answers = table[host]
        return answers.pop(0) if len(answers) > 1 else answers[0]

    return resolve


async def test_a_redirect_from_a_public_source_to_loopback_is_refused_before_it_is_followed(site):
    public = "203.0.113.7"
    net = StandInNetwork({public: site.server.port})
    policy = SourcePolicy(resolve=names({"files.example": [[public]], "localhost": [["127.0.0.1"]]}))
    async with httpx.AsyncClient(
        transport=GuardedTransport(policy, network=net, proxies={}), follow_redirects=True
    ) as c:
        r = await c.get(f"http://files.example:{site.server.port}/plain")
        assert r.status_code == 200  # the public source itself is fetched, at the address that was checked
        for target in (
            site.url("/secret"),
            f"http://localhost:{site.server.port}/secret",
            "http://169.254.169.254/latest/meta-data/",
            "http://[::1]:1/x",
            "http://0.0.0.0:1/x",
        ):
            with pytest.raises(SourceRefused, match="--allow-local-sources") as refused:
                await c.get(f"http://files.example:{site.server.port}/go/x", params={"to": target})
            assert httpx.URL(target).host in str(refused.value)
    assert "/secret" not in site.asked and all(h == public for h, _ in net.connected), (site.asked, net.connected)


async def test_a_name_that_resolves_to_loopback_on_a_later_lookup_is_refused_on_that_connection(site):
    # DNS rebinding: public when first asked, loopback a moment later. Each connection is checked
    # on the addresses it is made to, so the second one never reaches loopback.
    net = StandInNetwork({"203.0.113.7": site.server.port})
    policy = SourcePolicy(resolve=names({"rebind.example": [["203.0.113.7"], ["127.0.0.1"]]}))
    async with httpx.AsyncClient(
        transport=GuardedTransport(policy, network=net, proxies={}), headers={"Connection": "close"}
    ) as c:
        assert (await c.get(f"http://rebind.example:{site.server.port}/a")).status_code == 200
        with pytest.raises(SourceRefused, match=r"rebind.example \(127.0.0.1\) is a loopback address"):
            await c.get(f"http://rebind.example:{site.server.port}/b")
    assert site.asked == ["/a"]


async def test_a_name_answering_a_public_and_a_local_address_is_refused_whole():
    policy = SourcePolicy(resolve=names({"both.example": [["203.0.113.7", "127.0.0.1"]]}))
    with pytest.raises(SourceRefused, match=r"both.example \(127.0.0.1\)"):
        await policy.check("https://both.example/model.gguf?token=secret")


async def test_a_refusal_names_the_url_without_its_query():
    with pytest.raises(SourceRefused) as refused:
        await SourcePolicy().check("http://127.0.0.1:9/x.gguf?X-Amz-Signature=secret")
    assert "http://127.0.0.1:9/x.gguf:" in str(refused.value) and "secret" not in str(refused.value)


async def test_a_source_on_loopback_is_refused_at_once_and_nothing_is_fetched(site, tmp_path):
    mgr = Manager(tmp_path / "root", architectures=frozenset({"llama"}))
    try:
        for source in (site.url("/model.gguf"), site.url("/tok.bin"), f"http://localhost:{site.server.port}/tok.bin"):
            with pytest.raises(MirrorError, match="is a loopback address.*--allow-local-sources"):
                await mgr.fetch(source, "m", "v")
        assert site.asked == [] and mgr.list() == []
    finally:
        await mgr.close()


async def test_allow_local_sources_lets_the_operator_fetch_from_this_machine(site, tmp_path):
    mgr = Manager(tmp_path / "root", allow_local_sources=True)
    try:
        await mgr.fetch(site.url("/tok.bin"), "m", "v")
        assert (await mgr.wait("m", "v")).state == "present"
        assert (tmp_path / "root" / "m" / "v" / "tok.bin").read_bytes() == b"loopback-only secret"
    finally:
        await mgr.close()


async def test_the_configured_hugging_face_endpoint_may_be_local_but_its_redirect_to_another_local_port_is_not(
    site, tmp_path
):
    other = Site()
    await other.server.start_server()
    mgr = Manager(tmp_path / "root", hf_endpoint=site.url("/").rstrip("/"), architectures=frozenset({"llama"}))
    try:
        # The endpoint's own origin is the operator's setting: fetched from although it is loopback.
        await mgr.fetch(site.url("/direct.bin"), "m", "v1")
        assert (await mgr.wait("m", "v1")).state == "present"
        await mgr.fetch(site.url("/go/x.bin") + "?to=" + other.url("/secret.bin"), "m", "v2", as_name="x.bin")
        vs = await mgr.wait("m", "v2")
        assert vs.state == "failed" and "is a loopback address" in vs.reason and "--allow-local-sources" in vs.reason
        assert other.asked == [] and not (tmp_path / "root" / "m" / "v2" / "x.bin").exists()
    finally:
        await mgr.close()
        await other.server.close()


async def test_the_management_api_refuses_a_loopback_source_with_the_reason(site, tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    mgr = Manager(root)
    app = api_app(mgr, root, "http://m:8081", ApiAccess(token=TOKEN, token_file="/t"))
    try:
        async with TestClient(TestServer(app), headers={"Authorization": f"Bearer {TOKEN}"}) as c:
            r = await c.post("/v1/models", json={"source": site.url("/page"), "model": "m", "version": "v"})
            assert r.status == 400 and "--allow-local-sources" in (await r.json())["error"]["message"]
        assert site.asked == []
    finally:
        await mgr.close()


async def test_a_url_that_cannot_be_read_is_refused_in_words(tmp_path):
    mgr = Manager(tmp_path / "root")
    try:
        with pytest.raises(MirrorError, match="is not a URL that can be fetched"):
            await mgr.fetch("http://[::1/x.bin", "m", "v")
    finally:
        await mgr.close()
