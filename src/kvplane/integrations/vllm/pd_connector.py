"""KVPlanePDConnector: prefill -> decode KV transfer through the kvplane transfer engine.

Imports vLLM at module import (loaded only by vLLM's connector factory). Nothing else in kvplane
imports it.

Protocol (driven by ``kv_transfer_params``; ``kvplane pd-proxy`` does the choreography):

1. The proxy sends the request to a prefill instance with ``{"do_remote_decode": true}`` and
   ``max_tokens=1``. When it finishes, the prefill scheduler keeps the request's blocks
   (``request_finished`` -> True) and returns, as ``kv_transfer_params``, everything a decoder
   needs: the prefill worker's transfer-engine segment (P2PHANDSHAKE ``host:port``), its
   notification address, each layer's base address and block stride, and the block ids.
2. The proxy sends the same request to a decode instance with those params. Its scheduler grants
   the whole prompt as an asynchronous external load; its worker reads the prefill blocks
   straight into its own registered paged KV blocks with one transfer-engine batch, off the
   forward path, then notifies the prefill worker, which releases the blocks. A failed read is
   reported as invalid blocks, which vLLM recomputes (``kv_load_failure_policy="recompute"``);
   an unclaimed hold expires after ``transfer_timeout``.

Tensor parallelism: every TP rank of the prefill instance holds its own shard (its heads) of the
same blocks, so the params list each rank (``remote_ranks``), decode rank r reads from prefill
rank r and releases it. Different TP sizes on the two sides are not resharded: those requests
are recomputed on the decode side (``PullJob.on_rank``).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import zmq
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvplane.common.errors import KVPlaneError
from kvplane.integrations.vllm.config import ConnectorConfig, tp_rank
from kvplane.integrations.vllm.layout import KVLayout, worker_layout
from kvplane.integrations.vllm.pd_plan import PullJob, params_ok, pull_job, read_requests
from kvplane.transfer import EngineConfig, TransferEngine, TransferStatus

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("vllm.kvplane.pd_connector")


@dataclass
class PDHandshake(KVConnectorHandshakeMetadata):
    """What a worker tells its own scheduler (and, through params, the peers)."""

    segment: str
    notify: str
    layers: list[list[int]]  # [base, block_bytes, num_blocks, block_stride] per layer


@dataclass
class PDMetadata(KVConnectorMetadata):
    """Per-step plan: pulls to start (decode side) and requests now held (prefill side)."""

    pulls: list[PullJob] = field(default_factory=list)
    held: list[str] = field(default_factory=list)


class KVPlanePDConnector(KVConnectorBase_V1):
    """Prefill/decode disaggregation over the kvplane transfer engine (decode pulls).

    Args:
        vllm_config: engine config; ``kv_connector_extra_config`` takes ``ConnectorConfig`` names.
        role: SCHEDULER or WORKER.
        kv_cache_config: the KV cache layout.
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.cfg = ConnectorConfig.from_sources(
            vllm_config.kv_transfer_config.kv_connector_extra_config, os.environ)
        self.block_size = vllm_config.cache_config.block_size
        self._layer_names = list(kv_cache_config.kv_cache_groups[0].layer_names)
        # scheduler state
        self._local: PDHandshake | None = None
        self._ranks: list[PDHandshake] = []  # every prefill worker, in TP rank order
        self._lookups: dict[str, int] = {}
        self._consumed: set[str] = set()
        self._pulls: list[PullJob] = []
        self._held: list[str] = []
        # worker state
        self._lock = threading.Lock()
        self._te: TransferEngine | None = None
        self._layout: KVLayout | None = None
        self._ctx: zmq.Context[Any] | None = None
        self._pull_sock: Any = None
        self._push: dict[str, Any] = {}
        self._pool: cf.ThreadPoolExecutor | None = None
        self._holding: dict[str, float] = {}  # req id -> release deadline
        self._notified: set[str] = set()
        self._finished_seen: set[str] = set()
        self._recv_done: set[str] = set()
        self._recv_failed_blocks: set[int] = set()
        self._errors: set[int] = set()
        self.tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        self.tp_rank = 0
        if role == KVConnectorRole.WORKER:
            self.tp_rank = tp_rank()
            self._start_worker()

    # == worker plumbing ==========================================================================
    def _start_worker(self) -> None:
        c = self.cfg
        self._te = TransferEngine(EngineConfig.from_env(
            host=c.local_hostname, metadata=c.metadata_server, protocol=c.protocol,
            token=c.token, timeout=c.timeout))
        self._ctx = zmq.Context()
        self._pull_sock = self._ctx.socket(zmq.PULL)
        port = self._pull_sock.bind_to_random_port(f"tcp://{c.local_hostname}")
        self._notify_addr = f"tcp://{c.local_hostname}:{port}"
        self._pool = cf.ThreadPoolExecutor(2, thread_name_prefix="kvplane-pd-pull")
        log.info("kvplane PD worker: segment %s, notify %s", self._te.name, self._notify_addr)

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Register the paged KV memory with the transfer engine once (device memory through
        the engine's device path; ``KVLayout.register``)."""
        assert self._te is not None
        self._layout = worker_layout(kv_caches, self._layer_names)
        self._layout.register(self._te.register_memory)

    def get_handshake_metadata(self) -> PDHandshake | None:
        if self._te is None or self._layout is None:
            return None
        return PDHandshake(self._te.name, self._notify_addr,
                           [[s.base, s.block_bytes, s.num_blocks, s.block_stride]
                            for s in self._layout.layers])

    # == scheduler side =========================================================================
    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        """Keep every worker's handshake (vLLM keys them by TP rank)."""
        ranks = [metadata[k] for k in sorted(metadata)]
        self._ranks = [m for m in ranks if isinstance(m, PDHandshake)]
        if len(self._ranks) != len(ranks):
            log.warning("kvplane PD: %d of %d workers sent no kvplane handshake",
                        len(ranks) - len(self._ranks), len(ranks))
        self._local = self._ranks[0] if self._ranks else None

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_prefill") or request.request_id in self._consumed:
            return 0, False
        if not params_ok(params):
            log.warning("kvplane PD: request %s has incomplete kv_transfer_params; computing it "
                        "locally", request.request_id)
            return 0, False
        n = request.num_prompt_tokens - num_computed_tokens
        self._lookups[request.request_id] = num_computed_tokens
        return (n, True) if n > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        params = request.kv_transfer_params or {}
        rid = request.request_id
        if not params.get("do_remote_prefill") or rid in self._consumed:
            return
        self._consumed.add(rid)
        # with nothing to read (a local hit) the job only tells the prefill side to release
        self._pulls.append(pull_job(rid, params, blocks.get_block_ids()[0],
                                    self._lookups.pop(rid, 0), num_external_tokens,
                                    self.block_size))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = PDMetadata(self._pulls, self._held)
        self._pulls, self._held = [], []
        return meta

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """On a prefill instance, hold the blocks and tell the decoder where they are."""
        from vllm.v1.request import RequestStatus

        rid = request.request_id
        self._consumed.discard(rid)
        self._lookups.pop(rid, None)
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_decode") or self._local is None or \
                request.status != RequestStatus.FINISHED_LENGTH_CAPPED:
            return False, None
        self._held.append(rid)
        return True, {"do_remote_prefill": True, "do_remote_decode": False,
                      "remote_segment": self._local.segment, "remote_notify": self._local.notify,
                      "remote_layers": self._local.layers, "remote_block_ids": list(block_ids),
                      "remote_request_id": rid,
                      "remote_ranks": [{"segment": m.segment, "notify": m.notify,
                                        "layers": m.layers} for m in self._ranks]}

    # == worker side ============================================================================
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Start this step's pulls in the background (the forward does not wait)."""
        meta = self._get_connector_metadata()
        if not isinstance(meta, PDMetadata) or self._pool is None:
            return
        deadline = time.monotonic() + self.cfg.transfer_timeout
        with self._lock:
            for rid in meta.held:
                self._holding[rid] = deadline
        for job in meta.pulls:
            self._pool.submit(self._pull, job)

    def _pull(self, job: PullJob) -> None:
        if job.ranks and len(job.ranks) != self.tp_size:
            log.warning("kvplane PD: %s was prefilled with TP=%d, this instance runs TP=%d; "
                        "recomputing it", job.req_id, len(job.ranks), self.tp_size)
        job = job.on_rank(self.tp_rank, self.tp_size)
        ok = not job.local_blocks  # blocks without a source cannot be filled: recompute them
        if job.local_blocks and job.remote_blocks:
            ok = self._read(job)
        self._notify(job)
        if not job.local_blocks:
            return  # release-only: vLLM is not waiting on this request
        with self._lock:
            self._recv_done.add(job.req_id)
            if not ok:
                self._recv_failed_blocks.update(job.local_blocks)

    def _read(self, job: PullJob) -> bool:
        assert self._te is not None and self._layout is not None
        t0 = time.monotonic()
        try:
            handle = self._te.open_segment(job.segment, timeout=self.cfg.timeout)
            reqs = read_requests(job, self._layout, handle)
            statuses = self._te.transfer(reqs, self.cfg.timeout)
        except KVPlaneError as exc:
            log.warning("kvplane PD: pull of %s from %s failed: %s", job.req_id, job.segment, exc)
            return False
        ok = all(s == TransferStatus.COMPLETED for s in statuses)
        log.info("kvplane PD: pulled %d blocks of %s from %s in %.1f ms (%s)",
                 len(job.local_blocks), job.req_id, job.segment,
                 (time.monotonic() - t0) * 1e3, "ok" if ok else "FAILED")
        return ok

    def _notify(self, job: PullJob) -> None:
        if self._ctx is None:
            return
        with self._lock:
            for addr in job.notifies():
                sock = self._push.get(addr)
                if sock is None:
                    sock = self._push[addr] = self._ctx.socket(zmq.PUSH)
                    sock.setsockopt(zmq.LINGER, 1000)
                    sock.setsockopt(zmq.SNDHWM, 10000)
                    sock.connect(addr)
                try:
                    sock.send(json.dumps({"req_id": job.remote_req_id}).encode(), zmq.NOBLOCK)
                except zmq.ZMQError as exc:
                    log.warning("kvplane PD: notify %s failed: %s", addr, exc)

    def _drain_notifications(self) -> None:
        while self._pull_sock is not None:
            try:
                raw = self._pull_sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._notified.add(str(json.loads(raw)["req_id"]))
            except (ValueError, KeyError, TypeError):
                log.warning("kvplane PD: malformed notification %r", raw[:100])

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(held prefill requests now released, decode requests whose pull ended)."""
        self._drain_notifications()
        now = time.monotonic()
        with self._lock:
            self._finished_seen |= finished_req_ids & self._holding.keys()
            sent = {r for r, dl in self._holding.items()
                    if r in self._finished_seen and (r in self._notified or now > dl)}
            for r in sent:
                del self._holding[r]
                self._notified.discard(r)
                self._finished_seen.discard(r)
            recv, self._recv_done = self._recv_done, set()
            self._errors |= self._recv_failed_blocks
            self._recv_failed_blocks = set()
        return (sent or None), (recv or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._errors = self._errors, set()
        return errors

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def shutdown(self) -> None:
        """Stop pulls, close sockets and the engine (idempotent)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        for sock in [*self._push.values(), self._pull_sock]:
            if sock is not None:
                sock.close(0)
        self._push, self._pull_sock = {}, None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self._te is not None:
            self._te.close()
            self._te = None
