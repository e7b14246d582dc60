"""The master's status document (``GET /status``) and its ring buffer of samples.

Owns what ``kvplane status``, ``kvplane top`` and ``/dashboard`` show of a master: segments
(capacity, usage, liveness, replicas held), object and replica counts, evictions, RPC counts,
and rates (ops/s) computed from :class:`History`, a bounded ring of periodic samples.

Pure: no sockets, threads or clock reads; the server passes ``now`` (monotonic) and ``wall``
(epoch seconds) and calls under its state lock. Must not import the server or HTTP modules.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from kvplane.store.master.state import MasterState

# RPC methods counted as each kind of operation in the ops figures (one op per key a call names),
# except puts: objects committed (``COMMITTED``, counted by the server's PutEnd), so that a put
# through a spare (no PutStart), a batch, an upsert or a retried PutStart counts once
COMMITTED = "put_committed"
OPS = {"put": (COMMITTED,), "get": ("get_replicas",), "exist": ("exist",),
       "remove": ("remove", "remove_regex", "remove_all")}
SAMPLE_EVERY = 1.0  # seconds between samples
KEEP = 600  # samples kept: ten minutes at one a second
RATE_WINDOW = 10.0  # seconds over which ops/s and evictions/s are averaged


@dataclass(frozen=True)
class Sample:
    """Cumulative counters and levels at one moment (``t`` monotonic, ``wall`` epoch)."""

    t: float
    wall: float
    ops: dict[str, int]
    evicted: int
    objects: int
    used: int
    capacity: int
    segments: int

    def as_dict(self) -> dict[str, Any]:
        return {"wall": round(self.wall, 3), "ops": self.ops, "evicted": self.evicted,
                "objects": self.objects, "used_bytes": self.used,
                "capacity_bytes": self.capacity, "segments": self.segments}


@dataclass
class History:
    """The last ``keep`` samples, one per ``every`` seconds at most."""

    every: float = SAMPLE_EVERY
    keep: int = KEEP
    samples: deque[Sample] = field(default_factory=deque)

    def due(self, now: float) -> bool:
        """True when the last sample is at least ``every`` seconds old (or there is none)."""
        return not self.samples or now - self.samples[-1].t >= self.every

    def add(self, sample: Sample) -> None:
        self.samples.append(sample)
        while len(self.samples) > self.keep:
            self.samples.popleft()

    def rates(self, current: Sample, window: float = RATE_WINDOW) -> dict[str, float]:
        """Per-second rates of each op kind and of evictions, from the oldest sample inside
        ``window`` to ``current`` (all zero before there are two points)."""
        base = next((s for s in self.samples if current.t - s.t <= window), None)
        out = {k: 0.0 for k in (*OPS, "evictions")}
        if base is None or current.t - base.t <= 0:
            return out
        span = current.t - base.t
        for k in OPS:
            out[k] = round((current.ops.get(k, 0) - base.ops.get(k, 0)) / span, 3)
        out["evictions"] = round((current.evicted - base.evicted) / span, 3)
        return out


def op_totals(key_ops: dict[str, int]) -> dict[str, int]:
    """Keys named by RPCs, by method, grouped into the op kinds of ``OPS``."""
    return {kind: sum(key_ops.get(m, 0) for m in methods) for kind, methods in OPS.items()}


def sample(state: MasterState, key_ops: dict[str, int], now: float, wall: float) -> Sample:
    """The counters and levels of ``state`` now (``key_ops``: keys named by RPCs, by method)."""
    segs = state.segments.values()
    return Sample(now, wall, op_totals(key_ops), state.evicted, len(state.objects),
                  sum(s.alloc.used for s in segs), sum(s.alloc.capacity for s in segs),
                  len(state.segments))


def liveness(state: MasterState, name: str, now: float) -> tuple[str, float | None]:
    """(``alive`` | ``late`` | ``suspect``, seconds since its owner's last heartbeat).

    ``late``: no heartbeat for over half the client TTL (the master drops the segment at the
    TTL). ``suspect``: a client reported a failed transfer to it.
    """
    seg = state.segments[name]
    client = state.clients.get(seg.info.client_id)
    age = None if client is None else max(0.0, now - client.last_seen)
    if seg.suspect_since is not None:
        return "suspect", age
    if age is None or age > state.config.client_ttl / 2:
        return "late", age
    return "alive", age


def segments(state: MasterState, now: float, admin: bool) -> list[dict[str, Any]]:
    """One row per mounted segment (``client_id`` only for the admin)."""
    held = state.cols.census().per_segment
    rows = []
    for name, seg in state.segments.items():
        status, age = liveness(state, name, now)
        cap, used = seg.alloc.capacity, seg.alloc.used
        rows.append({"name": name, "endpoint": seg.info.endpoint, "host_id": seg.info.host_id,
                     **({"client_id": seg.info.client_id} if admin else {}),
                     "capacity_bytes": cap, "used_bytes": used,
                     "usage_percent": round(100 * used / cap, 2) if cap else 0.0,
                     "replicas": held[name], "status": status,
                     "heartbeat_age_s": None if age is None else round(age, 3)})
    return rows


def objects(state: MasterState) -> dict[str, int]:
    """Object and replica counts."""
    counts = state.cols.census()  # whole-column scans, not a loop over the objects
    return {"objects": counts.objects, "pending_puts": counts.pending,
            "replicas": counts.replicas, "bytes": counts.bytes,
            "under_replicated": state.repairs.under_replicated(),
            "repairs_pending": len(state.repairs.pending),
            "hard_pinned": counts.hard_pinned}


def document(state: MasterState, history: History, key_ops: dict[str, int],
             rpc_calls: dict[str, int], now: float, wall: float, master: dict[str, Any],
             admin: bool = False,
             with_history: bool = False) -> dict[str, Any]:
    """The whole ``/status`` document.

    Args:
        state: the master's state (read under the caller's lock).
        history: its samples (for rates, and the series with ``with_history``).
        key_ops: keys named by the RPCs served so far, by method (a remove_regex or
            remove_all counts one), and ``COMMITTED``: objects PutEnd committed.
        rpc_calls: RPCs served so far, by method.
        now: monotonic seconds; wall: epoch seconds (for the samples' timestamps).
        master: identity of the master (address, uptime, role: "leader" if absent...),
            passed through.
        admin: include segment owners.
        with_history: include the samples (oldest first).
    """
    current = sample(state, key_ops, now, wall)
    cfg = state.config
    master = {"role": "leader", **master}  # (the server says "standby" for an HA standby)
    doc: dict[str, Any] = {
        "master": {**master, "epoch": state.epoch, "view_version": state.view_version},
        "masters": [master],  # this one (with HA: /ha_status names the leader)
        "config": {"lease_ttl_s": cfg.lease_ttl, "client_ttl_s": cfg.client_ttl,
                   "high_watermark": cfg.high_watermark, "evict_ratio": cfg.evict_ratio},
        "capacity_bytes": current.capacity, "used_bytes": current.used,
        "clients": len(state.clients),
        "segments": segments(state, now, admin),
        "objects": objects(state),
        "evictions": {"total": state.evicted, "alloc_failures": state.alloc_failures},
        "ops": {"total": current.ops, "per_s": history.rates(current), "rpc_calls": dict(rpc_calls)},
    }
    if with_history:
        doc["history"] = [s.as_dict() for s in history.samples]
    return doc
