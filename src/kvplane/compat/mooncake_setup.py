"""``MooncakeDistributedStore.setup``: Mooncake's two overloads, read into one ``SetupArgs``.

* positional: ``setup(local_hostname, metadata_server, global_segment_size, local_buffer_size,
  protocol, rdma_devices, master_server_addr, engine=None, enable_ssd_offload=False,
  ssd_offload_path="", tenant_id="default", enable_client_http_server=False,
  client_http_port=9300)``; the first seven are required, an unknown keyword is a TypeError;
* dict: ``setup({"local_hostname": ..., "metadata_server": ..., ...})``; every value is read as
  its ``str()`` (Mooncake does the same), sizes may be human readable ("16MB", "1.5 GB").
  ``master_server_address`` and ``device_name`` (the spellings LMCache and older kvplane used)
  are read as ``master_server_addr`` and ``rdma_devices``. An unknown key is a TypeError naming
  it (Mooncake ignores it silently, which once cost an LMCache user a 90 s setup against the
  wrong master).

Then ``open_client`` builds the native ``StoreClient``; if that fails nothing is left behind
(the client releases its engine, sockets, threads and shared memory before raising).

Imports ``kvplane.store`` and ``kvplane.transfer.fabric`` only.
"""

from __future__ import annotations

import errno
import inspect
import logging
import os
import random
import re
import shutil
from dataclasses import dataclass, replace
from typing import Any

from kvplane.common import envs
from kvplane.store.client.client import StoreClient
from kvplane.store.config import StoreConfig
from kvplane.transfer import fabric

log = logging.getLogger(__name__)

MIN_SEGMENT_SIZE = 1024
CLIENT_PORTS = (12300, 14300)  # Mooncake's MC_STORE_CLIENT_MIN/MAX_PORT defaults
PORT_TRIES = 20
MAX_SEGMENT_SIZE = 1 << 40
DEFAULT_SIZE = 16 << 20


@dataclass
class SetupArgs:
    """One setup call, normalised."""

    local_hostname: str
    metadata_server: str
    global_segment_size: int = DEFAULT_SIZE
    local_buffer_size: int = DEFAULT_SIZE
    protocol: str = "tcp"
    rdma_devices: str = ""
    master_server_addr: str = "127.0.0.1:50051"
    engine: Any = None
    enable_ssd_offload: bool = False
    ssd_offload_path: str = ""
    tenant_id: str = "default"
    enable_client_http_server: bool = False
    client_http_port: int = 9300
    ipc_socket_path: str = ""


def _positional(local_hostname: str, metadata_server: str, global_segment_size: int,
                local_buffer_size: int, protocol: str, rdma_devices: str,
                master_server_addr: str, engine: Any = None, enable_ssd_offload: bool = False,
                ssd_offload_path: str = "", tenant_id: str = "default",
                enable_client_http_server: bool = False, client_http_port: int = 9300) -> None:
    """The positional overload's signature (bound, never called)."""


_SIGNATURE = inspect.signature(_positional)
_DICT_KEYS = {f for f in SetupArgs.__dataclass_fields__ if f != "engine"}
_ALIASES = {"master_server_address": "master_server_addr", "device_name": "rdma_devices"}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "G": 1 << 30, "GB": 1 << 30, "T": 1 << 40, "TB": 1 << 40}


def byte_size(value: Any) -> int | None:
    """Mooncake's size reading: an int, or "<number>[ ][K|KB|M|MB|G|GB|T|TB|B]" (case-free).
    None when it cannot be read (e.g. "50%")."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    m = _SIZE.match(str(value))
    if not m or m.group(2).upper() not in _UNITS:
        return None
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def _bool(value: Any) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def parse(args: tuple[Any, ...], kwargs: dict[str, Any]) -> SetupArgs | int:
    """SetupArgs from either overload, or INVALID_PARAMS (-600) for a value Mooncake refuses.

    Raises:
        TypeError: arguments that fit neither overload (missing, unknown, too many).
    """
    if (len(args) == 1 and not kwargs and isinstance(args[0], dict)) or \
            (not args and set(kwargs) == {"config"} and isinstance(kwargs["config"], dict)):
        return _from_dict(args[0] if args else kwargs["config"])
    bound = _SIGNATURE.bind(*args, **kwargs)  # TypeError on a mismatch, as pybind11 raises
    bound.apply_defaults()
    out = SetupArgs(**bound.arguments)
    for name in ("local_hostname", "metadata_server", "protocol", "rdma_devices",
                 "master_server_addr", "ssd_offload_path", "tenant_id"):
        if not isinstance(getattr(out, name), str):
            raise TypeError(f"setup(): {name} must be a str, got {getattr(out, name)!r}")
    for name in ("global_segment_size", "local_buffer_size"):
        size = getattr(out, name)
        if isinstance(size, str):  # kvplane extension: "4GiB"-style strings also read here
            parsed = byte_size(size)
            if parsed is None:
                return -600
            setattr(out, name, parsed)
        elif isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise TypeError(f"setup(): {name} must be an unsigned int, got {size!r}")
    return _checked(out)


def _from_dict(config: dict[Any, Any]) -> SetupArgs | int:
    values: dict[str, str] = {}
    for key, value in config.items():
        name = _ALIASES.get(str(key), str(key))
        if name not in _DICT_KEYS:
            raise TypeError(f"setup(): unknown config key {key!r}; known: {sorted(_DICT_KEYS)}")
        values[name] = str(value)
    if not values.get("local_hostname") or not values.get("metadata_server"):
        log.error("setup: local_hostname and metadata_server are required")
        return -600
    sizes = {k: byte_size(values.get(k, DEFAULT_SIZE))
             for k in ("global_segment_size", "local_buffer_size")}
    if None in sizes.values():
        log.error("setup: unreadable size in %s", {k: values.get(k) for k in sizes})
        return -600
    try:
        port = int(values.get("client_http_port", "9300"))
    except ValueError:
        return -600
    out = SetupArgs(
        values["local_hostname"], values["metadata_server"],
        sizes["global_segment_size"] or 0, sizes["local_buffer_size"] or 0,
        values.get("protocol", "tcp"), values.get("rdma_devices", ""),
        values.get("master_server_addr", "127.0.0.1:50051"),
        enable_ssd_offload=_bool(values.get("enable_ssd_offload", "")),
        ssd_offload_path=values.get("ssd_offload_path", ""),
        tenant_id=values.get("tenant_id", "default"),
        enable_client_http_server=_bool(values.get("enable_client_http_server", "")),
        client_http_port=port, ipc_socket_path=values.get("ipc_socket_path", ""))
    return _checked(out)


def _checked(out: SetupArgs) -> SetupArgs | int:
    if not out.local_hostname:
        return -600
    if out.global_segment_size and out.global_segment_size < MIN_SEGMENT_SIZE:
        return -600
    if (out.local_buffer_size and out.local_buffer_size < MIN_SEGMENT_SIZE) or \
            out.local_buffer_size > MAX_SEGMENT_SIZE:
        return -600
    if not out.tenant_id:
        return -600
    return out


def protocol_of(name: str) -> str:
    """The protocol a Mooncake protocol name asks kvplane's engine for: "" and "shm" read as
    ``auto``; ``rdma`` and the other hardware names stay as they are, and the engine resolves
    them (``kvplane.transfer.fabric``: NIXL when installed, else TCP with one warning).

    Raises:
        InvalidArgument: a protocol kvplane does not know.
    """
    proto = name.strip().lower()
    return "auto" if proto in ("", "shm") else fabric.normalise(proto)


def hostname_of(local_hostname: str) -> tuple[str, int]:
    """(host, port) of Mooncake's ``local_hostname`` ("host", "host:port", "[v6]:port");
    port 0 when none is given (then a free one is bound, as Mooncake picks one)."""
    text = local_hostname.strip()
    if text.startswith("[") and "]" in text:
        host, _, rest = text[1:].partition("]")
        port = rest.removeprefix(":")
    elif text.count(":") == 1:
        host, port = text.split(":")
    else:
        host, port = text, ""
    return host, int(port) if port.isdigit() and int(port) < 65536 else 0


def _ssd_offload(args: SetupArgs) -> dict[str, Any]:
    """``enable_ssd_offload`` + ``ssd_offload_path``: this client's segment gets an SSD tier
    there (docs/store.md, "SSD tier"), its quota Mooncake's 2 TB default capped at 90 % of the
    file system's free space."""
    if not args.enable_ssd_offload:
        return {}
    if not args.ssd_offload_path or args.global_segment_size <= 0:
        log.warning("setup: enable_ssd_offload needs ssd_offload_path and a segment; ignored")
        return {}
    os.makedirs(args.ssd_offload_path, exist_ok=True)
    free = shutil.disk_usage(args.ssd_offload_path).free
    return {"disk_dir": args.ssd_offload_path, "disk_size": max(1, min(2 << 40, free * 9 // 10))}


def open_client(args: SetupArgs, **overrides: Any) -> StoreClient:
    """A native StoreClient for ``args``.

    Raises:
        KVPlaneError, OSError: the client could not start (nothing it made is left running).
    """
    overrides = {**_ssd_offload(args), **overrides}
    if args.enable_client_http_server:
        log.warning("setup: the client HTTP server is not served; client_http_port ignored")
    host, port = hostname_of(args.local_hostname)
    cfg = StoreConfig.from_env(
        master=args.master_server_addr.removeprefix("tcp://"), metadata=args.metadata_server,
        local_hostname=host, port=port, protocol=protocol_of(args.protocol),
        global_segment_size=args.global_segment_size,
        local_buffer_size=args.local_buffer_size,
        populate=envs.get("KVPLANE_SEGMENT_POPULATE"), **overrides)
    if port:
        try:
            return StoreClient(cfg)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
        # Mooncake's transfer engine never binds the port named in local_hostname (it takes a
        # free one for its RPC service: transfer_engine_impl.cpp, "new RPC mapping"), so a
        # second client on a taken host:port sets up there. kvplane's segment is named by the
        # port it listens on: another one from Mooncake's client range, named by get_hostname()
        log.warning("setup: %s is in use; this client takes another port (get_hostname() "
                    "names it)", args.local_hostname)
    rng = random.Random()
    for attempt in range(PORT_TRIES):  # Mooncake names an unported client host:<12300-14300>
        try:
            return StoreClient(replace(cfg, port=rng.randint(*CLIENT_PORTS)))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or attempt == PORT_TRIES - 1:
                raise
    raise AssertionError("unreachable")
