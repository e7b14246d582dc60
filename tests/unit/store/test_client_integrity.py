"""StoreClient integrity (issue 15), in memory: truthful puts, one deadline per call, the
master's lease, checksums with failover, failed segments reported to the master."""

from __future__ import annotations

import time

import pytest

from kvplane.store.checksum import digest
from kvplane.store.errors import ChecksumMismatch, LeaseExpired, ObjectNotFound, TransferFail
from tests.unit.store.test_client_failover import VALUE, cluster  # noqa: F401 (fixture)

pytestmark = pytest.mark.timeout(30)


def test_a_put_the_master_did_not_commit_is_not_a_success(cluster):
    client, master, pool, plan = cluster
    master.replicas["k"] = [pool.replica("seg-a", b"\0" * len(VALUE))]
    master.end_code = ObjectNotFound.code  # e.g. its segment went away while it was written
    with pytest.raises(TransferFail):
        client.put("k", VALUE)
    assert master.ended == ["k"]


def really_sleep(pool):
    """Make the fabric's drops and delays take real time (recorded as well)."""
    pool.fabric.sleep = lambda s: (pool.fabric.waits.append(s), time.sleep(s))


def test_a_get_whose_replicas_all_hang_takes_one_timeout_not_one_per_replica(cluster):
    client, master, pool, plan = cluster
    really_sleep(pool)
    master.replicas["k"] = [pool.replica("seg-a"), pool.replica("seg-b")]
    plan.drop(op="read", times=2)
    t0 = time.monotonic()
    with pytest.raises(TransferFail):
        client.get("k")
    took = time.monotonic() - t0
    waits = pool.fabric.waits
    assert len(waits) == 2 and took <= client.config.timeout + 0.3  # one deadline for the call
    assert waits[0] < client.config.timeout * 0.6  # the first replica left time for the second


def test_a_read_never_outlives_the_masters_lease(cluster):
    client, master, pool, plan = cluster
    master.replicas["k"] = [pool.replica("seg-a")]
    really_sleep(pool)
    master.ttl = 0.5  # the master's lease, shorter than the client's 2 s timeout
    plan.delay(1.0, peer="seg-a", op="read")
    with pytest.raises(LeaseExpired):
        client.get("k")
    assert pool.fabric.waits and max(pool.fabric.waits) <= 0.5  # stopped waiting at lease end


def with_checksums(client):
    client.config = type(client.config)(**{**client.config.__dict__, "checksum": True})


def test_a_corrupt_replica_fails_over_and_all_corrupt_raises(cluster):
    client, master, pool, plan = cluster
    with_checksums(client)
    master.replicas["k"] = [pool.replica("seg-a"), pool.replica("seg-b")]
    master.checksums["k"] = digest(VALUE)
    plan.corrupt(peer="seg-a", op="read")
    assert client.get("k") == VALUE  # seg-a's bytes failed the checksum; seg-b served
    assert client.corrupt_reads == 1
    plan.corrupt(op="read", times=3)  # the speculative read where it last read k, then both
    with pytest.raises(ChecksumMismatch):
        client.get("k")


def test_every_put_sends_its_checksum_and_gets_check_it_only_when_on(cluster):
    client, master, pool, plan = cluster
    master.replicas["k0"] = [pool.replica("seg-a", b"\0" * len(VALUE))]
    client.put("k0", VALUE)
    assert master.checksums["k0"] == digest(VALUE)  # the inventory header carries it
    master.replicas["k"] = [pool.replica("seg-b")]
    master.checksums["k"] = digest(b"other bytes")  # bytes that do not match
    assert client.get("k") == VALUE  # off by default: a get does not hash
    with_checksums(client)
    with pytest.raises(ChecksumMismatch):
        client.get("k")


def test_a_failed_segment_is_reported_with_the_next_rpc_and_tried_last(cluster):
    client, master, pool, plan = cluster
    master.replicas["k"] = [pool.replica("seg-a"), pool.replica("seg-b")]
    plan.fail(peer="seg-a", op="read")
    assert client.get("k") == VALUE
    assert client.get("k") == VALUE  # this request carries the report
    assert master.suspects == ["seg-a"]
    assert pool.fabric.moves[("seg-b", "read")] == 2  # seg-a was not tried again
