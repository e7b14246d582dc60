"""Mooncake's store value types and integer codes, as ``mooncake.store`` exposes them.

Owns: the ErrorCode values the facade returns, ``code_of`` (kvplane exception -> Mooncake code:
the only place the mapping lives), the enums (``SoftPinAction``, ``ReplicaStatus``, ``TaskType``,
``TaskStatus``, ``ObjectDataType``), ``ReplicateConfig`` with Mooncake's fields, types and
validation, replica descriptors, ``BufferHandle``, ``QueryTaskResponse``,
``MooncakeHostMemAllocator`` and ``bind_to_numa_node``.

Imports only ``kvplane.common`` and ``kvplane.store`` types; never a socket or a thread.
"""

from __future__ import annotations

import ctypes
import enum
import functools
import logging
import mmap
import os
import threading
from typing import Any

from kvplane.common.errors import (
    Conflict,
    InvalidArgument,
    KVPlaneError,
    NoSpace,
    NotFound,
    Timeout,
    Unavailable,
)
from kvplane.store.errors import ChecksumMismatch
from kvplane.store.types import ReplicateConfig as NativeConfig

log = logging.getLogger(__name__)

# Mooncake ErrorCode values (mooncake-store/include/types.h)
OK = 0
INTERNAL_ERROR = -1
BUFFER_OVERFLOW = -10
SEGMENT_NOT_FOUND = -101
NO_AVAILABLE_HANDLE = -200
INVALID_KEY = -400
INVALID_PARAMS = -600
REPLICA_IS_NOT_READY = -703
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
OBJECT_HAS_LEASE = -706
LEASE_EXPIRED = -707
REPLICA_NOT_FOUND = -710
REPLICA_ALREADY_EXISTS = -711
TRANSFER_FAIL = -800
CHECKSUM_MISMATCH = -801
RPC_FAIL = -900
RPC_TIMEOUT = -901
NOT_SUPPORTED = -1012
TASK_NOT_FOUND = -1400
TASK_PENDING_LIMIT_EXCEEDED = -1401
DFS_SERVICE_UNAVAILABLE = -1601

MAX_SOFT_PIN_TTL_MS = 24 * 3600 * 1000  # Mooncake's max_kv_soft_pin_ttl default


def code_of(exc: BaseException) -> int:
    """Mooncake's integer code for a kvplane error (the facade's one mapping).

    Store errors carry Mooncake's own code (-704, -706, -200 ...; a ChecksumMismatch is
    CHECKSUM_MISMATCH, -801). Of the general classes:
    bad input (InvalidArgument, Conflict, NotFound) is INVALID_PARAMS, NoSpace is
    NO_AVAILABLE_HANDLE, Timeout is RPC_TIMEOUT, and an unreachable service or any other
    kvplane error is RPC_FAIL, as a failed master call is in Mooncake.
    """
    if isinstance(exc, ChecksumMismatch):
        return CHECKSUM_MISMATCH
    if isinstance(exc, KVPlaneError) and -1000 < exc.code < 0:
        return exc.code
    if isinstance(exc, Timeout):
        return RPC_TIMEOUT
    if isinstance(exc, (InvalidArgument, Conflict, NotFound)):
        return INVALID_PARAMS
    if isinstance(exc, NoSpace):
        return NO_AVAILABLE_HANDLE
    if isinstance(exc, (Unavailable, KVPlaneError)):
        return RPC_FAIL
    return INTERNAL_ERROR


class _Enum(enum.IntEnum):
    """pybind11-style enum: ``name``/``value``, int comparison, ``str`` as ``Type.NAME``."""

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


class SoftPinAction(_Enum):
    """What a write does to the object's soft pin when its first replica becomes readable."""

    PRESERVE = 0
    ENABLE = 1
    DISABLE = 2


class ReplicaStatus(_Enum):
    UNDEFINED = 0
    INITIALIZED = 1
    PROCESSING = 2
    COMPLETE = 3
    REMOVED = 4
    FAILED = 5


class TaskType(_Enum):
    REPLICA_COPY = 0
    REPLICA_MOVE = 1


class TaskStatus(_Enum):
    PENDING = 0
    PROCESSING = 1
    FAILED = 2
    SUCCESS = 3


class ObjectDataType(_Enum):
    UNKNOWN = 0
    KVCACHE = 1
    TENSOR = 2
    WEIGHT = 3
    SAMPLE = 4
    ACTIVATION = 5
    GRADIENT = 6
    OPTIMIZER_STATE = 7
    METADATA = 8
    GENERAL = 9


def _size_t(name: str, value: Any) -> int:
    if isinstance(value, float) or not hasattr(value, "__index__"):
        raise TypeError(f"{name}: incompatible value {value!r} (an unsigned integer)")
    v = int(value)
    if not 0 <= v < 1 << 64:
        raise TypeError(f"{name}: {v} is out of range for an unsigned 64-bit integer")
    return v


def _str_list(name: str, value: Any) -> list[str]:
    if isinstance(value, (str, bytes)) or not all(isinstance(s, str) for s in value):
        raise TypeError(f"{name}: expected a list of str, got {value!r}")
    return list(value)


class ReplicateConfig:
    """Mooncake's ``ReplicateConfig``: typed, validated attributes (a wrong type raises
    TypeError on assignment, as the pybind class does); the combination is checked per write
    by :func:`check_config` (INVALID_PARAMS, as Mooncake's master and client check it).

    ``with_soft_pin`` is kept as the older spelling: True sets ``soft_pin_action = ENABLE``.
    """

    _FIELDS = ("replica_num", "nof_replica_num", "dfs_replica_num", "soft_pin_action",
               "soft_pin_ttl_ms", "with_hard_pin", "preferred_segments",
               "preferred_nof_segments", "preferred_segment", "prefer_alloc_in_same_node",
               "data_type", "group_ids")

    def __init__(self) -> None:
        self.replica_num = 1
        self.nof_replica_num = 0
        self.dfs_replica_num = 0
        self.soft_pin_action = SoftPinAction.PRESERVE
        self.soft_pin_ttl_ms: int | None = None
        self.with_hard_pin = False
        self.preferred_segments: list[str] = []
        self.preferred_nof_segments: list[str] = []
        self.preferred_segment = ""
        self.prefer_alloc_in_same_node = False
        self.data_type = ObjectDataType.UNKNOWN
        self.group_ids: list[str] | None = None

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("replica_num", "nof_replica_num", "dfs_replica_num"):
            value = _size_t(name, value)
        elif name == "soft_pin_ttl_ms":
            value = None if value is None else _size_t(name, value)
        elif name == "soft_pin_action":
            if not isinstance(value, SoftPinAction):
                raise TypeError(f"soft_pin_action: expected a SoftPinAction, got {value!r}")
        elif name == "data_type":
            if not isinstance(value, ObjectDataType):
                raise TypeError(f"data_type: expected an ObjectDataType, got {value!r}")
        elif name in ("with_hard_pin", "prefer_alloc_in_same_node"):
            if not isinstance(value, bool):
                raise TypeError(f"{name}: expected a bool, got {value!r}")
        elif name in ("preferred_segments", "preferred_nof_segments"):
            value = _str_list(name, value)
        elif name == "group_ids":
            value = None if value is None else _str_list(name, value)
        elif name == "preferred_segment":
            if not isinstance(value, str):
                raise TypeError(f"preferred_segment: expected a str, got {value!r}")
        elif name == "with_soft_pin":
            object.__setattr__(self, "soft_pin_action",
                               SoftPinAction.ENABLE if value else SoftPinAction.PRESERVE)
            return
        else:
            raise AttributeError(f"'ReplicateConfig' object has no attribute {name!r}")
        object.__setattr__(self, name, value)

    @property
    def with_soft_pin(self) -> bool:
        return self.soft_pin_action == SoftPinAction.ENABLE

    def __str__(self) -> str:
        body = ", ".join(f"{f}: {getattr(self, f)}" for f in self._FIELDS)
        return f"ReplicateConfig: {{ {body} }}"

    def native(self, group_id: str = "") -> NativeConfig:
        """The kvplane config for one key (``group_id`` from ``group_ids``)."""
        action = {SoftPinAction.PRESERVE: "preserve", SoftPinAction.ENABLE: "enable",
                  SoftPinAction.DISABLE: "disable"}[self.soft_pin_action]
        return NativeConfig(replica_num=self.replica_num, with_hard_pin=self.with_hard_pin,
                            with_soft_pin=action == "enable", soft_pin_action=action,
                            soft_pin_ttl_ms=self.soft_pin_ttl_ms,
                            preferred_segment=self.preferred_segment,
                            preferred_segments=list(self.preferred_segments),
                            prefer_alloc_in_same_node=self.prefer_alloc_in_same_node,
                            group_id=group_id)


def check_config(cfg: ReplicateConfig | None, n_keys: int = 1, copying: bool = False) -> int:
    """0, or the code Mooncake returns for this config on a write of ``n_keys`` keys.

    ``copying``: the bytes API (put/put_parts/put_batch/put_from...), which Mooncake's client
    refuses with ``prefer_alloc_in_same_node`` (only the multi-buffer and tensor writes take it).
    """
    if cfg is None:
        return OK
    if not isinstance(cfg, ReplicateConfig):
        raise TypeError(f"config: expected a ReplicateConfig, got {type(cfg).__name__}")
    if cfg.replica_num == 0 and cfg.nof_replica_num == 0 and cfg.dfs_replica_num == 0:
        return INVALID_PARAMS
    if cfg.dfs_replica_num > 1 or (cfg.dfs_replica_num and not cfg.replica_num):
        return INVALID_PARAMS
    if cfg.nof_replica_num > 0:  # no NVMe-oF pool here (Mooncake without USE_NOF says the same)
        return INVALID_PARAMS
    if cfg.dfs_replica_num:
        return DFS_SERVICE_UNAVAILABLE
    if cfg.soft_pin_ttl_ms is not None and cfg.soft_pin_action != SoftPinAction.ENABLE:
        return INVALID_PARAMS
    if cfg.soft_pin_ttl_ms is not None and cfg.soft_pin_ttl_ms > MAX_SOFT_PIN_TTL_MS:
        return INVALID_PARAMS
    if cfg.prefer_alloc_in_same_node and (copying or cfg.replica_num != 1):
        return INVALID_PARAMS
    if cfg.group_ids is not None and len(cfg.group_ids) != n_keys:
        return INVALID_PARAMS
    return OK


def natives(cfg: ReplicateConfig | None, n_keys: int) -> list[NativeConfig | None]:
    """One native config per key (group ids split out); None where no config was given."""
    if cfg is None:
        return [None] * n_keys
    if cfg.group_ids is None:
        one = cfg.native()
        return [one] * n_keys
    return [cfg.native(g) for g in cfg.group_ids]


# -- replica descriptors ---------------------------------------------------------------------
class Descriptor:
    """A memory replica's buffer: ``size``, ``buffer_address``, ``transport_endpoint``."""

    def __init__(self, size: int = 0, buffer_address: int = 0, transport_endpoint: str = "") -> None:
        self.size, self.buffer_address, self.transport_endpoint = size, buffer_address, transport_endpoint

    def __repr__(self) -> str:
        return (f"<Descriptor size={self.size} buffer_address={self.buffer_address} "
                f"transport_endpoint={self.transport_endpoint}>")


class MemoryDescriptor:
    def __init__(self, buffer_descriptor: Descriptor) -> None:
        self.buffer_descriptor = buffer_descriptor


class DiskDescriptor:
    def __init__(self, file_path: str = "", object_size: int = 0) -> None:
        self.file_path, self.object_size = file_path, object_size


class ReplicaDescriptor:
    """One replica of an object. ``tier`` is "memory" today; the SSD tier adds "disk" and
    "local_disk" replicas (``disk`` then carries their DiskDescriptor)."""

    def __init__(self, status: ReplicaStatus, memory: Descriptor | None = None,
                 disk: DiskDescriptor | None = None, tier: str = "memory",
                 segment: str = "") -> None:
        self.status, self.tier, self.segment = status, tier, segment
        self._memory, self._disk = memory, disk

    def is_memory_replica(self) -> bool:
        return self.tier == "memory"

    def is_disk_replica(self) -> bool:
        return self.tier == "disk"

    def is_local_disk_replica(self) -> bool:
        return self.tier == "local_disk"

    def get_memory_descriptor(self) -> MemoryDescriptor:
        if self._memory is None:
            raise RuntimeError("not a memory replica")
        return MemoryDescriptor(self._memory)

    def get_disk_descriptor(self) -> DiskDescriptor:
        if self._disk is None:
            raise RuntimeError("not a disk replica")
        return self._disk


class BufferHandle:
    """Bytes of one object held in registered memory: ``ptr()``, ``size()``, ``len()`` and the
    buffer protocol (``memoryview(h)``, ``np.array(h, copy=False)``, ``torch.frombuffer``).

    Instances are ctypes arrays over the memory (Python 3.11 has no pure-Python buffer
    protocol); make them with :func:`buffer_handle`. The memory is given back when the handle
    is garbage collected or ``release()``d; do not use it afterwards.
    """

    def ptr(self) -> int:
        return ctypes.addressof(self)  # type: ignore[arg-type]  # a ctypes array at run time

    def size(self) -> int:
        return len(self)  # type: ignore[arg-type]  # a ctypes array at run time

    def release(self) -> None:
        rel = self.__dict__.pop("_release", None)
        self.__dict__.pop("_keep", None)
        if rel is not None:
            rel()

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # interpreter shutdown: the memory goes with the process
            pass


@functools.lru_cache(maxsize=256)
def _handle_type(size: int) -> Any:  # a ctypes array class made at run time
    return type("BufferHandle", (BufferHandle, ctypes.c_ubyte * size), {})


def buffer_handle(ptr: int, size: int, keep: Any = None, release: Any = None) -> BufferHandle:
    """A BufferHandle over ``size`` bytes at ``ptr``; ``keep`` is held while it lives and
    ``release`` is called once when it goes."""
    handle = _handle_type(int(size)).from_address(int(ptr))
    handle._keep = keep
    handle._release = release
    return handle


class QueryTaskResponse:
    """A copy/move task as the master reports it."""

    def __init__(self) -> None:
        self.id: tuple[int, int] = (0, 0)
        self.type = TaskType.REPLICA_COPY
        self.status = TaskStatus.PENDING
        self.created_at_ms_epoch = 0
        self.last_updated_at_ms_epoch = 0
        self.assigned_client: tuple[int, int] = (0, 0)
        self.message = ""

    def __repr__(self) -> str:
        return (f"QueryTaskResponse(id={self.id}, type={self.type}, status={self.status}, "
                f"message={self.message!r})")


# -- host memory --------------------------------------------------------------------------------
class MooncakeHostMemAllocator:
    """Page-aligned host memory: ``alloc(size) -> address`` (0 on failure), ``free(address)``
    -> 0 or -1. Anonymous mmap here (Mooncake pins the pages for its transports; the transports
    here need no pinning)."""

    def __init__(self) -> None:
        self._maps: dict[int, mmap.mmap] = {}
        self._lock = threading.Lock()

    def alloc(self, size: int) -> int:
        if size <= 0:
            return 0
        try:
            m = mmap.mmap(-1, int(size))
        except (OSError, ValueError, OverflowError) as exc:
            log.error("alloc(%s) failed: %s", size, exc)
            return 0
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
        with self._lock:
            self._maps[addr] = m
        return addr

    def free(self, ptr: int) -> int:
        with self._lock:
            m = self._maps.pop(int(ptr), None)
        if m is None:
            return -1
        try:
            m.close()
        except BufferError:  # someone still exports it: it stays mapped until they are done
            with self._lock:
                self._maps[int(ptr)] = m
            return -1
        return 0


def bind_to_numa_node(node: int) -> None:
    """Bind the calling thread to the CPUs of NUMA node ``node`` (from sysfs). On a machine
    without that node this logs a warning and changes nothing (Mooncake does the same)."""
    path = f"/sys/devices/system/node/node{int(node)}/cpulist"
    try:
        with open(path, encoding="ascii") as f:
            cpus = _cpulist(f.read())
        os.sched_setaffinity(0, cpus)
    except (OSError, ValueError) as exc:
        log.warning("bind_to_numa_node(%s): %s", node, exc)


def _cpulist(text: str) -> set[int]:
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if "-" in part:
            lo, hi = part.split("-")
            cpus.update(range(int(lo), int(hi) + 1))
        elif part:
            cpus.add(int(part))
    return cpus
