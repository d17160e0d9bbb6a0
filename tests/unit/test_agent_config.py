import pytest

from llmgw.config import ConfigError
from llmgw.config.agent import load_agent_config, parse_agent_config


def test_a_plain_node_needs_only_the_address():
    c = parse_agent_config({"server": "cp.example:7443"})
    assert c.addresses() == ["https://cp.example:7443"]
    assert c.node_id is None and c.mgmt_addr is None and c.mgmt_interface is None  # found, not guessed
    assert c.tls.ca == "/etc/llmgw/ca.pem"
    assert c.heartbeat_interval == 5.0 and c.engines.vllm.launch_mode == "mp"


def test_server_first_then_servers_without_duplicates():
    c = parse_agent_config({"server": "b:7443", "servers": ["a:7443", "b:7443", "https://a:7443/"]})
    assert c.addresses() == ["https://b:7443", "https://a:7443"]


def test_plaintext_only_when_tls_is_null():
    assert parse_agent_config({"server": "cp:7443", "tls": None}).addresses() == ["http://cp:7443"]


@pytest.mark.parametrize(
    "data,words",
    [
        ({}, "no control plane address"),
        ({"server": "http://cp:7443"}, "every address must match the TLS setting"),
        ({"server": "https://cp:7443", "tls": None}, "TLS is off"),
        (
            {"server": "cp:1", "fabrics": [{"name": "a", "hcas": ["mlx5_0"]}, {"name": "b", "hcas": ["mlx5_0"]}]},
            "fabrics[1].hcas: mlx5_0 is already on fabric a",
        ),
        ({"server": "cp:1", "fabrics": [{"name": "a", "hcas": []}]}, "fabrics[0].hcas: lists no adapters"),
        ({"server": "cp:1", "engines": {"vllm": {"launch_mode": "slurm"}}}, "engines.vllm.launch_mode:"),
        ({"server": "cp:1", "node": "x"}, "node: unknown key"),
    ],
)
def test_refusals_name_the_key(data, words):
    with pytest.raises(ConfigError) as ei:
        parse_agent_config(data)
    assert words in str(ei.value)


def test_load_from_file(tmp_path):
    p = tmp_path / "agent.yaml"
    p.write_text("server: cp:7443\nlabels: {rack: r1}\n")
    assert load_agent_config(p).labels == {"rack": "r1"}
    with pytest.raises(ConfigError, match="no such file"):
        load_agent_config(tmp_path / "missing.yaml")
