"""Tokens and principals: where a token comes from, and who a presented token is.

Secure by default: a service started without ``--token`` (and without ``--no-auth``) uses
``KVPLANE_TOKEN``, else the token file, else generates a token and writes it to the token file
(mode 0600, in a 0700 directory), as Jupyter does. Local clients find the token the same way
(:func:`client_token`), so on one host nothing needs configuring. The token file is
``KVPLANE_TOKEN_FILE``, else ``$XDG_RUNTIME_DIR/kvplane/token``, else ``~/.kvplane/token``.

A :class:`Principal` is what a presented token proves: a tenant name and whether it is the admin.
Services compare tokens in constant time (``hmac.compare_digest``).

Imports only ``kvplane.common``.
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat
from collections.abc import Callable
from dataclasses import dataclass

from kvplane.common import envs
from kvplane.common.errors import InvalidArgument

DEFAULT_TENANT = "default"


@dataclass(frozen=True)
class Principal:
    """Who a connection authenticated as.

    Attributes:
        tenant: key namespace of the caller (the admin token is tenant ``default``).
        admin: the admin token: may list every tenant and unmount any segment.
    """

    tenant: str = DEFAULT_TENANT
    admin: bool = False


ADMIN = Principal(DEFAULT_TENANT, admin=True)
Authenticator = Callable[[str], "Principal | None"]


def token_authenticator(token: str) -> Authenticator:
    """The authenticator of a single shared token: its holder is the admin.

    An empty ``token`` means no authentication (``--no-auth``): everyone is the admin.
    """
    if not token:
        return lambda _given: ADMIN
    want = token.encode()

    def check(given: str) -> Principal | None:
        return ADMIN if hmac.compare_digest(given.encode(), want) else None
    return check


class TokenTable:
    """The tokens one service accepts: service token, admin token and tenant tokens.

    * the service token (``--token``): tenant ``default``, not admin;
    * the admin token: tenant ``default`` with admin rights;
    * a tenant token: that tenant.

    With no service token (``--no-auth``) every caller is the admin, except that a tenant token
    still selects its tenant. Comparisons are constant-time; a token is resolved once per
    connection by the servers, so the linear scan over tenants is not on the data path.

    Args:
        token: the service token ("" = no authentication).
        admin_token: the admin token ("" = the service token has no admin twin).
        tenants: tenant name -> token.

    Raises:
        InvalidArgument: two roles share a token.
    """

    def __init__(self, token: str, admin_token: str = "",
                 tenants: dict[str, str] | None = None) -> None:
        self.token, self.admin_token = token, admin_token
        self.tenants = dict(tenants or {})
        values = [v for v in (token, admin_token, *self.tenants.values()) if v]
        if len(set(values)) != len(values):
            raise InvalidArgument("the service, admin and tenant tokens must all differ")
        self._rows = [(v.encode(), p) for v, p in (
            (admin_token, ADMIN), (token, Principal(DEFAULT_TENANT)),
            *((t, Principal(n)) for n, t in self.tenants.items())) if v]

    def __call__(self, given: str) -> Principal | None:
        raw = given.encode()
        found = None
        for want, principal in self._rows:  # no early exit: same work for every token
            if hmac.compare_digest(raw, want) and found is None:
                found = principal
        if found is None and not self.token:
            return ADMIN
        return found

    def accepted(self) -> tuple[str, ...]:
        """Every token that authenticates (for data listeners that only check membership)."""
        return tuple(v.decode() for v, _ in self._rows)


def token_file() -> str:
    """Path of the token file (see the module docstring)."""
    path = envs.get("KVPLANE_TOKEN_FILE")
    if path:
        return str(path)
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "kvplane", "token")
    return os.path.join(os.path.expanduser("~"), ".kvplane", "token")


def read_token_file(path: str | None = None) -> str:
    """The token in the token file, or "" when there is none.

    Raises:
        InvalidArgument: the file is readable by group or others (it would leak the token).
    """
    path = path or token_file()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except (FileNotFoundError, NotADirectoryError):
        return ""
    except OSError as exc:
        raise InvalidArgument(f"cannot read token file {path}: {exc}") from exc
    with os.fdopen(fd, encoding="utf-8") as f:
        if stat.S_IMODE(os.fstat(f.fileno()).st_mode) & 0o077:
            raise InvalidArgument(f"token file {path} is readable by others: chmod 600 it")
        return f.read(4096).strip()


def admin_token_file() -> str:
    """Path of the admin token file: ``admin-token`` next to the token file."""
    return os.path.join(os.path.dirname(token_file()), "admin-token")


def client_token() -> str:
    """The token a client presents by default: ``KVPLANE_TOKEN``, else the token file, else ""."""
    return str(envs.get("KVPLANE_TOKEN")) or read_token_file()


def client_admin_token() -> str:
    """The admin token for local tools: ``KVPLANE_ADMIN_TOKEN``, else its file, else ""."""
    return str(envs.get("KVPLANE_ADMIN_TOKEN")) or read_token_file(admin_token_file())


@dataclass(frozen=True)
class ServerToken:
    """The token a service requires, and where it came from.

    Attributes:
        token: "" only with ``--no-auth``.
        source: ``flag``, ``env``, ``file``, ``generated`` or ``none``.
        path: the token file when the token came from (or was written to) it.
    """

    token: str
    source: str
    path: str = ""

    def describe(self, what: str = "token") -> str:
        """One line for the service's banner (never the token itself)."""
        if self.source == "none":
            return "no token: --no-auth, every port is open to anyone who can reach it"
        if self.source in ("file", "generated"):
            verb = "generated and written to" if self.source == "generated" else "read from"
            return f"{what} {verb} {self.path} (local clients read it there)"
        return f"{what} from {'the command line' if self.source == 'flag' else 'the environment'}"


def server_token(explicit: str | None, no_auth: bool = False, admin: bool = False) -> ServerToken:
    """Resolve a service's token: ``--token``, ``KVPLANE_TOKEN``, the file, else a new one.

    With ``admin`` the same for the admin token (``--admin-token``, ``KVPLANE_ADMIN_TOKEN``,
    the admin token file).

    Raises:
        InvalidArgument: ``--token`` together with ``--no-auth``, or an unsafe token file.
    """
    if no_auth:
        if explicit:
            raise InvalidArgument("--token/--admin-token and --no-auth contradict each other")
        return ServerToken("", "none")
    if explicit:
        return ServerToken(explicit, "flag")
    env = str(envs.get("KVPLANE_ADMIN_TOKEN" if admin else "KVPLANE_TOKEN"))
    if env:
        return ServerToken(env, "env")
    path = admin_token_file() if admin else token_file()
    found = read_token_file(path)
    if found:
        return ServerToken(found, "file", path)
    return ServerToken(_write_new(path), "generated", path)


def _write_new(path: str) -> str:
    """Create the token file with a fresh token (0600), atomically; a concurrent creator wins."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    token = secrets.token_urlsafe(32)
    tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(token + "\n")
        os.link(tmp, path)  # fails if another process created it first
    except FileExistsError:
        return read_token_file(path)
    finally:
        os.unlink(tmp)
    return token


def token_headers(admin: bool = False) -> dict[str, str]:
    """``X-KVPlane-Token`` with the local token (the admin token with ``admin``), or {}.

    For local tools (``kvplane bench``, tests) that call a service's HTTP API as its operator.
    """
    token = client_admin_token() if admin else client_token()
    return {"X-KVPlane-Token": token} if token else {}
