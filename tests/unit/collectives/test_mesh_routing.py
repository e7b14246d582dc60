"""Mesh frame routing, driven frame by frame from scripted peers on socketpairs (no threads).

Each test plays ranks 1 and 2 against rank 0's Mesh (kvplane.testing.mesh_peers) and checks
where a frame goes: into the posted buffer, the P2P stash, the bin (stale epoch/op/attempt), on
hold (a newer epoch or op), into the evidence table (a smaller attempt, an ABORT), or whether it
costs the peer its connection (oversized, wrong size, unknown kind, corrupt header).
"""

from __future__ import annotations

import time

import pytest

from kvplane.testing.needs import need_module

need_module("torch", "pip install torch==2.13.0")  # the collectives package imports it

from kvplane.collectives.frames import KIND_ABORT, KIND_DATA, KIND_HELLO, KIND_P2P, Header
from kvplane.collectives.mesh import AttemptFailed, Mesh, Post, StreamRecv, StreamSend
from kvplane.testing.faults import FaultKind, FaultPlan
from kvplane.testing.mesh_peers import FramePeer, wire

pytestmark = pytest.mark.timeout(20)
ALL = 0b111  # ranks 0, 1, 2


@pytest.fixture
def mesh():
    m = Mesh(0, max_payload=1 << 20, stash_limit=256)
    yield m
    m.close()


@pytest.fixture
def connect(mesh):
    """``connect(ranks, plan=None)`` wires scripted peers to the mesh; closed after the test."""
    made: list[FramePeer] = []

    def make(ranks: list[int], plan: FaultPlan | None = None) -> dict[int, FramePeer]:
        peers = wire(mesh, ranks, plan)
        made.extend(peers.values())
        return peers

    yield make
    for peer in made:
        peer.close()


def send(peer: FramePeer, kind: int, seq: int, payload: bytes = b"", mask: int = ALL,
         step: int = 0, tag: int = 0, epoch: int = 0) -> None:
    peer.send(Header(kind, peer.rank, epoch, seq, mask, step, tag, len(payload)), payload)


def post_data(seq: int, size: int, mask: int = ALL, step: int = 0) -> Post:
    return Post(KIND_DATA, seq, mask, step, 0, memoryview(bytearray(size)))


def post_p2p(seq: int, tag: int, size: int) -> Post:
    return Post(KIND_P2P, seq, 0, 0, tag, memoryview(bytearray(size)))


def receive(mesh: Mesh, *posts: tuple[int, Post], within: float = 5.0) -> None:
    mesh.exchange([], list(posts), time.monotonic() + within, lambda peer: False)


def test_a_frame_for_the_posted_step_lands_in_the_posted_buffer(mesh, connect):
    p1 = connect([1])[1]
    mesh.begin(3, ALL)
    send(p1, KIND_DATA, 3, b"abcd")
    post = post_data(3, 4)
    receive(mesh, (1, post))
    assert post.done and bytes(post.buf) == b"abcd"


def test_frames_of_an_older_epoch_are_drained_and_ignored(mesh, connect):
    p1 = connect([1])[1]
    mesh.set_epoch(2)
    mesh.begin(0, ALL)
    send(p1, KIND_DATA, 0, b"old!", epoch=1)
    send(p1, KIND_ABORT, 0, mask=0b001, epoch=1)
    send(p1, KIND_DATA, 0, b"new!", epoch=2)
    post = post_data(0, 4)
    receive(mesh, (1, post))
    assert bytes(post.buf) == b"new!" and mesh.evidence == {}


def test_data_of_an_older_op_or_of_a_larger_attempt_is_dropped(mesh, connect):
    p1 = connect([1])[1]
    mesh.begin(5, 0b011)
    send(p1, KIND_DATA, 4, b"aaaa", mask=0b011)  # an op this rank has finished
    send(p1, KIND_DATA, 5, b"bbbb", mask=ALL)  # the attempt before rank 2 was dropped
    send(p1, KIND_DATA, 5, b"cccc", mask=0b011)
    post = post_data(5, 4, mask=0b011)
    receive(mesh, (1, post))
    assert bytes(post.buf) == b"cccc" and mesh.evidence == {}


def test_data_of_a_smaller_attempt_is_evidence_and_waits_for_that_attempt(mesh, connect):
    peers = connect([1, 2])
    mesh.begin(5, ALL)
    send(peers[1], KIND_DATA, 5, b"v2v2", mask=0b011)  # rank 1 already dropped rank 2
    with pytest.raises(AttemptFailed) as info:
        receive(mesh, (1, post_data(5, 4)))
    assert info.value.evidence and info.value.exclude == 0b100
    assert mesh.evidence == {5: 0b011}
    mesh.abandon(0b011)
    post = post_data(5, 4, mask=0b011)
    receive(mesh, (1, post))  # the held frame is the one for the new attempt
    assert bytes(post.buf) == b"v2v2"
    abort, _ = peers[1].recv()
    assert (abort.kind, abort.seq, abort.mask) == (KIND_ABORT, 5, 0b011)


def test_aborts_record_each_senders_view(mesh, connect):
    peers = connect([1, 2])
    mesh.begin(7, ALL)
    send(peers[1], KIND_ABORT, 7, mask=0b101)
    send(peers[2], KIND_ABORT, 7, mask=0b011)
    with pytest.raises(AttemptFailed) as info:
        receive(mesh, (1, post_data(7, 4)), (2, post_data(7, 4)))
    assert info.value.evidence
    mesh.flush(time.monotonic() + 1)
    deadline = time.monotonic() + 5
    while mesh.evidence.get(7) != 0b001 and time.monotonic() < deadline:
        with pytest.raises(AttemptFailed):
            receive(mesh, (1, post_data(7, 4)), (2, post_data(7, 4)), within=0.05)
    assert mesh.evidence == {7: 0b001}  # the intersection of both views


def test_a_frame_of_a_newer_epoch_waits_until_this_rank_gets_there(mesh, connect):
    p1 = connect([1])[1]
    mesh.begin(0, ALL)
    send(p1, KIND_DATA, 0, b"next", epoch=1)
    with pytest.raises(AttemptFailed) as info:
        receive(mesh, (1, post_data(0, 4)), within=0.3)
    assert not info.value.evidence and mesh.alive(1)
    mesh.abandon(ALL)  # what the process group does after every failed attempt
    mesh.set_epoch(1)
    mesh.begin(0, ALL)
    post = post_data(0, 4)
    receive(mesh, (1, post))
    assert bytes(post.buf) == b"next"


def test_a_frame_for_a_later_op_is_held_until_that_op_is_posted(mesh, connect):
    p1 = connect([1])[1]
    mesh.begin(1, ALL)
    send(p1, KIND_DATA, 2, b"two!")
    with pytest.raises(AttemptFailed):
        receive(mesh, (1, post_data(1, 4)), within=0.3)
    mesh.begin(2, ALL)
    post = post_data(2, 4)
    receive(mesh, (1, post))
    assert bytes(post.buf) == b"two!"


def test_unexpected_point_to_point_data_is_stashed_for_a_later_receive(mesh, connect):
    p1 = connect([1])[1]
    send(p1, KIND_P2P, 0, b"for tag nine", tag=9)
    send(p1, KIND_P2P, 0, b"eight", tag=8)
    eight = post_p2p(0, 8, 5)
    receive(mesh, (1, eight))
    assert bytes(eight.buf) == b"eight"
    assert list(mesh.stash) == [(1, 9, 0)]
    nine = post_p2p(0, 9, 12)
    receive(mesh, (1, nine), within=0.0)  # served from the stash, nothing to wait for
    assert bytes(nine.buf) == b"for tag nine" and mesh.stash == {}


def test_stashing_past_the_limit_costs_the_peer_its_connection(mesh, connect):
    peers = connect([1, 2])
    send(peers[1], KIND_P2P, 0, b"x" * 300, tag=1)  # the stash holds 256 bytes
    with pytest.raises(AttemptFailed) as info:
        receive(mesh, (1, post_p2p(0, 2, 4)))
    assert info.value.exclude == 0b010
    assert not mesh.alive(1) and mesh.alive(2) and peers[1].closed_by_mesh()


def test_a_frame_of_the_wrong_size_for_the_posted_buffer_costs_the_connection(mesh, connect):
    p1 = connect([1])[1]
    mesh.begin(0, ALL)
    send(p1, KIND_DATA, 0, b"eight by")
    with pytest.raises(AttemptFailed) as info:
        receive(mesh, (1, post_data(0, 4)))
    assert info.value.exclude == 0b010 and not mesh.alive(1)


def test_a_hello_after_the_handshake_costs_the_connection(mesh, connect):
    p1 = connect([1])[1]
    send(p1, KIND_HELLO, 0)
    with pytest.raises(AttemptFailed):
        receive(mesh, (1, post_p2p(0, 0, 1)))
    assert not mesh.alive(1)


def test_a_corrupt_header_drops_that_peer_only(mesh, connect):
    plan = FaultPlan(seed=11).corrupt(peer="1", op="data", at=0)
    peers = connect([1, 2], plan)
    mesh.begin(0, ALL)
    send(peers[1], KIND_DATA, 0, b"1111")
    send(peers[2], KIND_DATA, 0, b"2222")
    with pytest.raises(AttemptFailed) as info:
        receive(mesh, (1, post_data(0, 4)), (2, post_data(0, 4)))
    assert info.value.exclude == 0b010
    assert not mesh.alive(1) and mesh.alive(2)
    assert plan.count(FaultKind.CORRUPT) == 1


def test_a_peer_that_hangs_up_mid_op_fails_the_exchange(mesh, connect):
    plan = FaultPlan(seed=12).disconnect(peer="2", op="data", after=1)
    peers = connect([1, 2], plan)
    mesh.begin(0, ALL)
    send(peers[2], KIND_DATA, 0, b"ok!!")
    posts = [post_data(0, 4), post_data(0, 4, step=1)]
    receive(mesh, (2, posts[0]))
    send(peers[2], KIND_DATA, 0, b"lost", step=1)  # never leaves: the peer hangs up instead
    with pytest.raises(AttemptFailed) as info:
        receive(mesh, (2, posts[1]))
    assert info.value.exclude == 0b100 and not mesh.alive(2) and mesh.alive(1)


def test_empty_frames_complete_without_a_payload(mesh, connect):
    p1 = connect([1])[1]
    mesh.begin(0, ALL)
    send(p1, KIND_P2P, 0, tag=4)
    send(p1, KIND_DATA, 0)
    p2p, data = post_p2p(0, 4, 0), post_data(0, 0)
    receive(mesh, (1, p2p))
    receive(mesh, (1, data))
    assert p2p.done and data.done


def test_a_pipelined_stream_sends_right_and_receives_from_the_left(mesh, connect):
    peers = connect([1, 2])
    mesh.begin(9, ALL)
    got = bytearray(4)
    seen: list[int] = []
    send(peers[2], KIND_DATA, 9, b"left", step=0)
    mesh.stream(1, [StreamSend(1, memoryview(b"rite"), after_recv=0)], 2,
                [StreamRecv(0, memoryview(got), lambda: seen.append(0))],
                time.monotonic() + 5, lambda peer: False)
    assert got == b"left" and seen == [0]
    header, payload = peers[1].recv()
    assert (header.kind, header.seq, header.step, payload) == (KIND_DATA, 9, 1, b"rite")
