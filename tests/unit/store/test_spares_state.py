"""Spares (``kvplane.store.master.spares``): an allocation placed one put ahead, on an explicit
timeline (no clocks, no sockets)."""

from kvplane.common.auth import DEFAULT_TENANT
from kvplane.store.errors import InvalidKey, InvalidParams, ObjectExists, ObjectNotFound, ReplicaNotReady
from kvplane.store.inventory import header_len
from kvplane.store.master import spares
from kvplane.store.master.access import keys_of, unscoped
from kvplane.store.master.config import MasterConfig
from kvplane.store.master.state import MasterState
from kvplane.store.types import ReplicateConfig, SegmentInfo, SpareAsk

MB = 1 << 20
HDR = header_len("k1")


def state(seg_size=MB, **cfg):
    st = MasterState(MasterConfig(**cfg), seed=1)
    st.mount("c0", [SegmentInfo("s0", 1_000_000, seg_size, "", "h:0", "host")], 0.0)
    return st


def grant(st, size=1000, hdr=HDR, now=0.0, client="w", **cfg):
    return spares.grant(st, client, SpareAsk(size, hdr, ReplicateConfig(**cfg)), now,
                        frozenset(), 10.0)


def test_a_committed_spare_is_an_object_under_its_key_and_the_spare_is_gone():
    st = state()
    name, r = grant(st)
    assert r.code == 0 and r.size == 1000 and len(r.replicas) == 1
    assert name.startswith(spares.PREFIX) and not st.objects[name].complete
    assert st.get_replicas("k1", 0.0).code == ObjectNotFound.code  # nothing readable yet
    assert spares.commit(st, "w", name, "k1", r.version, 77, 1.0) == 0
    assert name not in st.objects and name not in st.open_puts
    got = st.get_replicas("k1", 1.0)
    assert got.code == 0 and got.replicas == r.replicas and got.size == 1000
    assert got.version == r.version and got.checksum == 77
    assert st.objects["k1"].owner == "w"  # the writer owns it (Mooncake's metadata.client_id)
    assert ("stored", "k1") in st.changes  # the pool's KV events see a plain put
    assert spares.commit(st, "w", name, "k2", r.version, 77, 1.0) == ObjectNotFound.code


def test_only_the_writer_with_the_version_commits_a_spare():
    st = state()
    name, r = grant(st)
    assert spares.commit(st, "intruder", name, "k1", r.version, 1, 0.0) == ObjectNotFound.code
    assert spares.commit(st, "w", name, "k1", r.version + 1, 1, 0.0) == ObjectNotFound.code
    assert spares.commit(st, "w", "k-not-a-spare", "k1", r.version, 1, 0.0) == ObjectNotFound.code
    assert spares.commit(st, "w", name, "k1", r.version, 1, 0.0) == 0


def test_a_commit_over_an_existing_key_keeps_the_object_and_drops_the_spare():
    st = state()
    first = st.put_start("k1", 500, ReplicateConfig(), 0.0)
    st.put_end("k1", 0.0)
    name, r = grant(st)
    assert spares.commit(st, "w", name, "k1", r.version, 1, 0.0) == ObjectExists.code
    assert name not in st.objects
    assert st.get_replicas("k1", 0.0).replicas == first.replicas  # untouched
    # the spare's record (it names k1) is fenced at the segment with its generation; its
    # space waits for that fence, not for the rest of the spare's write window
    assert r.version in st.fences_for("c0")
    used = st.used_ratio()
    st.ping("c0", 1.0, fenced=[r.version])
    st.reclaim(1.0)
    assert st.used_ratio() < used


def test_a_commit_over_a_key_being_written_is_refused():
    st = state()
    assert st.put_start("k1", 500, ReplicateConfig(), 0.0).code == 0
    name, r = grant(st)
    assert spares.commit(st, "w", name, "k1", r.version, 1, 1.0) == ObjectExists.code
    assert st.get_replicas("k1", 1.0).code == ReplicaNotReady.code


def test_a_key_whose_header_does_not_fit_or_a_bad_key_drops_the_spare():
    st = state()
    name, r = grant(st)
    assert spares.commit(st, "w", name, "k" * 100, r.version, 1, 0.0) == InvalidParams.code
    assert name not in st.objects
    name, r = grant(st)
    assert spares.commit(st, "w", name, "", r.version, 1, 0.0) == InvalidKey.code
    assert name not in st.objects


def test_a_spare_given_back_unwritten_is_free_at_once():
    st = state(seg_size=MB, high_watermark=1.0)
    name, r = grant(st, size=MB - HDR)
    assert spares.give_back(st, "intruder", name, r.version, False, 0.0) == ObjectNotFound.code
    assert st.used_ratio() == 1.0
    assert spares.give_back(st, "w", name, r.version, False, 0.0) == 0
    assert st.used_ratio() == 0.0 and name not in st.objects and name not in st.open_puts
    assert grant(st, size=MB - HDR) is not None  # the space serves the next one


def test_a_spare_whose_write_failed_is_fenced_before_its_space_is_reused():
    st = state(seg_size=MB, high_watermark=1.0)
    name, r = grant(st, size=MB - HDR)
    assert st.used_ratio() == 1.0
    assert spares.give_back(st, "intruder", name, r.version, True, 0.0) == ObjectNotFound.code
    assert spares.give_back(st, "w", name, r.version, True, 0.0) == 0
    st.reclaim(20.0)
    assert st.used_ratio() == 1.0  # a late write of the spare's writer may still land
    assert st.fences_for("c0") == [r.version]
    st.ping("c0", 20.0, fenced=[r.version])
    st.reclaim(20.0)
    assert st.used_ratio() == 0.0


def test_a_spare_of_a_dead_writer_is_dropped_with_its_other_unfinished_puts():
    st = state(client_ttl=5.0)
    st.mount("w", [], 0.0)
    name, r = grant(st)
    st.ping("c0", 10.0)
    assert st.expire_clients(10.0) == ["w"]
    assert name not in st.objects
    assert spares.commit(st, "w", name, "k1", r.version, 1, 10.0) == ObjectNotFound.code


def test_spares_are_refused_out_of_range_or_with_the_pool_full():
    st = state(seg_size=MB, high_watermark=1.0)
    assert grant(st, size=0) is None
    assert grant(st, size=spares.MAX_SPARE + 1) is None
    assert grant(st, hdr=HDR + 1) is None  # not a header length
    assert grant(st, replica_num=0) is None
    name, _ = grant(st, size=MB - HDR)
    assert grant(st, size=1000) is None  # nothing left
    assert name in st.objects


def test_a_spare_never_evicts_nor_takes_the_pool_past_its_watermark():
    st = state(seg_size=MB, high_watermark=0.9)
    put = st.put_start("k1", MB // 2, ReplicateConfig(), 0.0)
    st.put_end("k1", 0.0, put.version)
    # the next object of that size fits only if k1 goes, and would pass the watermark anyway
    assert grant(st, size=MB // 2) is None
    assert st.get_replicas("k1", 0.0).code == 0 and st.evicted == 0
    assert grant(st, size=MB // 4) is not None  # 0.75 of the pool: under the watermark


def test_a_spare_is_no_tenants_key():
    st = state()
    name, _ = grant(st)
    put = st.put_start("k1", 10, ReplicateConfig(), 0.0)
    st.put_end("k1", 0.0, put.version)
    assert [k for _, k in keys_of(st.objects, DEFAULT_TENANT)] == ["k1"]
    assert unscoped(name)[0] == ""  # the empty tenant, which no token selects
