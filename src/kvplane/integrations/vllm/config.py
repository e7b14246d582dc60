"""ConnectorConfig: how a vLLM connector reaches kvplane (pure; imports neither vLLM nor torch).

Sources, lowest precedence first: defaults, the JSON file named by ``KVPLANE_CONFIG_PATH``, then
``kv_connector_extra_config``. Mooncake's key names are accepted as they are, so a config written
for vLLM's MooncakeStoreConnector/MooncakeConnector carries over.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvplane.common.config import parse_size
from kvplane.common.errors import InvalidArgument
from kvplane.transfer import fabric

CONFIG_PATH_ENV = "KVPLANE_CONFIG_PATH"
PROTOCOLS = fabric.NAMES  # kept as asked for; the engine resolves it (transfer/fabric.py)
# Mooncake keys that have no meaning here but are accepted so existing configs load unchanged.
_IGNORED = frozenset({"device_name", "mode", "enable_offload", "tenant_id", "mooncake_protocol",
                      "num_workers", "bootstrap_server_address", "load_async", "lookup_async",
                      "enable_lookup", "save_decode_cache", "preferred_segment", "connectors"})


@dataclass(frozen=True)
class ConnectorConfig:
    """Settings shared by KVPlaneStoreConnector and KVPlanePDConnector.

    Attributes:
        master_server_address: store master RPC ``host:port`` (store connector only).
        metadata_server: transfer-engine metadata: ``P2PHANDSHAKE`` or a backend URL.
        protocol: ``auto`` (shared memory on one host, then NIXL when installed, else TCP),
            ``tcp``, ``shm``, ``nixl``, or Mooncake's ``rdma`` (and its other hardware names):
            NIXL when installed, else TCP with one warning (``kvplane.transfer.fabric``).
        global_segment_size: bytes each worker contributes to the pool (0: pure client; use a
            separate ``kvplane segment`` process so cached KV outlives the vLLM instance).
        local_buffer_size: staging for copying calls; zero-copy paths need none.
        local_hostname: address the worker's transfer engine binds and advertises.
        cache_prefix: namespace of every key (default: the model directory's last component).
        timeout: seconds one lookup, load or save may take before it counts as a miss.
        save_queue_size: pending background saves per worker; a save beyond it is dropped.
        token: token for the master and data listeners (None: ``KVPLANE_TOKEN``, else the
            token file, as every kvplane client finds it).
        transfer_timeout: seconds a prefill instance holds blocks for a decode instance (PD).
        device_staging_size: host memory (pinned on CUDA) through which the store connector
            moves KV caches that live in device memory: half for loads (a larger load runs in
            chunks), half for saves in flight (a save that does not fit is dropped).
        layerwise_load: copy loaded KV to device memory layer by layer, each layer waited for
            in ``wait_for_layer_load`` (vLLM then needs PIECEWISE CUDA graphs); else a step's
            loads are in device memory before its forward starts.
    """

    master_server_address: str = "127.0.0.1:50051"
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "auto"
    global_segment_size: int = 0
    local_buffer_size: int = 0
    local_hostname: str = "127.0.0.1"
    cache_prefix: str = ""
    timeout: float = 5.0
    save_queue_size: int = 256
    token: str | None = None
    transfer_timeout: float = 120.0
    device_staging_size: int = 256 << 20
    layerwise_load: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "protocol", fabric.normalise(self.protocol))  # InvalidArgument
        if self.timeout <= 0 or self.transfer_timeout <= 0:
            raise InvalidArgument("timeout and transfer_timeout must be > 0")
        if self.save_queue_size < 1:
            raise InvalidArgument("save_queue_size must be >= 1")
        if self.device_staging_size < 0:
            raise InvalidArgument("device_staging_size must be >= 0")
        if "/" in self.cache_prefix:
            raise InvalidArgument("cache_prefix must not contain '/'")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> ConnectorConfig:
        """Build from a mapping of Mooncake/kvplane names (unknown names raise).

        Raises:
            InvalidArgument: an unknown key, a bad size, protocol or number.
        """
        return cls(**_normalise(data))

    @classmethod
    def from_sources(cls, extra: Mapping[str, Any] | None, env: Mapping[str, str]) -> ConnectorConfig:
        """Defaults < ``$KVPLANE_CONFIG_PATH`` JSON < ``extra`` (kv_connector_extra_config).

        Raises:
            InvalidArgument: unreadable or malformed file, or an invalid value.
        """
        merged: dict[str, Any] = {}
        path = env.get(CONFIG_PATH_ENV, "")
        if path:
            merged.update(_normalise(_read_json(path)))
        merged.update(_normalise(extra or {}))
        return cls(**merged)

    def model_prefix(self, model: str) -> str:
        """The key namespace for ``model`` (``cache_prefix`` wins)."""
        if self.cache_prefix:
            return self.cache_prefix
        return model.rstrip("/").rsplit("/", 1)[-1].replace("@", "_") or "model"


def _read_json(path: str) -> Mapping[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"{CONFIG_PATH_ENV}={path}: {exc}") from exc
    if not isinstance(data, dict):
        raise InvalidArgument(f"{CONFIG_PATH_ENV}={path}: expected a JSON object")
    return data


def _normalise(data: Mapping[str, Any]) -> dict[str, Any]:
    fields = {f.name for f in dataclasses.fields(ConnectorConfig)}
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = {"master": "master_server_address", "metadata": "metadata_server"}.get(key, key)
        if name in _IGNORED:
            continue
        if name not in fields:
            raise InvalidArgument(f"unknown connector setting {key!r}; valid: {sorted(fields)}")
        out[name] = _convert(name, value)
    return out


def _convert(name: str, value: Any) -> Any:
    if name in ("global_segment_size", "local_buffer_size", "device_staging_size"):
        return parse_size(value)
    if name == "layerwise_load":
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("1", "true", "yes", "0", "false", "no"):
            return str(value).lower() in ("1", "true", "yes")
        raise InvalidArgument(f"layerwise_load must be true or false, got {value!r}")
    if name == "protocol":
        return fabric.normalise(str(value))
    if name in ("timeout", "transfer_timeout"):
        try:
            return float(value)
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(f"{name} must be a number, got {value!r}") from exc
    if name == "save_queue_size":
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidArgument(f"save_queue_size must be an integer, got {value!r}")
        return value
    if name == "master_server_address":
        return str(value).removeprefix("tcp://")
    return str(value)


def tp_rank() -> int:
    """This worker's tensor-parallel rank (0 outside a vLLM worker)."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        return int(get_tensor_model_parallel_rank())
    except (ImportError, AssertionError):
        return 0
