"""`llmgw keys`: API keys, worked on in the store directly.

Working on the store (not through a running server) means keys can be issued
before the server runs, without an endpoint that mints credentials.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import typer

from llmgw.cli.common import err, fail, print_table, resolve_store, when

if TYPE_CHECKING:
    from llmgw.store import Store

# The store (and SQLAlchemy under it) is imported inside the commands: every
# `llmgw` process loads this module, the agent's included, and none but these
# commands needs the store.

T = TypeVar("T")

app = typer.Typer(
    help="Create, list and revoke API keys; set limits; keep conversations and notes; move the store.",
    no_args_is_help=True,
)

STORE_HELP = (
    "Store address (path, postgres:// URL or @file); default: auth.store of --config, else /var/lib/llmgw/llmgw.db."
)
CONFIG_HELP = "server.yaml whose auth.store to use (default /etc/llmgw/server.yaml when it exists)."


def with_store(store: str | None, config: str | None, op: Callable[[Store], Awaitable[T]]) -> T:
    """Open the store (saying which setting chose it when that fails), run op, close."""
    address, chosen_by = resolve_store(store, config)

    from llmgw.store import Store, StoreError

    async def run() -> T:
        try:
            s = await Store.open(address)
        except Exception as exc:
            fail(f"cannot open the store chosen by {chosen_by}: {exc}")
        try:
            return await op(s)
        except (StoreError, LookupError, ValueError) as exc:
            fail(str(exc))
        finally:
            await s.close()

    return asyncio.run(run())


def _parse_duration(flag: str, text: str, allow_never: bool = True) -> timedelta | None:
    if allow_never and text.strip() in ("", "0"):
        return None
    m = re.fullmatch(r"\s*(\d+)\s*(m|h|d|w)\s*", text)
    if not m or int(m.group(1)) == 0:
        never = " (0 never expires)" if allow_never else ""
        fail(f'{flag} "{text}" is not a lifetime; write it like 12h, 30d or 8w{never}')
    n, unit = int(m.group(1)), m.group(2)
    return (
        timedelta(minutes=n)
        if unit == "m"
        else timedelta(hours=n)
        if unit == "h"
        else timedelta(days=n * (7 if unit == "w" else 1))
    )


def _parse_lifetime(text: str) -> timedelta | None:
    return _parse_duration("--expires-in", text)


@app.command("create")
def create(
    name_arg: str = typer.Argument(None, metavar="NAME", help="What the key is for, e.g. 'ci-bot' or 'alice laptop'."),
    name: str = typer.Option(None, "--name", "-n", help="The same as NAME."),
    project: str = typer.Option(
        None, "--project", help="Project (id, path or unique name); may be left out when there is exactly one."
    ),
    for_: str = typer.Option(
        None, "--for", help="The person (id or email) the key is for; without --project, a personal key."
    ),
    band: str = typer.Option(None, "--band", help="Admission band: low, normal or high; empty inherits."),
    expires_in: str = typer.Option("0", "--expires-in", help="Lifetime such as 12h, 30d, 8w; 0 never expires."),
    claim: bool = typer.Option(False, "--claim", help="Print a one-time claim link instead of the secret."),
    claim_ttl: str = typer.Option("7d", "--claim-ttl", help="How long the claim link works, e.g. 48h or 7d."),
    base_url: str = typer.Option(
        "http://localhost:8080", "--base-url", help="The gateway's public address, for the claim link."
    ),
    store: str = typer.Option(None, "--store", help=STORE_HELP),
    config: str = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
) -> None:
    """Create an API key. The secret is printed once, alone on the last line of standard output; only its hash is kept."""
    if name_arg and name and name_arg != name:
        fail("give the key's name once, as NAME or --name")
    key_name = name_arg or name
    if not key_name:
        fail("give the key a name: llmgw keys create NAME")
    lifetime = _parse_lifetime(expires_in)
    ttl = _parse_duration("--claim-ttl", claim_ttl, allow_never=False) if claim else None
    expires = datetime.now(UTC) + lifetime if lifetime else None

    from llmgw.store import Ambiguous, IssuedKey, NotFound, NotMember, StoreError

    async def make(s: Store):
        tree = await s.tree()
        if not tree.projects and not for_ and not claim and band is None:
            # A store without a tree yet: the key is not in one (--project is a label).
            secret, rec = await s.create_key(key_name, project=project, expires_at=expires)
            return IssuedKey(secret, rec, rec.project, None)
        try:
            return await s.issue_key(
                key_name,
                project=project,
                owner=for_,
                band=band,
                expires_at=expires,
                claim=claim,
                **({"claim_ttl": ttl} if ttl else {}),
            )
        except StoreError as exc:
            if project and not isinstance(exc, (NotFound, Ambiguous, NotMember)):
                raise StoreError(f"creating the key in {project}: {exc}") from None
            raise

    issued = with_store(store, config, make)
    rec = issued.key
    if issued.claim_token:
        err.print(f"created key {rec.id} ({rec.name})", highlight=False)
        err.print(f"\nid {rec.id}\nproject {_project_shown(issued.project_path, issued.owner_email)}", highlight=False)
        err.print(f"claim link expires {issued.claim_expires_at:%Y-%m-%d %H:%M} UTC", highlight=False)
        err.print("Send the link. It works once, and the key is shown only to whoever opens it.", highlight=False)
        typer.echo(f"{base_url.rstrip('/')}/claim/{issued.claim_token}")
        return
    err.print(f"created key {rec.id} ({rec.name}); it is shown once, keep it now", highlight=False)
    err.print(f"\nid {rec.id}\nproject {_project_shown(issued.project_path, issued.owner_email)}", highlight=False)
    if rec.expires_at:
        err.print(f"expires {rec.expires_at:%Y-%m-%d %H:%M} UTC", highlight=False)
    typer.echo(issued.secret)


def _project_shown(path: str | None, owner_email: str | None) -> str:
    if path:
        return path
    return f"personal, {owner_email}" if owner_email else "-"


@app.command("list")
def list_(
    project: str = typer.Option(None, "--project", help="Only keys in this project (id, path or unique name)."),
    all_: bool = typer.Option(False, "--all", "-a", help="Include revoked and expired keys."),
    store: str = typer.Option(None, "--store", help=STORE_HELP),
    config: str = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print as JSON."),
) -> None:
    """List API keys: id, name, visible prefix, project, owner, state and when last used. Secrets are never shown."""

    async def read(s: Store):
        tree = await s.tree(people=True)
        proj = await s.find("project", project) if project else None
        return tree, proj, await s.list_keys(include_revoked=True)

    tree, proj, keys = with_store(store, config, read)
    now = datetime.now(UTC)
    rows = []
    for k in keys:
        if proj is not None and k.project_id != proj.id:
            continue
        state = "revoked" if k.revoked_at else ("expired" if k.expires_at and k.expires_at <= now else "active")
        if state != "active" and not all_:
            continue
        owner = tree.users[k.user_id].email if k.user_id in tree.users else (k.user_id or "-")
        if k.project_id in tree.projects:
            where = tree.projects[k.project_id].path
        elif k.user_id and not k.project_id:
            where = "personal"
        else:
            where = k.project or "-"
        rows.append((k.id, k.name, k.prefix + "…", where, owner, state, when(k.last_used_at)))
    if as_json:
        import json

        cols = ("id", "name", "prefix", "project", "owner", "state", "last_used")
        typer.echo(
            json.dumps([dict(zip(cols, (r[0], r[1], r[2].rstrip("…"), *r[3:]), strict=True)) for r in rows], indent=2)
        )
        return
    if not rows:
        more = "" if all_ else " (revoked and expired keys are listed with --all)"
        err.print((f"no keys in {proj.path}" if proj else "no keys") + more, highlight=False)
        return
    print_table(("ID", "NAME", "KEY", "PROJECT", "OWNER", "STATE", "LAST USED"), rows)


@app.command("revoke")
def revoke(
    key: str = typer.Argument(..., metavar="ID|PREFIX", help="The key's id (key-…) or its visible prefix (llmgw-…)."),
    store: str = typer.Option(None, "--store", help=STORE_HELP),
    config: str = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
) -> None:
    """Revoke an API key. A running server refuses it within two seconds."""
    rec = with_store(store, config, lambda s: s.revoke_key(key))
    err.print(f"revoked key {rec.id} ({rec.name}, {rec.prefix}…)", highlight=False)


def _models(text: str | None):
    from llmgw.store.tenancy import UNSET

    if text is None:
        return UNSET
    return [m.strip() for m in text.split(",") if m.strip()]


@app.command("limits")
def limits_(
    scope: str = typer.Option("project", "--scope", help="org, team, project, user or key."),
    id_: str = typer.Option("", "--id", help="Which one: id, path or name (a person's id or email; a key's id)."),
    per_member: bool = typer.Option(
        False, "--per-member", help="A limit for each member there, not one shared by all (org, team, project)."
    ),
    rpm: int = typer.Option(None, "--rpm", help="Requests per minute."),
    tpm: int = typer.Option(None, "--tpm", help="Tokens per minute."),
    budget: float = typer.Option(None, "--budget", help="Spend per period, in whole units (stored as micro-units)."),
    period: str = typer.Option(None, "--period", help="The budget's period: day or month (default month)."),
    models: str = typer.Option(None, "--models", help="Allowed models, comma-separated; empty allows none."),
    band: str = typer.Option(
        None, "--band", help="Admission band (low, normal, high) for an org, team, project or key."
    ),
    clear: bool = typer.Option(False, "--clear", help="Remove every limit of the level."),
    allow_large_budget: bool = typer.Option(
        False,
        "--allow-large-budget",
        help="Accept a budget of a million units or more (refused otherwise, as "
        "that is usually a budget given in micro-units).",
    ),
    store: str = typer.Option(None, "--store", help=STORE_HELP),
    config: str = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
) -> None:
    """Set limits on a level of the tree, a person or a key. Only the flags given are written."""
    given: dict[str, Any] = {}
    for flag, value in (("--rpm", rpm), ("--tpm", tpm), ("--budget", budget)):
        if value is not None and value < 0:
            fail(f"{flag} cannot be negative ({value:g}); give 0 or more")
    if rpm is not None:
        given["rpm"] = rpm
    if tpm is not None:
        given["tpm"] = tpm
    if budget is not None:
        if budget != budget or budget in (float("inf"),):
            fail(f"--budget must be a number of at least 0, not {budget}")
        # Budgets were once given in micro-units; a number that large is almost always that.
        if budget >= 1_000_000 and not allow_large_budget:
            fail(
                f"--budget is in whole units (dollars, euros, credits), not micro-units: {budget:.0f} would allow "
                f"{budget:,.0f} a {period or 'month'}. If you meant {budget / 1_000_000:g}, write --budget "
                f"{budget / 1_000_000:g}; if you really mean {budget:,.0f}, add --allow-large-budget"
            )
        micros = budget * 1_000_000
        if abs(micros - round(micros)) > 1e-6:
            fail(f"--budget {budget:g} is finer than a millionth of a unit; give at most 6 decimals")
        given["budget_micros"] = round(micros)
    if period is not None:
        given["period"] = period
    if models is not None:
        given["models"] = _models(models)
    if band is not None:
        given["band"] = band

    async def apply(s: Store):
        return await s.set_limits(scope, id_ or None, per_member=per_member, clear=clear, **given)

    level, scope_id, _row = with_store(store, config, apply)
    typer.echo(f"limits {'cleared' if clear else 'set'} on {level} {scope_id}")


_KEPT = {
    "threads": (
        "conversations",
        "after the last turn",
        "how many hours a conversation is kept after its last turn",
    ),
    "memory": (
        "notes",
        "after they were last written",
        "how many hours a note is kept after it was last written",
    ),
}


def _retention(
    kind: Literal["threads", "memory"],
    project: str | None,
    retain_hours: int | None,
    off: bool,
    list_: bool,
    store: str | None,
    config: str | None,
) -> None:
    """`keys threads` and `keys memory`: set one project's retention, or list every project's."""
    what, after, needs = _KEPT[kind]
    if list_ or (project is None and retain_hours is None and not off):
        rows = with_store(store, config, lambda s: s.retention_settings())
        if not rows:
            err.print(
                "no project keeps conversations or notes; both are off until turned on for a project", highlight=False
            )
        else:
            shown = [
                (r.project_path, *(f"{h} h" if h else "off" for h in (r.threads_hours, r.memory_hours))) for r in rows
            ]
            print_table(("PROJECT", "CONVERSATIONS", "NOTES"), shown)
        if not list_:
            err.print(
                f"turn {what} on for a project with: llmgw keys {kind} --project PATH --retain-hours N", highlight=False
            )
        return
    if project is None or not project.strip():
        fail(f"say which project keeps its {what}: --project PATH (llmgw org tree shows them)")
    if off and retain_hours is not None:
        fail(f"give --retain-hours N to keep {what}, or --off to stop keeping them; not both")
    if not off and retain_hours is None:
        fail(
            f"{what} are kept only for a set time, so the hours are needed: give --retain-hours N, {needs} (or --off to stop keeping them)"
        )
    if retain_hours is not None and retain_hours < 1:
        fail(f"--retain-hours is a whole number of hours, at least 1, not {retain_hours}; --off stops keeping {what}")

    async def apply(s: Store):
        return await s.set_retention(project, kind, None if off else retain_hours)

    got = with_store(store, config, apply)
    hours = got.threads_hours if kind == "threads" else got.memory_hours
    if hours is None:
        typer.echo(
            f"{what} off for {got.project_path}: none are kept from now on; "
            "those kept so far are removed at the next hourly sweep"
        )
    else:
        typer.echo(f"{what} kept for {got.project_path}: {hours} {'hour' if hours == 1 else 'hours'} {after}")


@app.command("threads")
def threads_(
    project: str = typer.Option(None, "--project", help="The project (path, id or unique name)."),
    retain_hours: int = typer.Option(
        None,
        "--retain-hours",
        help="How many hours a conversation is kept after its last turn (required to turn them on).",
    ),
    off: bool = typer.Option(False, "--off", help="Keep no conversations; those kept go at the next hourly sweep."),
    list_: bool = typer.Option(False, "--list", help="List every project's settings (also without --project)."),
    store: str = typer.Option(None, "--store", help=STORE_HELP),
    config: str = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
) -> None:
    """Keep conversations (x-llmgw-thread) for a project, for a set number of hours after the last turn. Off until turned on."""
    _retention("threads", project, retain_hours, off, list_, store, config)


@app.command("memory")
def memory_(
    project: str = typer.Option(None, "--project", help="The project (path, id or unique name)."),
    retain_hours: int = typer.Option(
        None,
        "--retain-hours",
        help="How many hours a note is kept after it was last written (required to turn them on).",
    ),
    off: bool = typer.Option(False, "--off", help="Keep no notes; those kept go at the next hourly sweep."),
    list_: bool = typer.Option(False, "--list", help="List every project's settings (also without --project)."),
    store: str = typer.Option(None, "--store", help=STORE_HELP),
    config: str = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
) -> None:
    """Keep agents' memory notes for a project, for a set number of hours after each was last written. Off until turned on."""
    _retention("memory", project, retain_hours, off, list_, store, config)


@app.command("move-store")
def move_store(
    from_: str = typer.Option(
        ..., "--from", help="The store to copy (path, postgres:// URL or @file); it is only read."
    ),
    to: str = typer.Option(
        ...,
        "--to",
        help="The store to copy into (path, postgres:// URL or @file): empty, or a new file; migrated first.",
    ),
) -> None:
    """Copy a whole store into an empty one, e.g. SQLite to PostgreSQL; keys keep working. Stop the gateway first."""
    from llmgw.store import StoreError
    from llmgw.store.move import CopiedTable
    from llmgw.store.move import move_store as move

    def copied(t: CopiedTable) -> None:
        err.print(f"copied {t.name}: {t.rows:,} {'row' if t.rows == 1 else 'rows'}", highlight=False)

    try:
        result = asyncio.run(move(from_, to, on_table=copied))
    except StoreError as exc:
        fail(str(exc))
    typer.echo(
        f"moved {result.rows:,} rows in {len(result.tables)} tables from {result.source} to {result.destination}"
    )
    err.print(
        f"{result.source} is as it was. Point auth.store at the new store, then start the gateway.", highlight=False
    )
