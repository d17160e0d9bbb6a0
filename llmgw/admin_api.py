"""One call to a control plane's admin API, its reply read as a protocol.admin shape, errors raised.

The commands that drive a control plane from code (`server init`'s node and
model steps, `node add`'s wait for the node) use this; `llmgw ctl` wraps the
same call with its search for a credential and exits with the sentence.
"""

from __future__ import annotations

import ssl
from typing import TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from llmgw.errors import LlmgwError

Reply = TypeVar("Reply", bound=BaseModel)


class AdminAPIError(LlmgwError):
    """The admin API did not answer, or refused; ``status`` is its HTTP status (None: no answer)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def error_message(r: httpx.Response) -> str:
    """The server's own sentence from its error shape, or the start of what it sent."""
    try:
        return str(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return r.text[:200]


def request(
    method: str,
    url: str,
    token: str | None,
    body: dict | None = None,
    *,
    verify: ssl.SSLContext | bool = True,
    timeout: float = 60.0,
) -> httpx.Response:
    """The HTTP exchange; AdminAPIError when nothing answered."""
    if body is None and method in ("POST", "PUT", "PATCH"):
        body = {}  # the admin API refuses writes that are not JSON, even empty ones
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        # trust_env off: the admin API is on this machine or the fleet's network, never behind a proxy.
        return httpx.request(method, url, headers=headers, json=body, timeout=timeout, verify=verify, trust_env=False)
    except httpx.HTTPError as exc:
        raise AdminAPIError(f"cannot reach the control plane's admin API at {url}: {exc}") from None


class AdminAPI:
    """An admin API at ``url`` with one token."""

    def __init__(self, url: str, token: str | None, *, verify: ssl.SSLContext | bool = True) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.verify = verify

    def call(self, method: str, path: str, shape: type[Reply], body: BaseModel | None = None) -> Reply:
        sent = None if body is None else body.model_dump(mode="json", exclude_unset=True, exclude_none=True)
        r = request(method, self.url + path, self.token, sent, verify=self.verify)
        if not 200 <= r.status_code < 300:
            raise AdminAPIError(f"{self.url}{path} answered {r.status_code}: {error_message(r)}", r.status_code)
        try:
            return shape.model_validate(r.json() if r.content else {})
        except (ValueError, ValidationError) as exc:
            raise AdminAPIError(f"{self.url}{path} answered in a shape this llmgw does not read ({exc})") from None
