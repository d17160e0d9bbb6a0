"""The Organization page (/org) against a real in-process server: a manager sees the organization they
manage (its teams and projects with their limits and thirty days' spend, its members each once with
every place they belong, its usage over time by team, project or person, and nothing of another
organization's), an administrator sees every organization (or, with none, where to make one), anyone
else gets 403, the menu item shows only to those who may open it, and names are escaped."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import timedelta

import httpx
import pytest
from test_pages import PASSWORD, base, sign_in

from llmgw.config.server import parse_server_config
from llmgw.server.app import Server
from llmgw.store import Org, Project, Team, UsageRow, User
from llmgw.store.records import utcnow
from llmgw.testing.ports import free_port as _port

ADMIN = "root@example.com"
MIA = "mia@example.com"  # manages Acme
ANN = "ann@example.com"  # in Acme twice (a team and a project), and in Other
BOB = "bob@example.com"  # only in Other


async def _server(tmp_path, priced: bool = True) -> Server:
    auth: dict = {"store": str(tmp_path / "gw.db")}
    if priced:
        auth["pricing"] = {"m": {"prompt_per_1k": 1.0, "completion_per_1k": 1.0}}
    cfg = parse_server_config(
        {
            "listen": f"127.0.0.1:{_port()}",
            "admin_listen": f"127.0.0.1:{_port()}",
            "metrics_listen": None,
            "auth": auth,
            "data_dir": str(tmp_path),
            "models": [{"name": "m", "endpoints": [{"url": "http://127.0.0.1:9", "engine": "openai"}]}],
        }
    )
    srv = Server(cfg)
    await srv.start()
    await srv.store.create_user(ADMIN, PASSWORD, admin=True)
    return srv


@dataclass
class World:
    srv: Server
    acme: Org
    platform: Team
    data: Team
    gateway: Project
    etl: Project
    other: Org
    elsewhere: Project
    ann: User


async def _spend(srv: Server, proj: Project, user: User | None, micros: int, tokens: int, days_ago: float = 0) -> None:
    await srv.store.insert_usage(
        [
            UsageRow(
                model="m",
                endpoint="e",
                status=200,
                latency_ms=1,
                prompt_tokens=tokens,
                cost_micros=micros,
                user_id=user.id if user else None,
                project_id=proj.id,
                team_id=proj.team_id,
                org_id=proj.org_id,
                at=utcnow() - timedelta(days=days_ago),
            )
        ]
    )


async def _world(srv: Server) -> World:
    s = srv.store
    acme = await s.add_org("Acme")
    platform = await s.add_team("platform", "Acme")
    data = await s.add_team("data", "Acme")
    gateway = await s.add_project("gateway", "Acme/platform")
    etl = await s.add_project("etl", "Acme/data")
    other = await s.add_org("Other")
    await s.add_team("t", "Other")
    elsewhere = await s.add_project("p", "Other/t")
    mia = await s.create_user(MIA, PASSWORD, name="Mia")
    ann = await s.create_user(ANN, PASSWORD, name="Ann")
    bob = await s.create_user(BOB, PASSWORD)
    await s.join(mia.id, "org", "Acme", role="manager")
    await s.join(ann.id, "team", "Acme/data")
    await s.join(ann.id, "project", "Acme/platform/gateway")
    await s.join(ann.id, "project", "Other/t/p")
    await s.join(bob.id, "project", "Other/t/p")
    await s.set_limits("org", acme.id, tpm=50_000)
    await s.set_limits("team", platform.id, rpm=100)
    await s.set_limits("project", gateway.id, budget_micros=10_000_000, period="month")
    await _spend(srv, gateway, ann, 1_500_000, 300)
    await _spend(srv, etl, ann, 250_000, 50, days_ago=2)
    await _spend(srv, etl, None, 100_000, 20)  # a project key that belongs to no one
    await _spend(srv, elsewhere, ann, 7_000_000, 999)  # Ann's spend in Other: never on Acme's page
    await _spend(srv, elsewhere, bob, 3_000_000, 111)
    await _spend(srv, gateway, ann, 9_990_000, 1, days_ago=40)  # before the last thirty days
    return World(srv, acme, platform, data, gateway, etl, other, elsewhere, ann)


@pytest.fixture
async def world(tmp_path) -> AsyncIterator[World]:
    srv = await _server(tmp_path)
    try:
        yield await _world(srv)
    finally:
        await srv.stop()


@asynccontextmanager
async def signed_in(srv: Server, email: str) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=base(srv)) as http:
        assert (await sign_in(http, email)).status_code == 303
        yield http


def _menu(page: str) -> str:
    return re.search(r'<nav class="menu".*?</nav>', page, re.S).group(0)


def _level(page: str, what: str, label: str) -> str:
    rows = re.findall(r'<tr class="o-level">.*?</tr>', page, re.S)
    found = [r for r in rows if f'<span class="q-what">{what}</span> {label}</th>' in r]
    assert len(found) == 1, f"no single {what} {label} row"
    return found[0]


def _section(page: str, heading_id: str) -> str:
    start = page.index(f'aria-labelledby="{heading_id}"')
    return page[start : page.index("</section>", start)]


async def test_a_manager_sees_their_organizations_teams_and_projects_with_limits_and_thirty_days_spend(world):
    async with signed_in(world.srv, MIA) as http:
        r = await http.get("/org")
    assert r.status_code == 200
    page = r.text
    menu = _menu(page)
    assert 'href="/org" aria-current="page">Organizations</a>' in menu
    assert 'href="/admin"' not in menu and 'href="/admin/quotas"' not in menu
    assert "<h1>Acme</h1>" in page and "Other" not in page.split("<main>")[1]
    org = _level(page, "organization", "Acme")
    assert "50,000" in org and "1.85" in org  # its own tpm; everything spent in its projects in 30 days
    platform = _level(page, "team", "platform")
    assert "100" in platform and "↑ 50,000" in platform and "1.50" in platform
    gateway = _level(page, "project", "gateway")
    assert '<span class="q-inherited" title="inherited from team Acme/platform">↑ 100</span>' in gateway
    assert "10.00 a month" in gateway and 'value="0.15"' in gateway and "1.50 this month" in gateway
    etl = _level(page, "project", "etl")
    assert "0.35" in etl  # Ann's and the ownerless key's
    assert "9.99" not in page  # forty days ago


async def test_a_manager_sees_each_member_once_with_every_place_they_belong(world):
    async with signed_in(world.srv, MIA) as http:
        page = (await http.get("/org")).text
    members = _section(page, "h-members")
    rows = re.findall(r"<tr>\s*<th scope=\"row\" class=\"wrap o-person\">.*?</tr>", members, re.S)
    emails = [re.search(r'o-person">([^ <]+)', row).group(1) for row in rows]
    assert emails == [MIA, ANN]  # the manager first; Bob is only in Other
    ann = rows[1]
    assert '<span class="q-what">team</span> Acme/data' in ann
    assert '<span class="q-what">project</span> Acme/platform/gateway' in ann
    assert "Other" not in ann and "1.75" in ann  # her spend in Acme only
    assert '<span class="q-what">organization</span> Acme <span class="tag">manager</span>' in rows[0]


async def test_usage_over_time_is_only_the_organizations_by_team_project_or_person(world):
    async with signed_in(world.srv, MIA) as http:
        by_team = (await http.get("/org")).text
        by_person = (await http.get("/org", params={"by": "person", "window": "7d", "measure": "spend"})).text
        by_project = (await http.get("/org", params={"by": "project", "window": "24h", "measure": "tokens"})).text
    usage = _section(by_team, "h-usage")
    assert "In the last 30 days: <strong>3</strong> requests, <strong>370</strong> tokens" in usage
    labels = re.findall(r'<th scope="row" class="u-name"[^>]*>(.*?)</th>', usage.replace("<wbr>", ""))
    assert sorted(labels) == ["Acme/data", "Acme/platform"]
    assert len(re.findall(r'<figure class="u-chart">', usage)) == 2
    assert usage.count("<rect ") == 60  # two charts of thirty days, gaps filled
    person = _section(by_person, "h-usage")
    assert ANN in person and "no person" in person and "1.75" in person and "7.00" not in person
    assert BOB not in person and 'aria-current="true">spend</a>' in person
    project = _section(by_project, "h-usage")
    assert "In the last 24 hours: <strong>2</strong> requests, <strong>320</strong> tokens" in project
    assert "gateway" in project and "etl" in project


async def test_a_manager_cannot_open_another_organization(world):
    async with signed_in(world.srv, MIA) as http:
        r = await http.get("/org", params={"org": world.other.id})
        assert r.status_code == 404 and "no such organization among those you may see" in r.text
        assert "Other" not in r.text.split("<main>")[1]


async def test_an_administrator_sees_every_organization_and_chooses_among_them(world):
    async with signed_in(world.srv, ADMIN) as http:
        first = (await http.get("/org")).text
        other = (await http.get("/org", params={"org": world.other.id})).text
    assert 'href="/org"' in _menu(first) and 'href="/admin"' in _menu(first)
    pills = re.search(r'<nav class="qu-pills" aria-label="Organization">.*?</nav>', first, re.S).group(0)
    assert f'href="/org?org={world.acme.id}" aria-current="true">Acme</a>' in pills and ">Other</a>" in pills
    assert "<h1>Acme</h1>" in first and "<h1>Other</h1>" in other
    assert BOB in _section(other, "h-members") and "10.00" in _section(other, "h-levels")


async def test_an_administrator_without_any_organization_is_told_where_to_make_one(tmp_path):
    srv = await _server(tmp_path)
    try:
        async with signed_in(srv, ADMIN) as http:
            r = await http.get("/org")
        assert r.status_code == 200
        assert "There is no organization yet" in r.text and 'href="/admin/users"' in r.text
        assert "llmgw org add org NAME" in r.text
    finally:
        await srv.stop()


async def test_someone_who_manages_nothing_gets_403_with_a_sentence_and_no_menu_item(world):
    for email in (ANN, BOB):
        async with signed_in(world.srv, email) as http:
            r = await http.get("/org")
            assert r.status_code == 403
            assert "This page is for the managers of an organization, and you manage none." in r.text
            assert 'href="/org"' not in _menu((await http.get("/profile")).text)
    async with httpx.AsyncClient(base_url=base(world.srv)) as http:
        r = await http.get("/org")
        assert r.status_code == 303 and r.headers["location"] == "/login?next=/org"


async def test_the_menu_item_follows_a_managers_role_as_it_is_given_and_taken_back(world):
    async with signed_in(world.srv, BOB) as http:
        assert 'href="/org"' not in _menu((await http.get("/profile")).text)
        await world.srv.store.join(BOB, "org", "Other", role="manager")
        page = (await http.get("/profile")).text
        assert 'href="/org">Organizations</a>' in _menu(page)
        assert "<h1>Other</h1>" in (await http.get("/org")).text
        await world.srv.store.join(BOB, "org", "Other", role="member")
        assert 'href="/org"' not in _menu((await http.get("/profile")).text)
        assert (await http.get("/org")).status_code == 403


async def test_without_prices_the_page_shows_requests_and_tokens_and_says_nothing_is_spent(tmp_path):
    srv = await _server(tmp_path, priced=False)
    try:
        await _world(srv)
        async with signed_in(srv, MIA) as http:
            page = (await http.get("/org", params={"measure": "spend"})).text
        assert "No model has a price" in page and "Spent, 30 days" not in page
        assert 'aria-current="true">requests</a>' in page and ">spend</a>" not in page
    finally:
        await srv.stop()


async def test_names_on_the_organization_page_are_escaped(tmp_path):
    srv = await _server(tmp_path)
    try:
        s = srv.store
        await s.add_org("<script>alert(1)")
        await s.add_team("<b>t", "<script>alert(1)")
        proj = await s.add_project("<i>p", "<script>alert(1)/<b>t")
        eve = await s.create_user("eve@example.com", PASSWORD, name="<script>eve")
        await s.join(eve.id, "org", "<script>alert(1)", role="manager")
        await _spend(srv, proj, eve, 1000, 5)
        async with signed_in(srv, "eve@example.com") as http:
            pages = [(await http.get("/org", params={"by": by})).text for by in ("team", "project", "person")]
        for page in pages:
            body = page.split("</head>")[1]
            assert "<script" not in body and "<b>t" not in body and "<i>p" not in body
        assert "&lt;script&gt;alert(1)" in pages[0] and "&lt;script&gt;eve" in pages[0] and "&lt;b&gt;t" in pages[0]
        assert "&lt;i&gt;p" in pages[1]
    finally:
        await srv.stop()
