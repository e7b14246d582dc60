"""KvplaneProcessGroup: the ``torch.distributed`` face of :class:`~kvplane.collectives.core.GroupCore`.

Translates torch's C++-style op signatures (``allreduce(tensors, opts)`` ...) into collectives on
the communication thread and returns :class:`~kvplane.collectives.work.KvplaneWork`. Membership
is *slots plus a mask* as in Mooncake PG: ``size()`` never changes, ``active_ranks`` does.
CPU tensors only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from kvplane.collectives import ops
from kvplane.collectives.core import GroupCore, OpResult, Settings
from kvplane.collectives.frames import ranks_of
from kvplane.collectives.membership import Decision
from kvplane.collectives.shm import ShmArena
from kvplane.collectives.work import KvplaneWork
from kvplane.common import envs
from kvplane.common.errors import InvalidArgument


@dataclass(frozen=True)
class KvplaneOptions:
    """Options of a kvplane group, passed as ``init_process_group(pg_options=...)``.

    Attributes:
        is_extension: this process replaces a failed rank; it starts alone and must call
            :func:`kvplane.collectives.join_group`.
        timeout: per-op deadline in seconds; None uses the ``timeout`` given to torch.
        heartbeat_interval: seconds between heartbeats; None reads ``KVPLANE_PG_HEARTBEAT_INTERVAL``.
        heartbeat_timeout: silence after which a peer counts as failed; None reads
            ``KVPLANE_PG_HEARTBEAT_TIMEOUT``.
        max_message: largest payload accepted from a peer; None reads ``KVPLANE_PG_MAX_MESSAGE``.
        exact_restart: keep a copy of each allreduce input so an op that loses a rank part-way
            restarts from the original inputs and returns the exact result over the survivors.
            False saves one memcpy per allreduce on the TCP ring; such an op's output is then
            unspecified (it still reports ``local_success=False``). The shared-memory allreduce
            always keeps the copy: publishing the input is that copy.
        shm_bytes: allreduces of at least this many bytes go through ``/dev/shm`` (every rank
            of a group is on one host); 0 keeps them on the TCP ring. None reads
            ``KVPLANE_PG_SHM_BYTES`` (default 1 MiB).
    """

    is_extension: bool = False
    timeout: float | None = None
    heartbeat_interval: float | None = None
    heartbeat_timeout: float | None = None
    max_message: int | None = None
    exact_restart: bool = True
    shm_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("timeout", "heartbeat_interval", "heartbeat_timeout"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise InvalidArgument(f"{name} must be positive, got {v}")

    def settings(self, torch_timeout: float) -> Settings:
        """Resolve defaults (explicit > env > torch's timeout)."""
        return Settings(
            timeout=self.timeout if self.timeout is not None else torch_timeout,
            heartbeat_interval=self.heartbeat_interval or envs.get("KVPLANE_PG_HEARTBEAT_INTERVAL"),
            heartbeat_timeout=self.heartbeat_timeout or envs.get("KVPLANE_PG_HEARTBEAT_TIMEOUT"),
            max_message=self.max_message or envs.get("KVPLANE_PG_MAX_MESSAGE"),
            is_extension=self.is_extension,
        )

_OVERLAP_COPY_BYTES = 4 << 20  # smaller exact-restart copies are made inline


def _reduce_kind(opts: Any) -> str:
    op = getattr(opts, "reduceOp", opts)
    if op is None:
        return ops.SUM
    kind = getattr(op, "op", op)  # ReduceOp object vs RedOpType enum
    name = str(getattr(kind, "name", kind)).lower()
    return {"sum": ops.SUM, "avg": ops.AVG, "product": ops.PRODUCT, "min": ops.MIN, "max": ops.MAX,
            "band": ops.BAND, "bor": ops.BOR, "bxor": ops.BXOR}.get(name, name)


def _check(t: torch.Tensor) -> None:
    if t.device.type != "cpu":
        raise InvalidArgument(f"kvplane collectives take CPU tensors, got {t.device}")
    if t.is_sparse:
        raise InvalidArgument("sparse tensors are not supported")


class _Flat:
    """A contiguous 1-D working copy of a tensor list, written back after the op if needed."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            _check(t)
        self.tensors = tensors
        if len(tensors) == 1 and tensors[0].is_contiguous():
            self.flat = tensors[0].view(-1)
            self.copy = False
        else:
            self.flat = torch.cat([t.reshape(-1) for t in tensors])
            self.copy = True

    def write_back(self) -> None:
        """Copy the results back into the caller's tensors if a working copy was used."""
        if self.copy:
            off = 0
            for t in self.tensors:
                t.copy_(self.flat[off: off + t.numel()].view_as(t))
                off += t.numel()


class KvplaneProcessGroup(dist.ProcessGroup):
    """A fault-tolerant CPU process group (backend name ``"kvplane"``).

    Args:
        store: the group's store.
        rank: this process's slot.
        size: number of slots.
        timeout: torch's group timeout (the default per-op deadline).
        options: kvplane options.
    """

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta,
                 options: KvplaneOptions | None = None) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # the stub lists only the store-taking form
        self.options = options or KvplaneOptions()
        self.core = GroupCore(store, rank, size, self.options.settings(timeout.total_seconds()))
        self._name = ""
        self._bufs: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        self._copier: ThreadPoolExecutor | None = None
        shm = self.options.shm_bytes
        self._shm_bytes = envs.get("KVPLANE_PG_SHM_BYTES") if shm is None else shm
        self._shm = ShmArena(self.core.inc) if self._shm_bytes > 0 else None
        if self._shm is not None:
            self.core.on_dead.append(self._forget_peer)

    def _forget_peer(self, _rank: int, inc: int | None) -> None:
        """A peer failed: its shared-memory area goes (it cannot remove it itself)."""
        if self._shm is not None and inc is not None:
            self._shm.forget(inc)

    # ------------------------------------------------------------------ identity
    def getBackendName(self) -> str:
        """The backend name."""
        return "kvplane"

    def _set_group_name(self, name: str) -> None:
        self._name = name

    @property
    def group_name(self) -> str:  # type: ignore[override]  # a property over torch's method
        """The name torch registered this group under."""
        return self._name

    @property
    def active_ranks(self) -> torch.Tensor:
        """int32 ``[size]`` mask of committed members (updated in place)."""
        return self.core.active_ranks

    @property
    def epoch(self) -> int:
        """Current membership epoch."""
        return self.core.epoch

    # ------------------------------------------------------------------ plumbing
    def _timeout(self, opts: Any) -> float | None:
        t = getattr(opts, "timeout", None)
        if isinstance(t, timedelta) and t.total_seconds() > 0:
            return t.total_seconds()
        return None

    def _buf(self, name: str, dtype: torch.dtype, numel: int) -> torch.Tensor:
        b = self._bufs.get((name, dtype))
        if b is None or b.numel() < numel:
            b = torch.empty(max(numel, 1), dtype=dtype)
            self._bufs[(name, dtype)] = b
        return b[:numel]

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> Future[Any]:
        """``dst.copy_(src)``, on a helper thread when it is big enough to be worth overlapping.

        The exact-restart copy of an allreduce input then runs while the ring's reduce-scatter
        (which only reads the input) is under way; the ring waits for it before its first write.
        One helper thread runs copies in submission order, so a copy into a reused buffer never
        overtakes an earlier one.
        """
        if dst.numel() * dst.element_size() < _OVERLAP_COPY_BYTES:
            done: Future[Any] = Future()
            done.set_result(dst.copy_(src))
            return done
        if self._copier is None:
            self._copier = ThreadPoolExecutor(1, thread_name_prefix="kvplane-pg-copy")
        return self._copier.submit(dst.copy_, src)

    def _scratch(self, dtype: torch.dtype, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._buf("s0", dtype, numel), self._buf("s1", dtype, numel)

    def _submit(self, fn: Callable[[], OpResult], outputs: list[torch.Tensor]) -> KvplaneWork:
        fut = self.core.submit(fn)
        wait = 4 * self.core.settings.timeout + 10.0
        return KvplaneWork(fut, outputs, self.size(), wait)

    def _run(self, body: Callable[[ops.Attempt], None], restore: Callable[[], None] | None,
             opts: Any, after: Callable[[OpResult], None] | None = None) -> Callable[[], OpResult]:
        timeout = self._timeout(opts)

        def fn() -> OpResult:
            res = self.core.collective(body, restore, timeout)
            if after is not None:
                after(res)
            return res
        return fn

    # ------------------------------------------------------------------ collectives
    def allreduce(self, tensors: Any, opts: Any = None) -> KvplaneWork:  # type: ignore[override]  # c10d calls the opts form
        """In-place allreduce (SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR) over the participants."""
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        kind = _reduce_kind(opts)
        ops.check_reduce(kind, tensors[0].dtype)
        f = _Flat(tensors)
        flat = f.flat
        holder: dict[str, torch.Tensor] = {}

        exact = self.options.exact_restart
        copying: list[Future[Any]] = []
        path = [""]  # "shm": the last attempt wrote its result through the arena, which holds its input
        shm = self._shm if flat.numel() * flat.element_size() >= self._shm_bytes else None

        def copied() -> None:  # the ring calls this before it first writes into ``flat``
            while copying:
                copying.pop().result()

        def body(a: ops.Attempt) -> None:
            path[0] = ""
            if shm is not None and a.n > 1:
                # flat is written only once every participant reduced its block, after the
                # last exchange: a failure raised from in here leaves it untouched
                incs = [self.core.inc if r == self.core.rank else getattr(self.core.eps.get(r), "inc", None)
                        for r in a.ranks]
                if ops.allreduce_shm(a, flat, kind, shm, incs):
                    path[0] = "shm"
                    return
            if exact and "backup" not in holder and a.n > 1:
                holder["backup"] = self._buf("backup", flat.dtype, flat.numel())
                copying.append(self._copy(holder["backup"], flat))
            ops.allreduce(a, flat, kind, self._scratch(flat.dtype, math.ceil(flat.numel() / a.n)),
                          copied)

        def restore() -> None:
            copied()
            if path[0] == "shm":
                ops.restore_from_shm(flat, shm)  # type: ignore[arg-type]  # set on the shm path
            elif "backup" in holder:
                flat.copy_(holder["backup"])

        def after(_: OpResult) -> None:
            if path[0] == "shm":
                shm.settle()  # type: ignore[union-attr]  # every participant mapped its area
            f.write_back()

        return self._submit(self._run(body, restore, opts, after), tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> KvplaneWork:
        """Allreduce several tensors as one flat buffer."""
        return self.allreduce(list(tensors), opts)

    def reduce(self, tensors: Any, opts: Any = None) -> KvplaneWork:  # type: ignore[override]  # c10d calls the opts form
        """Reduce to ``opts.rootRank``; other ranks' tensors are left unchanged."""
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        root = getattr(opts, "rootRank", 0)
        kind = _reduce_kind(opts)
        ops.check_reduce(kind, tensors[0].dtype)
        work = tensors[0].detach().clone().contiguous().view(-1)

        def body(a: ops.Attempt) -> None:
            ops.allreduce(a, work, kind, self._scratch(work.dtype, math.ceil(work.numel() / a.n)))

        orig = work.clone()

        def after(_: OpResult) -> None:
            if self.core.rank == root:
                tensors[0].copy_(work.view_as(tensors[0]))

        return self._submit(self._run(body, lambda: work.copy_(orig), opts, after), tensors)

    def broadcast(self, tensors: Any, opts: Any = None) -> KvplaneWork:  # type: ignore[override]  # c10d calls the opts form
        """Binomial-tree broadcast from ``opts.rootRank`` (unchanged on receivers if the root failed)."""
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        root = getattr(opts, "rootRank", 0)
        f = _Flat(tensors)

        def body(a: ops.Attempt) -> None:
            if root in a.ranks:
                ops.broadcast(a, f.flat, a.ranks.index(root))

        return self._submit(self._run(body, None, opts, lambda _: f.write_back()), tensors)

    def _gather(self, outs: list[torch.Tensor], inp: torch.Tensor, opts: Any) -> KvplaneWork:
        _check(inp)
        flats = [o if o.is_contiguous() else o.contiguous() for o in outs]
        src = inp.contiguous().view(-1)
        me = self.core.rank

        def body(a: ops.Attempt) -> None:
            flats[me].view(-1).copy_(src)
            ops.allgather(a, [flats[r].view(-1) for r in a.ranks])

        def after(res: OpResult) -> None:
            for r, (o, fl) in enumerate(zip(outs, flats)):
                if not res.participants >> r & 1:
                    fl.zero_()
                if fl is not o:
                    o.copy_(fl)

        return self._submit(self._run(body, None, opts, after), outs)

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],  # type: ignore[override]  # c10d calls the opts form
                  opts: Any = None) -> KvplaneWork:
        """Ring allgather; outputs of non-participating slots are zeroed."""
        if len(output_tensors[0]) != self.size():
            raise InvalidArgument(f"need {self.size()} output tensors, got {len(output_tensors[0])}")
        return self._gather(list(output_tensors[0]), input_tensors[0], opts)

    def _allgather_base(self, output: torch.Tensor, inp: torch.Tensor, opts: Any = None) -> KvplaneWork:
        """Allgather into one tensor of ``size() * inp.numel()`` elements."""
        if output.numel() != inp.numel() * self.size() or not output.is_contiguous():
            raise InvalidArgument("output must be contiguous with size() * input.numel() elements")
        return self._gather(list(output.view(self.size(), -1).unbind(0)), inp, opts)

    def all_gather_single(self, output: torch.Tensor, inp: torch.Tensor, opts: Any = None) -> KvplaneWork:
        """torch 2.13's name for :meth:`_allgather_base` (``dist.all_gather_single``)."""
        return self._allgather_base(output, inp, opts)

    def _scatter_reduce(self, out: torch.Tensor, blocks: list[torch.Tensor], opts: Any) -> KvplaneWork:
        kind = _reduce_kind(opts)
        ops.check_reduce(kind, out.dtype)
        for b in blocks:
            _check(b)
            if b.numel() != out.numel():
                raise InvalidArgument("every input block must have the output's number of elements")
        flats = [b.contiguous().view(-1) for b in blocks]
        dst = out.contiguous().view(-1)

        def body(a: ops.Attempt) -> None:
            ops.reduce_scatter(a, [flats[r] for r in a.ranks], dst, kind,
                               self._scratch(dst.dtype, dst.numel()))

        def after(_: OpResult) -> None:
            if dst.data_ptr() != out.data_ptr():
                out.copy_(dst.view_as(out))

        return self._submit(self._run(body, None, opts, after), [out])

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],  # type: ignore[override]  # c10d calls the opts form
                       opts: Any = None) -> KvplaneWork:
        """Ring reduce-scatter: slot ``r`` of the inputs, reduced, lands on rank ``r``."""
        return self._scatter_reduce(output_tensors[0], list(input_tensors[0]), opts)

    def _reduce_scatter_base(self, output: torch.Tensor, inp: torch.Tensor, opts: Any = None) -> KvplaneWork:
        """Reduce-scatter of one flat input of ``size() * output.numel()`` elements."""
        if inp.numel() != output.numel() * self.size():
            raise InvalidArgument("input must have size() * output.numel() elements")
        return self._scatter_reduce(output, list(inp.contiguous().view(self.size(), -1).unbind(0)), opts)

    def reduce_scatter_single(self, output: torch.Tensor, inp: torch.Tensor, opts: Any = None) -> KvplaneWork:
        """torch 2.13's name for :meth:`_reduce_scatter_base` (``dist.reduce_scatter_single``)."""
        return self._reduce_scatter_base(output, inp, opts)

    def _exchange(self, outs: list[torch.Tensor], ins: list[torch.Tensor], opts: Any,
                  results: list[torch.Tensor], finish: Callable[[], None]) -> KvplaneWork:
        def body(a: ops.Attempt) -> None:
            ops.alltoall(a, [ins[r] for r in a.ranks], [outs[r] for r in a.ranks])

        def after(res: OpResult) -> None:
            for r in range(self.size()):
                if not res.participants >> r & 1:
                    outs[r].zero_()
            finish()

        return self._submit(self._run(body, None, opts, after), results)

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> KvplaneWork:
        """Pairwise all-to-all of per-slot tensors."""
        outs = [o if o.is_contiguous() else o.contiguous() for o in output_tensors]
        ins = [i.contiguous().view(-1) for i in input_tensors]

        def finish() -> None:
            for o, fl in zip(output_tensors, outs):
                if fl is not o:
                    o.copy_(fl)

        return self._exchange([o.view(-1) for o in outs], ins, opts, list(output_tensors), finish)

    def alltoall_base(self, output: torch.Tensor, inp: torch.Tensor, output_split_sizes: list[int],
                      input_split_sizes: list[int], opts: Any = None) -> KvplaneWork:
        """All-to-all of one tensor split along dim 0 (equal splits when the lists are empty)."""
        n = self.size()

        def parts(t: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
            sizes = list(sizes) or [t.shape[0] // n] * n
            if len(sizes) != n or sum(sizes) != t.shape[0]:
                raise InvalidArgument(f"bad split sizes {sizes} for dim 0 of {t.shape[0]}")
            return [p.reshape(-1) for p in torch.split(t, sizes, dim=0)]

        if not output.is_contiguous():
            raise InvalidArgument("alltoall_base output must be contiguous")
        return self._exchange(parts(output, output_split_sizes), parts(inp.contiguous(), input_split_sizes),
                              opts, [output], lambda: None)

    def all_to_all_single(self, output: torch.Tensor, inp: torch.Tensor, output_split_sizes: list[int],
                          input_split_sizes: list[int], opts: Any = None) -> KvplaneWork:
        """torch 2.13's name for :meth:`alltoall_base` (``dist.all_to_all_single``)."""
        return self.alltoall_base(output, inp, output_split_sizes, input_split_sizes, opts)

    def barrier(self, opts: Any = None) -> KvplaneWork:
        """Wait until every participant reached the barrier."""
        t = torch.zeros(1, dtype=torch.int32)
        return self._submit(self._run(lambda a: ops.allreduce(a, t, ops.SUM, self._scratch(t.dtype, 1)),
                                      None, opts), [t])

    # ------------------------------------------------------------------ point to point
    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int = 0) -> KvplaneWork:
        """Send to ``dstRank``; completes with ``local_success=False`` if the peer failed."""
        t = tensors[0].contiguous()
        _check(t)
        return self._submit(lambda: self.core.p2p(t, dstRank, tag, True, None), [t])

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int = 0) -> KvplaneWork:
        """Receive from ``srcRank``; completes with ``local_success=False`` if the peer failed."""
        out = tensors[0]
        _check(out)
        t = out if out.is_contiguous() else out.contiguous()

        def fn() -> OpResult:
            res = self.core.p2p(t, srcRank, tag, False, None)
            if t is not out:
                out.copy_(t)
            return res

        return self._submit(fn, [out])

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> KvplaneWork:
        """Not supported: a fault-tolerant receive needs to know whom it waits for."""
        raise InvalidArgument("recv from any source is not supported by kvplane")

    # ------------------------------------------------------------------ membership
    def sync_view(self, timeout: float | None = None, drop: Sequence[int] = (),
                  only: Sequence[int] | None = None, admit: bool = True) -> Decision:
        """Agree on membership with the other members and enter the next epoch (collective).

        All active members must call it at the same point of their programs. Failed ranks are
        deactivated and pending replacements admitted.

        Raises:
            Unavailable: this rank was excluded.
            Timeout: the store did not answer in time.
        """
        drop_mask = sum(1 << r for r in drop)
        only_mask = None if only is None else sum(1 << r for r in only)
        t = self.core.settings.timeout if timeout is None else timeout
        return self.core.call(lambda: self.core.sync_view(t, admit, drop_mask, only_mask), t + 5.0)

    def join(self, timeout: float | None = None) -> None:
        """Replacement process: wait to be admitted (blocking).

        Raises:
            Timeout: not admitted in time.
        """
        t = self.core.settings.timeout if timeout is None else timeout
        self.core.call(lambda: self.core.join(t), t + 5.0)

    def peer_state(self, ranks: list[int]) -> list[str]:
        """``"active"``, ``"pending"`` (a replacement waits to join) or ``"inactive"`` per rank."""
        pending = self.core.board.join_requests([r for r in ranks if not self.core.active >> r & 1])
        return ["active" if self.core.active >> r & 1 else "pending" if r in pending else "inactive"
                for r in ranks]

    def active_list(self) -> list[int]:
        """Active ranks, ascending."""
        return ranks_of(self.core.active)

    def shutdown(self) -> None:
        """Stop the communication thread and close sockets (idempotent)."""
        self.core.close()
        if self._copier is not None:
            self._copier.shutdown(wait=True)
        if self._shm is not None:
            self._shm.close()

    def abort(self) -> None:
        """Same as :meth:`shutdown`."""
        self.shutdown()
