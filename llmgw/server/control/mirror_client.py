"""The control plane's side of the model mirror: asking it to fetch, watching it,
and turning a mirrored version into a catalog entry in one step.

The mirror's management API (see docs/mirror.md) answers JSON; a refusal is
``{"error": {"message": SENTENCE}}``, and that sentence is passed on unchanged
so the operator reads the mirror's own words.
"""

from __future__ import annotations

import ssl
from typing import Any
from urllib.parse import quote

import aiohttp

from llmgw.config.server import MirrorConfig
from llmgw.errors import LlmgwError
from llmgw.files import SecretFileError, read_secret_file
from llmgw.pki import PKIError, client_context
from llmgw.protocol.mirror_api import MirrorVersion

GiB = 1 << 30
# The estimate the mirror's serve form offered: the weights, half again for the
# KV cache and buffers, and 2 GB for the engine itself.
MEMORY_FACTOR = 1.5
MEMORY_OVERHEAD_GB = 2.0
_WEIGHT_SUFFIXES = (".gguf", ".safetensors", ".bin", ".pt")


class MirrorUnavailable(LlmgwError):
    """The mirror could not be asked (not configured, unreachable, bad certificate)."""


class MirrorRefused(LlmgwError):
    """The mirror answered with a refusal; ``status`` is its HTTP status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class MirrorClient:
    def __init__(self, config: MirrorConfig, timeout: float = 30.0) -> None:
        self.config = config
        self.api = config.api.rstrip("/")
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._ssl: ssl.SSLContext | bool = True  # True: verify against the system's CAs
        self._headers: dict[str, str] = {}
        if config.tls is not None:
            try:
                self._ssl = client_context(config.tls.ca, config.tls.cert, config.tls.key)
            except PKIError as exc:
                raise MirrorUnavailable(f"mirror.tls: {exc}") from None
        if config.token_file is not None:
            # Read once, at start: a token file that cannot be read stops the start with the reason.
            try:
                self._headers["Authorization"] = f"Bearer {read_secret_file(config.token_file)}"
            except SecretFileError as exc:
                raise MirrorUnavailable(f"mirror.token_file: {exc}") from None

    async def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        url = self.api + path
        try:
            async with (
                aiohttp.ClientSession(timeout=self._timeout) as http,
                http.request(method, url, json=body, ssl=self._ssl, headers=self._headers) as resp,
            ):
                text = await resp.text()
                try:
                    data = await resp.json(content_type=None) if text else {}
                except ValueError:
                    data = None
        except aiohttp.ClientConnectorCertificateError as exc:
            raise MirrorUnavailable(
                f"the mirror at {self.api} presented a certificate that does not verify "
                f"against mirror.tls.ca: {exc.certificate_error}"
            ) from None
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise MirrorUnavailable(
                f"the mirror at {self.api} cannot be reached: "
                f"{exc or type(exc).__name__}; check mirror.api in server.yaml"
            ) from None
        if resp.status >= 400:
            message = None
            if isinstance(data, dict) and isinstance(data.get("error"), dict):
                message = data["error"].get("message")
            raise MirrorRefused(resp.status, message or f"the mirror answered {resp.status}: {text[:200]}")
        if not isinstance(data, dict):
            raise MirrorUnavailable(f"the mirror at {self.api} did not answer JSON: {text[:200]}")
        return data

    async def list(self) -> dict:
        return await self._call("GET", "/v1/models")

    async def fetch(
        self, source: str, model: str, version: str, *, as_name: str | None = None, anyway: bool = False
    ) -> dict:
        body: dict[str, Any] = {"source": source, "model": model, "version": version}
        if as_name:
            body["as"] = as_name
        if anyway:
            body["anyway"] = True
        return await self._call("POST", "/v1/models", body)

    async def status(self, model: str, version: str) -> dict:
        return await self._call("GET", f"/v1/models/{quote(model, safe='')}/{quote(version, safe='')}")

    async def remove(self, model: str, version: str) -> dict:
        return await self._call("DELETE", f"/v1/models/{quote(model, safe='')}/{quote(version, safe='')}")


def entry_from_version(
    version: MirrorVersion,
    base: str,
    *,
    name: str | None = None,
    gpu_class: str | None = None,
    engine: str | None = None,
    scaling: dict | None = None,
    description: str | None = None,
) -> dict:
    """A catalog entry (as a model file would hold it) for a present mirror version:
    the engine from the file type, the source, and a memory estimate. Raises
    ValueError, in words, when the version cannot be served as it is."""
    model, ver = version.model, version.version
    if version.state != "present":
        state = version.state or "unknown"
        why = f": {version.reason}" if version.reason else ""
        raise ValueError(f"{model}/{ver} is {state}{why}; only a version that is present can be served")
    # A file that does not say its state is present; one that says null is not.
    files = [f for f in version.files or () if (f.state if "state" in f.model_fields_set else "present") == "present"]
    weights = [f for f in files if f.name.lower().endswith(_WEIGHT_SUFFIXES)]
    if not weights:
        raise ValueError(f"{model}/{ver} holds no model weights (no .gguf, .safetensors or .bin file)")
    ggufs = [f for f in weights if f.name.lower().endswith(".gguf")]
    if engine is None:
        engine = "llamacpp" if ggufs else "vllm"
    if engine != "llamacpp" and gpu_class is None:
        raise ValueError(
            f"{model}/{ver} holds safetensors weights, which {engine} serves on GPUs: "
            "give the GPU class (e.g. --gpu-class h100-80g)"
        )
    root = f"{base.rstrip('/')}/{quote(model, safe='')}/{quote(ver, safe='')}/"
    # One file: its own URL; several (a shard set, or weights with their config): the version.
    source = root + quote(files[0].name, safe="") if len(files) == 1 else root
    size = sum(f.bytes or 0 for f in weights)
    profile: dict[str, Any] = {"engine": engine}
    if gpu_class:
        profile["gpu_class"] = gpu_class
    if size:
        profile["min_memory_gb"] = round(size / GiB * MEMORY_FACTOR + MEMORY_OVERHEAD_GB, 1)
    entry: dict[str, Any] = {"name": name or model, "source": source, "profiles": [profile]}
    if scaling:
        entry["scaling"] = scaling
    if description:
        entry["description"] = description
    return entry
