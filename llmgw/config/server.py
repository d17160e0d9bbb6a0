"""server.yaml: the gateway's listeners, store, limits, timeouts and models.

Every block refuses keys it does not know, so a misspelt setting fails at start
with its full path instead of silently doing nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from llmgw.config.loading import read_yaml, validate
from llmgw.config.types import ByteSize, Duration, Listen, ListenAddress, parse_listen

DEFAULT_STORE = "/var/lib/llmgw/llmgw.db"
DEFAULT_DATA_DIR = "/var/lib/llmgw"
# The first admin token, in data_dir: written by the server, read by `llmgw ctl`.
ADMIN_TOKEN_FILE = "admin-token"
DEFAULT_CONFIG_PATH = "/etc/llmgw/server.yaml"
# The administrator's name admin_tls lists by default; no node may take it, admin_tls on or off.
DEFAULT_ADMIN_CLIENT = "admin"
# The llama.cpp release nodes install unless server.yaml's engines: says otherwise.
DEFAULT_LLAMACPP = "b10991"

Engine = Literal["llamacpp", "vllm", "sglang", "openai"]

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,199}")


class _Block(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _check_model_name(value: str, what: str) -> str:
    if not _NAME_RE.fullmatch(value):
        raise ValueError(
            f'"{value}" is not a usable {what}: use letters, digits and . _ - : / @ +, '
            "starting with a letter or digit, at most 200 characters"
        )
    return value


class EndpointConfig(_Block):
    """An engine already running somewhere that serves this model."""

    url: str = Field(description="Base URL of the engine, e.g. http://10.0.0.5:8000 (without /v1).")
    engine: Engine = Field(
        description="Which engine serves it: llamacpp, vllm, sglang or openai. "
        "It decides which metric names are scraped from its /metrics; openai means "
        "any OpenAI-compatible server without metrics."
    )
    model: str | None = Field(
        default=None,
        description="The model name the engine itself expects; defaults to the catalog name.",
    )
    api_key: str | None = Field(
        default=None,
        description="@/path/to/file: the file (one line, mode 0600) holds the key the engine requires "
        "(llama-server, vLLM and SGLang: --api-key), which the gateway sends on every request, scrape and "
        "health check. A file, not the key: server.yaml and the catalog are shown by `ctl` and the admin API.",
    )

    @field_validator("api_key")
    @classmethod
    def _api_key(cls, v: str | None) -> str | None:
        if v is None:
            return v
        path = v[1:].strip() if v.startswith("@") else ""
        if not path.startswith("/"):
            # The value itself is never echoed: it may be the key.
            raise ValueError(
                "must be @/path/to/file naming the file that holds the key, not the key itself: "
                "server.yaml and the catalog are shown by `ctl` and the admin API"
            )
        return "@" + path

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f'"{v}" is not an http(s) URL such as http://127.0.0.1:8000')
        try:
            _ = parts.port  # raises ValueError on an invalid port
        except ValueError as exc:
            raise ValueError(f'"{v}" has an invalid port') from exc
        if parts.query or parts.fragment:
            raise ValueError(f'"{v}" should not carry a query or fragment')
        path = parts.path.rstrip("/")
        if path.endswith("/v1"):
            raise ValueError(f'"{v}": leave /v1 off; llmgw adds the route itself')
        return v.rstrip("/")


ProfileEngine = Literal["llamacpp", "vllm", "sglang"]
# How the gateway picks among a model's ready endpoints (llmgw/server/gateway/routing.py).
Routing = Literal["least_loaded", "prefix", "round_robin"]

_GPU_CLASS_RE = re.compile(r"[a-z0-9][a-z0-9.-]{0,63}")
_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_LABEL_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,252}")
# A bare model id as vLLM and SGLang resolve it: "Qwen/Qwen2.5-7B-Instruct" or "gpt2".
_MODEL_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9._-]+)?")
DEFAULT_IDLE_TIMEOUT = 15 * 60.0


def source_kind(source: str) -> Literal["path", "url", "set", "hf", "model_id"]:
    """What a model source is. Only a trailing slash on a URL makes a set of files."""
    if source.startswith(("/", "./", "../", "~")):
        return "path"
    if source.startswith("hf:"):
        return "hf"
    if "://" in source:
        return "set" if urlsplit(source).path.endswith("/") else "url"
    return "model_id"


def _check_source(v: str) -> str:
    if not v or v != v.strip() or any(ord(c) < 32 for c in v):
        raise ValueError(f"{v!r} is empty or has surrounding spaces or control characters")
    kind = source_kind(v)
    if kind == "hf":
        segments = v[3:].split("/")
        if len(segments) < 3 or any(seg in ("", ".", "..") for seg in segments) or "\\" in v:
            raise ValueError(
                f'"{v}" is not hf:ORG/REPO/FILE (a set of files comes from the mirror, as a URL ending in /)'
            )
    elif kind in ("url", "set"):
        parts = urlsplit(v)
        if parts.scheme.lower() not in ("http", "https"):
            raise ValueError(
                f'"{v}" uses {parts.scheme}://, which a node cannot fetch; use http(s)://, hf:ORG/REPO/FILE, a path or a model id'
            )
        if not parts.hostname:
            raise ValueError(f'"{v}" has no host; write it as http://HOST[:PORT]/PATH')
        try:
            _ = parts.port  # raises ValueError on an invalid port
        except ValueError as exc:
            raise ValueError(f'"{v}" has an invalid port') from exc
        if parts.path in ("", "/"):
            raise ValueError(f'"{v}" names no file or version; add its path')
    elif kind == "model_id" and not _MODEL_ID_RE.fullmatch(v):
        raise ValueError(
            f'"{v}" is not a URL, hf:ORG/REPO/FILE, a path (start it with /, ./ or ../) or a model id such as Qwen/Qwen2.5-7B-Instruct'
        )
    return v


class ScalingConfig(_Block):
    """How many replicas run."""

    min: int = Field(
        default=1, ge=0, description="Replicas always running; 0 loads one on the first request (on demand)."
    )
    max: int = Field(
        default=None,
        ge=0,
        validate_default=False,
        description="Most replicas; 0 stops the model. Left out: the same as min, or 1 when min is 0.",
    )  # type: ignore[assignment]
    idle_timeout: Duration = Field(
        default=DEFAULT_IDLE_TIMEOUT,
        description="An on-demand model (min 0) is stopped after this long without requests.",
    )

    @model_validator(mode="before")
    @classmethod
    def _default_max(cls, data: Any) -> Any:
        # Filled before validation so the field is always an int: "min: 0" alone reads as
        # on demand, not stopped; stopping takes an explicit "max: 0".
        if isinstance(data, dict) and data.get("max") is None:
            m = data.get("min", 1)
            if isinstance(m, int) and not isinstance(m, bool):
                data = {**data, "max": max(m, 1)}
        return data

    @model_validator(mode="after")
    def _order(self) -> ScalingConfig:
        if self.max == 0 and self.min > 0:
            raise ValueError(f"max is 0 (stopped) but min is {self.min}; set min to 0 as well to stop the model")
        if 0 < self.max < self.min:
            raise ValueError(f"max ({self.max}) is smaller than min ({self.min})")
        if self.idle_timeout <= 0:
            raise ValueError("idle_timeout must be longer than 0s")
        return self

    @property
    def state(self) -> Literal["stopped", "on demand", "fixed"]:
        if self.max == 0:
            return "stopped"
        return "on demand" if self.min == 0 else "fixed"


class ProfileConfig(_Block):
    """One way to run a model: an engine on a class of GPU (or on CPU) with its arguments."""

    name: str = Field(default="", description="Unique within the model; defaults to ENGINE-GPU_CLASS (or ENGINE-cpu).")
    engine: ProfileEngine = Field(description="llamacpp, vllm or sglang.")
    gpu_class: str | None = Field(
        default=None,
        description="GPU class such as h100-80g (name and GiB the driver reports); absent means CPU, llamacpp only.",
    )
    tp: int = Field(default=1, ge=1, le=64, description="Tensor-parallel size: GPUs per replica across its nodes.")
    nodes: int = Field(default=1, ge=1, le=64, description="Nodes one replica spans (vLLM/SGLang only).")
    min_memory_gb: float | None = Field(default=None, gt=0, description="Host memory a replica needs on each node.")
    node_selector: dict[str, str] = Field(default_factory=dict, description="Labels a node must carry.")
    weight: float = Field(default=1.0, gt=0, description="Share of traffic relative to the model's other profiles.")
    args: list[str] = Field(default_factory=list, description="Extra engine arguments, e.g. [--no-jinja].")
    env: dict[str, str] = Field(
        default_factory=dict, description="Extra environment for the engine, e.g. NCCL variables."
    )
    startup_timeout: Duration = Field(
        default=1800.0,
        description="A replica not ready this long after it was started (fetching its weights included) has failed.",
    )

    @field_validator("gpu_class")
    @classmethod
    def _gpu_class(cls, v: str | None) -> str | None:
        if v is not None and not _GPU_CLASS_RE.fullmatch(v):
            raise ValueError(f'"{v}" is not a GPU class such as h100-80g (lowercase letters, digits, . and -)')
        return v

    @field_validator("node_selector")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        for key in v:
            if not _LABEL_RE.fullmatch(key):
                raise ValueError(f'"{key}" is not a label name (letters, digits, . _ / -)')
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():
            if not _ENV_NAME_RE.fullmatch(key):
                raise ValueError(f'"{key}" is not an environment variable name')
            if "\x00" in value:
                raise ValueError(f"{key} holds a NUL character, which no environment can carry")
        return v

    @field_validator("args")
    @classmethod
    def _args(cls, v: list[str]) -> list[str]:
        for arg in v:
            if "\x00" in arg:
                raise ValueError(f"{arg!r} holds a NUL character, which no command line can carry")
        return v

    @model_validator(mode="after")
    def _rules(self) -> ProfileConfig:
        if self.gpu_class is None and self.engine != "llamacpp":
            raise ValueError(
                f"gpu_class is missing: {self.engine} needs a GPU; only llamacpp runs on CPU (gpu_class left out)"
            )
        if self.engine == "llamacpp" and (self.tp > 1 or self.nodes > 1):
            raise ValueError(
                "llamacpp runs a replica on one node without tensor parallelism; set tp and nodes to 1 or use vllm/sglang"
            )
        if self.startup_timeout <= 0:
            raise ValueError("startup_timeout must be longer than 0s")
        if self.tp % self.nodes:
            raise ValueError(f"tp ({self.tp}) must divide evenly across nodes ({self.nodes})")
        if not self.name:
            # Frozen model: the derived default is set once, here.
            object.__setattr__(self, "name", f"{self.engine}-{self.gpu_class or 'cpu'}")
        else:
            _check_model_name(self.name, "profile name")
        return self

    @property
    def fingerprint(self) -> str:
        """sha256 of the profile's canonical JSON. Fields left at their defaults are
        omitted, so writing `tp: 1` or not, or a new optional field in a later llmgw,
        does not mark every running replica stale."""
        data = self.model_dump(mode="json", exclude_defaults=True)
        data["name"] = self.name
        # Neither changes the engine that runs: a new traffic share or patience
        # must not mark every replica stale.
        data.pop("weight", None)
        data.pop("startup_timeout", None)
        canon = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return hashlib.sha256(canon.encode("utf-8")).hexdigest()


class ModelConfig(_Block):
    """A model clients can ask for: either run by the control plane (profiles) or
    already running somewhere (endpoints)."""

    name: str = Field(description="The catalog name clients send as `model`.")
    aliases: list[str] = Field(default_factory=list, description="Other names a client may send.")
    description: str | None = Field(default=None, description="Shown in /v1/models when set.")
    max_output: int | None = Field(default=None, gt=0, description="The largest max_tokens a request may ask for.")
    context_length: int | None = Field(
        default=None,
        gt=0,
        description="Tokens of prompt and output one request may hold, told to clients in /v1/models; left "
        "out: read from the profiles' engine arguments (--ctx-size over --parallel, --max-model-len, "
        "--context-length) when they set it.",
    )
    endpoints: list[EndpointConfig] = Field(
        default_factory=list, description="Engines already running that serve this model."
    )
    source: str | None = Field(
        default=None,
        description="What nodes load (models with profiles): an http(s) URL, a URL ending in / "
        "(a mirror version: a set of files), hf:ORG/REPO/FILE, a path starting with / ./ or ../ "
        "(never fetched), or a model id such as Qwen/Qwen2.5-7B-Instruct passed to vLLM/SGLang.",
    )
    scaling: ScalingConfig | None = Field(
        default=None, description="Replica counts (models with profiles); left out: one replica always running."
    )
    profiles: list[ProfileConfig] = Field(
        default_factory=list,
        description="How the control plane may run this model; with profiles, llmgw starts the engines.",
    )
    routing: Routing | None = Field(
        default=None,
        description="How a request picks one of this model's ready endpoints: least_loaded, prefix "
        "(the endpoint that recently served the longest start of the same prompt, within "
        "router.session_load_factor of the least loaded) or round_robin; left out: router.routing.",
    )

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return _check_model_name(v, "model name")

    @field_validator("aliases")
    @classmethod
    def _aliases(cls, v: list[str]) -> list[str]:
        for alias in v:
            _check_model_name(alias, "alias")
        return v

    @field_validator("source")
    @classmethod
    def _source(cls, v: str | None) -> str | None:
        return None if v is None else _check_source(v)

    @model_validator(mode="after")
    def _kind(self) -> ModelConfig:
        if self.profiles and self.endpoints:
            raise ValueError(
                f"{self.name}: give either profiles (llmgw runs the engines) or endpoints (engines already running), not both"
            )
        if not self.profiles:
            if not self.endpoints:
                raise ValueError(
                    f"{self.name}: nothing serves it; add profiles (llmgw runs the engines) or endpoints (engines already running)"
                )
            for key in ("source", "scaling"):
                if getattr(self, key) is not None:
                    raise ValueError(
                        f"{self.name}: {key} applies only to a model with profiles; this one has only endpoints"
                    )
            return self
        if self.source is None:
            raise ValueError(f"{self.name}: source is required with profiles; it says what the nodes load")
        seen: set[str] = set()
        for i, p in enumerate(self.profiles):
            if p.name in seen:
                raise ValueError(
                    f'profiles[{i}].name: "{p.name}" is used by another profile of {self.name}; give each a name'
                )
            seen.add(p.name)
            if p.engine == "llamacpp" and source_kind(self.source) == "model_id":
                raise ValueError(
                    f'profiles[{i}]: llamacpp cannot load the model id "{self.source}"; give a URL, hf:ORG/REPO/FILE or a path to a .gguf'
                )
        if self.scaling is None:
            object.__setattr__(self, "scaling", ScalingConfig())
        return self

    @property
    def managed(self) -> bool:
        """Run by the control plane (it has profiles), as opposed to a static model."""
        return bool(self.profiles)

    @property
    def served_context(self) -> int | None:
        """The context one request may use: context_length, else the smallest its profiles'
        engine arguments give (llama.cpp divides --ctx-size among its --parallel slots), else
        None (the engine's own default, which the gateway cannot know)."""
        if self.context_length is not None:
            return self.context_length
        found = [c for c in (_profile_context(p) for p in self.profiles) if c is not None]
        return min(found) if found else None


def _arg(args: list[str], *names: str) -> int | None:
    """The whole-number value of the last of ``names`` in an argument list (--flag N or --flag=N)."""
    value: int | None = None
    for i, a in enumerate(args):
        text: str | None = None
        if a in names and i + 1 < len(args):
            text = args[i + 1]
        elif "=" in a and a.split("=", 1)[0] in names:
            text = a.split("=", 1)[1]
        if text is not None and text.isdigit():
            value = int(text)
    return value


def _profile_context(p: ProfileConfig) -> int | None:
    if p.engine == "llamacpp":
        ctx = _arg(p.args, "--ctx-size", "-c")
        if not ctx:  # 0 is llama.cpp's "the model's own", unknown here
            return None
        return ctx // max(1, _arg(p.args, "--parallel", "-np") or 1)
    if p.engine == "vllm":
        return _arg(p.args, "--max-model-len")
    return _arg(p.args, "--context-length")


class PriceConfig(_Block):
    """What a model's tokens cost, in whole units (dollars, euros, credits) per 1,000 tokens."""

    prompt_per_1k: float = Field(default=0.0, ge=0, description="Price of 1,000 prompt (input) tokens.")
    completion_per_1k: float = Field(default=0.0, ge=0, description="Price of 1,000 completion (output) tokens.")


class AuthConfig(_Block):
    """API keys and where they, and usage, are stored."""

    enabled: bool = Field(default=True, description="Require an API key on every API request.")
    store: str = Field(
        default=DEFAULT_STORE,
        description="Where keys and usage live: a file path (SQLite), a postgres:// URL "
        "(PostgreSQL), or @/path/to/file holding the address. A SQLite file's directory is created "
        "when missing, with a warning in the log (a mistyped path would start on an empty store).",
    )
    pricing: dict[str, PriceConfig] = Field(
        default_factory=dict,
        description="Price per model by catalog name: {MODEL: {prompt_per_1k, completion_per_1k}} in whole "
        "units per 1,000 tokens. Budgets bind only on priced models; a model priced at zero is exempt "
        "from budgets. Requests are priced by the catalog name, not the alias a client sent.",
    )
    default_price: PriceConfig | None = Field(
        default=None,
        description="Price of every model pricing leaves out; null: those models cost nothing and no budget binds on them.",
    )
    default_rpm: int | None = Field(
        default=None,
        ge=1,
        description="Requests per minute for a key no level limits; counted per key, never a shared pool. null: no default.",
    )
    default_tpm: int | None = Field(
        default=None,
        ge=1,
        description="Tokens per minute for a key no level limits; counted per key, never a shared pool. null: no default.",
    )
    shared_limits: bool | None = Field(
        default=None,
        description="Hold requests and tokens per minute and budgets across every gateway on this store, "
        "not once per process: each gateway leases shares of a pool's limit from the store (docs/gateway.md, "
        "Limits across gateways). null: on when the store is PostgreSQL; true also on SQLite (two servers "
        "on one file); false: each server counts alone (its workers always share its one accountant).",
    )
    signup_open: bool = Field(
        default=False,
        description="Let anyone create an account at /signup; it waits, pending, until an administrator approves it.",
    )
    session_ttl: Duration = Field(
        default=7 * 86400.0, description="How long a browser stays signed in to the pages without signing in again."
    )

    @field_validator("store")
    @classmethod
    def _store(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("is empty; give a file path, a postgres:// URL or @/path/to/file")
        return v.strip()


class BreakerConfig(_Block):
    """When an endpoint that keeps failing is taken out of rotation."""

    failures: int = Field(default=3, ge=1, description="Consecutive failures that take an endpoint out.")
    cooldown: Duration = Field(default=10.0, description="How long an endpoint stays out before a trial request.")


class RouterConfig(_Block):
    """How requests are read and sent to endpoints."""

    max_body_bytes: ByteSize = Field(default=32 * 1024 * 1024, description="Largest request body read.")
    scrape_interval: Duration = Field(default=1.0, description="How often each engine's /metrics is read.")
    metrics_stale_after: Duration = Field(default=10.0, description="Scraped numbers older than this are marked stale.")
    breaker: BreakerConfig = Field(default_factory=BreakerConfig)
    retries: int = Field(
        default=2,
        ge=0,
        le=10,
        description="Other endpoints tried when one fails before the first byte reached the client.",
    )
    routing: Routing = Field(
        default="prefix",
        description="How a request picks one of a model's ready endpoints (a model's own `routing` "
        "overrides it): prefix sends it where the longest start of its prompt was served recently "
        "(the engine's cache holds it) unless that endpoint is too busy, else to the least loaded; "
        "least_loaded ignores the prompt; round_robin takes each endpoint in turn.",
    )
    session_load_factor: float = Field(
        default=1.25,
        ge=1.0,
        le=100.0,
        description="prefix routing: an endpoint holding the prompt's start is preferred while its "
        "load (requests ahead) is at most (least load + 1) times this.",
    )
    prefix_block_chars: int = Field(
        default=256,
        ge=16,
        le=65536,
        description="prefix routing: prompts are compared in blocks of this many characters.",
    )
    prefix_cache_blocks: int = Field(
        default=4096,
        ge=16,
        le=10_000_000,
        description="prefix routing: block hashes remembered per endpoint (about 100 bytes each), oldest forgotten first.",
    )


class TimeoutsConfig(_Block):
    """The gateway's own limits on engines."""

    connect: Duration = Field(default=5.0, description="Connecting to an engine.")
    generation: Duration = Field(
        default=600.0,
        description="A whole request to an engine; raise it for slow models. Before the first "
        "byte a timeout answers 504; after it the stream is closed.",
    )
    first_byte: Duration = Field(
        default=60.0,
        description="How long an engine may send nothing at all (not even response headers) while it "
        "also fails its health checks; the request then goes to another replica and the breaker counts "
        "a failure. An engine that keeps answering its health checks is never cut by this.",
    )
    drain: Duration = Field(default=15.0, description="On shutdown, how long running requests may finish.")


class UsageConfig(_Block):
    """How usage rows are written to the store."""

    flush_interval: Duration = Field(default=1.0, description="How often usage rows are written.")
    batch_size: int = Field(default=500, ge=1, description="Rows written per statement at most.")
    queue_limit: int = Field(
        default=100_000,
        ge=100,
        description="Rows held in memory while the store is slow; beyond it rows are counted as dropped.",
    )
    final_flush: Duration = Field(
        default=5.0,
        description="On shutdown, after timeouts.drain, how long the last write of queued rows may take; what the "
        "store has not taken by then is kept in usage-journal in data_dir, and the next start writes it to "
        "the store before serving.",
    )


class ThreadsConfig(_Block):
    """Conversations and agent notes without authentication (auth.enabled: false): one shared pool,
    for one trusted machine only. With keys, each project turns them on by name instead
    (`llmgw keys threads`, `llmgw keys memory`)."""

    store: bool = Field(default=False, description="Keep conversations (x-llmgw-thread) and agent notes.")
    retain_hours: int | None = Field(
        default=None, ge=1, description="How long one is kept after its last turn or write; required with store."
    )

    @model_validator(mode="after")
    def _retention(self) -> ThreadsConfig:
        if self.store and self.retain_hours is None:
            raise ValueError("threads.retain_hours is required with threads.store: how long to keep what is stored")
        return self


class AgentsConfig(_Block):
    """Bounds on what one tenant may keep for its agents (docs/agents.md, Quotas): the conversations,
    stored responses and notes of a project, and the MCP sessions of a key."""

    quota_items: int = Field(
        default=100_000,
        ge=1,
        description="Conversations, stored responses and notes one project keeps at most, together (without "
        "authentication: the shared pool); a write past it is refused 429 (storage_quota_items) until some are "
        "deleted or expire.",
    )
    quota_bytes: ByteSize = Field(
        default=1024 * 1024 * 1024,
        description="Bytes of note text and of conversation and stored-response messages (as JSON) one project "
        "keeps at most, together; a write past it is refused 429 (storage_quota_bytes), one item larger than the "
        "whole quota 413.",
    )
    mcp_sessions_per_key: int = Field(
        default=100,
        ge=1,
        description="MCP sessions one key holds open at most in each gateway process; a new one past it ends "
        "that key's least recently used session, never another key's.",
    )


class AdmissionConfig(_Block):
    """Saturated models: requests wait their turn, highest band first, tenants in turn within a band."""

    enabled: bool = Field(
        default=True,
        description="Hold requests in a per-model queue while the model's endpoints are saturated; false sends every request straight on.",
    )
    queue_timeout: Duration = Field(
        default=30.0, description="How long a request may wait for its turn before it is answered 503 with Retry-After."
    )
    max_queue: int = Field(
        default=1000,
        ge=1,
        description="Requests waiting per model at most; when full, a waiter of the lowest band gives way (or the newcomer, when none is lower).",
    )
    healthy_waiting: float = Field(
        default=8.0,
        gt=0,
        description="Requests waiting inside one engine (its own queue, as its /metrics reports) that still count as healthy; "
        "a model is saturated when its ready endpoints' waiting requests reach this many per endpoint.",
    )
    kv_ceiling: float = Field(
        default=0.9,
        gt=0,
        le=1,
        description="KV-cache use (0-1) that still counts as healthy; a model is saturated when its endpoints' mean use reaches it.",
    )
    retry_after: Duration = Field(
        default=5.0, description="The Retry-After sent with a 503 from admission (rounded up to whole seconds)."
    )


class AgentTLSConfig(_Block):
    """The agent listener's certificate, and the authority agents' certificates must come from."""

    ca: str = Field(default="/etc/llmgw/pki/ca.pem", description="The fleet's certificate authority.")
    cert: str = Field(
        default="/etc/llmgw/pki/server.pem",
        description="This control plane's certificate; its names must hold every address agents dial.",
    )
    key: str = Field(default="/etc/llmgw/pki/server-key.pem", description="Its private key.")
    require_node_mark: bool = Field(
        default=False,
        description="Refuse an agent whose certificate lacks the node mark (issued before llmgw marked node "
        "certificates). false: such a node still joins and the server logs, once per node, the command that "
        "issues its certificate again; set true once every node's has been. server init and llmgw up write true. "
        "An administrator's certificate is refused either way.",
    )


class AdminTLSConfig(_Block):
    """TLS on the admin listener; a client certificate from the fleet's authority is then a credential too."""

    ca: str = Field(
        default="/etc/llmgw/pki/ca.pem",
        description="The fleet's certificate authority; client certificates are checked against it.",
    )
    cert: str = Field(default="/etc/llmgw/pki/server.pem", description="The admin listener's certificate.")
    key: str = Field(default="/etc/llmgw/pki/server-key.pem", description="Its private key.")
    clients: list[str] = Field(
        default_factory=lambda: [DEFAULT_ADMIN_CLIENT],
        description="Names of the administrators' certificates that may use the admin API "
        "(`llmgw ctl cert issue-admin NAME` makes one); a node's certificate is refused whatever its name, "
        "and no node may be given one of these names.",
    )


class MirrorTLSConfig(_Block):
    """The control plane's client certificate for a mirror that requires mutual TLS."""

    ca: str = Field(description="The fleet's certificate authority (the mirror's certificate comes from it).")
    cert: str = Field(description="A client certificate from that authority, e.g. issued for control-plane.")
    key: str = Field(description="Its private key.")


class MirrorConfig(_Block):
    """The model mirror this control plane asks to fetch weights."""

    api: str = Field(description="The mirror's management API, e.g. http://models.internal:8082.")
    token_file: str | None = Field(
        default=None,
        description="A file holding the mirror's API token: a copy of the token file beside the mirror's "
        "directory (/srv/models.api-token for /srv/models), mode 0600, readable by the user the server runs as; "
        "read at start and sent as a bearer token.",
    )
    tls: MirrorTLSConfig | None = Field(
        default=None,
        description="TLS to the management API with a client certificate, which is a credential for a mirror started "
        "with --tls-ca (named by its --tls-client, control-plane by default); null: plain HTTP.",
    )
    registry: str | None = Field(
        default=None,
        description="An internal Hugging Face mirror used for hf: sources instead of https://huggingface.co.",
    )

    @field_validator("api", "registry")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        if v is not None:
            parts = urlsplit(v)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f'"{v}" is not an http(s) URL')
            v = v.rstrip("/")
        return v

    @model_validator(mode="after")
    def _credential(self) -> MirrorConfig:
        # The mirror answers nothing without one, so a block without one could never work.
        if self.token_file is None and self.tls is None:
            raise ValueError(
                "the mirror's management API needs a credential: set token_file to a copy of the "
                "mirror's API token (`llmgw mirror init` says where it is, e.g. /srv/models.api-token), "
                "or tls with a client certificate the mirror accepts"
            )
        if self.tls is not None and self.api.startswith("http://"):
            # A client certificate is only presented over TLS: http:// would reach a TLS listener in plain text.
            raise ValueError(
                f"tls is set but api is {self.api}: a mirror API that takes a client certificate listens with TLS, "
                f"so write it as {'https://' + self.api[len('http://') :]}"
            )
        return self


class ControlConfig(_Block):
    """The control plane: nodes connect and are driven from here."""

    enabled: bool = Field(default=False, description="Listen for node agents on agent_listen.")
    unreachable_after: Duration = Field(
        default=15.0, description="A node with no message for this long is unreachable."
    )
    lost_after: Duration = Field(default=60.0, description="A node with no message for this long is lost.")
    heartbeat_rate: float | None = Field(
        default=200.0,
        description="The heartbeats a second the control plane asks its whole fleet for. Above this many nodes "
        "each agent is asked to report every nodes/heartbeat_rate seconds (when that is longer than its own "
        "heartbeat_interval), and unreachable_after and lost_after stretch in proportion for it (three missed "
        "reports), so a large fleet's heartbeats, and a restart's reconnection storm, cost the control plane the "
        "same each second however many nodes there are. null: agents keep their own interval at any size.",
    )
    expected_nodes: list[str] = Field(
        default_factory=list,
        description="The node ids of every agent of this control plane, when they are known. After a start it "
        "places nothing for unreachable_after, so agents that run replicas come back before anything is placed "
        "twice; once each node listed here has registered it places at once. Empty: it always waits. A node "
        "left out of the list may find its replicas placed again elsewhere.",
    )
    interval: Duration = Field(
        default=5.0, description="How often the reconciler compares what runs with what should run."
    )
    base_backoff: Duration = Field(
        default=10.0, description="Wait after a model's replica failed to start; doubled on each failure in a row."
    )
    max_backoff: Duration = Field(default=300.0, description="The longest wait between start attempts of a model.")
    engine_ports: str = Field(
        default="20000-29999", description="Ports engines are given on nodes, FIRST-LAST; each replica takes one."
    )
    cold_start_wait: Duration = Field(
        default=600.0,
        description="How long a request to an on-demand model with no replica waits for one to load before a 503.",
    )
    fabric_scan_interval: Duration = Field(
        default=300.0,
        description="How often one node per InfiniBand fabric maps it with ibnetdiscover (/admin/fabrics).",
    )
    lease_ttl: Duration | None = Field(
        default=None,
        description="Leadership as a lease in the store, for two control planes on one PostgreSQL store: the "
        "lease lasts this long and is renewed every third of it; the other waits as a standby and takes over "
        "within it when the leader dies (at once when it stops cleanly). null: this control plane always leads.",
    )

    @field_validator("engine_ports")
    @classmethod
    def _ports(cls, v: str) -> str:
        port_range(v)
        return v

    @field_validator("expected_nodes")
    @classmethod
    def _expected_nodes(cls, v: list[str]) -> list[str]:
        for i, node_id in enumerate(v):
            if not node_id.strip():
                raise ValueError(f"entry {i} is empty: give each node's id (its agent's node_id)")
            if node_id in v[:i]:
                raise ValueError(f"{node_id!r} is listed twice: give each node once")
        return v

    @property
    def port_range(self) -> tuple[int, int]:
        return port_range(self.engine_ports)

    @model_validator(mode="after")
    def _times(self) -> ControlConfig:
        if not 0 < self.unreachable_after < self.lost_after:
            raise ValueError(
                f"unreachable_after ({self.unreachable_after:g}s) must be above 0 and below "
                f"lost_after ({self.lost_after:g}s)"
            )
        if self.heartbeat_rate is not None and not self.heartbeat_rate > 0:
            raise ValueError(
                f"heartbeat_rate ({self.heartbeat_rate:g}) must be above 0, or null to leave every agent its own interval"
            )
        for key in ("interval", "base_backoff", "cold_start_wait", "fabric_scan_interval"):
            if getattr(self, key) <= 0:
                raise ValueError(f"{key} must be longer than 0s")
        if self.max_backoff < self.base_backoff:
            raise ValueError(
                f"max_backoff ({self.max_backoff:g}s) is shorter than base_backoff ({self.base_backoff:g}s)"
            )
        if self.lease_ttl is not None and self.lease_ttl < 1.5:
            # Renewed every third of it: a shorter lease would have to be renewed faster than a store answers.
            raise ValueError(f"lease_ttl ({self.lease_ttl:g}s) must be at least 1.5s; 10s is a good start")
        return self


def port_range(text: str) -> tuple[int, int]:
    """ "20000-29999" -> (20000, 29999); refuses anything else with the reason."""
    m = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", text or "")
    if not m:
        raise ValueError(f'"{text}" is not a port range; write FIRST-LAST, e.g. 20000-29999')
    lo, hi = int(m.group(1)), int(m.group(2))
    if not 1024 <= lo <= hi <= 65535:
        raise ValueError(f'"{text}": ports must run from 1024 to 65535 with FIRST no larger than LAST')
    return lo, hi


class EnginesConfig(_Block):
    """The engine versions every node converges on; null leaves an engine alone."""

    llamacpp: str | None = Field(default=DEFAULT_LLAMACPP, description="llama.cpp release tag installed on every node.")
    vllm: str | None = Field(
        default=None, description="vLLM version installed on GPU nodes, e.g. 0.11.0; null: not installed."
    )
    sglang: str | None = Field(default=None, description="SGLang version installed on GPU nodes; null: not installed.")
    release_url: str | None = Field(
        default=None,
        description="Base URL of llama.cpp release archives (a mirror holding TAG/ASSET); null: GitHub.",
    )

    @field_validator("llamacpp", "vllm", "sglang")
    @classmethod
    def _version(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}", v):
            raise ValueError(f'"{v}" is not a version or release tag (letters, digits, . _ + -)')
        return v

    @field_validator("release_url")
    @classmethod
    def _release_url(cls, v: str | None) -> str | None:
        if v is not None:
            parts = urlsplit(v)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f'"{v}" is not an http(s) URL')
        return v

    def wanted(self) -> list[tuple[str, str, str | None]]:
        """(engine, version, source URL) for each engine named."""
        out: list[tuple[str, str, str | None]] = []
        for engine in ("llamacpp", "vllm", "sglang"):
            version = getattr(self, engine)
            if version:
                out.append((engine, version, self.release_url if engine == "llamacpp" else None))
        return out


class LandingConfig(_Block):
    """The open page at / for someone without an account."""

    contact: str | None = Field(
        default=None,
        description="How to ask for access, shown on / (an email address, a chat channel, a URL); null: not shown.",
    )


class MonitoringConfig(_Block):
    """Where the pages read the cluster's history from."""

    prometheus: str | None = Field(
        default=None,
        description="The Prometheus that scrapes this gateway's metrics listener, e.g. http://monitoring:9090; "
        "the Cluster and node pages chart its history. null: no charts (the pages say so).",
    )

    @field_validator("prometheus")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        if v is not None:
            parts = urlsplit(v)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f'"{v}" is not an http(s) URL; write it as http://HOST:9090')
            v = v.rstrip("/")
        return v


MAX_AUTO_WORKERS = 8  # beyond this the store's rounds, not the cores, are what a worker more costs
MAX_WORKERS = 64


def resolve_workers(setting: int | str, cores: int | None = None) -> int:
    """How many serving processes `workers` stands for on this machine: auto is one per core."""
    if setting != "auto":
        return int(setting)
    if cores is None:
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # not on Linux
            cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_AUTO_WORKERS))


class ServerConfig(_Block):
    """server.yaml."""

    listen: Listen = Field(default=parse_listen(":8080"), description="Client API (OpenAI-compatible).")
    workers: int | Literal["auto"] = Field(
        default="auto",
        description="Processes serving the client API on `listen` together (SO_REUSEPORT); one accountant, the "
        "server process's, holds limits and budgets across them (docs/gateway.md, Workers). auto: one per core "
        f"this process may run on, at most {MAX_AUTO_WORKERS}; 1: the server process alone.",
    )
    admin_listen: Listen = Field(
        default=parse_listen("127.0.0.1:9090"), description="Admin API and metrics; loopback by default."
    )
    metrics_listen: Listen | None = Field(
        default=parse_listen(":9091"), description="Prometheus metrics only; null turns it off."
    )
    agent_listen: Listen = Field(
        default=parse_listen(":7443"), description="Node agents' stream (with control.enabled)."
    )
    admin_tls: AdminTLSConfig | None = Field(
        default=None,
        description="TLS for admin_listen, accepting the fleet's client certificates named in clients "
        "as well as admin tokens; null: plain HTTP (keep admin_listen on loopback then).",
    )
    admin_hosts: list[str] = Field(
        default_factory=list,
        description="Further names the admin API is reached by (the Host header), besides this machine's "
        "own names and addresses; anything else is refused, which stops DNS-rebinding pages.",
    )
    data_dir: str | None = Field(
        default=None,
        description="The server's own files: admin-token (the first admin token, mode 0600, made at the "
        "first start) and usage-journal (usage rows the store could not take at shutdown). Created when missing. "
        "null: the directory of the SQLite store (auth.store), or /var/lib/llmgw when the store is PostgreSQL.",
    )
    agent_tls: AgentTLSConfig | None = Field(
        default_factory=AgentTLSConfig,
        description="Mutual TLS for agents; null means plaintext, for one trusted machine only.",
    )
    control: ControlConfig = Field(default_factory=ControlConfig)
    engines: EnginesConfig = Field(default_factory=EnginesConfig)
    mirror: MirrorConfig | None = Field(default=None, description="The model mirror; null: none.")
    auth: AuthConfig = Field(default_factory=AuthConfig)
    router: RouterConfig = Field(default_factory=RouterConfig)
    timeouts: TimeoutsConfig = Field(default_factory=TimeoutsConfig)
    usage: UsageConfig = Field(default_factory=UsageConfig)
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)
    models: list[ModelConfig] = Field(default_factory=list, description="The models served, with their engines.")
    landing: LandingConfig = Field(default_factory=LandingConfig)
    monitoring: MonitoringConfig = Field(default_factory=MonitoringConfig)
    threads: ThreadsConfig = Field(default_factory=ThreadsConfig)
    agents: AgentsConfig = Field(default_factory=AgentsConfig)

    @property
    def admin_names(self) -> frozenset[str]:
        """Names no node may take: admin_tls.clients, and the default admin even without admin_tls
        (turning admin_tls on lists it)."""
        listed = self.admin_tls.clients if self.admin_tls is not None else []
        return frozenset([DEFAULT_ADMIN_CLIENT, *listed])

    @property
    def data_path(self) -> str:
        """data_dir, or where it defaults to: beside a SQLite store, else /var/lib/llmgw."""
        if self.data_dir:
            return self.data_dir
        store = self.auth.store
        if store.startswith("@") or "://" in store:  # PostgreSQL (or an address read from a file)
            return DEFAULT_DATA_DIR
        return os.path.dirname(os.path.abspath(os.path.expanduser(store)))

    @field_validator("workers", mode="before")
    @classmethod
    def _workers(cls, v: Any) -> Any:
        if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_WORKERS):
            return v
        raise ValueError(
            f"{v!r} is not a number of workers: give a whole number from 1 to {MAX_WORKERS}, "
            f"or auto (one per core, at most {MAX_AUTO_WORKERS})"
        )

    @model_validator(mode="after")
    def _unique_names(self) -> ServerConfig:
        seen: dict[str, str] = {}
        for i, m in enumerate(self.models):
            for j, name in enumerate([m.name, *m.aliases]):
                where = f"models[{i}].name" if j == 0 else f"models[{i}].aliases[{j - 1}]"
                if name in seen:
                    raise ValueError(
                        f'{where}: "{name}" is already used by {seen[name]}; every name and alias must be unique'
                    )
                seen[name] = where
        listeners = {"listen": self.listen, "admin_listen": self.admin_listen}
        if self.metrics_listen is not None:
            listeners["metrics_listen"] = self.metrics_listen
        if self.control.enabled:
            listeners["agent_listen"] = self.agent_listen
        if self.threads.store and self.auth.enabled:
            raise ValueError(
                "threads.store keeps one pool for everyone and is for a gateway without authentication; with "
                "auth.enabled, turn conversations on per project: llmgw keys threads --project P --retain-hours N"
            )
        if self.control.lost_after <= self.control.unreachable_after:
            raise ValueError("control.lost_after must be longer than control.unreachable_after")
        if self.timeouts.first_byte < 2 * self.router.scrape_interval:
            # The first-byte check asks whether a probe sent in that time was answered.
            raise ValueError(
                f"timeouts.first_byte ({self.timeouts.first_byte:g}s) must be at least twice "
                f"router.scrape_interval ({self.router.scrape_interval:g}s): engines are probed "
                "that often, and one that answers its probes is never cut"
            )
        ports: dict[int, str] = {}
        for key, addr in listeners.items():
            if addr.port in ports and _overlap(addr, listeners[ports[addr.port]]):
                raise ValueError(f"{key}: port {addr.port} is already taken by {ports[addr.port]}")
            ports[addr.port] = key
        return self


def _overlap(a: ListenAddress, b: ListenAddress) -> bool:
    return a.host == b.host or "" in (a.host, b.host) or "0.0.0.0" in (a.host, b.host) or "::" in (a.host, b.host)


def parse_server_config(data: Any, source: str = "server.yaml") -> ServerConfig:
    return validate(ServerConfig, data, source, "listen:, auth:, models:")


def load_server_config(path: str | os.PathLike[str]) -> ServerConfig:
    return parse_server_config(
        read_yaml(path, "server.yaml (see examples/server.yaml)", empty="write `{}` in it to take every default"),
        str(path),
    )
