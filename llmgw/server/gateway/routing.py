"""Choosing among a model's ready endpoints: least loaded, prefix-aware, or round robin.

``prefix`` (the default) sends a request to the endpoint that most recently
served the longest leading part of the same prompt, so the engine finds that
part already in its KV cache and skips prefilling it, as long as that endpoint
is not much busier than the least loaded one; otherwise it takes the least
loaded. ``least_loaded`` ignores the prompt; ``round_robin`` ignores both load
and prompt and rotates per model. Where a model's endpoints differ in weight (a
profile's ``weight``, or the capacity `ctl bench --save` measured for it), loads are
compared per unit of weight (:func:`weighted`); ``round_robin`` rotates evenly whatever
the weights.

Prompts are compared without a tokenizer. The request's prompt text (for chat,
each message's role and text content in order) is cut into fixed blocks of
``block_chars`` characters; block i's hash is a hash of (hash of block i-1,
text of block i), so it stands for the whole prompt up to and including block
i, and two prompts share their first k block hashes exactly when their first
k*block_chars characters are equal. Only whole blocks count: a trailing
partial block would never match a longer next turn anyway.

Each endpoint keeps the hashes of the blocks it served recently in a bounded
LRU (an insertion-ordered dict, ``capacity`` blocks; about 100 bytes per
block, so the default 4096 blocks, 1 MiB of prompt text, take ~0.4 MB per
endpoint). A request's blocks are touched from its last to its first, so the
first blocks of a prompt are always the most recent ones and eviction removes
the deep ends of old prompts before their shared beginnings: what remains of a
prompt is always a prefix of it.

The hashes are Python's ``hash`` of a tuple: a few hundred nanoseconds per
256-character block; they are only compared within this process, so
per-process hash randomisation does not matter.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llmgw.server.gateway.endpoints import Endpoint

STRATEGIES = ("least_loaded", "prefix", "round_robin")
DEFAULT_STRATEGY = "prefix"
DEFAULT_BLOCK_CHARS = 256
DEFAULT_CAPACITY = 4096
DEFAULT_LOAD_FACTOR = 1.25
# Added to the least load before the factor applies: see Router.choose.
LOAD_SLACK = 1.0


def _text(content: Any) -> str:
    """A message's content as text: a string as it is, OpenAI content parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, dict):
                t = part.get("text")
                if isinstance(t, str):
                    out.append(t)
                else:
                    # An image or audio part: its type and reference still tell prompts apart.
                    out.append(repr(sorted((k, str(v)[:256]) for k, v in part.items())))
            elif isinstance(part, str):
                out.append(part)
        return "".join(out)
    if content is None:
        return ""
    return str(content)


def prompt_text(route: str, body: dict) -> str:
    """The text whose leading part an engine may have cached: chat messages rendered in
    order (role, then content), or a completion's prompt; empty for anything else."""
    if route == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list):
            return ""
        parts = []
        for m in messages:
            if isinstance(m, dict):
                parts.append(f"\x00{m.get('role', '')}\x01")
                parts.append(_text(m.get("content")))
        return "".join(parts)
    if route == "completions":
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            return prompt[0]  # a batch: the first prompt stands for it
        return ""
    return ""


def block_hashes(text: str, block_chars: int = DEFAULT_BLOCK_CHARS) -> tuple[int, ...]:
    """Chained hashes of the whole ``block_chars`` blocks of ``text``."""
    h = 0
    out = []
    for i in range(0, len(text) - block_chars + 1, block_chars):
        h = hash((h, text[i : i + block_chars]))
        out.append(h)
    return tuple(out)


def weighted(candidates: list[tuple[Endpoint, float]]) -> list[tuple[Endpoint, float]]:
    """The candidates' loads per unit of their endpoints' weight (a profile's ``weight``, or
    its measured capacity: control/capacity.py), so an endpoint of twice the weight takes
    twice the requests before it counts as busier. Each is compared as the load it would
    have with the new request, ``(load + 1) / weight`` (weighted least connections: an idle
    pool already fills the heavier endpoint first), scaled by the mean weight and less that
    one request again, so loads stay in requests and equal weights change nothing at all."""
    if len(candidates) < 2:
        return candidates
    first = candidates[0][0].weight
    if all(ep.weight == first for ep, _ in candidates):
        return candidates
    mean = sum(ep.weight for ep, _ in candidates) / len(candidates)
    return [(ep, (load + 1.0) * mean / ep.weight - 1.0) for ep, load in candidates]


class PrefixLRU:
    """The block hashes one endpoint served recently, at most ``capacity`` of them."""

    __slots__ = ("_blocks", "capacity")

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self._blocks: dict[int, None] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, h: int) -> bool:
        return h in self._blocks

    def match(self, blocks: Sequence[int]) -> int:
        """How many leading blocks of ``blocks`` this endpoint served recently."""
        b = self._blocks
        n = 0
        for h in blocks:
            if h not in b:
                break
            n += 1
        return n

    def record(self, blocks: Sequence[int]) -> None:
        b = self._blocks
        # Last block first, so the shared beginnings are the most recent entries and
        # are evicted last.
        for h in reversed(blocks):
            b.pop(h, None)
            b[h] = None
        extra = len(b) - self.capacity
        if extra > 0:
            it = iter(b)
            old = [next(it) for _ in range(extra)]
            for h in old:
                del b[h]


class RouterStats:
    """Counters per model, read when Prometheus scrapes (plain ints on the request path)."""

    __slots__ = ("choices", "matched_blocks", "prefix_hits", "prompt_blocks")

    def __init__(self) -> None:
        self.choices: dict[tuple[str, str], int] = {}
        self.prefix_hits: dict[str, int] = {}
        self.matched_blocks: dict[str, int] = {}
        self.prompt_blocks: dict[str, int] = {}


class Router:
    """The routing settings (global and per model) and the choice itself."""

    def __init__(
        self,
        strategy: str = DEFAULT_STRATEGY,
        load_factor: float = DEFAULT_LOAD_FACTOR,
        block_chars: int = DEFAULT_BLOCK_CHARS,
        capacity: int = DEFAULT_CAPACITY,
    ) -> None:
        self.default = strategy
        self.load_factor = load_factor
        self.block_chars = block_chars
        self.capacity = capacity
        self.per_model: dict[str, str] = {}
        self._rr: dict[str, int] = {}
        self.stats = RouterStats()

    def configure(self, strategy: str, load_factor: float, block_chars: int, capacity: int) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown routing {strategy!r}; use one of {', '.join(STRATEGIES)}")
        self.default = strategy
        self.load_factor = load_factor
        self.block_chars = block_chars
        self.capacity = capacity

    def set_model_strategies(self, strategies: dict[str, str | None]) -> None:
        self.per_model = {m: s for m, s in strategies.items() if s is not None}

    def strategy(self, model: str) -> str:
        return self.per_model.get(model, self.default)

    def blocks_for(self, model: str, route: str, body: dict) -> tuple[int, ...]:
        """The request's block hashes when its model routes by prefix; empty otherwise."""
        if self.per_model.get(model, self.default) != "prefix":
            return ()
        return block_hashes(prompt_text(route, body), self.block_chars)

    def choose(
        self, model: str, candidates: Iterable[tuple[Endpoint, float]], blocks: Sequence[int] = ()
    ) -> Endpoint | None:
        """Pick one of ``candidates`` (available endpoints with their load), in the order
        the model lists them.

        ``prefix``: an endpoint is a candidate for its cache when its load L satisfies
        L <= (L_min + 1) * load_factor, L_min being the least load. The 1 is one request:
        with a purely relative rule an idle pool (L_min = 0) would admit only idle
        endpoints, so a conversation would leave the endpoint holding its prefix
        whenever any other one went idle, which at low load is almost always, and
        exactly when a cache hit is worth most. Among those candidates the longest
        matched prefix wins; ties go to the least loaded, then to chance. No match at
        all is plain least loaded.
        """
        strategy = self.per_model.get(model, self.default)
        stats = self.stats
        if strategy == "round_robin":
            eps = [ep for ep, _ in candidates]
            if not eps:
                return None
            # Rotates over the endpoints available now; one dropping out shifts the turns.
            i = self._rr.get(model, 0)
            self._rr[model] = i + 1
            ep = eps[i % len(eps)]
            _count(stats.choices, (model, "round_robin"))
            return ep

        pool = list(candidates)
        if not pool:
            return None
        least = min(load for _, load in pool)
        best: Endpoint | None = None
        best_load = 0.0
        best_match = 0
        ties = 0
        if strategy == "prefix" and blocks:
            limit = (least + LOAD_SLACK) * self.load_factor
            for ep, load in pool:
                lru = ep.prefixes
                m = lru.match(blocks) if lru is not None and load <= limit else 0
                if best is None or m > best_match or (m == best_match and load < best_load):
                    best, best_load, best_match, ties = ep, load, m, 1
                elif m == best_match and load == best_load:
                    ties += 1
                    if random.random() * ties < 1.0:
                        best = ep
            assert best is not None
            lru = best.prefixes
            if lru is None:
                lru = best.prefixes = PrefixLRU(self.capacity)
            lru.record(blocks)
            _count(stats.prompt_blocks, model, len(blocks))
            if best_match:
                _count(stats.prefix_hits, model)
                _count(stats.matched_blocks, model, best_match)
                _count(stats.choices, (model, "prefix"))
            else:
                _count(stats.choices, (model, "least_loaded"))
            return best

        for ep, load in pool:
            if best is None or load < best_load:
                best, best_load, ties = ep, load, 1
            elif load == best_load:
                # Reservoir choice among equals spreads an idle pool evenly.
                ties += 1
                if random.random() * ties < 1.0:
                    best = ep
        _count(stats.choices, (model, "least_loaded"))
        return best


def _count(d: dict, key: Any, n: int = 1) -> None:
    d[key] = d.get(key, 0) + n


class RouterCollector:
    """Prometheus view of a Router's counters (computed at scrape time)."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        s = self.router.stats
        choices = CounterMetricFamily(
            "llmgw_router_choices",
            "Endpoint choices, by model and what decided them (prefix: a cached prefix; least_loaded; round_robin).",
            labels=["model", "decided_by"],
        )
        for (model, how), n in sorted(s.choices.items()):
            choices.add_metric([model, how], n)
        hits = CounterMetricFamily(
            "llmgw_router_prefix_hits",
            "Requests sent to an endpoint that recently served a prefix of their prompt.",
            labels=["model"],
        )
        for model, n in sorted(s.prefix_hits.items()):
            hits.add_metric([model], n)
        matched = CounterMetricFamily(
            "llmgw_router_prefix_matched_blocks",
            "Prompt blocks found on the chosen endpoint (prefix routing).",
            labels=["model"],
        )
        for model, n in sorted(s.matched_blocks.items()):
            matched.add_metric([model], n)
        total = CounterMetricFamily(
            "llmgw_router_prompt_blocks", "Prompt blocks of requests routed by prefix.", labels=["model"]
        )
        for model, n in sorted(s.prompt_blocks.items()):
            total.add_metric([model], n)
        return [choices, hits, matched, total]
