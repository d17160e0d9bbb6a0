"""server.yaml: the gateway's listeners, store, limits, timeouts and models.

Every block refuses keys it does not know, so a misspelt setting fails at start
with its full path instead of silently doing nothing.
"""

from __future__ import annotations

import os
import re
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from llmgw.config.loading import read_yaml, validate
from llmgw.config.types import ByteSize, Duration, Listen, ListenAddress, parse_listen

DEFAULT_STORE = "/var/lib/llmgw/llmgw.db"
DEFAULT_CONFIG_PATH = "/etc/llmgw/server.yaml"

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

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f'"{v}" is not an http(s) URL such as http://127.0.0.1:8000')
        try:
            parts.port
        except ValueError as exc:
            raise ValueError(f'"{v}" has an invalid port') from exc
        if parts.query or parts.fragment:
            raise ValueError(f'"{v}" should not carry a query or fragment')
        path = parts.path.rstrip("/")
        if path.endswith("/v1"):
            raise ValueError(f'"{v}": leave /v1 off; llmgw adds the route itself')
        return v.rstrip("/")


class ModelConfig(_Block):
    """A model clients can ask for, and where it is served."""

    name: str = Field(description="The catalog name clients send as `model`.")
    aliases: list[str] = Field(default_factory=list, description="Other names a client may send.")
    description: str | None = Field(default=None, description="Shown in /v1/models when set.")
    max_output: int | None = Field(
        default=None, gt=0, description="The largest max_tokens a request may ask for."
    )
    endpoints: list[EndpointConfig] = Field(
        default_factory=list, description="Engines already running that serve this model."
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


class AuthConfig(_Block):
    """API keys and where they, and usage, are stored."""

    enabled: bool = Field(default=True, description="Require an API key on every API request.")
    store: str = Field(
        default=DEFAULT_STORE,
        description="Where keys and usage live: a file path (SQLite), a postgres:// URL "
        "(PostgreSQL), or @/path/to/file holding the address.",
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
    metrics_stale_after: Duration = Field(
        default=10.0, description="Scraped numbers older than this are marked stale."
    )
    breaker: BreakerConfig = Field(default_factory=BreakerConfig)
    retries: int = Field(
        default=2, ge=0, le=10,
        description="Other endpoints tried when one fails before the first byte reached the client.",
    )


class TimeoutsConfig(_Block):
    """The gateway's own limits on engines."""

    connect: Duration = Field(default=5.0, description="Connecting to an engine.")
    generation: Duration = Field(
        default=600.0,
        description="A whole request to an engine; raise it for slow models. Before the first "
        "byte a timeout answers 504; after it the stream is closed.",
    )
    drain: Duration = Field(default=15.0, description="On shutdown, how long running requests may finish.")


class UsageConfig(_Block):
    """How usage rows are written to the store."""

    flush_interval: Duration = Field(default=1.0, description="How often usage rows are written.")
    batch_size: int = Field(default=500, ge=1, description="Rows written per statement at most.")
    queue_limit: int = Field(
        default=100_000, ge=100, description="Rows held in memory while the store is slow; beyond it rows are counted as dropped."
    )


class AgentTLSConfig(_Block):
    """The agent listener's certificate, and the authority agents' certificates must come from."""

    ca: str = Field(default="/etc/llmgw/pki/ca.pem", description="The fleet's certificate authority.")
    cert: str = Field(default="/etc/llmgw/pki/server.pem", description="This control plane's certificate; its names must hold every address agents dial.")
    key: str = Field(default="/etc/llmgw/pki/server-key.pem", description="Its private key.")


class ControlConfig(_Block):
    """The control plane: nodes connect and are driven from here."""

    enabled: bool = Field(default=False, description="Listen for node agents on agent_listen.")
    unreachable_after: Duration = Field(default=15.0, description="A node with no message for this long is unreachable.")
    lost_after: Duration = Field(default=60.0, description="A node with no message for this long is lost.")


class ServerConfig(_Block):
    """server.yaml."""

    listen: Listen = Field(default=parse_listen(":8080"), description="Client API (OpenAI-compatible).")
    admin_listen: Listen = Field(
        default=parse_listen("127.0.0.1:9090"), description="Admin API and metrics; loopback by default."
    )
    metrics_listen: Listen | None = Field(
        default=parse_listen(":9091"), description="Prometheus metrics only; null turns it off."
    )
    agent_listen: Listen = Field(default=parse_listen(":7443"), description="Node agents' stream (with control.enabled).")
    agent_tls: AgentTLSConfig | None = Field(
        default_factory=AgentTLSConfig,
        description="Mutual TLS for agents; null means plaintext, for one trusted machine only.",
    )
    control: ControlConfig = Field(default_factory=ControlConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    router: RouterConfig = Field(default_factory=RouterConfig)
    timeouts: TimeoutsConfig = Field(default_factory=TimeoutsConfig)
    usage: UsageConfig = Field(default_factory=UsageConfig)
    models: list[ModelConfig] = Field(default_factory=list, description="The models served, with their engines.")

    @model_validator(mode="after")
    def _unique_names(self) -> "ServerConfig":
        seen: dict[str, str] = {}
        for i, m in enumerate(self.models):
            for j, name in enumerate([m.name, *m.aliases]):
                where = f"models[{i}].name" if j == 0 else f"models[{i}].aliases[{j - 1}]"
                if name in seen:
                    raise ValueError(f'{where}: "{name}" is already used by {seen[name]}; every name and alias must be unique')
                seen[name] = where
        listeners = {"listen": self.listen, "admin_listen": self.admin_listen}
        if self.metrics_listen is not None:
            listeners["metrics_listen"] = self.metrics_listen
        if self.control.enabled:
            listeners["agent_listen"] = self.agent_listen
        if self.control.lost_after <= self.control.unreachable_after:
            raise ValueError("control.lost_after must be longer than control.unreachable_after")
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
    return parse_server_config(read_yaml(path, "server.yaml (see examples/server.yaml)"), str(path))
