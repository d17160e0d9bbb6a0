"""`llmgw server init --postgres` from the frozen binary on a booted Debian machine without internet.

The machine becomes a control plane on SQLite first, with an API key that answers `/v1/models`. Then
`--postgres` installs PostgreSQL with apt-get from the packages the machine root holds in apt's cache
(scripts/build-test-machine-root) and moves the store, twice failing on the way as an operator's machine
can: the SQLite store held open by another process (the move is refused, nothing changes), and a
drop-in that keeps the gateway from reading the DSN file (it does not start on PostgreSQL, so server.yaml
goes back and the gateway runs on SQLite again, the copy removed). The third run moves it: PostgreSQL
tuned and running, the DSN file 0600 and owned by llmgw, server.yaml's comments kept with the old file
beside it, the gateway on PostgreSQL with the key made before still valid. A rerun changes nothing, and
`--postgres` with server.yaml naming another PostgreSQL server is refused.
"""

from __future__ import annotations

import re

import httpx
import pytest
from harness import BUILD_TIMEOUT

from llmgw.testing.waiting import until

INIT = "llmgw server init --admin admin@example.com --plain --no-mirror --no-node --no-model"
DSN = "/etc/llmgw/secrets/store-dsn"
NOTE = "# kept: a note from the operator"
# The build may happen in this test's setup; then four init runs, one waiting out the health timeout (60 s).
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(BUILD_TIMEOUT + 900)]


def _steps(out: str) -> dict[int, str]:
    return {int(m.group(1)): line for line in out.splitlines() if (m := re.match(r"(\d+)\. ", line))}


def test_server_init_postgres_installs_postgresql_offline_moves_the_store_and_goes_back_to_sqlite_on_failure(
    frozen_llmgw, machines
):
    (m,) = machines.boot("cp")
    machines.copy_in("cp", frozen_llmgw, "/usr/local/bin/llmgw")
    machines.ssh("cp", "chmod 0755 /usr/local/bin/llmgw")

    def sh(cmd: str, **kw) -> str:
        return machines.ssh("cp", cmd, **kw).stdout.strip()

    def journal() -> str:
        return sh("journalctl -u llmgw-server --no-pager -n 40", check=False)

    def init(extra: str = "") -> tuple[int, str]:
        r = machines.ssh("cp", f"{INIT} {extra}", check=False, timeout=600)
        return r.exit_status, r.stdout + r.stderr

    def sql(query: str, db: str = "postgres") -> str:
        return sh(f'runuser -u postgres -- env -C / psql -X -A -t -d {db} -c "{query}"')

    def models_status(key: str) -> int:
        return httpx.get(
            f"http://{m.address}:8080/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=5
        ).status_code

    def answers(key: str, what: str) -> None:
        until(lambda: models_status(key) == 200, 60.0, what, ignore=(httpx.HTTPError,))

    rc, out = init()
    assert rc == 0, f"{out}\n{journal()}"
    sh(f"sed -i '1i {NOTE}' /etc/llmgw/server.yaml")  # a comment the text edit must keep
    sqlite_yaml = sh("cat /etc/llmgw/server.yaml")
    key = sh("llmgw keys create before-the-move").splitlines()[-1]
    answers(key, "the key made on SQLite to answer /v1/models")
    assert machines.ssh("cp", "command -v pg_lsclusters", check=False).exit_status != 0  # no PostgreSQL yet

    # 1. The store is held open by another process (a backup script, an sqlite3 shell): the move is refused.
    holder = sh(
        "nohup python3 -c \"import pathlib, signal, sqlite3; c = sqlite3.connect('/var/lib/llmgw/llmgw.db'); "
        "c.execute('SELECT count(*) FROM sqlite_master').fetchall(); pathlib.Path('/run/holder.open').touch(); "
        'signal.pause()" >/dev/null 2>&1 & echo $!'
    )
    until(lambda: machines.ssh("cp", "test -e /run/holder.open", check=False).exit_status == 0, 30.0, "the holder")
    rc, out = init("--postgres")
    assert rc != 0, out
    assert "moving the store /var/lib/llmgw/llmgw.db to PostgreSQL failed (llmgw-server.service stopped" in out, out
    assert f"is open in another process (pid {holder})" in out, out
    assert "server.yaml was not changed and the gateway runs on SQLite again" in out, out
    assert "installed PostgreSQL 15 (cluster 15/main) with apt-get; tuned it" in _steps(out)[5], out
    assert sh("cat /etc/llmgw/server.yaml") == sqlite_yaml
    assert machines.ssh("cp", "test -e /etc/llmgw/server.yaml.before-postgres", check=False).exit_status != 0
    assert sh("systemctl is-active llmgw-server", check=False) == "active", journal()
    answers(key, "the key, on SQLite again after the refused move")
    sh(f"kill {holder}")

    # PostgreSQL is there from that run, installed from apt's cache, running and tuned (init installed it).
    assert re.search(r"^15\s+main\s+5432\s+online", sh("pg_lsclusters --no-header"), re.M)
    assert sql("SHOW shared_buffers") == "96MB" and sql("SHOW max_connections") == "40"

    # 2. A drop-in keeps the gateway from reading the DSN file: it does not start on PostgreSQL.
    sh(
        "mkdir -p /etc/systemd/system/llmgw-server.service.d && printf '[Service]\\nInaccessiblePaths=/etc/llmgw/secrets\\n'"
        " > /etc/systemd/system/llmgw-server.service.d/hide-secrets.conf && systemctl daemon-reload"
    )
    rc, out = init("--postgres")
    assert rc != 0, out
    six = _steps(out)[6]
    assert six.startswith("6. FAILED: store to PostgreSQL: the gateway did not start on PostgreSQL"), out
    assert "server.yaml is back as it was" in six and "the gateway runs on SQLite again" in six, out
    assert "the copy in PostgreSQL was removed again" in six, out
    assert sh("cat /etc/llmgw/server.yaml") == sqlite_yaml
    assert sh("systemctl is-active llmgw-server", check=False) == "active", journal()
    answers(key, "the key, on SQLite again after the gateway did not start on PostgreSQL")
    assert sql("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'", db="llmgw") == "0"
    sh("rm -r /etc/systemd/system/llmgw-server.service.d && systemctl daemon-reload")

    # 3. Nothing in the way: the store moves.
    rc, out = init("--postgres")
    assert rc == 0, f"{out}\n{journal()}"
    steps = _steps(out)
    assert "found PostgreSQL 15 (cluster 15/main), which init installed and tuned" in steps[5], out
    assert "moved the store /var/lib/llmgw/llmgw.db into PostgreSQL" in steps[6], out
    assert "llmgw-server.service restarted on PostgreSQL" in steps[6], out
    assert sh(f"stat -c '%a %U' {DSN} /etc/llmgw/secrets") == "600 llmgw\n700 llmgw"
    written = re.fullmatch(r"postgres://llmgw:([A-Za-z0-9_-]{24,})@127\.0\.0\.1:5432/llmgw", sh(f"cat {DSN}"))
    assert written and written.group(1) not in out  # the password is in the file only
    pg_yaml = sh("cat /etc/llmgw/server.yaml")
    assert NOTE in pg_yaml and "# Written by `llmgw server init`" in pg_yaml
    assert [b for a, b in zip(sqlite_yaml.splitlines(), pg_yaml.splitlines(), strict=True) if a != b] == [
        f'  store: "@{DSN}"'
    ]
    assert sh("cat /etc/llmgw/server.yaml.before-postgres") == sqlite_yaml
    assert sh("systemctl is-active llmgw-server", check=False) == "active", journal()
    assert int(sql("SELECT count(*) FROM pg_stat_activity WHERE usename = 'llmgw'")) >= 1  # the gateway's pool
    answers(key, "the key made on SQLite, now on PostgreSQL")
    assert models_status("sk-not-a-key") == 401
    later = sh("llmgw keys create after-the-move").splitlines()[-1]  # the CLI follows server.yaml to PostgreSQL
    answers(later, "a key made on PostgreSQL")
    assert sql("SELECT count(*) FROM api_keys", db="llmgw") == "2"

    # A rerun changes nothing: no file rewritten, neither server restarted.
    files = f"/etc/llmgw/server.yaml {DSN} /etc/llmgw/server.yaml.before-postgres /etc/llmgw/postgres-installed"
    stamps = sh(f"stat -c '%n %Y %i' {files}")
    pids = sh("systemctl show -p MainPID --value llmgw-server postgresql@15-main")
    rc, again = init("--postgres")
    assert rc == 0 and "done: nothing changed." in again, again
    assert "server.yaml's store is PostgreSQL" in _steps(again)[6], again
    assert sh(f"stat -c '%n %Y %i' {files}") == stamps
    assert sh("systemctl show -p MainPID --value llmgw-server postgresql@15-main") == pids

    # Another PostgreSQL server in server.yaml: refused before anything is touched.
    sh("cp /etc/llmgw/server.yaml /root/server.yaml")
    sh(f"sed -i 's|store: \"@{DSN}\"|store: postgres://app:secret@db.example:5432/llmgw|' /etc/llmgw/server.yaml")
    rc, out = init("--postgres")
    assert rc != 0 and "5. FAILED: PostgreSQL: the store is already PostgreSQL at postgres://app:***@db.example" in out
    assert "llmgw keys move-store" in out and "secret" not in out, out
    sh("cp /root/server.yaml /etc/llmgw/server.yaml")
    assert sh("systemctl show -p MainPID --value llmgw-server postgresql@15-main") == pids
