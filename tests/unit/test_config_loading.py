"""Reading server.yaml and agent.yaml: files that YAML would take but an operator did not mean."""

from __future__ import annotations

import logging

import pytest

from llmgw.config import ConfigError, load_server_config
from llmgw.config.agent import load_agent_config
from llmgw.store.address import resolve_store_address

LOADERS = {"server.yaml": load_server_config, "agent.yaml": load_agent_config}


def _refusal(tmp_path, name: str, content: bytes) -> str:
    p = tmp_path / name
    p.write_bytes(content)
    with pytest.raises(ConfigError) as ei:
        LOADERS[name](p)
    return str(ei.value)


@pytest.mark.parametrize("name", list(LOADERS))
def test_a_key_given_twice_is_refused_naming_both_lines(tmp_path, name):
    msg = _refusal(tmp_path, name, b"# top\nlisten: ':8080'\nmetrics_listen: null\n\n\nlisten: ':9000'\n")
    assert msg.endswith('"listen" appears twice, at lines 2 and 6; keep one')


def test_a_key_given_twice_deep_inside_is_refused_with_where_it_sits(tmp_path):
    msg = _refusal(tmp_path, "server.yaml", b"auth:\n  store: a.db\n  enabled: true\n  store: b.db\n")
    assert '"store" appears twice in auth, at lines 2 and 4' in msg
    msg = _refusal(
        tmp_path,
        "server.yaml",
        b"models:\n  - name: a\n    endpoints:\n      - {url: 'http://x:1', url: 'http://y:1'}\n",
    )
    assert '"url" appears twice in models[0].endpoints[0], at line 4, columns 10 and 29' in msg


def test_a_merge_may_override_what_it_brings_in(tmp_path):
    p = tmp_path / "server.yaml"
    p.write_text("timeouts:\n  <<: {connect: 1s, drain: 5s}\n  drain: 7s\n")
    assert load_server_config(p).timeouts.drain == 7.0


@pytest.mark.parametrize("name", list(LOADERS))
def test_a_file_that_is_not_utf8_says_which_byte_and_where(tmp_path, name):
    msg = _refusal(tmp_path, name, b"listen: ':8080'\n# caf\xe9\n")
    assert "is not UTF-8 text: byte 0xe9 at line 2, column 6 (byte offset 21); save the file as UTF-8" in msg


def test_a_utf16_file_is_named_as_such(tmp_path):
    assert "is UTF-16 text; save it as UTF-8" in _refusal(tmp_path, "server.yaml", "listen: ':1'\n".encode("utf-16"))


def test_a_byte_order_mark_is_not_an_error(tmp_path):
    p = tmp_path / "server.yaml"
    p.write_bytes(b"\xef\xbb\xbfmetrics_listen: null\n")
    assert load_server_config(p).metrics_listen is None


def test_a_character_yaml_forbids_is_refused_with_its_place(tmp_path):
    msg = _refusal(tmp_path, "server.yaml", b"listen: ':8080'\nauth: {store: \"a\x01\"}\n")
    assert "holds the character U+0001 at line 2, column 17, which YAML does not allow" in msg


@pytest.mark.parametrize("content", [b"", b"\n\n", b"# nothing yet\n# at all\n", b"---\n", b"null\n"])
def test_an_empty_server_yaml_is_refused_rather_than_starting_public_listeners_with_defaults(tmp_path, content):
    msg = _refusal(tmp_path, "server.yaml", content)
    assert "it holds nothing (or only comments); write `{}` in it to take every default" in msg


def test_an_empty_agent_yaml_is_refused_saying_what_it_needs(tmp_path):
    assert "write at least `server: HOST:7443` in it" in _refusal(tmp_path, "agent.yaml", b"# todo\n")


def test_braces_take_every_default(tmp_path):
    p = tmp_path / "server.yaml"
    p.write_text("{}\n")
    assert load_server_config(p).listen.port == 8080


def test_a_store_directory_that_does_not_exist_is_created_and_said_so(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="llmgw.store")
    path = tmp_path / "new" / "deeper" / "llmgw.db"
    resolve_store_address(str(path))
    assert path.parent.is_dir()
    (rec,) = caplog.records
    assert rec.levelno == logging.WARNING
    assert f"created {path.parent} for the SQLite store {path}: it did not exist" in rec.getMessage()
    caplog.clear()
    resolve_store_address(str(path))  # there now: nothing to say
    assert not caplog.records
