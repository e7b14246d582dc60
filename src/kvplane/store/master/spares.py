"""Spares: an allocation made one put ahead, so that a client's next put takes two round trips.

A put is PutStart (the master places it), the write, and PutEnd (the master commits it). A
client that puts one object after another asks, with each PutEnd, for a *spare*: the master
places the next object now (same size, same header length, same config) as an unfinished put
under a name no user key can have (``name_of``). The client's next put of a fitting object
writes its header and value into the spare and commits it under its own key with its PutEnd
(``commit``), which asks for the next spare: write and PutEnd, no PutStart.

What does not change: the space is placed, fenced, quarantined and freed by the same rules as
any unfinished put's (its writer's death, its segment's loss, the release timeout), the writer
must begin its copies inside the spare's write window, and the object is readable only once the
commit says so. A commit under a key that exists or is being written drops the spare (its
record is forgotten at the segment) and answers ObjectExists, as PutStart would have.

Pure: operates on the master's ``ObjectTable`` (the server holds its lock), no I/O, no clocks;
a service of the table (``table.py``): it must not import the state, an RPC module or the server.
"""

from __future__ import annotations

from kvplane.common.errors import KVPlaneError
from kvplane.store import inventory
from kvplane.store.errors import InvalidParams, ObjectExists, ObjectNotFound
from kvplane.store.master.rows import Row
from kvplane.store.master.table import Obj, ObjectTable
from kvplane.store.types import KeyResult, SpareAsk

PREFIX = "\x00\x00spare\x00"  # NUL: never a user key; the empty tenant: never a tenant's key
MAX_SPARE = 1 << 20  # bytes of value: larger puts gain nothing from one round trip less
_MIN_HDR = inventory.header_len(b"k")
_MAX_HDR = inventory.header_len(b"k" * 4096)


def name_of(client_id: str, version: int) -> str:
    """The internal key of the spare made for ``client_id`` with ``version``."""
    return f"{PREFIX}{client_id}\x00{version}"


def grant(state: ObjectTable, client_id: str, ask: SpareAsk, now: float,
          local: frozenset[str], window: float) -> tuple[str, KeyResult] | None:
    """Place a spare for ``client_id``'s next put (``ask``); None when it cannot be placed
    without evicting or without taking the pool past its eviction watermark, or is out of
    range (the key table full, a config PutStart would refuse)."""
    cfg = ask.config
    if not (0 < ask.size <= MAX_SPARE and _MIN_HDR <= ask.hdr <= _MAX_HDR
            and ask.hdr % inventory.ALIGN == 0 and cfg.replica_num >= 1):
        return None
    if len(state.objects) >= state.config.max_keys:
        return None
    cap = state.usage.capacity
    want = (ask.hdr + ask.size) * cfg.replica_num
    if not cap or (state.usage.used + want) / cap > state.config.high_watermark:
        return None  # a spare never makes the master evict: only space the pool does not need
    try:
        pin = state.soft_pin_ttl(cfg)
        replicas = state.place(ask.hdr + ask.size, cfg, now, local, evict=False)
    except KVPlaneError:
        return None
    version = replicas[0][2]  # the put's generation
    obj = Obj(ask.size, tuple(replicas), False, now, hard_pin=cfg.with_hard_pin,
              version=version, want=cfg.replica_num, writer=client_id,
              window_until=now + state.write_window(window), hdr=ask.hdr,
              flags=inventory.FLAG_HARD_PIN if cfg.with_hard_pin else 0, soft_pin_ttl=pin)
    name = name_of(client_id, version)
    state.insert(name, obj)
    return name, KeyResult(0, obj.replicas_of(state.segments), ask.size, version)


def renew(state: ObjectTable, client_id: str, name: str, version: int, now: float,
          window: float) -> KeyResult | None:
    """Hand out spare ``name``, placed for ``client_id`` earlier and not yet handed out, as
    if placed now: its write window and age start afresh (as a PutStart retry's do). None if it
    is no longer that client's unwritten spare (pre-empted, dropped with its segment, a new
    master)."""
    obj = _mine(state, client_id, name, version)
    if obj is None:
        return None
    put = state.cols.puts[obj.row]
    put.started = now
    put.window_until = now + state.write_window(window)
    return KeyResult(0, obj.replicas_of(state.segments), obj.size, version)


def unwritten(state: ObjectTable, client_id: str, name: str, version: int) -> bool:
    """Whether ``name`` is still ``client_id``'s unwritten spare of ``version``."""
    return _mine(state, client_id, name, version) is not None


def _mine(state: ObjectTable, client_id: str, name: str, version: int) -> Row | None:
    """Spare ``name`` if it is still ``client_id``'s unwritten one of ``version``."""
    obj = state.objects.get(name)
    if (not name.startswith(PREFIX) or obj is None or obj.complete or obj.writer != client_id
            or obj.version != version):
        return None
    return obj


def commit(state: ObjectTable, client_id: str, name: str, key: str, version: int,
           checksum: int, now: float) -> int:
    """Make spare ``name`` (written by ``client_id`` with ``version``) the object ``key``, owned
    by ``client_id``: 0, or ObjectNotFound (no such spare: pre-empted, dropped with its
    segment, or a master that never made it), ObjectExists, InvalidKey or InvalidParams (the
    spare is dropped)."""
    obj = _mine(state, client_id, name, version)
    if obj is None:
        return ObjectNotFound.code
    try:
        state.check_key(key)
        if inventory.header_len(key) != obj.hdr:
            raise InvalidParams("the key's header does not fit the spare")
        old = state.objects.get(key)
        if old is not None:
            if old.complete:
                raise ObjectExists(f"{key!r} exists")
            if now - old.started < state.config.put_discard_timeout:
                raise ObjectExists(f"{key!r} is being written")
            state.drop_object(key, old, now)
    except KVPlaneError as exc:  # its record names a key that stays as it was: drop it, its
        obj.window_until = now  # writer's copies over (only frames may be in flight: fenced)
        state.drop_object(name, obj, now)
        return exc.code
    c, row = state.cols, obj.row
    c.rename(row, key)
    c.owner[row] = c.owner_id(client_id)
    state.complete_row(row, key, now, checksum)  # (its version is the one _mine checked)
    return 0


def give_back(state: ObjectTable, client_id: str, name: str, version: int, written: bool,
              now: float) -> int:
    """``client_id`` gives its spare ``name`` back (0, or ObjectNotFound). One it ``written``
    into (a write that failed) is revoked: its space waits for the segment's fence. One it never
    wrote is freed at once: its writer is the only one who could have written there, and it
    says it did not (the same trust as a retirement report; such a client can already write
    registered memory with generation 0)."""
    obj = _mine(state, client_id, name, version)
    if obj is None:
        return ObjectNotFound.code
    if written:
        return state.put_revoke(name, now, version)
    for seg, off, _gen in obj.replicas:  # (on mounted segments only)
        state.segments[seg].alloc.free(off, obj.hdr + obj.size)
    state.cols.drop(obj.row)
    return 0
