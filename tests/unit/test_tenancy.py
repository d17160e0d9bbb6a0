"""The tenancy tree, people, tenant keys, claims, limits and principals, on both backends."""

from __future__ import annotations

import hashlib
import re
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select, text

from llmgw.server.gateway.auth import AuthError, KeyCache, build_principal
from llmgw.server.gateway.principal import Pool
from llmgw.store import Ambiguous, NotFound, NotMember, Store, StoreError, UsageRow
from llmgw.store.schema import key_claims, limits
from llmgw.store.tenancy import SIGN_UP_TAKEN
from llmgw.testing.waiting import async_until

UTC = UTC


@pytest.fixture
async def store(address):
    s = await Store.open(address)
    yield s
    await s.close()


async def _acme(s: Store):
    org = await s.add_org("Acme")
    team = await s.add_team("platform", "Acme")
    proj = await s.add_project("gateway", "Acme/platform")
    return org, team, proj


# -- the tree --------------------------------------------------------------------


async def test_tree_ids_paths_and_resolution(store):
    org, team, proj = await _acme(store)
    assert re.fullmatch(r"org-[0-9a-f]{10}", org.id) and team.id.startswith("team-") and proj.id.startswith("proj-")
    assert (team.path, proj.path) == ("Acme/platform", "Acme/platform/gateway")
    for ref in (proj.id, "Acme/platform/gateway", "gateway", " /Acme/platform/gateway/ "):
        assert (await store.find("project", ref)).id == proj.id
    assert (await store.find("team", "platform")).id == team.id
    assert (await store.find("org", org.id)).name == "Acme"
    # A name used twice is refused, listing the paths.
    await store.add_org("Beta")
    await store.add_team("platform", "Beta")
    with pytest.raises(Ambiguous) as ei:
        await store.find("team", "platform")
    assert ei.value.paths == ["Acme/platform", "Beta/platform"]
    assert "Acme/platform, Beta/platform" in str(ei.value)
    with pytest.raises(NotFound, match='No project at "Acme/nope/gateway"'):
        await store.find("project", "Acme/nope/gateway")
    with pytest.raises(NotFound, match="No organization is named"):
        await store.find("org", "Nope")


async def test_tree_names_unique_among_siblings_only(store):
    await _acme(store)
    gen = await store.keys_generation()
    with pytest.raises(StoreError, match="already"):
        await store.add_org("Acme")
    with pytest.raises(StoreError, match="Acme/platform has a project named"):
        await store.add_project("gateway", "Acme/platform")
    for bad in ("", "a/b", "x" * 201, "line\nbreak", "proj-0123456789"):
        with pytest.raises(StoreError):
            await store.add_team(bad, "Acme")
    with pytest.raises(NotFound):
        await store.add_project("p", "Acme/none")
    assert await store.keys_generation() == gen  # refusals changed nothing
    await store.add_team("data", "Acme")
    await store.add_project("gateway", "Acme/data")  # same name, other parent: fine
    assert sorted(p.path for p in (await store.tree()).projects.values()) == [
        "Acme/data/gateway",
        "Acme/platform/gateway",
    ]


async def test_rename_move_remove(store):
    _org, _team, proj = await _acme(store)
    await store.add_team("data", "Acme")
    gen = await store.keys_generation()
    renamed = await store.rename("project", "Acme/platform/gateway", "gw")
    assert renamed.id == proj.id and renamed.path == "Acme/platform/gw"
    assert await store.keys_generation() == gen + 1
    with pytest.raises(StoreError, match='named "data" there already'):
        await store.rename("team", "platform", "data")
    moved = await store.move("project", proj.id, "Acme/data")
    assert moved.path == "Acme/data/gw"
    with pytest.raises(StoreError, match="Only a team"):
        await store.move("org", "Acme", "Acme")
    await store.add_project("gw", "Acme/platform")
    with pytest.raises(StoreError, match='has a project named "gw" already'):
        await store.move("project", "Acme/platform/gw", "Acme/data")
    # Only empty things go.
    with pytest.raises(StoreError, match="not empty"):
        await store.remove("team", "Acme/data")
    with pytest.raises(StoreError, match="not empty"):
        await store.remove("org", "Acme")
    removed = await store.remove("project", "Acme/platform/gw")
    assert removed.path == "Acme/platform/gw"
    # A project that ever had a key is never removed, even once the key is revoked.
    issued = await store.issue_key("k", project=proj.id)
    await store.revoke_key(issued.key.id)
    with pytest.raises(StoreError, match="ever had a key is never removed"):
        await store.remove("project", proj.id)
    # Members hold a thing in place.
    await store.create_user("a@example.com", "password1")
    await store.join("a@example.com", "team", "Acme/platform")
    with pytest.raises(StoreError, match="a@example.com"):
        await store.remove("team", "Acme/platform")
    await store.leave("a@example.com", "team", "Acme/platform")
    await store.remove("team", "Acme/platform")


# -- people ------------------------------------------------------------------------


async def test_users_create_verify_state(store):
    u = await store.create_user("Ann@Example.com", "correct horse", name="Ann")
    assert re.fullmatch(r"usr-[0-9a-f]{10}", u.id) and u.email == "ann@example.com" and u.state == "active"
    async with store.engine.connect() as conn:
        (h,) = (await conn.execute(text("SELECT password_hash FROM users"))).one()
    assert h.startswith("$argon2") and "correct horse" not in h
    assert (await store.verify_password("ann@example.com", "correct horse")).id == u.id
    assert await store.verify_password("ann@example.com", "wrong pass") is None
    with pytest.raises(StoreError, match="has an account already"):
        await store.create_user("ann@example.com", "another one")
    with pytest.raises(StoreError, match="not an email"):
        await store.create_user("nope", "password1")
    with pytest.raises(StoreError, match="at least 8"):
        await store.create_user("b@example.com", "short")
    assert (await store.set_user_state(u.id, "suspended")).state == "suspended"
    assert await store.verify_password("ann@example.com", "correct horse") is None
    with pytest.raises(StoreError):
        await store.set_user_state(u.id, "gone")
    assert (await store.promote("ann@example.com")).admin
    assert (await store.find_user(u.id)).admin


async def test_a_sign_up_is_pending_and_signs_in_only_once_approved(store):
    _org, _team, proj = await _acme(store)
    gen = await store.keys_generation()
    u = await store.sign_up("New@Example.com", "correct horse", name="New")
    assert (u.email, u.state, u.admin) == ("new@example.com", "pending", False)
    # Strangers signing up do not make gateways reload their keys.
    assert await store.keys_generation() == gen
    async with store.engine.connect() as conn:
        (h,) = (await conn.execute(text("SELECT password_hash FROM users"))).one()
    assert h.startswith("$argon2")
    assert await store.verify_password("new@example.com", "correct horse") is None
    await store.create_user("old@example.com", "password1")
    assert [p.email for p, _ in await store.list_users(state="pending")] == ["new@example.com"]
    assert {p.email for p, _ in await store.list_users()} == {"new@example.com", "old@example.com"}
    with pytest.raises(StoreError, match='not "gone"'):
        await store.list_users(state="gone")
    with pytest.raises(StoreError, match="is pending; `llmgw users approve` first"):
        await store.issue_key("k", project=proj.id, owner=u.id)
    approved = await store.approve("new@example.com", project="gateway")
    assert approved.state == "active" and (await store.find_user(u.id)).state == "active"
    assert (await store.tree(people=True)).reaches(u.id, proj)
    assert (await store.verify_password("new@example.com", "correct horse")).id == u.id
    assert await store.list_users(state="pending") == []
    gen = await store.keys_generation()
    with pytest.raises(StoreError, match="new@example.com is active, not a sign-up waiting for approval"):
        await store.approve(u.id)
    assert await store.keys_generation() == gen
    # Approving needs no project.
    v = await store.sign_up("v@example.com", "correct horse")
    assert (await store.approve(v.id)).state == "active"
    assert not [m for m in (await store.tree(people=True)).memberships if m.user_id == v.id]


async def test_a_sign_up_for_a_taken_email_is_refused_without_saying_whether_it_is_pending(store):
    await store.create_user("ann@example.com", "correct horse")
    await store.sign_up("bob@example.com", "correct horse")
    messages = set()
    for email in ("ann@example.com", "BOB@example.com"):
        with pytest.raises(StoreError) as ei:
            await store.sign_up(email, "another one")
        messages.add(str(ei.value))
    assert messages == {SIGN_UP_TAKEN}
    assert "@" not in SIGN_UP_TAKEN and "usr-" not in SIGN_UP_TAKEN
    assert [u.state for u in (await store.tree(people=True)).users.values()] == ["active", "pending"]
    with pytest.raises(StoreError, match="needs a password"):
        await store.create_user("c@example.com", pending=True)
    with pytest.raises(StoreError, match="at least 8"):
        await store.sign_up("c@example.com", "short")
    with pytest.raises(StoreError, match="cannot be an administrator"):
        await store.create_user("c@example.com", "correct horse", admin=True, pending=True)


async def test_reject_removes_only_a_sign_up_waiting_for_approval(store):
    await _acme(store)
    u = await store.sign_up("new@example.com", "correct horse")
    await store.join(u.id, "project", "gateway")
    await store.set_limits("user", u.id, rpm=5)
    assert (await store.reject("new@example.com")).id == u.id
    with pytest.raises(NotFound):
        await store.find_user(u.id)
    assert not (await store.tree(people=True)).memberships and await store.get_limits("user", u.id) is None
    # The email may sign up again.
    assert (await store.sign_up("new@example.com", "correct horse")).state == "pending"
    a = await store.create_user("ann@example.com", "correct horse")
    await store.set_user_state(a.id, "suspended")
    gen = await store.keys_generation()
    for who in (a.id, "ann@example.com"):
        with pytest.raises(StoreError, match="only a sign-up waiting for approval is rejected; suspend or delete"):
            await store.reject(who)
    assert await store.keys_generation() == gen and (await store.find_user(a.id)).state == "suspended"


async def test_a_sign_up_is_approved_or_rejected_never_suspended_or_reinstated(store):
    u = await store.sign_up("new@example.com", "correct horse")
    a = await store.create_user("ann@example.com", "correct horse")
    for state in ("active", "suspended"):
        with pytest.raises(StoreError, match="waiting for approval; approve it"):
            await store.set_user_state(u.id, state)
    with pytest.raises(StoreError, match="pending only from signing up"):
        await store.set_user_state(a.id, "pending")
    assert (await store.find_user(u.id)).state == "pending" and (await store.find_user(a.id)).state == "active"


async def test_a_wrong_email_or_a_password_less_account_never_verifies(store):
    await store.create_user("nopw@example.com")  # made without a password: cannot sign in
    assert await store.verify_password("nobody@example.com", "correct horse") is None
    assert await store.verify_password("nopw@example.com", "") is None
    assert await store.verify_password("nopw@example.com", "correct horse") is None
    u = await store.find_user("nopw@example.com")
    assert not await store.check_password(u.id, "correct horse")
    await store.set_password(u.id, "correct horse")
    assert (await store.verify_password("nopw@example.com", "correct horse")).id == u.id


async def test_memberships_reach_and_leave_revokes(store):
    _org, team, proj = await _acme(store)
    await store.add_project("other", "Acme/platform")
    u = await store.create_user("a@example.com", "password1")
    with pytest.raises(
        NotMember, match=r"a@example.com is not a member of Acme/platform/gateway; `llmgw users join` first"
    ):
        await store.issue_key("k", project=proj.id, owner=u.id)
    with pytest.raises(StoreError, match="manager is a role in an organization"):
        await store.join(u.id, "team", team.id, role="manager")
    await store.join(u.id, "team", "Acme/platform")
    # A team member reaches every project in it.
    k1 = await store.issue_key("k1", project="gateway", owner="a@example.com")
    k2 = await store.issue_key("k2", project="other", owner=u.id)
    personal = await store.issue_key("mine", owner=u.id)
    assert personal.key.project_id is None and personal.project_path is None
    await store.join(u.id, "project", proj.id)
    # Leaving the team: the project membership still reaches gateway, not other.
    path, revoked = await store.leave(u.id, "team", team.id)
    assert path == "Acme/platform" and [k.id for k in revoked] == [k2.key.id]
    keys = {k.id: k for k in await store.list_keys()}
    assert keys[k1.key.id].revoked_at is None and keys[k2.key.id].revoked_at is not None
    assert keys[personal.key.id].revoked_at is None
    with pytest.raises(NotMember):
        await store.leave(u.id, "team", team.id)
    await store.join(u.id, "org", "Acme", role="manager")
    tree = await store.tree(people=True)
    assert {(m.scope, m.role) for m in tree.memberships} == {("project", "member"), ("org", "manager")}
    # Deleting the person revokes every key of theirs.
    _person, revoked = await store.delete_user(u.id)
    assert sorted(k.id for k in revoked) == sorted([k1.key.id, personal.key.id])
    assert all(k.revoked_at for k in await store.list_keys())
    assert not (await store.tree(people=True)).memberships


# -- keys and claims ----------------------------------------------------------------


async def test_issue_key_project_choice(store):
    with pytest.raises(StoreError, match="none yet"):
        await store.issue_key("k")
    _org, _team, proj = await _acme(store)
    issued = await store.issue_key("k", band="high")  # the only project
    assert issued.key.project_id == proj.id and issued.key.project == "Acme/platform/gateway"
    assert issued.key.band == "high"
    (active,) = await store.active_keys()
    assert active.hash == hashlib.sha256(issued.secret.encode()).hexdigest() and active.band == "high"
    await store.add_project("two", "Acme/platform")
    with pytest.raises(StoreError, match="Acme/platform/gateway, Acme/platform/two"):
        await store.issue_key("k")
    with pytest.raises(StoreError, match="band"):
        await store.issue_key("k", project=proj.id, band="urgent")


async def test_claim_works_once(store):
    _org, _team, proj = await _acme(store)
    issued = await store.issue_key("k", project=proj.id, claim=True)
    assert issued.claim_token and issued.claim_expires_at > datetime.now(UTC)
    async with store.engine.connect() as conn:
        (sealed,) = (await conn.execute(select(key_claims.c.sealed))).one()
    assert sealed and issued.secret not in sealed
    assert await store.claim_key(issued.claim_token) == issued.secret
    async with store.engine.connect() as conn:
        row = (await conn.execute(select(key_claims))).one()
    assert row.sealed == "" and row.used_at is not None
    with pytest.raises(StoreError, match="works once"):
        await store.claim_key(issued.claim_token)
    with pytest.raises(NotFound):
        await store.claim_key("nope")
    expired = await store.issue_key("k2", project=proj.id, claim=True, claim_ttl=timedelta(seconds=1))
    async with store.engine.begin() as conn:
        await conn.execute(
            key_claims.update()
            .where(key_claims.c.key_id == expired.key.id)
            .values(expires_at=datetime.now(UTC) - timedelta(seconds=1))
        )
    with pytest.raises(StoreError, match="expired"):
        await store.claim_key(expired.claim_token)


# -- limits ---------------------------------------------------------------------------


async def test_limits_set_merge_clear_and_refusals(store):
    _org, team, proj = await _acme(store)
    gen = await store.keys_generation()
    level, sid, row = await store.set_limits("team", "Acme/platform", rpm=60, budget_micros=5_000_000)
    assert (level, sid) == ("team", team.id) and (row.rpm, row.budget_micros, row.period) == (60, 5_000_000, "month")
    assert await store.keys_generation() == gen + 1
    # Only what is given is written.
    _, _, row = await store.set_limits("team", team.id, tpm=1000, period="day", models=["b", "a"])
    assert (row.rpm, row.tpm, row.period, row.models) == (60, 1000, "day", ("a", "b"))
    _, _, row = await store.set_limits("team", team.id, rpm=None)
    assert row.rpm is None and row.tpm == 1000
    level, sid, row = await store.set_limits("project", proj.id, per_member=True, rpm=5)
    assert (level, sid) == ("project-member", proj.id)
    _, _, row = await store.set_limits("project", "gateway", models=[])
    assert row.models == ()
    gen = await store.keys_generation()
    for kwargs, msg in [
        (dict(scope="bogus", ref="x", rpm=1), '--scope is org, team, project, user or key, not "bogus"'),
        (dict(scope="key", ref=None, rpm=1), "--scope key needs --id, the key's id"),
        (dict(scope="user", ref="x", per_member=True, rpm=1), "--per-member is for --scope org, team or project"),
        (dict(scope="team", ref=team.id, rpm=-1), "negative"),
        (dict(scope="team", ref=team.id, budget_micros=-5), "negative"),
        (dict(scope="team", ref=team.id, period="week"), "--period is day or month"),
        (dict(scope="team", ref=team.id, band="urgent"), "--band"),
        (dict(scope="team", ref="Acme/nope"), "Give a limit"),
        (dict(scope="team", ref="Acme/nope", rpm=1), 'No team at "Acme/nope"'),
        (dict(scope="key", ref="key-nope", rpm=1), "No key has the id"),
        (dict(scope="team", ref=team.id, rpm=1, clear=True), "without other limits"),
    ]:
        with pytest.raises(StoreError, match=re.escape(msg)):
            await store.set_limits(**kwargs)
    assert await store.keys_generation() == gen  # nothing changed
    await store.set_limits("team", team.id, clear=True)
    assert await store.get_limits("team", team.id) is None
    async with store.engine.connect() as conn:
        scopes = sorted(r.scope for r in await conn.execute(select(limits)))
    assert scopes == ["project", "project-member"]
    u = await store.create_user("a@example.com", "password1")
    assert (await store.set_limits("user", "a@example.com", budget_micros=10**15))[1] == u.id


# -- principals ---------------------------------------------------------------------


async def _principal(store, key_id, **defaults):
    tree = await store.tenancy_snapshot()
    (k,) = [k for k in await store.active_keys() if k.id == key_id]
    return build_principal(k, tree, defaults.get("rpm"), defaults.get("tpm"))


async def test_principal_pools_band_models(store):
    org, team, proj = await _acme(store)
    u = await store.create_user("a@example.com", "password1")
    await store.join(u.id, "org", org.id)
    issued = await store.issue_key("k", project=proj.id, owner=u.id)
    kid = issued.key.id
    p = await _principal(store, kid, rpm=100, tpm=10000)
    assert (p.project, p.project_id, p.team_id, p.org_id, p.user_id, p.band) == (
        "Acme/platform/gateway",
        proj.id,
        team.id,
        org.id,
        u.id,
        "normal",
    )
    assert p.pools == (Pool(f"default:{kid}", 100, 10000),) and p.models is None
    await store.set_limits("org", org.id, band="low", tpm=5000, models=["a", "b", "c"])
    await store.set_limits("team", team.id, band="high")
    await store.set_limits("project", proj.id, per_member=True, rpm=10)
    await store.set_limits("org", org.id, per_member=True, budget_micros=7, period="day")
    await store.set_limits("key", kid, rpm=3, models=["b", "c", "d"])
    await store.set_limits("user", u.id, budget_micros=9)
    await store.set_limits("project", proj.id, models=["c", "b"])
    p = await _principal(store, kid, rpm=100, tpm=10000)
    assert p.band == "high"  # the team's: the nearest level with a band
    assert [q.key for q in p.pools] == [
        f"key:{kid}",
        f"project-member:{proj.id}:{u.id}",
        f"org-member:{org.id}:{u.id}",
        f"org:{org.id}",
        f"user:{u.id}",
    ]
    assert p.pools[2] == Pool(f"org-member:{org.id}:{u.id}", None, None, 7, "day")
    assert p.models == frozenset({"b", "c"})
    # The defaults only for a kind no level limits: tpm is set by the org, rpm by the key.
    await store.set_limits("key", kid, clear=True)
    await store.set_limits("project", proj.id, per_member=True, clear=True)
    p = await _principal(store, kid, rpm=100, tpm=10000)
    assert p.pools[0] == Pool(f"default:{kid}", 100, None)
    await store.set_limits("key", kid, band="low")
    assert (await _principal(store, kid)).band == "low"  # the key's own band wins
    # An empty allow-list anywhere allows none.
    await store.set_limits("team", team.id, models=[])
    assert (await _principal(store, kid)).models == frozenset()


async def test_principal_personal_and_unowned_keys(store):
    org, _team, proj = await _acme(store)
    u = await store.create_user("a@example.com", "password1")
    await store.set_limits("org", org.id, per_member=True, rpm=1)
    await store.set_limits("org", org.id, band="high")
    await store.set_limits("user", u.id, tpm=50)
    personal = await store.issue_key("mine", owner=u.id)
    p = await _principal(store, personal.key.id, rpm=100, tpm=1000)
    assert (p.project, p.project_id, p.org_id, p.user_id, p.band) == (None, None, None, u.id, "normal")
    assert [q.key for q in p.pools] == [f"default:{personal.key.id}", f"user:{u.id}"]
    assert p.pools[0].rpm == 100 and p.pools[0].tpm is None
    op = await store.issue_key("ops", project=proj.id)  # no owner: no member or user pools
    await store.set_limits("org", org.id, rpm=30)
    p = await _principal(store, op.key.id)
    assert [q.key for q in p.pools] == [f"org:{org.id}"] and p.user_id is None
    # Keys made before the tree keep their project label.
    _, legacy = await store.create_key("old", project="web")
    p = await _principal(store, legacy.id, rpm=5)
    assert p.project == "web" and p.project_id is None and p.pools == (Pool(f"default:{legacy.id}", 5),)


async def test_key_cache_reloads_on_tree_and_limit_changes(store):
    _org, team, proj = await _acme(store)
    u = await store.create_user("a@example.com", "password1")
    await store.join(u.id, "project", proj.id)
    issued = await store.issue_key("k", project=proj.id, owner=u.id)
    cache = KeyCache(store, poll_interval=0.02, default_rpm=60, default_tpm=None)
    await cache.load()
    header = f"Bearer {issued.secret}"
    assert cache.authenticate(header).pools == (Pool(f"default:{issued.key.id}", 60),)
    cache.start()

    def refusal() -> AuthError | None:
        try:
            cache.authenticate(header)
        except AuthError as exc:
            return exc
        return None

    try:
        await store.set_limits("team", team.id, rpm=5)
        await async_until(
            lambda: [q.key for q in cache.authenticate(header).pools] == [f"team:{team.id}"],
            what="the team's limit loaded",
        )
        assert [q.key for q in cache.authenticate(header).pools] == [f"team:{team.id}"]
        await store.rename("project", proj.id, "gw")
        await async_until(lambda: cache.authenticate(header).project == "Acme/platform/gw", what="the new name loaded")
        assert cache.authenticate(header).project == "Acme/platform/gw"
        await store.set_user_state(u.id, "suspended")
        await async_until(lambda: "suspended" in str(refusal() or ""), what="the suspension loaded")
        with pytest.raises(AuthError, match="suspended"):
            cache.authenticate(header)
        await store.set_user_state(u.id, "active")
        await store.leave(u.id, "project", proj.id)
        await async_until(lambda: getattr(refusal(), "code", None) == "revoked_api_key", what="the departure loaded")
        with pytest.raises(AuthError) as ei:
            cache.authenticate(header)
        assert ei.value.code == "revoked_api_key"
    finally:
        await cache.stop()


# -- usage ----------------------------------------------------------------------------


async def test_usage_cost_since(store):
    now = datetime.now(UTC)

    def row(key, cost, at=now, user="usr-1", proj="proj-1"):
        return UsageRow(
            model="m",
            endpoint="/v1/chat/completions",
            status=200,
            latency_ms=1.0,
            key_id=key,
            user_id=user,
            project_id=proj,
            team_id="team-1",
            org_id="org-1",
            cost_micros=cost,
            at=at,
        )

    await store.insert_usage(
        [row("k1", 10), row("k1", 5), row("k2", 3, proj=None), row("k1", 100, at=now - timedelta(days=2)), row("k3", 0)]
    )
    got = sorted(
        (r.key_id, r.user_id, r.project_id, r.team_id, r.org_id, r.cost_micros)
        for r in await store.usage_cost_since(now - timedelta(hours=1))
    )
    assert got == [("k1", "usr-1", "proj-1", "team-1", "org-1", 15), ("k2", "usr-1", None, "team-1", "org-1", 3)]
    before = await store.usage_cost_since(now - timedelta(days=3), until=now - timedelta(hours=1))
    assert [(r.key_id, r.cost_micros) for r in before] == [("k1", 100)]
    big = 3 * 10**12  # BIGINT: more than 32 bits
    await store.insert_usage([row("k4", big), row("k4", big)])
    assert {r.key_id: r.cost_micros for r in await store.usage_cost_since(now - timedelta(hours=1))}["k4"] == 2 * big
    (back,) = await store.list_usage(limit=1, key_id="k1")
    assert back.cost_micros in (10, 5) and back.org_id == "org-1"


async def test_upgrade_from_0003_keeps_keys_and_usage(address):
    from alembic import command

    from llmgw.store.address import resolve_store_address
    from llmgw.store.migrate import _alembic_config
    from llmgw.store.schema import api_keys, usage
    from llmgw.store.store import _create_engine

    engine = _create_engine(resolve_store_address(address))
    at = datetime(2026, 1, 2, tzinfo=UTC)
    try:
        async with engine.begin() as conn:
            await conn.run_sync(lambda c: command.upgrade(_alembic_config(c), "0003"))
            await conn.execute(
                api_keys.insert().values(
                    id="key-old", name="old", prefix="llmgw-abcdefgh", hash="0" * 64, project="web", created_at=at
                )
            )
            await conn.execute(
                usage.insert().values(
                    at=at,
                    key_id="key-old",
                    project="web",
                    model="m",
                    endpoint="/e",
                    prompt_tokens=1,
                    completion_tokens=2,
                    latency_ms=1.0,
                    status=200,
                    stream=False,
                )
            )
    finally:
        await engine.dispose()
    async with await Store.open(address) as s:
        (k,) = await s.list_keys()
        assert (k.id, k.project, k.project_id, k.user_id, k.band) == ("key-old", "web", None, None, None)
        (u,) = await s.list_usage()
        assert (u.project, u.cost_micros, u.org_id) == ("web", 0, None)
        assert await s.usage_cost_since(at - timedelta(days=1)) == []
