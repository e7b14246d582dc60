"""The in-memory fault kit itself: FaultPlan scripting, the in-memory RPC, the "mem" transport."""

from __future__ import annotations

import uuid

import msgspec
import numpy as np
import pytest

from kvplane.common.errors import (
    InvalidArgument,
    NotFound,
    Timeout,
    Unauthorized,
    Unavailable,
)
from kvplane.testing.faults import FaultKind, FaultPlan
from kvplane.testing.mem_rpc import MemRpcNetwork
from kvplane.testing.mem_transport import MemFabric
from kvplane.transfer import OpCode, TransferEngine, TransferRequest, TransferStatus

pytestmark = pytest.mark.timeout(30)


# -- FaultPlan ------------------------------------------------------------------------------------
def test_a_rule_fires_after_n_matching_ops_and_only_times_times():
    plan = FaultPlan(seed=1).fail(peer="a", op="read", after=2, times=2)
    got = [plan.decide("a", "read") for _ in range(6)]
    assert [f is not None for f in got] == [False, False, True, True, False, False]
    assert plan.decide("b", "read") is None and plan.decide("a", "write") is None
    assert plan.count(FaultKind.FAIL) == 2 and plan.count(FaultKind.FAIL, peer="b") == 0


def test_every_matching_rule_counts_an_op_and_the_first_due_one_fires():
    plan = FaultPlan().drop(peer="a").disconnect(peer="a", after=2, times=None)
    kinds = [getattr(plan.decide("a", "x"), "kind", None) for _ in range(4)]
    assert kinds == [FaultKind.DROP, None, FaultKind.DISCONNECT, FaultKind.DISCONNECT]


def test_rates_and_corrupt_positions_repeat_for_the_same_seed():
    def run(seed: int) -> list[tuple[str, int]]:
        plan = FaultPlan(seed).corrupt(rate=0.3, times=None)
        return [(str(f.kind), f.position) if f else ("-", 0)
                for f in (plan.decide("p", "read") for _ in range(50))]

    assert run(7) == run(7) and run(7) != run(8)
    assert 5 < sum(kind != "-" for kind, _ in run(7)) < 30


def test_corrupt_at_a_fixed_byte_flips_that_byte():
    fault = FaultPlan().corrupt(at=3).decide("p", "read")
    data = bytearray(b"abcdef")
    fault.flip(data)
    assert data == b"abc" + bytes([ord("d") ^ 0xFF]) + b"ef"


# -- in-memory RPC --------------------------------------------------------------------------------
class Echo(msgspec.Struct):
    text: str


@pytest.fixture
def rpc():
    """(network, server with 'echo' and 'missing', waits recorded instead of slept)."""
    waits: list[float] = []
    net = MemRpcNetwork(FaultPlan(seed=3), sleep=waits.append)
    srv = net.server(token="t")
    srv.add("echo", lambda req: Echo(req.text.upper()), Echo)

    def missing(req: Echo) -> Echo:
        raise NotFound(f"no {req.text}")

    srv.add("missing", missing, Echo)
    net.waits = waits
    return net, srv


def test_a_call_goes_through_the_real_envelope_and_dispatch(rpc):
    net, srv = rpc
    client = net.client(srv.endpoint, token="t", timeout=2)
    assert client.call("echo", Echo("hi"), Echo) == Echo("HI")
    with pytest.raises(NotFound, match="no key"):
        client.call("missing", Echo("key"), Echo)
    with pytest.raises(InvalidArgument, match="unknown method"):
        client.call("nope", Echo("x"), Echo)
    with pytest.raises(Unauthorized):
        net.client(srv.endpoint, token="wrong").call("echo", Echo("x"), Echo)
    assert srv.served == 4


def test_no_server_or_a_closed_one_is_refused(rpc):
    net, srv = rpc
    with pytest.raises(Unavailable, match="refused"):
        net.client("mem:999").call("echo", Echo("x"), Echo)
    srv.close()
    with pytest.raises(Unavailable, match="refused"):
        net.client(srv.endpoint, token="t").call("echo", Echo("x"), Echo)


def test_a_dropped_request_times_out_after_the_timeout_without_running(rpc):
    net, srv = rpc
    net.plan.drop(op="echo")
    with pytest.raises(Timeout, match="timed out after 1.5s"):
        net.client(srv.endpoint, token="t", timeout=1.5).call("echo", Echo("x"), Echo)
    assert net.waits == [1.5] and srv.served == 0


def test_a_late_reply_is_a_timeout_but_the_server_did_the_work(rpc):
    net, srv = rpc
    net.plan.delay(5.0, op="echo").delay(0.25, op="echo")
    client = net.client(srv.endpoint, token="t", timeout=1.0)
    with pytest.raises(Timeout):
        client.call("echo", Echo("x"), Echo)
    assert client.call("echo", Echo("y"), Echo) == Echo("Y")
    assert net.waits == [1.0, 0.25] and srv.served == 2


def test_an_injected_failure_crosses_the_wire_as_its_code(rpc):
    net, srv = rpc
    net.plan.fail(op="echo", error=NotFound).disconnect(op="echo")
    client = net.client(srv.endpoint, token="t")
    with pytest.raises(NotFound, match="injected failure of echo"):
        client.call("echo", Echo("x"), Echo)
    with pytest.raises(Unavailable, match="reset"):
        client.call("echo", Echo("x"), Echo)
    assert client.call("echo", Echo("x"), Echo) == Echo("X") and srv.served == 1


def test_a_corrupt_frame_is_dropped_as_malformed(rpc):
    net, srv = rpc
    net.plan.corrupt(op="echo", at=0)  # the msgpack array header of the envelope
    with pytest.raises(Unavailable, match="malformed"):
        net.client(srv.endpoint, token="t").call("echo", Echo("x"), Echo)
    assert srv.malformed == 1 and srv.served == 0


# -- the "mem" transport --------------------------------------------------------------------------
@pytest.fixture
def pair():
    """(fabric, initiator, target, target buffer): two attached engines sharing memory metadata."""
    fabric = MemFabric(FaultPlan(seed=4))
    space = f"memory://kit-{uuid.uuid4().hex}"
    kw = dict(metadata=space, transports=("tcp", "local", "mem"), protocol="mem", timeout=2)
    with TransferEngine(name="init", **kw) as ini, TransferEngine(name="tgt", **kw) as tgt:
        buf = np.arange(4096, dtype=np.uint8) % 251
        tgt.register_memory(buf)
        fabric.attach(ini)
        fabric.attach(tgt)
        yield fabric, ini, tgt, buf


def read(ini: TransferEngine, tgt: TransferEngine, buf: np.ndarray, out: np.ndarray,
         timeout: float = 2.0) -> TransferStatus:
    ini.register_memory(out, publish=False)
    try:
        seg = ini.open_segment(tgt.name)
        (status,) = ini.transfer([TransferRequest(OpCode.READ, out.ctypes.data, seg,
                                                  buf.ctypes.data, len(out))], timeout)
        return status
    finally:
        ini.unregister_memory(out.ctypes.data, publish=False)


def test_the_mem_transport_moves_bytes_between_attached_engines(pair):
    fabric, ini, tgt, buf = pair
    out = np.zeros(4096, np.uint8)
    assert read(ini, tgt, buf, out) == TransferStatus.COMPLETED
    assert np.array_equal(out, buf) and fabric.moves[("tgt", "read")] == 1
    assert ini._server.frames == 0 and tgt._server.frames == 0  # no TCP frame was served


@pytest.mark.parametrize("script,status", [
    (lambda p: p.fail(peer="tgt"), TransferStatus.FAILED),
    (lambda p: p.disconnect(peer="tgt"), TransferStatus.FAILED),
    (lambda p: p.drop(peer="tgt"), TransferStatus.TIMEOUT),
    (lambda p: p.delay(9.0, peer="tgt"), TransferStatus.TIMEOUT),
])
def test_faults_finish_the_slice_as_the_plan_says(pair, script, status):
    fabric, ini, tgt, buf = pair
    waits: list[float] = []
    fabric.sleep = waits.append
    script(fabric.plan)
    out = np.zeros(64, np.uint8)
    assert read(ini, tgt, buf, out, timeout=0.5) == status
    assert not out.any() and fabric.moves[("tgt", "read")] == 0
    assert all(w <= 0.5 for w in waits) and (status != TransferStatus.TIMEOUT or waits)


def test_a_corrupted_read_completes_with_one_byte_flipped(pair):
    fabric, ini, tgt, buf = pair
    fabric.plan.corrupt(peer="tgt", at=10)
    out = np.zeros(64, np.uint8)
    assert read(ini, tgt, buf, out) == TransferStatus.COMPLETED
    assert np.flatnonzero(out != buf[:64]).tolist() == [10]


def test_a_closed_target_is_refused():
    fabric = MemFabric()
    kw = dict(metadata=f"memory://kit-{uuid.uuid4().hex}", transports=("tcp", "local", "mem"),
              protocol="mem", timeout=2)
    with TransferEngine(name="init", **kw) as ini:
        fabric.attach(ini)
        tgt = fabric.attach(TransferEngine(name="tgt", **kw))
        buf = np.ones(64, np.uint8)
        tgt.register_memory(buf)
        seg = ini.open_segment("tgt")
        tgt.close()
        out = np.zeros(64, np.uint8)
        ini.register_memory(out)
        batch = ini.allocate_batch(1)
        ini.submit(batch, [TransferRequest(OpCode.READ, out.ctypes.data, seg, buf.ctypes.data, 64)])
        assert ini.wait(batch, 2) == [TransferStatus.FAILED]
        assert "connection refused" in ini.errors(batch)[0]


def test_an_engine_without_the_mem_transport_cannot_attach():
    with TransferEngine(metadata="P2PHANDSHAKE", transports=("tcp", "local")) as te:
        with pytest.raises(InvalidArgument, match="did not load"):
            MemFabric().attach(te)
