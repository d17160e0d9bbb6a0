"""Configuration files read into pydantic models: loading, validation and error messages."""

from llmgw.config.errors import ConfigError
from llmgw.config.server import (
    AuthConfig,
    EndpointConfig,
    ModelConfig,
    RouterConfig,
    ServerConfig,
    TimeoutsConfig,
    load_server_config,
    parse_server_config,
)

__all__ = [
    "AuthConfig",
    "ConfigError",
    "EndpointConfig",
    "ModelConfig",
    "RouterConfig",
    "ServerConfig",
    "TimeoutsConfig",
    "load_server_config",
    "parse_server_config",
]
