"""Engines in one process: striping, transport choice, file segments, tokens, metadata backends."""

import numpy as np
import pytest

from kvplane.common.errors import AddressNotRegistered, InvalidArgument, NotFound, Unauthorized
from kvplane.transfer import OpCode, TransferEngine, TransferRequest, TransferStatus
from kvplane.transfer.metadata import open_metadata
from kvplane.transfer.metadata_server import serve_in_thread
from tests.support.services import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]
MB = 1 << 20


def pair(**kw):
    return TransferEngine(**kw), TransferEngine(**kw)


def test_large_request_is_sliced_and_striped():
    a, b = pair(protocol="tcp", slice_size=MB, streams=3)
    with a, b:
        src = np.random.randint(0, 256, 24 * MB, dtype=np.uint8)
        dst = np.zeros_like(src)
        a.register_memory(src)
        b.register_memory(dst)
        seg = a.open_segment(b.name)
        tcp = a.transports["tcp"]
        lanes = []
        real_lane = tcp._lane

        def spy(peer, slices, deadline):
            lanes.append(len(slices))
            return real_lane(peer, slices, deadline)

        tcp._lane = spy
        a.write(seg, src.ctypes.data, dst.ctypes.data, src.nbytes)
        assert np.array_equal(src, dst)
        assert b._server.frames >= 24  # one frame per 1 MiB slice
        assert lanes == [8, 8, 8]  # striped over three lanes (connections)


def test_auto_uses_shm_and_no_socket_for_managed_memory():
    a, b = pair(protocol="auto")
    with a, b:
        buf = b.allocate_managed_buffer(4 * MB)
        src = np.random.randint(0, 256, 4 * MB, dtype=np.uint8)
        a.register_memory(src)
        seg = a.open_segment(b.name)
        before = b._server.frames
        a.write(seg, src.ctypes.data, buf.addr, 4 * MB)
        assert np.array_equal(buf.array, src)
        assert b._server.frames == before  # no READ/WRITE frame: it went through shared memory
        a.transfer([TransferRequest(OpCode.READ, src.ctypes.data, seg, buf.addr, MB,
                                    transport="tcp")], check=True)
        assert b._server.frames == before + 1
        with pytest.raises(InvalidArgument):
            a.transfer([TransferRequest(OpCode.READ, src.ctypes.data, seg, buf.addr, MB,
                                        transport="file")], check=True)
        b.free_managed_buffer(buf.addr)
        with pytest.raises(NotFound):
            b.free_managed_buffer(buf.addr)


def test_file_segments_local_and_remote(tmp_path):
    root = tmp_path / "nvme"
    root.mkdir()
    a, b = pair(protocol="auto", file_root=str(root))
    with a, b:
        region = b.register_file("kv.bin", 8 * MB)
        src = np.random.randint(0, 256, 8 * MB, dtype=np.uint8)
        back = np.zeros_like(src)
        a.register_memory(src)
        a.register_memory(back)
        seg = a.open_segment(b.name)
        before = b._server.frames
        a.write(seg, src.ctypes.data, region.addr, 8 * MB)  # file transport: pwrite
        assert b._server.frames == before
        assert (root / "kv.bin").read_bytes() == src.tobytes()
        a.transfer([TransferRequest(OpCode.READ, back.ctypes.data, seg, region.addr + MB, MB,
                                    transport="tcp")], check=True)  # owner serves it (sendfile)
        assert np.array_equal(back[:MB], src[MB:2 * MB])
        a.transfer([TransferRequest(OpCode.WRITE, src.ctypes.data, seg, region.addr, MB,
                                    transport="tcp")], check=True)
        for bad in ("../escape", "a/b", "", ".hidden/../../x"):
            with pytest.raises(InvalidArgument):
                b.register_file(bad, 10)
        assert not (tmp_path / "escape").exists()


def test_file_segments_need_a_root():
    with TransferEngine() as te, pytest.raises(InvalidArgument):
        te.register_file("x", 10)


def test_token_is_enforced():
    with TransferEngine(token="s3cret", protocol="tcp") as b, \
            TransferEngine(token="wrong", protocol="tcp") as bad, \
            TransferEngine(token="s3cret", protocol="tcp") as good:
        dst = np.zeros(MB, np.uint8)
        b.register_memory(dst)
        src = np.ones(MB, np.uint8)
        bad.register_memory(src)
        good.register_memory(src.copy())
        with pytest.raises(Unauthorized):
            bad.open_segment(b.name, timeout=3)
        seg = good.open_segment(b.name)
        good.write(seg, good.memory.regions()[0].addr, dst.ctypes.data, MB)
        assert dst.all()


@pytest.mark.parametrize("backend", ["memory", "http", "etcd", "redis"])
def test_metadata_backends(backend, request):
    http = None
    if backend == "memory":
        url = "memory://t-backends"
    elif backend == "http":
        http = serve_in_thread()
        url = f"{http.url}/metadata"
    else:
        url = request.getfixturevalue(f"{backend}_url")
    try:
        with TransferEngine(metadata=url, name=f"seg-{backend}", protocol="tcp") as b, \
                TransferEngine(metadata=url, protocol="tcp") as a:
            dst = np.zeros(MB, np.uint8)
            b.register_memory(dst)
            src = np.full(MB, 9, np.uint8)
            a.register_memory(src)
            seg = a.open_segment(f"seg-{backend}")
            a.write(seg, src.ctypes.data, dst.ctypes.data, MB)
            assert (dst == 9).all()
            with pytest.raises(NotFound):
                a.open_segment("no-such-segment")
        meta = open_metadata(url)
        assert meta.get(f"kvplane/segments/seg-{backend}") is None  # unpublished on close
        meta.close()
    finally:
        if http:
            http.close()


def test_republish_after_metadata_server_restart():
    http = serve_in_thread()
    port = http.port
    url = f"{http.url}/metadata"
    with TransferEngine(metadata=url, name="phoenix", republish_interval=0.05) as b:
        b.register_memory(np.zeros(4096, np.uint8))
        http.close()
        http = serve_in_thread(port=port)  # comes back empty
        meta = open_metadata(url)
        wait_until(lambda: meta.get("kvplane/segments/phoenix") is not None, 10, "republish")
        meta.close()
    http.close()


def test_http_metadata_server_limits():
    import httpx

    with serve_in_thread(token="t") as srv:
        base = f"{srv.url}/metadata"
        assert httpx.put(base, params={"key": "k"}, content=b"v").status_code == 401
        hdr = {"X-KVPlane-Token": "t"}
        assert httpx.put(base, params={"key": "k"}, content=b"v", headers=hdr).status_code == 200
        assert httpx.get(base, params={"key": "k"}, headers=hdr).content == b"v"
        big = b"x" * ((1 << 20) + 1)
        assert httpx.put(base, params={"key": "b"}, content=big, headers=hdr).status_code == 413
        assert httpx.get(base, params={"key": "nope"}, headers=hdr).status_code == 404
        assert httpx.get(base, headers=hdr).status_code == 422
        assert httpx.delete(base, params={"key": "k"}, headers=hdr).status_code == 200
        assert httpx.get(f"{srv.url}/metrics/").status_code == 401  # /metrics needs it too
        assert "kvplane_metadata_keys" in httpx.get(f"{srv.url}/metrics/", headers=hdr).text
        plain = httpx.get(f"{srv.url}/metrics", headers=hdr, follow_redirects=False)  # no 307
        assert plain.status_code == 200 and "kvplane_metadata_keys" in plain.text
        assert httpx.get(f"{srv.url}/health").status_code == 200  # the one open path


def test_own_segment_is_a_memcpy_even_under_tcp():
    with TransferEngine(protocol="tcp") as te:
        a = np.arange(MB, dtype=np.uint8)
        b = np.zeros(MB, np.uint8)
        te.register_memory(a)
        te.register_memory(b)
        seg = te.open_segment(te.name)
        te.write(seg, a.ctypes.data, b.ctypes.data, MB)
        assert np.array_equal(a, b) and te._server.frames == 0
        with pytest.raises(AddressNotRegistered):
            te.write(seg, a.ctypes.data, b.ctypes.data + 10, MB)  # still bounds-checked


def test_a_crashing_transport_fails_requests_instead_of_hanging():
    with TransferEngine(protocol="tcp") as a, TransferEngine(protocol="tcp") as b:
        src, dst = np.ones(4096, np.uint8), np.zeros(4096, np.uint8)
        a.register_memory(src)
        b.register_memory(dst)
        seg = a.open_segment(b.name)

        def boom(*args):
            raise RuntimeError("bug")

        a.transports["tcp"].run = boom
        st = a.transfer([TransferRequest(OpCode.WRITE, src.ctypes.data, seg, dst.ctypes.data, 4096)],
                        timeout=5)
        assert st == [TransferStatus.FAILED]



def test_failed_same_host_slices_fail_over_to_tcp():
    from kvplane.common import metrics

    a, b = pair(protocol="auto")
    with a, b:
        buf = b.allocate_managed_buffer(2 * MB)
        src = np.random.randint(0, 256, 2 * MB, dtype=np.uint8)
        a.register_memory(src)
        seg = a.open_segment(b.name)

        def broken(route, slices, deadline):
            for s in slices:
                s.done(TransferStatus.FAILED, "mapping vanished")

        a.transports["shm"].run = broken
        before = metrics.TRANSFER_FAILOVERS.labels("shm")._value.get()
        a.write(seg, src.ctypes.data, buf.addr, 2 * MB)
        assert np.array_equal(buf.array, src)
        assert metrics.TRANSFER_FAILOVERS.labels("shm")._value.get() == before + 1
        # forcing shm means no failover: the failure is reported
        st = a.transfer([TransferRequest(OpCode.WRITE, src.ctypes.data, seg, buf.addr, MB,
                                         transport="shm")])
        assert st == [TransferStatus.FAILED]


@pytest.mark.parametrize("op", ["read", "write"])
def test_lean_paths_end_every_kind_of_item_as_transfer_would(op):
    """TCP items go as one READV/WRITEV frame per peer; own-memory items, bad lengths, unknown
    handles and out-of-range items end as transfer() would end them."""
    reading = op == "read"
    a, b = pair(protocol="tcp")
    with a, b:
        rng = np.random.default_rng(1)
        remote = rng.integers(0, 256, MB, dtype=np.uint8) if reading else np.zeros(MB, np.uint8)
        mine = rng.integers(0, 256, MB, dtype=np.uint8) if reading else np.zeros(MB, np.uint8)
        local = np.zeros(8 * 4096, np.uint8) if reading else \
            rng.integers(0, 256, 8 * 4096, dtype=np.uint8)
        b.register_memory(remote)
        a.register_memory(mine)
        a.register_memory(local)
        seg_b, seg_a = a.open_segment(b.name), a.open_segment(a.name)
        lo, r, m = local.ctypes.data, remote.ctypes.data, mine.ctypes.data
        frames = b._server.frames
        items = [(seg_b, lo + k * 4096, r + k * 8192, 4096, 0) for k in range(5)]
        items += [(seg_a, lo + 5 * 4096, m + 4096, 4096, 0),  # own memory: a memcpy
                  (seg_b, lo + 6 * 4096, r, 0, 0),  # bad length
                  (999, lo + 6 * 4096, r, 4096, 0),  # no such segment handle
                  (seg_b, lo + 7 * 4096, r + MB - 100, 4096, 0)]  # past b's region
        got = (a.read_many if reading else a.write_many)(items, timeout=5)
        assert got == [TransferStatus.COMPLETED] * 6 + [TransferStatus.FAILED] * 3
        pairs = [(local[k * 4096:(k + 1) * 4096], remote[k * 8192:k * 8192 + 4096])
                 for k in range(5)] + [(local[5 * 4096:6 * 4096], mine[4096:8192])]
        assert all(np.array_equal(x, y) for x, y in pairs)
        if reading:
            assert not local[6 * 4096:].any()  # nothing landed for the failed reads
        else:
            untouched = np.ones(MB, bool)
            for k in range(5):
                untouched[k * 8192:k * 8192 + 4096] = False
            assert not remote[untouched].any()  # the failed writes wrote nothing
        assert b._server.frames == frames + 1  # the five TCP items: one frame


def test_read_many_reports_a_dead_peer_instead_of_hanging():
    a, b = pair(protocol="tcp")
    with a:
        src = np.zeros(MB, np.uint8)
        dst = np.zeros(4096, np.uint8)
        b.register_memory(src)
        a.register_memory(dst)
        seg = a.open_segment(b.name)
        b.close()  # its listener is gone
        got = a.read_many([(seg, dst.ctypes.data, src.ctypes.data, 4096, 0)] * 2, timeout=2)
        assert got == [TransferStatus.FAILED] * 2


@pytest.mark.parametrize("op", ["read", "write"])
def test_one_item_paths_end_each_item_as_the_many_form_would(op):
    """read_one/write_one: a TCP item is one plain frame with its bytes moved; own memory, a
    bad length, an unknown handle and a range past the peer's region end as read_many or
    write_many would end them; a dead peer is FAILED, not a hang."""
    reading = op == "read"
    a, b = pair(protocol="tcp")
    with a:
        rng = np.random.default_rng(2)
        remote = rng.integers(0, 256, MB, dtype=np.uint8) if reading else np.zeros(MB, np.uint8)
        mine = rng.integers(0, 256, MB, dtype=np.uint8) if reading else np.zeros(MB, np.uint8)
        local = np.zeros(4096, np.uint8) if reading else rng.integers(0, 256, 4096, dtype=np.uint8)
        b.register_memory(remote)
        a.register_memory(mine)
        a.register_memory(local)
        seg_b, seg_a = a.open_segment(b.name), a.open_segment(a.name)
        lo, r, m = local.ctypes.data, remote.ctypes.data, mine.ctypes.data
        one = a.read_one if reading else a.write_one
        many = a.read_many if reading else a.write_many
        frames = b._server.frames
        assert one(seg_b, lo, r + 8192, 4096, timeout=5) == TransferStatus.COMPLETED
        assert b._server.frames == frames + 1
        assert np.array_equal(local, remote[8192:8192 + 4096])
        assert one(seg_a, lo, m + 4096, 4096, timeout=5) == TransferStatus.COMPLETED
        assert np.array_equal(local, mine[4096:8192])
        bad = [(seg_b, lo, r, 0, 0), (999, lo, r, 4096, 0), (seg_b, lo, r + MB - 100, 4096, 0)]
        for item in bad:
            before = (local.copy(), remote.copy())
            assert one(*item, timeout=5) == many([item], timeout=5)[0] == TransferStatus.FAILED
            assert np.array_equal(local, before[0]) and np.array_equal(remote, before[1])
        b.close()  # its listener is gone
        assert one(seg_b, lo, r, 4096, timeout=2) == TransferStatus.FAILED
