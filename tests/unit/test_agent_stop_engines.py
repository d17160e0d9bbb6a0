"""What the agent does with its engines when it stops: leaves them running (adopted by the
next agent), or, with supervisor.stop_engines_on_exit (`llmgw up`), stops them."""

from __future__ import annotations

import asyncio
from typing import ClassVar

import pytest

from llmgw.agent import service
from llmgw.agent.identity import Identity
from llmgw.config.agent import parse_agent_config


class FakeSupervisor:
    instances: ClassVar[list[FakeSupervisor]] = []

    def __init__(self, *args, **kwargs) -> None:
        self.calls: list[str] = []
        FakeSupervisor.instances.append(self)

    async def adopt(self):
        class Report:
            adopted: ClassVar[list[str]] = []

        return Report()

    def statuses(self):
        return []

    async def stop_all(self, timeout=None):
        self.calls.append("stop_all")

    async def close(self):
        self.calls.append("close")


class FakeDiscovery:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def inventory(self):
        from llmgw.protocol.inventory import NodeInventory

        return NodeInventory()

    def close(self) -> None:
        pass


class Nothing:
    def __init__(self, *args, **kwargs) -> None:
        pass

    async def run(self, *args) -> None:
        await asyncio.Event().wait()

    async def aclose(self) -> None:
        pass


class LinkThatEnds:
    def __init__(self, cfg, session) -> None:
        pass

    async def run(self, stop: asyncio.Event) -> None:
        return None  # the agent was told to stop


@pytest.fixture
def fakes(monkeypatch):
    FakeSupervisor.instances = []
    monkeypatch.setattr(service, "Supervisor", FakeSupervisor)
    monkeypatch.setattr(service, "Discovery", FakeDiscovery)
    monkeypatch.setattr(service, "WeightsCache", Nothing)
    monkeypatch.setattr(service, "Installer", Nothing)
    monkeypatch.setattr(service, "ConvergeLoop", Nothing)
    monkeypatch.setattr(service, "ControlPlaneLink", LinkThatEnds)
    monkeypatch.setattr(service.HostFacts, "from_inventory", staticmethod(lambda *a: None))


def _run(tmp_path, **supervisor) -> list[str]:
    cfg = parse_agent_config(
        {
            "server": "127.0.0.1:7443",
            "tls": None,
            "weights_cache": str(tmp_path / "w"),
            "engines_dir": str(tmp_path / "e"),
            "supervisor": {"work_dir": str(tmp_path / "s"), **supervisor},
        }
    )
    agent = service.Agent(cfg, Identity(node_id="n", mgmt_addr="127.0.0.1", mgmt_interface=None))
    asyncio.run(agent.run(asyncio.Event()))
    return FakeSupervisor.instances[-1].calls


def test_engines_are_left_running_by_default(fakes, tmp_path):
    assert _run(tmp_path) == ["close"]


def test_stop_engines_on_exit_stops_them_first(fakes, tmp_path):
    assert _run(tmp_path, stop_engines_on_exit=True) == ["stop_all", "close"]


@pytest.mark.parametrize(
    "addr,host", [("127.0.0.1", "127.0.0.1"), ("10.0.0.5", "0.0.0.0"), (None, "0.0.0.0"), ("not-an-address", "0.0.0.0")]
)
def test_engines_bind_loopback_only_when_the_control_plane_is_reached_over_loopback(addr, host):
    assert service._engine_host(addr) == host


def test_a_binary_agent_yaml_names_is_reported_and_never_installed(tmp_path):
    from llmgw.protocol import EngineWant, Provision, encode

    cfg = parse_agent_config(
        {
            "server": "127.0.0.1:7443",
            "tls": None,
            "weights_cache": str(tmp_path / "w"),
            "engines_dir": str(tmp_path / "e"),
            "supervisor": {"work_dir": str(tmp_path / "s")},
            "engines": {"llamacpp": {"bin": "/opt/own/llama-server"}},
        }
    )
    agent = service.Agent(cfg, Identity(node_id="n", mgmt_addr="127.0.0.1", mgmt_interface=None))

    class Installer:
        statuses: ClassVar[dict] = {}

    class Converge:
        wanted: ClassVar[list] = []

        def want(self, wants) -> None:
            Converge.wanted = list(wants)

    agent.installer, agent._converge = Installer(), Converge()
    agent.send = lambda msg: None
    # Placement counts the node as having llama.cpp...
    assert agent._engine_versions() == {"llamacpp": "configured"}
    # ...and a provision for it installs nothing, while other engines are still installed.
    agent._handle(
        encode(
            Provision(
                id="p1",
                engines=[EngineWant(engine="llamacpp", version="b1"), EngineWant(engine="vllm", version="0.11.0")],
            )
        )
    )
    assert [w.engine for w in Converge.wanted] == ["vllm"]
