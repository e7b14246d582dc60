"""Pure parts of the collectives and EP packages: framing, schedules, membership decisions, layouts."""

from __future__ import annotations

import pytest

from kvplane.testing.needs import need_module

torch = need_module("torch", "pip install torch==2.13.0")
import torch.distributed as dist

import kvplane.collectives as kc
import kvplane.ep as kep
from kvplane.collectives import frames, ops, schedule
from kvplane.collectives.membership import Decision, View, decide
from kvplane.common.errors import InvalidArgument, ProtocolError
from kvplane.ep import topology

pytestmark = pytest.mark.timeout(10)


def test_header_roundtrip_and_limits() -> None:
    h = frames.Header(frames.KIND_DATA, 3, 7, 11, 0b1011, 2, -5, 1000)
    assert frames.Header.unpack(h.pack(), 1000) == h
    with pytest.raises(ProtocolError, match="exceeds"):
        frames.Header.unpack(h.pack(), 999)
    bad = bytearray(h.pack())
    bad[0] ^= 0xFF
    with pytest.raises(ProtocolError, match="magic"):
        frames.Header.unpack(bytes(bad), 1000)
    with pytest.raises(ProtocolError, match="abort"):
        frames.Header.unpack(frames.Header(frames.KIND_ABORT, 0, 0, 0, 1, 0, 0, 4).pack(), 10)


def test_masks() -> None:
    assert frames.bits([0, 2, 3]) == 0b1101
    assert frames.ranks_of(0b1101) == [0, 2, 3]
    with pytest.raises(ValueError):
        frames.bits([64])


@pytest.mark.parametrize("numel,n", [(10, 3), (2, 4), (0, 2), (1001, 4)])
def test_split_covers_everything(numel: int, n: int) -> None:
    parts = schedule.split(numel, n)
    assert parts[0][0] == 0 and parts[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
    assert max(hi - lo for lo, hi in parts) - min(hi - lo for lo, hi in parts) <= 1


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_ring_schedules_simulated(n: int) -> None:
    # simulate the ring symbolically: each block's set of folded positions, in order
    held = {(i, b): [i] for i in range(n) for b in range(n)}
    partial = {}
    for s in range(n - 1):
        sends = {}
        for i in range(n):
            sb, _ = schedule.ring_reduce_scatter(i, n)[s]
            sends[(i + 1) % n] = (sb, partial.get((i, sb), held[(i, sb)]))
        for i in range(n):
            _, rb = schedule.ring_reduce_scatter(i, n)[s]
            sb, got = sends[i]
            assert sb == rb, "receiver and sender disagree on the block"
            partial[(i, rb)] = got + [i]
    for i in range(n):
        assert partial[(i, i)] == schedule.reduction_order(i, n)
    have = {i: {i} for i in range(n)}
    for s in range(n - 1):
        moves = [(i, schedule.ring_allgather(i, n)[s]) for i in range(n)]
        for i, (sb, _rb) in moves:
            assert sb in have[i]
            assert schedule.ring_allgather((i + 1) % n, n)[s][1] == sb
        for i, (_, rb) in moves:
            have[i].add(rb)
    assert all(have[i] == set(range(n)) for i in range(n))


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_tree_broadcast_reaches_everyone_once(n: int) -> None:
    got = {0}
    edges = {}
    for v in range(n):
        for level, action, peer in schedule.tree_broadcast(v, n):
            edges.setdefault((level, min(v, peer), max(v, peer)), []).append(action)
    for (level, a, b), acts in sorted(edges.items()):
        assert sorted(acts) == ["recv", "send"], (level, a, b)
        assert a in got
        got.add(b)
    assert got == set(range(n))


def test_pairwise_is_a_permutation() -> None:
    n = 5
    for s in range(n - 1):
        tos = [schedule.pairwise(i, n)[s][0] for i in range(n)]
        assert sorted(tos) == list(range(n))
        for i in range(n):
            to, frm = schedule.pairwise(i, n)[s]
            assert schedule.pairwise(to, n)[s][1] == i


def test_decide_drops_unreachable_and_admits_joiners() -> None:
    views = {0: View(0b1011), 1: View(0b1011, {2: 99}), 3: View(0b1011)}
    assert decide(views) == Decision(0b1111, {2: 99})
    # rank 3 cannot reach 1: the intersection removes 1
    views = {0: View(0b1011), 1: View(0b1011), 3: View(0b1001)}
    assert decide(views).active == 0b1001
    # a silent member (no view) is removed; an explicit drop wins over a join request
    assert decide({0: View(0b11)}).active == 0b01
    assert decide({0: View(0b111, {1: 5}, drop=0b10), 2: View(0b111)}).active == 0b101


def test_reduce_checks_and_fold() -> None:
    with pytest.raises(InvalidArgument):
        ops.check_reduce("avg", torch.int64)
    with pytest.raises(InvalidArgument):
        ops.check_reduce("band", torch.float32)
    with pytest.raises(InvalidArgument):
        ops.check_reduce("premul_sum", torch.float32)
    a, b = torch.tensor([True, False, False]), torch.tensor([False, False, True])
    ops.fold("sum", a, b)
    assert a.tolist() == [True, False, True]
    assert ops.byte_view(torch.zeros(3, dtype=torch.bfloat16)).nbytes == 6


def test_options_validate() -> None:
    with pytest.raises(InvalidArgument):
        kc.KvplaneOptions(timeout=0)
    s = kc.KvplaneOptions(timeout=2.0).settings(30.0)
    assert s.timeout == 2.0 and s.heartbeat_timeout > 0
    assert kc.KvplaneOptions().settings(7.0).timeout == 7.0


def test_dispatch_layout() -> None:
    idx = torch.tensor([[0, 3, -1], [5, 6, 7], [1, 2, 4]])
    lay = topology.dispatch_layout(idx, 8, 4)
    assert lay.num_tokens_per_rank.tolist() == [2, 2, 2, 1]
    assert lay.num_tokens_per_expert.tolist() == [1, 1, 1, 1, 1, 1, 1, 1]
    assert lay.is_token_in_rank.tolist() == [[True, True, False, False], [False, False, True, True],
                                             [True, True, True, False]]
    masked = topology.dispatch_layout(idx, 8, 4, torch.tensor([1, 1, 0, 1], dtype=torch.int32))
    assert masked.num_tokens_per_rank.tolist() == [2, 2, 0, 1]
    assert masked.num_tokens_per_expert[4:6].tolist() == [0, 0]
    with pytest.raises(InvalidArgument):
        topology.experts_per_rank(6, 4)
    with pytest.raises(InvalidArgument):
        topology.owner(torch.tensor([[8]]), 8, 4)


def test_public_surface_is_pinned() -> None:
    assert sorted(kc.__all__) == sorted([
        "BACKEND", "KvplaneOptions", "KvplaneProcessGroup", "KvplaneWork", "activate_ranks",
        "deactivate_ranks", "elastic_allreduce_hook", "get_active_ranks", "get_current_epoch",
        "get_failed_ranks_hint", "get_local_success", "get_peer_state", "join_group", "recover_ranks",
        "register", "set_collective_timeout_us", "sync_after_failure"])
    assert sorted(kep.__all__) == ["Buffer", "DispatchHandle", "LowLatencyHandle"]
    assert "kvplane" in dist.Backend.backend_list
