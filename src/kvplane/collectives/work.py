"""KvplaneWork: the ``torch.distributed.Work`` handed back by every kvplane operation.

Adds Mooncake PG's per-op evidence: ``local_success`` and ``failed_ranks_hint``. Completed by the
communication thread; waited on by any thread.
"""

from __future__ import annotations

from concurrent.futures import Future
from datetime import timedelta

import torch
import torch.distributed as dist

from kvplane.collectives.core import OpResult
from kvplane.common.errors import Timeout


class KvplaneWork(dist.Work):
    """Handle of one queued operation.

    Args:
        fut: completes with the op's :class:`OpResult` (or its exception) on the comm thread.
        tensors: what ``get_future()`` resolves to (the op's outputs).
        size: number of slots of the group (length of ``failed_ranks_hint``).
        max_wait: upper bound for ``wait()`` without a timeout (the op has its own deadline).
    """

    def __init__(self, fut: Future[OpResult], tensors: list[torch.Tensor], size: int,
                 max_wait: float) -> None:
        super().__init__()
        self._fut = fut
        self._tensors = tensors
        self._size = size
        self._max_wait = max_wait
        self._tfut: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
        fut.add_done_callback(self._done)

    def _done(self, fut: Future[OpResult]) -> None:
        exc = fut.exception()
        if exc is not None:
            self._tfut.set_exception(exc)  # type: ignore[arg-type]  # torch's stub types the error as the value
        else:
            self._tfut.set_result(self._tensors)

    def _result(self, timeout: float | None = None) -> OpResult:
        try:
            return self._fut.result(timeout=self._max_wait if timeout is None else timeout)
        except TimeoutError as exc:
            raise Timeout("collective did not complete in time") from exc

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        """Block until the op completed; re-raise its exception.

        Args:
            timeout: zero means "the op's own deadline bounds the wait".

        Raises:
            Timeout: the op did not complete in ``timeout``.
        """
        secs = timeout.total_seconds() if timeout else 0.0
        self._result(secs if secs > 0 else None)
        return True

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        """A torch Future resolving to the op's output tensors."""
        return self._tfut

    def is_completed(self) -> bool:
        """True once the op finished (successfully or not)."""
        return self._fut.done()

    def is_success(self) -> bool:
        """True if the op finished without raising (peers may still have been missing)."""
        return self._fut.done() and self._fut.exception() is None

    def exception(self) -> BaseException | None:
        """The op's exception, if it raised."""
        return self._fut.exception() if self._fut.done() else None

    def synchronize(self) -> None:
        """Same as :meth:`wait` on CPU."""
        self.wait()

    def result(self) -> list[torch.Tensor]:
        """The op's output tensors (waits)."""
        self.wait()
        return self._tensors

    @property
    def local_success(self) -> bool:
        """True if every active rank contributed, from this rank's point of view (waits)."""
        r = self._result()
        return r.failed == 0

    @property
    def failed_ranks_hint(self) -> torch.Tensor:
        """int32 ``[size]``: 1 for each active rank that did not take part (waits)."""
        r = self._result()
        return torch.tensor([r.failed >> i & 1 for i in range(self._size)], dtype=torch.int32)

    @property
    def participants(self) -> list[int]:
        """Ranks whose contributions are in the result (waits)."""
        r = self._result()
        return [i for i in range(self._size) if r.participants >> i & 1]
