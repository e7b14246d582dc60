"""The master side of moving hash slots between shards, and of re-cutting a segment's shares.

A move of slots from a source shard to a target (driven by ``mover.py``) goes:

1. The map lists the slots as moving (``ShardMap.moving``): the source serves their reads and
   the ends of puts already started, the target nothing (``role.py``).
2. ``shard_export`` on the source: how many puts of those slots are still open; with
   ``freeze``, no put of them may end any more, and the answer lists every complete object of
   them with its replicas (each under a fresh read lease, so the space is not reused while the
   mover copies it) and how many replicas it wants.
3. The mover reads each object and puts it into the target with ``shard_import`` (a PutStart
   of the object's internal key, replica count and pin, in the target's shares) and
   ``shard_import_end`` (its PutEnd, with the object's checksum).
4. A new map gives the slots to the target (the source first: it redirects from then on).
5. ``shard_release`` on the source drops the objects of slots it no longer owns (their space
   is reused once their read leases end; held readers are fenced by the heartbeat, as for a
   forced remove).

A failed move ends with a map that gives the slots back to the source, and ``shard_release``
on the target drops what it had imported. Every step checks the shard's epoch the mover
first saw (``expect``): a shard that restarted or failed over in between has lost its moving
state, so the move starts over.

``shard_reshare`` re-cuts one segment's share on this shard for a host, in place (the share's
allocator is resized; every allocation and object stays where it is): a share that shrinks
keeps its base and gives up a free tail (the shard finds how much of it is free: nothing
allocated, quarantined or fenced lies there), a share that grows takes the range after it. A
share mounted for a shard new to the segment takes no placements until the host has cleared
the headers left in it (its adoption of no records ends that).

Handlers run under the master's lock. Imports the master's state and serving layers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvplane.store.errors import InvalidParams, SlotMoving
from kvplane.store.master.access import require_service
from kvplane.store.master.allocator import ALIGN, OffsetAllocator
from kvplane.store.master.serving import Handlers, Serving
from kvplane.store.shard.messages import (
    Exported,
    ExportRep,
    ExportReq,
    ImportEndReq,
    ImportReq,
    ReleaseReq,
    ReshareRep,
    ReshareReq,
)
from kvplane.store.shard.slots import IN, OTHER, OUT, SLOTS, slot_of_internal
from kvplane.store.types import CodesRep, MountRep, ReplicateConfig, ResultsRep

if TYPE_CHECKING:
    from kvplane.store.shard.role import ShardRole


def _mask(ranges: list[tuple[int, int]]) -> bytearray:
    mask = bytearray(SLOTS)
    for first, end in ranges:
        if not 0 <= first < end <= SLOTS:
            raise InvalidParams(f"bad slot range [{first}, {end})")
        mask[first:end] = b"\x01" * (end - first)
    return mask


class MoveRpc:
    """The move and reshare RPCs of one shard (see the module docstring).

    Args:
        role: the shard's role (its slot table).
        serving: the state being served.
    """

    def __init__(self, role: ShardRole, serving: Serving) -> None:
        self.role, self.serving = role, serving

    def handlers(self) -> Handlers:
        return {"shard_export": (self.export, ExportReq),
                "shard_import": (self.import_start, ImportReq),
                "shard_import_end": (self.import_end, ImportEndReq),
                "shard_release": (self.release, ReleaseReq),
                "shard_reshare": (self.reshare, ReshareReq)}

    def _expect(self, epoch: int) -> None:
        require_service("moving slots")
        if epoch and epoch != self.serving.state.epoch:
            raise SlotMoving(f"shard {self.role.me} restarted or failed over during the move "
                             f"(epoch {self.serving.state.epoch}, not {epoch})")

    def _in_state(self, mask: bytearray, want: int) -> None:
        state = self.role.table.state
        if any(m and state[s] != want for s, m in enumerate(mask)):
            raise InvalidParams(f"shard {self.role.me}: those slots are not moving "
                                f"{'out of' if want == OUT else 'into'} it (map "
                                f"v{self.role.map.version})")

    def export(self, req: ExportReq) -> ExportRep:
        self._expect(req.expect)
        st, mask = self.serving.state, _mask(req.ranges)
        self._in_state(mask, OUT)
        pending = sum(1 for k in st.open_puts if mask[slot_of_internal(k)])
        if not req.freeze:
            return ExportRep(st.epoch, pending)
        frozen = self.role.frozen
        for first, end in req.ranges:
            frozen[first:end] = b"\x01" * (end - first)
        now = self.serving.clock()
        keys = [k for k, o in st.objects.items() if o.complete and mask[slot_of_internal(k)]]
        results = st.get_replicas_many(keys, now)  # leased: not reused while copied
        out = [Exported(k, r, st.objects[k].want, st.objects[k].hard_pin)
               for k, r in zip(keys, results) if r.code == 0]
        return ExportRep(st.epoch, pending, out, st.config.lease_ttl)

    def import_start(self, req: ImportReq) -> ResultsRep:
        self._expect(req.expect)
        st = self.serving.state
        self._in_state(_mask([(slot_of_internal(k), slot_of_internal(k) + 1)
                              for k in req.keys]), IN)
        now = self.serving.clock()
        window = st.write_window(req.ttl)
        out = [st.put_start(k, n, ReplicateConfig(replica_num=w, with_hard_pin=p), now,
                            client_id=req.client_id, window=window, checksum=c, nonce=req.nonce)
               for k, n, c, w, p in zip(req.keys, req.sizes, req.checksums, req.wants, req.pins,
                                        strict=True)]
        return ResultsRep(out, window)

    def import_end(self, req: ImportEndReq) -> CodesRep:
        self._expect(req.expect)
        st, now = self.serving.state, self.serving.clock()
        return CodesRep([st.put_end(k, now, v, c) for k, v, c in
                         zip(req.keys, req.versions, req.checksums, strict=True)])

    def release(self, req: ReleaseReq) -> int:
        require_service("moving slots")
        st, mask, state = self.serving.state, _mask(req.ranges), self.role.table.state
        now = self.serving.clock()
        gone = [k for k in st.objects if mask[s := slot_of_internal(k)] and state[s] == OTHER]
        for k in gone:
            obj = st.objects.get(k)
            if obj is not None and obj.complete:
                st.remove(k, True, now)
            elif obj is not None:
                st.put_revoke(k, now)
        st.retiring.clear()  # held readers are fenced through their segments' heartbeats
        return len(gone)

    def reshare(self, req: ReshareReq) -> ReshareRep:
        require_service("re-cutting a segment's shares")
        st, now = self.serving.state, self.serving.clock()
        info = req.segment
        old = st.segments.get(info.name)
        if old is None:  # a share new to this shard: no placements until the host cleared it
            floor = st.mount(req.client_id, [info], now, adopt=True)
            st.view_version += 1
            return ReshareRep(MountRep(st.epoch, floor, st.secret), info.size, fresh=True)
        if old.info.client_id != req.client_id or old.info.base != info.base:
            raise InvalidParams(f"segment {info.name!r}: a share is re-cut at its end, by its "
                                "owner")
        size = self._free_tail(old.alloc, info.size) if req.shrink else info.size
        if size != old.alloc.capacity:  # in place: every allocation and object stays
            st.resize_segment(old, size)
            st.view_version += 1
        return ReshareRep(MountRep(st.epoch, st.floor(), st.secret), size, fresh=False)

    @staticmethod
    def _free_tail(alloc: OffsetAllocator, least: int) -> int:
        """The smallest end >= ``least`` (4 KiB aligned) past which ``alloc`` is all free."""
        end = max(-(-least // 4096), -(-alloc.free_tail() // 4096)) * 4096
        return min(max(end, ALIGN), alloc.capacity)


def handlers(role: ShardRole, serving: Serving) -> Handlers:
    """The move and reshare RPCs of ``role``'s shard."""
    return MoveRpc(role, serving).handlers()
