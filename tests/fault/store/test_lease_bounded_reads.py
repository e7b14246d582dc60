"""Issue 28, finding 1: a warm reader never returns another object's bytes as a success.

A master with a 1 s read lease, a reader with a 5 s timeout that has read ``victim`` once (its
place is known, and held), a segment process that is stopped (SIGSTOP) while the reader reads
``victim`` again; meanwhile ``victim`` is removed once its lease ends and its space is refilled
by a shared-memory client (which writes into the stopped segment's memory directly); then the
segment resumes (SIGCONT) and serves the queued read. The read ended after the lease that
covered it: its bytes must not be returned. Every read path is tried (get, get_into,
batch_get_into, the held one-key path, the Mooncake facade's get and get_into); each must raise
(or give the facade's failure) or give ``victim``'s own bytes, never the refill's.
"""

from __future__ import annotations

import signal
import threading

import httpx
import numpy as np
import pytest

from kvplane.common.errors import KVPlaneError
from kvplane.compat.mooncake_store import MooncakeDistributedStore
from kvplane.store.client.client import StoreClient
from tests.support.auth import headers
from tests.support.services import wait_until
from tests.support.store_client_proc import value_of
from tests.support.store_procs import spawn_master, spawn_segment

pytestmark = [pytest.mark.fault, pytest.mark.timeout(90)]
KB = 1024
SIZE = 128 * KB


def lookups(admin_port: int) -> float:
    """The master's count of lookups served (``master_rpc_requests_total{method=get_replicas}``)."""
    text = httpx.get(f"http://127.0.0.1:{admin_port}/metrics/", headers=headers()).text
    for line in text.splitlines():
        if line.startswith("master_rpc_requests_total{") and 'method="get_replicas"' in line:
            return float(line.split()[-1])
    return 0.0


def _buffer(c: StoreClient) -> tuple[np.ndarray, int]:
    buf = np.zeros(SIZE, np.uint8)
    return buf, c.register_buffer(buf)


def read_get(c: StoreClient) -> bytes:
    return c.get("victim")


def read_get_into(c: StoreClient) -> bytes:
    buf, addr = _buffer(c)
    n = c.get_into("victim", addr, SIZE)
    return buf[:n].tobytes()


def read_batch_get_into(c: StoreClient) -> bytes:
    buf, addr = _buffer(c)
    got = c.batch_get_into(["victim"], [addr], [SIZE])[0]
    if isinstance(got, KVPlaneError):
        raise got
    return buf[:got].tobytes()


def _facade(c: StoreClient) -> MooncakeDistributedStore:
    st = MooncakeDistributedStore()
    st._c, st._local_buffer = c, c.config.local_buffer_size  # this reader, set up already
    return st


def read_mooncake_get(c: StoreClient) -> bytes:
    got = _facade(c).get("victim")
    if not got:
        raise KVPlaneError("the facade's get failed (b'')")
    return got


def read_mooncake_get_into(c: StoreClient) -> bytes:
    buf, addr = _buffer(c)
    n = _facade(c).get_into("victim", addr, SIZE)
    if n < 0:
        raise KVPlaneError(f"the facade's get_into failed ({n})")
    return buf[:n].tobytes()


def fill(writer: StoreClient, place: tuple) -> str:
    """Put new objects until one lands where ``victim`` was (``place``); returns its key.
    Objects that land elsewhere are removed again, so the space stays free."""
    got: list[str] = []

    def landed() -> bool:
        key = f"refill-{len(got)}"
        writer.put(key, value_of(key, SIZE).tobytes())
        loc = writer.locations.get(key)
        if loc is not None and loc[:2] == place[:2]:
            got.append(key)
            return True
        writer.remove(key, force=True)
        got.append("")
        return False
    wait_until(landed, 10, "victim's space to be handed out again")
    return got[-1]


# (read, held): held reads on, the second read comes at once (within half the lease: a held
# read, no lookup); off, it is speculative (the lookup and the read overlap)
CASES = {
    "get": (read_get, False),
    "get_into": (read_get_into, False),
    "batch_get_into": (read_batch_get_into, False),
    "held_get": (read_get, True),
    "held_one": (read_get_into, True),
    "held_batch_get_into": (read_batch_get_into, True),
    "mooncake_get": (read_mooncake_get, False),
    "mooncake_get_into": (read_mooncake_get_into, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_warm_reader_never_returns_the_refills_bytes_after_its_lease_ended(case):
    read, held = CASES[case]
    victim = value_of("victim", SIZE).tobytes()
    with spawn_master("--lease-ttl", "1", "--client-ttl", "30") as m:
        addr, admin = m.info["master"], m.info["admin_port"]
        with spawn_segment(addr, "1MiB") as seg, \
                StoreClient(master=addr, protocol="tcp", timeout=5, held_reads=held) as reader, \
                StoreClient(master=addr, timeout=5) as writer:  # shm: writes while seg is stopped
            writer.put("victim", victim)
            assert read(reader) == victim  # warm: the reader knows (and holds) victim's place
            place = reader.locations.get("victim")
            assert place is not None
            # the reader keeps the segments its reads timed out on to itself: as if its report
            # reached the master only after the refill (else the master places nothing there
            # until the segment is heard from again, and the space is not reused)
            reader.suspects.take = lambda: []
            reading = threading.Event()
            for name in ("read_many", "read_one"):  # tells the test the read went out
                real = getattr(reader.engine, name)

                def traced(*a, _real=real, **kw):
                    reading.set()
                    return _real(*a, **kw)
                setattr(reader.engine, name, traced)
            before = lookups(admin)
            out: dict[str, object] = {}

            def second_read() -> None:
                try:
                    out["got"] = read(reader)
                except KVPlaneError as exc:
                    out["error"] = exc

            seg.signal(signal.SIGSTOP)
            t = threading.Thread(target=second_read, daemon=True)
            try:
                t.start()
                wait_until(reading.is_set, 10, "the reader's read to go out")
                if not held:  # the lookup overlapping it was served: a new lease was granted
                    wait_until(lambda: lookups(admin) > before, 10, "the reader's lookup")
                wait_until(lambda: writer.batch_remove(["victim"])[0] is None, 10,
                           "victim's read lease to end")  # a plain remove succeeds then
                refill = fill(writer, place)
            finally:
                seg.signal(signal.SIGCONT)
            t.join(20)
            assert not t.is_alive()
            got = out.get("got")
            wrong = 0 if got is None or got == victim else 1
            assert wrong == 0, (
                f"{case}: another object's bytes returned as success "
                f"(the refill's: {got == value_of(refill, SIZE).tobytes()})")
