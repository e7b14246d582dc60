"""This repository's test harnesses (not shipped): the scenario drivers that start real processes.

Real processes: ``store_procs`` / ``store_client_proc`` (master, segments, clients),
``services`` (etcd, Redis), ``target`` (a transfer-engine target), ``ranks`` (collectives
ranks), ``p2p_proc`` (a P2P node driven by JSON lines), ``vllm_harness`` / ``vllm_engine_proc``
(a real vLLM engine in its own venv), ``engines_harness`` with ``sglang_proc`` / ``lmcache_proc``
(SGLang and LMCache in the engines venv), ``mooncake_real`` (real Mooncake's master).

Fake engines: ``fake_vllm`` (a fake vLLM OpenAI server with vLLM's metrics, tokenizer endpoint
and KV events, scripted faults; ``router_over_fakes`` puts a ``kvplane router`` in front).

Many hosts on one machine: ``netns`` (network namespaces on a bridge, link caps, partitions;
the ``netbed`` fixture; docs/testbed.md) and ``netprobe`` (sink, timed sender, connect check).
A headless browser: ``browser``. Hostile peers: ``hostile``.

Entry modules run as ``python -m tests.support.X``: the repo root must be on the child's path
(tests/conftest.py puts it on PYTHONPATH; benchmarks run from the repo root). The reusable
fakes (fault plan, in-memory transport and RPC) stay in the package, ``kvplane.testing``; this
package may import them, never the other way round.
"""
