"""TCP's vectored capability: many READs or WRITEs per peer as READV/WRITEV frames.

Owns the runs of :class:`~kvplane.transfer.jobs.PeerJob` lists (``TcpTransport.read_scatter``
and ``write_gather``): per peer one connection, ``READV_WINDOW`` frames in flight, each answer
landing in the entries' views with one scatter receive; the first job on the calling thread,
the others on lanes; a broken connection retried on a fresh one for the entries it did not
finish. Reaches connections only through the :class:`Pool` protocol (the transport's pool);
never imports the engine or ``tcp``.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
from typing import Protocol

from kvplane.common import metrics
from kvplane.common.deadline import Deadline
from kvplane.common.errors import KVPlaneError, ProtocolError, Timeout, Unavailable
from kvplane.transfer import protocol
from kvplane.transfer.jobs import PeerJob, Span, runs
from kvplane.transfer.transports.tcp_conn import READV_WINDOW, Conn, frames, refused
from kvplane.transfer.types import TransferStatus

_Outcome = tuple[list[int], str]  # per entry 0 or the peer's code; the refusal of the frame


class Pool(Protocol):
    """Pooled connections to peers, as the vectored runs use them."""

    def acquire(self, peer: tuple[str, int], deadline: Deadline) -> Conn:
        """An idle or new connection to ``peer``. Raises KVPlaneError."""

    def release(self, conn: Conn) -> None:
        """Give ``conn`` back (closed if it died or the pool is full)."""

    def drop_peer(self, peer: tuple[str, int]) -> None:
        """Close the idle connections to ``peer`` (they are suspect)."""


def run_jobs(pool: Pool, lanes: cf.Executor, jobs: list[PeerJob], deadline: Deadline,
             reading: bool, retries: int, label: str) -> None:
    """Run ``jobs`` to an outcome per entry, with up to ``retries`` fresh connections per job."""
    for job in jobs:
        job.reset()
    todo = list(jobs)
    attempts_left = retries + 1
    while todo:
        broken = _round(pool, lanes, todo, deadline, reading)
        attempts_left -= 1
        if not broken:
            return
        for job, _ in broken:
            pool.drop_peer(job.peer)
        if attempts_left <= 0 or deadline.expired():
            status = TransferStatus.TIMEOUT if deadline.expired() else TransferStatus.FAILED
            for job, exc in broken:
                job.finish_pending(status, f"connection to {job.peer[0]}:{job.peer[1]} "
                                           f"failed: {exc}")
            return
        metrics.TRANSFER_RETRIES.labels(label).inc(len(broken))
        todo = [job for job, _ in broken]


def _round(pool: Pool, lanes: cf.Executor, jobs: list[PeerJob], deadline: Deadline,
           reading: bool) -> list[tuple[PeerJob, BaseException]]:
    """One attempt at each job's unfinished entries, the peers in parallel (lanes);
    returns the jobs whose connection broke (their unfinished entries stay unfinished)."""
    futs = [lanes.submit(_job, pool, job, deadline, reading) for job in jobs[1:]]
    broken: list[tuple[PeerJob, BaseException]] = []
    got = _job(pool, jobs[0], deadline, reading) if jobs else None
    if got is not None:
        broken.append(got)
    for f, job in zip(futs, jobs[1:]):
        try:
            got = f.result()  # each ends by the deadline (kernel timeouts)
        except cf.CancelledError:  # the transport was closed meanwhile
            got = (job, Unavailable("transport closed"))
        if got is not None:
            broken.append(got)
    return broken


def _job(pool: Pool, job: PeerJob, deadline: Deadline, reading: bool
         ) -> tuple[PeerJob, BaseException] | None:
    """One job's unfinished entries over one connection; (job, cause) if it broke."""
    ids = job.pending()
    if not ids:
        return None
    try:
        conn = pool.acquire(job.peer, deadline)
    except KVPlaneError as exc:
        timed_out = isinstance(exc, Timeout) or deadline.expired()
        job.finish_pending(TransferStatus.TIMEOUT if timed_out else TransferStatus.FAILED,
                           str(exc))
        return None
    todo = [ids[a:b] for a, b in frames([job.lengths[i] for i in ids])]
    todo.reverse()  # popped from the end, in order
    waiting: collections.deque[tuple[int, list[int]]] = collections.deque()
    try:
        conn.set_timeout(deadline)
        while todo or waiting:
            while todo and len(waiting) < READV_WINDOW:
                ids = todo.pop()
                waiting.append((_send_frame(conn, job, ids, reading), ids))
            if deadline.expired():
                raise TimeoutError("deadline passed")
            conn.set_timeout(deadline)
            rid, ids = waiting[0]
            _settle(job, ids, _receive_frame(conn, job, rid, ids, reading), reading)
            waiting.popleft()
    except TimeoutError:
        conn.close()
        job.finish_pending(TransferStatus.TIMEOUT, "deadline passed waiting for the peer")
    except (OSError, Unavailable, ProtocolError) as exc:
        conn.close()
        return job, exc
    else:
        pool.release(conn)
    return None


def _receive_frame(conn: Conn, job: PeerJob, rid: int, ids: list[int], reading: bool) -> _Outcome:
    """The answer to the frame ``rid`` of entries ``ids`` (READ bytes land in their views)."""
    if len(ids) == 1:
        return conn.receive_one(rid, job.views[ids[0]] if reading else None)
    if reading:
        views = job.views
        return conn.receive_readv(
            rid, views.each(ids) if isinstance(views, Span) else [views[i] for i in ids],
            [job.lengths[i] for i in ids], runs(views, ids))
    return conn.receive_codes(rid, len(ids))


def _settle(job: PeerJob, ids: list[int], outcome: _Outcome, reading: bool) -> None:
    """Record the outcome of one frame's entries in ``job`` (the usual case: all completed)."""
    codes, whole = outcome
    if not whole and not any(codes):
        for i in ids:
            job.status[i] = TransferStatus.COMPLETED
        return
    for i, code in zip(ids, codes):
        if whole or code:
            job.status[i] = TransferStatus.FAILED
            job.errors[i] = whole or refused(code, "READ" if reading else "WRITE")
        else:
            job.status[i] = TransferStatus.COMPLETED


def _send_frame(conn: Conn, job: PeerJob, ids: list[int], reading: bool) -> int:
    """Send one frame for entries ``ids``: a plain READ or WRITE (the listener's cheapest
    frame) for one entry, else a READV or WRITEV. Returns its request id."""
    if len(ids) == 1:
        i, rid = ids[0], conn.next_id()
        head = protocol.pack_req(protocol.OP_READ if reading else protocol.OP_WRITE, rid,
                                 job.remote[i], job.lengths[i], job.gens[i])
        protocol.send_all(conn.sock, [head] if reading else [head, job.views[i]])
        return rid
    table = job.table(ids)
    if reading:
        return conn.send_readv(table, len(ids))
    rid = conn.next_id()
    protocol.send_all(conn.sock, [
        protocol.pack_req(protocol.OP_WRITEV, rid, len(ids),
                          len(table) + sum(job.lengths[i] for i in ids)),
        table, *runs(job.views, ids)])
    return rid
