"""A fleet registering at once must not make the fabric registry walk every node once per node."""

from __future__ import annotations

from test_fabric_service import FABRIC, ib_node, service

from llmgw.testing.waiting import async_until


async def test_many_registrations_in_the_event_loop_derive_the_fabrics_once_not_once_per_node():
    svc, agents, _ = service()
    derived = []
    real = svc.registry._derive
    svc.registry._derive = lambda: (derived.append(1), real())[1]  # type: ignore[method-assign]
    for i in range(40):
        agents.put(ib_node(f"node-{i:02d}"))
    assert derived == [], "a registration only takes the report; nothing walks the other nodes"
    await async_until(lambda: svc._known_ib == {FABRIC}, timeout=5.0)
    assert derived == [1], "the forty reports were derived in one pass"
    assert len(svc.fabrics()[0].members) == 160 and derived == [1], "a read reuses the settled view"


def test_a_read_right_after_a_report_sees_it_without_waiting_for_the_settle():
    svc, agents, _ = service()
    agents.put(ib_node("node-a"))
    assert {m.node for m in svc.fabrics()[0].members} == {"node-a"}
    agents.put(ib_node("node-b"))
    assert {m.node for m in svc.fabrics()[0].members} == {"node-a", "node-b"}
