"""Which fabric serves a requested protocol: the one place ``rdma`` (and Mooncake's other
hardware names) becomes a transport, and says so.

:func:`resolve` turns a requested protocol into a :class:`FabricChoice`: the engine protocol,
the transports the engine loads and a one-line reason.

* ``auto`` (or ""): shared memory on one host, then NIXL (when available), then TCP; the
  engine's "auto" priority order does that once "nixl" is loaded (local 4, shm 3, nixl/file 2,
  tcp 1).
* ``rdma`` and Mooncake's other hardware names (:data:`HARDWARE`): NIXL when available (UCX then
  picks the fabric: InfiniBand/RoCE verbs, shared memory, TCP), else TCP with one warning line
  per process that says how to install NIXL.
* ``nixl``: NIXL; an error when it is not installed.
* ``tcp``, ``shm``, ``file``, ``local``: that transport, as before.

NIXL is *available* when its Python package is installed (found with
:func:`importlib.util.find_spec`, never imported here: importing it starts nothing, but costs
time) and the "nixl" transport is registered. ``KVPLANE_NIXL`` decides whether defaults use it:
``auto`` (when available), ``on`` (required: an error when missing), ``off`` (never for
``auto``/``rdma``; an explicit ``nixl`` still loads it).

Imports the transport registry only (never a transport module).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import threading
from dataclasses import asdict, dataclass
from typing import Any

from kvplane.common import envs
from kvplane.common.errors import InvalidArgument

log = logging.getLogger(__name__)

NIXL = "nixl"  # registry name of the NIXL transport
NIXL_PACKAGES = ("nixl_cu12", "nixl")  # import names of the NIXL wheels, in preference order
INSTALL_HINT = "pip install --no-deps nixl-cu12==1.5.1"
# Mooncake protocol names that ask for a hardware fabric kvplane serves with NIXL (else TCP)
HARDWARE = frozenset({"rdma", "efa", "cxl", "ascend", "ub", "ubshmem", "maca", "sunrise_link",
                      "nvlink", "nvlink_intra", "hip", "barex", "musa", "nvmeof"})
DEFAULT_TRANSPORTS = ("tcp", "shm", "file", "local")
PLAIN = ("tcp", "shm", "file", "local")

_warned = False
_warn_lock = threading.Lock()


@dataclass(frozen=True)
class FabricChoice:
    """What a requested protocol resolved to.

    Attributes:
        requested: the protocol as asked for, lower-cased ("" reads as ``auto``).
        protocol: the engine protocol (``auto``, ``tcp``, ``shm``, ``file``, ``local``, ``nixl``).
        transports: registry names the engine loads.
        reason: one line saying why (shown in ready lines and ``/status``).
    """

    requested: str
    protocol: str
    transports: tuple[str, ...]
    reason: str

    def as_dict(self) -> dict[str, Any]:
        """The choice as JSON-ready fields (``transports`` a list)."""
        out = asdict(self)
        out["transports"] = list(self.transports)
        return out


@functools.cache
def nixl_package() -> str | None:
    """The import name of the installed NIXL package (``nixl_cu12``, then ``nixl``), or None;
    nothing is imported. Probed once per process."""
    for name in NIXL_PACKAGES:
        try:
            if importlib.util.find_spec(name) is not None:
                return name
        except (ImportError, ValueError):
            continue
    return None


def nixl_registered() -> bool:
    """Whether a "nixl" transport is in the registry."""
    from kvplane.transfer.plugins import TRANSPORTS

    return NIXL in TRANSPORTS.names()


def nixl_available() -> bool:
    """NIXL is installed and its transport registered."""
    return nixl_package() is not None and nixl_registered()


def _why_not() -> str:
    if nixl_package() is None:
        return f"NIXL is not installed ({INSTALL_HINT})"
    return "no 'nixl' transport is registered in this kvplane"


def _mode() -> str:
    mode = str(envs.get("KVPLANE_NIXL")).strip().lower()
    if mode not in ("auto", "on", "off"):
        raise InvalidArgument(f"KVPLANE_NIXL={mode!r}: choose auto, on or off")
    return mode


def _with_nixl(transports: tuple[str, ...]) -> tuple[str, ...]:
    return transports if NIXL in transports else (*transports, NIXL)


def warn_tcp_once(requested: str, why: str) -> None:
    """The one warning line per process that a hardware protocol is served by TCP."""
    global _warned
    with _warn_lock:
        if _warned:
            return
        _warned = True
    log.warning("protocol %r is served by TCP: %s", requested, why)


def resolve(requested: str, transports: tuple[str, ...] = DEFAULT_TRANSPORTS) -> FabricChoice:
    """The engine protocol and transports for ``requested``.

    Args:
        requested: a kvplane or Mooncake protocol name (case-free; "" is ``auto``).
        transports: the transports the engine would load; "nixl" is added to the defaults
            (:data:`DEFAULT_TRANSPORTS`) when the choice uses NIXL, and to any set for an
            explicit ``nixl``.

    Raises:
        InvalidArgument: ``nixl`` (or ``KVPLANE_NIXL=on``) without NIXL, a bad
            ``KVPLANE_NIXL``, or a protocol that names no transport.
    """
    req = (requested or "").strip().lower() or "auto"
    mode = _mode()
    defaults = tuple(transports) == DEFAULT_TRANSPORTS
    if req == NIXL:
        if not nixl_available():
            raise InvalidArgument(f"protocol 'nixl': {_why_not()}")
        return FabricChoice(req, NIXL, _with_nixl(transports), "NIXL asked for (UCX picks the "
                            "fabric; tcp where a peer has no NIXL agent)")
    if req not in ("auto", *HARDWARE):
        if req not in PLAIN and req not in transports:
            raise InvalidArgument(f"protocol {requested!r}: choose auto, tcp, shm, file, nixl "
                                  "or rdma")
        return FabricChoice(req, req, tuple(transports), f"{req} asked for")
    use = mode != "off" and (NIXL in transports or (defaults and nixl_available()))
    if mode == "on" and not use:
        raise InvalidArgument(f"KVPLANE_NIXL=on: {_why_not()}")
    if req == "auto":
        if use:
            return FabricChoice(req, "auto", _with_nixl(transports),
                                "auto: shm on one host, then nixl, then tcp")
        why = "KVPLANE_NIXL=off" if mode == "off" else _why_not()
        return FabricChoice(req, "auto", tuple(transports),
                            f"auto: shm on one host, else tcp (no nixl: {why})")
    if use:
        return FabricChoice(req, NIXL, _with_nixl(transports),
                            f"{req} served by NIXL (UCX picks the fabric)")
    why = "KVPLANE_NIXL=off" if mode == "off" else _why_not()
    warn_tcp_once(req, why)
    return FabricChoice(req, "tcp", tuple(transports), f"{req} served by TCP: {why}")


NAMES = ("auto", *PLAIN, NIXL, *sorted(HARDWARE))


def normalise(requested: str) -> str:
    """``requested`` lower-cased ("" reads as ``auto``), checked to be a protocol
    :func:`resolve` knows; what integrations keep in their configs (the engine resolves it).

    Raises:
        InvalidArgument: an unknown protocol.
    """
    req = (str(requested) or "").strip().lower() or "auto"
    if req not in NAMES:
        raise InvalidArgument(f"protocol {requested!r}: choose auto, tcp, shm, nixl or rdma "
                              f"(or a Mooncake hardware name: {', '.join(sorted(HARDWARE))})")
    return req


def record(choice: FabricChoice) -> None:
    """Export ``choice`` as the ``kvplane_transfer_fabric_info`` gauge (1 for this choice)."""
    from kvplane.common.metrics import TRANSFER_FABRIC

    TRANSFER_FABRIC.labels(requested=choice.requested, protocol=choice.protocol,
                           transports=",".join(choice.transports)).set(1)


def _reset_warning() -> None:
    """Forget the once-per-process warning (tests)."""
    global _warned
    with _warn_lock:
        _warned = False
