"""Test kit shipped with kvplane: reusable fakes and a pytest plugin (never imported by the product).

In memory, with scripted faults from a seeded ``faults.FaultPlan`` (drop, delay, fail, corrupt,
disconnect after N; per peer and op):

* ``mem_transport``    the ``mem`` transport for the TransferEngine registry (``MemFabric``);
* ``mem_rpc``          a control RPC with ``RpcServer``/``RpcClient``'s surface;
* ``fake_data_socket`` the far side of a TCP data connection (for ``transports.tcp.Conn``);
* ``mesh_peers``       scripted peers of a collectives ``Mesh`` over socketpairs.

``needs`` names outside prerequisites (etcd, Redis, torch...) and skips (under ``CI``: fails)
when one is missing; ``plugin`` is the pytest plugin (entry point ``kvplane`` in ``pytest11``)
that gives the ``requires`` marker and the ``fault_plan`` fixture.

Importing this package imports neither pytest nor any kvplane component; the modules import
only what they fake. The harnesses that drive real processes, browsers, namespaces and engines
are this repository's, in ``tests/support``; nothing here imports them.
"""
