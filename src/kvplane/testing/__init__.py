"""Test kit shipped with kvplane (imported by tests and benchmarks, never by the product).

``auth.headers()`` gives the local token for HTTP calls to services the tests started.

Real processes: ``procs`` (spawn, wait for a ready line, kill), ``services`` (etcd, Redis),
``store_procs`` / ``store_client_proc`` (master, segments, clients), ``ranks`` (collectives
ranks), ``vllm_harness`` / ``vllm_engine_proc`` (a real vLLM engine in its own venv;
``OpenAIServer``: a real vLLM OpenAI server), ``p2p_proc`` (a P2P node driven by JSON lines).

Fake engines: ``fake_vllm`` (a fake vLLM OpenAI server with vLLM's metrics, tokenizer endpoint
and KV events, scripted faults; ``router_over_fakes`` puts a ``kvplane router`` in front).

Many hosts on one machine: ``netns`` (network namespaces on a bridge, link caps, partitions;
the ``netbed`` fixture; docs/testbed.md) and ``netprobe`` (sink, timed sender, connect check).

In memory, with scripted faults from a seeded ``faults.FaultPlan`` (drop, delay, fail, corrupt,
disconnect after N; per peer and op):

* ``mem_transport``    the ``mem`` transport for the TransferEngine registry (``MemFabric``);
* ``mem_rpc``          a control RPC with ``RpcServer``/``RpcClient``'s surface;
* ``fake_data_socket`` the far side of a TCP data connection (for ``transports.tcp.Conn``);
* ``mesh_peers``       scripted peers of a collectives ``Mesh`` over socketpairs.
"""

from kvplane.testing.procs import Proc, spawn_target, wait_for_line

__all__ = ["Proc", "spawn_target", "wait_for_line"]
