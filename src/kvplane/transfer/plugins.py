"""The transport registry and the set of transports one engine loaded, with their capabilities.

Owns :data:`TRANSPORTS` (registry name -> ``"module:Class"``, imported only when an engine
loads it; the built-ins are registered here by path, never imported) and :class:`TransportSet`
(the loaded plugins, their optional capabilities discovered once, the "auto" preference
order). A plugin that does not import, is not a :class:`~kvplane.transfer.seam.Transport`
subclass, or declares no :class:`~kvplane.transfer.seam.Capabilities` fails loudly at load.

Imports the seam only; never a transport module (the engine goes through this).
"""

from __future__ import annotations

from collections.abc import Iterable

from kvplane.common.errors import InvalidArgument
from kvplane.common.registry import Registry
from kvplane.transfer.seam import (
    Capabilities,
    ControlChannel,
    MappedOneIO,
    OneItemIO,
    Prunable,
    RegistersMemory,
    Route,
    RouteOneIO,
    Transport,
    TransportContext,
    VectoredIO,
)

TRANSPORTS: Registry[Transport] = Registry("transport")
TRANSPORTS.register("tcp", "kvplane.transfer.transports.tcp:TcpTransport")
TRANSPORTS.register("shm", "kvplane.transfer.transports.shm:ShmTransport")
TRANSPORTS.register("file", "kvplane.transfer.transports.file:FileTransport")
TRANSPORTS.register("local", "kvplane.transfer.transports.local:LocalTransport")
TRANSPORTS.register("nixl", "kvplane.transfer.transports.nixl:NixlTransport")
TRANSPORTS.register("cudaipc", "kvplane.transfer.transports.cuda_ipc:CudaIpcTransport")


def load(name: str) -> type[Transport]:
    """The transport class registered as ``name`` (or an explicit ``"module:Class"``).

    Raises:
        InvalidArgument: an unknown name, or a plugin that is not a Transport with
            Capabilities. Import errors propagate (a broken plugin fails loudly).
    """
    try:
        cls = TRANSPORTS.load(name)
    except AttributeError as exc:
        raise InvalidArgument(f"transport plugin {name!r} names no class: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, Transport)):
        raise InvalidArgument(f"transport plugin {name!r} is {cls!r}, not a Transport subclass")
    if not isinstance(cls.capabilities, Capabilities):
        raise InvalidArgument(f"transport plugin {name!r} declares no Capabilities")
    return cls


class TransportSet:
    """The transports of one engine, by registry name, and what each can do beyond ``run``.

    Discovery runs once here: the engine's hot paths read the dicts, never ``isinstance``.

    Args:
        transports: registry name -> loaded transport, in load order (ties in priority go
            to the first).

    Raises:
        InvalidArgument: none of them has a control channel (handshakes, fences and grants
            need one).
    """

    def __init__(self, transports: dict[str, Transport]) -> None:
        self.by_name = transports
        ranked = sorted(transports.values(), key=lambda t: -t.capabilities.priority)
        self.first = [t for t in ranked if t.capabilities.any_protocol]
        self.ranked = ranked  # the "auto" preference order
        self.vectored: dict[str, VectoredIO] = {
            n: t for n, t in transports.items() if isinstance(t, VectoredIO)}
        self.one_item: dict[str, OneItemIO] = {
            n: t for n, t in transports.items() if isinstance(t, OneItemIO)}
        self.mapped_one: dict[str, MappedOneIO] = {
            n: t for n, t in transports.items() if isinstance(t, MappedOneIO)}
        self.route_one: dict[str, RouteOneIO] = {
            n: t for n, t in transports.items() if isinstance(t, RouteOneIO)}
        self.prunable = [t for t in transports.values() if isinstance(t, Prunable)]
        self.registers_by_name: dict[str, RegistersMemory] = {
            n: t for n, t in transports.items() if isinstance(t, RegistersMemory)}
        self.registers = list(self.registers_by_name.values())
        control = [t for t in ranked if isinstance(t, ControlChannel)]
        if not control:
            raise InvalidArgument(f"none of the transports {sorted(transports)} has a control "
                                  "channel (the handshake, fences and grants use it)")
        self.control: ControlChannel = control[0]

    @classmethod
    def load(cls, names: Iterable[str], ctx: TransportContext) -> TransportSet:
        """Load and construct ``names``; what was constructed is closed if one fails."""
        loaded: dict[str, Transport] = {}
        try:
            for n in names:
                loaded[n] = load(n)(ctx)
            return cls(loaded)
        except BaseException:
            for t in loaded.values():
                t.close()
            raise

    def fallback(self, t: Transport, route: Route) -> Transport | None:
        """The first loaded transport of ``t``'s fallbacks that reaches ``route`` (or None)."""
        for name in t.capabilities.fallbacks:
            f = self.by_name.get(name)
            if f is not None and f.can_reach(route):
                return f
        return None

    def close(self) -> None:
        """Close every transport (each ``close`` is idempotent)."""
        for t in self.by_name.values():
            t.close()
