"""The administrator's Quotas and Usage pages against a real in-process server and a fake engine: the
whole tree, an edit holding the very next request through the gateway, clearing, the log of changes,
inherited limits, the guards, per-key limits refused, usage grouped each way over each window, and
names typed by people escaped."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest
from test_pages import PASSWORD, active_person, base, form_token, sign_in

from llmgw.config.server import parse_server_config
from llmgw.server.app import Server
from llmgw.store import UsageRow
from llmgw.testing.fake_engine import FakeEngine
from llmgw.testing.ports import free_port as _port
from llmgw.testing.waiting import async_until

ADMIN = "root@example.com"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}


async def _start(tmp_path, engine: FakeEngine, **auth) -> Server:
    cfg = parse_server_config(
        {
            "listen": f"127.0.0.1:{_port()}",
            "admin_listen": f"127.0.0.1:{_port()}",
            "metrics_listen": None,
            "agent_listen": f"127.0.0.1:{_port()}",
            "agent_tls": None,
            "auth": {"store": str(tmp_path / "gw.db"), **auth},
            "usage": {"flush_interval": "50ms"},
            "data_dir": str(tmp_path),
            "models": [{"name": "m", "endpoints": [{"url": engine.url, "engine": "llamacpp"}]}],
        }
    )
    srv = Server(cfg)
    await srv.start()
    return srv


@pytest.fixture
async def served(tmp_path):
    engine = await FakeEngine(model="m", tokens=6).start()
    srv = await _start(tmp_path, engine)
    await srv.store.create_user(ADMIN, PASSWORD, admin=True)
    try:
        yield srv
    finally:
        await srv.stop()
        await engine.stop()


@pytest.fixture
async def priced(tmp_path):
    engine = await FakeEngine(model="m", tokens=6).start()
    srv = await _start(tmp_path, engine, pricing={"m": {"prompt_per_1k": 1.0, "completion_per_1k": 2.0}})
    await srv.store.create_user(ADMIN, PASSWORD, admin=True)
    try:
        yield srv
    finally:
        await srv.stop()
        await engine.stop()


async def _tree(srv: Server):
    store = srv.store
    org = await store.add_org("Acme")
    team = await store.add_team("platform", "Acme")
    proj = await store.add_project("gateway", "Acme/platform")
    return org, team, proj


@asynccontextmanager
async def _admin(srv: Server) -> AsyncIterator[httpx.AsyncClient]:
    """A browser signed in as the administrator."""
    async with httpx.AsyncClient(base_url=base(srv)) as http:
        assert (await sign_in(http, ADMIN)).status_code == 303
        yield http


async def _save(http: httpx.AsyncClient, level: str, **fields: str) -> httpx.Response:
    page = (await http.get("/admin/quotas", params={"edit": level})).text
    data = {"csrf": form_token(page), "level": level, "rpm": "", "tpm": "", "budget": "", "period": "month"}
    data.update(fields)
    return await http.post("/admin/quotas", data=data)


async def _key_accepted(srv: Server, secret: str) -> None:
    async def accepted() -> bool:
        async with httpx.AsyncClient(base_url=base(srv)) as api:
            r = await api.get("/v1/models", headers={"Authorization": f"Bearer {secret}"})
            return r.status_code == 200

    await async_until(accepted, 10, "the gateway to accept the new key")


def _row(page: str, anchor: str) -> str:
    m = re.search(rf'<tbody id="{re.escape(anchor)}".*?</tbody>', page, re.S)
    assert m, f"no row {anchor} in the page"
    return m.group(0)


async def test_the_quotas_page_shows_every_level_of_the_tree_and_every_person_with_or_without_limits(served):
    srv = served
    org, team, proj = await _tree(srv)
    await srv.store.add_org("Empty")
    ann = await active_person(srv)
    await srv.store.set_limits("team", team.id, rpm=600, tpm=200000)
    await srv.store.set_limits("project", proj.id, per_member=True, budget_micros=20_000_000, period="day")
    await srv.store.set_limits("org", org.id, models=["m", "other"], band="high")
    async with _admin(srv) as http:
        r = await http.get("/admin/quotas")
    assert r.status_code == 200
    page = r.text
    assert 'href="/admin/quotas" aria-current="page"' in page and 'href="/admin/usage"' in page
    for anchor in (f"q-org-{org.id}", f"q-team-{team.id}", f"q-project-{proj.id}", f"q-user-{ann.id}"):
        _row(page, anchor)
    assert "Empty" in page and ann.email in page and ADMIN in page
    team_row = _row(page, f"q-team-{team.id}")
    assert "600" in team_row and "200,000" in team_row
    members = _row(page, f"q-project-member-{proj.id}")
    assert "each member of Acme/platform/gateway" in members and "20.00 a day" in members
    org_row = _row(page, f"q-org-{org.id}")
    assert "m, other" in org_row and "high" in org_row
    # Nothing is priced: budgets cannot bind, and the page says so.
    assert "No model has a price" in page and "rate and token limits are unaffected" in page


async def test_a_projects_rpm_set_on_the_page_holds_the_next_request_and_clearing_it_removes_the_row(served):
    srv = served
    _, _, proj = await _tree(srv)
    issued = await srv.store.issue_key("ci", project=proj.id)
    await _key_accepted(srv, issued.secret)
    key = {"Authorization": f"Bearer {issued.secret}"}
    async with _admin(srv) as http, httpx.AsyncClient(base_url=base(srv), headers=key) as api:
        assert (await api.post("/v1/chat/completions", json=CHAT)).status_code == 200
        r = await _save(http, f"project:{proj.id}", rpm="1")
        assert r.status_code == 303 and r.headers["location"].startswith(f"/admin/quotas?saved=project:{proj.id}")
        page = (await http.get(r.headers["location"])).text
        assert "Saved the limits of project Acme/platform/gateway" in page
        assert "q-edit-row" not in page  # saving closes the form
        assert (await srv.store.get_limits("project", proj.id)).rpm == 1
        # No waiting for the key cache's poll: the very next requests are held to the new limit.
        assert (await api.post("/v1/chat/completions", json=CHAT)).status_code == 200
        refused = await api.post("/v1/chat/completions", json=CHAT)
        assert refused.status_code == 429 and "a minute" in refused.json()["error"]["message"]

        r = await _save(http, f"project:{proj.id}")  # every field blank
        assert r.status_code == 303
        assert await srv.store.get_limits("project", proj.id) is None
        assert (await api.post("/v1/chat/completions", json=CHAT)).status_code == 200


async def test_every_change_is_logged_with_who_made_it_and_the_value_before(served):
    srv = served
    _, team, _ = await _tree(srv)
    await srv.store.set_limits("team", team.id, rpm=5)  # the command line's way
    async with _admin(srv) as http:
        assert (await _save(http, f"team:{team.id}", rpm="7", budget="2.5", period="day")).status_code == 303
        assert (await _save(http, f"team:{team.id}", rpm="7", budget="2.5", period="day")).status_code == 303
        r = await _save(http, f"team:{team.id}", clear="1")
        assert r.status_code == 303
        page = (await http.get("/admin/quotas")).text
    changes = await srv.store.limit_changes()
    assert [(c.changed_by, c.old and c.old.rpm, c.new and c.new.rpm) for c in changes] == [
        (ADMIN, 7, None),
        (ADMIN, 5, 7),  # saving the same values again changed nothing and logged nothing
        (None, None, 5),
    ]
    assert changes[1].new.budget_micros == 2_500_000 and changes[1].new.period == "day"
    log = page[page.index("Last changes") :]
    assert ADMIN in log and "the command line" in log and "team Acme/platform" in log
    assert "5 requests/min" in log and "7 requests/min; budget 2.50 a day" in log and "no limits" in log


async def test_limits_set_above_are_shown_muted_as_inherited_with_where_they_come_from(served):
    srv = served
    _, team, proj = await _tree(srv)
    await srv.store.set_limits("team", team.id, rpm=100, band="low")
    await srv.store.set_limits("project", proj.id, tpm=5000)
    await srv.store.set_limits("project", proj.id, per_member=True, rpm=500)
    async with _admin(srv) as http:
        page = (await http.get("/admin/quotas", params={"edit": f"project:{proj.id}"})).text
    row = _row(page, f"q-project-{proj.id}")
    assert '<span class="q-inherited" title="inherited from team Acme/platform">↑ 100</span>' in row
    assert "↑ low" in row and "5,000" in row
    assert 'placeholder="↑ 100 from team platform"' in row  # the open form says it too
    assert 'name="rpm" inputmode="numeric" value=""' in row and 'name="tpm" inputmode="numeric" value="5000"' in row
    members = _row(page, f"q-project-member-{proj.id}")
    assert '<span class="q-caps" title="team Acme/platform">capped at 100 by team platform</span>' in members


async def test_a_non_administrator_gets_403_and_a_post_without_its_token_is_refused(served):
    srv = served
    _, team, _ = await _tree(srv)
    await active_person(srv)
    async with httpx.AsyncClient(base_url=base(srv)) as http:
        await sign_in(http, "ann@example.com")
        token = form_token((await http.get("/chat")).text)
        for path in ("/admin/quotas", "/admin/usage"):
            r = await http.get(path)
            assert r.status_code == 403 and "for administrators" in r.text
        r = await http.post("/admin/quotas", data={"csrf": token, "level": f"team:{team.id}", "rpm": "1"})
        assert r.status_code == 403
        assert 'href="/admin/quotas"' not in (await http.get("/chat")).text  # nor is it in their menu
    async with _admin(srv) as http:
        r = await http.post("/admin/quotas", data={"level": f"team:{team.id}", "rpm": "1"})
        assert r.status_code == 403 and "security token" in r.text
        page = (await http.get("/admin/quotas")).text
        r = await http.post(
            "/admin/quotas",
            data={"csrf": form_token(page), "level": f"team:{team.id}", "rpm": "1"},
            headers={"Origin": "https://evil.example"},
        )
        assert r.status_code == 403
    assert await srv.store.get_limits("team", team.id) is None


async def test_per_key_limits_are_refused_on_the_page_and_left_to_the_command_line(served):
    srv = served
    _, _, proj = await _tree(srv)
    issued = await srv.store.issue_key("ci", project=proj.id)
    await srv.store.set_limits("key", issued.key.id, rpm=3)
    async with _admin(srv) as http:
        r = await http.get("/admin/quotas", params={"edit": f"key:{issued.key.id}"})
        assert r.status_code == 400 and "llmgw keys limits --scope key" in r.text and "q-edit-row" not in r.text
        r = await http.post(
            "/admin/quotas", data={"csrf": form_token(r.text), "level": f"key:{issued.key.id}", "rpm": "50"}
        )
        assert r.status_code == 400 and "command line only" in r.text
        page = (await http.get("/admin/quotas")).text
    assert (await srv.store.get_limits("key", issued.key.id)).rpm == 3
    assert "ci" in _row(page, f"q-key-{issued.key.id}")  # shown, read-only
    assert f"?edit=key:{issued.key.id}" not in page


async def test_a_value_the_store_would_refuse_keeps_the_form_open_with_what_was_typed(served):
    srv = served
    _, team, _ = await _tree(srv)
    async with _admin(srv) as http:
        for fields, words in (
            ({"rpm": "-3"}, "whole number"),
            ({"budget": "2000000"}, "--allow-large-budget"),
            ({"budget": "0.0000001"}, "6 decimals"),
            ({"models": "m", "models_none": "1"}, "not both"),
        ):
            r = await _save(http, f"team:{team.id}", **fields)
            assert r.status_code == 400 and words in r.text, fields
            assert "q-edit-row" in r.text and f'value="{next(iter(fields.values()))}"' in r.text
    assert await srv.store.get_limits("team", team.id) is None and await srv.store.limit_changes() == []


async def test_a_budget_shows_the_spend_of_its_period_with_a_meter_red_past_90_percent(priced):
    srv = priced
    _, team, proj = await _tree(srv)
    ann = await active_person(srv)
    await srv.store.join(ann.id, "project", proj.id)
    await srv.store.set_limits("project", proj.id, budget_micros=1_000_000)
    await srv.store.set_limits("team", team.id, budget_micros=10_000_000)
    await srv.store.set_limits("project", proj.id, per_member=True, budget_micros=2_000_000)
    where = {"project_id": proj.id, "team_id": team.id, "org_id": proj.org_id}
    await srv.store.insert_usage(
        [
            UsageRow(model="m", endpoint="e", status=200, latency_ms=1, cost_micros=950_000, user_id=ann.id, **where),
        ]
    )
    async with _admin(srv) as http:
        page = (await http.get("/admin/quotas")).text
    assert "No model has a price" not in page
    project = _row(page, f"q-project-{proj.id}")
    assert "0.95" in project and "this month" in project and "q-meter q-red" in project and "95%" in project
    team_row = _row(page, f"q-team-{team.id}")
    assert "0.95" in team_row and "q-red" not in team_row and "9.5%" in team_row
    members = _row(page, f"q-project-member-{proj.id}")
    assert "most: ann@example.com" in members and "47%" in members
    assert "the last 30 days" in _row(page, f"q-org-{proj.org_id}")  # no budget: thirty days of spend


async def test_the_usage_page_shows_a_keys_requests_grouped_each_way_over_each_window(served):
    srv = served
    _, _, proj = await _tree(srv)
    ann = await active_person(srv)
    await srv.store.join(ann.id, "project", proj.id)
    issued = await srv.store.issue_key("laptop", project=proj.id, owner=ann.id)
    await _key_accepted(srv, issued.secret)
    async with httpx.AsyncClient(base_url=base(srv), headers={"Authorization": f"Bearer {issued.secret}"}) as api:
        for _ in range(3):
            assert (await api.post("/v1/chat/completions", json=CHAT)).status_code == 200

    async def written() -> bool:
        return await srv.store.count_usage() == 3

    await async_until(written, 10, "the usage rows to be written")
    labels = {"org": "Acme", "team": "Acme/platform", "project": "Acme/platform/gateway", "person": ann.email}
    async with _admin(srv) as http:
        for window in ("1h", "24h", "7d", "30d"):
            for by, label in labels.items():
                r = await http.get("/admin/usage", params={"window": window, "by": by})
                assert r.status_code == 200, (window, by)
                table = r.text[r.text.index('<table class="u-table">') : r.text.index("</table>")].replace("<wbr>", "")
                assert re.search(rf">{re.escape(label)}</th><td class=\"num\">3</td>", table), (window, by)
                assert "<svg" in r.text and "<rect" in r.text and "<script" not in r.text.split("</head>")[1]
                assert "nothing is spent" in r.text and ">Spend<" not in r.text
        r = await http.get("/admin/usage", params={"window": "1h", "by": "project", "measure": "tokens"})
        assert "Ranked by tokens" in r.text
        assert 'aria-current="true">the last hour<' in r.text


async def test_names_people_typed_are_escaped_on_both_pages(served):
    srv = served
    org = await srv.store.add_org("<script>alert(1)")
    team = await srv.store.add_team("<img src=x onerror=alert(2)>", org.id)
    proj = await srv.store.add_project('"><b>p', team.id)
    issued = await srv.store.issue_key("<script>key", project=proj.id)
    await srv.store.set_limits("key", issued.key.id, rpm=9)
    await srv.store.create_user("eve@example.com", PASSWORD, name="<script>eve")
    await srv.store.insert_usage(
        [
            UsageRow(
                model="m", endpoint="e", status=200, latency_ms=1, project_id=proj.id, team_id=team.id, org_id=org.id
            )
        ]
    )
    async with _admin(srv) as http:
        pages = [(await http.get("/admin/quotas", params={"edit": f"team:{team.id}"})).text]
        pages += [(await http.get("/admin/usage", params={"by": by})).text for by in ("org", "team", "project")]
    for page in pages:
        body = page.split("</head>", 1)[1]
        assert "<script" not in body and "<img" not in body and '"><b>' not in body
    assert "&lt;script&gt;alert(1)" in pages[0] and "&lt;script&gt;eve" in pages[0] and "&lt;script&gt;key" in pages[0]
    assert "&lt;img src=x onerror=alert(2)&gt;" in pages[2]
