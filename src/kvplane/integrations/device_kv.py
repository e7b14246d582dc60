"""Staged device KV: engine KV caches in device memory (CUDA, a test's stand-in) moved through
registered host slots, by address.

The store keeps objects in host segments and reads the bytes it stores on the host (the
checksum in each inventory header, local replica copies), so KV that lives in device memory
reaches it through host staging: a save copies each page device -> slot and stores the slot; a
load reads into slots and copies slot -> device. Every move is an address range, a device range
inside a registered device region and a host range inside the staging buffer; nothing here takes
a host view of device memory. Copies go through a :class:`DeviceCopier` (torch's for torch
tensors, :mod:`kvplane.transfer.torch_device`; another kind of device registers its own with
:func:`register_device_kind`), which returns a :class:`Fence` per batch, so a layer-wise caller
overlaps one layer's copies with other work. A failed copy raises a ``KVPlaneError``
(``DeviceFailed``, or ``TransferFail`` from older copiers) from the copy or its fence: the pages
it carried count as failed loads (the engine recomputes them) or failed saves, never as wrong
bytes.

The copier protocol and its registry live in :mod:`kvplane.transfer.device` (the transfer
engine stages device memory too) and are re-exported here under their old names. Imports
neither torch nor an engine.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from kvplane.common.errors import InvalidArgument, KVPlaneError
from kvplane.store.errors import TransferFail
from kvplane.transfer.device import (
    DONE,
    CopierFactory,
    Copy,
    DeviceCopier,
    Done,
    Fence,
    HostBuffer,
    MemRegion,
    coalesce,
    copier_for,
    device_of,
    register_device_kind,
)

__all__ = [
    "DONE", "CopierFactory", "Copy", "DeviceCopier", "DeviceStaging", "Done", "Fence",
    "HostBuffer", "MemRegion", "PendingLoad", "SlotPool", "StagedSave", "coalesce", "copier_for",
    "device_of", "register_device_kind",
]


class SlotPool:
    """``count`` fixed-size slots of ``slot_bytes`` from ``base`` (thread-safe).

    ``take`` is all or nothing and hands out the lowest free slots, so consecutive pages tend
    to land in adjacent slots (and their copies coalesce).
    """

    def __init__(self, base: int, slot_bytes: int, count: int) -> None:
        self.base, self.slot_bytes, self.count = base, slot_bytes, count
        self._free = list(range(count))
        self._lock = threading.Lock()

    @property
    def free(self) -> int:
        with self._lock:
            return len(self._free)

    def take(self, n: int) -> list[int] | None:
        """Addresses of ``n`` slots, or None when fewer are free."""
        with self._lock:
            if n > len(self._free):
                return None
            got, self._free = self._free[:n], self._free[n:]
        return [self.base + i * self.slot_bytes for i in got]

    def give(self, addrs: Sequence[int]) -> None:
        """Return slots ``take`` handed out."""
        with self._lock:
            self._free.extend((a - self.base) // self.slot_bytes for a in addrs)
            self._free.sort()


class StagedSave:
    """Pages of one save, copied device -> slot, then stored from the slots.

    Args:
        copier: the device's copier.
        pool: the save slots (already taken: ``slots``).
        dev_addrs, sizes: the pages in device memory.
        slots: one slot per page.
    """

    def __init__(self, copier: DeviceCopier, pool: SlotPool, dev_addrs: Sequence[int],
                 sizes: Sequence[int], slots: list[int]) -> None:
        self._copier, self._pool = copier, pool
        self.dev_addrs, self.sizes, self.slots = list(dev_addrs), list(sizes), slots
        self._copied = [False] * len(slots)
        self._fences: list[Fence] = []
        self._error: KVPlaneError | None = None
        self._released = False

    def copy(self, indices: Sequence[int]) -> None:
        """Start the device -> slot copies of pages ``indices`` not copied yet (layer-wise
        callers copy each layer once it is computed). A failure is kept for :meth:`ready`."""
        todo = [i for i in indices if not self._copied[i]]
        for i in todo:
            self._copied[i] = True
        if not todo or self._error is not None:
            return
        moves = coalesce([Copy(self.dev_addrs[i], self.slots[i], self.sizes[i]) for i in todo])
        try:
            self._fences.append(self._copier.copy(moves, to_device=False))
        except KVPlaneError as exc:
            self._error = exc

    def ready(self, timeout: float) -> None:
        """Copy what is left and wait for every copy.

        Raises:
            TransferFail, Timeout, InvalidArgument: a copy failed; store nothing.
        """
        self.copy(range(len(self.slots)))
        if self._error is not None:
            raise self._error
        for f in self._fences:
            f.wait(timeout)

    def release(self) -> None:
        """Give the slots back (idempotent; after the store read them, or on failure)."""
        if not self._released:
            self._released = True
            self._pool.give(self.slots)


FetchFn = Callable[[list[str], list[int], list[int]], Sequence["int | KVPlaneError"]]
PutFn = Callable[[list[str], list[int], list[int]], Sequence["KVPlaneError | None"]]


class PendingLoad:
    """A load read into slots whose slot -> device copies run per group (layer).

    After the waits, ``ok[i]`` is True when page ``i`` was read whole and copied; False for a
    page whose read or copy failed. The slots go back once every group was waited for.
    """

    def __init__(self, ok: list[bool], fences: dict[int, tuple[list[int], Fence | None]],
                 release: Callable[[], None]) -> None:
        self.ok = ok
        self._fences = fences
        self._release = release
        self.failures: list[str] = []

    @property
    def complete(self) -> bool:
        """Whether every group was waited for (or the load ran in chunks)."""
        return not self._fences

    def wait(self, group: int, timeout: float) -> None:
        """Wait for group ``group``'s copies (once; a failure marks its pages not ok)."""
        entry = self._fences.pop(group, None)
        if entry is not None:
            indices, fence = entry
            try:
                if fence is None:
                    raise TransferFail("device copy was refused")
                fence.wait(timeout)
            except KVPlaneError as exc:
                self.failures.append(str(exc))
                for i in indices:
                    self.ok[i] = False
        if not self._fences:
            self._release()

    def wait_all(self, timeout: float) -> list[bool]:
        """Wait for every group; returns ``ok``."""
        for g in list(self._fences):
            self.wait(g, timeout)
        self._release()
        return self.ok


class DeviceStaging:
    """Host staging for one device's KV: load slots and save slots in one registered buffer.

    Args:
        copier: the device's copier.
        register: registers host memory with the store (``StoreClient.register_buffer``);
            returns the registered address.
        slot_bytes: bytes of one slot (the largest page moved).
        load_slots: pages one load holds at a time (a larger load runs in chunks).
        save_slots: pages saves in flight hold; a save that does not fit is refused.

    Raises:
        InvalidArgument: no slots, or a buffer the store cannot register.
    """

    def __init__(self, copier: DeviceCopier, register: Callable[[Any], int], slot_bytes: int,
                 load_slots: int, save_slots: int) -> None:
        if slot_bytes <= 0 or load_slots < 1 or save_slots < 1:
            raise InvalidArgument(f"device staging needs slots: {load_slots} load and {save_slots} "
                                  f"save slots of {slot_bytes} B")
        self.copier = copier
        self.device = copier.device
        self.slot_bytes = slot_bytes
        self.buffer = copier.host_buffer(slot_bytes * (load_slots + save_slots))
        self.addr = register(self.buffer.obj)
        self.loads = SlotPool(self.addr, slot_bytes, load_slots)
        self.saves = SlotPool(self.addr + slot_bytes * load_slots, slot_bytes, save_slots)

    def _check(self, sizes: Sequence[int]) -> None:
        big = [s for s in sizes if s > self.slot_bytes]
        if big:
            raise InvalidArgument(f"a page of {big[0]} B exceeds the {self.slot_bytes} B slots")

    def save(self, dev_addrs: Sequence[int], sizes: Sequence[int]) -> StagedSave | None:
        """Reserve slots for a save (nothing copied yet); None when they are not free.

        Raises:
            InvalidArgument: a page larger than a slot.
        """
        self._check(sizes)
        slots = self.saves.take(len(sizes))
        if slots is None:
            return None
        return StagedSave(self.copier, self.saves, dev_addrs, sizes, slots)

    def load(self, keys: Sequence[str], dev_addrs: Sequence[int], sizes: Sequence[int],
             fetch: FetchFn, timeout: float,
             groups: Sequence[Sequence[int]] | None = None) -> PendingLoad:
        """Read ``keys`` into slots with ``fetch`` (``StoreClient.batch_get_into``), then start the
        slot -> device copies, one batch per group of page indices (default: one group).

        A load that fits the load slots returns with the copies running (wait per group); a
        larger one runs chunk by chunk and returns complete. A failed read or copy leaves the
        pages it covers not ok; nothing raises.

        Raises:
            InvalidArgument: a page larger than a slot (a bug of the caller, not a miss).
        """
        self._check(sizes)
        n = len(keys)
        parts = [list(g) for g in groups] if groups is not None else [list(range(n))]
        ok = [False] * n
        if n <= self.loads.count:
            slots = self.loads.take(n)
            if slots is not None:
                return self._start(keys, dev_addrs, sizes, fetch, slots, ok, parts)
        done = PendingLoad(ok, {}, lambda: None)
        step = self.loads.count
        for at in range(0, n, step):  # chunked: each chunk fully copied before the next
            idx = list(range(at, min(n, at + step)))
            slots = self.loads.take(len(idx))
            if slots is None:
                done.failures.append("load slots are held by an earlier load")
                break
            part = self._start([keys[i] for i in idx], [dev_addrs[i] for i in idx],
                               [sizes[i] for i in idx], fetch, slots, [False] * len(idx),
                               [list(range(len(idx)))])
            for i, good in zip(idx, part.wait_all(timeout)):
                ok[i] = good
            done.failures += part.failures
        return done

    def _start(self, keys: Sequence[str], dev_addrs: Sequence[int], sizes: Sequence[int],
               fetch: FetchFn, slots: list[int], ok: list[bool],
               groups: list[list[int]]) -> PendingLoad:
        released = threading.Event()

        def release() -> None:
            if not released.is_set():
                released.set()
                self.loads.give(slots)

        try:
            got = fetch(list(keys), list(slots), list(sizes))
        except KVPlaneError as exc:
            got = [exc] * len(keys)
        read = [got[i] == sizes[i] for i in range(len(keys))]  # an exception never equals a size
        fences: dict[int, tuple[list[int], Fence | None]] = {}
        failures: list[str] = []
        for g, indices in enumerate(groups):
            good = [i for i in indices if read[i]]
            fence: Fence | None = DONE
            if good:
                moves = coalesce([Copy(slots[i], dev_addrs[i], sizes[i]) for i in good])
                try:
                    fence = self.copier.copy(moves, to_device=True)
                except KVPlaneError as exc:
                    failures.append(str(exc))
                    fence = None
            for i in good:
                ok[i] = True
            fences[g] = (good, fence)
        pending = PendingLoad(ok, fences, release)
        pending.failures = failures
        return pending

    def put(self, keys: Sequence[str], dev_addrs: Sequence[int], sizes: Sequence[int],
            store: PutFn, timeout: float) -> list[KVPlaneError | None]:
        """Store device pages now (synchronous callers: SGLang, LMCache): chunk by chunk of the
        save slots, each copied to the host, stored with ``store`` (``batch_put_from``), freed.

        Returns:
            Per key None (stored) or the error (a failed copy fails its whole chunk).

        Raises:
            InvalidArgument: a page larger than a slot.
        """
        self._check(sizes)
        out: list[KVPlaneError | None] = []
        step = self.saves.count
        for at in range(0, len(keys), step):
            idx = range(at, min(len(keys), at + step))
            staged = self.save([dev_addrs[i] for i in idx], [sizes[i] for i in idx])
            if staged is None:
                out += [TransferFail("save slots are held by other saves")] * len(idx)
                continue
            try:
                staged.ready(timeout)
                out += list(store([keys[i] for i in idx], staged.slots, staged.sizes))
            except KVPlaneError as exc:
                out += [exc] * len(idx)
            finally:
                staged.release()
        return out

    def get(self, keys: Sequence[str], dev_addrs: Sequence[int], sizes: Sequence[int],
            fetch: FetchFn, timeout: float) -> list[bool]:
        """Load pages into device memory now; per page whether it arrived whole."""
        return self.load(keys, dev_addrs, sizes, fetch, timeout).wait_all(timeout)

    def close(self, unregister: Callable[[int], None]) -> None:
        """Unregister the staging buffer (``StoreClient.unregister_buffer``)."""
        try:
            unregister(self.addr)
        except KVPlaneError:
            pass
