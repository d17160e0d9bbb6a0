"""A fabric agent.yaml declares is advertised only while its adapters are there with an ACTIVE
port; what keeps one out is said, logged once, shown in ctl nodes' warnings, and a change is
sent once with the next heartbeat."""

from __future__ import annotations

import logging

from llmgw.agent.fabrics import check_fabrics
from llmgw.agent.identity import Identity
from llmgw.agent.service import Agent
from llmgw.config.agent import FabricDecl, parse_agent_config
from llmgw.protocol import IBPort


def _port(hca: str, state: str = "ACTIVE", rate: float | None = 400.0) -> IBPort:
    return IBPort(hca=hca, port=1, state=state, phys_state="LinkUp" if state == "ACTIVE" else "Polling", rate_gbps=rate)


def test_a_fabric_whose_adapters_are_all_active_is_advertised_with_its_slowest_port():
    decl = [FabricDecl(name="ib-a", hcas=["mlx5_0", "mlx5_1"])]
    check = check_fabrics(decl, [_port("mlx5_0"), _port("mlx5_1", rate=200.0)])
    assert [(f.fabric, f.hcas, f.rate_gbps) for f in check.advertised] == [("ib-a", ["mlx5_0", "mlx5_1"], 200.0)]
    assert check.problems == ()


def test_a_missing_adapter_or_one_with_no_active_port_keeps_its_fabric_out_saying_which_and_why():
    decl = [FabricDecl(name="ib-a", hcas=["mlx5_0", "mlx5_9"]), FabricDecl(name="ib-b", hcas=["mlx5_1"])]
    check = check_fabrics(decl, [_port("mlx5_0"), _port("mlx5_1", state="DOWN")])
    assert check.advertised == ()
    a, b = check.problems
    assert a.startswith("fabric ib-a is not advertised: mlx5_9 is not on this node")
    assert "fabric ib-b is not advertised: mlx5_1 has no ACTIVE port (mlx5_1: port 1 DOWN)" in b
    assert "agent.yaml" in a


def test_without_sysfs_every_declared_fabric_is_missing_its_adapters():
    check = check_fabrics([FabricDecl(name="ib-a", hcas=["mlx5_0"])], None)
    assert check.advertised == () and "mlx5_0 is not on this node" in check.problems[0]


def test_the_declared_rate_stands_in_where_the_ports_do_not_say_one():
    decl = [FabricDecl(name="roce", hcas=["mlx5_0"], rate_gbps=200)]
    assert check_fabrics(decl, [_port("mlx5_0", rate=None)]).advertised[0].rate_gbps == 200


def _agent() -> Agent:
    cfg = parse_agent_config(
        {"server": "127.0.0.1:7443", "fabrics": [{"name": "ib-a", "hcas": ["mlx5_0"], "rate_gbps": 400}]}
    )
    return Agent(cfg, Identity("gpu-1", None, None))


def test_a_change_is_sent_once_and_logged_once_then_the_fabric_comes_back(caplog):
    agent = _agent()
    with caplog.at_level(logging.WARNING, "llmgw"):
        first = agent._fabrics_now([_port("mlx5_0", state="DOWN")], force=True)
        again = agent._fabrics_now([_port("mlx5_0", state="DOWN")])
    assert first is not None and first.advertised == () and len(first.problems) == 1
    assert again is None  # nothing changed: nothing sent, nothing logged a second time
    assert sum("ib-a is not advertised" in r.getMessage() for r in caplog.records) == 1
    back = agent._fabrics_now([_port("mlx5_0")])
    assert back is not None and [f.fabric for f in back.advertised] == ["ib-a"] and back.problems == ()
    # A registration says everything again, changed or not.
    assert agent._fabrics_now([_port("mlx5_0")], force=True) == back
