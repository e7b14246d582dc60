"""The listener keeps a few idle threads for its next connections, and ends them when closed."""

from __future__ import annotations

import socket
import threading

import pytest

from kvplane.common import listener as listener_mod
from kvplane.common.listener import Listener

pytestmark = pytest.mark.timeout(60)


class _Echo:
    """A serve function: answers each line with the serving thread's ident, until EOF."""

    def __init__(self) -> None:
        self.idents: list[int] = []
        self.served = threading.Semaphore(0)

    def __call__(self, conn: socket.socket) -> None:
        me = threading.get_ident()
        self.idents.append(me)
        try:
            while conn.recv(1):
                conn.sendall(me.to_bytes(8, "little"))
        except OSError:
            pass
        finally:
            self.served.release()


def _ask(lst: Listener) -> int:
    with socket.create_connection((lst.host, lst.port), timeout=10) as s:
        s.sendall(b"?")
        got = b""
        while len(got) < 8:
            chunk = s.recv(8 - len(got))
            assert chunk, "closed early"
            got += chunk
    return int.from_bytes(got, "little")


def _kept(lst: Listener) -> int:
    with lst._kept:
        return len(lst._waiting)


def _wait_kept(lst: Listener, n: int) -> None:
    """Until ``n`` threads of ``lst`` wait for a connection (they get there right after their
    connection's serve returns; the Condition is what tells)."""
    for _ in range(2000):
        if _kept(lst) >= n:
            return
        with lst._kept:
            lst._kept.wait(0.005)
    raise AssertionError(f"{_kept(lst)} threads kept, expected {n}")


def test_the_next_connection_is_served_by_the_kept_thread():
    echo = _Echo()
    lst = Listener(echo, name="keep")
    try:
        first = _ask(lst)
        assert echo.served.acquire(timeout=10)
        _wait_kept(lst, 1)
        assert _ask(lst) == first  # no thread start for it
        assert echo.served.acquire(timeout=10)
        assert echo.idents == [first, first]
    finally:
        lst.close()


def test_at_most_keep_idle_threads_wait_and_close_ends_them(monkeypatch):
    monkeypatch.setattr(listener_mod, "KEEP_IDLE", 2)
    echo = _Echo()
    lst = Listener(echo, name="few")
    socks = []
    try:
        for _ in range(5):  # five at once: five threads
            s = socket.create_connection((lst.host, lst.port), timeout=10)
            s.sendall(b"?")
            assert len(s.recv(8)) == 8
            socks.append(s)
        assert len(set(echo.idents)) == 5
        for s in socks:
            s.close()
        for _ in range(5):
            assert echo.served.acquire(timeout=10)
        _wait_kept(lst, 2)
        assert _kept(lst) == 2
        waiting = list(lst._waiting)
    finally:
        lst.close()
    assert not any(t.is_alive() for t in waiting)
    assert _kept(lst) == 0


def test_a_kept_thread_ends_after_keep_for(monkeypatch):
    monkeypatch.setattr(listener_mod, "KEEP_FOR", 0.2)
    echo = _Echo()
    lst = Listener(echo, name="brief")
    try:
        _ask(lst)
        assert echo.served.acquire(timeout=10)
        _wait_kept(lst, 1)
        (t,) = list(lst._waiting)
        t.join(10)
        assert not t.is_alive() and _kept(lst) == 0
        _ask(lst)  # served all the same, by a new thread
        assert echo.served.acquire(timeout=10)
        assert len(echo.idents) == 2
    finally:
        lst.close()
