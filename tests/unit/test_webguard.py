"""The management APIs' guard: what only a browser or a DNS-rebinding page sends is refused."""

from __future__ import annotations

from aiohttp.test_utils import make_mocked_request

from llmgw.webguard import bearer_token, guard_for, machine_names


async def _nobody(request):
    return None


GUARD = guard_for(machine_names("cp.internal"), _nobody, "get a token", lambda *a: a)


def _req(method="GET", **headers):
    return make_mocked_request(method, "/api/v1/status", headers=headers)


def test_addresses_and_this_machines_names_are_hosts_a_rebinding_page_cannot_present():
    for host in ("127.0.0.1:9090", "[::1]:9090", "10.1.2.3", "localhost:9090", "cp.internal:9090", "CP.INTERNAL"):
        assert GUARD.host_allowed(host), host
    for host in ("evil.example:9090", "127.0.0.1.nip.io:9090", "", None, "[not an address"):
        assert not GUARD.host_allowed(host), host


def test_a_foreign_origin_a_cross_site_fetch_and_a_non_json_write_are_refused():
    assert GUARD.refusal(_req(Host="127.0.0.1:9090")) is None
    assert GUARD.refusal(_req(Host="127.0.0.1:9090", Origin="http://127.0.0.1:9090")) is None
    assert GUARD.refusal(_req(Host="127.0.0.1:9090", Origin="http://127.0.0.1:8080"))[2] == "cross_origin"
    assert GUARD.refusal(_req(Host="127.0.0.1:9090", Origin="null"))[2] == "cross_origin"
    assert GUARD.refusal(_req(Host="127.0.0.1:9090", **{"Sec-Fetch-Site": "cross-site"}))[2] == "cross_origin"
    assert GUARD.refusal(_req("POST", Host="127.0.0.1:9090", **{"Content-Type": "text/plain"}))[0] == 415
    assert (
        GUARD.refusal(_req("POST", Host="127.0.0.1:9090", **{"Content-Type": "application/x-www-form-urlencoded"}))[0]
        == 415
    )
    assert GUARD.refusal(_req("POST", Host="127.0.0.1:9090", **{"Content-Type": "application/json"})) is None
    status, message, code = GUARD.refusal(_req(Host="evil.example:9090"))
    assert (status, code) == (421, "host_not_allowed") and "admin_hosts" in message
    assert GUARD.refusal(_req())[0] in (400, 421)


def test_a_bearer_token_with_bytes_that_are_not_ascii_is_no_token_rather_than_an_error():
    assert bearer_token(_req(Authorization="Bearer llmgw-admin-abc")) == "llmgw-admin-abc"
    assert bearer_token(_req(Authorization="Basic abc")) is None
    assert bearer_token(_req(Authorization="Bearer llmgw-\u00e9")) is None
    assert bearer_token(_req(Authorization="Bearer a\x00b")) is None
    assert bearer_token(_req()) is None
