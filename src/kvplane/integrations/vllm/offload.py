"""KVPlaneOffloadingSpec: kvplane's store as a backend of vLLM's OffloadingConnector.

vLLM >= 0.32 offloads KV through ``OffloadingConnector``, whose medium is an ``OffloadingSpec``
plugin (the seam llm-d's file-system backend uses). This spec puts the offloaded chunks in the
kvplane store, so every instance on the same pool shares them:

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "KVPlaneOffloadingSpec",
        "spec_module_path": "kvplane.integrations.vllm.offload",
        "master_server_address": "127.0.0.1:50051"}}'

The kvplane keys of ``kv_connector_extra_config`` are the store connector's (docs/vllm.md);
OffloadingConnector's own keys (``spec_name``, ``block_size``, ...) are left to it.

Scheduler side (:class:`KVPlaneOffloadingManager`): a lookup the manager cannot answer yet
returns RETRY and joins the request's pending batch; at the end of the scheduler step the batch
goes to the store as one ``batch_exists``, and the next step answers HIT or MISS from it
(answers older than ``ANSWER_TTL_S`` are asked again). The pool evicts on its
own, so the manager keeps no capacity book: stores always "succeed" from its point of view (a
lost store is a later miss).
Worker side (:class:`KVPlaneOffloadingWorker`, in :mod:`.offload_worker`): one object per chunk
and layer, ``batch_put_from`` / ``batch_get_into`` straight from and into the paged KV cache;
loads on the engine's step (before the forward, like ``KVPlaneStoreConnector``), stores on a
background thread.

Limits (vLLM 0.32): one KV-cache group, chunks of one vLLM block (no ``block_size`` above the
engine's), tensor parallel 1. vLLM's OffloadingConnector asserts that every transfer succeeded:
a failed store is reported as done (it is only a later miss), but a load that fails after its
lookup hit (the pool evicted the chunk in between, or the pool is gone) stops the engine. Size
the pool above the working set, or use ``KVPlaneStoreConnector``, which recomputes failed loads.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Collection
from dataclasses import dataclass, field

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    LoadStoreSpec,
    LookupResult,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from kvplane.common.errors import InvalidArgument, KVPlaneError
from kvplane.integrations.vllm.config import ConnectorConfig
from kvplane.integrations.vllm.offload_plan import ObjectNames, namespace
from kvplane.integrations.vllm.store_connector import store_client
from kvplane.store.client.client import StoreClient

log = logging.getLogger("vllm.kvplane.offload")

ANSWER_TTL_S = 1.0  # a lookup answer older than this is asked again


class KVPlaneLoadStoreSpec(LoadStoreSpec):
    """The chunks of one transfer, by vLLM offload key, in the order of the paired block ids."""

    def __init__(self, keys: Collection[OffloadKey]) -> None:
        self.keys = list(keys)

    def __repr__(self) -> str:
        return f"KVPlaneLoadStoreSpec({len(self.keys)} chunks)"


@dataclass
class _Lookups:
    """One request's lookup state: per key (present, when asked), and keys waiting to be asked."""

    answers: dict[OffloadKey, tuple[bool, float]] = field(default_factory=dict)
    want: list[OffloadKey] = field(default_factory=list)


class KVPlaneOffloadingManager(OffloadingManager):
    """Scheduler-side view of the pool: batched lookups at the end of each step, no local
    capacity book.

    Args:
        client: store client (no segment of its own).
        names: object names of the chunks.
    """

    def __init__(self, client: StoreClient, names: ObjectNames) -> None:
        self.client, self.names = client, names
        self._states: dict[str, _Lookups] = {}

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        """Every request offloads its newly computed chunks (vLLM's CHUNK_LEVEL policy)."""
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT or MISS from this request's answer for ``key`` (if younger than ``ANSWER_TTL_S``);
        else RETRY, and the key is asked at the end of this step."""
        st = self._state(req_context)
        got = st.answers.get(key)
        if got is not None and time.monotonic() - got[1] < ANSWER_TTL_S:
            return LookupResult.HIT if got[0] else LookupResult.MISS
        if key not in st.want:
            st.want.append(key)
        return LookupResult.RETRY

    def _state(self, ctx: ReqContext) -> _Lookups:
        st = ctx.get_state(_Lookups)
        if st is None:
            st = _Lookups()
            ctx.set_state(st)
            self._states[ctx.req_id] = st
        return st

    def on_schedule_end(self, context: object) -> None:
        """Ask the store about every request's waiting keys (one ``batch_exists`` per request,
        on the scheduler's thread: one round trip, where a helper thread would wait for the
        GIL behind the busy engine loop). A failed ask answers MISS: a failed read is a miss."""
        for st in self._states.values():
            if not st.want:
                continue
            keys, st.want = st.want, []
            try:
                found = self.names.per_chunk(self.client.batch_exists(self.names.of(keys)))
            except KVPlaneError as exc:
                log.warning("kvplane offload lookup failed, treating as a miss: %s", exc)
                found = [False] * len(keys)
            now = time.monotonic()
            st.answers.update((k, (f, now)) for k, f in zip(keys, found))

    def has_pending_work(self) -> bool:
        """True while a lookup waits for the end of the step."""
        return any(st.want for st in self._states.values())

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        """The chunks to read, in the order vLLM pairs them with its blocks."""
        return KVPlaneLoadStoreSpec(keys)

    def prepare_store(self, keys: Collection[OffloadKey],
                      req_context: ReqContext) -> PrepareStoreOutput | None:
        """Store every offered chunk (the pool drops repeats and evicts on its own)."""
        return PrepareStoreOutput(keys_to_store=list(keys), store_spec=KVPlaneLoadStoreSpec(keys),
                                  evicted_keys=[])

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._states.pop(req_context.req_id, None)

    def reset_cache(self) -> None:
        """Forget every answer (the pool itself is shared and is not emptied)."""
        for st in self._states.values():
            st.answers.clear()

    def shutdown(self) -> None:
        self.client.close()


def connector_config(extra: dict[str, object]) -> ConnectorConfig:
    """The kvplane settings among OffloadingConnector's extra config (its own keys are skipped)."""
    import dataclasses

    fields = {f.name for f in dataclasses.fields(ConnectorConfig)} | {"master", "metadata"}
    return ConnectorConfig.from_sources({k: v for k, v in extra.items() if k in fields}, os.environ)


class KVPlaneOffloadingSpec(OffloadingSpec):
    """OffloadingSpec whose medium is the kvplane store (see the module docstring).

    Raises:
        InvalidArgument: more than one KV-cache group, chunks of several blocks, or TP > 1.
    """

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        if len(config.groups) != 1 or config.cache.blocks_per_chunk != 1:
            raise InvalidArgument("KVPlaneOffloadingSpec: one KV-cache group and chunks of one "
                                  f"block only (got {len(config.groups)} groups, "
                                  f"{config.cache.blocks_per_chunk} blocks per chunk)")
        if config.parallel.world_size != 1:
            raise InvalidArgument("KVPlaneOffloadingSpec: tensor/pipeline parallel 1 only; use "
                                  "KVPlaneStoreConnector for TP > 1")
        self.cfg = connector_config(dict(self.extra_config))
        group = config.groups[0]
        ns = namespace(self.cfg.model_prefix(config.model.name), config.model.dtype,
                       group.tokens_per_block, config.parallel.rank, config.parallel.world_size)
        self.names = ObjectNames(ns, len(group.layer_names))
        self._manager: KVPlaneOffloadingManager | None = None
        self._worker: OffloadingWorker | None = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            self._manager = KVPlaneOffloadingManager(store_client(self.cfg, contribute=False),
                                                     self.names)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            from kvplane.integrations.vllm.offload_worker import KVPlaneOffloadingWorker

            self._worker = KVPlaneOffloadingWorker(store_client(self.cfg, contribute=True),
                                                   kv_caches, self.names, self.cfg.timeout)
        return self._worker
