"""Config helpers: human sizes, host:port parsing, env/mapping loading for frozen dataclasses.

Precedence everywhere: explicit argument > CLI flag > environment > file > default.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping
from typing import Any, TypeVar

from kvplane.common.errors import InvalidArgument

T = TypeVar("T")

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "ki": 1 << 10, "kib": 1 << 10, "mi": 1 << 20, "mib": 1 << 20, "gi": 1 << 30, "gib": 1 << 30,
    "ti": 1 << 40, "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: str | int) -> int:
    """Parse ``4GiB``, ``512MB``, ``1048576`` or ``"4 GB"`` into bytes.

    Raises:
        InvalidArgument: on a malformed size or an unknown unit.
    """
    if isinstance(value, int):
        if value < 0:
            raise InvalidArgument(f"size must be >= 0, got {value}")
        return value
    m = _SIZE_RE.match(str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise InvalidArgument(f"bad size {value!r}: use e.g. 4096, 64KiB, 512MB, 4GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_hostport(value: str, default_port: int | None = None) -> tuple[str, int]:
    """Split ``host:port`` (IPv6 as ``[::1]:port``).

    Raises:
        InvalidArgument: when the port is missing (and no default) or not a number.
    """
    host, sep, port = value.rpartition(":")
    if not sep or "]" in port:
        if default_port is None:
            raise InvalidArgument(f"expected host:port, got {value!r}")
        return value.strip("[]"), default_port
    if not port.isdigit() or not 0 <= int(port) < 65536:
        raise InvalidArgument(f"bad port in {value!r}")
    return host.strip("[]"), int(port)


def from_mapping(cls: type[T], data: Mapping[str, Any]) -> T:
    """Build a dataclass from a mapping, rejecting unknown keys with the list of valid ones."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]  # T is bound to dataclasses at the callers; TypeVar cannot say so
    unknown = set(data) - names
    if unknown:
        raise InvalidArgument(f"unknown config keys {sorted(unknown)}; valid: {sorted(names)}")
    return cls(**data)


def from_json_file(cls: type[T], path: str | os.PathLike[str]) -> T:
    """Load a dataclass from a JSON file (unknown keys are an error)."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise InvalidArgument(f"{path}: expected a JSON object")
    return from_mapping(cls, data)
