"""How every command that calls the admin API reaches it: the address, and the credential
found without being told.

The credential, in order: --token-file, LLMGW_ADMIN_TOKEN, then the first-start token
files of this machine: data_dir/admin-token of /etc/llmgw/server.yaml (or of
/var/lib/llmgw), and `llmgw up`'s. When several are found and the first is
refused, the next is tried, so a laptop with both an installed server and
`llmgw up` needs no flag. Over https the server is checked against
LLMGW_ADMIN_CA (default /etc/llmgw/pki/ca.pem), and LLMGW_ADMIN_CERT and
LLMGW_ADMIN_KEY present a client certificate.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import typer

from llmgw.cli.common import fail
from llmgw.config.server import ADMIN_TOKEN_FILE, DEFAULT_CONFIG_PATH, DEFAULT_DATA_DIR
from llmgw.files import SecretFileError, read_secret_file
from llmgw.pki import DEFAULT_PKI_DIR

DEFAULT_SERVER = "http://127.0.0.1:9090"
DEFAULT_CA = str(Path(DEFAULT_PKI_DIR) / "ca.pem")

ServerOpt = Annotated[
    str | None,
    typer.Option(
        "--server",
        "--admin",
        envvar="LLMGW_SERVER",
        show_envvar=False,
        help=f"The control plane's admin API (admin_listen); default {DEFAULT_SERVER}.",
    ),
]
TokenFileOpt = Annotated[
    Path | None,
    typer.Option(
        "--token-file",
        help="A file holding an admin token; default: LLMGW_ADMIN_TOKEN, else this machine's data_dir/admin-token.",
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print as JSON.")]


@dataclass
class Admin:
    """One admin API and the credentials to try on it, in order."""

    url: str
    tokens: list[tuple[str, str]] = field(default_factory=list)  # (token, where it came from)
    looked: list[str] = field(default_factory=list)  # what was looked at and why it gave nothing
    verify: ssl.SSLContext | bool = True


def _url(server: str | None) -> str:
    s = (server or DEFAULT_SERVER).strip().rstrip("/")
    if "://" not in s:
        s = "http://" + (f"127.0.0.1{s}" if s.startswith(":") else s)
    return s


def _candidate_files() -> list[Path]:
    files: list[Path] = []
    if Path(DEFAULT_CONFIG_PATH).exists():
        try:
            from llmgw.config import load_server_config

            files.append(Path(load_server_config(DEFAULT_CONFIG_PATH).data_path) / ADMIN_TOKEN_FILE)
        except Exception:
            pass
    files.append(Path(DEFAULT_DATA_DIR) / ADMIN_TOKEN_FILE)
    from llmgw.up.config import default_dir

    files.append(default_dir() / ADMIN_TOKEN_FILE)
    return list(dict.fromkeys(files))


def connect(server: str | None, token_file: Path | None) -> Admin:
    admin = Admin(_url(server))
    if token_file is not None:
        try:
            admin.tokens.append((read_secret_file(token_file), f"--token-file {token_file}"))
        except SecretFileError as exc:
            fail(f"--token-file: {exc}")
    else:
        env = os.environ.get("LLMGW_ADMIN_TOKEN", "").strip()
        if env:
            admin.tokens.append((env, "LLMGW_ADMIN_TOKEN"))
        else:
            for path in _candidate_files():
                try:
                    admin.tokens.append((read_secret_file(path), str(path)))
                except SecretFileError as exc:
                    admin.looked.append(str(exc))
    if admin.url.startswith("https://"):
        ca = os.environ.get("LLMGW_ADMIN_CA") or (DEFAULT_CA if Path(DEFAULT_CA).exists() else None)
        cert, key = os.environ.get("LLMGW_ADMIN_CERT"), os.environ.get("LLMGW_ADMIN_KEY")
        try:
            ctx = ssl.create_default_context(cafile=ca)
            if cert and key:
                ctx.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as exc:
            fail(f"the admin API's TLS files (LLMGW_ADMIN_CA, LLMGW_ADMIN_CERT, LLMGW_ADMIN_KEY): {exc}")
        admin.verify = ctx
    return admin


def admin_call(method: str, admin: Admin, path: str, body: dict | None = None, *, timeout: float = 60.0) -> dict:
    """One call; exits with the server's own sentence when it refuses."""
    from llmgw.admin_api import AdminAPIError, error_message, request

    url = admin.url + path
    attempts: list[tuple[str, str] | None] = list(admin.tokens) or [None]
    r = None
    for cred in attempts:
        try:
            r = request(method, url, cred[0] if cred else None, body, verify=admin.verify, timeout=timeout)
        except AdminAPIError as exc:
            fail(f"{exc}; is llmgw server running, and is --server its admin_listen?")
        if r.status_code != 401:
            break
    assert r is not None
    if not 200 <= r.status_code < 300:
        message = error_message(r)
        if r.status_code == 401:
            tried = ", ".join(where for _, where in admin.tokens)
            message += f" (tried: {tried})" if tried else ""
            if admin.looked:
                message += "; found no token in: " + "; ".join(admin.looked)
        fail(f"{url} answered {r.status_code}: {message}")
    return r.json() if r.content else {}
