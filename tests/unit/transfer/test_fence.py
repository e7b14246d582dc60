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
