"""`llmgw org`, `llmgw users` and the tree-aware `llmgw keys`, through typer's runner."""

from __future__ import annotations

import asyncio
import re

import pytest
from typer.testing import CliRunner

from llmgw.cli.main import app
from llmgw.store import Store

runner = CliRunner()


@pytest.fixture
def db(tmp_path):
    return str(tmp_path / "t.db")


def run(db, *args, input=None):
    return runner.invoke(app, [*args, "--store", db], input=input)


def ok(db, *args, input=None):
    r = run(db, *args, input=input)
    assert r.exit_code == 0, r.output
    return r


def refused(db, *args, match: str):
    before = asyncio.run(_generation(db))
    r = run(db, *args)
    assert r.exit_code != 0, r.output
    assert match in r.output, r.output
    assert asyncio.run(_generation(db)) == before  # nothing changed
    return r


async def _generation(db):
    async with await Store.open(db) as s:
        return await s.keys_generation()


def test_every_tenancy_command_has_help():
    for args in [
        ("org",),
        ("org", "tree"),
        ("org", "add", "org"),
        ("org", "add", "team"),
        ("org", "add", "project"),
        ("org", "rename"),
        ("org", "move"),
        ("org", "remove"),
        ("users",),
        ("users", "create"),
        ("users", "list"),
        ("users", "join"),
        ("users", "leave"),
        ("users", "suspend"),
        ("users", "reinstate"),
        ("users", "delete"),
        ("users", "promote"),
        ("users", "approve"),
        ("users", "reject"),
        ("keys", "limits"),
    ]:
        r = runner.invoke(app, [*args, "--help"])
        assert r.exit_code == 0 and len(r.output.strip()) > 40, args


def test_org_tree_commands(db):
    assert re.search(r"added organization Acme \(org-[0-9a-f]{10}\)", ok(db, "org", "add", "org", "Acme").stdout)
    ok(db, "org", "add", "team", "platform", "--in", "Acme")
    assert (
        "added project Acme/platform/gateway (proj-"
        in ok(db, "org", "add", "project", "gateway", "--in", "Acme/platform").stdout
    )
    ok(db, "org", "add", "org", "Beta")
    ok(db, "org", "add", "team", "platform", "--in", "Beta")
    refused(db, "org", "add", "project", "x", "--in", "platform", match="Acme/platform, Beta/platform; give the path")
    refused(db, "org", "add", "project", "x", "--in", "Acme/nothing", match='No team at "Acme/nothing"')
    refused(db, "org", "add", "team", "platform", "--in", "Acme", match="already")
    out = ok(db, "org", "tree").stdout
    assert "Acme" in out and "gateway" in out and "proj-" in out
    assert (
        "moved to Beta/platform/gateway" in ok(db, "org", "move", "project", "gateway", "--to", "Beta/platform").stdout
    )
    assert "renamed to Beta/platform/gw" in ok(db, "org", "rename", "project", "gateway", "gw").stdout
    refused(db, "org", "remove", "team", "Beta/platform", match="not empty")
    refused(db, "org", "rename", "galaxy", "x", "y", match="KIND is org, team or project")
    ok(db, "org", "remove", "project", "Beta/platform/gw")
    ok(db, "org", "remove", "team", "Acme/platform")
    ok(db, "org", "remove", "org", "Acme")
    assert "Acme" not in ok(db, "org", "tree").stdout


def test_users_and_keys_in_the_tree(db):
    ok(db, "org", "add", "org", "Acme")
    ok(db, "org", "add", "team", "platform", "--in", "Acme")
    ok(db, "org", "add", "project", "gateway", "--in", "Acme/platform")
    uid = ok(db, "users", "create", "ann@example.com", "--password", "correct horse", "--name", "Ann").stdout.strip()
    assert re.fullmatch(r"usr-[0-9a-f]{10}", uid)
    assert (
        ok(db, "users", "create", "bob@example.com", input="secret123\nsecret123\n")
        .stdout.splitlines()[-1]
        .startswith("usr-")
    )
    refused(
        db,
        "keys",
        "create",
        "laptop",
        "--project",
        "gateway",
        "--for",
        "ann@example.com",
        match="ann@example.com is not a member of Acme/platform/gateway; `llmgw users join` first",
    )
    refused(
        db, "users", "join", "ann@example.com", "--team", "platform", "--role", "manager", match="manager is a role"
    )
    refused(db, "users", "join", "ann@example.com", match="exactly one of")
    assert (
        "ann@example.com is a member of Acme/platform"
        in ok(db, "users", "join", "ann@example.com", "--team", "platform").stdout
    )
    r = ok(db, "keys", "create", "laptop", "--for", "ann@example.com", "--project", "gateway")
    secret = r.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"llmgw-[A-Za-z0-9_-]{40}", secret) and r.stdout.strip() == secret
    assert "project Acme/platform/gateway" in r.stderr
    r = ok(db, "keys", "create", "--name", "mine", "--for", uid, "--project", "")
    assert "project personal, ann@example.com" in r.stderr
    # --project may be left out of an operator's key: there is exactly one.
    r = ok(db, "keys", "create", "claimed", "--claim", "--base-url", "https://llm.example.com/")
    link = r.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"https://llm\.example\.com/claim/[A-Za-z0-9_-]+", link)
    assert "Send the link. It works once, and the key is shown only to whoever opens it." in r.stderr
    token = link.rsplit("/", 1)[1]

    async def claim():
        async with await Store.open(db) as s:
            return await s.claim_key(token)

    assert asyncio.run(claim()).startswith("llmgw-")
    out = ok(db, "keys", "list").stdout
    header = out.splitlines()[0].split()
    assert header == ["ID", "NAME", "KEY", "PROJECT", "OWNER", "STATE", "LAST", "USED"]
    assert "ann@example.com" in out and "Acme/platform/gateway" in out and secret not in out
    assert "no keys in Acme/platform/gateway" not in run(db, "keys", "list", "--project", "gateway").output
    out = ok(db, "users", "list").stdout
    assert "ann@example.com" in out and "Acme/platform" in out and "on their own" in out  # bob
    import json

    orgs = json.loads(ok(db, "org", "tree", "--json", "--people").stdout)
    (acme,) = [o for o in orgs if o["name"] == "Acme"]
    assert any(p["path"] == "Acme/platform/gateway" for t in acme["teams"] for p in t["projects"])
    keys = json.loads(ok(db, "keys", "list", "--json").stdout)
    assert {k["project"] for k in keys} >= {"Acme/platform/gateway"} and all(secret not in str(k) for k in keys)
    people = {p["email"]: p for p in json.loads(ok(db, "users", "list", "--json").stdout)}
    assert people["ann@example.com"]["member_of"] and people["bob@example.com"]["member_of"] == []
    # Leaving revokes the keys made in projects no longer reached.
    r = ok(db, "users", "leave", "ann@example.com", "--team", "Acme/platform")
    assert "revoked key" in r.stderr and "laptop" in r.stderr
    assert "laptop" not in ok(db, "keys", "list").stdout
    ok(db, "users", "suspend", "bob@example.com")
    assert "suspended" in ok(db, "users", "list").stdout
    ok(db, "users", "reinstate", "bob@example.com")
    assert "is an administrator" in ok(db, "users", "promote", "bob@example.com").stdout
    refused(db, "users", "delete", "ann@example.com", match="--yes")
    assert "key(s) revoked" in ok(db, "users", "delete", "ann@example.com", "--yes").stdout
    refused(db, "users", "join", "ann@example.com", "--org", "Acme", match="No person")


def _sign_up(db, email):
    async def go():
        async with await Store.open(db) as s:
            return (await s.sign_up(email, "correct horse")).id

    return asyncio.run(go())


def test_users_approve_and_reject_sign_ups_and_list_pending_shows_only_them(db):
    ok(db, "org", "add", "org", "Acme")
    ok(db, "org", "add", "team", "platform", "--in", "Acme")
    ok(db, "org", "add", "project", "gateway", "--in", "Acme/platform")
    ok(db, "users", "create", "ann@example.com", "--password", "correct horse")
    assert "no sign-ups are waiting for approval" in ok(db, "users", "list", "--pending").stderr
    new = _sign_up(db, "new@example.com")
    _sign_up(db, "spam@example.com")
    out = ok(db, "users", "list").stdout
    header, *rows = out.splitlines()
    assert header.split()[:4] == ["ID", "EMAIL", "STATE", "ADMIN"]
    states = {r.split()[1]: r.split()[2] for r in rows}
    assert states == {"ann@example.com": "active", "new@example.com": "pending", "spam@example.com": "pending"}
    pending = ok(db, "users", "list", "--pending").stdout
    assert "new@example.com" in pending and "spam@example.com" in pending and "ann@example.com" not in pending
    import json

    listed = json.loads(ok(db, "users", "list", "--pending", "--json").stdout)
    assert [(p["email"], p["state"]) for p in listed] == [
        ("new@example.com", "pending"),
        ("spam@example.com", "pending"),
    ]
    refused(db, "users", "approve", "ann@example.com", match="ann@example.com is active, not a sign-up waiting")
    refused(db, "users", "approve", new, "--project", "nope", match='No project is named "nope"')
    refused(db, "users", "reject", "ann@example.com", match="only a sign-up waiting for approval is rejected")
    refused(db, "users", "suspend", new, match="waiting for approval; approve it")
    refused(db, "users", "approve", "nobody@example.com", match="No person")
    assert (
        ok(db, "users", "approve", new, "--project", "gateway").stdout
        == "new@example.com is approved and a member of Acme/platform/gateway\n"
    )
    assert "Acme/platform/gateway" in ok(db, "users", "list").stdout
    r = ok(db, "users", "reject", "spam@example.com")
    assert re.fullmatch(r"rejected the sign-up of spam@example\.com \(usr-[0-9a-f]{10}\)\n", r.stdout)
    assert "no sign-ups are waiting for approval" in ok(db, "users", "list", "--pending").stderr
    assert "spam@example.com" not in ok(db, "users", "list").stdout
    assert ok(db, "users", "approve", _sign_up(db, "plain@example.com")).stdout == "plain@example.com is approved\n"


def test_personal_key_and_project_choice(db):
    ok(db, "org", "add", "org", "Acme")
    ok(db, "org", "add", "team", "t", "--in", "Acme")
    ok(db, "org", "add", "project", "a", "--in", "Acme/t")
    ok(db, "org", "add", "project", "b", "--in", "Acme/t")
    refused(db, "keys", "create", "k", match="Acme/t/a, Acme/t/b")
    ok(db, "users", "create", "c@example.com", "--password", "password1")
    r = ok(db, "keys", "create", "mine", "--for", "c@example.com")
    assert "project personal, c@example.com" in r.stderr
    assert "personal" in ok(db, "keys", "list").stdout
    refused(db, "keys", "create", "k", "--project", "nope", match='No project is named "nope"')


def test_keys_limits_sets_limits_on_a_scope_and_refuses_bad_scopes_in_words(db):
    ok(db, "org", "add", "org", "Acme")
    ok(db, "org", "add", "team", "platform", "--in", "Acme")
    ok(db, "org", "add", "project", "gateway", "--in", "Acme/platform")
    r = ok(
        db,
        "keys",
        "limits",
        "--scope",
        "team",
        "--id",
        "Acme/platform",
        "--rpm",
        "60",
        "--budget",
        "12.5",
        "--period",
        "day",
        "--models",
        "a,b",
    )
    assert re.fullmatch(r"limits set on team team-[0-9a-f]{10}\n", r.stdout)
    assert re.match(
        r"limits set on project-member proj-",
        ok(db, "keys", "limits", "--id", "gateway", "--per-member", "--tpm", "100").stdout,
    )

    async def row():
        async with await Store.open(db) as s:
            team = await s.find("team", "Acme/platform")
            return await s.get_limits("team", team.id)

    lim = asyncio.run(row())
    assert (lim.rpm, lim.budget_micros, lim.period, lim.models) == (60, 12_500_000, "day", ("a", "b"))
    refused(db, "keys", "limits", "--scope", "key", "--rpm", "1", match="--scope key needs --id, the key's id")
    refused(
        db,
        "keys",
        "limits",
        "--scope",
        "galaxy",
        "--id",
        "x",
        "--rpm",
        "1",
        match='--scope is org, team, project, user or key, not "galaxy"',
    )
    refused(
        db,
        "keys",
        "limits",
        "--scope",
        "user",
        "--id",
        "x",
        "--per-member",
        "--rpm",
        "1",
        match="--per-member is for --scope org, team or project",
    )
    refused(db, "keys", "limits", "--scope", "team", "--id", "platform", "--rpm", "-5", match="negative")
    refused(db, "keys", "limits", "--scope", "team", "--id", "platform", "--budget", "-1", match="negative")
    refused(db, "keys", "limits", "--scope", "team", "--id", "platform", "--budget", "10USD", match="--budget")
    # A budget in micro-units (the old unit) is caught: 5000000 was meant as 5.
    refused(
        db,
        "keys",
        "limits",
        "--scope",
        "team",
        "--id",
        "platform",
        "--budget",
        "5000000",
        match="not micro-units: 5000000 would allow 5,000,000 a month. If you meant 5, write --budget 5",
    )
    refused(
        db,
        "keys",
        "limits",
        "--scope",
        "team",
        "--id",
        "platform",
        "--budget",
        "0.0000001",
        match="finer than a millionth of a unit",
    )
    assert asyncio.run(row()).budget_micros == 12_500_000  # refusals changed nothing
    ok(db, "keys", "limits", "--scope", "team", "--id", "platform", "--budget", "5000000", "--allow-large-budget")
    assert asyncio.run(row()).budget_micros == 5_000_000_000_000
    refused(db, "keys", "limits", "--scope", "team", "--id", "platform", "--period", "week", match="day or month")
    refused(db, "keys", "limits", "--scope", "team", "--id", "Acme/nope", "--rpm", "1", match='No team at "Acme/nope"')
    assert "limits cleared on team" in ok(db, "keys", "limits", "--scope", "team", "--id", "platform", "--clear").stdout
    assert asyncio.run(row()) is None
