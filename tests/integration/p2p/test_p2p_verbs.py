"""Mooncake's P2P verbs on raw memory: register, get_replica, list, unregister, delete_replica."""

import numpy as np
import pytest

from kvplane.common.errors import InvalidArgument, NotFound
from kvplane.p2p import MooncakeP2PStore
from tests.support.p2p_nodes import TOKEN

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def test_register_get_replica_and_withdraw(tracker):
    src = [np.random.default_rng(i).integers(0, 255, n, dtype=np.uint8) for i, n in
           enumerate((3 << 20, 12345))]
    dst = [np.zeros_like(a) for a in src]
    with MooncakeP2PStore(tracker.url, token=TOKEN) as seed, \
            MooncakeP2PStore(tracker.url, token=TOKEN) as peer, \
            MooncakeP2PStore(tracker.url, token=TOKEN) as third:
        v = seed.register("ckpt", [a.ctypes.data for a in src], [a.nbytes for a in src],
                          max_shard_size=1 << 20)
        assert v == 1
        assert peer.get_replica("ckpt", [a.ctypes.data for a in dst], [a.nbytes for a in dst]) == 1
        assert all(np.array_equal(a, b) for a, b in zip(src, dst))
        [info] = seed.list("ck")
        assert info["name"] == "ckpt" and info["versions"][0]["chunks"] == 4
        seed.unregister("ckpt")  # only the replica serves now
        out = [np.zeros_like(a) for a in src]
        third.get_replica("ckpt", [a.ctypes.data for a in out], [a.nbytes for a in out])
        assert all(np.array_equal(a, b) for a, b in zip(src, out))
        peer.delete_replica("ckpt")
        third.delete_replica("ckpt")
        assert tracker.status("ckpt")["holders"] == []
        with pytest.raises(NotFound):  # nobody holds the chunks any more
            peer.get_replica("ckpt", [a.ctypes.data for a in dst], [a.nbytes for a in dst],
                             timeout=10)
        with pytest.raises(InvalidArgument):
            seed.register("x", [1], [])
