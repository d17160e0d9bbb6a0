"""`llmgw keys threads` and `llmgw keys memory`, through typer's runner."""

from __future__ import annotations

import asyncio

import pytest
from typer.testing import CliRunner

from llmgw.cli.main import app
from llmgw.store import Store

runner = CliRunner()


@pytest.fixture
def db(tmp_path):
    """A store with one project, Acme/platform/gateway."""
    path = str(tmp_path / "t.db")

    async def make():
        async with await Store.open(path) as s:
            await s.add_org("Acme")
            await s.add_team("platform", "Acme")
            await s.add_project("gateway", "Acme/platform")

    asyncio.run(make())
    return path


def run(db, *args):
    return runner.invoke(app, [*args, "--store", db])


def ok(db, *args):
    r = run(db, *args)
    assert r.exit_code == 0, r.output
    return r


async def _state(db):
    async with await Store.open(db) as s:
        return await s.keys_generation(), await s.retention_settings()


def refused(db, *args, match: str):
    before = asyncio.run(_state(db))
    r = run(db, *args)
    assert r.exit_code == 1, r.output
    assert match in r.stderr, r.stderr
    assert asyncio.run(_state(db)) == before  # nothing changed
    return r


def test_keys_threads_and_memory_have_help_that_says_retention_is_required():
    for kind in ("threads", "memory"):
        r = runner.invoke(app, ["keys", kind, "--help"])
        assert r.exit_code == 0 and "--retain-hours" in r.output and "required" in r.output, r.output


def test_keys_threads_turns_conversations_on_for_a_project_for_its_hours_and_off_again(db):
    r = ok(db, "keys", "threads", "--project", "Acme/platform/gateway", "--retain-hours", "72")
    assert r.stdout == "conversations kept for Acme/platform/gateway: 72 hours after the last turn\n"
    (setting,) = asyncio.run(_state(db))[1]
    assert (setting.project_path, setting.threads_hours, setting.memory_hours) == ("Acme/platform/gateway", 72, None)

    r = ok(db, "keys", "threads", "--project", "gateway", "--off")
    assert r.stdout.startswith("conversations off for Acme/platform/gateway: none are kept from now on")
    assert "removed at the next hourly sweep" in r.stdout
    assert asyncio.run(_state(db))[1] == []


def test_keys_memory_keeps_notes_for_hours_after_they_were_last_written(db):
    r = ok(db, "keys", "memory", "--project", "gateway", "--retain-hours", "1")
    assert r.stdout == "notes kept for Acme/platform/gateway: 1 hour after they were last written\n"
    assert asyncio.run(_state(db))[1][0].memory_hours == 1
    assert ok(db, "keys", "memory", "--project", "gateway", "--off").stdout.startswith("notes off for")


def test_keys_threads_without_a_project_lists_every_projects_settings(db):
    r = ok(db, "keys", "threads")
    assert "no project keeps conversations or notes" in r.stderr
    assert "llmgw keys threads --project PATH --retain-hours N" in r.stderr
    ok(db, "keys", "threads", "--project", "gateway", "--retain-hours", "72")
    ok(db, "keys", "memory", "--project", "gateway", "--retain-hours", "24")
    for args in (("keys", "threads", "--list"), ("keys", "memory")):
        lines = ok(db, *args).stdout.splitlines()
        assert lines[0].split() == ["PROJECT", "CONVERSATIONS", "NOTES"]
        assert lines[1].split() == ["Acme/platform/gateway", "72", "h", "24", "h"]


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (
            ("keys", "threads", "--project", "gateway"),
            "conversations are kept only for a set time, so the hours are needed: give --retain-hours N, "
            "how many hours a conversation is kept after its last turn (or --off to stop keeping them)",
        ),
        (
            ("keys", "memory", "--project", "gateway"),
            "how many hours a note is kept after it was last written",
        ),
        (
            ("keys", "threads", "--project", "gateway", "--retain-hours", "5", "--off"),
            "give --retain-hours N to keep conversations, or --off to stop keeping them; not both",
        ),
        (
            ("keys", "threads", "--retain-hours", "5"),
            "say which project keeps its conversations: --project PATH",
        ),
        (
            ("keys", "memory", "--project", "gateway", "--retain-hours", "0"),
            "--retain-hours is a whole number of hours, at least 1, not 0; --off stops keeping notes",
        ),
        (
            ("keys", "threads", "--project", "gateway", "--retain-hours", "100000"),
            "whole number of hours from 1 to 87,600, not 100000",
        ),
        (
            ("keys", "threads", "--project", "Acme/platform/nowhere", "--retain-hours", "5"),
            'No project at "Acme/platform/nowhere"; `llmgw org tree` shows what exists.',
        ),
    ],
)
def test_keys_threads_and_memory_refuse_in_words_and_change_nothing(db, args, match):
    refused(db, *args, match=match)
