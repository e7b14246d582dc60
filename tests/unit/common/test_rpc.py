import socket
import struct

import msgspec
import pytest

from kvplane.common.errors import InvalidArgument, NotFound, Timeout, Unauthorized, Unavailable
from kvplane.common.rpc import RpcClient, RpcServer

pytestmark = pytest.mark.timeout(30)


class Req(msgspec.Struct):
    x: int


def make_server(token=""):
    srv = RpcServer(token=token)

    def double(r: Req) -> int:
        if r.x < 0:
            raise NotFound("negative")
        return r.x * 2

    srv.add("double", double, Req)
    srv.add("boom", lambda r: 1 / 0, Req)
    return srv.start()


def test_calls_errors_and_token():
    with make_server(token="t") as srv:
        ep = f"127.0.0.1:{srv.port}"
        with RpcClient(ep, token="t") as c:
            assert c.call("double", Req(21), int) == 42
            with pytest.raises(NotFound):
                c.call("double", Req(-1), int)
            with pytest.raises(InvalidArgument):
                c.call("nope", Req(1), int)
            raised = pytest.raises(Exception, c.call, "boom", Req(1), int)  # noqa: B017
            assert "internal error" in str(raised.value)
            assert c.call("double", Req(1), int) == 2  # still usable
        with RpcClient(ep, token="bad") as c, pytest.raises(Unauthorized):
            c.call("double", Req(1), int)


def test_malformed_frames_close_only_that_connection():
    with make_server() as srv:
        for junk in (b"\xff" * 64, struct.pack("<I", 1 << 30),
                     struct.pack("<I", 5) + b"\xc1\xc1\xc1\xc1\xc1"):
            with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
                s.sendall(junk)
                try:
                    assert s.recv(100) == b""  # closed, no reply
                except ConnectionResetError:
                    pass  # closed with our junk unread: also a close
        with RpcClient(f"127.0.0.1:{srv.port}") as c:
            assert c.call("double", Req(2), int) == 4
        assert srv.malformed >= 2


def test_timeout_and_unreachable():
    ls = socket.create_server(("127.0.0.1", 0))  # accepts but never answers
    port = ls.getsockname()[1]
    with RpcClient(f"127.0.0.1:{port}", timeout=0.3) as c, pytest.raises(Timeout):
        c.call("double", Req(1), int)
    ls.close()
    with RpcClient(f"127.0.0.1:{port}", timeout=0.3) as c, pytest.raises(Unavailable):
        c.call("double", Req(1), int)


def test_meanwhile_runs_once_between_the_request_and_its_reply():
    # the server answers only after `meanwhile` let it: the reply cannot have been read first
    import threading

    gate = threading.Event()
    srv = RpcServer()
    srv.add("gated", lambda r: (gate.wait(5), r.x)[1], Req)
    with srv.start():
        with RpcClient(f"127.0.0.1:{srv.port}", timeout=5) as c:
            runs: list[int] = []
            assert c.call("gated", Req(7), int, meanwhile=lambda: (runs.append(1), gate.set())) == 7
            assert runs == [1]
    ls = socket.create_server(("127.0.0.1", 0))
    port = ls.getsockname()[1]
    ls.close()  # nobody listens: nothing was sent, so `meanwhile` does not run
    with RpcClient(f"127.0.0.1:{port}", timeout=0.3) as c, pytest.raises(Unavailable):
        c.call("double", Req(1), int, meanwhile=lambda: runs.append(2))
    assert runs == [1]


def test_poll_spin_takes_what_is_there_gives_up_after_its_time_and_sees_eof():
    from kvplane.common.sockets import poll_spin

    a, b = socket.socketpair()
    with a, b:
        buf = memoryview(bytearray(8))
        assert poll_spin(a, buf, 1e-3) == -1  # nothing came: no block, no bytes
        b.sendall(b"abc")
        assert poll_spin(a, buf, 1.0) == 3 and bytes(buf[:3]) == b"abc"
        b.close()
        assert poll_spin(a, buf, 1.0) == 0  # end of stream


def test_a_frame_is_busy_polled_only_with_the_spinner_free(monkeypatch):
    import threading

    from kvplane.common import rpc

    polls = []
    real = rpc.poll_spin
    monkeypatch.setattr(rpc, "poll_spin", lambda *a: polls.append(1) or real(*a))
    spinner = threading.Lock()
    a, b = socket.socketpair()
    with a, b:
        for _ in range(2):
            b.sendall(struct.pack("<I", 2) + b"hi")
        spinner.acquire()  # another connection is polling: this one waits in the kernel
        assert rpc._recv_frame(a, 1 << 10, 1e-3, spinner) == b"hi" and polls == []
        spinner.release()
        assert rpc._recv_frame(a, 1 << 10, 1e-3, spinner) == b"hi" and polls == [1]
        assert not spinner.locked()  # never held past the poll


def test_a_server_in_a_tight_loop_answers_and_holds_no_spinner_while_idle():
    from tests.support.services import wait_until

    srv = RpcServer(spin=500e-6)
    srv.add("double", lambda r: r.x * 2, Req)
    with srv, RpcClient(f"127.0.0.1:{srv.port}") as c1, RpcClient(f"127.0.0.1:{srv.port}") as c2:
        with make_server() as plain:
            assert plain._spin == 0  # busy-polling is asked for, never the default
        for i in range(300):  # two clients in tight loops, interleaved
            assert c1.call("double", Req(i), int) == 2 * i
            assert c2.call("double", Req(i + 1), int) == 2 * i + 2
        # once both go quiet, the thread that polled gives the spinner up and blocks
        wait_until(lambda: not srv._spinner.locked(), 5, "the spinner is released when idle")
        assert c1.call("double", Req(5), int) == 10  # and a call after the pause is served


def test_a_server_built_not_listening_refuses_until_started():
    """``listen=False`` (the master): the port is bound and known, a connect is refused (and
    retried by clients) until ``start()``, so an early client never meets a half-built server."""
    srv = RpcServer(listen=False)
    srv.add("double", lambda r: r.x * 2, Req)
    try:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", srv.port), timeout=2).close()
        cli = RpcClient(f"127.0.0.1:{srv.port}", timeout=2)
        with pytest.raises(Unavailable):
            cli.call("double", Req(2), int)
        srv.start()
        assert cli.call("double", Req(2), int) == 4
        cli.close()
    finally:
        srv.close()


def test_a_server_never_started_closes_and_frees_its_port():
    srv = RpcServer(listen=False)
    port = srv.port
    srv.close()
    srv.start()  # a no-op once closed
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def _frame_of(method: str, body: object, rid: int = 7, token: str = "t", v: int = 1) -> bytes:
    from kvplane.common import wire

    return wire.encode(wire.Envelope(v, rid, method, token, 1000, msgspec.Raw(wire.encode(body))))


def test_answer_frames_exactly_what_dispatch_replies():
    """The server's one-pass reply (``answer``) is byte for byte the length prefix plus
    ``wire.encode(dispatch(...))``: successes, each kind of error, the hello, large ids."""
    from kvplane.common import rpc, wire
    from kvplane.common.auth import token_authenticator

    handlers = {"double": (lambda r: r.x * 2, Req),
                "nf": (lambda r: (_ for _ in ()).throw(NotFound("gone")), Req),
                "boom": (lambda r: 1 / 0, Req),
                "blob": (lambda r: {"k": [r.x] * 3, "b": b"\x00" * 70000}, Req)}
    check = token_authenticator("t")
    cases = [_frame_of("double", Req(21)), _frame_of("double", Req(3), rid=2**40),
             _frame_of("nf", Req(1)), _frame_of("boom", Req(1)), _frame_of("blob", Req(5)),
             _frame_of("nope", Req(1)), _frame_of(rpc.HELLO, None),
             _frame_of("double", Req(1), token="bad"), _frame_of("double", Req(1), v=9),
             _frame_of("double", {"y": "not a Req"})]
    out = bytearray(b"junk left from the last reply" * 10)
    for data in cases:
        for view in (data, memoryview(bytearray(data))):
            want = wire.encode(rpc.dispatch(handlers, check, data))
            assert rpc.answer(handlers, check, view, out)
            assert bytes(out) == struct.pack("<I", len(want)) + want
    assert rpc.dispatch(handlers, check, b"\xc1junk") is None
    assert not rpc.answer(handlers, check, b"\xc1junk", out)


def test_frames_are_read_ahead_and_split_exactly():
    """One recv brings pipelined requests; each comes out whole, in order, also when split
    across reads, and one larger than the read-ahead buffer is read into its own."""
    from kvplane.common import rpc

    a, b = socket.socketpair()
    with a, b:
        frames = rpc._Frames(a, 1 << 22)
        bodies = [b"x" * n for n in (0, 1, 5, 1000, 70000, 3, (64 << 10) - 4, 200000)]
        wire_bytes = b"".join(struct.pack("<I", len(x)) + x for x in bodies)
        import threading

        sender = threading.Thread(target=lambda: [b.sendall(wire_bytes[i:i + 777]) for i in
                                                  range(0, len(wire_bytes), 777)])
        sender.start()
        got = [bytes(frames.next()) for _ in bodies]
        sender.join()
        assert got == bodies
        assert not frames.buffered()
        b.sendall(struct.pack("<I", 1 << 23))
        with pytest.raises(Exception) as raised:
            frames.next()
        assert "exceeds" in str(raised.value)


def test_after_reply_runs_once_the_answer_is_out_and_only_in_a_server_thread():
    import threading

    from kvplane.common.rpc import after_reply
    from tests.support.services import wait_until

    # one event per call, set by the client once it holds that call's answer (a shared event
    # cleared between calls raced a server thread that reached its wait after the clear)
    received = {x: threading.Event() for x in (1, 2, 3)}
    ran: list[int] = []
    srv = RpcServer()

    def later(x: int) -> None:
        # waits for the client to have the answer: were it run before the answer went out,
        # the answer would come only after this gave up (and ``ran`` would say so)
        ran.append(x if received[x].wait(5) else -x)

    def handler(r: Req) -> int:
        after_reply(lambda: later(r.x))
        after_reply(lambda: 1 / 0)  # a failing one is logged; the connection goes on
        return r.x

    srv.add("later", handler, Req)
    with srv.start(), RpcClient(f"127.0.0.1:{srv.port}") as c:
        for x in (1, 2, 3):  # the second and third answer after the work before them ran
            assert c.call("later", Req(x), int) == x
            received[x].set()
        wait_until(lambda: len(ran) == 3, 20, "the work after the third answer")
        assert ran == [1, 2, 3]
    after_reply(lambda: ran.append(99))  # not in a server thread: dropped
    assert ran == [1, 2, 3]
