"""What every long-running ``kvplane`` command does around its service: announce, then wait.

``announce`` prints the one JSON ready line (and optionally writes it to a file) once every
listener is bound; tests and scripts wait on that line. Every server's line has the same shape:
``{"service": NAME, "pid": PID, ...its addresses}``. Until then the command's informational
log lines and notes (where the token is) are held: a start that fails prints only its one-line
error (cli/errors.py), a start that succeeds prints them before the ready line.
``wait_for_signal`` blocks until SIGTERM or SIGINT. ``resolve_token`` finds (or generates) the
token a service requires and notes where it is; ``token_option``, ``no_auth_option`` and
``size_option`` are the shared flags (sizes are parsed and checked while options are parsed,
before anything binds).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

import typer

from kvplane.common.errors import InvalidArgument


class _Hold(logging.Filter):
    """Keeps INFO-and-below records (and notes) back until the command is ready or done."""

    def __init__(self) -> None:
        super().__init__()
        self.holding = False
        self.records: list[logging.LogRecord] = []
        self.notes: list[str] = []
        self.lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        with self.lock:
            if self.holding and record.levelno < logging.WARNING:
                self.records.append(record)
                return False
        return True


_hold = _Hold()


def hold_logs() -> None:
    """A server starts: hold its INFO log lines and notes until ``announce`` (or ``release``).

    Called by ``resolve_token`` (every service resolves its token first); tools that print
    as they go (simulate, bench) never hold.
    """
    with _hold.lock:
        _hold.holding = True
    for handler in logging.getLogger("kvplane").handlers:
        if _hold not in handler.filters:
            handler.addFilter(_hold)


def note(line: str) -> None:
    """A line for a person on stderr, printed once the command is ready (dropped on failure)."""
    with _hold.lock:
        if _hold.holding:
            _hold.notes.append(line)
            return
    typer.echo(line, err=True)


def release(show: bool) -> None:
    """Stop holding: print what was held (``show``) or drop it (a failed start)."""
    with _hold.lock:
        if not _hold.holding:
            return
        _hold.holding = False
        records, _hold.records = _hold.records, []
        notes, _hold.notes = _hold.notes, []
    if not show:
        return
    for line in notes:
        typer.echo(line, err=True)
    for record in records:
        logging.getLogger(record.name).handle(record)


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


_stop = threading.Event()


def _catch_signals() -> None:
    """From now on SIGTERM and SIGINT end ``wait_for_signal`` (set before the ready line, so a
    signal sent as soon as it is read still stops the service cleanly)."""
    signal.signal(signal.SIGTERM, lambda *_: _stop.set())
    signal.signal(signal.SIGINT, lambda *_: _stop.set())


def wait_for_signal() -> None:
    """Block until SIGTERM or SIGINT."""
    _catch_signals()
    _stop.wait()


def announce(service: str, info: dict[str, object], ready_file: str | None,
             signals: bool = True) -> None:
    """Print the ready line ``{"service": service, "pid": ..., **info}`` on stdout (after the
    held notes and log lines); also write it to ``ready_file``. With ``signals`` SIGTERM and
    SIGINT are caught first, for ``wait_for_signal`` (servers that handle them themselves, like
    uvicorn's, pass False)."""
    if signals:
        _catch_signals()
    release(show=True)
    line = json.dumps({"service": service, "pid": os.getpid(), **info})
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

    Also raises the descriptor limit and starts holding the start-up lines (every service
    resolves its token once, at start).
    """
    from kvplane.common.auth import server_token
    from kvplane.common.errors import InvalidArgument

    raise_fd_limit()
    hold_logs()
    try:
        found = server_token(token, no_auth, admin=admin)
    except InvalidArgument as exc:
        raise typer.BadParameter(str(exc)) from exc
    if not (admin and no_auth):
        note(f"kvplane: {found.describe('admin token' if admin else 'token')}")
    return found.token


def human(n: float) -> str:
    """``n`` bytes for a person: ``512 B``, ``1.5 KiB`` ... ``23.4 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def memory_room() -> tuple[int, str] | None:
    """The most a new shared-memory segment can take on this host now, and what limits it:
    MemAvailable, or the free space of /dev/shm when that is smaller (None: neither known)."""
    room: list[tuple[int, str]] = []
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            kib = next((int(ln.split()[1]) for ln in f if ln.startswith("MemAvailable:")), None)
        if kib is not None:
            room.append((kib * 1024, "of memory available (MemAvailable)"))
    except (OSError, ValueError):
        pass
    try:
        st = os.statvfs("/dev/shm")
        room.append((st.f_bavail * st.f_frsize, "free in /dev/shm (in Docker: --shm-size)"))
    except OSError:
        pass
    return min(room) if room else None


def _sizes(minimum: int, memory: bool) -> Any:
    def parse(value: Any) -> int:
        from kvplane.common.config import parse_size

        if isinstance(value, int):
            size = value
        else:
            try:
                size = parse_size(value)
            except InvalidArgument as exc:
                raise typer.BadParameter(str(exc)) from exc
        if size < minimum:
            raise typer.BadParameter(f"{value!r} is {size} bytes; it must be at least {minimum}")
        room = memory_room() if memory else None
        if room is not None and size > room[0]:
            raise typer.BadParameter(f"{value} ({human(size)}) is more than this host can give a "
                                     f"segment now: {human(room[0])} {room[1]}; pass a smaller size")
        return size

    return parse


def size_option(default: str, *names: str, help: str, minimum: int = 1,
                memory: bool = False) -> Any:
    """A size option (``4GiB``, ``512MB``, ``4096``) parsed to bytes while options are parsed;
    below ``minimum`` bytes (default 1) it is a usage error, and so is a ``memory`` size (a
    shared-memory segment) larger than the host can give now (:func:`memory_room`)."""
    return typer.Option(default, *names, help=help, parser=_sizes(minimum, memory),
                        metavar="SIZE")


@contextlib.contextmanager
def usage_checked(option: str | None = None) -> Iterator[None]:
    """Turn an InvalidArgument raised while building a config from flags into a usage error."""
    try:
        yield
    except InvalidArgument as exc:
        raise typer.BadParameter(str(exc), param_hint=option) from exc


def store_client(config: Any, master_option: str = "--master") -> Any:
    """A StoreClient for a command, or one line saying why the master would not take it.

    The client releases everything it took when it fails (shared memory, listener, threads).
    """
    from kvplane.cli.errors import StartFailed
    from kvplane.common.errors import Timeout, Unauthorized, Unavailable
    from kvplane.common.rpc import NotRpcPeer
    from kvplane.store.client.client import StoreClient

    try:
        return StoreClient(config)
    except Unauthorized as exc:
        raise StartFailed(f"the master at {config.master} refused this token ({exc}); pass its "
                          "token with --token or KVPLANE_TOKEN (on its host: the token file)") from exc
    except NotRpcPeer as exc:
        raise StartFailed(f"{master_option} {config.master} is not a master: {exc}"
                          f"{_listener(config.master)}; pass the master's RPC address with "
                          f"{master_option}") from exc
    except (Unavailable, Timeout) as exc:
        if "rpc " not in str(exc):
            raise
        raise StartFailed(f"cannot reach the master at {config.master} "
                          f"({_unreached(config.master, exc)}); start it (kvplane master or "
                          f"kvplane serve) or pass its address with {master_option}") from exc


def _listener(address: str) -> str:
    """``" (pid 1234 listens there: kvplane serve)"`` for a local ``HOST:PORT``, else ""."""
    from kvplane.cli.errors import port_holder
    from kvplane.common.config import parse_hostport

    try:
        _, port = parse_hostport(address)
    except InvalidArgument:
        return ""
    holder = port_holder(port)
    return f" (pid {holder[0]} listens there: {holder[1]})" if holder else ""


def _unreached(address: str, exc: Exception) -> str:
    """Why a master at ``address`` did not answer, naming what listens on its port."""
    text = str(exc)
    if "Connection refused" in text:
        return "nothing listens on that port: connection refused"
    return text.rsplit(": ", 1)[-1] + _listener(address)
