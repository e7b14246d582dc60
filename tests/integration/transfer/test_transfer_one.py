"""``TransferEngine.transfer_one``: one request along a cached route, by a transport with the
``RouteOneIO`` capability (NIXL; here an in-process stand-in, tests.support.route_once). The
route is reused while it holds and resolved again when the peer's descriptor changes, a
region is registered or unregistered, the segment is closed or the request leaves the cached
regions; protocol "auto" never uses it. The same over NIXL between processes is in
test_nixl_transport.py."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from kvplane.common import metrics
from kvplane.transfer import OpCode, TransferEngine, TransferStatus
from tests.support.route_once import PATH, RouteOnce

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]
W, R, OK = OpCode.WRITE, OpCode.READ, TransferStatus.COMPLETED


def _pair(protocol: str = "tcp"):
    kw = dict(transports=("tcp", "local", PATH), protocol=protocol,
              metadata=f"memory://one-{uuid.uuid4().hex}")
    return TransferEngine(**kw), TransferEngine(**kw)


def _linked(a: TransferEngine, b: TransferEngine, size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """``size`` ones registered on ``a``, ``size`` zeros on ``b``, and ``a``'s handle of ``b``."""
    src, dst = np.ones(size, np.uint8), np.zeros(size, np.uint8)
    a.register_memory(src)
    b.register_memory(dst)
    return src, dst, a.open_segment(b.name)


def _value(counter, *labels: str) -> float:
    return counter.labels(*labels)._value.get()


def test_one_request_reuses_its_route_until_something_changes():
    a, b = _pair()
    with a, b:
        src = np.arange(1 << 16, dtype=np.uint64).view(np.uint8)[: 1 << 16].copy()
        dst = np.zeros(1 << 16, np.uint8)
        a.register_memory(src)
        b.register_memory(dst)
        seg = a.open_segment(b.name)
        ro = a.transports[PATH]
        assert isinstance(ro, RouteOnce)
        s, d = src.ctypes.data, dst.ctypes.data
        before = (_value(metrics.TRANSFER_REQUESTS, "write", "completed"),
                  _value(metrics.TRANSFER_BYTES, "write", "any"),
                  _value(metrics.TRANSFER_SLICES, "routeonce"))
        assert a.transfer_one(W, s, seg, d, 4096, PATH) == OK
        assert a.transfer_one(W, s + 4096, seg, d + 4096, 8192, PATH) == OK
        assert np.array_equal(dst[:12288], src[:12288]) and not dst[12288:].any()
        assert len(ro.calls) == 2 and ro.slices == 0  # no batch, no slice
        assert a._router.resolved == 1  # the second reused the first's route
        after = (_value(metrics.TRANSFER_REQUESTS, "write", "completed"),
                 _value(metrics.TRANSFER_BYTES, "write", "any"),
                 _value(metrics.TRANSFER_SLICES, "routeonce"))
        assert [y - x for x, y in zip(before, after)] == [2, 12288, 2]  # counted as transfer()

        end = d + dst.nbytes  # a range past the peer's region is refused, never copied
        assert a.transfer_one(W, s, seg, end - 100, 4096, PATH) == TransferStatus.FAILED
        mine = s + src.nbytes  # and so is one past the local region
        assert a.transfer_one(W, mine - 100, seg, d, 4096, PATH) == TransferStatus.FAILED
        assert len(ro.calls) == 2

        back = np.zeros(4096, np.uint8)
        a.register_memory(back)  # a new local region: resolved again
        assert a.transfer_one(R, back.ctypes.data, seg, d, 4096, PATH) == OK
        assert np.array_equal(back, src[:4096])
        assert a._router.resolved == 2 and len(ro.calls) == 3

        b.register_memory(np.zeros(4096, np.uint8))  # the peer's descriptor changes ...
        assert a.open_segment(b.name) == seg  # ... and is fetched again
        assert a.transfer_one(R, back.ctypes.data, seg, d + 4096, 4096, PATH) == OK
        assert a._router.resolved == 3 and ro.routes[-1] == 2  # along the new descriptor
        assert np.array_equal(back, src[4096:8192])

        a.unregister_memory(back.ctypes.data)  # a cached local region that went away
        assert a.transfer_one(R, back.ctypes.data, seg, d, 4096, PATH) == TransferStatus.FAILED
        assert len(ro.calls) == 4  # refused before any copy

        a.close_segment(seg)
        assert a.transfer_one(W, s, seg, d, 4096, PATH) == TransferStatus.FAILED
        assert len(ro.calls) == 4


def test_a_past_deadline_times_out_and_auto_plans_every_request():
    a, b = _pair()
    with a, b:
        src, dst, seg = _linked(a, b, 8192)
        assert a.transfer_one(W, src.ctypes.data, seg, dst.ctypes.data, 4096, PATH,
                              timeout=0) == TransferStatus.TIMEOUT
        assert not dst.any()
    a, b = _pair("auto")
    with a, b:
        src, dst, seg = _linked(a, b, 8192)
        assert a.transfer_one(W, src.ctypes.data, seg, dst.ctypes.data, 8192) == OK
        assert dst.all() and a._router.resolved == 0
        assert a.transfer_one(W, src.ctypes.data, seg, dst.ctypes.data, 4096, "tcp") == OK
        assert not a.transports[PATH].calls and a._router.resolved == 1


def test_a_transport_without_the_capability_goes_through_transfer():
    a, b = _pair()
    with a, b:
        src, dst, seg = _linked(a, b, 4096)
        # WRITE frames only (in the full suite another frame, not a write, reached b here)
        writes = _value(metrics.SERVER_FRAMES, "write")
        for _ in range(2):
            assert a.transfer_one(W, src.ctypes.data, seg, dst.ctypes.data, 4096) == OK
        assert dst.all()
        assert _value(metrics.SERVER_FRAMES, "write") == writes + 2  # over tcp, by plan and run
        assert a._router.resolved == 1  # resolved once: the second knew at once
        assert not a.transports[PATH].calls
