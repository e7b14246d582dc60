"""How a ``kvplane`` command fails: one line on stderr, exit 2 (usage) or 1 (runtime).

``run`` invokes the typer app and turns whatever escapes a command into one line that says
what is wrong and what to do; the traceback is printed only with ``--debug`` or
``KVPLANE_DEBUG=1``. ``check_ports`` is the pre-flight every server runs before it binds
anything, and ``port_holder`` names the process listening on a port (from /proc, Linux only).
Imports only typer, the stdlib, ``kvplane.common`` and ``kvplane.cli.lifecycle``; no service
module.
"""

from __future__ import annotations

import errno
import os
import re
import socket
import sys
import traceback
from typing import Any, TypedDict

import typer

from kvplane.common import envs
from kvplane.common.errors import KVPlaneError, Timeout, Unauthorized, Unavailable

USAGE = 2
RUNTIME = 1
_state = {"debug": False}


class PortInUse(KVPlaneError):
    """A port a server was told to use is taken (the message names the holder)."""


class StartFailed(KVPlaneError):
    """A command could not start; the message already says what to do."""


def set_debug(on: bool) -> None:
    """Print tracebacks (the root ``--debug`` flag)."""
    _state["debug"] = bool(on)


def debugging() -> bool:
    """True with ``--debug`` or ``KVPLANE_DEBUG`` set to a true value."""
    try:
        return _state["debug"] or bool(envs.get("KVPLANE_DEBUG"))
    except KVPlaneError:  # KVPLANE_DEBUG=maybe: no traceback rather than a second failure
        return False


_ROOT_VALUED = ("--log-level",)  # root options that take a value


def _command(app: Any, argv: list[str]) -> str:
    """``kvplane p2p get`` for ``--debug p2p get NAME --out d``: the (sub)command words only."""
    import typer.main

    words, group, skip = ["kvplane"], typer.main.get_command(app), False
    for arg in argv:
        if skip or arg.startswith("-"):
            skip = arg in _ROOT_VALUED
            continue
        sub = getattr(group, "commands", {}).get(arg)
        if sub is None:
            break
        words.append(arg)
        group = sub
    return " ".join(words)


def run(app: Any, argv: list[str] | None = None) -> int:
    """Run the typer ``app`` on ``argv``; returns the exit code (0, 1, 2 or a command's own)."""
    usage_error, no_args = _click_errors()

    from kvplane.cli.lifecycle import release

    argv = sys.argv[1:] if argv is None else argv
    prog = _command(app, argv)
    try:
        try:
            rv = app(args=argv, prog_name="kvplane", standalone_mode=False)
        except BaseException:
            release(show=debugging())  # a failed start: its held INFO lines are noise
            raise
        release(show=True)
        return rv if isinstance(rv, int) else 0
    except no_args as exc:  # `kvplane` or `kvplane p2p` alone: the help (rich prints it itself)
        text = exc.ctx.get_help()
        if text:
            typer.echo(text)
        return USAGE
    except usage_error as exc:
        _trace()
        sub = exc.ctx.command_path if exc.ctx is not None else prog
        typer.echo(f"{sub}: {_flat(exc.format_message())} (see {sub} --help)", err=True)
        return USAGE
    except typer.Abort:
        typer.echo(f"{prog}: aborted", err=True)
        return RUNTIME
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # every other failure: one line, the traceback only with --debug
        _trace()
        typer.echo(f"{prog}: {describe(exc)}", err=True)
        return RUNTIME


def _click_errors() -> tuple[Any, Any]:
    """(UsageError, NoArgsIsHelpError or ()) of the click that typer uses (Any: which click
    that is, vendored or not, is known only at run time)."""
    try:  # typer >= 0.16 vendors click; older ones use click itself
        from typer._click import exceptions as click_exc
    except ImportError:
        from click import exceptions as click_exc  # type: ignore[no-redef]  # the same module under its own name
    return click_exc.UsageError, getattr(click_exc, "NoArgsIsHelpError", ())


def _trace() -> None:
    if debugging():
        traceback.print_exc()


def _flat(text: object) -> str:
    return " ".join(str(text).split())


def describe(exc: BaseException) -> str:
    """What went wrong and what to do, in one line."""
    if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
        found = re.search(r"\('?([^',]+)'?, (\d+)\)", str(exc))
        if found:
            return in_use(found.group(1), int(found.group(2)), None)
        return f"{_flat(exc)}: another process holds the address; stop it or pick another port"
    if isinstance(exc, Unauthorized):
        return (f"{_flat(exc)}: the peer wants another token; pass the one it uses with --token "
                "or KVPLANE_TOKEN (on its host it is in the token file)")
    if isinstance(exc, (Unavailable, Timeout)):
        return (f"{_flat(exc)}: is that service running and reachable? Start it, or point this "
                "command at the right address")
    if isinstance(exc, FileNotFoundError):
        return f"no such file: {exc.filename}"
    if isinstance(exc, PermissionError):
        return f"permission denied: {exc.filename or _flat(exc)}"
    if isinstance(exc, KVPlaneError):
        return _flat(exc)
    if isinstance(exc, OSError):
        return _flat(exc)
    return (f"internal error: {type(exc).__name__}: {_flat(exc)} "
            "(rerun with --debug for the traceback and report it)")


def in_use(host: str, port: int, option: str | None) -> str:
    """'port 8080 is in use (pid 1234: kvplane serve); pass --metadata-port or stop it'."""
    holder = port_holder(port)
    who = f" (pid {holder[0]}: {holder[1]})" if holder else ""
    fix = f"pass another {option} (0 picks a free one)" if option else "pick another port"
    return f"port {port} on {host} is in use{who}; {fix} or stop it"



class PortRange(TypedDict):
    """typer.Option keywords of a port option (a TypedDict, so ``**PORT`` type-checks)."""

    min: int
    max: int


PORT: PortRange = {"min": 0, "max": 65535}


def check_ports(host: str, ports: dict[str, int | None]) -> None:
    """Fail with one line if any fixed port (option -> port) cannot be bound on ``host``.

    Run before a server binds anything, so a taken port leaves nothing half-started. Port 0
    (any), None and negative ports (off) are skipped.
    """
    _check_host(host)
    seen: dict[int, str] = {}
    for option, port in ports.items():
        if port is None or port <= 0:
            continue
        if port in seen:
            raise typer.BadParameter(f"{option} and {seen[port]} are both {port}",
                                     param_hint=option)
        seen[port] = option
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PortInUse(in_use(host, port, option)) from exc
            if exc.errno == errno.EADDRNOTAVAIL:
                raise typer.BadParameter(f"{host} is not an address of this host",
                                         param_hint="--host") from exc
            if exc.errno == errno.EACCES:
                raise PortInUse(f"port {port} needs root (ports below 1024); pass another "
                                f"{option}") from exc
            raise
        finally:
            sock.close()


def _check_host(host: str) -> None:
    """``--host`` must be an address of this host (bound on port 0 and released at once)."""
    try:
        family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
    except socket.gaierror as exc:
        raise typer.BadParameter(f"cannot resolve {host!r}: {exc.strerror}",
                                 param_hint="--host") from exc
    except OSError as exc:
        if exc.errno == errno.EADDRNOTAVAIL:
            raise typer.BadParameter(f"{host} is not an address of this host",
                                     param_hint="--host") from exc
        raise


def port_holder(port: int) -> tuple[int, str] | None:
    """(pid, command line) of the process listening on TCP ``port`` here, if /proc shows it."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii") as f:
                next(f, None)
                for line in f:
                    cols = line.split()
                    if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(f"socket:[{cols[9]}]")
        except OSError:
            continue
    return _pid_with(inodes) if inodes else None


def _pid_with(inodes: set[str]) -> tuple[int, str] | None:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in fds):
                return int(pid), _cmdline(int(pid))
        except OSError:
            continue
    return None


def _words(args: list[str]) -> list[str]:
    """The subcommand words of a kvplane argv (``p2p publish``, ``serve``), options skipped."""
    words: list[str] = []
    skip = False
    for arg in args:
        if skip or arg.startswith("-"):
            skip = arg in _ROOT_VALUED
            continue
        if not re.fullmatch(r"[a-z][a-z0-9-]*", arg):
            break
        words.append(arg)
        if words[0] not in ("p2p", "bench") or len(words) == 2:
            break
    return words


def _cmdline(pid: int) -> str:
    """The holder's command, shortened to ``kvplane serve`` when it is one of ours."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return "?"
    for i, arg in enumerate(args):
        if arg in ("kvplane.cli.main", "kvplane") or arg.endswith("/kvplane"):
            return " ".join(["kvplane", *_words(args[i + 1:])])
    return " ".join(args)[:80] or "?"
