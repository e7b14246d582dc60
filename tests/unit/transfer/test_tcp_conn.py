"""transports/tcp.py without sockets: Conn.execute and the lane retry loop over fake data sockets.

The far side is :class:`kvplane.testing.fake_data_socket.FakeDataPeer`, which speaks the data
protocol in memory and injects the faults of a seeded FaultPlan.
"""

from __future__ import annotations

import threading
import time

import pytest

from kvplane.common import metrics
from kvplane.common.deadline import Deadline
from kvplane.common.errors import AddressNotRegistered, ProtocolError, Timeout, Unavailable
from kvplane.testing.fake_data_socket import FakeDataPeer
from kvplane.testing.faults import FaultKind, FaultPlan
from kvplane.transfer.batch import Batch, Slice
from kvplane.transfer.jobs import PeerJob, Span
from kvplane.transfer.transports.base import Route, TransportContext
from kvplane.transfer.transports.tcp import TcpTransport
from kvplane.transfer.transports.tcp_conn import WINDOW, Broken, Conn
from kvplane.transfer.types import OpCode, RegionDesc, SegmentDesc, TransferRequest, TransferStatus

pytestmark = pytest.mark.timeout(20)
BASE = 0x10000
ADDR = ("10.0.0.9", 7000)


def make_slices(ops: list[OpCode], size: int, local: bytearray) -> list[Slice]:
    """One task per slice; slice k moves ``size`` bytes between local[k*size:] and BASE+k*size."""
    batch = Batch(0, len(ops))
    tasks = batch.add([TransferRequest(op, 0, 1, k * size, size) for k, op in enumerate(ops)])
    out = []
    for k, (task, op) in enumerate(zip(tasks, ops)):
        batch.expect(task, 1)
        out.append(Slice(task, op, memoryview(local)[k * size:(k + 1) * size], BASE + k * size, size))
    return out


def statuses(slices: list[Slice]) -> list[TransferStatus]:
    return [s.task.status for s in slices]


def fill(peer: FakeDataPeer, n: int) -> None:
    peer.memory[:n] = bytes(i % 251 for i in range(n))


def test_writes_and_reads_complete_and_move_the_bytes():
    peer = FakeDataPeer(size=8 * 64)
    fill(peer, 4 * 64)
    local = bytearray(b"\x07" * 8 * 64)
    ops = [OpCode.READ] * 4 + [OpCode.WRITE] * 4
    slices = make_slices(ops, 64, local)
    Conn(peer.connect(), ADDR, readv=False).execute(slices, Deadline.after(5))
    assert statuses(slices) == [TransferStatus.COMPLETED] * 8
    assert local[:4 * 64] == peer.memory[:4 * 64]
    assert peer.memory[4 * 64:] == b"\x07" * 4 * 64
    assert [op for op, _, _ in peer.served] == ["read"] * 4 + ["write"] * 4


def test_reads_are_pipelined_up_to_the_window_and_no_further():
    n = 3 * WINDOW + 5
    peer = FakeDataPeer(size=n * 16)
    fill(peer, n * 16)
    local = bytearray(n * 16)
    slices = make_slices([OpCode.READ] * n, 16, local)
    Conn(peer.connect(), ADDR, readv=False).execute(slices, Deadline.after(5))
    assert statuses(slices) == [TransferStatus.COMPLETED] * n
    assert local == peer.memory
    in_flight = [unread + 1 for _, unread in peer.arrivals]
    assert max(in_flight) == WINDOW


def test_a_write_waits_until_no_read_is_outstanding():
    ops = [OpCode.READ, OpCode.READ, OpCode.WRITE, OpCode.READ, OpCode.WRITE, OpCode.WRITE]
    peer = FakeDataPeer(size=len(ops) * 32)
    slices = make_slices(ops, 32, bytearray(len(ops) * 32))
    Conn(peer.connect(), ADDR, readv=False).execute(slices, Deadline.after(5))
    assert statuses(slices) == [TransferStatus.COMPLETED] * len(ops)
    # (op, answers still unread when it arrived): each write went only once no read was
    # outstanding; reads and writes behind a write pipeline freely.
    assert peer.arrivals == [("read", 0), ("read", 1), ("write", 0), ("read", 1), ("write", 0),
                             ("write", 1)]


def test_partial_sends_and_receives_still_move_every_byte():
    peer = FakeDataPeer(size=6 * 100, send_chunk=7, recv_chunk=5)
    fill(peer, 3 * 100)
    local = bytearray(b"\x01" * 6 * 100)
    slices = make_slices([OpCode.READ] * 3 + [OpCode.WRITE] * 3, 100, local)
    Conn(peer.connect(), ADDR, readv=False).execute(slices, Deadline.after(5))
    assert statuses(slices) == [TransferStatus.COMPLETED] * 6
    assert local[:300] == peer.memory[:300] and peer.memory[300:] == b"\x01" * 300


def test_an_error_answer_fails_that_slice_only_and_keeps_the_connection():
    plan = FaultPlan(seed=1).fail(op="read", after=1, error=AddressNotRegistered)
    peer = FakeDataPeer(size=4 * 64, plan=plan)
    slices = make_slices([OpCode.READ] * 4, 64, bytearray(4 * 64))
    conn = Conn(peer.connect(), ADDR, readv=False)
    conn.execute(slices, Deadline.after(5))
    assert statuses(slices) == [TransferStatus.COMPLETED, TransferStatus.FAILED,
                                TransferStatus.COMPLETED, TransferStatus.COMPLETED]
    assert "injected failure" in slices[1].task.error
    assert conn.alive and plan.count(FaultKind.FAIL) == 1


def test_a_peer_that_hangs_up_reports_the_unfinished_slices():
    plan = FaultPlan(seed=2).disconnect(op="read", after=2)
    peer = FakeDataPeer(size=5 * 64, plan=plan)
    slices = make_slices([OpCode.READ] * 5, 64, bytearray(5 * 64))
    conn = Conn(peer.connect(), ADDR, readv=False)
    with pytest.raises(Broken) as info:
        conn.execute(slices, Deadline.after(5))
    assert info.value.left == slices[2:]
    assert isinstance(info.value.__cause__, Unavailable)
    assert statuses(slices)[:2] == [TransferStatus.COMPLETED] * 2
    assert statuses(slices)[2:] == [TransferStatus.PENDING] * 3  # the retry loop owns them now
    assert not conn.alive and peer.sockets[0].closed


def test_unconfirmed_writes_are_handed_back_even_if_the_peer_applied_them():
    plan = FaultPlan(seed=2).disconnect(op="write", after=2)
    peer = FakeDataPeer(size=5 * 64, plan=plan)
    slices = make_slices([OpCode.WRITE] * 5, 64, bytearray(5 * 64))
    with pytest.raises(Broken) as info:
        Conn(peer.connect(), ADDR, readv=False).execute(slices, Deadline.after(5))
    done = [s for s in slices if s.task.status == TransferStatus.COMPLETED]
    assert set(map(id, done)).isdisjoint(map(id, info.value.left))
    assert len(done) + len(info.value.left) == 5  # nothing lost: confirmed or handed back
    assert info.value.left[-3:] == slices[2:]


@pytest.mark.parametrize("at,match", [(0, "magic"), (8, "response id")])
def test_a_corrupt_response_header_breaks_the_connection(at, match):
    plan = FaultPlan(seed=3).corrupt(op="read", after=1, at=at)
    peer = FakeDataPeer(size=3 * 64, plan=plan)
    slices = make_slices([OpCode.READ] * 3, 64, bytearray(3 * 64))
    with pytest.raises(Broken) as info:
        Conn(peer.connect(), ADDR, readv=False).execute(slices, Deadline.after(5))
    assert isinstance(info.value.__cause__, ProtocolError) and match in str(info.value)
    assert info.value.left == slices[1:]


def test_a_read_answered_with_the_wrong_length_is_a_protocol_error():
    plan = FaultPlan(seed=4).corrupt(op="read", at=16)  # low byte of the length field
    peer = FakeDataPeer(size=64, plan=plan)
    slices = make_slices([OpCode.READ], 64, bytearray(64))
    with pytest.raises(Broken, match="READ returned"):
        Conn(peer.connect(), ADDR, readv=False).execute(slices, Deadline.after(5))


def test_a_stalled_peer_times_out_every_unfinished_slice_by_the_deadline():
    plan = FaultPlan(seed=5).drop(op="read", after=2)
    peer = FakeDataPeer(size=6 * 64, plan=plan)
    slices = make_slices([OpCode.READ] * 6, 64, bytearray(6 * 64))
    conn = Conn(peer.connect(), ADDR, readv=False)
    t0 = time.monotonic()
    conn.execute(slices, Deadline.after(0.3))
    assert time.monotonic() - t0 < 3.0
    assert statuses(slices) == [TransferStatus.COMPLETED] * 2 + [TransferStatus.TIMEOUT] * 4
    assert not conn.alive


def test_a_passed_deadline_times_out_without_waiting_for_the_peer():
    peer = FakeDataPeer(size=2 * 64)
    slices = make_slices([OpCode.READ] * 2, 64, bytearray(2 * 64))
    Conn(peer.connect(), ADDR, readv=False).execute(slices, Deadline(time.monotonic() - 1))
    assert statuses(slices) == [TransferStatus.TIMEOUT] * 2


def test_a_delayed_answer_within_the_deadline_still_completes():
    plan = FaultPlan(seed=6).delay(0.05, op="read")
    peer = FakeDataPeer(size=64, plan=plan)
    slices = make_slices([OpCode.READ], 64, bytearray(64))
    Conn(peer.connect(), ADDR, readv=False).execute(slices, Deadline.after(5))
    assert statuses(slices) == [TransferStatus.COMPLETED]
    assert plan.count(FaultKind.DELAY) == 1


# -- the lane: retries on a fresh connection ---------------------------------------------------
class FakeNetTcp(TcpTransport):
    """TcpTransport whose connections go to a FakeDataPeer instead of the network."""

    def __init__(self, peer: FakeDataPeer, retries: int = 2, refuse: bool = False,
                 token: str = "") -> None:
        super().__init__(TransportContext("host", token, 1 << 20, 1, "", retries=retries))
        self.peer = peer
        self.refuse = refuse

    def _connect(self, peer, timeout):
        if self.refuse:
            raise Unavailable(f"cannot connect to {peer[0]}:{peer[1]}: refused")
        conn = Conn(self.peer.connect(), peer)
        if self.ctx.token:
            conn.hello(self.ctx.token, timeout)  # as Conn.open does after connecting
        return conn


def route() -> Route:
    seg = SegmentDesc("seg", ADDR[0], ADDR[1], "other-host", 1, ["tcp"], [RegionDesc(BASE, 1 << 20)])
    return Route(seg, seg.regions[0], False)


def retries() -> float:
    return metrics.TRANSFER_RETRIES.labels("tcp")._value.get()


@pytest.fixture
def lane_peer():
    """A peer, and a factory of FakeNetTcp transports to it (closed after the test)."""
    made: list[FakeNetTcp] = []

    def make(plan: FaultPlan, size: int, **kw) -> tuple[FakeDataPeer, FakeNetTcp]:
        peer = FakeDataPeer(size=size, plan=plan)
        made.append(FakeNetTcp(peer, **kw))
        return peer, made[-1]

    yield make
    for tcp in made:
        tcp.close()


def test_a_broken_connection_is_retried_on_a_fresh_one(lane_peer):
    peer, tcp = lane_peer(FaultPlan(seed=7).disconnect(op="read", after=3), 8 * 64)
    fill(peer, 8 * 64)
    local = bytearray(8 * 64)
    slices = make_slices([OpCode.READ] * 8, 64, local)
    before = retries()
    tcp.run(route(), slices, Deadline.after(5))
    assert statuses(slices) == [TransferStatus.COMPLETED] * 8
    assert local == peer.memory
    assert len(peer.sockets) == 2 and peer.sockets[0].closed and not peer.sockets[1].closed
    assert [addr for _, addr, _ in peer.served] == [BASE + k * 64 for k in range(8)]
    assert retries() == before + 1


def test_writes_retried_after_a_hang_up_leave_the_right_bytes(lane_peer):
    peer, tcp = lane_peer(FaultPlan(seed=7).disconnect(op="write", after=3), 8 * 64)
    local = bytearray(bytes(range(1, 9)) * 64)
    slices = make_slices([OpCode.WRITE] * 8, 64, local)
    tcp.run(route(), slices, Deadline.after(5))
    assert statuses(slices) == [TransferStatus.COMPLETED] * 8
    assert peer.memory == local and len(peer.sockets) == 2


def test_the_healthy_connection_goes_back_to_the_pool(lane_peer):
    peer, tcp = lane_peer(FaultPlan(), 64)
    for _ in range(3):
        slices = make_slices([OpCode.READ], 64, bytearray(64))
        tcp.run(route(), slices, Deadline.after(5))
        assert statuses(slices) == [TransferStatus.COMPLETED]
    assert len(peer.sockets) == 1


def test_a_peer_that_keeps_hanging_up_fails_after_the_retries(lane_peer):
    plan = FaultPlan(seed=8).disconnect(op="read", times=None)
    peer, tcp = lane_peer(plan, 4 * 64, retries=2)
    slices = make_slices([OpCode.READ] * 4, 64, bytearray(4 * 64))
    tcp.run(route(), slices, Deadline.after(5))
    assert statuses(slices) == [TransferStatus.FAILED] * 4
    assert "connection to 10.0.0.9:7000 failed" in slices[0].task.error
    assert len(peer.sockets) == 3 and plan.count(FaultKind.DISCONNECT) == 3


def test_an_unreachable_peer_fails_every_slice(lane_peer):
    peer, tcp = lane_peer(FaultPlan(), 64, refuse=True)
    slices = make_slices([OpCode.READ] * 2, 32, bytearray(64))
    tcp.run(route(), slices, Deadline.after(5))
    assert statuses(slices) == [TransferStatus.FAILED] * 2
    assert "refused" in slices[0].task.error and not peer.sockets


def test_a_stall_is_a_timeout_and_is_not_retried(lane_peer):
    peer, tcp = lane_peer(FaultPlan(seed=9).drop(op="read"), 2 * 64)
    slices = make_slices([OpCode.READ] * 2, 64, bytearray(2 * 64))
    tcp.run(route(), slices, Deadline.after(0.2))
    assert statuses(slices) == [TransferStatus.TIMEOUT] * 2
    assert len(peer.sockets) == 1


def test_a_rejected_token_fails_the_slices_without_retrying(lane_peer):
    peer, tcp = lane_peer(FaultPlan(), 64, token="wrong")
    peer.token = b"secret"
    slices = make_slices([OpCode.READ], 64, bytearray(64))
    tcp.run(route(), slices, Deadline.after(5))
    assert statuses(slices) == [TransferStatus.FAILED]
    assert "bad token" in slices[0].task.error
    assert len(peer.sockets) == 1 and peer.sockets[0].closed


# -- READV: many READs in one frame ----------------------------------------------------------------
def test_reads_go_as_readv_frames_and_move_the_bytes():
    from kvplane.transfer import protocol
    from kvplane.transfer.transports.tcp_conn import READV_WINDOW
    n = 3 * protocol.MAX_READV + 7
    peer = FakeDataPeer(size=n * 16, recv_chunk=100)  # partial scatter receives too
    fill(peer, n * 16)
    local = bytearray(n * 16)
    slices = make_slices([OpCode.READ] * n, 16, local)
    Conn(peer.connect(), ADDR).execute(slices, Deadline.after(5))
    assert statuses(slices) == [TransferStatus.COMPLETED] * n and local == peer.memory
    assert [op for op, _ in peer.arrivals] == ["readv"] * 4
    assert max(unread + 1 for _, unread in peer.arrivals) == READV_WINDOW


def test_a_failed_readv_entry_fails_that_slice_only_and_keeps_the_connection():
    plan = FaultPlan(seed=1).fail(op="read", after=1, error=AddressNotRegistered)
    peer = FakeDataPeer(size=4 * 64, plan=plan)
    fill(peer, 4 * 64)
    local = bytearray(4 * 64)
    slices = make_slices([OpCode.READ] * 4, 64, local)
    conn = Conn(peer.connect(), ADDR)
    conn.execute(slices, Deadline.after(5))
    assert statuses(slices) == [TransferStatus.COMPLETED, TransferStatus.FAILED,
                                TransferStatus.COMPLETED, TransferStatus.COMPLETED]
    assert "AddressNotRegistered" in slices[1].task.error and conn.alive
    assert local[:64] == peer.memory[:64] and local[128:] == peer.memory[128:]
    assert local[64:128] == bytes(64)  # the failed entry's bytes were not sent, nothing landed


def test_a_hang_up_inside_a_readv_hands_back_every_slice_of_unanswered_frames():
    from kvplane.transfer import protocol
    n = protocol.MAX_READV + 10  # two frames; the peer hangs up inside the second
    plan = FaultPlan(seed=2).disconnect(op="read", after=protocol.MAX_READV + 3)
    peer = FakeDataPeer(size=n * 8, plan=plan)
    slices = make_slices([OpCode.READ] * n, 8, bytearray(n * 8))
    with pytest.raises(Broken) as info:
        Conn(peer.connect(), ADDR).execute(slices, Deadline.after(5))
    assert info.value.left == slices[protocol.MAX_READV:]
    assert statuses(slices[:protocol.MAX_READV]) == [TransferStatus.COMPLETED] * protocol.MAX_READV


def test_a_stalled_readv_peer_times_out_every_slice_by_the_deadline():
    plan = FaultPlan(seed=3).drop(op="read", after=0)
    peer = FakeDataPeer(size=6 * 32, plan=plan)
    slices = make_slices([OpCode.READ] * 6, 32, bytearray(6 * 32))
    t0 = time.monotonic()
    conn = Conn(peer.connect(), ADDR)
    conn.execute(slices, Deadline.after(0.3))
    assert time.monotonic() - t0 < 3.0 and not conn.alive
    assert statuses(slices) == [TransferStatus.TIMEOUT] * 6


@pytest.mark.parametrize("at,match", [(0, "magic"), (24, "READV returned")])
def test_a_corrupt_readv_answer_breaks_the_connection(at, match):
    plan = FaultPlan(seed=4).corrupt(op="read", after=0, at=at)
    peer = FakeDataPeer(size=3 * 32, plan=plan)
    slices = make_slices([OpCode.READ] * 3, 32, bytearray(3 * 32))
    with pytest.raises(Broken) as info:
        Conn(peer.connect(), ADDR).execute(slices, Deadline.after(5))
    assert isinstance(info.value.__cause__, ProtocolError) and match in str(info.value)
    assert info.value.left == slices


# -- read_scatter: READs with no per-slice bookkeeping -------------------------------------------
def scatter_job(n: int, size: int, local: bytearray, gens: list[int] | None = None,
                peer=ADDR, span: bool = False) -> PeerJob:
    """A job reading entry k (``size`` bytes at BASE+k*size) into local[k*size:]; its local
    buffers a list of views, or (``span``) one Span over ``local``."""
    view = memoryview(local)
    views = Span(view, [k * size for k in range(n)], [size] * n) if span else \
        [view[k * size:(k + 1) * size] for k in range(n)]
    return PeerJob(peer, [BASE + k * size for k in range(n)], [size] * n, gens or [0] * n, views)


def test_a_span_merges_entries_that_follow_each_other_and_only_those():
    buf = memoryview(bytearray(range(100)))
    span = Span(buf, [0, 10, 20, 50, 60], [10, 10, 5, 10, 3])
    assert [bytes(v) for v in span.runs([0, 1])] == [bytes(range(20))]  # adjacent: one view
    assert [bytes(v) for v in span.runs([0, 1, 2])] == [bytes(range(25))]
    assert [bytes(v) for v in span.runs([2, 3])] == [bytes(range(20, 25)), bytes(range(50, 60))]
    assert [bytes(v) for v in span.runs([1, 3])] == [bytes(range(10, 20)), bytes(range(50, 60))]
    assert [bytes(v) for v in span.each([4, 0])] == [bytes(range(60, 63)), bytes(range(10))]
    assert bytes(span[3]) == bytes(range(50, 60)) and len(span) == 5


@pytest.mark.parametrize("span", [False, True])
def test_read_scatter_moves_every_byte_in_readv_frames(lane_peer, span):
    from kvplane.transfer import protocol
    n = 2 * protocol.MAX_READV + 5
    peer, tcp = lane_peer(FaultPlan(), n * 16)
    peer.recv_chunk = 100  # partial scatter receives too
    fill(peer, n * 16)
    local = bytearray(n * 16)
    job = scatter_job(n, 16, local, span=span)
    tcp.read_scatter([job], Deadline.after(5))
    assert job.status == [TransferStatus.COMPLETED] * n and local == peer.memory
    assert [addr for _, addr, _ in peer.served] == [BASE + k * 16 for k in range(n)]
    assert len(peer.sockets) == 1 and not peer.sockets[0].closed  # pooled again


@pytest.mark.parametrize("span", [False, True])
def test_read_scatter_fails_only_the_entries_the_peer_refuses(lane_peer, span):
    peer, tcp = lane_peer(FaultPlan(), 4 * 64)
    fill(peer, 4 * 64)
    local = bytearray(5 * 64)
    job = scatter_job(5, 64, local, span=span)  # entry 4 lies past the peer's memory
    tcp.read_scatter([job], Deadline.after(5))
    assert job.status == [TransferStatus.COMPLETED] * 4 + [TransferStatus.FAILED]
    assert "AddressNotRegistered" in job.errors[4]
    assert local[:256] == peer.memory and local[256:] == bytes(64)  # nothing lands for it


@pytest.mark.parametrize("span", [False, True])
def test_read_scatter_retries_a_broken_connection_on_a_fresh_one(lane_peer, span):
    peer, tcp = lane_peer(FaultPlan(seed=7).disconnect(op="read", after=3), 8 * 64)
    fill(peer, 8 * 64)
    local = bytearray(8 * 64)
    job = scatter_job(8, 64, local, span=span)
    before = retries()
    tcp.read_scatter([job], Deadline.after(5))
    assert job.status == [TransferStatus.COMPLETED] * 8 and local == peer.memory
    assert len(peer.sockets) == 2 and peer.sockets[0].closed
    assert retries() == before + 1


def test_read_scatter_fails_after_the_retries_when_the_peer_keeps_hanging_up(lane_peer):
    plan = FaultPlan(seed=8).disconnect(op="read", times=None)
    peer, tcp = lane_peer(plan, 4 * 64, retries=2)
    job = scatter_job(4, 64, bytearray(4 * 64))
    tcp.read_scatter([job], Deadline.after(5))
    assert job.status == [TransferStatus.FAILED] * 4
    assert "connection to 10.0.0.9:7000 failed" in job.errors[0]
    assert len(peer.sockets) == 3


@pytest.mark.parametrize("op", ["read", "write"])
def test_a_stalled_peer_times_out_every_entry_by_the_deadline(lane_peer, op):
    peer, tcp = lane_peer(FaultPlan(seed=9).drop(op=op), 2 * 64)
    job = scatter_job(2, 64, bytearray(2 * 64))
    t0 = time.monotonic()
    (tcp.read_scatter if op == "read" else tcp.write_gather)([job], Deadline.after(0.2))
    assert time.monotonic() - t0 < 2.0
    assert job.status == [TransferStatus.TIMEOUT] * 2 and len(peer.sockets) == 1


def test_read_scatter_fails_an_unreachable_peer(lane_peer):
    peer, tcp = lane_peer(FaultPlan(), 64, refuse=True)
    job = scatter_job(2, 32, bytearray(64))
    tcp.read_scatter([job], Deadline.after(5))
    assert job.status == [TransferStatus.FAILED] * 2 and "refused" in job.errors[0]


class TwoPeerTcp(TcpTransport):
    """Connections to ADDR go to ``a``, to any other address to ``b``; with ``hang_connect``,
    a connect to ``b`` hangs until its timeout (a host that does not answer SYNs) or until
    ``released`` is set, then times out."""

    def __init__(self, a: FakeDataPeer, b: FakeDataPeer, hang_connect: bool = False) -> None:
        super().__init__(TransportContext("host", "", 1 << 20, 1, "", retries=0))
        self.peers = {ADDR: a}
        self.other = b
        self.hang_connect = hang_connect
        self.released = threading.Event()

    def _connect(self, peer, timeout):
        if peer != ADDR and self.hang_connect:
            self.released.wait(timeout)
            raise Timeout(f"cannot connect to {peer[0]}:{peer[1]}: timed out")
        return Conn(self.peers.get(peer, self.other).connect(), peer)


def test_read_scatter_serves_one_peer_while_the_other_stalls():
    a = FakeDataPeer(size=4 * 64)
    b = FakeDataPeer(size=4 * 64, plan=FaultPlan(seed=3).drop(op="read"))
    fill(a, 4 * 64)
    tcp = TwoPeerTcp(a, b)
    try:
        la, lb = bytearray(4 * 64), bytearray(4 * 64)
        ja = scatter_job(4, 64, la)
        jb = scatter_job(4, 64, lb, peer=("10.0.0.10", 7000))
        tcp.read_scatter([jb, ja], Deadline.after(0.3))  # the stalled one first
        assert ja.status == [TransferStatus.COMPLETED] * 4 and la == a.memory
        assert jb.status == [TransferStatus.TIMEOUT] * 4
        assert b.sockets[0].closed  # a timed-out connection is never pooled
    finally:
        tcp.close()


# -- write_gather: WRITEV frames -----------------------------------------------------------------
@pytest.mark.parametrize("span", [False, True])
def test_write_gather_moves_every_byte_in_writev_frames(lane_peer, span):
    from kvplane.transfer import protocol
    n = 2 * protocol.MAX_READV + 5
    peer, tcp = lane_peer(FaultPlan(), n * 16)
    peer.send_chunk = 1000  # partial sends too
    local = bytearray(bytes(i % 253 for i in range(n * 16)))
    job = scatter_job(n, 16, local, span=span)
    tcp.write_gather([job], Deadline.after(5))
    assert job.status == [TransferStatus.COMPLETED] * n and peer.memory == local
    assert [op for op, _ in peer.arrivals] == ["writev"] * 3  # 256 + 256 + 5 entries
    assert len(peer.sockets) == 1 and not peer.sockets[0].closed


@pytest.mark.parametrize("span", [False, True])
def test_write_gather_fails_only_the_entries_the_peer_refuses(lane_peer, span):
    peer, tcp = lane_peer(FaultPlan(), 4 * 64)
    local = bytearray(b"\x07" * (5 * 64))
    job = scatter_job(5, 64, local, span=span)  # entry 4 lies past the peer's memory
    tcp.write_gather([job], Deadline.after(5))
    assert job.status == [TransferStatus.COMPLETED] * 4 + [TransferStatus.FAILED]
    assert "WRITE refused by the peer: AddressNotRegistered" in job.errors[4]
    assert peer.memory == local[:256]


@pytest.mark.parametrize("span", [False, True])
def test_write_gather_writes_again_on_a_fresh_connection_after_a_hang_up(lane_peer, span):
    peer, tcp = lane_peer(FaultPlan(seed=7).disconnect(op="write", after=3), 8 * 64)
    local = bytearray(bytes(range(1, 9)) * 64)
    job = scatter_job(8, 64, local, span=span)
    before = retries()
    tcp.write_gather([job], Deadline.after(5))
    assert job.status == [TransferStatus.COMPLETED] * 8 and peer.memory == local
    assert len(peer.sockets) == 2 and peer.sockets[0].closed and retries() == before + 1


def test_write_gather_fails_after_the_retries(lane_peer):
    peer, tcp = lane_peer(FaultPlan(seed=8).disconnect(op="write", times=None), 2 * 64)
    job = scatter_job(2, 64, bytearray(2 * 64))
    tcp.write_gather([job], Deadline.after(5))
    assert job.status == [TransferStatus.FAILED] * 2 and "failed" in job.errors[0]
    assert len(peer.sockets) == 3


def test_write_gather_reports_a_corrupt_answer_as_failed_not_written(lane_peer):
    peer, tcp = lane_peer(FaultPlan(seed=4).corrupt(op="write", at=0, times=None), 64)
    job = scatter_job(1, 64, bytearray(64))
    tcp.write_gather([job], Deadline.after(5))
    assert job.status == [TransferStatus.FAILED]  # never COMPLETED on an answer it cannot trust


def test_read_scatter_serves_one_peer_while_connecting_to_the_other_hangs():
    a, b = FakeDataPeer(size=2 * 64), FakeDataPeer(size=2 * 64)
    fill(a, 2 * 64)
    tcp = TwoPeerTcp(a, b, hang_connect=True)
    try:
        la = bytearray(2 * 64)
        ja = scatter_job(2, 64, la)
        jb = scatter_job(2, 64, bytearray(2 * 64), peer=("10.0.0.10", 7000))
        t0 = time.monotonic()
        tcp.read_scatter([jb, ja], Deadline.after(0.3))  # the hanging connect first
        assert time.monotonic() - t0 < 2.0
        assert ja.status == [TransferStatus.COMPLETED] * 2 and la == a.memory
        assert jb.status == [TransferStatus.TIMEOUT] * 2
    finally:
        tcp.released.set()
        tcp.close()
