"""StoreClient replica failover, in memory: a scripted master over the in-memory RPC, storage
engines reached through the "mem" transport, faults from a seeded FaultPlan.

The master here is a script (it answers get_replicas / put_start with the replicas a test
chooses), so the tests pin the client's side of the contract: the replica order it tries, what
it does when a replica fails, and what it raises or returns when all do.
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from kvplane.common.errors import Timeout, Unavailable
from kvplane.store.client import link as link_module
from kvplane.store.client.client import StoreClient
from kvplane.store.errors import ObjectNotFound, TransferFail
from kvplane.store.types import (
    CodesRep,
    KeyResult,
    KeysReq,
    MountRep,
    MountReq,
    PingRep,
    PingReq,
    PutEndReq,
    PutStartReq,
    Replica,
    ReplicateConfig,
    ResultsRep,
)
from kvplane.testing.faults import FaultKind, FaultPlan
from kvplane.testing.mem_rpc import MemRpcNetwork
from kvplane.testing.mem_transport import MemFabric
from kvplane.transfer import TransferEngine

pytestmark = pytest.mark.timeout(30)
VALUE = bytes(range(256)) * 8  # 2 KiB
ENGINE = dict(transports=("tcp", "local", "mem"), protocol="mem", timeout=2)


class ScriptedMaster:
    """The master's RPC methods the client calls, answering from ``replicas`` (key -> list)."""

    def __init__(self, network: MemRpcNetwork) -> None:
        self.server = network.server()
        self.replicas: dict[str, list[Replica]] = {}
        self.ended: list[str] = []
        self.revoked: list[str] = []
        self.end_code = 0  # what put_end answers
        self.checksums: dict[str, int] = {}
        self.suspects: list[str] = []
        self.ttl = 0.0
        for name, fn, typ in (("mount", lambda r: MountRep(0), MountReq), ("unmount", lambda r: 0, MountReq),
                              ("ping", lambda r: PingRep("ok", 0), PingReq),
                              ("get_replicas", self.get_replicas, KeysReq),
                              ("put_start", self.put_start, PutStartReq),
                              ("put_end", self.put_end, PutEndReq),
                              ("put_revoke", self.put_revoke, PutEndReq)):
            self.server.add(name, fn, typ)

    def get_replicas(self, req: KeysReq) -> ResultsRep:
        self.suspects += req.suspects
        return ResultsRep([KeyResult(0, self.replicas[k], self.replicas[k][0].size, 1,
                                     self.checksums.get(k, 0))
                           if k in self.replicas else KeyResult(ObjectNotFound.code)
                           for k in req.keys], self.ttl)

    def put_start(self, req: PutStartReq) -> ResultsRep:
        return ResultsRep([KeyResult(0, self.replicas[k], size) for k, size in zip(req.keys, req.sizes)])

    def put_end(self, req: PutEndReq) -> CodesRep:
        self.ended += req.keys
        self.checksums.update(zip(req.keys, req.checksums))
        self.suspects += req.suspects
        return CodesRep([self.end_code] * len(req.keys))

    def put_revoke(self, req: PutEndReq) -> CodesRep:
        self.suspects += req.suspects
        self.revoked += req.keys
        return CodesRep([0] * len(req.keys))


class Pool:
    """Storage engines by name, each with one registered 64 KiB buffer, on one fabric."""

    def __init__(self, fabric: MemFabric, metadata: str) -> None:
        self.fabric, self.metadata = fabric, metadata
        self.engines: dict[str, TransferEngine] = {}
        self.buffers: dict[str, np.ndarray] = {}

    def start(self, name: str) -> None:
        engine = TransferEngine(name=name, metadata=self.metadata, **ENGINE)
        self.buffers[name] = np.zeros(64 << 10, np.uint8)
        engine.register_memory(self.buffers[name])
        self.engines[name] = self.fabric.attach(engine)

    def restart(self, name: str) -> None:
        """Close the engine and start a new one under the same name (new port, new memory)."""
        self.engines.pop(name).close()
        self.start(name)

    def replica(self, name: str, value: bytes = VALUE, offset: int = 0) -> Replica:
        """A replica of ``value`` in ``name``'s buffer at ``offset`` (written there now)."""
        buf = self.buffers[name]
        buf[offset:offset + len(value)] = np.frombuffer(value, np.uint8)
        return Replica(name, buf.ctypes.data + offset, len(value))

    def holds(self, name: str, value: bytes, offset: int = 0) -> bool:
        return self.buffers[name][offset:offset + len(value)].tobytes() == value

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()


@pytest.fixture
def cluster(monkeypatch):
    """(client, master, pool, plan): a StoreClient whose RPC and transfers stay in memory."""
    plan = FaultPlan(seed=16)
    waits: list[float] = []  # master RPC waits (drops, delays), recorded instead of slept
    network = MemRpcNetwork(plan, sleep=waits.append)
    fabric = MemFabric(plan, sleep=lambda seconds: fabric.waits.append(seconds))
    fabric.waits = []  # transfer waits, likewise
    metadata = f"memory://failover-{uuid.uuid4().hex}"
    master = ScriptedMaster(network)
    monkeypatch.setattr(link_module, "RpcClient", network.client)
    monkeypatch.setenv("KVPLANE_TRANSPORTS", "tcp,local,mem")
    pool = Pool(fabric, metadata)
    for name in ("seg-a", "seg-b"):
        pool.start(name)
    client = StoreClient(master=master.server.endpoint, metadata=metadata, protocol="mem",
                         local_buffer_size=1 << 20, timeout=2, heartbeat_interval=60)
    fabric.attach(client.engine)
    opened: list[str] = []
    open_segment = client.engine.open_segment
    client.engine.open_segment = lambda name, timeout=5.0: opened.append(name) or open_segment(name, timeout)
    client.opened, client.waits = opened, waits
    yield client, master, pool, plan
    client.close()
    pool.close()


def test_the_first_replica_serves_when_it_is_healthy(cluster):
    client, master, pool, plan = cluster
    master.replicas["k"] = [pool.replica("seg-a"), pool.replica("seg-b")]
    assert client.get("k") == VALUE
    assert pool.fabric.moves == {("seg-a", "read"): 1}


def test_a_failed_replica_fails_over_to_the_next(cluster):
    client, master, pool, plan = cluster
    master.replicas["k"] = [pool.replica("seg-a"), pool.replica("seg-b")]
    plan.fail(peer="seg-a", op="read")
    assert client.get("k") == VALUE
    assert plan.count(FaultKind.FAIL, "seg-a", "read") == 1
    assert pool.fabric.moves == {("seg-b", "read"): 1}


@pytest.mark.parametrize("fault", ["fail", "disconnect", "drop"])
def test_when_every_replica_fails_get_raises_transfer_fail(cluster, fault):
    client, master, pool, plan = cluster
    master.replicas["k"] = [pool.replica("seg-a"), pool.replica("seg-b")]
    getattr(plan, fault)(op="read", times=2)
    with pytest.raises(TransferFail):
        client.get("k")
    assert plan.count(FaultKind[fault.upper()]) == 2 and not pool.fabric.moves
    if fault == "drop":  # each lost read was waited out to the transfer deadline
        assert len(pool.fabric.waits) == 2 and all(0 < w <= 2 for w in pool.fabric.waits)


def test_a_batch_reports_the_failed_key_and_serves_the_others(cluster):
    client, master, pool, plan = cluster
    master.replicas["bad"] = [pool.replica("seg-a", b"x" * 100)]
    master.replicas["good"] = [pool.replica("seg-b", b"y" * 100)]
    plan.fail(peer="seg-a", op="read")
    bad, good, missing = client.get_batch(["bad", "good", "none"])
    assert isinstance(bad, TransferFail) and "bad" in str(bad)
    assert good == b"y" * 100
    assert isinstance(missing, ObjectNotFound)


def test_a_batch_of_single_replicas_fails_only_the_key_whose_read_failed(cluster):
    """The one-pass read of a batch (every key one replica, every segment open) fails the key
    whose read failed, serves the others, and blames only that segment."""
    client, master, pool, plan = cluster
    master.replicas["a"] = [pool.replica("seg-a", b"x" * 100)]
    master.replicas["b"] = [pool.replica("seg-b", b"y" * 100)]
    assert client.get_batch(["a", "b"]) == [b"x" * 100, b"y" * 100]  # both segments open now
    assert sorted(client.opened) == ["seg-a", "seg-b"]
    plan.fail(peer="seg-a", op="read", times=2)  # the speculative read, then the one it falls
    bad, good = client.get_batch(["a", "b"])      # back to (the client learned both places)
    assert isinstance(bad, TransferFail) and "a" in str(bad) and good == b"y" * 100
    assert client.suspects.bad("seg-a") and not client.suspects.bad("seg-b")
    assert client.get_batch(["a", "b"]) == [b"x" * 100, b"y" * 100]
    assert sorted(client.opened) == ["seg-a", "seg-a", "seg-b"]  # seg-a looked up afresh


def test_failover_reads_the_next_replica_into_a_registered_buffer(cluster):
    client, master, pool, plan = cluster
    master.replicas["k"] = [pool.replica("seg-a"), pool.replica("seg-b", offset=4096)]
    plan.disconnect(peer="seg-a", op="read")
    out = np.zeros(len(VALUE), np.uint8)
    addr = client.register_buffer(out)
    assert client.get_into("k", addr, len(out)) == len(VALUE)
    assert out.tobytes() == VALUE


def test_a_restarted_segment_gets_its_handle_refreshed(cluster):
    client, master, pool, plan = cluster
    master.replicas["k"] = [pool.replica("seg-a")]
    assert client.get("k") == VALUE  # seg-a's handle is now cached
    assert client.opened == ["seg-a"]
    pool.restart("seg-a")  # same name, new port, new memory: the cached descriptor is stale
    master.replicas["k"] = [pool.replica("seg-a"), pool.replica("seg-b")]
    assert client.get("k") == VALUE  # the stale handle fails; seg-b serves
    assert pool.fabric.moves[("seg-b", "read")] == 1
    master.replicas["k"] = [pool.replica("seg-a")]
    assert client.get("k") == VALUE  # seg-a is opened again and serves
    assert client.opened == ["seg-a", "seg-b", "seg-a"]
    assert pool.fabric.moves[("seg-a", "read")] == 2


def test_a_write_that_fails_on_a_replica_is_revoked_and_the_other_key_is_kept(cluster):
    client, master, pool, plan = cluster
    master.replicas["ok"] = [Replica("seg-a", pool.buffers["seg-a"].ctypes.data, 100)]
    master.replicas["lost"] = [Replica("seg-a", pool.buffers["seg-a"].ctypes.data + 4096, 100),
                               Replica("seg-b", pool.buffers["seg-b"].ctypes.data, 100)]
    plan.fail(peer="seg-b", op="write")
    ok, lost = client.put_batch(["ok", "lost"], [b"o" * 100, b"l" * 100], ReplicateConfig(replica_num=2))
    assert ok is None and isinstance(lost, TransferFail)
    assert master.ended == ["ok"] and master.revoked == ["lost"]
    assert pool.holds("seg-a", b"o" * 100) and not pool.holds("seg-b", b"l" * 100)
    client.put("lost", b"l" * 100)  # the fault fired once: a new attempt writes both replicas
    assert master.ended == ["ok", "lost"]
    assert pool.holds("seg-a", b"l" * 100, offset=4096) and pool.holds("seg-b", b"l" * 100)


def test_a_master_that_does_not_answer_is_a_timeout_and_a_reset_is_retried(cluster):
    client, master, pool, plan = cluster
    master.replicas["k"] = [pool.replica("seg-a")]
    plan.drop(op="get_replicas").disconnect(op="get_replicas")
    with pytest.raises(Timeout):  # the request may have been served: not repeated
        client.get("k")
    assert len(client.waits) == 1 and 1.9 < client.waits[0] <= 2  # the call's deadline, once
    assert client.get("k") == VALUE  # the reset changed nothing: retried within the deadline
    plan.disconnect(op="get_replicas", times=None)  # a master that stays unreachable
    with pytest.raises(Unavailable):
        client.get("k")


def test_a_known_key_is_read_once_while_the_master_answers_even_when_the_lookup_is_retried(cluster):
    # get_into learns where "k" is; the next get_into reads it while the master is asked. The
    # first lookup's connection drops after the request went out (the link retries): the
    # speculative read runs once, and the answer of the retry confirms it
    client, master, pool, plan = cluster
    master.replicas["k"] = [pool.replica("seg-b")]
    out = np.zeros(len(VALUE), np.uint8)
    addr = client.register_buffer(out)
    assert client.get_into("k", addr, len(out)) == len(VALUE)
    assert client.locations.get("k") is not None
    pool.fabric.moves.clear()
    out[:] = 0
    plan.disconnect(op="get_replicas")
    assert client.get_into("k", addr, len(out)) == len(VALUE) and out.tobytes() == VALUE
    assert plan.count(FaultKind.DISCONNECT, op="get_replicas") == 1
    assert pool.fabric.moves == {("seg-b", "read"): 1}  # once, and confirmed: not read again
    # the master now names another replica at another place: read again, from there
    master.replicas["k"] = [pool.replica("seg-a", offset=4096)]
    pool.fabric.moves.clear()
    out[:] = 0
    assert client.get_into("k", addr, len(out)) == len(VALUE) and out.tobytes() == VALUE
    assert pool.fabric.moves == {("seg-b", "read"): 1, ("seg-a", "read"): 1}
