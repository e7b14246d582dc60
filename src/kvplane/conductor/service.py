"""The in-process conductor: registrations, hash profiles, event application and queries.

``Conductor`` is what the HTTP API and the ZMQ ingest call; Python callers (routers, the
scheduling simulator) can use it directly and get the same answers as over HTTP. It owns the
pure :class:`~kvplane.conductor.indexer.PrefixIndex` behind one lock. No sockets here: this
module must not import ``zmq`` or the HTTP stack.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

from kvplane.common import log as kvlog
from kvplane.common.errors import Conflict, InvalidArgument, NotFound, ProtocolError
from kvplane.conductor import instruments
from kvplane.conductor.config import ConductorConfig
from kvplane.conductor.hashing import HashProfile, low64
from kvplane.conductor.indexer import ContextKey, Holder, Match, PrefixIndex
from kvplane.kvevents import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    Tier,
    extra_keys_of,
    tier_of,
    tokens_of,
)

log = logging.getLogger(__name__)
SHARED_TYPES = frozenset({"mooncake", "kvplane"})
_VERIFY_FIRST = 16


@dataclass(frozen=True)
class Registration:
    """One engine instance (or shared KV pool) whose KV events the conductor ingests.

    Attributes:
        instance_id: router-facing instance id, unique within the tenant.
        model: served model name (Mooncake's ``modelname``).
        block_size: tokens per KV block of the engine.
        endpoint: the engine's ZMQ PUB endpoint to connect to; None when the engine connects
            its publisher to one of the conductor's bound SUB endpoints (then ``topic`` names it).
        replay_endpoint: the engine's ZMQ ROUTER replay endpoint (None disables gap healing).
        type: ``vLLM``/``SGLang`` engines; ``Mooncake``/``kvplane`` are shared pools whose
            CPU/DISK blocks count for every instance.
        lora_name: default LoRA adapter when events do not name one (``""`` = base model).
        tenant_id: tenant namespace.
        dp_rank: first DP rank this registration covers.
        dp_size: number of DP ranks; rank ``r`` uses the tcp ports of both endpoints + ``r - dp_rank``
            (as vLLM offsets them).
        additional_salt: operator namespace salt (part of the index context).
        topic: publisher topic; routes messages arriving on a bound SUB endpoint.
        hash_profile: how the engine hashes blocks (None = the conductor's default).
        token: token presented (ZMQ PLAIN) to a publisher that requires one, such as a kvplane
            master's authenticated KV-event stream ("" = none); never listed.
    """

    instance_id: str
    model: str
    block_size: int
    endpoint: str | None = None
    replay_endpoint: str | None = None
    type: str = "vLLM"
    lora_name: str = ""
    tenant_id: str = "default"
    dp_rank: int = 0
    dp_size: int = 1
    additional_salt: str = ""
    topic: str = ""
    hash_profile: HashProfile | None = None
    token: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if not self.instance_id or not self.model:
            raise InvalidArgument("instance_id and model are required")
        if not 0 < self.block_size <= 1 << 16:
            raise InvalidArgument(f"block_size must be in 1..65536, got {self.block_size}")
        if self.dp_rank < 0 or not 0 < self.dp_size <= 1024:
            raise InvalidArgument("dp_rank must be >= 0 and dp_size in 1..1024")
        for ep in (self.endpoint, self.replay_endpoint):
            if ep is not None and not ep.startswith(("tcp://", "ipc://", "inproc://")):
                raise InvalidArgument(f"bad ZMQ endpoint {ep!r}")

    @property
    def shared(self) -> bool:
        """True for shared KV pools (their tiers serve every instance)."""
        return self.type.lower() in SHARED_TYPES


def offset_endpoint(endpoint: str | None, offset: int) -> str | None:
    """vLLM's DP rule: tcp ports move by ``offset``, ipc/inproc paths get ``_dp{offset}``."""
    if endpoint is None or offset == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + offset}"
    return f"{endpoint}_dp{offset}"


@dataclass
class Stream:
    """One (tenant, instance, DP rank) event stream and its health."""

    reg: Registration
    dp_rank: int
    endpoint: str | None
    replay_endpoint: str | None
    hash_checks: int = 0
    hash_mismatches: int = 0
    roots_seen: int = 0
    block_size_mismatches: int = 0
    last_seq: int | None = None
    batches: int = 0
    events: int = 0  # events applied (stored, removed, cleared)
    loras: set[str] = field(default_factory=set)

    @property
    def key(self) -> tuple[str, str, int]:
        """(tenant, instance, rank)."""
        return (self.reg.tenant_id, self.reg.instance_id, self.dp_rank)

    @property
    def hash_status(self) -> str:
        """``ok``, ``mismatch`` or ``unverified`` (no root block checked yet)."""
        if self.hash_mismatches:
            return "mismatch"
        return "ok" if self.hash_checks else "unverified"


@dataclass
class QueryRequest:
    """A prefix query (the body of ``/query`` and ``/query_by_hash``).

    Attributes:
        model: model name.
        token_ids: prompt token ids (``/query``); only complete blocks count.
        seq_hashes: 64-bit event hashes of consecutive blocks (``/query_by_hash``).
        lora_name: LoRA adapter (``""`` = base model).
        tenant_id: tenant.
        instance_id: only this instance (None = every instance of the tenant and model).
        block_size: block size (None = the one block size registered for this model).
        cache_salt: request cache salt, hashed into the first block.
        additional_salt: operator namespace salt of the context.
        lora_path: adapter path (hashed with the name by the ``vllm_v1_tagged`` strategy).
    """

    model: str
    token_ids: Sequence[int] | None = None
    seq_hashes: Sequence[int] | None = None
    lora_name: str = ""
    tenant_id: str = "default"
    instance_id: str | None = None
    block_size: int | None = None
    cache_salt: str | None = None
    additional_salt: str = ""
    lora_path: str | None = None


Listener = Callable[[list[Stream], list[Stream]], None]


@dataclass
class _Counters:
    started: float = field(default_factory=time.monotonic)


class Conductor:
    """Registrations + index + queries. Thread-safe: every method takes the one lock.

    Args:
        config: the conductor configuration.
    """

    def __init__(self, config: ConductorConfig | None = None) -> None:
        self.config = config or ConductorConfig()
        self.index = PrefixIndex()
        self._lock = threading.RLock()  # wait_until predicates may call locked views
        self._changed = threading.Condition(self._lock)
        self._streams: dict[tuple[str, str, int], Stream] = {}
        self._profiles: dict[tuple[str, str, int, str], HashProfile] = {}
        self._listeners: list[Listener] = []
        self._counters = _Counters()

    # registration ------------------------------------------------------------------------
    def add_listener(self, fn: Listener) -> None:
        """Call ``fn(added, removed)`` after every registration change (from the caller's thread)."""
        self._listeners.append(fn)

    def register(self, reg: Registration) -> list[Stream]:
        """Register an instance (all its DP ranks). Idempotent for an identical registration.

        Returns:
            The streams now registered for it.

        Raises:
            Conflict: the instance is registered with different settings, or the context is
                bound to a different hash profile.
            InvalidArgument: too many streams.
        """
        profile = reg.hash_profile or self.config.default_profile
        reg = replace(reg, hash_profile=profile)
        pkey = (reg.tenant_id, reg.model, reg.block_size, reg.additional_salt)
        added: list[Stream] = []
        with self._lock:
            bound = self._profiles.get(pkey)
            if bound is not None and bound != profile:
                instruments.HASH_MISMATCH.labels(reason="registration").inc()
                raise Conflict(f"hash profile mismatch for model {reg.model!r} block_size "
                               f"{reg.block_size}: context uses {bound}, registration has {profile}")
            ranks = range(reg.dp_rank, reg.dp_rank + reg.dp_size)
            for r in ranks:
                old = self._streams.get((reg.tenant_id, reg.instance_id, r))
                if old is not None and old.reg != reg:
                    raise Conflict(f"instance {reg.instance_id!r} rank {r} is registered with "
                                   "different settings; unregister it first")
            new = [r for r in ranks if (reg.tenant_id, reg.instance_id, r) not in self._streams]
            if len(self._streams) + len(new) > self.config.max_instances:
                raise InvalidArgument(f"at most {self.config.max_instances} streams")
            self._profiles[pkey] = profile
            for r in new:
                off = r - reg.dp_rank
                s = Stream(reg, r, offset_endpoint(reg.endpoint, off),
                           offset_endpoint(reg.replay_endpoint, off))
                self._streams[s.key] = s
                added.append(s)
            out = [self._streams[(reg.tenant_id, reg.instance_id, r)] for r in ranks]
        if added:
            kvlog.event("conductor_register", instance=reg.instance_id, tenant=reg.tenant_id,
                        ranks=[s.dp_rank for s in added])
            self._notify(added, [])
        return out

    def unregister(self, instance_id: str, tenant_id: str = "default",
                   dp_rank: int | None = None) -> list[str]:
        """Remove an instance (or one DP rank of it) and forget its blocks.

        Returns:
            Removed streams as ``"<instance>|<tenant>|<rank>"`` (Mooncake's format).

        Raises:
            NotFound: nothing matched.
        """
        with self._lock:
            gone = [s for k, s in self._streams.items() if k[0] == tenant_id and k[1] == instance_id
                    and (dp_rank is None or k[2] == dp_rank)]
            if not gone:
                raise NotFound(f"instance {instance_id!r} (tenant {tenant_id!r}) is not registered")
            for s in gone:
                del self._streams[s.key]
                self.index.clear(None, instance_id, s.dp_rank, release=True)
            self._gc_profiles()
        self._notify([], gone)
        return [f"{s.reg.instance_id}|{s.reg.tenant_id}|{s.dp_rank}" for s in gone]

    def _gc_profiles(self) -> None:
        live = {(s.reg.tenant_id, s.reg.model, s.reg.block_size, s.reg.additional_salt)
                for s in self._streams.values()}
        for k in [k for k in self._profiles if k not in live]:
            del self._profiles[k]

    def _notify(self, added: list[Stream], removed: list[Stream]) -> None:
        for fn in self._listeners:
            fn(added, removed)

    def streams(self) -> list[Stream]:
        """A snapshot of every registered stream."""
        with self._lock:
            return list(self._streams.values())

    def stream(self, tenant_id: str, instance_id: str, dp_rank: int) -> Stream | None:
        """The stream of one (tenant, instance, rank), if registered."""
        with self._lock:
            return self._streams.get((tenant_id, instance_id, dp_rank))

    def stream_for_topic(self, topic: str, dp_rank: int | None) -> Stream | None:
        """The connect-mode-less stream a bound-SUB message belongs to, by topic and rank."""
        with self._lock:
            for s in self._streams.values():
                if s.reg.endpoint is None and s.reg.topic == topic and (
                        dp_rank is None or s.dp_rank == dp_rank):
                    return s
        return None

    # event application ---------------------------------------------------------------------
    def apply(self, stream: Stream, batch: EventBatch, seq: int | None = None) -> None:
        """Apply one decoded batch of ``stream``'s events to the index (never raises on content).

        Args:
            stream: the registered stream the batch came from.
            batch: the decoded batch.
            seq: its sequence number (recorded for /instances).
        """
        reg = stream.reg
        with self._changed:
            if self._streams.get(stream.key) is not stream:
                return  # unregistered meanwhile
            for ev in batch.events:
                if isinstance(ev, BlockStored):
                    self._apply_stored(stream, ev)
                elif isinstance(ev, BlockRemoved):
                    tier = self._tier(ev.medium, ev.group_idx)
                    if tier is not None:
                        holder = Holder(reg.instance_id, stream.dp_rank, tier)
                        n = sum(self.index.remove(self._ctx(reg, lora), holder, ev.hashes)
                                for lora in stream.loras)
                        instruments.BLOCKS.labels(kind="removed").inc(n)
                elif isinstance(ev, AllBlocksCleared):
                    self.index.clear(None, reg.instance_id, stream.dp_rank)
                    instruments.BLOCKS.labels(kind="cleared").inc()
            stream.batches += 1
            stream.events += len(batch.events)
            if seq is not None:
                stream.last_seq = seq
            self._changed.notify_all()

    def _tier(self, medium: str | None, group_idx: int | None) -> Tier | None:
        if group_idx not in (None, 0):
            instruments.SKIPPED.labels(reason="group_idx").inc()
            return None
        tier = tier_of(medium)
        if tier is None:
            instruments.SKIPPED.labels(reason="unknown_medium").inc()
        return tier

    def _ctx(self, reg: Registration, lora: str | None) -> ContextKey:
        return ContextKey(reg.tenant_id, reg.model, lora if lora is not None else reg.lora_name,
                          reg.block_size, reg.additional_salt)

    def _apply_stored(self, stream: Stream, ev: BlockStored) -> None:
        reg = stream.reg
        tier = self._tier(ev.medium, ev.group_idx)
        if tier is None:
            return
        if ev.block_size and ev.block_size != reg.block_size:
            stream.block_size_mismatches += 1
            instruments.SKIPPED.labels(reason="block_size").inc()
            return
        if ev.parent is None and ev.hashes:
            self._maybe_verify(stream, ev)
        ctx = self._ctx(reg, ev.lora_name)
        stream.loras.add(ctx.lora)
        n = self.index.store(ctx, Holder(reg.instance_id, stream.dp_rank, tier), ev.hashes)
        instruments.BLOCKS.labels(kind="stored").inc(n)

    def _maybe_verify(self, stream: Stream, ev: BlockStored) -> None:
        """Check a root block's hash against the registered profile; record a mismatch."""
        every = self.config.verify_every
        stream.roots_seen += 1
        if every == 0 or (stream.roots_seen > _VERIFY_FIRST and stream.roots_seen % every):
            return
        profile = stream.reg.hash_profile
        if profile is None or not profile.reproducible:
            return
        try:
            tokens = tokens_of(ev)
            extras = extra_keys_of(ev)
        except ProtocolError:
            return
        bs = stream.reg.block_size
        if len(tokens) < bs:
            return
        if extras is None and ev.lora_name:
            return  # old event format with a LoRA: extra keys unknown, cannot check
        extra = extras[0] if extras else None
        if extra is not None and profile.strategy == "vllm_v1_tagged":
            return  # events carry extra keys untagged; the tagged form cannot be rebuilt
        want = low64(profile.hash_block(None, tokens[:bs], extra))
        stream.hash_checks += 1
        if want != ev.hashes[0]:
            stream.hash_mismatches += 1
            instruments.HASH_MISMATCH.labels(reason="event").inc()
            if stream.hash_mismatches == 1:
                log.warning("hash profile mismatch on instance %s rank %s: registered %s does not "
                            "reproduce its block hashes (check PYTHONHASHSEED and "
                            "--prefix-caching-hash-algo); token queries will not match",
                            stream.reg.instance_id, stream.dp_rank, profile)

    def reset_stream(self, stream: Stream, reason: str) -> int:
        """Forget every block of one stream (publisher restarted or an unhealable gap)."""
        with self._changed:
            n = self.index.clear(None, stream.reg.instance_id, stream.dp_rank)
            self._changed.notify_all()
        kvlog.event("conductor_stream_reset", instance=stream.reg.instance_id,
                    rank=stream.dp_rank, reason=reason, entries=n)
        return n

    def notify_waiters(self) -> None:
        """Wake :meth:`wait_until` callers (ingest calls it after skipping a message)."""
        with self._changed:
            self._changed.notify_all()

    def wait_until(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Block until ``predicate()`` (checked after each applied batch) holds or ``timeout`` ends."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
            return True

    # queries ----------------------------------------------------------------------------------
    def match(self, req: QueryRequest) -> dict[str, Match]:
        """Longest prefix per instance in blocks (the typed form of :meth:`query`).

        Raises:
            InvalidArgument: neither or both of token_ids/seq_hashes, too long, or an unknown
                block size / unreproducible hash profile for a token query.
            NotFound: ``instance_id`` is not registered for this tenant and model.
        """
        return self._match(req)[1]

    def _match(self, req: QueryRequest) -> tuple[int, dict[str, Match]]:
        if (req.token_ids is None) == (req.seq_hashes is None):
            raise InvalidArgument("give exactly one of token_ids and seq_hashes")
        with self._lock:
            bs = self._block_size(req)
            n = len(req.token_ids) if req.token_ids is not None else len(req.seq_hashes or ()) * bs
            if n > self.config.max_query_tokens:
                raise InvalidArgument(f"query of {n} tokens exceeds {self.config.max_query_tokens}")
            ctx = ContextKey(req.tenant_id, req.model, req.lora_name, bs, req.additional_salt)
            instances, shared = self._targets(req, bs)
            if not instances:
                return bs, {}
            hashes: Iterable[int]
            if req.seq_hashes is not None:
                hashes = req.seq_hashes
            else:
                profile = self._profiles.get((req.tenant_id, req.model, bs, req.additional_salt))
                if profile is None or not profile.reproducible:
                    raise InvalidArgument("no reproducible hash profile for this context; "
                                          "register engines with a fixed PYTHONHASHSEED or use "
                                          "/query_by_hash")
                hashes = profile.event_hashes(req.token_ids, bs, lora_name=req.lora_name or None,  # type: ignore[arg-type]  # ids: no hashes
                                              cache_salt=req.cache_salt, lora_path=req.lora_path)
            return bs, self.index.match(ctx, hashes, instances, shared)

    def query(self, req: QueryRequest) -> dict[str, dict[str, dict[str, object]]]:
        """Mooncake's answer: ``{tenant: {instance: {longest_matched, GPU, CPU, DISK, DP}}}`` in tokens."""
        start = time.perf_counter()
        bs, result = self._match(req)
        body = {inst: {"longest_matched": mt.longest * bs, "GPU": mt.gpu * bs, "CPU": mt.cpu * bs,
                       "DISK": mt.disk * bs, "DP": {str(r): v * bs for r, v in sorted(mt.dp.items())}}
                for inst, mt in result.items()}
        instruments.QUERY_SECONDS.labels(kind="tokens" if req.token_ids is not None else "hashes").observe(
            time.perf_counter() - start)
        return {req.tenant_id: body}

    def _block_size(self, req: QueryRequest) -> int:
        if req.block_size is not None:
            if req.block_size <= 0:
                raise InvalidArgument("block_size must be > 0")
            return req.block_size
        sizes = {s.reg.block_size for s in self._streams.values()
                 if s.reg.tenant_id == req.tenant_id and s.reg.model == req.model}
        if len(sizes) != 1:
            raise InvalidArgument("block_size is required (registered sizes for this model: "
                                  f"{sorted(sizes)})")
        return sizes.pop()

    def _targets(self, req: QueryRequest, bs: int) -> tuple[dict[str, set[int]], set[str]]:
        instances: dict[str, set[int]] = {}
        shared: set[str] = set()
        for s in self._streams.values():
            r = s.reg
            if (r.tenant_id, r.model, r.block_size, r.additional_salt) != (
                    req.tenant_id, req.model, bs, req.additional_salt):
                continue
            if r.shared:
                shared.add(r.instance_id)
            elif req.instance_id is None or r.instance_id == req.instance_id:
                instances.setdefault(r.instance_id, set()).add(s.dp_rank)
        if req.instance_id is not None and not instances:
            raise NotFound(f"instance {req.instance_id!r} is not registered for model "
                           f"{req.model!r} block_size {bs} in tenant {req.tenant_id!r}")
        return instances, shared

    # views ------------------------------------------------------------------------------------
    def instances(self) -> list[dict[str, object]]:
        """One row per registered stream: identity, endpoints, hash status, counters."""
        with self._lock:
            rows = []
            for s in self._streams.values():
                r = s.reg
                p = r.hash_profile or self.config.default_profile
                held = {t.name: sum(self.index.held_by(self._ctx(r, lora),
                                                       Holder(r.instance_id, s.dp_rank, t))
                                    for lora in s.loras) for t in Tier}
                rows.append({
                    "instance_id": r.instance_id, "tenant_id": r.tenant_id, "dp_rank": s.dp_rank,
                    "type": r.type, "modelname": r.model, "lora_name": r.lora_name,
                    "block_size": r.block_size, "additionalsalt": r.additional_salt,
                    "endpoint": s.endpoint, "replay_endpoint": s.replay_endpoint, "topic": r.topic,
                    "hash_profile": {"strategy": p.strategy, "algorithm": p.algorithm,
                                     "python_hash_seed": p.seed, "index_projection": p.index_projection},
                    "hash_status": s.hash_status, "hash_checks": s.hash_checks,
                    "hash_mismatches": s.hash_mismatches,
                    "block_size_mismatches": s.block_size_mismatches,
                    "last_seq": s.last_seq, "batches": s.batches, "events": s.events,
                    "blocks": held,
                })
            return rows

    def clear_hash_caches(self) -> None:
        """Forget every profile's remembered prompt chunks (the next token query hashes cold)."""
        with self._lock:
            for profile in set(self._profiles.values()):
                profile.clear_cache()

    def health(self) -> dict[str, object]:
        """Liveness plus sizes; ``status`` is ``degraded`` while any stream has a hash mismatch."""
        with self._lock:
            bad = [f"{s.reg.instance_id}|{s.reg.tenant_id}|{s.dp_rank}" for s in self._streams.values()
                   if s.hash_mismatches or s.block_size_mismatches]
            st = self.index.stats()
            return {"status": "degraded" if bad else "ok", "streams": len(self._streams),
                    "mismatched_streams": bad,
                    "uptime_s": round(time.monotonic() - self._counters.started, 3), **st}
