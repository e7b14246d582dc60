"""Scripted peers of one collectives :class:`~kvplane.collectives.mesh.Mesh`, over socketpairs.

``wire(mesh, ranks)`` connects the mesh to one :class:`FramePeer` per rank through
``socket.socketpair()``: no listener, no handshake, no threads. A test then writes the frames a
peer would send (in any order, stale or hostile ones included), drives the mesh through its
public calls (``exchange``, ``stream``, ``begin``, ``set_epoch``) and reads what the mesh sent.

A :class:`~kvplane.testing.faults.FaultPlan` can script the peer's own sends, keyed by
``str(rank)`` and the frame kind (``"data"``, ``"abort"``, ``"p2p"``, ``"hello"``): DROP skips the
frame, DELAY sleeps first, CORRUPT flips one byte of the header, DISCONNECT closes the socket
instead of sending. FAIL has no meaning for a frame and is refused.
"""

from __future__ import annotations

import socket
import time

from kvplane.collectives.frames import (
    HEADER_SIZE,
    KIND_ABORT,
    KIND_DATA,
    KIND_HELLO,
    KIND_P2P,
    Header,
)
from kvplane.collectives.mesh import Mesh
from kvplane.testing.faults import FaultKind, FaultPlan

KIND_NAMES = {KIND_DATA: "data", KIND_ABORT: "abort", KIND_P2P: "p2p", KIND_HELLO: "hello"}


class FramePeer:
    """One rank's end of a socketpair to the mesh under test.

    Args:
        rank: the rank this peer plays.
        sock: its end of the socketpair (blocking).
        plan: faults for this peer's sends (default: none).
    """

    def __init__(self, rank: int, sock: socket.socket, plan: FaultPlan | None = None) -> None:
        self.rank = rank
        self.sock = sock
        self.plan = plan or FaultPlan()
        self.sent = 0  # frames actually written

    def send(self, header: Header, payload: bytes = b"") -> None:
        """Send one frame (``header.nbytes`` should match ``payload``), through the plan."""
        fault = self.plan.decide(str(self.rank), KIND_NAMES.get(header.kind, str(header.kind)))
        frame = bytearray(header.pack())
        if fault is not None:
            if fault.kind is FaultKind.FAIL:
                raise ValueError("FAIL is not a fault a frame can carry")
            if fault.kind is FaultKind.DROP:
                return
            if fault.kind is FaultKind.DISCONNECT:
                self.close()
                return
            if fault.kind is FaultKind.DELAY:
                time.sleep(fault.seconds)
            if fault.kind is FaultKind.CORRUPT:
                fault.flip(frame)
        self.send_raw(bytes(frame) + payload)
        self.sent += 1

    def send_raw(self, data: bytes) -> None:
        """Write bytes as they are (truncated or garbage frames)."""
        self.sock.sendall(data)

    def recv(self, timeout: float = 5.0) -> tuple[Header, bytes]:
        """The next frame the mesh sent to this peer.

        Raises:
            TimeoutError: nothing within ``timeout``. EOFError: the mesh closed the connection.
        """
        header = Header.unpack(self._exact(HEADER_SIZE, timeout), 1 << 40)
        return header, self._exact(header.nbytes, timeout)

    def closed_by_mesh(self, timeout: float = 5.0) -> bool:
        """True once the mesh closed its end (anything still queued is read and dropped)."""
        self.sock.settimeout(timeout)
        try:
            while self.sock.recv(1 << 16):
                pass
        except TimeoutError:
            return False
        except ConnectionResetError:
            pass  # closed with our bytes unread: a reset, which is a close too
        return True

    def close(self) -> None:
        """Close this end (the mesh sees EOF)."""
        self.sock.close()

    def _exact(self, n: int, timeout: float) -> bytes:
        self.sock.settimeout(timeout)
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise EOFError("mesh closed the connection")
            buf += chunk
        return bytes(buf)


def wire(mesh: Mesh, ranks: list[int], plan: FaultPlan | None = None) -> dict[int, FramePeer]:
    """Connect ``mesh`` to a scripted peer for each rank in ``ranks``."""
    peers = {}
    for rank in ranks:
        mine, theirs = socket.socketpair()
        mesh.attach(rank, mine)
        peers[rank] = FramePeer(rank, theirs, plan)
    return peers
