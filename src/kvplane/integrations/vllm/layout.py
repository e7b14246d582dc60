"""KVLayout: where each (block, layer) of vLLM's paged KV cache lives in memory.

Pure address arithmetic over duck-typed tensors (``data_ptr``, ``shape``, ``stride``,
``element_size``, ``is_contiguous``, ``untyped_storage``); imports neither vLLM nor torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvplane.common.errors import InvalidArgument


@dataclass(frozen=True)
class LayerSpan:
    """One layer's cache: block ``b`` occupies ``[base + b*block_bytes, +block_bytes)``."""

    base: int
    block_bytes: int
    num_blocks: int


class KVLayout:
    """Addresses of every block of every layer, in the connector's layer order.

    Args:
        kv_caches: vLLM's ``register_kv_caches`` argument, layer name -> tensor whose first
            dimension is the block index (vLLM's CPU layout ``[blocks, heads, block, 2*head]``).
        layer_names: the layer order used in keys (``kv_cache_config`` group 0).

    Raises:
        InvalidArgument: a layer is missing, non-contiguous, or not block-major.
    """

    def __init__(self, kv_caches: Mapping[str, Any], layer_names: Sequence[str]) -> None:
        missing = [n for n in layer_names if n not in kv_caches]
        if missing:
            raise InvalidArgument(f"KV caches lack layers {missing[:3]}")
        self.layers: list[LayerSpan] = []
        self.regions: list[tuple[int, int]] = []
        seen: set[int] = set()
        for name in layer_names:
            t = kv_caches[name]
            if not t.is_contiguous():
                raise InvalidArgument(f"KV cache of {name} is not contiguous")
            block_bytes = int(t.stride(0)) * int(t.element_size())
            self.layers.append(LayerSpan(int(t.data_ptr()), block_bytes, int(t.shape[0])))
            storage = t.untyped_storage()
            start = int(storage.data_ptr())
            if start not in seen:
                seen.add(start)
                self.regions.append((start, int(storage.nbytes())))

    @classmethod
    def from_spans(cls, spans: Sequence[LayerSpan]) -> KVLayout:
        """A layout from explicit spans (peers' layouts in PD, tests)."""
        obj = cls.__new__(cls)
        obj.layers = list(spans)
        obj.regions = [(s.base, s.block_bytes * s.num_blocks) for s in spans]
        return obj

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def block_addrs(self, block_ids: Sequence[int]) -> tuple[list[int], list[int]]:
        """(addresses, sizes) of ``block_ids`` x layers, block-major, matching ``KeySpace.keys``.

        Raises:
            InvalidArgument: a block id outside the cache.
        """
        addrs: list[int] = []
        sizes: list[int] = []
        for b in block_ids:
            for span in self.layers:
                if not 0 <= b < span.num_blocks:
                    raise InvalidArgument(f"block {b} outside cache of {span.num_blocks} blocks")
                addrs.append(span.base + b * span.block_bytes)
                sizes.append(span.block_bytes)
        return addrs, sizes
