"""vLLM-compatible prefix-cache block hashing (v1 engine), enough to match its KV events.

A block digest is ``H((parent_digest or NONE_HASH, tuple(block_tokens), extra_keys or None))``
where ``H`` is SHA-256 over pickle protocol 5 (``sha256``, vLLM's default) or over canonical CBOR
(``sha256_cbor``), and ``NONE_HASH = H(seed)`` with ``seed`` the engine's ``PYTHONHASHSEED``
string. Events carry the low 64 bits of the digest (last 8 bytes, big-endian). The next block is
chained on the **full** 32-byte digest, never on the projection. Only complete blocks are hashed.

Pure: no I/O. Must not import sockets, HTTP or anything outside the standard library.
"""

from __future__ import annotations

import hashlib
import pickle
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

from kvplane.common.errors import InvalidArgument

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
        return b"".join(map(_UINTS.__getitem__, block))  # type: ignore[arg-type]
    except KeyError:
        if len(_UINTS) > 1 << 20:
            _UINTS.clear()
        for n in block:
            if type(n) is not int or not 0 <= n < _UINT_LIMIT:
                raise TypeError("not a token id") from None
            _UINTS[n] = _cbor_head(0, n)
        return b"".join(map(_UINTS.__getitem__, block))  # type: ignore[arg-type]


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
            token_ids: prompt token ids; the trailing partial block is ignored.
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
        if block_size <= 0:
            raise InvalidArgument(f"block_size must be > 0, got {block_size}")
        if not isinstance(token_ids, list | tuple):
            token_ids = [int(t) for t in token_ids]  # numpy ints would pickle differently
        fn = _HASH_FNS[self.algorithm]
        parent = self._none_hash
        plain = not lora_name and not cache_salt and extra_keys is None
        for i in range(len(token_ids) // block_size):
            block = tuple(token_ids[i * block_size:(i + 1) * block_size])
            if plain:
                parent = fn((parent, block, None))
            else:
                extra = self._extra(i, lora_name, lora_path, cache_salt, extra_keys)
                parent = fn((parent, block, extra))
            yield parent

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

    def event_hashes(self, token_ids: Sequence[int], block_size: int, **kw: object) -> Iterator[int]:
        """Like :meth:`digests` but yields the 64-bit event projections (index keys)."""
        for d in self.digests(token_ids, block_size, **kw):  # type: ignore[arg-type]
            yield low64(d)
