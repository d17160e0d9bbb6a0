"""`llmgw org`: the tenancy tree (organizations > teams > projects), in the store directly."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.markup import escape
from rich.tree import Tree as RichTree

from llmgw.cli.common import err, fail
from llmgw.cli.keys import CONFIG_HELP, STORE_HELP, with_store

if TYPE_CHECKING:  # the store is imported by with_store, when a command runs
    from llmgw.store import Store, Tree

app = typer.Typer(
    help="Organizations, teams and projects: the tree keys, people and limits hang on.", no_args_is_help=True
)
add_app = typer.Typer(help="Add an organization, a team or a project.", no_args_is_help=True)
app.add_typer(add_app, name="add")

_KINDS = {"org": "org", "organization": "org", "team": "team", "project": "project"}
_WORDS = {"org": "organization", "team": "team", "project": "project"}


def _kind(kind: str) -> str:
    if kind not in _KINDS:
        fail(f'KIND is org, team or project, not "{kind}"')
    return _KINDS[kind]


def _members(tree: Tree, scope: str, scope_id: str) -> str:
    people = [
        (tree.users[m.user_id].email, m.role)
        for m in tree.memberships
        if m.scope == scope and m.scope_id == scope_id and m.user_id in tree.users
    ]
    if not people:
        return ""
    return (
        "  [dim]" + escape(", ".join(e + (" (manager)" if r == "manager" else "") for e, r in sorted(people))) + "[/]"
    )


def render_tree(tree: Tree, people: bool) -> RichTree:
    root = RichTree("[bold]organizations[/]", guide_style="dim")
    for org in tree.orgs.values():
        o = root.add(f"{escape(org.name)}  [dim]{org.id}[/]" + (_members(tree, "org", org.id) if people else ""))
        for team in (t for t in tree.teams.values() if t.org_id == org.id):
            t = o.add(f"{escape(team.name)}  [dim]{team.id}[/]" + (_members(tree, "team", team.id) if people else ""))
            for proj in (p for p in tree.projects.values() if p.team_id == team.id):
                t.add(
                    f"{escape(proj.name)}  [dim]{proj.id}[/]" + (_members(tree, "project", proj.id) if people else "")
                )
    return root


@app.command("tree")
def tree_(
    people: bool = typer.Option(False, "--people", help="Show who is a member where."),
    store: str = typer.Option(None, "--store", help=STORE_HELP),
    config: str = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print as JSON: organizations with their teams and projects."),
) -> None:
    """Show the tree with ids."""
    tree = with_store(store, config, lambda s: s.tree(people=people))
    if as_json:
        import json

        def members(scope: str, sid: str) -> dict:
            if not people:
                return {}
            return {
                "members": [
                    {
                        "user": m.user_id,
                        "email": tree.users[m.user_id].email if m.user_id in tree.users else None,
                        "role": m.role,
                    }
                    for m in tree.memberships
                    if m.scope == scope and m.scope_id == sid
                ]
            }

        typer.echo(
            json.dumps(
                [
                    {
                        "id": o.id,
                        "name": o.name,
                        **members("org", o.id),
                        "teams": [
                            {
                                "id": t.id,
                                "name": t.name,
                                **members("team", t.id),
                                "projects": [
                                    {"id": p.id, "name": p.name, "path": p.path, **members("project", p.id)}
                                    for p in tree.projects.values()
                                    if p.team_id == t.id
                                ],
                            }
                            for t in tree.teams.values()
                            if t.org_id == o.id
                        ],
                    }
                    for o in tree.orgs.values()
                ],
                indent=2,
            )
        )
        return
    if not tree.orgs:
        err.print("no organizations yet; start with `llmgw org add org NAME`")
        return
    Console(highlight=False, width=200).print(render_tree(tree, people))


def _add(kind: str, name: str, parent: str | None, store: str | None, config: str | None) -> None:
    node = with_store(store, config, lambda s: s.add(kind, name, parent))
    typer.echo(f"added {_WORDS[kind]} {node.path} ({node.id})")


@add_app.command("org")
def add_org(
    name: str = typer.Argument(..., help="The organization's name."),
    store: str = typer.Option(None, "--store", help=STORE_HELP),
    config: str = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
) -> None:
    """Add an organization."""
    _add("org", name, None, store, config)


@add_app.command("team")
def add_team(
    name: str = typer.Argument(..., help="The team's name."),
    in_: str = typer.Option(..., "--in", help="The organization (id or name)."),
    store: str = typer.Option(None, "--store", help=STORE_HELP),
    config: str = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
) -> None:
    """Add a team to an organization."""
    _add("team", name, in_, store, config)


@add_app.command("project")
def add_project(
    name: str = typer.Argument(..., help="The project's name."),
    in_: str = typer.Option(..., "--in", help="The team: ORG/TEAM, its id, or a unique team name."),
    store: str = typer.Option(None, "--store", help=STORE_HELP),
    config: str = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
) -> None:
    """Add a project to a team."""
    _add("project", name, in_, store, config)


@app.command("rename")
def rename(
    kind: str = typer.Argument(..., help="org, team or project."),
    path: str = typer.Argument(..., help="What to rename: id, path or unique name."),
    new_name: str = typer.Argument(..., metavar="NEWNAME", help="The new name."),
    store: str = typer.Option(None, "--store", help=STORE_HELP),
    config: str = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
) -> None:
    """Rename an organization, team or project; its id, keys and limits stay."""
    k = _kind(kind)
    node = with_store(store, config, lambda s: s.rename(k, path, new_name))
    typer.echo(f"renamed to {node.path} ({node.id})")


@app.command("move")
def move(
    kind: str = typer.Argument(..., help="team or project."),
    path: str = typer.Argument(..., help="What to move: id, path or unique name."),
    to: str = typer.Option(..., "--to", help="The new parent: an organization for a team, ORG/TEAM for a project."),
    store: str = typer.Option(None, "--store", help=STORE_HELP),
    config: str = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
) -> None:
    """Move a team to another organization or a project to another team."""
    k = _kind(kind)
    node = with_store(store, config, lambda s: s.move(k, path, to))
    typer.echo(f"moved to {node.path} ({node.id})")


@app.command("remove")
def remove(
    kind: str = typer.Argument(..., help="org, team or project."),
    path: str = typer.Argument(..., help="What to remove: id, path or unique name."),
    store: str = typer.Option(None, "--store", help=STORE_HELP),
    config: str = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
) -> None:
    """Remove an organization, team or project, only when nothing is in it. A project that ever had a key is never removed."""
    k = _kind(kind)

    async def op(s: Store):
        return await s.remove(k, path)

    node = with_store(store, config, op)
    typer.echo(f"removed {node.path} ({node.id})")
