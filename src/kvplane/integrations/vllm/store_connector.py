"""KVPlaneStoreConnector: kvplane as vLLM's shared KV pool (vLLM v1 connector API, vLLM >= 0.32).

Imports vLLM at module import; ``kvplane.integrations.vllm`` loads this module only when vLLM's
connector factory asks for the class. Nothing else in kvplane imports it.

Scheduler side (EngineCore process): looks a prompt's block-hash chain up in the store
(``batch_exists``), grants the leading run of stored blocks to vLLM, and plans per step which
blocks the workers load and which freshly computed prompt blocks they save.
Worker side: registers the paged KV tensors once with the store client, loads granted blocks with
``batch_get_into`` straight into the paged cache before the forward, and hands saves
(``batch_put_from`` straight from the cache) to a background thread. A block that fails to load is
reported through ``get_block_ids_with_load_errors``; with ``kv_load_failure_policy="recompute"``
vLLM recomputes it. A request whose prompt blocks are being saved keeps its blocks until the
save is done (``request_finished`` -> True, reported back by ``get_finished``).
KV caches in device memory (CUDA tensors) move through registered host staging by address
(:mod:`kvplane.integrations.vllm.staged`): saves are copied off the device layer by layer as
``save_kv_layer`` reports each layer computed, loads land in device memory before the forward
(or layer by layer with ``layerwise_load``); a failed device copy is a failed load or save.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvplane.common.errors import KVPlaneError
from kvplane.integrations.vllm.config import ConnectorConfig, tp_rank
from kvplane.integrations.vllm.layout import KVLayout, worker_layout
from kvplane.integrations.vllm.plan import (
    KeySpace,
    LoadJob,
    SaveJob,
    StepPlan,
    blocks_present,
    load_job,
    loadable_blocks,
    matched_tokens,
    save_span,
)
from kvplane.integrations.vllm.saver import BackgroundSaver, SaveStats
from kvplane.integrations.vllm.staged import LoadOutcome, StagedKV, open_staging
from kvplane.store.client.client import StoreClient
from kvplane.store.config import StoreConfig

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

# a child of vLLM's logger, so these lines appear in vLLM's own log stream
log = logging.getLogger("vllm.kvplane.store_connector")


class KVPlaneStoreMetadata(KVConnectorMetadata):
    """The per-step plan the scheduler sends to the workers."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


@dataclass
class _Tracked:
    request: Any
    block_ids: list[int] = field(default_factory=list)
    saved: int = 0  # prompt blocks [0, saved) are stored or queued


def key_space(vllm_config: VllmConfig, cfg: ConnectorConfig, layer_names: list[str],
              tp_rank: int) -> KeySpace:
    """The key namespace of this engine's KV (model, dtype, block size, TP shard)."""
    cache = vllm_config.cache_config
    dtype = cache.cache_dtype
    if dtype == "auto":
        dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
    return KeySpace(cfg.model_prefix(vllm_config.model_config.model), dtype, cache.block_size,
                    len(layer_names), tp_rank, vllm_config.parallel_config.tensor_parallel_size)


def store_client(cfg: ConnectorConfig, contribute: bool) -> StoreClient:
    """A store client for one connector role (only workers contribute a segment)."""
    return StoreClient(StoreConfig.from_env(
        master=cfg.master_server_address, metadata=cfg.metadata_server,
        local_hostname=cfg.local_hostname, protocol=cfg.protocol,
        global_segment_size=cfg.global_segment_size if contribute else 0,
        local_buffer_size=cfg.local_buffer_size, token=cfg.token, timeout=cfg.timeout))


class KVPlaneStoreConnector(KVConnectorBase_V1):
    """vLLM KV connector backed by the kvplane store.

    Args:
        vllm_config: the engine config; ``kv_transfer_config.kv_connector_extra_config`` holds
            Mooncake-named settings (see ``ConnectorConfig``).
        role: SCHEDULER (EngineCore) or WORKER.
        kv_cache_config: the KV cache layout (layer names, block count).
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        tcfg = vllm_config.kv_transfer_config
        self.cfg = ConnectorConfig.from_sources(tcfg.kv_connector_extra_config, os.environ)
        self.can_load = bool(tcfg.is_kv_consumer)
        self.can_save = bool(tcfg.is_kv_producer)
        if self.can_load and tcfg.kv_load_failure_policy != "recompute":
            log.warning("kvplane: kv_load_failure_policy=%r fails a request whose KV load fails; "
                        "set it to 'recompute' to recompute instead", tcfg.kv_load_failure_policy)
        self._layer_names = list(kv_cache_config.kv_cache_groups[0].layer_names)
        worker = role == KVConnectorRole.WORKER
        rank = tp_rank() if worker else 0
        self.space = key_space(vllm_config, self.cfg, self._layer_names, rank)
        self.client = store_client(self.cfg, contribute=worker)
        # scheduler state
        self._lookups: dict[str, int] = {}
        self._tracked: dict[str, _Tracked] = {}
        self._loads: list[LoadJob] = []
        self._saving: set[str] = set()
        # worker state
        self._layout: KVLayout | None = None
        self._staged: StagedKV | None = None
        self._layer_index = {name: i for i, name in enumerate(self._layer_names)}
        self._saver: BackgroundSaver | None = None
        self._finishing: set[str] = set()
        self._load_errors: set[int] = set()
        self.loaded_blocks = 0
        log.info("kvplane store connector (%s, role %s) on master %s, keys %s/...",
                 role.name, tcfg.kv_role, self.cfg.master_server_address, self.space.root)

    # == scheduler side =========================================================================
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens past ``num_computed_tokens`` stored in kvplane (loaded synchronously)."""
        if not self.can_load:
            return 0, False
        bs = self.space.block_size
        last = loadable_blocks(request.num_prompt_tokens, len(request.block_hashes), bs)
        first = num_computed_tokens // bs
        if last <= first:
            return 0, False
        # every rank's shard of a block must be stored (each worker loads its own)
        keys = [k for ks in self.space.every_rank_keys(request.block_hashes[first:last])
                for k in ks]
        try:
            found = self.client.batch_exists(keys)
        except KVPlaneError as exc:
            log.warning("kvplane lookup failed, treating as a miss: %s", exc)
            return 0, False
        per_block = self.space.num_layers * self.space.tp_size
        hit = matched_tokens(blocks_present(found, per_block), first, num_computed_tokens, bs)
        self._lookups[request.request_id] = num_computed_tokens
        if hit:
            log.info("kvplane: request %s matched %d tokens in the store (after %d local)",
                     request.request_id, hit, num_computed_tokens)
        return hit, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        rid = request.request_id
        st = self._tracked.setdefault(rid, _Tracked(request))
        if num_external_tokens <= 0:
            return
        computed = self._lookups.get(rid, 0)
        job = load_job(rid, blocks.get_block_ids()[0], request.block_hashes, computed,
                       num_external_tokens, self.space)
        if job is not None:
            self._loads.append(job)
            st.saved = max(st.saved, (computed + num_external_tokens) // self.space.block_size)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        so = scheduler_output
        plan = StepPlan(loads=self._loads, preempted=sorted(so.preempted_req_ids or ()))
        self._loads = []
        if self.can_save:
            for new in so.scheduled_new_reqs:
                st = self._tracked.get(new.req_id)
                if st is not None:
                    st.block_ids = list(new.block_ids[0])
                    self._plan_save(plan, new.req_id, st, new.num_computed_tokens +
                                    so.num_scheduled_tokens.get(new.req_id, 0))
            cached = so.scheduled_cached_reqs
            for i, rid in enumerate(cached.req_ids):
                st = self._tracked.get(rid)
                if st is None:
                    continue
                new_ids = cached.new_block_ids[i]
                if rid in cached.resumed_req_ids:
                    st.block_ids = list(new_ids[0]) if new_ids else []
                elif new_ids:
                    st.block_ids.extend(new_ids[0])
                self._plan_save(plan, rid, st, cached.num_computed_tokens[i] +
                                so.num_scheduled_tokens.get(rid, 0))
        return KVPlaneStoreMetadata(plan)

    def _plan_save(self, plan: StepPlan, rid: str, st: _Tracked, computed_after: int) -> None:
        req = st.request
        a, b = save_span(st.saved, computed_after, req.num_prompt_tokens, len(req.block_hashes),
                         len(st.block_ids), self.space.block_size)
        if b > a:
            plan.saves.append(SaveJob(rid, st.block_ids[a:b], self.space.keys(req.block_hashes[a:b])))
            st.saved = b
            self._saving.add(rid)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Hold the blocks while a save of this request is in flight on the worker."""
        rid = request.request_id
        self._tracked.pop(rid, None)
        self._lookups.pop(rid, None)
        held = rid in self._saving
        self._saving.discard(rid)
        return held, None

    # == worker side ============================================================================
    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Layer-wise loads wait in ``wait_for_layer_load``, which a full CUDA graph skips."""
        return ConnectorConfig.from_sources(extra_config, os.environ).layerwise_load

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Register the paged KV memory once: host memory as addresses for zero-copy loads and
        saves; device memory through host staging (``StagedKV``), never a host view of it.

        Raises:
            InvalidArgument: a layout whose blocks are not one contiguous run or whose block
                interior is not ``[H, N, C]``, a device kvplane cannot copy, or a
                ``device_staging_size`` too small for one page.
        """
        self._layout = worker_layout(kv_caches, self._layer_names)
        if self._layout.device:
            staging = open_staging(self._layout, self.client.register_buffer,
                                   self.cfg.device_staging_size)
            self._staged = StagedKV(self._layout, staging, self.cfg.timeout,
                                    self.cfg.layerwise_load)
        else:
            self._layout.register(self.client.register_buffer)
        self._saver = BackgroundSaver(self.client.batch_put_from, self.cfg.save_queue_size,
                                      name=f"kvplane-saver-{os.getpid()}")
        log.info("kvplane: registered %d KV regions on %s (%d layers, %d B per block-layer)",
                 len(self._layout.regions), self._layout.device or "host",
                 self._layout.num_layers,
                 self._layout.layers[0].block_bytes if self._layout.layers else 0)

    @property
    def kv_layout(self) -> KVLayout | None:
        """Where the registered KV pages live (None before ``register_kv_caches``)."""
        return self._layout

    @property
    def save_stats(self) -> SaveStats | None:
        """The background saver's counters (None before ``register_kv_caches``)."""
        return self._saver.stats if self._saver is not None else None

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        plan = getattr(connector_metadata, "plan", None)
        if isinstance(plan, StepPlan) and self.space.tp_rank:
            # the scheduler plans in rank 0's keys: this worker stores and loads its own shard
            plan = plan.for_rank(self.space)
            connector_metadata = KVPlaneStoreMetadata(plan)
        super().bind_connector_metadata(connector_metadata)
        if plan is not None and plan.preempted and self._saver is not None:
            # preempted blocks are reused this step: finish reading them first
            if not self._saver.drain(self.cfg.timeout):
                log.warning("kvplane: saves still running after preemption")

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Load this step's granted blocks into the paged cache (before the forward)."""
        meta = self._get_connector_metadata()
        if self._layout is None or not isinstance(meta, KVPlaneStoreMetadata):
            return
        if self._staged is not None:
            self._loaded(self._staged.start_loads(meta.plan.loads, self.client.batch_get_into))
            return
        for job in meta.plan.loads:
            self._load(job)

    def _loaded(self, outcome: LoadOutcome | None) -> None:
        if outcome is not None:
            self._load_errors.update(outcome.failed)
            self.loaded_blocks += outcome.loaded

    def _load(self, job: LoadJob) -> None:
        assert self._layout is not None
        L = self._layout.num_layers
        keys = [k for ks in job.keys for k in ks]
        addrs, sizes = self._layout.block_addrs(job.block_ids)
        try:
            got: list[int | KVPlaneError] = self.client.batch_get_into(keys, addrs, sizes)
        except KVPlaneError as exc:
            log.warning("kvplane load of %s failed: %s", job.req_id, exc)
            got = [exc] * len(keys)
        bad = [b for i, b in enumerate(job.block_ids)  # an exception never equals a size
               if any(got[i * L + j] != sizes[i * L + j] for j in range(L))]
        self._load_errors.update(bad)
        self.loaded_blocks += len(job.block_ids) - len(bad)
        if bad:
            log.warning("kvplane: %d of %d blocks of %s failed to load; vLLM recomputes them",
                        len(bad), len(job.block_ids), job.req_id)
        else:
            log.info("kvplane: loaded %d blocks of %s", len(job.block_ids), job.req_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """With ``layerwise_load`` on device memory: wait until this layer's loads are copied."""
        layer = self._layer_index.get(layer_name)
        if self._staged is not None and layer is not None:
            self._staged.wait_layer(layer)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """On device memory: start copying this layer's pages of this step's saves to the host
        (the layer has just been computed). Host memory needs nothing here."""
        layer = self._layer_index.get(layer_name)
        if self._staged is None or layer is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if isinstance(meta, KVPlaneStoreMetadata):
            self._staged.save_layer(layer, meta.plan.saves)

    def wait_for_save(self) -> None:
        """Queue this step's saves on the background thread; never waits for them."""
        meta = self._get_connector_metadata()
        if self._layout is None or self._saver is None or not isinstance(meta, KVPlaneStoreMetadata):
            return
        if self._staged is not None:
            self._loaded(self._staged.finish_loads())  # layers vLLM never waited for
            self._staged.submit_saves(meta.plan.saves, self._saver)
            return
        for job in meta.plan.saves:
            addrs, sizes = self._layout.block_addrs(job.block_ids)
            self._saver.submit(job.req_id, [k for ks in job.keys for k in ks], addrs, sizes)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Report finished requests whose saves are done (their blocks may now be freed)."""
        if self._saver is None:
            return None, None
        self._finishing |= {r for r in finished_req_ids if self._saver.known(r)}
        done = {r for r in self._finishing if self._saver.pending(r) == 0}
        self._finishing -= done
        self._saver.forget(done)
        return (done or None), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._staged is not None:
            self._loaded(self._staged.finish_loads())
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        """Finish queued saves, then release the store client (idempotent)."""
        if self._saver is not None:
            self._saver.close(self.cfg.timeout)
        if self._staged is not None:
            self._staged.staging.close(self.client.unregister_buffer)
            self._staged = None
        self.client.close()
