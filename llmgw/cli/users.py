"""`llmgw users`: people, their accounts and memberships, in the store directly."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

from llmgw.cli.common import err, fail, print_table
from llmgw.cli.keys import CONFIG_HELP, STORE_HELP, with_store

if TYPE_CHECKING:  # the store is imported by with_store, when a command runs
    from llmgw.store import Store

app = typer.Typer(
    help="People: accounts, sign-ups waiting for approval, memberships in the tree, suspension.",
    no_args_is_help=True,
)


def _where(org: str | None, team: str | None, project: str | None) -> tuple[str, str]:
    given = [(k, v) for k, v in (("org", org), ("team", team), ("project", project)) if v]
    if len(given) != 1:
        fail("give exactly one of --org, --team or --project")
    return given[0]


@app.command("create")
def create(
    email: str = typer.Argument(..., help="The person's email; it is how they sign in."),
    password: str = typer.Option(None, "--password", help="Their password (asked for when left out)."),
    name: str = typer.Option(None, "--name", help="Their name, as pages show it."),
    store: str = typer.Option(None, "--store", help=STORE_HELP),
    config: str = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
) -> None:
    """Create an account; prints its id (usr-…)."""
    if password is None:
        password = typer.prompt("Password", hide_input=True, confirmation_prompt=True)
    user = with_store(store, config, lambda s: s.create_user(email, password, name=name))
    err.print(f"created {user.email}")
    typer.echo(user.id)


@app.command("list")
def list_(
    pending: bool = typer.Option(False, "--pending", help="Only sign-ups waiting for approval."),
    store: str = typer.Option(None, "--store", help=STORE_HELP),
    config: str = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print as JSON."),
) -> None:
    """List people: ID EMAIL STATE ADMIN MEMBER OF SIGNED UP (STATE: active, suspended or pending)."""

    async def read(s: Store):
        return await s.tree(people=True)

    tree = with_store(store, config, read)
    people = [u for u in tree.users.values() if not pending or u.state == "pending"]
    if as_json:
        import json

        typer.echo(
            json.dumps(
                [
                    {
                        "id": u.id,
                        "email": u.email,
                        "name": u.name,
                        "state": u.state,
                        "admin": u.admin,
                        "created_at": u.created_at.isoformat(),
                        "member_of": [
                            {"scope": m.scope, "id": m.scope_id, "role": m.role}
                            for m in tree.memberships
                            if m.user_id == u.id
                        ],
                    }
                    for u in people
                ],
                indent=2,
            )
        )
        return
    if not people:
        if pending:
            err.print("no sign-ups are waiting for approval")
        else:
            err.print("no people yet; `llmgw users create EMAIL` adds one")
        return
    from llmgw.store.tenancy import describe_memberships

    print_table(
        ("ID", "EMAIL", "STATE", "ADMIN", "MEMBER OF", "SIGNED UP"),
        [
            (
                u.id,
                u.email,
                u.state,
                "yes" if u.admin else "-",
                describe_memberships(tree, [m for m in tree.memberships if m.user_id == u.id]) or "on their own",
                f"{u.created_at:%Y-%m-%d}",
            )
            for u in people
        ],
    )


@app.command("join")
def join(
    user: str = typer.Argument(..., help="The person: id or email."),
    org: str = typer.Option(None, "--org", help="An organization (every project in it)."),
    team: str = typer.Option(None, "--team", help="A team: ORG/TEAM, id or unique name (every project in it)."),
    project: str = typer.Option(None, "--project", help="A project: ORG/TEAM/PROJECT, id or unique name."),
    role: str = typer.Option("member", "--role", help="member, or manager (organizations only)."),
    store: str = typer.Option(None, "--store", help=STORE_HELP),
    config: str = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
) -> None:
    """Make a person a member of an organization, team or project."""
    kind, ref = _where(org, team, project)
    person, m, path = with_store(store, config, lambda s: s.join(user, kind, ref, role))
    typer.echo(f"{person.email} is a {m.role} of {path}")


@app.command("leave")
def leave(
    user: str = typer.Argument(..., help="The person: id or email."),
    org: str = typer.Option(None, "--org", help="An organization."),
    team: str = typer.Option(None, "--team", help="A team."),
    project: str = typer.Option(None, "--project", help="A project."),
    store: str = typer.Option(None, "--store", help=STORE_HELP),
    config: str = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
) -> None:
    """End a membership; keys made in projects no other membership reaches are revoked."""
    kind, ref = _where(org, team, project)

    async def op(s: Store):
        person = await s.find_user(user)
        path, revoked = await s.leave(user, kind, ref)
        return person, path, revoked

    person, path, revoked = with_store(store, config, op)
    typer.echo(f"{person.email} left {path}")
    for k in revoked:
        err.print(f"revoked key {k.id} ({k.name}, {k.project or '-'})")


@app.command("approve")
def approve(
    user: str = typer.Argument(..., help="The sign-up: id or email."),
    project: str = typer.Option(None, "--project", help="Also make them a member of this project (optional)."),
    store: str = typer.Option(None, "--store", help=STORE_HELP),
    config: str = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
) -> None:
    """Approve a sign-up waiting for approval: the account becomes active and can sign in."""

    async def op(s: Store):
        person = await s.approve(user, project=project)
        return person, (await s.find("project", project)).path if project is not None else None

    person, path = with_store(store, config, op)
    typer.echo(f"{person.email} is approved" + (f" and a member of {path}" if path else ""))


@app.command("reject")
def reject(
    user: str = typer.Argument(..., help="The sign-up: id or email."),
    store: str = typer.Option(None, "--store", help=STORE_HELP),
    config: str = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
) -> None:
    """Reject a sign-up waiting for approval: it is removed (the email may sign up again)."""
    person = with_store(store, config, lambda s: s.reject(user))
    typer.echo(f"rejected the sign-up of {person.email} ({person.id})")


def _state(user: str, state: str, store: str | None, config: str | None) -> None:
    person = with_store(store, config, lambda s: s.set_user_state(user, state))
    typer.echo(f"{person.email} is {state}")


@app.command("suspend")
def suspend(
    user: str = typer.Argument(..., help="The person: id or email."),
    store: str = typer.Option(None, "--store", help=STORE_HELP),
    config: str = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
) -> None:
    """Suspend an account: signs them out; sign-in and their keys stop working until reinstated."""
    _state(user, "suspended", store, config)


@app.command("reinstate")
def reinstate(
    user: str = typer.Argument(..., help="The person: id or email."),
    store: str = typer.Option(None, "--store", help=STORE_HELP),
    config: str = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
) -> None:
    """Reinstate a suspended account."""
    _state(user, "active", store, config)


@app.command("delete")
def delete(
    user: str = typer.Argument(..., help="The person: id or email."),
    yes: bool = typer.Option(False, "--yes", help="Confirm: the account goes and their keys are revoked."),
    store: str = typer.Option(None, "--store", help=STORE_HELP),
    config: str = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
) -> None:
    """Delete an account: signs them out and revokes their keys. Usage history keeps their id."""
    if not yes:
        fail(f"deleting {user} revokes their keys; add --yes to do it")
    person, revoked = with_store(store, config, lambda s: s.delete_user(user))
    typer.echo(f"deleted {person.email} ({person.id}); {len(revoked)} key(s) revoked")


@app.command("promote")
def promote(
    user: str = typer.Argument(..., help="The person: id or email."),
    store: str = typer.Option(None, "--store", help=STORE_HELP),
    config: str = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
) -> None:
    """Make a person an administrator (the /admin pages)."""
    person = with_store(store, config, lambda s: s.promote(user))
    typer.echo(f"{person.email} is an administrator")
