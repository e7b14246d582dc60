"""A heartbeat still out when ``StoreClient.close()`` gives up waiting for it (a slow master)
must not write into the segment's memory afterwards: close() releases the memory, and a late
answer's forgotten headers were written into it (a segfault of the test process in a full run,
test_shard_moves)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from kvplane.store import MasterServer
from kvplane.store.client.client import StoreClient
from kvplane.store.master.config import MasterConfig
from kvplane.store.types import PingRep

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def test_a_ping_answered_after_close_gave_up_on_it_touches_no_memory(monkeypatch):
    with MasterServer(MasterConfig(), admin_port=None) as m:
        c = StoreClient(master=f"127.0.0.1:{m.port}", protocol="tcp", timeout=10.0,
                        global_segment_size=1 << 20, local_buffer_size=0,
                        heartbeat_interval=0.1)
        out, answer = threading.Event(), threading.Event()
        real = c.rpc.call
        late: list[str] = []

        def call(method: str, *a: Any, **kw: Any) -> Any:
            if method != "ping":
                return real(method, *a, **kw)
            out.set()
            answer.wait(30)  # a master that answers late
            return PingRep("ok", 0, forgets=[(7, c.context.segments[0].base)])

        real_forget = c.holdings.forget
        closed = threading.Event()  # set when close() has returned

        def forget(forgets: list[tuple[int, int]]) -> list[int]:
            if closed.is_set():  # too late: the memory is gone (do not write: it would crash)
                late.append("forget after close")
                return []
            return real_forget(forgets)

        def close() -> None:
            c.close()
            closed.set()

        monkeypatch.setattr(c.rpc, "call", call)
        monkeypatch.setattr(c.holdings, "forget", forget)
        assert out.wait(10)  # a ping is out
        closer = threading.Thread(target=close)
        closer.start()
        closer.join(3)  # past close()'s wait for the heartbeat thread (1.1 s)
        answer.set()  # the late answer arrives
        closer.join(10)
        assert closed.is_set()
        c._hb.join(10)
        assert not c._hb.is_alive()
        assert not late
