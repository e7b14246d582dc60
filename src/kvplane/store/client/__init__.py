"""Store clients: the blocking core (``client.StoreClient``) and its asyncio facade.

The client is built in layers; a module may import only modules of the groups before its own
(``tests/unit/test_layering.py`` enforces it, and that every module of the client and of the
host package is listed here). Read from the bottom up::

    timing, suspects, staging, location_cache, spares, grants   leaves: no client imports
    link                                                       the master link
    context                                                    ClientContext: shared state
    replica_io                                                 transfers to and from replicas
    lookup                                                     GetReplicaList and its answer
    read_through, reservations                                 SSD read-through; PutStart
    get_path, put_path, ranges, replica_ops, host.*            the paths (and segment hosting)
    client                                                     the StoreClient facade
    aio                                                        its asyncio facade

A new read path goes in the paths group, built on ``lookup``/``read_through`` and
``replica_io``; the facade only calls it.
"""

LAYERS: tuple[tuple[str, ...], ...] = (
    ("kvplane.store.client.timing", "kvplane.store.client.suspects",
     "kvplane.store.client.staging", "kvplane.store.client.location_cache",
     "kvplane.store.client.spares", "kvplane.store.client.grants"),
    ("kvplane.store.client.link",),
    ("kvplane.store.client.context",),
    ("kvplane.store.client.replica_io",),
    ("kvplane.store.client.lookup",),
    ("kvplane.store.client.read_through", "kvplane.store.client.reservations"),
    ("kvplane.store.client.get_path", "kvplane.store.client.put_path",
     "kvplane.store.client.ranges", "kvplane.store.client.replica_ops",
     "kvplane.store.host", "kvplane.store.host.segment", "kvplane.store.host.repairs",
     "kvplane.store.host.adoption", "kvplane.store.host.disk_node"),
    ("kvplane.store.client.client",),
    ("kvplane.store.client.aio",),
)
