"""The SSD tier with tenants: disk files keep the tenant-scoped key, a tenant reads its own
disk-only objects, and a disk node serves nothing without the master's ticket."""

from __future__ import annotations

import os

import pytest

from kvplane.common.errors import Unauthorized
from kvplane.common.rpc import RpcClient
from kvplane.store import MasterServer, StoreClient
from kvplane.store.disk import layout
from kvplane.store.master.access import scoped
from kvplane.store.tier_types import DiskSyncReq, LoadRep, LoadReq
from kvplane.store.types import KeysReq, ResultsRep
from tests.support.services import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]
SVC, ADM = "service-token-0123456789", "admin-token-0123456789"
TOK = {"a": "tenant-a-token-0123456789", "b": "tenant-b-token-0123456789"}
MB = 1 << 20


def test_tenants_read_their_disk_objects_and_only_theirs(tmp_path):
    with MasterServer(token=SVC, admin_token=ADM, tenants=TOK) as m:
        addr = f"127.0.0.1:{m.port}"
        with StoreClient(master=addr, token=SVC, global_segment_size=8 * MB,
                         peer_tokens=tuple(TOK.values()), disk_dir=str(tmp_path),
                         disk_size=256 * MB) as seg, \
                StoreClient(master=addr, token=TOK["a"], protocol="tcp", timeout=10) as a, \
                StoreClient(master=addr, token=TOK["b"], protocol="tcp", timeout=10) as b:
            values = {f"t-{i}": os.urandom(MB // 2) for i in range(40)}  # 20 MiB into 8
            for k, v in values.items():
                a.put(k, v)
            wait_until(lambda: sum(1 for o in m.state.objects.values() if o.disk) >= 20, 20,
                       "objects on disk")
            cold = next(k for k in values if not m.state.objects[scoped("a", k)].replicas)
            assert layout.read_header(layout.path_of(tmp_path, scoped("a", cold)),
                                      seg.disk.store.secret).key == scoped("a", cold)
            assert not layout.path_of(tmp_path, cold).exists()  # the scoped key, not the bare one
            assert a.get(cold) == values[cold]
            assert not b.exists(cold)
            r = a.rpc.call("get_replicas", KeysReq(a.config.client_id, [cold]), ResultsRep)
            disk = r.results[0].disk[0]
            version = r.results[0].version
            with RpcClient(disk.endpoint, token=TOK["b"]) as link:  # tenant b, no ticket
                rep = link.call("load", LoadReq([disk.key], [version], True), LoadRep)
                assert rep.codes[0] < 0 and not any(rep.data)
                forged = LoadReq([disk.key], [version], True, [bytes(16)])
                assert link.call("load", forged, LoadRep).codes[0] < 0
                good = LoadReq([disk.key], [version], True, [disk.ticket])
                assert link.call("load", good, LoadRep).codes == [0]  # a ticket is the grant
            with RpcClient(addr, token=TOK["b"]) as other, pytest.raises(Unauthorized):
                other.call("disk_sync", DiskSyncReq(seg.config.client_id), object)


def test_a_node_on_the_admin_token_keys_its_files_with_the_masters_key(tmp_path):
    with MasterServer(token=SVC, admin_token=ADM) as m:
        addr = f"127.0.0.1:{m.port}"
        with StoreClient(master=addr, token=ADM, global_segment_size=8 * MB, peer_tokens=(SVC,),
                         disk_dir=str(tmp_path), disk_size=256 * MB) as seg, \
                StoreClient(master=addr, token=SVC, protocol="tcp", timeout=10) as c:
            values = {f"adm-{i}": os.urandom(MB // 2) for i in range(40)}  # 20 MiB into 8
            for k, v in values.items():
                c.put(k, v)
            assert seg.disk.store.usage()["files"] >= 20 and seg.disk.store.foreign == 0
            assert all(c.get(k) == v for k, v in values.items())
