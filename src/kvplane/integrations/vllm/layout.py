"""KVLayout: where each (block, layer) of vLLM's paged KV cache lives in memory.

Pure address arithmetic over duck-typed tensors (``data_ptr``, ``shape``, ``stride``,
``element_size``, ``untyped_storage``, ``device``); imports neither vLLM nor torch.

vLLM 0.32 allocates one backing buffer and hands ``register_kv_caches`` one ``[B, H, N, C]``
view per layer; block ``b`` of layer ``l`` starts at ``offset + l*layer_stride + b*block_stride``
(``vllm.v1.worker.utils.allocate_kv_cache``). A (block, layer) page is one object in the store,
so it must be one contiguous run of bytes: the layer-compact layouts (``LBHNC``, ``LBNHC``, the
CPU backend's) and the block-outermost ones (``BLHNC``, ``BLNHC``) are; ``LHBNC``/``BHLNC``
scatter a page into per-head runs and are refused with a clear error. Where the cache lives
(host or a device such as ``cuda:0``) travels with each region: a device region is registered
through the transfer engine's device path (the tensor itself, never a host view of its address).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvplane.common.errors import InvalidArgument
from kvplane.integrations.device_kv import MemRegion, device_of


@dataclass(frozen=True)
class LayerSpan:
    """One layer's cache: block ``b`` occupies ``[base + b*stride, +block_bytes)``.

    ``block_stride`` 0 means ``block_bytes`` (blocks back to back).
    """

    base: int
    block_bytes: int
    num_blocks: int
    block_stride: int = 0

    @property
    def stride(self) -> int:
        return self.block_stride or self.block_bytes


KVRegion = MemRegion  # one backing allocation (host or device) of the cache


tensor_device = device_of  # "" for host memory, else the tensor's device


def page_order(t: Any) -> str:
    """The physical order of a block's interior, ``""`` when it is one dense run in logical
    order (``[H, N, C]``), else the axis letters outermost first (``"NHC"`` for ``LBNHC``).

    Raises:
        InvalidArgument: the interior of a block is not one contiguous run of bytes.
    """
    dims = list(range(1, len(t.shape)))
    by_stride = sorted((d for d in dims if int(t.shape[d]) != 1), key=lambda d: int(t.stride(d)))
    expected = 1
    for d in by_stride:
        if int(t.stride(d)) != expected:
            raise InvalidArgument(
                "a KV block of this layout is not one contiguous run of bytes (strides "
                f"{tuple(int(t.stride(i)) for i in range(len(t.shape)))}, shape "
                f"{tuple(int(s) for s in t.shape)}); use a block-compact layout "
                "(VLLM_KV_CACHE_LAYOUT=LBHNC, LBNHC, BLHNC or BLNHC)")
        expected *= int(t.shape[d])
    names = "HNC" if len(dims) == 3 else "".join(chr(ord("a") + d) for d in dims)
    logical = "".join(names[d - 1] for d in dims if int(t.shape[d]) != 1)
    physical = "".join(names[d - 1] for d in reversed(by_stride))
    return "" if physical == logical else physical


class KVLayout:
    """Addresses of every block of every layer, in the connector's layer order.

    Args:
        kv_caches: vLLM's ``register_kv_caches`` argument, layer name -> tensor whose first
            dimension is the block index (host or device memory).
        layer_names: the layer order used in keys (``kv_cache_config`` group 0).

    Attributes:
        layers: one span per layer.
        regions: (address, length) of each backing allocation.
        memory: the same allocations with their device (what registration uses).
        order: the block interior's physical order ("" for ``[H, N, C]``), part of the keys.

    Raises:
        InvalidArgument: a layer is missing, a block is not one contiguous run, the layers
            disagree on device or interior order, or a layer lies outside its storage.
    """

    def __init__(self, kv_caches: Mapping[str, Any], layer_names: Sequence[str]) -> None:
        missing = [n for n in layer_names if n not in kv_caches]
        if missing:
            raise InvalidArgument(f"KV caches lack layers {missing[:3]}")
        self.layers: list[LayerSpan] = []
        self.regions: list[tuple[int, int]] = []
        self.memory: list[KVRegion] = []
        orders: set[str] = set()
        devices: set[str] = set()
        for name in layer_names:
            t = kv_caches[name]
            orders.add(page_order(t))
            devices.add(tensor_device(t))
            elem = int(t.element_size())
            page = elem
            for s in t.shape[1:]:
                page *= int(s)
            stride = int(t.stride(0)) * elem
            if stride < page:
                raise InvalidArgument(f"KV cache of {name}: blocks overlap ({stride} < {page} B)")
            n = int(t.shape[0])
            base = int(t.data_ptr())
            self.layers.append(LayerSpan(base, page, n, 0 if stride == page else stride))
            storage = t.untyped_storage()
            start, nbytes = int(storage.data_ptr()), int(storage.nbytes())
            if n and not (start <= base and base + (n - 1) * stride + page <= start + nbytes):
                raise InvalidArgument(f"KV cache of {name} reaches outside its storage")
            if all(r.addr != start for r in self.memory):
                self.memory.append(KVRegion(start, nbytes, tensor_device(t), _flat(t, nbytes)))
                self.regions.append((start, nbytes))
        if len(orders) > 1 or len(devices) > 1:
            raise InvalidArgument(f"KV cache layers differ in layout {sorted(orders)} or device "
                                  f"{sorted(devices)}")
        self.order = orders.pop() if orders else ""
        self.device = devices.pop() if devices else ""

    @classmethod
    def from_spans(cls, spans: Sequence[LayerSpan], device: str = "") -> KVLayout:
        """A layout from explicit spans (peers' layouts in PD, tests)."""
        obj = cls.__new__(cls)
        obj.layers = list(spans)
        obj.regions = [(s.base, s.stride * (s.num_blocks - 1) + s.block_bytes) for s in spans]
        obj.memory = [KVRegion(a, n, device) for a, n in obj.regions]
        obj.order = ""
        obj.device = device
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
                addrs.append(span.base + b * span.stride)
                sizes.append(span.block_bytes)
        return addrs, sizes

    def layer_addrs(self, layer: int, block_ids: Sequence[int]) -> tuple[list[int], list[int]]:
        """(addresses, sizes) of ``block_ids`` of one layer (layer-wise moves).

        Raises:
            InvalidArgument: a block id outside the cache.
        """
        span = self.layers[layer]
        bad = [b for b in block_ids if not 0 <= b < span.num_blocks]
        if bad:
            raise InvalidArgument(f"block {bad[0]} outside cache of {span.num_blocks} blocks")
        return [span.base + b * span.stride for b in block_ids], [span.block_bytes] * len(block_ids)

    def register(self, register: Callable[..., Any]) -> list[int]:
        """Register every backing allocation with ``register`` (``StoreClient.register_buffer``
        or ``TransferEngine.register_memory``); returns the registered addresses.

        Host memory registers as ``(address, length)``; device memory as its torch tensor (other
        device kinds as ``(address, length)`` with ``device=``), so the
        engine registers it through its device path (NIXL VRAM or staged copies). An engine
        without device support refuses the tensor with its own error, which is re-raised with
        the device named: nothing ever takes a host view of a device address.

        Raises:
            InvalidArgument: a device cache the engine cannot register.
        """
        out: list[int] = []
        for r in self.memory:
            if not r.device:
                register(r.addr, r.length)
                out.append(r.addr)
                continue
            if r.tensor is None:
                raise InvalidArgument(f"KV region on {r.device} has no tensor to register")
            try:
                if type(r.tensor).__module__.startswith("torch"):
                    register(r.tensor)
                else:  # another device kind (its copier registered by kind): by address
                    register((r.addr, r.length), device=r.device)
            except (InvalidArgument, TypeError) as exc:  # TypeError: takes no device=
                raise InvalidArgument(f"KV caches on {r.device} cannot be registered with this "
                                      f"transfer engine: {exc}") from exc
            out.append(r.addr)
        return out


def worker_layout(kv_caches: dict[str, Any], layer_names: list[str]) -> KVLayout:
    """The worker's layout, refusing block interiors other than ``[H, N, C]``: keys do not
    name the interior order, so such bytes would be read as another engine's layout.

    Raises:
        InvalidArgument: see ``KVLayout``, or an interior order other than ``[H, N, C]``.
    """
    layout = KVLayout(kv_caches, layer_names)
    if layout.order:
        raise InvalidArgument(f"kvplane: KV block interior {layout.order} is not supported (keys "
                              "assume [H, N, C]); use VLLM_KV_CACHE_LAYOUT=LBHNC or BLHNC")
    return layout


def _flat(t: Any, nbytes: int) -> Any:
    """A flat, contiguous view of ``t``'s whole storage (torch tensors only; else None)."""
    if tensor_device(t) == "":
        return None
    elem = int(t.element_size())
    as_strided = getattr(t, "as_strided", None)
    if as_strided is None or nbytes % elem:
        return None
    return as_strided((nbytes // elem,), (1,), 0)
