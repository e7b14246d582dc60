"""Hand-made cluster states for policy tests, read through the real conductor prefix index."""

from __future__ import annotations

from kvplane.conductor.indexer import PrefixIndex
from kvplane.conductor.scheduling.config import ClusterConfig, ModelConfig, PolicyConfig
from kvplane.conductor.scheduling.policy import create_policy
from kvplane.conductor.scheduling.prefix import POOL, IndexPrefixes
from kvplane.conductor.scheduling.timemodel import TimeModel
from kvplane.conductor.scheduling.view import ClusterView, DecodeLoad, PrefillLoad, Request
from kvplane.kvevents import Tier

TM = TimeModel(ModelConfig(), ClusterConfig())
CAP = ModelConfig().decode_kv_capacity_tokens


def req(hashes, input_length=None, rid=0, output_length=100):
    """A request whose prompt is exactly ``len(hashes)`` full blocks unless told otherwise."""
    hashes = tuple(hashes)
    return Request(rid, 0.0, input_length or 512 * len(hashes), output_length, hashes)


def view(queues, gpu=None, cpu=None, pool=None, decode=None, now=0.0):
    """Prefill instances p0..pN with queue times ``queues``; ``gpu``/``cpu``: inst -> hashes held."""
    names = [f"p{i}" for i in range(len(queues))]
    idx = PrefixIndex()
    src = IndexPrefixes(idx, names, pool=pool is not None)
    for tier, held in ((Tier.GPU, gpu or {}), (Tier.CPU, cpu or {})):
        for inst, hashes in held.items():
            src.store(inst, tier, hashes)
    if pool:
        src.store(POOL, Tier.DISK, pool)
    loads = [PrefillLoad(n, queue_s=q, queued=int(q > 0), cached_blocks=len((gpu or {}).get(n, ())),
                         gpu_capacity_blocks=1000) for n, q in zip(names, queues)]
    decode = decode if decode is not None else [DecodeLoad("d0", kv_capacity=CAP, max_batch=256),
                                                 DecodeLoad("d1", kv_capacity=CAP, max_batch=256)]
    return ClusterView(now, loads, decode, src)


def policy(name, seed=0, **knobs):
    return create_policy(name, PolicyConfig(**knobs), TM, seed)
