"""Reading engines' Prometheus text.

Engines publish their load in Prometheus' text format; the gateway reads it
to route and the agent to know when a draining engine has finished, so both
sides share this one reader.
"""

from __future__ import annotations


def parse_prometheus(text: str, wanted: set[str]) -> dict[str, float]:
    """Sum the samples of the wanted series in Prometheus text format.

    Only plain gauge/counter lines are looked at; a series with several label
    sets (vLLM labels by model_name) is summed, which is what load means.
    """
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        space = line.find(" ")
        if space < 0:
            continue
        end = brace if 0 <= brace < space else space
        name = line[:end]
        if name not in wanted:
            continue
        if brace == end:
            close = line.rfind("}")
            if close < 0:
                continue
            rest = line[close + 1 :].split()
        else:
            rest = line[space + 1 :].split()
        if not rest:
            continue
        try:
            value = float(rest[0])
        except ValueError:
            continue
        if value != value:  # NaN says nothing about load
            continue
        out[name] = out.get(name, 0.0) + value
    return out
