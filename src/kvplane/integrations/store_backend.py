"""StoreBackendConfig: how an engine's storage backend (SGLang HiCache, LMCache) reaches kvplane.

Shared by ``kvplane.integrations.sglang`` and ``kvplane.integrations.lmcache``. The key names
are Mooncake's (a config written for the engine's own Mooncake backend carries over; the
spellings real Mooncake's dict setup uses, ``master_server_addr`` and ``rdma_devices``, too),
plus kvplane's ``token``, ``timeout`` and ``key_prefix``. Keys that belong to the engine (SGLang's
``backend_name``/``module_path``/..., LMCache's plugin keys) are passed in ``ignore``; any other
unknown key is an error, so a typo never silently falls back to a default.

Imports neither an engine nor torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvplane.common.config import parse_size
from kvplane.common.errors import InvalidArgument
from kvplane.integrations.device_kv import DeviceStaging, MemRegion, copier_for, device_of
from kvplane.store.client.client import StoreClient
from kvplane.store.config import StoreConfig
from kvplane.transfer import fabric

PROTOCOLS = fabric.NAMES  # kept as asked for; the engine resolves it (transfer/fabric.py)
_ALIASES = {"master": "master_server_address", "master_server_addr": "master_server_address",
            "metadata": "metadata_server"}
# Mooncake keys with no meaning for kvplane, accepted so existing configs load unchanged.
_MOONCAKE_IGNORED = frozenset({"device_name", "rdma_devices", "tenant_id", "enable_ssd_offload",
                               "ssd_offload_path", "check_server", "master_metrics_port",
                               "standalone_storage", "client_server_address",
                               "enable_group_semantics", "ipc_socket_path"})


@dataclass(frozen=True)
class StoreBackendConfig:
    """Settings of a native engine backend.

    Attributes:
        master_server_address: store master RPC ``host:port``.
        metadata_server: transfer-engine metadata: ``P2PHANDSHAKE`` or a backend URL.
        protocol: ``auto`` (shared memory on one host, then NIXL when installed, else TCP),
            ``tcp``, ``shm``, ``nixl``, or Mooncake's ``rdma`` (and its other hardware names):
            NIXL when installed, else TCP with one warning (``kvplane.transfer.fabric``).
        global_segment_size: bytes this engine process contributes to the pool (0: pure client;
            a separate ``kvplane segment`` then holds the pool, which outlives the engine).
        local_buffer_size: staging for the copying (non zero-copy) calls.
        local_hostname: address the engine's transfer engine binds and advertises.
        token: shared token for the master and the data listeners (default: ``KVPLANE_TOKEN``).
        timeout: seconds one store call may take; a slower call counts as a miss.
        key_prefix: namespace put in front of every key (default: the engine's model name).
        device_staging_size: host memory through which a pool in device memory moves (half
            for loads, half for stores; larger batches run in chunks).
    """

    master_server_address: str = "127.0.0.1:50051"
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "auto"
    global_segment_size: int = 0
    local_buffer_size: int = 16 << 20
    local_hostname: str = "127.0.0.1"
    token: str | None = None
    timeout: float = 5.0
    key_prefix: str = ""
    device_staging_size: int = 64 << 20

    def __post_init__(self) -> None:
        object.__setattr__(self, "protocol", fabric.normalise(self.protocol))  # InvalidArgument
        if self.timeout <= 0:
            raise InvalidArgument("timeout must be > 0")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | None,
                     ignore: Iterable[str] = ()) -> StoreBackendConfig:
        """Build from Mooncake/kvplane key names; ``mooncake_<key>`` spells ``<key>`` too.

        Raises:
            InvalidArgument: an unknown key, or a bad size, protocol or number.
        """
        skip = _MOONCAKE_IGNORED | frozenset(ignore)
        fields = {f.name for f in dataclasses.fields(cls)}
        out: dict[str, Any] = {}
        for key, value in (data or {}).items():
            if key in skip:
                continue
            name = key.removeprefix("mooncake_") if key.startswith("mooncake_") else key
            name = _ALIASES.get(name, name)
            if name in skip or (key.startswith("mooncake_") and name not in fields):
                continue
            if name not in fields:
                raise InvalidArgument(f"unknown kvplane backend setting {key!r}; "
                                      f"valid: {sorted(fields)}")
            out[name] = _convert(name, value)
        return cls(**out)

    def store_config(self) -> StoreConfig:
        """The store client configuration (``KVPLANE_TOKEN`` unless ``token`` is set)."""
        return StoreConfig.from_env(
            master=self.master_server_address, metadata=self.metadata_server,
            local_hostname=self.local_hostname, protocol=self.protocol,
            global_segment_size=self.global_segment_size,
            local_buffer_size=self.local_buffer_size, timeout=self.timeout, token=self.token)

    def staging(self, pool: Any, page_bytes: int, client: StoreClient) -> DeviceStaging:
        """Host staging for an engine pool in device memory (``pool``: one contiguous tensor),
        ``device_staging_size`` bytes of ``page_bytes`` slots registered with ``client``.

        Raises:
            InvalidArgument: a staging size that holds no page per half, or a device kvplane
                cannot copy.
        """
        half = self.device_staging_size // 2 // page_bytes if page_bytes > 0 else 0
        if half < 1:
            raise InvalidArgument(f"device_staging_size {self.device_staging_size} B holds no "
                                  f"{page_bytes} B page per half")
        nbytes = int(pool.numel()) * int(pool.element_size())
        region = MemRegion(int(pool.data_ptr()), nbytes, device_of(pool), pool)
        return DeviceStaging(copier_for([region]), client.register_buffer, page_bytes, half, half)

    def open_client(self) -> StoreClient:
        """A connected store client.

        Raises:
            Unavailable, Timeout: the master cannot be reached.
        """
        return StoreClient(self.store_config())


def _convert(name: str, value: Any) -> Any:
    if name in ("global_segment_size", "local_buffer_size", "device_staging_size"):
        return parse_size(value if isinstance(value, int) else str(value))
    if name == "protocol":
        return fabric.normalise(str(value))
    if name == "timeout":
        try:
            return float(value)
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(f"timeout must be a number, got {value!r}") from exc
    if name == "master_server_address":
        return str(value).removeprefix("tcp://")
    return str(value)
