"""StagedKV: the store connector's worker side for KV caches in device memory.

vLLM hands ``register_kv_caches`` its paged KV; on a GPU those are CUDA tensors. The store holds
objects in host segments and checks their bytes on the host, so each (block, layer) page moves
through the host staging of :mod:`kvplane.integrations.device_kv`, by address:

* saves: the slots for a step's saves are reserved at the first ``save_kv_layer`` of the step;
  each ``save_kv_layer`` then starts the device -> slot copies of that layer's pages (the layer
  has just been computed, so the copies overlap the rest of the forward), ``wait_for_save``
  copies whatever no ``save_kv_layer`` covered and queues the puts on the background saver,
  which waits for the copies before it stores the slots. A save whose slots are not free is
  dropped and counted, like a save beyond the queue (a future miss).
* loads: ``start_load_kv`` reads the step's granted pages into load slots (one
  ``batch_get_into``), then starts the slot -> device copies, one batch per layer with
  ``layerwise_load`` (``wait_for_layer_load`` waits for that layer's), else one batch it waits
  for at once. A page whose read or copy failed marks its block failed: reported through
  ``get_block_ids_with_load_errors`` as for host memory, so vLLM recomputes it.

Imports neither vLLM nor torch (the copier does; unit-tested with a stand-in device).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvplane.common.errors import InvalidArgument
from kvplane.integrations.device_kv import (
    DeviceStaging,
    FetchFn,
    PendingLoad,
    StagedSave,
    copier_for,
)
from kvplane.integrations.vllm.layout import KVLayout
from kvplane.integrations.vllm.plan import LoadJob, SaveJob
from kvplane.integrations.vllm.saver import BackgroundSaver

log = logging.getLogger("vllm.kvplane.staged")


@dataclass
class LoadOutcome:
    """The blocks one step's loads filled and the ones that failed."""

    loaded: int = 0
    failed: set[int] = field(default_factory=set)


class StagedKV:
    """Saves and loads of device-memory KV through host staging.

    Args:
        layout: the worker's KV layout (device regions).
        staging: the device's staging (slots registered with the store client).
        timeout: seconds a copy may take before its pages count as failed.
        layerwise_load: copy loads layer by layer (``wait_for_layer_load`` waits per layer).
    """

    def __init__(self, layout: KVLayout, staging: DeviceStaging, timeout: float,
                 layerwise_load: bool = False) -> None:
        self.layout, self.staging, self.timeout = layout, staging, timeout
        self.layerwise_load = layerwise_load
        self._saves_for: Sequence[SaveJob] | None = None
        self._staged: list[StagedSave | None] = []
        self._load: PendingLoad | None = None
        self._load_jobs: list[LoadJob] = []

    # -- saves -------------------------------------------------------------------------------------
    def _reserve(self, saves: Sequence[SaveJob]) -> None:
        if self._saves_for is saves:
            return
        self._saves_for = saves
        self._staged = []
        for job in saves:
            addrs, sizes = self.layout.block_addrs(job.block_ids)
            self._staged.append(self.staging.save(addrs, sizes))

    def save_layer(self, layer: int, saves: Sequence[SaveJob]) -> None:
        """Start the device -> slot copies of layer ``layer`` of this step's saves."""
        if not saves:
            return
        self._reserve(saves)
        L = self.layout.num_layers
        for job, staged in zip(saves, self._staged):
            if staged is not None:
                staged.copy([i * L + layer for i in range(len(job.block_ids))])

    def submit_saves(self, saves: Sequence[SaveJob], saver: BackgroundSaver) -> None:
        """Queue this step's saves: the saver waits for their copies, then stores the slots."""
        if not saves:
            return
        self._reserve(saves)
        for job, staged in zip(saves, self._staged):
            keys = [k for ks in job.keys for k in ks]
            if staged is None:
                saver.drop(job.req_id, len(keys), f"{len(keys)} pages exceed the free staging "
                           f"slots on {self.staging.device}")
                continue
            staged.copy(range(len(keys)))
            saver.submit(job.req_id, keys, staged.slots, staged.sizes,
                         prepare=functools.partial(staged.ready, self.timeout), done=staged.release)
        self._saves_for, self._staged = None, []

    # -- loads -------------------------------------------------------------------------------------
    def start_loads(self, loads: Sequence[LoadJob], fetch: FetchFn) -> LoadOutcome | None:
        """Read this step's loads into slots and start their copies to the device.

        Returns the outcome when the loads are already complete (not layer-wise, or chunked),
        else None (see :meth:`wait_layer` and :meth:`finish_loads`).
        """
        outcome = self.finish_loads()  # a previous step's, if its layers were never waited for
        if outcome.loaded or outcome.failed:
            log.warning("kvplane: an earlier step's loads were finished late")
        if not loads:
            return None
        L = self.layout.num_layers
        keys: list[str] = []
        addrs: list[int] = []
        sizes: list[int] = []
        for job in loads:
            keys += [k for ks in job.keys for k in ks]
            a, s = self.layout.block_addrs(job.block_ids)
            addrs += a
            sizes += s
        groups = [list(range(layer, len(keys), L)) for layer in range(L)] \
            if self.layerwise_load else None
        self._load = self.staging.load(keys, addrs, sizes, fetch, self.timeout, groups)
        self._load_jobs = list(loads)
        return self.finish_loads() if self._load.complete or not self.layerwise_load else None

    def wait_layer(self, layer: int) -> None:
        """Wait until layer ``layer`` of this step's loads is in device memory."""
        if self._load is not None and self.layerwise_load:
            self._load.wait(layer, self.timeout)

    def finish_loads(self) -> LoadOutcome:
        """Wait for every copy of this step's loads; which blocks were filled, which failed."""
        out = LoadOutcome()
        pending, jobs = self._load, self._load_jobs
        self._load, self._load_jobs = None, []
        if pending is None:
            return out
        ok = pending.wait_all(self.timeout)
        L = self.layout.num_layers
        at = 0
        for job in jobs:
            bad = [b for i, b in enumerate(job.block_ids)
                   if not all(ok[at + i * L:at + (i + 1) * L])]
            at += len(job.block_ids) * L
            out.failed.update(bad)
            out.loaded += len(job.block_ids) - len(bad)
            if bad:
                log.warning("kvplane: %d of %d blocks of %s failed to load to %s; vLLM recomputes "
                            "them", len(bad), len(job.block_ids), job.req_id, self.staging.device)
            else:
                log.info("kvplane: loaded %d blocks of %s to %s", len(job.block_ids), job.req_id,
                         self.staging.device)
        if pending.failures:
            log.warning("kvplane: device copies failed: %s", pending.failures[0])
        return out


def open_staging(layout: KVLayout, register: Callable[[Any], int], size: int) -> DeviceStaging:
    """Host staging for ``layout``'s device memory: ``size`` bytes, half load and half save
    slots of one page each, registered with ``register`` (``StoreClient.register_buffer``).

    Raises:
        InvalidArgument: ``size`` holds less than one page per half, or the device has no copier.
    """
    page = max((s.block_bytes for s in layout.layers), default=0)
    half = size // 2 // page if page else 0
    if half < 1:
        raise InvalidArgument(f"device_staging_size {size} B holds no {page} B KV page per half "
                              f"(needs at least {2 * page} B)")
    return DeviceStaging(copier_for(layout.memory), register, page, half, half)
