"""Fault-tolerant collectives: the ``"kvplane"`` torch.distributed backend (CPU).

Importing this package registers the backend, so ``dist.init_process_group("kvplane", ...)``,
``dist.all_reduce`` and DDP work. Failure semantics follow Mooncake PG: every op has a deadline, a
dead or hung rank does not stop the others, the op completes over the ranks that took part and its
Work reports ``local_success`` and ``failed_ranks_hint``. Membership (``active_ranks``, epoch) is
agreed through the torch Store; a replacement process can take a freed slot.

The module-level helpers use Mooncake PG's names and take the group (or Work) explicitly.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

from kvplane.common.extras import require

if TYPE_CHECKING:
    import torch
else:  # a missing torch is an error that says how to install it
    torch = require("torch", "torch", "the kvplane collectives backend")
import torch.distributed as dist

from kvplane.collectives.membership import Decision
from kvplane.collectives.process_group import KvplaneOptions, KvplaneProcessGroup
from kvplane.collectives.work import KvplaneWork
from kvplane.common.errors import InvalidArgument

__all__ = [
    "BACKEND", "KvplaneOptions", "KvplaneProcessGroup", "KvplaneWork", "activate_ranks",
    "deactivate_ranks", "elastic_allreduce_hook", "get_active_ranks", "get_current_epoch",
    "get_failed_ranks_hint", "get_local_success", "get_peer_state", "join_group", "recover_ranks",
    "register", "set_collective_timeout_us", "sync_after_failure",
]

BACKEND = "kvplane"


def _create(dist_opts: Any, pg_options: Any) -> KvplaneProcessGroup:
    if pg_options is not None and not isinstance(pg_options, KvplaneOptions):
        raise InvalidArgument(f"pg_options must be KvplaneOptions, got {type(pg_options).__name__}")
    timeout = dist_opts.timeout if isinstance(dist_opts.timeout, timedelta) else timedelta(seconds=30)
    return KvplaneProcessGroup(dist_opts.store, dist_opts.group_rank, dist_opts.group_size, timeout,
                               pg_options)


def register() -> None:
    """Register the ``"kvplane"`` backend with torch.distributed (idempotent)."""
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])


register()


def _pg(group: Any) -> KvplaneProcessGroup:
    pg = dist.distributed_c10d._get_default_group() if group is None else group
    if not isinstance(pg, KvplaneProcessGroup):
        raise InvalidArgument(f"not a kvplane process group: {type(pg).__name__}")
    return pg


def get_active_ranks(group: Any = None) -> torch.Tensor:
    """int32 ``[size]`` mask of committed members (the live tensor, updated in place)."""
    return _pg(group).active_ranks


def get_current_epoch(group: Any = None) -> int:
    """The group's membership epoch."""
    return _pg(group).epoch


def get_local_success(work: KvplaneWork) -> bool:
    """Whether every active rank took part in the op, as seen by this rank (waits)."""
    return work.local_success


def get_failed_ranks_hint(work: KvplaneWork) -> torch.Tensor:
    """int32 ``[size]``: active ranks that did not take part in the op (waits)."""
    return work.failed_ranks_hint


def sync_after_failure(group: Any = None, timeout: float | None = None) -> str:
    """Agree on membership after failures (collective over the survivors).

    Returns:
        ``"Reconciled"`` if membership changed, else ``"NoPending"``.
    """
    pg = _pg(group)
    before = pg.active_list()
    pg.sync_view(timeout, admit=False)
    return "Reconciled" if pg.active_list() != before else "NoPending"


def deactivate_ranks(ranks: list[int], group: Any = None, timeout: float | None = None) -> Decision:
    """Remove ``ranks`` from the membership (collective over the active members)."""
    return _pg(group).sync_view(timeout, drop=list(ranks), admit=False)


def activate_ranks(ranks: list[int], group: Any = None, timeout: float | None = None) -> Decision:
    """Admit replacement processes waiting for ``ranks`` (collective over the active members)."""
    return _pg(group).sync_view(timeout, only=list(ranks))


recover_ranks = activate_ranks


def join_group(group: Any = None, timeout: float | None = None) -> None:
    """Replacement process: block until the members admit it (see :func:`activate_ranks`)."""
    _pg(group).join(timeout)


def get_peer_state(ranks: list[int], group: Any = None) -> list[str]:
    """Per rank: ``"active"``, ``"pending"`` (a replacement waits) or ``"inactive"``."""
    return _pg(group).peer_state(list(ranks))


def set_collective_timeout_us(timeout_us: int, group: Any = None) -> None:
    """Change the default per-op deadline of the group."""
    pg = _pg(group)
    if timeout_us <= 0:
        raise InvalidArgument("timeout_us must be positive")
    import dataclasses

    pg.core.settings = dataclasses.replace(pg.core.settings, timeout=timeout_us / 1e6)


def elastic_allreduce_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: average gradients over the ranks that actually took part.

    ``state`` may be None or an object with a ``works`` list to which each Work is appended (so a
    training loop can inspect ``local_success`` and ``failed_ranks_hint`` per step). Register with
    ``ddp.register_comm_hook(state, elastic_allreduce_hook)``.
    """
    work = dist.all_reduce(bucket.buffer(), op=dist.ReduceOp.AVG, async_op=True)
    works = getattr(state, "works", None)
    if works is not None:
        works.append(work)
    return work.get_future().then(lambda f: f.value()[0])


# DDP compares the hook's annotations with the real classes, not with postponed strings.
elastic_allreduce_hook.__annotations__ = {
    "state": Any, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor],
}
