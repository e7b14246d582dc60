"""The pool's totals and the segments open to placement are kept as they change
(``allocator.Usage``, ``ObjectTable.eligible``): a put does no work that grows with the number
of segments mounted, and what it reads is what a full count would say."""

import random

import pytest

from kvplane.common.errors import InvalidArgument
from kvplane.store.inventory import header_len
from kvplane.store.master import spares
from kvplane.store.master.allocator import OffsetAllocator, Usage
from kvplane.store.master.config import MasterConfig
from kvplane.store.master.state import MasterState
from kvplane.store.types import ReplicateConfig, SegmentInfo, SpareAsk

MB = 1 << 20
ASK = SpareAsk(1000, header_len("key-00000"), ReplicateConfig())


def mount(st, i, size=MB, adopt=False, now=0.0):
    info = SegmentInfo(f"s{i}", (i + 1) << 32, size, "", f"h:{i}", "host")
    st.mount(f"c{i}", [info], now, adopt=adopt)


def full_count(st):
    segs = st.segments.values()
    return sum(s.alloc.capacity for s in segs), sum(s.alloc.used for s in segs)


def test_usage_counts_what_its_allocators_do_and_refuses_a_double_attach():
    usage, a, b = Usage(), OffsetAllocator(4096), OffsetAllocator(8192)
    a.allocate(100)  # before it is attached: counted on attach
    usage.attach(a)
    usage.attach(b)
    off = b.allocate(1000)
    assert (usage.capacity, usage.used) == (4096 + 8192, 128 + 1024)
    b.free(off, 1000)
    assert usage.used == 128 and usage.ratio() == 128 / (4096 + 8192)
    with pytest.raises(InvalidArgument):
        Usage().attach(a)
    usage.detach(a)
    assert (usage.capacity, usage.used) == (8192, 0)
    with pytest.raises(InvalidArgument):
        usage.detach(a)


def test_totals_match_a_full_count_through_puts_removes_spares_evictions_and_mounts():
    """A seeded random run of everything that allocates, frees, mounts, unmounts or re-cuts
    space; after each step the kept totals equal a count over every segment."""
    rng = random.Random(7)
    st = MasterState(MasterConfig(), seed=3)
    for i in range(4):
        mount(st, i)
    live: list[str] = []
    spare = None
    n_segs, now = 4, 0.0
    for step in range(4000):
        now += 0.05
        r = rng.random()
        if r < 0.45:  # a put (the pool fills: place() evicts)
            key = f"k{step}"
            cfg = ReplicateConfig(replica_num=rng.choice([1, 2]))
            res = st.put_start(key, rng.choice([100, 4000, 60_000]), cfg, now)
            if res.code == 0 and rng.random() < 0.85:
                st.put_end(key, now)
                live.append(key)
            elif res.code == 0:
                st.put_revoke(key, now)
        elif r < 0.65 and live:
            st.remove(live.pop(rng.randrange(len(live))), True, now)
        elif r < 0.8:  # a spare: granted, then committed or given back
            if spare is None:
                spare = spares.grant(st, "w", ASK, now, frozenset(), 10.0)
            else:
                name, res = spare
                if rng.random() < 0.5:
                    spares.commit(st, "w", name, f"key-{step % 100000:05d}", res.version, 0, now)
                else:
                    spares.give_back(st, "w", name, res.version, rng.random() < 0.5, now)
                spare = None
        elif r < 0.84:
            st.evict(now, rng.choice([0, 64 << 10]))
        elif r < 0.88:
            st.reclaim(now + 60)  # quarantined space comes back
        elif r < 0.92 and len(st.segments) > 1:
            st.unmount(rng.choice(sorted(st.segments)))
            spare = None
        elif r < 0.96:
            mount(st, n_segs, rng.choice([MB // 2, MB, 2 * MB]), now=now)
            n_segs += 1
        else:  # a share re-cut at its end (sharded masters), as far as its free tail allows
            seg = st.segments[rng.choice(sorted(st.segments))]
            tail = -(-seg.alloc.free_tail() // 4096) * 4096
            st.resize_segment(seg, max(tail, 4096) + rng.choice([0, 4096, 1 << 16]))
        assert (st.usage.capacity, st.usage.used) == full_count(st), f"step {step}"
        assert st.largest == max((s.alloc.capacity for s in st.segments.values()), default=0)
    assert st.usage.used > 0 and len(st.segments) > 1  # (the run did fill and keep segments)


def test_placement_follows_suspects_adoption_and_unmounts():
    """The cached list of placeable segments changes with each of them."""
    st = MasterState(MasterConfig(), seed=1)
    for i in range(3):
        mount(st, i)

    def placed(n=60):
        return {st.place(1000, ReplicateConfig(), 0.0, frozenset())[0][0] for _ in range(n)}

    assert placed() == {"s0", "s1", "s2"}
    st.suspect(["s1"], 0.0)
    assert placed() == {"s0", "s2"}
    st.segments["s1"].suspect_since = None  # (what a heartbeat does after suspect_min)
    assert placed() == {"s0", "s1", "s2"}
    st.unmount("s2")
    assert placed() == {"s0", "s1"}
    mount(st, 3, adopt=True)  # re-registering what it holds: no placements yet
    assert placed() == {"s0", "s1"}
    st.adopt("c3", "s3", [], [], True, 0.0)
    assert placed() == {"s0", "s1", "s3"}


class CountingDict(dict):
    """A dict that counts walks over all of its entries."""

    walks = 0

    def values(self):
        CountingDict.walks += 1
        return super().values()

    def items(self):
        CountingDict.walks += 1
        return super().items()

    def __iter__(self):
        CountingDict.walks += 1
        return super().__iter__()


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_put_walks_no_segment_list(replicas):
    """With 500 segments mounted, puts (PutStart, PutEnd, and a spare's commit with the next
    grant) never walk the segments: their cost does not grow with the pool."""
    st = MasterState(MasterConfig(), seed=1)
    for i in range(500):
        mount(st, i)
    st.segments = CountingDict(st.segments)
    cfg = ReplicateConfig(replica_num=replicas)
    ask = SpareAsk(ASK.size, ASK.hdr, cfg)
    name, res = spares.grant(st, "w", ask, 0.0, frozenset(), 10.0)  # (builds the cache)
    CountingDict.walks = 0
    for i in range(200):
        key = f"key-{i:05d}"
        assert spares.commit(st, "w", name, key, res.version, 0, 1.0) == 0
        name, res = spares.grant(st, "w", ask, 1.0, frozenset(), 10.0)
        assert len(res.replicas) == replicas
        got = st.put_start(f"p{i}", 4096, cfg, 1.0)
        assert got.code == 0 and len(got.replicas) == replicas
        assert st.put_end(f"p{i}", 1.0) == 0
    assert CountingDict.walks == 0
    assert len({r.segment for i in range(200) for r in st.get_replicas(f"p{i}", 2.0).replicas}) > 50


class CountingList(list):
    """A list that counts walks: iterations and slices (an index of one item is not one)."""

    walks = 0

    def __iter__(self):
        CountingList.walks += 1
        return super().__iter__()

    def __getitem__(self, i):
        if isinstance(i, slice):
            CountingList.walks += 1
        return super().__getitem__(i)


@pytest.mark.parametrize("cfg", [ReplicateConfig(preferred_segment="s7"),
                                 ReplicateConfig(replica_num=2, preferred_segments=["s3", "s9"])],
                         ids=["preferred_segment", "preferred_segments"])
def test_a_put_to_preferred_segments_walks_no_segment_list(cfg):
    """What LMCache and vLLM's Mooncake connector ask for (their own host's segment first):
    with 500 segments mounted, puts and spares land there without walking or copying the
    list of segments open to placement."""
    st = MasterState(MasterConfig(), seed=1)
    for i in range(500):
        mount(st, i, size=8 * MB)
    ask = SpareAsk(ASK.size, ASK.hdr, cfg)
    name, res = spares.grant(st, "w", ask, 0.0, frozenset(), 10.0)  # (builds the cache)
    st._eligible = CountingList(st._eligible)  # (the cache stays valid: nothing changed)
    CountingList.walks = 0
    wanted = {cfg.preferred_segment} if cfg.preferred_segment else set(cfg.preferred_segments)
    for i in range(200):
        assert spares.commit(st, "w", name, f"key-{i:05d}", res.version, 0, 1.0) == 0
        name, res = spares.grant(st, "w", ask, 1.0, frozenset(), 10.0)
        got = st.put_start(f"p{i}", 4096, cfg, 1.0)
        assert got.code == 0 and {r.segment for r in got.replicas} == wanted
        assert {r.segment for r in res.replicas} == wanted
        assert st.put_end(f"p{i}", 1.0) == 0
    assert CountingList.walks == 0
    st.suspect(sorted(wanted), 2.0)  # preferred but suspect: placed elsewhere, as before
    got = st.put_start("elsewhere", 4096, cfg, 2.0)
    assert got.code == 0 and not {r.segment for r in got.replicas} & wanted
