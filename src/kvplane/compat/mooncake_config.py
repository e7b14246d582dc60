"""``MooncakeConfig`` (``mooncake.mooncake_config``): a store client's settings from a JSON file
(``MOONCAKE_CONFIG_PATH``) or ``MOONCAKE_*`` environment variables, as Mooncake reads them.

Sizes accept ``"4gb"``, ``"512 MB"``, ``"1.5g"`` or plain integers; booleans ``true/false``,
``1/0``, ``yes/no``, ``on/off``. The protocol is lower-cased; an unknown one only warns (setup
decides). ``rdma`` and the other hardware names are served by NIXL when it is installed, else by
TCP with one warning (``kvplane.transfer.fabric``). Required and non-empty: ``local_hostname``,
``metadata_server``, ``master_server_address``.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_GLOBAL_SEGMENT_SIZE = 3355443200  # 3.125 GiB
DEFAULT_LOCAL_BUFFER_SIZE = 1073741824  # 1 GiB
_SUFFIXES = [("kb", 1 << 10), ("mb", 1 << 20), ("gb", 1 << 30), ("tb", 1 << 40),
             ("k", 1 << 10), ("m", 1 << 20), ("g", 1 << 30), ("t", 1 << 40), ("b", 1)]
_KNOWN = frozenset({"tcp", "rdma", "efa", "nvmeof", "nvlink", "musa", "nvlink_intra", "hip",
                    "barex", "cxl", "ascend", "ub", "ubshmem", "maca", "sunrise_link", "rpc_only",
                    "nixl", "auto", "shm"})
_REQUIRED = ("local_hostname", "metadata_server", "master_server_address")


def _parse_segment_size(value: Any) -> int:
    """Bytes from an int or a size string (ValueError on an empty or unreadable one)."""
    if isinstance(value, int):
        return value
    text = str(value).strip().lower()
    if not text:
        raise ValueError("Invalid segment size: empty string")
    for suffix, unit in _SUFFIXES:
        if text.endswith(suffix):
            number = text[: -len(suffix)].strip()
            if not number:
                raise ValueError(f"Invalid segment size: no number before {suffix!r}")
            return int(float(number) * unit)
    return int(float(text))


def _parse_bool(value: Any) -> bool:
    """A boolean from a bool, a number or a common word (ValueError otherwise)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return bool(value)
    if value is None:
        return False
    text = str(value).strip().lower()
    if text in ("", "false", "0", "no", "off", "disable"):
        return False
    if text in ("true", "1", "yes", "on", "enable"):
        return True
    raise ValueError(f"Invalid boolean value: {value!r}")


@dataclass
class MooncakeConfig:
    """One store client's settings (the fields of Mooncake's config file)."""

    local_hostname: str
    metadata_server: str
    global_segment_size: int
    local_buffer_size: int
    protocol: str
    device_name: str | None
    master_server_address: str
    enable_ssd_offload: bool = False
    ssd_offload_path: str = ""
    tenant_id: str = "default"
    enable_client_http_server: bool = False
    client_http_port: int = 9300

    def __post_init__(self) -> None:
        if not isinstance(self.protocol, str) or not self.protocol.strip():
            raise ValueError(f"Invalid protocol: {self.protocol!r}; e.g. 'tcp' or 'rdma'")
        self.protocol = self.protocol.strip().lower()
        if self.protocol not in _KNOWN:
            logger.warning("Unrecognised protocol %r; passed through unchanged", self.protocol)
        for name in ("global_segment_size", "local_buffer_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"Invalid {name}: {getattr(self, name)}; must be >= 0")
        for name in _REQUIRED:
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"Config field {name!r} must be a non-empty string, got {value!r}")

    @staticmethod
    def from_file(file_path: str) -> MooncakeConfig:
        """Read a JSON config file (ValueError when a required field is missing)."""
        with open(file_path, encoding="utf-8") as f:
            data = json.load(f)
        for name in _REQUIRED:
            if name not in data:
                raise ValueError(f"Missing required config field: {name}")
        return MooncakeConfig(
            local_hostname=data["local_hostname"], metadata_server=data["metadata_server"],
            global_segment_size=_parse_segment_size(
                data.get("global_segment_size", DEFAULT_GLOBAL_SEGMENT_SIZE)),
            local_buffer_size=_parse_segment_size(
                data.get("local_buffer_size", DEFAULT_LOCAL_BUFFER_SIZE)),
            protocol=data.get("protocol", "tcp"), device_name=data.get("device_name", ""),
            master_server_address=data["master_server_address"],
            enable_ssd_offload=_parse_bool(data.get("enable_ssd_offload", False)),
            ssd_offload_path=str(data.get("ssd_offload_path") or ""),
            tenant_id=str(data["tenant_id"]) if data.get("tenant_id") is not None else "default",
            enable_client_http_server=_parse_bool(data.get("enable_client_http_server", False)),
            client_http_port=int(data.get("client_http_port", 9300)))

    @staticmethod
    def load_from_env() -> MooncakeConfig:
        """From ``MOONCAKE_CONFIG_PATH``, else the ``MOONCAKE_*`` variables (``MOONCAKE_MASTER``
        required, ValueError otherwise)."""
        path = os.getenv("MOONCAKE_CONFIG_PATH")
        if path is not None:
            return MooncakeConfig.from_file(path)
        if not os.getenv("MOONCAKE_MASTER"):
            raise ValueError("Neither the environment variable 'MOONCAKE_CONFIG_PATH' nor "
                             "'MOONCAKE_MASTER' is set.")
        env = os.getenv
        return MooncakeConfig(
            local_hostname=env("MOONCAKE_LOCAL_HOSTNAME", "localhost"),
            metadata_server=env("MOONCAKE_TE_META_DATA_SERVER", "P2PHANDSHAKE"),
            global_segment_size=_parse_segment_size(
                env("MOONCAKE_GLOBAL_SEGMENT_SIZE", DEFAULT_GLOBAL_SEGMENT_SIZE)),
            local_buffer_size=_parse_segment_size(
                env("MOONCAKE_LOCAL_BUFFER_SIZE", DEFAULT_LOCAL_BUFFER_SIZE)),
            protocol=env("MOONCAKE_PROTOCOL", "tcp"), device_name=env("MOONCAKE_DEVICE", ""),
            master_server_address=env("MOONCAKE_MASTER", ""),
            enable_ssd_offload=_parse_bool(env("MOONCAKE_OFFLOAD_ENABLED", "false")),
            ssd_offload_path=env("MOONCAKE_OFFLOAD_FILE_STORAGE_PATH", ""),
            tenant_id=env("MOONCAKE_TENANT_ID", "default"),
            enable_client_http_server=_parse_bool(env("MOONCAKE_ENABLE_CLIENT_HTTP_SERVER", "false")),
            client_http_port=int(env("MOONCAKE_CLIENT_HTTP_PORT", "9300")))


__all__ = ["DEFAULT_GLOBAL_SEGMENT_SIZE", "DEFAULT_LOCAL_BUFFER_SIZE", "MooncakeConfig"]
