"""NIXL transport: one-sided READ/WRITE through an NVIDIA NIXL agent (UCX backend), which
picks RDMA, GPUDirect, CUDA IPC, shared memory or TCP by what the hardware has.

* One agent per engine. Every region the engine registers is registered with the agent too
  (host memory as DRAM, ``cuda:N`` device regions as VRAM on device N); file regions and
  other devices are not, and routes to them go to the engine's other transports. Requests
  from local ``cuda:N`` memory come as DeviceSlices (``Capabilities.device_kinds``) and move
  VRAM to wherever directly; their fallback (TCP) stages them through host memory.
* The agent's metadata (its UCX address and the remote keys of its regions) is this
  transport's *advert*: it travels in the segment descriptor, so every metadata backend
  (P2PHANDSHAKE, HTTP, etcd, Redis) carries it. A peer loads it on its first route to the
  segment, and again whenever the descriptor's advert changed (new regions, new keys).
* A run is one NIXL transfer request per operation (READs and WRITEs apart), completion
  polled against the deadline: past it the request is released (UCX cancels it) and every
  slice reports TIMEOUT; a NIXL error reports FAILED with NIXL's text. A dead or stopped
  peer therefore ends within the deadline.
* Fencing, as the shm transport does it (no server mediates a one-sided copy): in a
  ``fenced`` region (a store segment) the owner's fence floor, its first 8 bytes, is read
  before and after the copy and a generation it does not admit fails the slice; a slice that
  carries a store generation and finished past its deadline reports TIMEOUT, never COMPLETED.
* Tenants: NIXL bypasses the listener's grants, so an engine whose listener serves tenants
  (``grants``) publishes no advert and registers nothing: it is reachable only over TCP.

Needs the ``nixl`` package (PyPI ``nixl-cu12``; import ``nixl_cu12``, or ``nixl``):
``pip install --no-deps nixl-cu12==1.5.1`` plus numpy (its declared dependencies pull torch
and CUDA wheels it does not need to import).
"""

from __future__ import annotations

import atexit
import bisect
import ctypes
import ctypes.util
import logging
import os
import secrets
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from kvplane.common.deadline import Deadline
from kvplane.common.errors import InvalidArgument
from kvplane.transfer.batch import Slice
from kvplane.transfer.fence import admits
from kvplane.transfer.memory import Region
from kvplane.transfer.seam import Capabilities, Route, Transport, TransportContext
from kvplane.transfer.transports.nixl_lists import LOCAL, Prepped, PreppedLists
from kvplane.transfer.transports.nixl_setup import INSTALL, avoid_exit_crash, import_nixl, new_agent
from kvplane.transfer.types import OpCode, RegionDesc, RegionKind, SegmentDesc, TransferStatus

log = logging.getLogger(__name__)
__all__ = ["INSTALL", "NixlTransport", "avoid_exit_crash", "import_nixl", "new_agent"]

_POLL_SPIN_S = 0.002  # busy-poll check_xfer_state this long (covers ~10 MiB at UCX's rates)
_POLL_NAP_S = (2e-5, 1e-3)  # then sleep a 32nd of the wait so far, within these bounds
_OP_NAMES = {OpCode.READ: "READ", OpCode.WRITE: "WRITE"}


@dataclass(frozen=True)
class _Remote:
    """A peer's agent as loaded into ours: its NIXL name and the advert it came from."""

    agent: str
    advert: bytes


class _Local(NamedTuple):
    """A region registered with our agent: where it is and its NIXL memory type."""

    addr: int
    end: int
    mem: str
    dev: int


Outcome = tuple[TransferStatus, str]


def _mem_type(device: str) -> tuple[str, int] | None:
    """NIXL memory type and device id of a region on ``device`` (None: not for NIXL)."""
    if not device:
        return "DRAM", 0
    if device.startswith("cuda"):
        _, _, idx = device.partition(":")
        return "VRAM", int(idx or 0)
    return None


def _addr_of(view: memoryview) -> int:
    """The address of a host slice's bytes (registered memory: a writable view)."""
    if not len(view):
        return 0
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    except TypeError:  # a read-only view
        return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def _local_addr(s: Slice) -> int:
    return s.addr if s.device else _addr_of(s.local)


class NixlTransport(Transport):
    """One-sided transfers through a NIXL agent (see the module docstring)."""

    name = "nixl"
    capabilities = Capabilities(priority=2, fallbacks=("tcp",), device_kinds=("cuda",))

    def __init__(self, ctx: TransportContext) -> None:
        super().__init__(ctx)
        self._nixl = import_nixl()
        self._lock = threading.Lock()
        self._remotes: dict[str, _Remote] = {}  # segment name -> loaded agent
        self._regs: dict[int, Any] = {}  # region addr -> NIXL registration descriptors
        # regions registered with the agent, by address, and those addresses (for bisect);
        # replaced as one tuple, so a reader never sees one without the other
        self._locals: tuple[tuple[_Local, ...], list[int]] = ((), [])
        self._closed = False
        self.agent_name = f"kvplane-{os.getpid()}-{secrets.token_hex(4)}"
        self._agent: Any = new_agent(self._nixl, self.agent_name)
        if "UCX" not in getattr(self._agent, "backends", {"UCX": None}):
            raise InvalidArgument("NIXL has no UCX backend here (check UCX_TLS and the plugins)")
        self.lists = PreppedLists(self._agent)
        # 8 bytes per concurrent fence check, registered once: READ the owner's floor into it
        self._scratch = np.zeros(4096, dtype=np.uint8)
        scratch = int(self._scratch.ctypes.data)
        self._scratch_reg = self._agent.register_memory([(scratch, self._scratch.nbytes, 0, "")],
                                                        "DRAM")
        self._index(_Local(scratch, scratch + self._scratch.nbytes, "DRAM", 0), add=True)
        self._scratch_free = list(range(0, self._scratch.nbytes, 8))
        _LIVE.add(self)

    # -- registration and advert ----------------------------------------------------------
    def on_register(self, region: Region) -> None:
        if self.ctx.grants or region.kind == RegionKind.FILE:
            return
        mt = _mem_type(region.device)
        if mt is None:
            return
        reg = self._agent.register_memory([(region.addr, region.length, mt[1], "")], mt[0])
        with self._lock:
            self._regs[region.addr] = reg
        self._index(_Local(region.addr, region.end, *mt), add=True)

    def on_unregister(self, region: Region) -> None:
        with self._lock:
            reg = self._regs.pop(region.addr, None)
        if reg is None:
            return
        self._index(_Local(region.addr, region.end, "", 0), add=False)
        self.lists.drop_region(region.addr)  # its prepared lists name the registration
        try:
            self._agent.deregister_memory(reg)
        except Exception as exc:  # the engine has dropped it either way
            log.warning("NIXL deregister of %#x failed: %s", region.addr, exc)

    def _index(self, region: _Local, add: bool) -> None:
        """Add ``region`` to (or remove the one at its address from) the local index."""
        with self._lock:
            regions = [r for r in self._locals[0] if r.addr != region.addr]
            if add:
                regions.append(region)
            regions.sort()
            self._locals = (tuple(regions), [r.addr for r in regions])

    def _local(self, addr: int, length: int) -> _Local | None:
        """The registered local region holding ``[addr, addr+length)``, if any."""
        regions, starts = self._locals
        i = bisect.bisect_right(starts, addr) - 1
        if i >= 0 and addr + length <= regions[i].end:
            return regions[i]
        return None

    def advert(self) -> bytes:
        if self.ctx.grants or self._closed:
            return b""
        return bytes(self._agent.get_agent_metadata())

    # -- routes ---------------------------------------------------------------------------
    def can_reach(self, route: Route) -> bool:
        if self._closed or not route.segment.adverts.get(self.name):
            return False
        return route.region.kind != RegionKind.FILE and _mem_type(route.region.device) is not None

    def _remote(self, seg: SegmentDesc) -> str:
        """The NIXL name of ``seg``'s agent, its advert loaded (again if it changed)."""
        md = seg.adverts[self.name]
        known = self._remotes.get(seg.name)
        if known is not None and known.advert == md:  # the same bytes object, mostly
            return known.agent
        with self._lock:
            known = self._remotes.get(seg.name)
            if known is not None and known.advert == md:
                return known.agent
            if known is not None:
                self.lists.drop_peer(known.agent)  # prepared against the old metadata
                try:
                    self._agent.remove_remote_agent(known.agent)
                except Exception:  # not loaded any more: load afresh
                    pass
            agent = self._agent.add_remote_agent(md)
            name = agent.decode() if isinstance(agent, bytes) else str(agent)
            self.lists.drop_peer(name)  # the same name loaded once before, under another segment
            self._remotes[seg.name] = _Remote(name, md)
            return name

    def forget(self, segment: str) -> None:
        """Drop a peer's loaded agent (its process went away)."""
        with self._lock:
            known = self._remotes.pop(segment, None)
        if known is not None:
            self.lists.drop_peer(known.agent)
            try:
                self._agent.remove_remote_agent(known.agent)
            except Exception:
                pass

    # -- the data path --------------------------------------------------------------------
    def run(self, route: Route, slices: list[Slice], deadline: Deadline) -> None:
        try:
            peer = self._remote(route.segment)
        except Exception as exc:
            for s in slices:
                s.done(TransferStatus.FAILED, f"NIXL could not load the peer's agent: {exc}")
            return
        if len(slices) == 1 and not slices[0].task.req.gen and self._one(peer, route, slices[0],
                                                                        deadline):
            return
        out: dict[int, Outcome] = {}  # slice index -> failure
        where = self._where(route, slices, out)
        gen = [i for i, s in enumerate(slices) if s.task.req.gen]
        fenced = [i for i in gen if i not in out and where[i].fenced]
        if fenced:
            self._fence(peer, slices, where, fenced, out, deadline,
                        "fenced: the segment serves another master epoch or a newer mount")
        if len(slices) == 1 or len({s.op for s in slices}) == 1:
            group = [i for i in range(len(slices)) if i not in out]
            if group:
                self._move(peer, slices[group[0]].op, slices, where, group, out, deadline)
        else:
            for op in (OpCode.READ, OpCode.WRITE):
                group = [i for i, s in enumerate(slices) if i not in out and s.op == op]
                if group:
                    self._move(peer, op, slices, where, group, out, deadline)
        if fenced:
            self._fence(peer, slices, where, [i for i in fenced if i not in out], out, deadline,
                        "fenced during the copy")
        if gen and deadline.expired():  # a store's copy that ended late is not a success
            for i in gen:
                out.setdefault(i, (TransferStatus.TIMEOUT, "copy finished past its deadline"))
        for i, s in enumerate(slices):
            if i in out:
                s.done(*out[i])
            else:
                s.done(TransferStatus.COMPLETED)

    def _one(self, peer: str, route: Route, s: Slice, deadline: Deadline) -> bool:
        """Run one unfenced slice inside the route's region (the common single request)
        with the least Python; False (nothing done) for any other."""
        r = route.region
        mt, lt = _mem_type(r.device), _mem_type(s.device)
        if mt is None or lt is None or not r.addr <= s.remote <= r.addr + r.length - s.length:
            return False
        if deadline.expired():
            s.done(TransferStatus.TIMEOUT, "deadline passed")
            return True
        moves = _Moves([_local_addr(s)], [s.remote], [s.length], [r], lt, mt)
        err = self._post(peer, _OP_NAMES[s.op], moves, deadline)
        if err is None:
            s.done(TransferStatus.COMPLETED)
        else:
            s.done(*err)
        return True

    def _where(self, route: Route, slices: list[Slice], out: dict[int, Outcome]
               ) -> list[RegionDesc]:
        """The peer's region of each slice (the route's, mostly); a slice in none that the
        peer registered with NIXL fails in ``out``."""
        first = route.region
        index: _RegionIndex | None = None
        where: list[RegionDesc] = []
        for i, s in enumerate(slices):
            region: RegionDesc | None = first
            if not first.addr <= s.remote <= first.addr + first.length - s.length:
                if index is None:
                    index = _RegionIndex(route.segment.regions)
                region = index.find(s.remote, s.length)
            if region is None or _mem_type(region.device) is None:
                out[i] = (TransferStatus.FAILED, f"range {s.remote:#x}+{s.length} is not in a "
                          "region the peer registered with NIXL")
            where.append(region or _NO_REGION)
        return where

    def _move(self, peer: str, op: OpCode, slices: list[Slice], where: list[RegionDesc],
              group: list[int], out: dict[int, Outcome], deadline: Deadline) -> None:
        """One NIXL request per (local, remote) memory type for ``group``; failures go to
        ``out``. A DeviceSlice's local side is VRAM at its ``addr`` (a local ``cuda:N``
        region, registered as VRAM), any other slice's is DRAM at its view."""
        if deadline.expired():
            for i in group:
                out[i] = (TransferStatus.TIMEOUT, "deadline passed")
            return
        by_type: dict[tuple[tuple[str, int], tuple[str, int]], list[int]] = {}
        for i in group:
            mt, lt = _mem_type(where[i].device), _mem_type(slices[i].device)
            assert mt is not None and lt is not None  # checked by run; device_kinds: cuda only
            by_type.setdefault((lt, mt), []).append(i)
        name = _OP_NAMES[op]
        for (lt, mt), part in by_type.items():
            moves = _Moves([_local_addr(slices[i]) for i in part],
                           [slices[i].remote for i in part], [slices[i].length for i in part],
                           [where[i] for i in part], lt, mt)
            err = self._post(peer, name, moves, deadline)
            if err is not None:
                for i in part:
                    out[i] = err

    def _request(self, peer: str, op: str, m: _Moves) -> tuple[Any, tuple[Prepped, ...]]:
        """A NIXL request for ``m``: from prepared lists where every move is one block of
        the same size in one local and one remote region (:mod:`.nixl_lists`), else from
        fresh descriptor lists. Returns it with the prepared lists it holds (release them
        after the request)."""
        n = m.lengths[0]
        loc = self._local(m.local[0], n)
        far = m.regions[0]
        if (loc is not None and (loc.mem, loc.dev) == m.lt
                and m.aligned(loc.addr, loc.end, far.addr, far.addr + far.length)):
            pair = self.lists.acquire_pair((LOCAL, loc.addr, loc.end - loc.addr, n, *m.lt),
                                           (peer, far.addr, far.length, n, *m.mt))
            if pair is not None:
                lp, rp = pair
                try:
                    return self._agent.make_prepped_xfer(
                        op, lp.handle, [(a - loc.addr) // n for a in m.local],
                        rp.handle, [(a - far.addr) // n for a in m.remote]), pair
                except BaseException:
                    self.lists.release(pair)
                    raise
        ldev, rdev = m.lt[1], m.mt[1]
        local = np.array([(a, k, ldev) for a, k in zip(m.local, m.lengths)], dtype=np.uint64)
        remote = np.array([(a, k, rdev) for a, k in zip(m.remote, m.lengths)], dtype=np.uint64)
        ag = self._agent
        return ag.initialize_xfer(op, ag.get_xfer_descs(local, m.lt[0]),
                                  ag.get_xfer_descs(remote, m.mt[0]), peer), ()

    def _post(self, peer: str, op: str, m: _Moves, deadline: Deadline) -> Outcome | None:
        """Post one request for ``m`` and wait for it within ``deadline``; None when it
        completed."""
        try:
            handle, held = self._request(peer, op, m)
        except Exception as exc:
            return TransferStatus.FAILED, f"NIXL refused the request: {exc}"
        try:
            state = self._agent.transfer(handle)
            if state == "PROC":
                state = self._wait(handle, deadline)
            if state is None:
                return TransferStatus.TIMEOUT, "NIXL transfer did not finish by the deadline"
            if state != "DONE":
                return TransferStatus.FAILED, f"NIXL transfer failed ({state})"
            return None
        except Exception as exc:
            return TransferStatus.FAILED, f"NIXL transfer failed: {exc}"
        finally:
            self._release(handle)
            if held:
                self.lists.release(held)

    def _wait(self, handle: Any, deadline: Deadline) -> str | None:
        """Poll ``handle`` until it leaves "PROC" (its state) or ``deadline`` passes (None).

        Spins first: a transfer up to a few MiB completes within the spin, and a sleep (at
        least ~60 us in practice) would cost more than the move itself. Then naps, each a
        32nd of the time waited so far (within :data:`_POLL_NAP_S`), so a long transfer's end
        is seen at most ~3 % late.
        """
        check, now, at = self._agent.check_xfer_state, time.monotonic, deadline.at
        start = now()
        spin_until, (least, most) = start + _POLL_SPIN_S, _POLL_NAP_S
        while True:
            state: str = check(handle)
            if state != "PROC":
                return state
            t = now()
            if t >= at:
                return None
            if t > spin_until:
                time.sleep(min(most, max(least, (t - start) / 32), at - t))

    def _release(self, handle: Any) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception as exc:  # still in flight at UCX: NIXL keeps it and frees it later
            log.debug("NIXL release deferred: %s", exc)

    def _fence(self, peer: str, slices: list[Slice], where: list[RegionDesc], group: list[int],
               out: dict[int, Outcome], deadline: Deadline, why: str) -> None:
        """Read the floor of each fenced region ``group`` touches (one-sided); a slice whose
        generation it does not admit fails with ``why``."""
        floors: dict[int, int | None] = {}
        for i in group:
            r = where[i]
            if r.addr not in floors:
                floors[r.addr] = self._read_floor(peer, r, deadline)
            floor = floors[r.addr]
            if floor is None:
                out[i] = (TransferStatus.TIMEOUT if deadline.expired() else TransferStatus.FAILED,
                          "could not read the owner's fence floor")
            elif not admits(floor, slices[i].task.req.gen):
                out[i] = (TransferStatus.FAILED, why)

    def _read_floor(self, peer: str, region: RegionDesc, deadline: Deadline) -> int | None:
        with self._lock:
            if not self._scratch_free:
                return None
            off = self._scratch_free.pop()
        try:
            mt = _mem_type(region.device)
            assert mt is not None
            floor = _Moves([int(self._scratch.ctypes.data) + off], [region.addr], [8], [region],
                           ("DRAM", 0), mt)
            if self._post(peer, "READ", floor, deadline) is not None:
                return None
            return int.from_bytes(self._scratch[off:off + 8].tobytes(), "little")
        finally:
            with self._lock:
                self._scratch_free.append(off)

    def close(self) -> None:
        """Release the peers, the lists, the registrations and the agent (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            remotes, self._remotes = list(self._remotes.values()), {}
            regs, self._regs = list(self._regs.values()), {}
        self.lists.close()
        for r in remotes:
            _quietly(self._agent.remove_remote_agent, r.agent)
        for reg in [*regs, self._scratch_reg]:
            _quietly(self._agent.deregister_memory, reg)
        _LIVE.discard(self)
        self._agent = None


class _Moves:
    """The moves of one NIXL request: local and remote addresses, lengths, the peer's region
    of each, and the (memory type, device) of each side."""

    __slots__ = ("local", "remote", "lengths", "regions", "lt", "mt")

    def __init__(self, local: list[int], remote: list[int], lengths: list[int],
                 regions: list[RegionDesc], lt: tuple[str, int], mt: tuple[str, int]) -> None:
        self.local, self.remote, self.lengths, self.regions = local, remote, lengths, regions
        self.lt, self.mt = lt, mt

    def aligned(self, lo: int, hi: int, rlo: int, rhi: int) -> bool:
        """Every move is one block of the first's size, at a multiple of it from the start of
        local ``[lo, hi)`` and of remote ``[rlo, rhi)``, inside both."""
        n = self.lengths[0]
        if n <= 0 or self.lengths.count(n) != len(self.lengths):
            return False
        for a, r in zip(self.local, self.remote):
            if (a - lo) % n or (r - rlo) % n or a < lo or a + n > hi or r < rlo or r + n > rhi:
                return False
        return True


_NO_REGION = RegionDesc(0, 0)


class _RegionIndex:
    """The regions of a descriptor, found by address (a handful per segment: a scan)."""

    __slots__ = ("_regions",)

    def __init__(self, regions: list[RegionDesc]) -> None:
        self._regions = regions

    def find(self, addr: int, length: int) -> RegionDesc | None:
        for r in self._regions:
            if r.addr <= addr and addr + length <= r.addr + r.length:
                return r
        return None


def _quietly(fn: Callable[..., Any], *args: Any) -> None:
    try:
        fn(*args)
    except Exception as exc:
        log.debug("NIXL cleanup: %s", exc)


_LIVE: weakref.WeakSet[NixlTransport] = weakref.WeakSet()


@atexit.register
def _close_live() -> None:
    """Release every agent before the interpreter unloads the NIXL/UCX libraries."""
    for t in list(_LIVE):
        t.close()
