"""Store clients: the blocking core (``client.StoreClient``) and its asyncio facade."""
