"""The admin API of a real `llmgw server` process: only operators reach it, and ctl finds its credential."""

from __future__ import annotations

import os
import subprocess

import httpx
import pytest

from tests.e2e.harness import Gateway, free_port, llmgw_cmd

pytestmark = pytest.mark.e2e


def _ctl(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(llmgw_cmd("ctl", *args), capture_output=True, text=True, timeout=60, env=env)


def test_a_web_page_cannot_drive_the_admin_api_and_ctl_finds_its_token_by_itself(tmp_path):
    # The server keeps its files where `llmgw up` would (XDG_DATA_HOME/llmgw/up), one of the
    # places ctl looks; ctl is given no flag and no variable for the token.
    xdg = tmp_path / "xdg"
    data = xdg / "llmgw" / "up"
    gw = Gateway(
        tmp_path,
        models=[],
        data_dir=str(data),
        agent_listen=f"127.0.0.1:{free_port()}",
        agent_tls=None,
        control={"enabled": True},
    ).wait_up(ready=False)
    env = {k: v for k, v in os.environ.items() if k != "LLMGW_ADMIN_TOKEN"}
    env["XDG_DATA_HOME"] = str(xdg)
    try:
        assert (data / "admin-token").stat().st_mode & 0o777 == 0o600

        # What a page in the operator's browser can send without a preflight: a text/plain POST.
        evil = (
            b'{"model": {"name": "evil", "source": "/x.gguf", "profiles": [{"engine": "llamacpp", '
            b'"env": {"LD_PRELOAD": "/tmp/evil.so"}}]}, "source_check": false}'
        )
        r = httpx.post(
            gw.admin + "/api/v1/models",
            content=evil,
            headers={"Content-Type": "text/plain", "Origin": "http://evil.example"},
        )
        assert r.status_code == 403, r.text
        # A rebinding page: the browser thinks it talks to evil.example, so that is the Host it sends.
        r = httpx.get(gw.admin + "/api/v1/models", headers={"Host": "evil.example"})
        assert r.status_code == 421, r.text
        r = httpx.get(gw.admin + "/api/v1/models")
        assert r.status_code == 401 and "llmgw ctl token create" in r.json()["error"]["message"]

        listing = _ctl(env, "models", "--json", "--server", gw.admin)
        assert listing.returncode == 0, listing.stderr
        assert "evil" not in listing.stdout

        # Nothing to find: the refusal says how to get a credential.
        bare = {**env, "XDG_DATA_HOME": str(tmp_path / "empty")}
        r = _ctl(bare, "models", "--server", gw.admin)
        assert r.returncode == 1 and "401" in r.stderr and "llmgw ctl token create" in r.stderr, r.stderr

        # Another token, made in the store, passed as a variable; revoked, it stops working.
        made = subprocess.run(
            llmgw_cmd("ctl", "token", "create", "ci", "--config", str(gw.config)),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert made.returncode == 0, made.stderr
        secret = made.stdout.strip().splitlines()[-1]
        assert secret.startswith("llmgw-admin-")
        r = _ctl({**bare, "LLMGW_ADMIN_TOKEN": secret}, "models", "--server", gw.admin)
        assert r.returncode == 0, r.stderr
        listed = subprocess.run(
            llmgw_cmd("ctl", "token", "list", "--json", "--config", str(gw.config)),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert listed.returncode == 0 and '"name": "ci"' in listed.stdout and secret not in listed.stdout
        gone = subprocess.run(
            llmgw_cmd("ctl", "token", "revoke", secret[:16], "--config", str(gw.config)),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert gone.returncode == 0, gone.stderr
        r = _ctl({**bare, "LLMGW_ADMIN_TOKEN": secret}, "models", "--server", gw.admin)
        assert r.returncode == 1 and "401" in r.stderr
        assert secret not in gw.text()
    finally:
        gw.stop()
