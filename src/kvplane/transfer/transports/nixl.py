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
import ctypes.util
import hashlib
import importlib
import importlib.util
import logging
import os
import secrets
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from kvplane.common.deadline import Deadline
from kvplane.common.errors import InvalidArgument
from kvplane.transfer.batch import Slice
from kvplane.transfer.fence import admits
from kvplane.transfer.memory import Region
from kvplane.transfer.seam import Capabilities, Route, Transport, TransportContext
from kvplane.transfer.types import OpCode, RegionDesc, RegionKind, SegmentDesc, TransferStatus

log = logging.getLogger(__name__)

INSTALL = "pip install --no-deps nixl-cu12==1.5.1 (the 'nixl' transport needs NIXL)"
_MODULES = ("nixl_cu12", "nixl_cu13", "nixl")
_POLL_SPIN_S = 0.002  # busy-poll check_xfer_state this long (covers ~10 MiB at UCX's rates)
_POLL_NAP_S = (2e-5, 1e-3)  # then sleep, doubling from the first to the second, per poll


def import_nixl() -> ModuleType:
    """The NIXL Python API module.

    Raises:
        InvalidArgument: NIXL is not installed (the message says how to install it).
    """
    for name in _MODULES:
        spec = importlib.util.find_spec(name)
        if spec is None:
            continue
        if spec.origin:
            avoid_exit_crash(os.path.dirname(spec.origin))
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if not hasattr(mod, "nixl_agent"):
            try:  # the meta package re-exports the API from a submodule
                mod = importlib.import_module(f"{name}._api")
            except ImportError:
                continue
        _quiet_stdout_logging()
        return mod
    raise InvalidArgument(f"NIXL is not installed: {INSTALL}")


def avoid_exit_crash(package_dir: str) -> str:
    """Keep the NIXL wheel's UCX from loading a second libnl into the process, the cause of
    its crash at exit; returns the UCX_MODULES value set ("" when nothing was changed).

    The wheel bundles renamed copies of libibverbs, libnl-3 and libnl-route-3, and links its
    UCX modules to them, all but one: ``ucx/libuct_ib_efa.so`` (AWS EFA) still names the
    system's ``libibverbs.so.1``. Where that library is installed (rdma-core, or Debian's
    libibverbs1, which Mooncake needs), loading the EFA module brings the system's libnl-3 and
    libnl-route-3 too. At exit their destructors run against the other copy's interposed
    symbols, and the process dies in ``rtnl_tc_unregister`` during ``_dl_fini`` (SIGSEGV,
    rc 139), after all Python code ran. So, on exactly that condition, and only when the user
    has not chosen UCX's modules (``UCX_MODULES``), UCX is told not to load the EFA module
    (``UCX_MODULES=^efa``). An EFA host that needs the module sets ``UCX_MODULES`` itself (and
    then owns the exit code).
    """
    if "UCX_MODULES" in os.environ:
        return ""
    libs = os.path.join(os.path.dirname(package_dir.rstrip("/")),
                        f"{os.path.basename(package_dir.rstrip('/'))}.libs", "ucx")
    try:
        efa = [os.path.join(libs, f) for f in os.listdir(libs) if f.startswith("libuct_ib_efa.so")]
    except OSError:
        return ""
    unbundled = False
    for path in efa:
        try:
            with open(path, "rb") as f:
                unbundled = unbundled or b"\x00libibverbs.so.1\x00" in f.read()
        except OSError:
            continue
    if not unbundled or ctypes.util.find_library("ibverbs") is None:
        return ""
    os.environ["UCX_MODULES"] = "^efa"
    log.debug("UCX_MODULES=^efa: the NIXL wheel's EFA module links the system libibverbs")
    return "^efa"


def _quiet_stdout_logging() -> None:
    """NIXL's Python logger writes INFO lines to stdout, where kvplane commands print their
    one JSON ready line: send its records through the root logger (stderr) instead, at
    WARNING unless NIXL_LOG_LEVEL asks for more."""
    nl = logging.getLogger("nixl")
    for h in list(nl.handlers):
        if getattr(h, "stream", None) is sys.stdout:
            nl.removeHandler(h)
    nl.propagate = True
    if not os.environ.get("NIXL_LOG_LEVEL"):
        nl.setLevel(logging.WARNING)


@dataclass(frozen=True)
class _Remote:
    """A peer's agent as loaded into ours: its NIXL name and the advert it came from."""

    agent: str
    digest: bytes


def _mem_type(device: str) -> tuple[str, int] | None:
    """NIXL memory type and device id of a region on ``device`` (None: not for NIXL)."""
    if not device:
        return "DRAM", 0
    if device.startswith("cuda"):
        _, _, idx = device.partition(":")
        return "VRAM", int(idx or 0)
    return None


def _addr_of(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if len(view) else 0


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
        self._closed = False
        self.agent_name = f"kvplane-{os.getpid()}-{secrets.token_hex(4)}"
        conf = self._nixl.nixl_agent_config(backends=["UCX"])
        self._agent: Any = self._nixl.nixl_agent(self.agent_name, conf)
        if "UCX" not in getattr(self._agent, "backends", {"UCX": None}):
            raise InvalidArgument("NIXL has no UCX backend here (check UCX_TLS and the plugins)")
        # 8 bytes per concurrent fence check, registered once: READ the owner's floor into it
        self._scratch = np.zeros(4096, dtype=np.uint8)
        self._scratch_reg = self._agent.register_memory(
            [(int(self._scratch.ctypes.data), self._scratch.nbytes, 0, "")], "DRAM")
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

    def on_unregister(self, region: Region) -> None:
        with self._lock:
            reg = self._regs.pop(region.addr, None)
        if reg is not None:
            try:
                self._agent.deregister_memory(reg)
            except Exception as exc:  # the engine has dropped it either way
                log.warning("NIXL deregister of %#x failed: %s", region.addr, exc)

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
        digest = hashlib.blake2b(md, digest_size=16).digest()
        with self._lock:
            known = self._remotes.get(seg.name)
            if known is not None and known.digest == digest:
                return known.agent
            if known is not None:
                try:
                    self._agent.remove_remote_agent(known.agent)
                except Exception:  # not loaded any more: load afresh
                    pass
            agent = self._agent.add_remote_agent(md)
            name = agent.decode() if isinstance(agent, bytes) else str(agent)
            self._remotes[seg.name] = _Remote(name, digest)
            return name

    def forget(self, segment: str) -> None:
        """Drop a peer's loaded agent (its process went away)."""
        with self._lock:
            known = self._remotes.pop(segment, None)
        if known is not None:
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
        regions = _RegionIndex(route.segment.regions)
        out: dict[int, tuple[TransferStatus, str]] = {}  # slice index -> failure
        where: list[RegionDesc] = []
        for i, s in enumerate(slices):
            region = regions.find(s.remote, s.length)
            if region is None or _mem_type(region.device) is None:
                out[i] = (TransferStatus.FAILED, f"range {s.remote:#x}+{s.length} is not in a "
                          "region the peer registered with NIXL")
            where.append(region or _NO_REGION)
        fenced = [i for i, s in enumerate(slices)
                  if i not in out and s.task.req.gen and where[i].fenced]
        if fenced:
            self._fence(peer, slices, where, fenced, out, deadline,
                        "fenced: the segment serves another master epoch or a newer mount")
        for op in (OpCode.READ, OpCode.WRITE):
            group = [i for i, s in enumerate(slices) if i not in out and s.op == op]
            if group:
                self._move(peer, op, slices, where, group, out, deadline)
        if fenced:
            self._fence(peer, slices, where, [i for i in fenced if i not in out], out, deadline,
                        "fenced during the copy")
        for i, s in enumerate(slices):
            if i in out:
                s.done(*out[i])
            elif s.task.req.gen and deadline.expired():
                s.done(TransferStatus.TIMEOUT, "copy finished past its deadline")
            else:
                s.done(TransferStatus.COMPLETED)

    def _move(self, peer: str, op: OpCode, slices: list[Slice], where: list[RegionDesc],
              group: list[int], out: dict[int, tuple[TransferStatus, str]],
              deadline: Deadline) -> None:
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
        for ((lmem, ldev), (mem, dev)), part in by_type.items():
            local = np.array([(slices[i].addr if slices[i].device else _addr_of(slices[i].local),
                               slices[i].length, ldev) for i in part], dtype=np.uint64)
            remote = np.array([(slices[i].remote, slices[i].length, dev) for i in part],
                              dtype=np.uint64)
            err = self._post(peer, "READ" if op == OpCode.READ else "WRITE", local, lmem,
                             remote, mem, deadline)
            if err is not None:
                for i in part:
                    out[i] = err

    def _post(self, peer: str, op: str, local: np.ndarray, local_mem: str, remote: np.ndarray,
              remote_mem: str, deadline: Deadline) -> tuple[TransferStatus, str] | None:
        """Post one request and wait for it within ``deadline``; None when it completed."""
        try:
            ldesc = self._agent.get_xfer_descs(local, local_mem)
            rdesc = self._agent.get_xfer_descs(remote, remote_mem)
            handle = self._agent.initialize_xfer(op, ldesc, rdesc, peer)
        except Exception as exc:
            return TransferStatus.FAILED, f"NIXL refused the request: {exc}"
        try:
            state = self._agent.transfer(handle)
            # spin first: a transfer up to a few MiB completes within the spin, and a sleep
            # (at least ~60 us in practice) would cost more than the move itself
            spin_until, nap = time.monotonic() + _POLL_SPIN_S, _POLL_NAP_S[0]
            while state == "PROC":
                if deadline.expired():
                    return TransferStatus.TIMEOUT, "NIXL transfer did not finish by the deadline"
                if time.monotonic() > spin_until:
                    time.sleep(nap)
                    nap = min(nap * 2, _POLL_NAP_S[1])
                state = self._agent.check_xfer_state(handle)
            if state != "DONE":
                return TransferStatus.FAILED, f"NIXL transfer failed ({state})"
            return None
        except Exception as exc:
            return TransferStatus.FAILED, f"NIXL transfer failed: {exc}"
        finally:
            self._release(handle)

    def _release(self, handle: Any) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception as exc:  # still in flight at UCX: NIXL keeps it and frees it later
            log.debug("NIXL release deferred: %s", exc)

    def _fence(self, peer: str, slices: list[Slice], where: list[RegionDesc], group: list[int],
               out: dict[int, tuple[TransferStatus, str]], deadline: Deadline, why: str) -> None:
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
            local = np.array([(int(self._scratch.ctypes.data) + off, 8, 0)], dtype=np.uint64)
            remote = np.array([(region.addr, 8, mt[1])], dtype=np.uint64)
            if self._post(peer, "READ", local, "DRAM", remote, mt[0], deadline) is not None:
                return None
            return int.from_bytes(self._scratch[off:off + 8].tobytes(), "little")
        finally:
            with self._lock:
                self._scratch_free.append(off)

    def close(self) -> None:
        """Release the peers, the registrations and the agent (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            remotes, self._remotes = list(self._remotes.values()), {}
            regs, self._regs = list(self._regs.values()), {}
        for r in remotes:
            _quietly(self._agent.remove_remote_agent, r.agent)
        for reg in [*regs, self._scratch_reg]:
            _quietly(self._agent.deregister_memory, reg)
        _LIVE.discard(self)
        self._agent = None


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
