"""``kvplane token``: print the token local clients present, for tools that are not kvplane
(``curl -H "Authorization: Bearer $(kvplane token)"``), or with ``--path`` where it is."""

from __future__ import annotations

import typer


def token(
    path: bool = typer.Option(False, "--path", help="Print the token file's path instead."),
    admin: bool = typer.Option(False, "--admin", help="The master's admin token instead "
                               "(KVPLANE_ADMIN_TOKEN, else admin-token next to the token file)."),
) -> None:
    """Print the token clients on this host present: KVPLANE_TOKEN, else the token file
    (KVPLANE_TOKEN_FILE, else $XDG_RUNTIME_DIR/kvplane/token, else ~/.kvplane/token), which
    every kvplane service writes when it starts without one. Exit 1 when there is none yet."""
    from kvplane.cli.errors import StartFailed
    from kvplane.common import envs
    from kvplane.common.auth import admin_token_file, read_token_file, token_file

    where = admin_token_file() if admin else token_file()
    if path:
        typer.echo(where)
        return
    found = str(envs.get("KVPLANE_ADMIN_TOKEN" if admin else "KVPLANE_TOKEN")) or read_token_file(where)
    if not found:
        raise StartFailed(f"no {'admin ' if admin else ''}token yet: {where} does not exist and "
                          f"{'KVPLANE_ADMIN_TOKEN' if admin else 'KVPLANE_TOKEN'} is not set; start "
                          "a service (kvplane serve writes it) or set the variable")
    typer.echo(found)


def register(app: typer.Typer) -> None:
    """Add ``token`` to the ``kvplane`` app."""
    app.command("token")(token)
