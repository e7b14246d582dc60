"""Mooncake-compatible Python facade: ``from kvplane.compat.mooncake import TransferEngine``.

Same method names, argument order and return codes as ``mooncake.engine.TransferEngine``:
0 on success and a negative Mooncake error code on failure; ``transfer_check_status``
returns 1 done, 0 in progress, -1 failed, -2 timeout. Switching is one import.
"""

from __future__ import annotations

import enum
import json
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from kvplane.common.config import parse_hostport
from kvplane.common.errors import (
    AddressNotRegistered,
    Conflict,
    InvalidArgument,
    KVPlaneError,
    NotFound,
    ProtocolError,
    Timeout,
    Unavailable,
)
from kvplane.transfer.config import EngineConfig
from kvplane.transfer.engine import TransferEngine as _Engine
from kvplane.transfer.types import OpCode, TransferRequest, TransferStatus

log = logging.getLogger(__name__)

# Mooncake TE error codes (mooncake-transfer-engine/include/error.h)
ERR_INVALID_ARGUMENT = -1
ERR_TOO_MANY_REQUESTS = -2
ERR_ADDRESS_NOT_REGISTERED = -3
ERR_BATCH_BUSY = -4
ERR_ADDRESS_OVERLAPPED = -7
ERR_SOCKET = -102
ERR_MALFORMED_JSON = -103
ERR_METADATA = -200


def te_code(exc: KVPlaneError) -> int:
    """The Mooncake TE error code for a kvplane error."""
    if isinstance(exc, AddressNotRegistered):
        return ERR_ADDRESS_NOT_REGISTERED
    if isinstance(exc, Conflict):
        return ERR_ADDRESS_OVERLAPPED
    if isinstance(exc, NotFound):
        return ERR_METADATA
    if isinstance(exc, ProtocolError):
        return ERR_MALFORMED_JSON
    if isinstance(exc, (Unavailable, Timeout)):
        return ERR_SOCKET
    return ERR_INVALID_ARGUMENT


class TransferOpcode(enum.IntEnum):
    """Mooncake's ``TransferOpcode`` (``Read``/``Write``; ``READ``/``WRITE`` are aliases)."""

    Read = 0
    Write = 1
    READ = 0
    WRITE = 1


def _transport(hint: str) -> str | None:
    """The transport a ``transport_hint`` pins: one this engine loads ("tcp", "shm", "file",
    "local"); "" or a transport not here ("rdma", "nvlink" ...) leaves the choice to the engine,
    as Mooncake's classic engine ignores the hint."""
    name = (hint or "").strip().lower()
    return name if name in ("tcp", "shm", "file", "local") else None


class TransferNotify:
    """Mooncake's ``TransferNotify(name, msg)`` (accepted; notifications are not sent yet)."""

    def __init__(self, name: str = "", msg: str = "") -> None:
        self.name, self.msg = name, msg


class TransferEngine:
    """Mooncake ``TransferEngine`` with kvplane underneath."""

    def __init__(self) -> None:
        self._te: _Engine | None = None
        self._handles: dict[str, int] = {}
        self._lock = threading.Lock()
        self._managed: dict[int, Any] = {}

    # -- init ------------------------------------------------------------------------------
    def initialize(self, local_hostname: str, metadata_server: str, protocol: str,
                   device_name: str = "") -> int:
        """Start the engine. ``protocol``: "tcp" forces TCP, "auto"/"shm" prefer shared memory
        on the same host, "rdma" (and Mooncake's other hardware names) is served by NIXL when
        installed, else by TCP with one warning (``kvplane.transfer.fabric``). Returns 0 or < 0."""
        proto = protocol.strip().lower() or "auto"
        host, port = parse_hostport(local_hostname, 0)
        name = None if metadata_server.upper() == "P2PHANDSHAKE" or not port else local_hostname
        try:
            cfg = EngineConfig.from_env(host=host, port=port, metadata=metadata_server,
                                        protocol=proto, name=name)
            self._te = _Engine(cfg)
        except KVPlaneError as exc:
            log.error("initialize failed: %s", exc)
            return te_code(exc)
        except OSError as exc:
            log.error("initialize failed: %s", exc)
            return ERR_SOCKET
        return 0

    def initialize_ext(self, local_hostname: str, metadata_server: str, protocol: str,
                       device_name: str, metadata_type: str) -> int:
        """As :meth:`initialize`; ``metadata_type`` is implied by the server string here."""
        return self.initialize(local_hostname, metadata_server, protocol, device_name)

    @property
    def engine(self) -> _Engine:
        if self._te is None:
            raise InvalidArgument("TransferEngine is not initialized")
        return self._te

    def get_engine(self) -> _Engine:
        """The native kvplane engine (Mooncake returns its inner engine here)."""
        return self.engine

    def get_engine_ptr(self) -> int:
        """An id of the native engine (Mooncake returns a C++ pointer; there is none here)."""
        return id(self.engine)

    def get_rpc_port(self) -> int:
        """The handshake/data port; in P2PHANDSHAKE mode peers use ``f"{host}:{port}"``."""
        return self.engine.port

    def get_local_topology(self, device_name: str | None = None) -> str:
        """A JSON description of this engine (no NICs to report on this transport set)."""
        d = self.engine.describe()
        return json.dumps({"segment": d.name, "transports": d.transports, "cpu:0": [[], []]})

    # -- memory ----------------------------------------------------------------------------
    def _rc(self, fn: Callable[[], Any]) -> int:
        try:
            fn()
            return 0
        except KVPlaneError as exc:
            log.warning("%s", exc)
            return te_code(exc)

    def register_memory(self, buffer_addr: int, capacity: int, location: str = "*") -> int:
        """Register memory. ``location`` (Mooncake's NUMA/device hint, e.g. "cpu:0") is
        accepted; kvplane's transports have no NIC affinity to apply it to."""
        return self._rc(lambda: self.engine.register_memory(int(buffer_addr), int(capacity)))

    def unregister_memory(self, buffer_addr: int) -> int:
        return self._rc(lambda: self.engine.unregister_memory(int(buffer_addr)))

    def batch_register_memory(self, buffer_addresses: Sequence[int], capacities: Sequence[int],
                              location: str = "*") -> int:
        if len(buffer_addresses) != len(capacities):
            return ERR_INVALID_ARGUMENT
        for a, n in zip(buffer_addresses, capacities):
            rc = self.register_memory(a, n, location)
            if rc:
                return rc
        return 0

    def batch_unregister_memory(self, buffer_addresses: Sequence[int]) -> int:
        rcs = [self.unregister_memory(a) for a in buffer_addresses]
        return next((rc for rc in rcs if rc), 0)

    def allocate_managed_buffer(self, length: int) -> int:
        """Shared-memory backed registered memory; returns its address or 0."""
        try:
            buf = self.engine.allocate_managed_buffer(int(length))
        except (KVPlaneError, OSError) as exc:
            log.warning("allocate_managed_buffer(%s): %s", length, exc)
            return 0
        self._managed[buf.addr] = buf
        return buf.addr

    def free_managed_buffer(self, buffer_addr: int, length: int) -> int:
        self._managed.pop(int(buffer_addr), None)
        return self._rc(lambda: self.engine.free_managed_buffer(int(buffer_addr)))

    def write_bytes_to_buffer(self, dest_address: int, src_ptr: bytes, length: int) -> int:
        def put() -> None:
            self.engine.memory.view(int(dest_address), int(length))[:] = memoryview(src_ptr)[:length]
        return self._rc(put)

    def read_bytes_from_buffer(self, source_address: int, length: int) -> bytes:
        return bytes(self.engine.memory.view(int(source_address), int(length)))

    def get_first_buffer_address(self, segment_name: str) -> int:
        h = self._handle(segment_name)
        regions = self.engine.segment(h).desc.regions
        return regions[0].addr if regions else 0

    # -- transfers -------------------------------------------------------------------------
    def _handle(self, target: str, refresh: bool = False) -> int:
        with self._lock:
            h = self._handles.get(target)
        if h is None or refresh:
            h = self.engine.open_segment(target)
            with self._lock:
                self._handles[target] = h
        return h

    def _requests(self, target: str, op: OpCode, buffers: Sequence[int], peers: Sequence[int],
                  lengths: Sequence[int], hint: str = "") -> list[TransferRequest]:
        if not len(buffers) == len(peers) == len(lengths):
            raise InvalidArgument("buffers, peer addresses and lengths differ in length")
        h = self._handle(target)
        transport = _transport(hint)
        return [TransferRequest(op, int(b), h, int(p), int(n), transport=transport)
                for b, p, n in zip(buffers, peers, lengths)]

    def _sync(self, target: str, op: OpCode, buffers: Sequence[int], peers: Sequence[int],
              lengths: Sequence[int], hint: str = "") -> int:
        try:
            reqs = self._requests(target, op, buffers, peers, lengths, hint)
            statuses = self.engine.transfer(reqs)
            if TransferStatus.FAILED in statuses and TransferStatus.TIMEOUT not in statuses:
                # the peer may have restarted: refresh its descriptor once and retry
                reqs = self._requests_refreshed(target, op, buffers, peers, lengths, hint)
                statuses = self.engine.transfer(reqs)
        except KVPlaneError as exc:
            log.warning("transfer to %s failed: %s", target, exc)
            return -1
        return 0 if all(s == TransferStatus.COMPLETED for s in statuses) else -1

    def _requests_refreshed(self, target: str, op: OpCode, buffers: Sequence[int],
                            peers: Sequence[int], lengths: Sequence[int],
                            hint: str = "") -> list[TransferRequest]:
        self._handle(target, refresh=True)
        return self._requests(target, op, buffers, peers, lengths, hint)

    def _single(self, target: str, op: OpCode, buffer: int, peer: int, length: int,
                hint: str) -> int:
        """One sync request: as :meth:`_sync` of it (a FAILED one is retried once with the
        peer's descriptor fetched again), through the engine's ``transfer_one``."""
        transport = _transport(hint) if hint else None
        try:
            h = self._handles.get(target)
            if h is None:
                h = self._handle(target)
            st = self.engine.transfer_one(op, int(buffer), h, int(peer), int(length), transport)
            if st == TransferStatus.FAILED:  # the peer may have restarted
                h = self._handle(target, refresh=True)
                st = self.engine.transfer_one(op, int(buffer), h, int(peer), int(length), transport)
        except KVPlaneError as exc:
            log.warning("transfer to %s failed: %s", target, exc)
            return -1
        return 0 if st == TransferStatus.COMPLETED else -1

    def transfer_sync_write(self, target_hostname: str, buffer: int, peer_buffer_address: int,
                            length: int, transport_hint: str = "") -> int:
        """Copy local -> remote; 0 or -1. ``transport_hint`` ("tcp", "shm", ...) pins a
        transport this engine has; other names are ignored (see :func:`_transport`)."""
        return self._single(target_hostname, OpCode.WRITE, buffer, peer_buffer_address, length,
                            transport_hint)

    def transfer_sync_read(self, target_hostname: str, buffer: int, peer_buffer_address: int,
                           length: int, transport_hint: str = "") -> int:
        return self._single(target_hostname, OpCode.READ, buffer, peer_buffer_address, length,
                            transport_hint)

    def transfer_sync(self, target_hostname: str, buffer: int, peer_buffer_address: int,
                      length: int, opcode: TransferOpcode, notify: TransferNotify | None = None,
                      transport_hint: str = "") -> int:
        return self._single(target_hostname, OpCode(int(opcode)), buffer, peer_buffer_address,
                            length, transport_hint)

    def batch_transfer_sync_write(self, target_hostname: str, buffers: Sequence[int],
                                  peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                  transport_hint: str = "") -> int:
        return self._sync(target_hostname, OpCode.WRITE, buffers, peer_buffer_addresses, lengths,
                          transport_hint)

    def batch_transfer_sync_read(self, target_hostname: str, buffers: Sequence[int],
                                 peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                 transport_hint: str = "") -> int:
        return self._sync(target_hostname, OpCode.READ, buffers, peer_buffer_addresses, lengths,
                          transport_hint)

    def batch_transfer_sync(self, target_hostname: str, buffers: Sequence[int],
                            peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                            opcode: TransferOpcode, notify: TransferNotify | None = None,
                            transport_hint: str = "") -> int:
        return self._sync(target_hostname, OpCode(int(opcode)), buffers, peer_buffer_addresses,
                          lengths, transport_hint)

    def _async(self, target: str, op: OpCode, buffers: Sequence[int], peers: Sequence[int],
               lengths: Sequence[int], hint: str = "") -> int:
        try:
            reqs = self._requests(target, op, buffers, peers, lengths, hint)
            bid = self.engine.allocate_batch(max(1, len(reqs)))
            self.engine.submit(bid, reqs)
            return bid
        except KVPlaneError as exc:
            log.warning("async transfer to %s failed: %s", target, exc)
            return 0

    def transfer_submit_write(self, target_hostname: str, buffer: int, peer_buffer_address: int,
                              length: int, transport_hint: str = "") -> int:
        """Start a write; returns a batch id (0 on failure)."""
        return self._async(target_hostname, OpCode.WRITE, [buffer], [peer_buffer_address], [length],
                           transport_hint)

    def batch_transfer_async_write(self, target_hostname: str, buffers: Sequence[int],
                                   peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                   transport_hint: str = "") -> int:
        return self._async(target_hostname, OpCode.WRITE, buffers, peer_buffer_addresses, lengths,
                           transport_hint)

    def batch_transfer_async_read(self, target_hostname: str, buffers: Sequence[int],
                                  peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                  transport_hint: str = "") -> int:
        return self._async(target_hostname, OpCode.READ, buffers, peer_buffer_addresses, lengths,
                           transport_hint)

    def batch_transfer_async(self, target_hostname: str, buffers: Sequence[int],
                             peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                             opcode: TransferOpcode, transport_hint: str = "") -> int:
        return self._async(target_hostname, OpCode(int(opcode)), buffers, peer_buffer_addresses,
                           lengths, transport_hint)

    def transfer_check_status(self, batch_id: int) -> int:
        """1 done, 0 in progress, -1 failed, -2 timeout. A finished batch is released."""
        try:
            statuses = self.engine.batch_status(batch_id)
        except KVPlaneError:
            return -1
        if any(not s.done for s in statuses):
            return 0
        self.engine.free_batch(batch_id)
        if any(s == TransferStatus.TIMEOUT for s in statuses):
            return -2
        return 1 if all(s == TransferStatus.COMPLETED for s in statuses) else -1

    def get_batch_transfer_status(self, batch_ids: Sequence[int]) -> int:
        """Wait for every batch; 0 if all completed, -1 otherwise."""
        ok = True
        for bid in batch_ids:
            try:
                statuses = self.engine.wait(bid)
                self.engine.free_batch(bid)
            except KVPlaneError:
                ok = False
                continue
            ok = ok and all(s == TransferStatus.COMPLETED for s in statuses)
        return 0 if ok else -1

    def send_probe(self, peer_server_name: str) -> int:
        """0 if the peer answers a handshake."""
        try:
            self._handle(peer_server_name, refresh=True)
            return 0
        except KVPlaneError:
            return -1

    def get_notifies(self) -> list[TransferNotify]:
        """Notifications received (none: kvplane does not send notifies yet)."""
        return []

    def close(self) -> None:
        if self._te is not None:
            self._te.close()
            self._te = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: nothing left to release
            pass


from kvplane.compat.mooncake_buffer_pool import BufferPool  # noqa: E402
from kvplane.compat.mooncake_store import MooncakeDistributedStore  # noqa: E402
from kvplane.compat.mooncake_tensor_format import (  # noqa: E402
    ParallelAxis,
    ReadTarget,
    TensorParallelism,
)
from kvplane.compat.mooncake_types import (  # noqa: E402
    BufferHandle,
    Descriptor,
    DiskDescriptor,
    MemoryDescriptor,
    MooncakeHostMemAllocator,
    ObjectDataType,
    QueryTaskResponse,
    ReplicaDescriptor,
    ReplicaStatus,
    ReplicateConfig,
    SoftPinAction,
    TaskStatus,
    TaskType,
    bind_to_numa_node,
)

__all__ = ["BufferHandle", "BufferPool", "Descriptor", "DiskDescriptor", "MemoryDescriptor",
           "MooncakeDistributedStore", "MooncakeHostMemAllocator", "ObjectDataType",
           "ParallelAxis", "QueryTaskResponse", "ReadTarget", "ReplicaDescriptor",
           "ReplicaStatus", "ReplicateConfig", "SoftPinAction", "TaskStatus", "TaskType",
           "TensorParallelism", "TransferEngine", "TransferNotify",
           "TransferOpcode", "bind_to_numa_node", "te_code"]
