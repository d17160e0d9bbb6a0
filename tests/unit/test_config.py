from pathlib import Path

import pytest

from llmgw.config import ConfigError, load_server_config, parse_server_config
from llmgw.config.types import parse_duration, parse_listen, parse_size

ROOT = Path(__file__).resolve().parents[2]


def test_an_empty_server_config_gets_the_documented_defaults():
    c = parse_server_config({})
    assert str(c.listen) == ":8080"
    assert str(c.admin_listen) == "127.0.0.1:9090"
    assert str(c.metrics_listen) == ":9091"
    assert c.auth.enabled is True
    assert c.auth.store == "/var/lib/llmgw/llmgw.db"
    assert c.router.max_body_bytes == 32 * 1024 * 1024
    assert c.models == []


def test_example_file_is_valid():
    c = load_server_config(ROOT / "examples" / "server.yaml")
    assert c.models, "the example should show at least one model"
    names = {n for m in c.models for n in (m.name, *m.aliases)}
    assert len(names) == sum(1 + len(m.aliases) for m in c.models)


def _err(data) -> str:
    with pytest.raises(ConfigError) as ei:
        parse_server_config(data, "server.yaml")
    return str(ei.value)


def test_error_names_full_path_of_nested_key():
    msg = _err({"models": [{"name": "a"}, {"name": "b", "endpoints": [{"url": "ftp://x", "engine": "vllm"}]}]})
    assert "models[1].endpoints[0].url:" in msg
    assert "http(s) URL" in msg


def test_unknown_key_refused_with_path():
    msg = _err({"router": {"max_body_byte": 10}})
    assert "router.max_body_byte: unknown key" in msg


def test_wrong_type_refused():
    msg = _err({"models": [{"name": "a", "max_output": "lots"}]})
    assert "models[0].max_output:" in msg
    msg = _err({"auth": {"enabled": "perhaps"}})
    assert "auth.enabled:" in msg


def test_a_heartbeat_rate_that_is_not_above_zero_is_refused_and_null_turns_pacing_off():
    assert parse_server_config({}).control.heartbeat_rate == 200.0
    assert parse_server_config({"control": {"heartbeat_rate": None}}).control.heartbeat_rate is None
    assert "heartbeat_rate (0) must be above 0, or null" in _err({"control": {"heartbeat_rate": 0}})


def test_expected_nodes_listed_twice_or_empty_are_refused():
    assert parse_server_config({"control": {"expected_nodes": ["a", "b"]}}).control.expected_nodes == ["a", "b"]
    assert "control.expected_nodes" in _err({"control": {"expected_nodes": ["a", "a"]}})
    assert "listed twice" in _err({"control": {"expected_nodes": ["a", "a"]}})
    assert "is empty" in _err({"control": {"expected_nodes": [" "]}})


def test_unknown_engine_refused():
    msg = _err({"models": [{"name": "a", "endpoints": [{"url": "http://x:1", "engine": "ollama"}]}]})
    assert "models[0].endpoints[0].engine:" in msg and "llamacpp" in msg


def test_duplicate_names_and_aliases_refused():
    ep = [{"url": "http://x:1", "engine": "vllm"}]
    msg = _err({"models": [{"name": "a", "endpoints": ep}, {"name": "b", "aliases": ["a"], "endpoints": ep}]})
    assert 'models[1].aliases[0]: "a" is already used by models[0].name' in msg


def test_listener_clash_refused():
    msg = _err({"listen": ":9090", "admin_listen": "127.0.0.1:9090"})
    assert "admin_listen: port 9090" in msg


def test_url_with_v1_refused():
    msg = _err({"models": [{"name": "a", "endpoints": [{"url": "http://x:1/v1", "engine": "vllm"}]}]})
    assert "leave /v1 off" in msg


def test_a_config_file_that_is_not_a_mapping_is_refused(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="should hold a mapping"):
        load_server_config(p)


def test_yaml_syntax_error_has_line(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text("listen: ':8080'\nmodels: [\n")
    with pytest.raises(ConfigError, match="not valid YAML at line"):
        load_server_config(p)


def test_loading_a_missing_config_file_says_no_such_file(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_server_config(tmp_path / "nope.yaml")


def test_metrics_listen_can_be_turned_off():
    assert parse_server_config({"metrics_listen": None}).metrics_listen is None


@pytest.mark.parametrize(
    "text,host,port",
    [(":8080", "", 8080), ("127.0.0.1:9", "127.0.0.1", 9), ("[::1]:9090", "::1", 9090), ("0.0.0.0:1", "0.0.0.0", 1)],
)
def test_listen_addresses_parse_to_host_and_port(text, host, port):
    a = parse_listen(text)
    assert (a.host, a.port) == (host, port)


@pytest.mark.parametrize("bad", ["8080", "host:", ":0", ":70000", "a:b:c"])
def test_malformed_listen_addresses_are_refused(bad):
    with pytest.raises(ValueError):
        parse_listen(bad)


@pytest.mark.parametrize(
    "text,seconds", [("30s", 30), ("10m", 600), ("250ms", 0.25), ("1h30m", 5400), (5, 5), (1.5, 1.5)]
)
def test_durations_parse_to_seconds(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("bad", ["ten", "10", "-1s", "0s", True, "5x"])
def test_malformed_or_non_positive_durations_are_refused(bad):
    with pytest.raises(ValueError):
        parse_duration(bad)


@pytest.mark.parametrize("text,n", [("32MiB", 32 << 20), (1000, 1000), ("1.5KB", 1500), ("2GiB", 2 << 30)])
def test_sizes_parse_to_bytes_in_binary_and_decimal_units(text, n):
    assert parse_size(text) == n


def test_docs_configuration_md_matches_the_config_models():
    from llmgw.config.reference import render

    assert (ROOT / "docs" / "configuration.md").read_text() == render(), (
        "docs/configuration.md is out of date: run python -m llmgw.config.reference > docs/configuration.md"
    )
