"""The single table of every KVPLANE_* environment variable: name, parser, default, doc.

Read values through :func:`get`; nothing else in kvplane reads ``os.environ`` for config.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvplane.common.errors import InvalidArgument


def parse_bool(value: str) -> bool:
    """The one boolean parser: 1/true/yes/on and 0/false/no/off (case-insensitive)."""
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off", ""):
        return False
    raise InvalidArgument(f"not a boolean: {value!r}")


@dataclass(frozen=True)
class EnvVar:
    """One environment variable: its parser, default and one-line doc."""

    name: str
    parse: Callable[[str], Any]
    default: Any
    doc: str


def _names(v: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in v.split(",") if n.strip())


def _size(v: str) -> int:
    from kvplane.common.config import parse_size

    return parse_size(v)


TABLE: dict[str, EnvVar] = {
    e.name: e
    for e in (
        EnvVar("KVPLANE_TOKEN", str, "", "shared token every kvplane service and client must present (wins over the token file)"),
        EnvVar("KVPLANE_TOKEN_FILE", str, "", "token file servers write and local clients read (default $XDG_RUNTIME_DIR/kvplane/token, else ~/.kvplane/token)"),
        EnvVar("KVPLANE_ADMIN_TOKEN", str, "", "admin token of the store master (wins over the admin-token file next to the token file)"),
        EnvVar("KVPLANE_TENANTS_FILE", str, "", "JSON file of tenant tokens the store master accepts: {\"tenants\": {\"NAME\": \"TOKEN\"}}"),
        EnvVar("KVPLANE_HANDSHAKE_TIMEOUT", float, 5.0, "seconds a new connection has to authenticate (first RPC frame, data HELLO, HTTP request headers)"),
        EnvVar("KVPLANE_IDLE_TIMEOUT", float, 300.0, "seconds an authenticated RPC or data connection may stay idle before it is closed"),
        EnvVar("KVPLANE_HTTP_REQUEST_TIMEOUT", float, 30.0, "seconds an HTTP client has to send a request body once its headers arrived"),
        EnvVar("KVPLANE_PREAUTH_FRAME", _size, 64 << 10, "largest frame a listener reads from a peer that has not authenticated yet"),
        EnvVar("KVPLANE_MAX_PREAUTH", int, 64, "unauthenticated connections one listener holds; past it the oldest is closed"),
        EnvVar("KVPLANE_MAX_PREAUTH_PER_PEER", int, 16, "unauthenticated connections one peer address may hold on one listener; past it its oldest is closed"),
        EnvVar("KVPLANE_LOG_LEVEL", str, "INFO", "log level of the kvplane loggers"),
        EnvVar("KVPLANE_LOG_JSON", parse_bool, False, "emit logs as one JSON object per line"),
        EnvVar("KVPLANE_DEBUG", parse_bool, False, "kvplane commands print the traceback of a failure (as --debug)"),
        EnvVar("KVPLANE_TRANSFER_TIMEOUT", float, 30.0, "default transfer timeout in seconds (Mooncake MC_TRANSFER_TIMEOUT)"),
        EnvVar("KVPLANE_CONNECT_TIMEOUT", float, 5.0, "longest a transport connection and its HELLO may take, seconds (within the transfer's deadline; raise it where peers' listener threads are starved of CPU)"),
        EnvVar("KVPLANE_TCP_STREAMS", int, 2, "TCP connections a large batch is striped over, per peer"),
        EnvVar("KVPLANE_SLICE_SIZE", _size, 4 << 20, "largest slice one TCP frame carries"),
        EnvVar("KVPLANE_MAX_FRAME", _size, 256 << 20, "largest payload a TCP listener accepts in one frame"),
        EnvVar("KVPLANE_LOCAL_SOCKETS", parse_bool, True, "TCP clients of a server on the same host (the store master's RPC, a transfer listener) move to its abstract Unix socket after connecting (0: off, for servers and clients; kvplane.common.local)"),
        EnvVar("KVPLANE_MASTER_SPIN", float, 0.0, "seconds the store master busy-polls a client that calls again within that long, one connection at a time (0, the default: never; it costs a core while polling, see docs/benchmarks.md, issue 32)"),
        EnvVar("KVPLANE_TRANSPORTS", _names, ("tcp", "shm", "file", "local"), "transports an engine loads, comma separated registry names (one of them must have a control channel, e.g. tcp)"),
        EnvVar("KVPLANE_NIXL", str, "auto", "whether engines under protocol auto/rdma load the NIXL transport: auto (when installed), on (required), off (never; an explicit protocol nixl still loads it)"),
        EnvVar("KVPLANE_FILE_ROOT", str, "", "directory that file-backed segments must live under"),
        EnvVar("KVPLANE_SEGMENT_POPULATE", parse_bool, True, "Mooncake facade: fault a contributed segment's pages in at setup (0: on first use)"),
        EnvVar("KVPLANE_STORE_CHECKSUM", parse_bool, False, "store clients checksum every put (xxh3-64) and check it on every get"),
        EnvVar("KVPLANE_STORE_LOCATION_CACHE", int, 65536, "keys whose replica a store client remembers, to read them while the master looks them up (0: off)"),
        EnvVar("KVPLANE_STORE_HELD_READS", parse_bool, True, "store gets of keys a lookup confirmed less than half a read lease ago read them without asking the master (0: off)"),
        EnvVar("KVPLANE_STORE_SPARES", parse_bool, True, "store clients put one small object in two round trips, into space the master placed with their last PutEnd (0: off)"),
        EnvVar("KVPLANE_CLUSTER_ID", str, "", "HA store cluster id when an etcd:// master address names none (default kvplane)"),
        EnvVar("KVPLANE_MAX_CONNECTIONS", int, 512, "most inbound data connections one engine serves"),
        EnvVar("KVPLANE_P2P_TRACKER", str, "http://127.0.0.1:8080", "URL of the P2P tracker (the `kvplane metadata` server)"),
        EnvVar("KVPLANE_PG_HEARTBEAT_INTERVAL", float, 0.1, "seconds between collectives heartbeats"),
        EnvVar("KVPLANE_PG_HEARTBEAT_TIMEOUT", float, 1.0, "silence (s) after which a collectives peer counts as failed"),
        EnvVar("KVPLANE_PG_MAX_MESSAGE", _size, 1 << 30, "largest collectives frame payload accepted from a peer"),
        EnvVar("KVPLANE_PG_SHM_BYTES", _size, 1 << 20, "allreduces from this size up go through /dev/shm (0: always the TCP ring)"),
    )
}


def get(name: str) -> Any:
    """The parsed value of ``name`` from the environment, or its default.

    Raises:
        KeyError: for a name not in the table (a typo must fail loudly).
        InvalidArgument: when the value does not parse.
    """
    var = TABLE[name]
    raw = os.environ.get(name)
    if raw is None:
        return var.default
    try:
        return var.parse(raw)
    except (ValueError, InvalidArgument) as exc:
        raise InvalidArgument(f"{name}={raw!r}: {exc}") from exc
