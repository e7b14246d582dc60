import asyncio

import pytest

from kvplane.store import AsyncStoreClient, MasterServer, StoreClient
from kvplane.store.errors import ObjectNotFound

pytestmark = [pytest.mark.integration, pytest.mark.timeout(30)]


def test_async_facade():
    with MasterServer(admin_port=None) as m:
        addr = f"127.0.0.1:{m.port}"
        with StoreClient(master=addr, global_segment_size=4 << 20) as seg:
            ac = AsyncStoreClient(StoreClient(master=addr))

            async def go():
                assert await ac.put("a", b"1") is None
                got = await asyncio.gather(*(ac.get("a") for _ in range(8)))
                assert got == [b"1"] * 8
                assert await ac.exists("a") is True
                with pytest.raises(ObjectNotFound):
                    await ac.get("missing")
                with pytest.raises(AttributeError):
                    ac.no_such_method  # noqa: B018
                await ac.close()

            asyncio.run(go())
            seg.health_check()
