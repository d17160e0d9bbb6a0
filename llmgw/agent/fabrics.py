"""Which of agent.yaml's fabrics this node is usably on, checked against the adapters sysfs shows.

A fabric is advertised only when every adapter it lists is present with at least one ACTIVE
port: placement puts a replica's shards on a fabric by its name, and a node advertising a
fabric it cannot reach would be given shards whose traffic goes nowhere. What keeps a fabric
out is said in words, logged on the node and sent to the control plane (ctl nodes shows it).
Checked again with every heartbeat's ports, so an adapter that comes back is advertised again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from llmgw.config.agent import FabricDecl
from llmgw.protocol import IBPort
from llmgw.protocol.messages import FabricAttachment


@dataclass(frozen=True)
class FabricCheck:
    advertised: tuple[FabricAttachment, ...]
    problems: tuple[str, ...]  # one sentence per fabric kept out, naming the adapters and why


def check_fabrics(declared: Sequence[FabricDecl], ports: Sequence[IBPort] | None) -> FabricCheck:
    """agent.yaml's fabrics against the ports read now; ``ports`` None: not read (no sysfs)."""
    by_hca: dict[str, list[IBPort]] = {}
    for p in ports or ():
        by_hca.setdefault(p.hca, []).append(p)
    advertised: list[FabricAttachment] = []
    problems: list[str] = []
    for decl in declared:
        missing = [h for h in decl.hcas if h not in by_hca]
        inactive = [h for h in decl.hcas if h in by_hca and not any(p.active for p in by_hca[h])]
        if missing or inactive:
            why = []
            if missing:
                why.append(f"{_names(missing)} {'is' if len(missing) == 1 else 'are'} not on this node")
            if inactive:
                states = "; ".join(f"{h}: {_states(by_hca[h])}" for h in inactive)
                why.append(f"{_names(inactive)} {'has' if len(inactive) == 1 else 'have'} no ACTIVE port ({states})")
            problems.append(
                f"fabric {decl.name} is not advertised: {' and '.join(why)}; check the cable and the subnet "
                "manager, or correct fabrics[].hcas in agent.yaml"
            )
            continue
        rates = [p.rate_gbps for h in decl.hcas for p in by_hca[h] if p.active and p.rate_gbps is not None]
        advertised.append(
            FabricAttachment(fabric=decl.name, hcas=list(decl.hcas), rate_gbps=min(rates) if rates else decl.rate_gbps)
        )
    return FabricCheck(tuple(advertised), tuple(problems))


def _names(hcas: list[str]) -> str:
    return ", ".join(hcas)


def _states(ports: list[IBPort]) -> str:
    return ", ".join(f"port {p.port} {p.state or 'unknown'}" for p in sorted(ports, key=lambda p: p.port))
