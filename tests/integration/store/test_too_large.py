"""A value larger than any segment (issue 28, finding 6) fails at once with an error that says
it can never fit and names the largest segment, instead of evicting, retrying and timing out."""

from __future__ import annotations

import time

import pytest

from kvplane.store.client.client import FENCE_WORD, StoreClient
from kvplane.store.errors import NoAvailableHandle, ValueTooLarge
from tests.support.store_procs import spawn_master, spawn_segment

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
MB = 1 << 20


def test_a_value_larger_than_the_pool_fails_at_once_saying_it_can_never_fit():
    with spawn_master() as m, spawn_segment(m.info["master"], "4MiB"), \
            spawn_segment(m.info["master"], "4MiB"), \
            StoreClient(master=m.info["master"], protocol="tcp", timeout=5.0) as c:
        c.put("small", b"s" * 1000)
        value = b"x" * (16 * MB)
        t0 = time.monotonic()
        with pytest.raises(NoAvailableHandle) as got:
            c.put("huge", value)
        took = time.monotonic() - t0
        print(f"failed in {took:.3f} s: {got.value!r}")
        assert isinstance(got.value, ValueTooLarge) and not got.value.retryable
        msg = str(got.value)
        assert f"value of {16 * MB} bytes can never fit" in msg, msg
        assert f"the largest segment is {4 * MB - FENCE_WORD} bytes" in msg, msg  # its fence word
        assert took < 1.0, took  # the deadline is 5 s
        assert c.get("small") == b"s" * 1000  # nothing was evicted for it
