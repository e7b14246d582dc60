import pytest

from kvplane.common.errors import Conflict, InvalidArgument
from kvplane.transfer.batch import Batch, cut
from kvplane.transfer.types import OpCode, TransferRequest, TransferStatus


def req(n=100):
    return TransferRequest(OpCode.WRITE, 1, 1, 1000, n)


def test_cut_merges_small_tail():
    b = Batch(1, 1)
    (t,) = b.add([req(10 * 1024 + 100)])
    view = memoryview(bytearray(10 * 1024 + 100))
    sl = cut(t, view, 5000, len(view), 1024)
    assert [s.length for s in sl] == [1024] * 9 + [1024 + 100]
    assert sl[1].remote == 5000 + 1024 and sum(len(s.local) for s in sl) == len(view)
    assert [s.length for s in cut(t, view[:3000], 0, 3000, 1024)] == [1024, 1024, 952]
    assert len(cut(t, view[:10], 0, 10, 1024)) == 1


def test_task_completes_after_all_slices():
    b = Batch(1, 2)
    t1, t2 = b.add([req(), req()])
    assert b.busy and t1.status == TransferStatus.PENDING
    b.expect(t1, 2)
    b.expect(t2, 1)
    seen = []
    b.on_done(lambda batch: seen.append(batch.id))
    b.finish_slice(t1, TransferStatus.COMPLETED, 50, "")
    assert t1.status == TransferStatus.PENDING
    b.finish_slice(t1, TransferStatus.COMPLETED, 50, "")
    assert t1.status == TransferStatus.COMPLETED and t1.transferred == 100
    assert not seen and b.busy
    b.finish_slice(t2, TransferStatus.TIMEOUT, 0, "slow")
    assert t2.status == TransferStatus.TIMEOUT and t2.error == "slow"
    assert seen == [1] and not b.busy and b.wait(0)
    b.check_free()


def test_first_failure_sticks():
    b = Batch(1, 1)
    (t,) = b.add([req()])
    b.expect(t, 3)
    b.finish_slice(t, TransferStatus.FAILED, 0, "boom")
    b.finish_slice(t, TransferStatus.COMPLETED, 10, "")
    assert t.status == TransferStatus.FAILED and t.error == "boom"


def test_capacity_and_busy():
    b = Batch(7, 2)
    b.add([req()])
    with pytest.raises(InvalidArgument):
        b.add([req(), req()])
    with pytest.raises(Conflict):
        b.check_free()
    assert not b.wait(0.01)
    with pytest.raises(InvalidArgument):
        Batch(1, 0)


def test_hostile_shm_names_are_refused():
    from kvplane.transfer.transports.shm import _SHM_NAME

    assert _SHM_NAME.match("kvplane-123-abcdef")
    for bad in ("../../etc/passwd", "kvplane-1-ab/../x", "psm_123", ""):
        assert not _SHM_NAME.match(bad)
