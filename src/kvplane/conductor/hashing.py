"""vLLM-compatible prefix-cache block hashing (v1 engine), enough to match its KV events.

A block digest is ``H((parent_digest or NONE_HASH, tuple(block_tokens), extra_keys or None))``
where ``H`` is SHA-256 over pickle protocol 5 (``sha256``, vLLM's default) or over canonical CBOR
(``sha256_cbor``), and ``NONE_HASH = H(seed)`` with ``seed`` the engine's ``PYTHONHASHSEED``
string. Events carry the low 64 bits of the digest (last 8 bytes, big-endian). The next block is
chained on the **full** 32-byte digest, never on the projection. Only complete blocks are hashed.

Long prompts take a batched path (:func:`_fast_chain`): the C accelerator hashes a whole batch in
one call when it was built; otherwise the hash inputs of many blocks are laid out at once with
numpy, so the per-block Python work is one concatenation and one SHA-256 call. Both are exact by
construction and checked against the generic encoder on the first block of every batch (any
difference falls back to the next path).

Pure: no I/O. Must not import sockets, HTTP or anything outside the standard library, numpy and
its own optional C accelerator (``_accel``, see :func:`_fast_chain`).
"""

from __future__ import annotations

import hashlib
import operator
import pickle
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Literal

import numpy as np

from kvplane.common.errors import InvalidArgument

try:  # ``native``: the optional C accelerator (pyproject's ext-modules); the numpy path below is the fallback
    from kvplane.conductor import _accel as native
except ImportError:  # pragma: no cover - depends on the build
    native = None  # type: ignore[assignment]  # not built: callers test for None

Algorithm = Literal["sha256", "sha256_cbor"]
ALGORITHMS: tuple[str, ...] = ("sha256", "sha256_cbor")
STRATEGIES: tuple[str, ...] = ("vllm_v1", "vllm_v1_tagged")
LOW64 = (1 << 64) - 1
# A per-block extra key is a tuple of str/bytes/int/tuple items, or None.
ExtraKeys = tuple[object, ...] | None


def _cbor_head(major: int, n: int) -> bytes:
    """The shortest CBOR head for major type ``major`` and argument ``n``."""
    if n < 24:
        return bytes([(major << 5) | n])
    for code, fmt, limit in ((24, ">B", 1 << 8), (25, ">H", 1 << 16), (26, ">I", 1 << 32),
                             (27, ">Q", 1 << 64)):
        if n < limit:
            return bytes([(major << 5) | code]) + struct.pack(fmt, n)
    raise InvalidArgument(f"integer {n} does not fit in 64 bits")


_UINT_LIMIT = 1 << 32
_UINTS: dict[int, bytes] = {}  # token id -> its CBOR encoding (bounded, see _token_block)


def _token_block(block: tuple[object, ...]) -> bytes:
    """CBOR bodies of a block of token ids (hot path of sha256_cbor).

    Raises:
        TypeError: if an item is not a non-negative int below 2**32 (use the generic encoder).
    """
    if block and set(map(type, block)) != {int}:  # bools compare equal to 0/1: keep them out
        raise TypeError("not a token id")
    try:
        return b"".join(map(_UINTS.__getitem__, block))  # type: ignore[arg-type]  # ints checked above
    except KeyError:
        if len(_UINTS) > 1 << 20:
            _UINTS.clear()
        for n in block:
            if type(n) is not int or not 0 <= n < _UINT_LIMIT:
                raise TypeError("not a token id") from None
            _UINTS[n] = _cbor_head(0, n)
        return b"".join(map(_UINTS.__getitem__, block))  # type: ignore[arg-type]  # ints checked above


def cbor_canonical(obj: object) -> bytes:
    """Encode ``obj`` as canonical CBOR (RFC 7049 §3.9) for the types vLLM hashes.

    Supports None, bool, int (64-bit range), bytes, str and tuples/lists of those.

    Raises:
        InvalidArgument: for any other type or an out-of-range integer.
    """
    out = bytearray()
    _cbor_into(obj, out)
    return bytes(out)


def _cbor_into(obj: object, out: bytearray) -> None:
    if obj is None:
        out.append(0xF6)
    elif obj is True:
        out.append(0xF5)
    elif obj is False:
        out.append(0xF4)
    elif isinstance(obj, int):
        out += _cbor_head(0, obj) if obj >= 0 else _cbor_head(1, -1 - obj)
    elif isinstance(obj, bytes | bytearray | memoryview):
        data = bytes(obj)
        out += _cbor_head(2, len(data)) + data
    elif isinstance(obj, str):
        data = obj.encode("utf-8")
        out += _cbor_head(3, len(data)) + data
    elif isinstance(obj, tuple | list):
        out += _cbor_head(4, len(obj))
        for item in obj:
            _cbor_into(item, out)
    else:
        raise InvalidArgument(f"cannot CBOR-encode {type(obj).__name__} for block hashing")


def _sha256_pickle(obj: object) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(obj: object) -> bytes:
    if type(obj) is tuple and len(obj) == 3 and type(obj[0]) is bytes and type(obj[1]) is tuple:
        parent, block, extra = obj  # hot path: (parent digest, token ids, extra keys)
        try:
            body = _token_block(block)
        except TypeError:
            return hashlib.sha256(cbor_canonical(obj)).digest()
        data = b"".join((b"\x83", _cbor_head(2, len(parent)), parent, _cbor_head(4, len(block)),
                         body, b"\xf6" if extra is None else cbor_canonical(extra)))
        return hashlib.sha256(data).digest()
    return hashlib.sha256(cbor_canonical(obj)).digest()


_HASH_FNS = {"sha256": _sha256_pickle, "sha256_cbor": _sha256_cbor}

# Batched path. A block's hash input is ``pre + parent + tail`` where only ``parent`` depends on
# the previous block. pickle protocol 5 of (bytes32, (t0, .., tn), None): PROTO 5, FRAME <u64>,
# SHORT_BINBYTES 32 <parent>, MEMOIZE, MARK, BININT1/BININT2/BININT per token, TUPLE, MEMOIZE,
# NONE, TUPLE3, MEMOIZE, STOP (tuples of 1-3 items use TUPLE1-3 and no MARK). CBOR of the same:
# array(3), bytes(32) <parent>, array(n), one unsigned int per token, null.
_FIRST_BATCH = 64  # blocks hashed before the first yield (a walk may stop early)
_BATCH_GROWTH = 8
_MIN_BATCH = 8  # fewer blocks than this are cheaper block by block
_PICKLE_SMALL_TUPLE = {1: b"\x85", 2: b"\x86", 3: b"\x87"}
_FRAME_LIMIT = 1 << 16  # the pickler starts a new frame past 64 KiB; such blocks go generic
CHUNK_BLOCKS = 64  # prefix-cache granularity: whole chunks of this many blocks are remembered
CACHE_CHUNKS = 2048  # chunks remembered per profile (about 6 KiB each with 16-token blocks)


def _as_tokens(token_ids: Sequence[int]) -> np.ndarray | None:
    """Token ids as int64 (each as ``operator.index`` gives it), or None if one is not an int."""
    if isinstance(token_ids, np.ndarray):
        return token_ids.astype(np.int64, copy=False) if token_ids.dtype.kind in "iu" else None
    try:
        return np.frombuffer(struct.pack(f"<{len(token_ids)}q", *token_ids), dtype=np.int64)
    except (struct.error, TypeError, OverflowError):
        return None


# Per size class of a token id: the first byte of its encoding and which of the 5 slot bytes
# (that byte, then the u32 in the encoding's byte order) the encoding uses.
_PICKLE_OPS = np.array([0x4B, 0x4D, 0x4A], np.uint8)  # BININT1 <256, BININT2 <65536, BININT
_PICKLE_USED = np.array([[1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], bool)
_CBOR_USED = np.array([[1, 0, 0, 0, 0], [1, 0, 0, 0, 1], [1, 0, 0, 1, 1], [1, 1, 1, 1, 1]], bool)


def _token_slots(tok: np.ndarray, cbor: bool) -> tuple[np.ndarray, np.ndarray]:
    """Each token's encoding in a 5-byte slot and the mask of the slot bytes it uses."""
    n = tok.size
    slots = np.empty((n, 5), np.uint8)
    word = tok.astype(">u4" if cbor else "<u4")
    slots[:, 1:] = word.view(np.uint8).reshape(n, 4)
    size = (tok >= 256).view(np.int8) + (tok >= 65536).view(np.int8)
    if cbor:  # <24: the value itself; 0x18 u8, 0x19 u16, 0x1a u32 (big-endian, the low bytes)
        size += (tok >= 24).view(np.int8)
        slots[:, 0] = np.where(size == 0, tok.astype(np.uint8), size + 0x17)
        return slots, _CBOR_USED[size]
    slots[:, 0] = _PICKLE_OPS[size]  # BININT1 u8, BININT2 u16, BININT i32 (little-endian)
    return slots, _PICKLE_USED[size]


def _layout(tok: np.ndarray, bs: int, cbor: bool) -> tuple[list[bytes], list[bytes]] | None:
    """Per block: the bytes before the parent digest and the bytes after it; None = go generic."""
    if tok.size == 0 or int(tok.min()) < 0 or int(tok.max()) >= (1 << 32 if cbor else 1 << 31):
        return None  # negative or LONG1-sized ids: the generic encoders handle them
    nb = tok.size // bs
    slots, used = _token_slots(tok, cbor)
    if cbor:
        mid, post = _cbor_head(4, bs), b"\xf6"
    elif bs in _PICKLE_SMALL_TUPLE:
        mid, post = b"\x94", _PICKLE_SMALL_TUPLE[bs] + b"\x94N\x87\x94."
    else:
        mid, post = b"\x94(", b"t\x94N\x87\x94."
    m, width = len(mid), len(mid) + 5 * bs + len(post)
    rows = np.empty((nb, width), np.uint8)
    rows[:, :m] = np.frombuffer(mid, np.uint8)
    rows[:, m:width - len(post)] = slots.reshape(nb, 5 * bs)
    rows[:, width - len(post):] = np.frombuffer(post, np.uint8)
    mask = np.ones((nb, width), bool)
    mask[:, m:width - len(post)] = used.reshape(nb, 5 * bs)
    blob = rows[mask].tobytes()
    ends = np.cumsum(mask.sum(axis=1)).tolist()
    tails = [blob[a:b] for a, b in zip([0, *ends[:-1]], ends)]
    if cbor:
        return [b"\x83\x58\x20"] * nb, tails
    frames = [len(t) + 34 for t in tails]  # SHORT_BINBYTES with its 32 bytes, then the tail
    if max(frames) >= _FRAME_LIMIT:
        return None
    heads = {f: b"\x80\x05\x95" + f.to_bytes(8, "little") + b"C\x20" for f in set(frames)}
    return [heads[f] for f in frames], tails


def _fast_chain(algorithm: str, tok: np.ndarray, bs: int, parent: bytes,
                use_native: bool = True) -> bytes | None:
    """Digests of every complete block of ``tok`` chained from ``parent``, no extra keys, as one
    blob (32 bytes per block).

    The C accelerator runs the whole chain when it is built (``use_native=False`` skips it, for tests
    and benchmarks); otherwise the hash inputs are laid out with numpy. Returns None when neither
    applies or neither reproduces the generic encoder on the first block; the caller then hashes
    block by block.
    """
    cbor = algorithm == "sha256_cbor"
    first = tuple(tok[:bs].tolist())
    if use_native and native is not None and tok.size >= bs:
        # The C loop writes the same bytes as _layout; its first digest is checked like _layout's
        # first input, against the generic encoder.
        blob = native.chain(np.ascontiguousarray(tok, np.int64), bs, parent, cbor)
        if blob is not None and blob[:32] == _HASH_FNS[algorithm]((parent, first, None)):
            return blob
    layout = _layout(tok, bs, cbor)
    if layout is None:
        return None
    heads, tails = layout
    generic = (pickle.dumps((parent, first, None), protocol=pickle.HIGHEST_PROTOCOL)
               if not cbor else cbor_canonical((parent, first, None)))
    if heads[0] + parent + tails[0] != generic:
        return None
    sha = hashlib.sha256
    out: list[bytes] = []
    append = out.append
    for head, tail in zip(heads, tails):
        parent = sha(head + parent + tail).digest()
        append(parent)
    return b"".join(out)


def _split(blob: bytes) -> list[bytes]:
    """A blob of digests as a list of 32-byte digests."""
    return [blob[i:i + 32] for i in range(0, len(blob), 32)]


def low64_all(blob: bytes) -> list[int]:
    """:func:`low64` of every digest in a blob of 32-byte digests."""
    return np.frombuffer(blob, dtype=">u8")[3::4].tolist()


def low64(digest: bytes) -> int:
    """Project a digest to the event hash: its last 8 bytes as a big-endian unsigned int."""
    return int.from_bytes(digest[-8:], "big")


@dataclass(frozen=True)
class HashProfile:
    """How an engine computes its block hashes; an index context is bound to exactly one.

    Attributes:
        algorithm: ``sha256`` (pickle, vLLM's default) or ``sha256_cbor``.
        seed: the engine's ``PYTHONHASHSEED`` as a string; ``NONE_HASH = H(seed)``. The value
            ``"random"`` means the engine ran without a fixed seed: events can still be indexed
            and queried by hash, but token queries cannot reproduce the chain.
        strategy: how extra keys are built. ``vllm_v1`` (Mooncake's name): untagged, LoRA name on
            every block then the cache salt on the first (the golden vectors; vLLM before
            tagging). ``vllm_v1_tagged``: vLLM 0.32's tagged keys ``("lora", name, path)`` and
            ``("cache_salt", salt)``. Both agree when a request has no LoRA and no salt.
        index_projection: how digests become index keys (``low64_be``); the only one supported.
    """

    algorithm: Algorithm = "sha256"
    seed: str = "0"
    strategy: Literal["vllm_v1", "vllm_v1_tagged"] = "vllm_v1"
    index_projection: Literal["low64_be"] = "low64_be"
    _none_hash: bytes = field(init=False, repr=False, compare=False, default=b"")
    _chunks: dict[tuple[bytes, bytes], bytes] = field(init=False, repr=False, compare=False,
                                                      default_factory=dict)

    def __post_init__(self) -> None:
        if self.algorithm not in _HASH_FNS:
            raise InvalidArgument(f"unknown hash algorithm {self.algorithm!r}; choose one of {ALGORITHMS}")
        if self.strategy not in STRATEGIES or self.index_projection != "low64_be":
            raise InvalidArgument(f"strategy must be one of {STRATEGIES} and projection 'low64_be'")
        if not isinstance(self.seed, str):
            raise InvalidArgument("seed must be the PYTHONHASHSEED string, e.g. '0'")
        object.__setattr__(self, "_none_hash", _HASH_FNS[self.algorithm](self.seed))

    @property
    def none_hash(self) -> bytes:
        """The root parent digest (vLLM's ``NONE_HASH``)."""
        return self._none_hash

    @property
    def reproducible(self) -> bool:
        """False when the engine's seed is random, so token queries cannot match."""
        return self.seed != "random"

    def hash_block(self, parent: bytes | None, tokens: Sequence[int], extra: ExtraKeys = None) -> bytes:
        """The 32-byte digest of one full block chained on ``parent`` (None = the root)."""
        return _HASH_FNS[self.algorithm]((parent or self._none_hash, tuple(tokens), extra))

    def digests(self, token_ids: Sequence[int], block_size: int, *, lora_name: str | None = None,
                cache_salt: str | None = None, extra_keys: Sequence[ExtraKeys] | None = None,
                lora_path: str | None = None) -> Iterator[bytes]:
        """Lazily yield the digest of every complete block of ``token_ids``.

        Args:
            token_ids: prompt token ids (a sequence or an integer numpy array); each is hashed as
                the Python int ``operator.index`` gives (so numpy integers hash like vLLM's
                ints); the trailing partial block is ignored.
            block_size: tokens per block (> 0).
            lora_name: LoRA adapter name, folded into every block's extra keys.
            cache_salt: request cache salt, folded into the first block only.
            extra_keys: optional per-block opaque extra keys (e.g. multimodal hashes), appended
                after the LoRA key and before the salt, as vLLM orders them.
            lora_path: the adapter path (``vllm_v1_tagged`` hashes it with the name).

        Yields:
            32-byte digests, one per complete block, in order; stop early to save hashing.

        Raises:
            InvalidArgument: for a non-positive block size.
        """
        for batch in self.digest_batches(token_ids, block_size, lora_name=lora_name,
                                         cache_salt=cache_salt, extra_keys=extra_keys,
                                         lora_path=lora_path):
            yield from batch

    def digest_batches(self, token_ids: Sequence[int], block_size: int, *,
                       lora_name: str | None = None, cache_salt: str | None = None,
                       extra_keys: Sequence[ExtraKeys] | None = None,
                       lora_path: str | None = None) -> Iterator[list[bytes]]:
        """:meth:`digests` in lists of growing length (64 blocks, then 8 times more each)."""
        for blob in self._blobs(token_ids, block_size, lora_name=lora_name, cache_salt=cache_salt,
                                extra_keys=extra_keys, lora_path=lora_path):
            yield _split(blob)

    def _blobs(self, token_ids: Sequence[int], block_size: int, *, lora_name: str | None = None,
               cache_salt: str | None = None, extra_keys: Sequence[ExtraKeys] | None = None,
               lora_path: str | None = None) -> Iterator[bytes]:
        """:meth:`digest_batches` as blobs of 32-byte digests (no per-digest objects)."""
        if block_size <= 0:
            raise InvalidArgument(f"block_size must be > 0, got {block_size}")
        if not isinstance(token_ids, list | tuple | np.ndarray):
            token_ids = list(token_ids)
        n_blocks = len(token_ids) // block_size
        parent, start, size = self._none_hash, 0, _FIRST_BATCH
        keyed = bool(lora_name) or extra_keys is not None
        if cache_salt and not keyed and n_blocks:  # the salt is in the first block's keys only
            parent = self._generic(token_ids, block_size, 0, 1, parent, None, None, cache_salt, None)[0]
            yield parent
            start = 1
        while start < n_blocks:
            end = min(n_blocks, start + size)
            if keyed:
                out = b"".join(self._generic(token_ids, block_size, start, end, parent, lora_name,
                                             lora_path, cache_salt, extra_keys))
            else:
                out = self._plain(token_ids, block_size, start, end, parent)
            yield out
            parent, start, size = out[-32:], end, size * _BATCH_GROWTH

    def _plain(self, token_ids: Sequence[int], bs: int, start: int, stop: int,
               parent: bytes) -> bytes:
        """Blocks ``start..stop`` without extra keys: batched (_fast_chain) when it applies."""
        if stop - start >= _MIN_BATCH:
            tok = _as_tokens(token_ids[start * bs:stop * bs])
            out = None if tok is None else self._cached_chain(tok, bs, parent)
            if out is not None:
                return out
        return b"".join(self._generic(token_ids, bs, start, stop, parent, None, None, None, None))

    def _cached_chain(self, tok: np.ndarray, bs: int, parent: bytes) -> bytes | None:
        """:func:`_fast_chain` with an exact prefix cache of ``CHUNK_BLOCKS``-block chunks.

        A chunk's key is its parent digest and its token ids (the exact bytes, so a hit can
        only be the same chain); its value is the chunk's digests. Hits are taken from the
        start; the rest is hashed in one batch and its whole chunks are remembered (at most
        ``CACHE_CHUNKS``, oldest dropped first).
        """
        hits: list[bytes] = []
        step, width = CHUNK_BLOCKS * bs, CHUNK_BLOCKS * 32
        if tok.size and (int(tok.min()) < 0 or int(tok.max()) >= 1 << 31):
            return _fast_chain(self.algorithm, tok, bs, parent)
        ids = tok.astype(np.int32)
        done = 0
        while done + step <= tok.size:
            got = self._chunks.get((parent, ids[done:done + step].tobytes()))
            if got is None:
                break
            hits.append(got)
            parent, done = got[-32:], done + step
        if done == tok.size:
            return b"".join(hits)
        rest = _fast_chain(self.algorithm, tok[done:], bs, parent)
        if rest is None:
            if not hits:
                return None
            return b"".join(hits + self._generic(tok[done:], bs, 0, (tok.size - done) // bs,
                                                 parent, None, None, None, None))
        for k in range(0, len(rest) // 32 - CHUNK_BLOCKS + 1, CHUNK_BLOCKS):
            key = ids[done + k * bs:done + (k + CHUNK_BLOCKS) * bs].tobytes()
            self._chunks[(parent if k == 0 else rest[32 * k - 32:32 * k], key)] = rest[32 * k:32 * k + width]
        while len(self._chunks) > CACHE_CHUNKS:
            try:
                del self._chunks[next(iter(self._chunks))]
            except (KeyError, RuntimeError, StopIteration):  # another thread trimmed it
                break
        hits.append(rest)
        return b"".join(hits)

    def clear_cache(self) -> None:
        """Forget the remembered chunks (benchmarks measure the cold path with this)."""
        self._chunks.clear()

    def _generic(self, token_ids: Sequence[int] | np.ndarray, bs: int, start: int, stop: int, parent: bytes,
                 lora_name: str | None, lora_path: str | None, cache_salt: str | None,
                 extra_keys: Sequence[ExtraKeys] | None) -> list[bytes]:
        """Block by block, any extra keys (the reference path)."""
        fn = _HASH_FNS[self.algorithm]
        plain = not lora_name and not cache_salt and extra_keys is None
        out = []
        for i in range(start, stop):
            chunk = token_ids[i * bs:(i + 1) * bs]
            block = tuple(chunk.tolist() if isinstance(chunk, np.ndarray)
                          else map(operator.index, chunk))
            extra = None if plain else self._extra(i, lora_name, lora_path, cache_salt, extra_keys)
            parent = fn((parent, block, extra))
            out.append(parent)
        return out

    def _extra(self, i: int, lora_name: str | None, lora_path: str | None,
               cache_salt: str | None, extra_keys: Sequence[ExtraKeys] | None) -> ExtraKeys:
        tagged = self.strategy == "vllm_v1_tagged"
        keys: list[object] = []
        if lora_name:
            keys.append(("lora", lora_name, lora_path or "") if tagged else lora_name)
        if extra_keys is not None and i < len(extra_keys) and extra_keys[i]:
            keys.extend(extra_keys[i] or ())
        if cache_salt and i == 0:
            keys.append(("cache_salt", cache_salt) if tagged else cache_salt)
        return tuple(keys) if keys else None

    def event_hashes(self, token_ids: Sequence[int], block_size: int, **kw: object) -> HashStream:
        """Like :meth:`digests` but yields the 64-bit event projections (index keys)."""
        return HashStream(map(low64_all, self._blobs(token_ids, block_size, **kw)))  # type: ignore[arg-type]  # bytes digests


class HashStream:
    """The event hashes of a prompt, computed batch by batch as they are consumed (a walk that
    stops early saves hashing). Iterate it for the hashes, or take :meth:`batches` for the same
    hashes as lists (the index walks a list at a time). Single use, either way."""

    __slots__ = ("_batches",)

    def __init__(self, batches: Iterator[list[int]]) -> None:
        self._batches = batches

    def __iter__(self) -> Iterator[int]:
        return chain.from_iterable(self._batches)

    def batches(self) -> Iterator[list[int]]:
        """The hashes in lists of growing length (64, then 8 times more each)."""
        return self._batches
