"""The listener's fence table: epochs, fenced generations, acknowledgement after writes."""

from kvplane.transfer.fence import EPOCH_SHIFT, Fence


def gen(epoch, n):
    return epoch << EPOCH_SHIFT | n


def test_unfenced_frames_are_always_admitted():
    f = Fence()
    f.set_epoch(3)
    assert f.admit(0) and f.begin_write(0)


def test_frames_of_another_master_epoch_are_refused():
    f = Fence()
    assert f.admit(gen(2, 1))  # not mounted yet: anything goes
    f.set_epoch(3)
    assert not f.admit(gen(2, 1)) and not f.begin_write(gen(2, 1))
    assert f.admit(gen(3, 1)) and f.refused == 2


def test_a_fenced_generation_is_refused_and_acknowledged_only_after_its_write():
    f = Fence()
    f.set_epoch(1)
    g = gen(1, 5)
    assert f.begin_write(g)  # a WRITE of g is landing
    assert f.install([g]) == []  # fenced, not acknowledged yet
    assert not f.begin_write(g) and not f.admit(g)
    f.end_write(g)
    assert f.install([g]) == [g]


def test_a_new_epoch_forgets_old_fences_and_the_table_is_bounded():
    f = Fence(keep=2)
    f.set_epoch(1)
    f.install([gen(1, 1), gen(1, 2), gen(1, 3)])
    assert not f.fenced(gen(1, 1)) and f.fenced(gen(1, 3))
    f.set_epoch(2)
    assert not f.fenced(gen(1, 3))


def test_admit_many_decides_each_generation_as_admit_does():
    f = Fence()
    f.set_epoch(3, floor=gen(3, 10))
    f.install([gen(3, 12)])
    gens = [0, gen(3, 11), gen(3, 12), gen(2, 11), gen(3, 9), gen(4, 1), gen(3, 11)]
    want = [True, True, False, False, False, False, True]
    before = f.refused
    assert f.admit_many(gens) == want
    assert f.refused == before + 4
    assert [f.admit(g) for g in gens] == want
    assert f.admit_many([0, 0]) == [True, True]


def test_retired_generations_are_refused_and_kept_apart_from_fences():
    """A flood of retirements (store clients, held reads) never pushes out a fence the master
    waits for: both tables are bounded on their own."""
    f = Fence(keep=2)
    f.set_epoch(1)
    f.install([gen(1, 1)])
    f.retire([gen(1, 5), 0, gen(1, 6), gen(1, 7)])
    assert f.fenced(gen(1, 1)) and not f.admit(gen(1, 1))  # the master's fence stays
    assert not f.admit(gen(1, 6)) and not f.begin_write(gen(1, 7))
    assert f.admit(gen(1, 5))  # the oldest retirement went (bounded)
    assert f.admit_many([gen(1, 6), gen(1, 8), 0]) == [False, True, True]
    f.set_epoch(2)  # a new epoch refuses the old generations by their epoch anyway
    assert f.admit(gen(2, 6))


def test_lanes_serve_one_epoch_each_and_change_alone():
    """A segment shared by master shards: each lane (shard) admits its own epoch from its
    floor; a new epoch on one lane refuses that lane's old generations only."""
    f = Fence()
    f.set_epoch(3, floor=gen(3, 10), lane=0)
    f.set_epoch(7, floor=gen(7, 5), lane=5)
    f.install([gen(7, 6), gen(3, 11)])
    assert f.admit(gen(3, 12)) and f.admit(gen(7, 5)) and not f.admit(gen(7, 4))
    assert not f.admit(gen(4, 1)) and not f.admit(gen(7, 6))
    assert f.admit_many([gen(3, 12), gen(7, 9), gen(7, 6), gen(5, 1)]) == [True, True, False, False]
    f.set_epoch(8, lane=5)  # shard 5 failed over
    assert not f.admit(gen(7, 9)) and f.admit(gen(8, 1))
    assert f.admit(gen(3, 12)) and f.fenced(gen(3, 11)) and not f.fenced(gen(7, 6))
    assert f.lanes() == {0: gen(3, 10), 5: gen(8, 0)}


def test_shared_memory_words_publish_every_lane():
    import numpy as np

    from kvplane.transfer.fence import FENCE_BYTES, admits_words
    from kvplane.transfer.transports.shm import _admitted

    words = bytearray(FENCE_BYTES)
    f = Fence()
    f.attach(memoryview(words))
    arr = np.frombuffer(words, np.uint8)
    assert _admitted(arr, gen(9, 1))  # nothing mounted: anything goes
    f.set_epoch(3, floor=gen(3, 10), lane=0)
    f.set_epoch(7, floor=gen(7, 5), lane=2)
    assert _admitted(arr, gen(3, 10)) and not _admitted(arr, gen(3, 9))
    assert _admitted(arr, gen(7, 5)) and not _admitted(arr, gen(7, 4))
    assert not _admitted(arr, gen(9, 1))
    f.set_epoch(0, lane=0)  # shard 0 left: its generations go, lane 2's stay
    assert not _admitted(arr, gen(3, 11)) and _admitted(arr, gen(7, 6))
    assert admits_words([0, 0], gen(1, 1)) and not admits_words([0, gen(2, 0)], gen(1, 1))
