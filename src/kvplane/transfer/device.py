"""Device memory seen from the transfer layer: the copier protocol and the copier registry.

A device region (CUDA memory, a test's stand-in) has no host view: its bytes move only through
the device's :class:`DeviceCopier`, which copies by address between device memory and host
staging it allocated (pinned for CUDA), and returns a :class:`Fence` per batch of copies, so a
caller overlaps copies with network sends. Torch tensors get
:class:`~kvplane.transfer.torch_device.TorchCopier` (imported only when a torch tensor on a
device asks for a copier); another kind of device registers its own factory with
:func:`register_device_kind`.

These names were first written for the connectors (``kvplane.integrations.device_kv``
re-exports them); they live here so the transfer engine can stage device memory without
importing integrations. Imports neither torch nor the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, runtime_checkable

from kvplane.common.errors import InvalidArgument


@dataclass
class MemRegion:
    """One backing allocation of device (or host) memory, as a copier resolves it.

    Attributes:
        addr: start address (a device address when ``device`` is set).
        length: bytes.
        device: "" for host memory, else the tensor's device (``cuda:0``, ``standin:0``).
        tensor: an object spanning the allocation (for device memory: what a copier resolves
            device addresses in; torch: a flat view of the whole storage). None for raw
            device pointers (then only a registered kind's copier can serve it).
    """

    addr: int
    length: int
    device: str = ""
    tensor: Any = field(default=None, repr=False, compare=False)


class Copy(NamedTuple):
    """Copy ``length`` bytes from address ``src`` to address ``dst``."""

    src: int
    dst: int
    length: int


class HostBuffer(NamedTuple):
    """Host memory a copier allocated for staging (pinned where the device wants it).

    ``obj`` keeps it alive and is what a caller registers (with a store or an engine).
    """

    addr: int
    length: int
    obj: Any


class Fence(Protocol):
    """Completion of one batch of copies."""

    def wait(self, timeout: float) -> None:
        """Return once the copies are done; blocks at most ``timeout`` seconds.

        Raises:
            KVPlaneError: a copy failed (``DeviceFailed`` from kvplane's copiers,
                ``TransferFail`` from the connectors' older ones).
            Timeout: not done within ``timeout`` seconds (the copies may still run).
        """


class DeviceCopier(Protocol):
    """Copies between one device's registered regions and host staging, by address.

    Callable from any thread; ``copy`` only enqueues (it may copy at once when the device
    has no asynchronous engine).
    """

    device: str

    def host_buffer(self, nbytes: int) -> HostBuffer:
        """Staging memory for this device (pinned host memory for CUDA)."""

    def copy(self, moves: Sequence[Copy], to_device: bool) -> Fence:
        """Start ``moves`` (host -> device when ``to_device``, else device -> host).

        Raises:
            InvalidArgument: an address outside the registered device regions or the staging.
            KVPlaneError: the device refused the copy.
        """


@runtime_checkable
class TracksRegions(Protocol):
    """A copier that resolves device addresses only in the regions it was told about (torch:
    one flat tensor per region); the engine tells it of each region registered later. A
    copier without these resolves any address of its device by itself."""

    def add_region(self, region: MemRegion) -> None:
        """Resolve addresses in ``region`` from now on (InvalidArgument: unusable region)."""

    def remove_region(self, addr: int) -> None:
        """Forget the region starting at ``addr`` (never raises)."""


class Done:
    """A fence that is already complete (synchronous copiers)."""

    def wait(self, timeout: float) -> None:
        return None


DONE = Done()
CopierFactory = Callable[[Sequence[MemRegion]], DeviceCopier]
_KINDS: dict[str, CopierFactory] = {}


def register_device_kind(kind: str, factory: CopierFactory | None) -> None:
    """Use ``factory(regions)`` as the copier of devices named ``kind:N`` (None unregisters).

    Torch tensors need none (their own copier serves every torch device).
    """
    if factory is None:
        _KINDS.pop(kind, None)
    else:
        _KINDS[kind] = factory


def device_of(t: Any) -> str:
    """"" for host memory (a CPU tensor, an array), else the tensor's device (``cuda:0``)."""
    dev = getattr(t, "device", None)
    if dev is None:
        return ""
    kind = getattr(dev, "type", str(dev))
    return "" if kind == "cpu" else str(dev)


def copier_for(regions: Sequence[MemRegion]) -> DeviceCopier:
    """The copier of ``regions`` (all on one device).

    Raises:
        InvalidArgument: no region, regions on several devices, or a device kvplane cannot copy.
    """
    devices = {r.device for r in regions}
    if len(devices) != 1 or "" in devices:
        raise InvalidArgument(f"staging needs regions on one device, got {sorted(devices)}")
    device = devices.pop()
    factory = _KINDS.get(device.split(":", 1)[0])
    if factory is not None:
        return factory(regions)
    if all(type(r.tensor).__module__.startswith("torch") for r in regions):
        from kvplane.transfer.torch_device import TorchCopier
        return TorchCopier(regions)
    raise InvalidArgument(f"memory on {device}: kvplane has no copy path for this device "
                          "(torch tensors, or a kind registered with register_device_kind)")


def coalesce(moves: Sequence[Copy]) -> list[Copy]:
    """``moves`` with each run that is adjacent on both sides merged into one copy."""
    out: list[Copy] = []
    for m in moves:
        if out and out[-1].src + out[-1].length == m.src and out[-1].dst + out[-1].length == m.dst:
            last = out[-1]
            out[-1] = Copy(last.src, last.dst, last.length + m.length)
        else:
            out.append(m)
    return out
