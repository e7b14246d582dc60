"""The kvplane exception tree. Every boundary maps foreign errors into one of these.

::

    KVPlaneError                      (code -1000, not retryable)
    ├── InvalidArgument               bad input from the caller; nothing was touched
    │   └── AddressNotRegistered      an address/length outside every registered region
    ├── NotFound                      unknown key, segment, batch, ...
    ├── Conflict                      already exists / overlapping / busy
    │   └── Fenced                    a transfer against a freed allocation (stale generation)
    ├── NoSpace                       allocation failed
    ├── Unavailable      (retryable)  peer or service unreachable, connection dropped
    ├── Timeout          (retryable)  a deadline passed
    ├── ProtocolError                 malformed or hostile frame, version mismatch
    ├── Unauthorized                  shared token missing or wrong
    ├── DeviceFailed                  a device (CUDA, a stand-in) failed or refused a copy
    └── MissingExtra                  an optional dependency is not installed (also an ImportError)

``code`` is a stable negative integer carried on the wire; ``from_code`` turns it back into a
class on the other side.
"""

from __future__ import annotations


class KVPlaneError(Exception):
    """Root of every kvplane error."""

    code: int = -1000
    retryable: bool = False


class InvalidArgument(KVPlaneError):
    """The caller passed something invalid; no memory or state was touched."""

    code = -1001


class AddressNotRegistered(InvalidArgument):
    """An (address, length) range is not inside one registered memory region."""

    code = -1002


class NotFound(KVPlaneError):
    """The named object (segment, key, batch) does not exist."""

    code = -1003


class Conflict(KVPlaneError):
    """The object exists already, overlaps another, or is busy."""

    code = -1004


class Fenced(Conflict):
    """The allocation a transfer targeted was freed, or belongs to another master epoch: the
    data listener refused the stale generation and touched no memory."""

    code = -1020


class NoSpace(KVPlaneError):
    """An allocation could not be satisfied."""

    code = -1005


class Unavailable(KVPlaneError):
    """A peer or service could not be reached or dropped the connection."""

    code = -1006
    retryable = True


class Timeout(KVPlaneError):
    """A deadline passed before the operation completed."""

    code = -1007
    retryable = True


class ProtocolError(KVPlaneError):
    """A malformed, oversized or otherwise hostile frame."""

    code = -1008


class Unauthorized(KVPlaneError):
    """The shared token was missing or wrong."""

    code = -1009


class DeviceFailed(KVPlaneError):
    """A device copy (device <-> host staging) failed or was refused: the bytes it carried
    were not moved, and nothing that depended on them was reported done."""

    code = -1011


class MissingExtra(KVPlaneError, ImportError):
    """An optional dependency is not installed; the message names the pip extra to add."""

    code = -1010


_BY_CODE: dict[int, type[KVPlaneError]] = {
    cls.code: cls
    for cls in (
        KVPlaneError,
        InvalidArgument,
        AddressNotRegistered,
        NotFound,
        Conflict,
        Fenced,
        NoSpace,
        Unavailable,
        Timeout,
        ProtocolError,
        Unauthorized,
        DeviceFailed,
        MissingExtra,
    )
}


def register_code(cls: type[KVPlaneError]) -> type[KVPlaneError]:
    """Add a component's error class to the wire code table (used as a class decorator).

    Raises:
        ValueError: if the code is taken by another class.
    """
    prev = _BY_CODE.get(cls.code)
    if prev is not None and prev is not cls:
        raise ValueError(f"error code {cls.code} already used by {prev.__name__}")
    _BY_CODE[cls.code] = cls
    return cls


def from_code(code: int, message: str) -> KVPlaneError:
    """Build the exception for a wire error code (unknown codes become ``KVPlaneError``)."""
    return _BY_CODE.get(code, KVPlaneError)(message)
