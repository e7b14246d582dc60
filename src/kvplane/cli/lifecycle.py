"""What every long-running ``kvplane`` command does around its service: announce, then wait.

``announce`` prints the one JSON ready line (and optionally writes it to a file) once every
listener is bound; tests and scripts wait on that line. ``wait_for_signal`` blocks until SIGTERM
or SIGINT. ``resolve_token`` finds (or generates) the token a service requires and says on
stderr where it is; ``token_option`` and ``no_auth_option`` are the shared flags.
"""

from __future__ import annotations

import json
import signal
import threading
from typing import Any

import typer


def raise_fd_limit(want: int = 65536) -> None:
    """Raise this process's soft RLIMIT_NOFILE towards ``want`` (never past the hard limit).

    A service that runs out of descriptors cannot accept its own clients; a flood of idle
    sockets should meet the connection caps first.
    """
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def wait_for_signal() -> None:
    """Block until SIGTERM or SIGINT."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()


def announce(info: dict[str, object], ready_file: str | None) -> None:
    """Print the ready line (one JSON object) on stdout; also write it to ``ready_file``."""
    line = json.dumps(info)
    typer.echo(line, nl=True)
    if ready_file:
        with open(ready_file, "w", encoding="utf-8") as f:
            f.write(line + "\n")


def no_auth_option(opens: str) -> Any:
    """The ``--no-auth`` flag; its help says exactly what it opens (``opens``)."""
    return typer.Option(False, "--no-auth", help=(
        f"Serve without a token. This opens {opens} to every process and host that can reach "
        "the bound address: with no token anyone can do there whatever a token holder can. "
        "Without this flag a token is required everywhere but /health (from --token, "
        "KVPLANE_TOKEN or the token file; one is generated and written there if none exists)."))


def token_option() -> Any:
    """The ``--token`` option shared by every service."""
    return typer.Option(None, help="Token clients must present (default: KVPLANE_TOKEN, else the "
                        "token file KVPLANE_TOKEN_FILE / $XDG_RUNTIME_DIR/kvplane/token / "
                        "~/.kvplane/token, else a new one written there, mode 0600).")


def admin_token_option() -> Any:
    """The master's ``--admin-token`` option."""
    return typer.Option(None, help="Admin token: unmounts any client's segment, lists any "
                        "tenant's keys, sees segment owners (default: KVPLANE_ADMIN_TOKEN, else "
                        "the file admin-token next to the token file, else a new one written there).")


def resolve_token(token: str | None, no_auth: bool, admin: bool = False) -> str:
    """The (admin) token this service requires ("" with --no-auth); says where it is on stderr.

    Also raises the descriptor limit (every service resolves its token once, at start).
    """
    from kvplane.common.auth import server_token
    from kvplane.common.errors import InvalidArgument

    raise_fd_limit()
    try:
        found = server_token(token, no_auth, admin=admin)
    except InvalidArgument as exc:
        raise typer.BadParameter(str(exc)) from exc
    if not (admin and no_auth):
        typer.echo(f"kvplane: {found.describe('admin token' if admin else 'token')}", err=True)
    return found.token
