"""A peer that stalls in the middle of a frame costs one kernel timeout in all, not one per short
send or receive (``sockets.ran_out``): a 512 KiB write to a stopped segment over a Unix socket
(about 200 KiB of buffer) once took two timeouts and ran a put's deadline out before its revoke."""

from __future__ import annotations

import socket
import time

import pytest

from kvplane.common.sockets import recv_exact, set_io_timeout
from kvplane.transfer.protocol import recv_scatter, send_all

pytestmark = pytest.mark.timeout(30)
T = 1.0  # the kernel timeout armed on the socket


def test_a_send_to_a_peer_that_stopped_reading_takes_one_timeout():
    a, b = socket.socketpair()  # b never reads; a's buffer holds far less than 4 MiB
    with a, b:
        set_io_timeout(a, T)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            send_all(a, [b"h" * 40, memoryview(bytearray(4 << 20))])
        took = time.monotonic() - t0
    assert 0.8 * T <= took < 1.7 * T, took  # was two: the short send, then a whole wait


@pytest.mark.parametrize("scatter", [False, True])
def test_a_receive_from_a_peer_that_stalled_mid_frame_takes_one_timeout(scatter):
    a, b = socket.socketpair()
    with a, b:
        set_io_timeout(a, T)
        b.sendall(b"x" * 1000)  # then stalls, 1 MiB short
        view = memoryview(bytearray((1 << 20) + 1000))
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            if scatter:
                recv_scatter(a, [view[:500], view[500:]])
            else:
                recv_exact(a, view)
        took = time.monotonic() - t0
        assert bytes(view[:1000]) == b"x" * 1000
    assert 0.8 * T <= took < 1.7 * T, took  # was two: the short return, then a whole wait


def test_a_frame_in_pieces_is_not_cut_off():
    """Only a short return is a timeout: a frame that arrives in pieces within it completes."""
    import threading

    a, b = socket.socketpair()
    with a, b:
        set_io_timeout(a, T)
        view = memoryview(bytearray(300_000))

        def drip() -> None:
            for _ in range(30):
                b.sendall(b"y" * 10_000)

        t = threading.Thread(target=drip)
        t.start()
        recv_exact(a, view)
        t.join()
        assert bytes(view) == b"y" * 300_000
