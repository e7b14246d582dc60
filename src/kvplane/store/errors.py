"""Store errors, carrying Mooncake's numeric ErrorCode values on the wire.

::

    KVPlaneError
    ├── NotFound
    │   ├── ObjectNotFound        -704
    │   ├── SegmentNotFound       -101
    │   └── ClientNotFound        -103
    ├── Conflict
    │   ├── ObjectExists          -705
    │   ├── ObjectHasLease        -706
    │   ├── SegmentExists         -102
    │   └── ReplicaNotReady       -703
    ├── NoSpace
    │   └── NoAvailableHandle     -200
    │       └── ValueTooLarge     -1032 larger than any segment: can never fit (not retried)
    ├── InvalidArgument
    │   ├── InvalidKey            -400
    │   └── InvalidParams         -600
    ├── LeaseExpired              -707
    ├── Unavailable                    (retryable)
    │   ├── NotLeader             -1030 a standby, or a leader whose lease ran out (HA)
    │   └── Recovering            -1031 a new leader still re-registering what segments hold
    └── TransferFail              -800 (retryable)
        └── ChecksumMismatch      -1021 every replica read back with bytes that fail the checksum
"""

from __future__ import annotations

from kvplane.common.errors import (
    Conflict,
    InvalidArgument,
    KVPlaneError,
    NoSpace,
    NotFound,
    Unavailable,
    from_code,
    register_code,
)


@register_code
class ObjectNotFound(NotFound):
    """No complete object under that key (Mooncake OBJECT_NOT_FOUND)."""

    code = -704


@register_code
class ObjectExists(Conflict):
    """The key exists already; a plain put does not overwrite (OBJECT_ALREADY_EXISTS)."""

    code = -705


@register_code
class ObjectHasLease(Conflict):
    """A read lease blocks the removal (OBJECT_HAS_LEASE)."""

    code = -706


@register_code
class ReplicaNotReady(Conflict):
    """The object is still being written (REPLICA_IS_NOT_READY)."""

    code = -703


@register_code
class SegmentNotFound(NotFound):
    """SEGMENT_NOT_FOUND."""

    code = -101


@register_code
class SegmentExists(Conflict):
    """SEGMENT_ALREADY_EXISTS."""

    code = -102


@register_code
class ClientNotFound(NotFound):
    """CLIENT_NOT_FOUND."""

    code = -103


@register_code
class NoAvailableHandle(NoSpace):
    """No segment has room (NO_AVAILABLE_HANDLE)."""

    code = -200


@register_code
class ValueTooLarge(NoAvailableHandle):
    """The value is larger than the largest segment of the pool: it can never fit (Mooncake
    answers NO_AVAILABLE_HANDLE). PutStart's per-key answer carries the largest segment's
    size in ``KeyResult.size``; never retried."""

    code = -1032

    @staticmethod
    def message(key: str, size: int, largest: int) -> str:
        return (f"key {quoted(key)}: a value of {size} bytes can never fit: the largest segment "
                f"is {largest} bytes")


@register_code
class InvalidKey(InvalidArgument):
    """Empty, too long, or otherwise unusable key (INVALID_KEY)."""

    code = -400


@register_code
class InvalidParams(InvalidArgument):
    """INVALID_PARAMS."""

    code = -600


@register_code
class LeaseExpired(KVPlaneError):
    """The read lease ran out before the transfer finished (LEASE_EXPIRED)."""

    code = -707


@register_code
class NotLeader(Unavailable):
    """This master does not lead (a standby, or a leader whose lease ran out): ask etcd who
    does, and retry there."""

    code = -1030


@register_code
class Recovering(Unavailable):
    """The master is re-registering what the segments hold (after a failover or a restart);
    retry until the call's deadline."""

    code = -1031


@register_code
class TransferFail(KVPlaneError):
    """Every replica failed to transfer (TRANSFER_FAIL)."""

    code = -800
    retryable = True


@register_code
class ChecksumMismatch(TransferFail):
    """Every replica that could be read failed the object's checksum (corrupt or stale bytes)."""

    code = -1021


def key_error(code: int, key: str) -> KVPlaneError:
    """The exception for a per-key wire code, with the key and what the code means."""
    exc = from_code(code, "")
    doc = (f"error code {code}" if type(exc) is KVPlaneError
           else (type(exc).__doc__ or type(exc).__name__).strip().splitlines()[0].rstrip("."))
    exc.args = (f"key {quoted(key)}: {doc}",)
    return exc


QUOTED_KEY = 64  # characters of a key an error message shows


def quoted(key: str) -> str:
    """``key`` as an error message shows it: whole up to :data:`QUOTED_KEY` characters, else
    its start and its length (a 5,000-character key must not fill a terminal)."""
    if len(key) <= QUOTED_KEY:
        return repr(key)
    return f"{key[:QUOTED_KEY]!r}... ({len(key.encode(errors='replace'))} bytes)"
