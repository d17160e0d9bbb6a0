import socket

from llmgw.agent.identity import interface_of, resolve_identity, source_address
from llmgw.config.agent import parse_agent_config


def test_source_address_towards_loopback():
    assert source_address("https://127.0.0.1:7443") == "127.0.0.1"


def test_loopback_interface_is_found():
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("not an address") is None


def test_ipv6_interface_from_proc_format(tmp_path):
    f = tmp_path / "if_inet6"
    f.write_text(
        "00000000000000000000000000000001 01 80 10 80       lo\nfe800000000000000a0027fffe4d5e6f 02 40 20 80     eth0\n"
    )
    assert interface_of("fe80::a00:27ff:fe4d:5e6f", f) == "eth0"
    assert interface_of("::2", f) is None


def test_found_values_and_written_overrides():
    found = resolve_identity(parse_agent_config({"server": "127.0.0.1:7443"}))
    assert found.node_id == socket.gethostname()
    assert (found.mgmt_addr, found.mgmt_interface) == ("127.0.0.1", "lo")
    written = resolve_identity(
        parse_agent_config(
            {"server": "127.0.0.1:7443", "node_id": "gpu-7", "mgmt_addr": "10.1.2.3", "mgmt_interface": "bond0"}
        )
    )
    assert written == type(written)("gpu-7", "10.1.2.3", "bond0")
