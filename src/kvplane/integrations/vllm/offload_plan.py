"""Pure parts of the kvplane backend of vLLM's OffloadingConnector: object names and addresses.

vLLM names an offloaded chunk by an ``OffloadKey`` (its block hash plus the KV-cache group index,
as bytes). kvplane stores one object per chunk and layer, named
``{namespace}/{key hex}/{layer}``, so instances with the same model, dtype, block size and
parallel layout share chunks and nothing else does. Addresses come from the worker's
canonical KV tensors: layer ``i`` of block ``b`` is ``base_i + b * stride_i`` with ``size_i`` bytes.
No vLLM, no torch, no I/O here (tests/unit/test_layering.py keeps it pure).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvplane.common.errors import InvalidArgument


@dataclass(frozen=True)
class LayerPages:
    """Where one layer's pages live in the worker's KV cache.

    Attributes:
        base: address of block 0.
        stride: bytes from one block to the next.
        size: bytes of one block's page of this layer.
        blocks: blocks in the cache.
    """

    base: int
    stride: int
    size: int
    blocks: int


@dataclass(frozen=True)
class ObjectNames:
    """The store's names for offloaded chunks.

    Attributes:
        namespace: model, dtype, block size and parallel layout (see :func:`namespace`).
        layers: layers of the offloaded KV-cache group (one object per chunk and layer).
    """

    namespace: str
    layers: int

    def of(self, keys: Sequence[bytes]) -> list[str]:
        """Object names of ``keys``, chunk-major (every layer of the first chunk, then the next)."""
        return [f"{self.namespace}/{bytes(k).hex()}/{i}" for k in keys for i in range(self.layers)]

    def per_chunk(self, found: Sequence[bool]) -> list[bool]:
        """Fold a per-object answer (in :meth:`of` order) to one per chunk: all layers present."""
        n = self.layers
        return [all(found[i:i + n]) for i in range(0, len(found), n)]


def namespace(prefix: str, dtype: str, tokens_per_block: int, rank: int, world: int) -> str:
    """The key namespace: ``{prefix}/{dtype}/bs{tokens}/r{rank}of{world}/off``.

    Raises:
        InvalidArgument: a prefix with '/' or an impossible rank.
    """
    if "/" in prefix or not 0 <= rank < world:
        raise InvalidArgument(f"bad offload namespace: prefix {prefix!r}, rank {rank} of {world}")
    return f"{prefix}/{dtype}/bs{tokens_per_block}/r{rank}of{world}/off"


def block_addresses(block_ids: Sequence[int], layers: Sequence[LayerPages]) -> tuple[list[int], list[int]]:
    """(addresses, sizes) of ``block_ids`` x layers, in :meth:`ObjectNames.of` order.

    Raises:
        InvalidArgument: a block id outside the cache.
    """
    addrs: list[int] = []
    sizes: list[int] = []
    for b in block_ids:
        for lp in layers:
            if not 0 <= b < lp.blocks:
                raise InvalidArgument(f"block {b} outside the KV cache ({lp.blocks} blocks)")
            addrs.append(lp.base + b * lp.stride)
            sizes.append(lp.size)
    return addrs, sizes


def extents(layers: Sequence[LayerPages]) -> list[tuple[int, int]]:
    """(address, length) of the memory the layers' pages span, overlapping or touching spans
    merged (views of one allocation register once)."""
    spans = sorted((lp.base, lp.base + (lp.blocks - 1) * lp.stride + lp.size)
                   for lp in layers if lp.blocks > 0)
    out: list[list[int]] = []
    for lo, hi in spans:
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi - lo) for lo, hi in out]
