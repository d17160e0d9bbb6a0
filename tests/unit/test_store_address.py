"""Store address resolution: paths, PostgreSQL URLs, @file, and the errors for bad ones."""

from __future__ import annotations

import os

import pytest
from sqlalchemy.engine import make_url

from llmgw.store import StoreError, mask_password, resolve_store_address


def test_relative_path_is_sqlite_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    url = make_url(resolve_store_address("data/sub/llmgw.db"))
    assert url.drivername == "sqlite+aiosqlite"
    assert url.database == str(tmp_path / "data" / "sub" / "llmgw.db")
    assert (tmp_path / "data" / "sub").is_dir()  # parent made


def test_home_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    url = make_url(resolve_store_address("~/.local/share/llmgw/llmgw.db"))
    assert url.database == str(tmp_path / ".local/share/llmgw/llmgw.db")


def test_odd_characters_in_path_survive(tmp_path):
    path = tmp_path / "a?b#c %d.db"
    assert make_url(resolve_store_address(str(path))).database == str(path)


def test_resolving_is_idempotent(tmp_path):
    for addr in (str(tmp_path / "x.db"), "postgres://u:p@h/db?sslmode=require"):
        once = resolve_store_address(addr)
        assert resolve_store_address(once) == once


@pytest.mark.parametrize("scheme", ["postgres", "postgresql", "POSTGRESQL"])
def test_postgres_url_gets_asyncpg_driver(scheme):
    url = make_url(resolve_store_address(f"{scheme}://alice:p%40ss@db.example:6543/llmgw"))
    assert url.drivername == "postgresql+asyncpg"
    assert (url.username, url.password, url.host, url.port, url.database) == (
        "alice",
        "p@ss",
        "db.example",
        6543,
        "llmgw",
    )


@pytest.mark.parametrize("mode", ["disable", "require", "verify-full"])
def test_sslmode_becomes_ssl(mode):
    url = make_url(resolve_store_address(f"postgres://u@h/db?sslmode={mode}&connect_timeout=5"))
    assert dict(url.query) == {"ssl": mode, "timeout": "5"}


def test_at_file_reads_address(tmp_path):
    target = tmp_path / "store.db"
    f = tmp_path / "addr"
    f.write_text(f"  {target}\n\n")
    assert resolve_store_address(f"@{f}") == resolve_store_address(str(target))
    f.write_text("postgresql://u:secret@h/db\n")
    assert make_url(resolve_store_address(f"@{f}")).password == "secret"


@pytest.mark.parametrize(
    "content, needle", [(None, "does not exist"), ("", "is empty"), ("  \n", "is empty"), ("@/x", "another @")]
)
def test_an_at_file_address_that_is_missing_empty_or_nested_is_refused(tmp_path, content, needle):
    f = tmp_path / "addr"
    if content is not None:
        f.write_text(content)
    with pytest.raises(StoreError, match=needle):
        resolve_store_address(f"@{f}")


@pytest.mark.parametrize(
    "addr, needle",
    [
        ("", "is empty"),
        ("   ", "is empty"),
        ("@", "names no file"),
        (":memory:", "not a file path"),
        ("mysql://u:p@h/db", "unsupported scheme 'mysql://'"),
        ("postgres://u@h", "names no database"),
        ("postgres://u@h:port/db", "could not be parsed"),
        ("postgres://u@h/db?sslmode=sometimes", "sslmode=sometimes"),
        ("postgres://u@h/db?application_name=x", "'application_name'"),
        ("postgres://u@h/db?sslmode=require&ssl=disable", "twice"),
        ("postgres://u@h/db?ssl=a&ssl=b", "more than once"),
        ("postgres://u@h/db?connect_timeout=soon", "connect_timeout=soon; give a number"),
        ("postgres://u@h/db?command_timeout=0", "greater than zero"),
        ("postgres://u@h/db?connect_timeout=1&timeout=2", "twice"),
        ("postgres://u@h/db?prepared_statement_cache_size=-1", "whole number"),
    ],
)
def test_bad_store_addresses_are_refused_with_the_reason(addr, needle):
    with pytest.raises(StoreError, match=needle):
        resolve_store_address(addr)


def test_directory_is_refused(tmp_path):
    with pytest.raises(StoreError, match="is a directory"):
        resolve_store_address(str(tmp_path))
    with pytest.raises(StoreError, match="is a directory"):
        resolve_store_address(str(tmp_path / "new") + os.sep)


def test_a_store_whose_directory_cannot_be_created_is_refused(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(StoreError, match="Could not create the directory"):
        resolve_store_address(str(blocker / "sub" / "llmgw.db"))


def test_password_masked_in_errors(tmp_path):
    for addr in (
        "postgres://bob:s3cr3t@h/db?sslmode=bogus",
        "postgresql://bob:s3cr3t@h",
        "mysql://bob:s3cr3t@h/db",
        "postgres://bob:s3cr3t@h:nope/db",
    ):
        with pytest.raises(StoreError) as e:
            resolve_store_address(addr)
        assert "s3cr3t" not in str(e.value) and "bob:***@" in str(e.value), str(e.value)
    f = tmp_path / "addr"
    f.write_text("postgres://bob:s3cr3t@h/db?sslmode=bogus")
    with pytest.raises(StoreError) as e:
        resolve_store_address(f"@{f}")
    assert "s3cr3t" not in str(e.value) and str(f) in str(e.value)


def test_passwords_in_store_addresses_are_masked_and_nothing_else():
    assert mask_password("x postgresql://u:p@ss@h:1/db?a=b y") == "x postgresql://u:***@h:1/db?a=b y"
    assert mask_password("postgresql://u@h/db") == "postgresql://u@h/db"
    assert mask_password("/var/lib/a:b@c") == "/var/lib/a:b@c"
