"""``mooncake.store`` on kvplane: the store facade of ``kvplane.compat.mooncake`` and its types.

The enum members are also module attributes (``mooncake.store.COMPLETE`` ...), as pybind11's
``export_values`` makes them in Mooncake's extension.
"""

from __future__ import annotations

from kvplane.compat.mooncake import (
    BufferHandle,
    Descriptor,
    DiskDescriptor,
    MemoryDescriptor,
    MooncakeDistributedStore,
    MooncakeHostMemAllocator,
    ObjectDataType,
    ParallelAxis,
    QueryTaskResponse,
    ReadTarget,
    ReplicaDescriptor,
    ReplicaStatus,
    ReplicateConfig,
    SoftPinAction,
    TaskStatus,
    TaskType,
    TensorParallelism,
    bind_to_numa_node,
)
from kvplane.compat.mooncake_buffer_pool import BufferLease, BufferPool, RegisteredBufferPool
from kvplane.compat.mooncake_tensor import (  # noqa: F401  (Mooncake's module spells them private)
    deserialize_tensor as _deserialize_tensor,
)

__all__ = ["BufferHandle", "BufferLease", "BufferPool", "RegisteredBufferPool", "Descriptor",
           "DiskDescriptor", "MemoryDescriptor",
           "MooncakeDistributedStore", "MooncakeHostMemAllocator", "ObjectDataType",
           "ParallelAxis", "QueryTaskResponse", "ReadTarget", "ReplicaDescriptor",
           "ReplicaStatus", "ReplicateConfig", "SoftPinAction", "TaskStatus", "TaskType",
           "TensorParallelism", "bind_to_numa_node"]

for _enum in (ReplicaStatus, TaskStatus, TaskType, ObjectDataType):
    globals().update(_enum.__members__)
