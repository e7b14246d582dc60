"""The unified parallel tensor calls (``*_tensor_with_parallelism*``): TP / DP / EP / PP shards.

Where a shard lives: the non-TP axes name a *group* (``"{key}@dp1of2@pp0of2s7"``, axes in the
fixed order dp, ep, pp, so the order the caller lists them in does not matter); a TP shard of
rank ``r`` is ``"{group}_tp_{r}"`` (for TP alone that is the legacy ``"{key}_tp_{r}"``); a
shard without a TP axis is the group key itself; no parallelism is the plain key.

Writes: with a single TP axis the tensor given is the shard (Mooncake's compatibility rule);
with TP and other axes, or with ``writer_partition=(rank, size, split_dim)``, the tensor given
is the full one and the shard is ``tensor.chunk(size, split_dim)[rank]``. Each TP shard's header
records its TP size, rank and split dim, so reads need no other object.

Reads (``ReadTarget``): ``as_stored`` (default) returns the object named by the target's
parallelism (or the plain key); ``shard`` returns that shard, rebuilt from the stored shards
when they were cut for another TP size; ``full`` concatenates a group's TP shards along their
split dim (or returns the plain object). Bad axes (unknown or repeated kind, rank outside the
size, a split_dim on DP/EP/PP, TP without one, EP without expert_id) or a parallelism together
with a writer_partition are INVALID_PARAMS (-600); a read that cannot be served returns None.

A mixin of ``MooncakeDistributedStore`` (through ``mooncake_tensor.TensorMixin``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from kvplane.compat import mooncake_tensor_format as fmt
from kvplane.compat.mooncake_types import INVALID_PARAMS, ReplicateConfig
from kvplane.transfer.memory import view_at

log = logging.getLogger(__name__)


def group_key(key: str, axes: list[Any]) -> str:
    """The key of the shard group the non-TP axes name."""
    out = key
    for kind in ("dp", "ep", "pp"):
        for a in axes:
            if a.kind == kind:
                out += f"@{kind}{a.rank}of{a.size}"
                if kind == "ep" and a.expert_id is not None:
                    out += f"e{a.expert_id}"
                if kind == "pp" and getattr(a, "stage_id", None) is not None:
                    out += f"s{a.stage_id}"
    return out


def tp_axis(axes: list[Any]) -> Any:
    return next((a for a in axes if a.kind == "tp"), None)


def _split(part: Any) -> tuple[int, int, int]:
    """(rank, size, split_dim) of a writer partition (any object with those attributes, or a
    3-tuple)."""
    if isinstance(part, (tuple, list)):
        rank, size, split = part
    else:
        rank, size, split = part.rank, part.size, part.split_dim
    return int(rank), int(size), int(split)


class ParallelMixin:
    """See the module docstring."""

    _c: Any

    # -- writes --------------------------------------------------------------------------------------
    def _parallel_payload(self, key: str, tensor: Any, parallelism: Any,
                          writer_partition: Any) -> tuple[str, bytes] | int:
        """(key, object bytes) for one unified write, or INVALID_PARAMS."""
        if parallelism is not None and writer_partition is not None:
            return INVALID_PARAMS
        if writer_partition is not None:
            rank, size, split = _split(writer_partition)
            if not 0 <= rank < size:
                return INVALID_PARAMS
            return self._shard_payload(key, tensor, rank, size, split, [], full_input=True)
        if parallelism is None:
            return key, self._payload(tensor)  # type: ignore[attr-defined]  # mixin: the store class has it
        axes = list(parallelism.axes)
        why = fmt.check_axes(axes)
        if why:
            log.error("tensor write %r: %s", key, why)
            return INVALID_PARAMS
        group = group_key(key, axes)
        tp = tp_axis(axes)
        if tp is None:
            return group, self._payload(tensor, axes=fmt.axes_tuple(parallelism))  # type: ignore[attr-defined]  # mixin
        return self._shard_payload(group, tensor, tp.rank, tp.size, tp.split_dim,
                                   fmt.axes_tuple(parallelism), full_input=len(axes) > 1)

    def _shard_payload(self, group: str, tensor: Any, rank: int, size: int, split: int,
                       axes: list[Any], full_input: bool) -> tuple[str, bytes] | int:
        if tensor.dim() == 0 or not -tensor.dim() <= split < tensor.dim():
            return INVALID_PARAMS
        split %= tensor.dim()
        gshape: tuple[int, ...] = ()
        shard = tensor
        if full_input:
            if tensor.shape[split] % size:  # a full tensor is only cut into equal shards
                return INVALID_PARAMS
            chunks = tensor.chunk(size, split)
            if len(chunks) != size:
                return INVALID_PARAMS
            shard, gshape = chunks[rank].contiguous(), tuple(int(d) for d in tensor.shape)
        head = fmt.header_for(shard, global_shape=gshape, tp_size=size, tp_rank=rank,
                              split_dim=split, axes=axes)
        return f"{group}_tp_{rank}", fmt.pack(head) + fmt.tensor_bytes(shard).tobytes()

    def _write_parallel(self, keys: Sequence[str], tensors: Sequence[Any], parallelisms: Any,
                        config: Any, partitions: Any, upsert: bool) -> list[int]:
        n = len(keys)
        if self._c is None or len(tensors) != n:
            return [INVALID_PARAMS] * n
        pars = list(parallelisms) if parallelisms is not None else [None] * n
        parts = list(partitions) if partitions is not None else [None] * n
        if len(pars) != n or len(parts) != n:
            return [INVALID_PARAMS] * n
        out, todo = [INVALID_PARAMS] * n, []
        for i in range(n):
            try:
                got = self._parallel_payload(keys[i], tensors[i], pars[i], parts[i])
            except (ValueError, TypeError, AttributeError, RuntimeError) as exc:
                log.error("tensor write %r: %s", keys[i], exc)
                continue
            if not isinstance(got, int):
                todo.append((i, got))
        if todo:
            codes = self._put_values([k for _, (k, _) in todo], [p for _, (_, p) in todo],  # type: ignore[attr-defined]  # mixin: the store class has it
                                     config, upsert)
            for (i, _), rc in zip(todo, codes):
                out[i] = rc
        return out

    def put_tensor_with_parallelism(self, key: str, tensor: Any, parallelism: Any = None,
                                    config: ReplicateConfig | None = None,
                                    writer_partition: Any = None) -> int:
        return self._write_parallel([key], [tensor], [parallelism], config, [writer_partition], False)[0]

    def upsert_tensor_with_parallelism(self, key: str, tensor: Any, parallelism: Any = None,
                                       config: ReplicateConfig | None = None,
                                       writer_partition: Any = None) -> int:
        return self._write_parallel([key], [tensor], [parallelism], config, [writer_partition], True)[0]

    def batch_put_tensor_with_parallelism(self, keys: Sequence[str], tensors_list: Sequence[Any],
                                          parallelisms: Any = None,
                                          config: ReplicateConfig | None = None,
                                          writer_partitions: Any = None) -> list[int]:
        return self._write_parallel(list(keys), list(tensors_list), parallelisms, config,
                                    writer_partitions, False)

    def batch_upsert_tensor_with_parallelism(self, keys: Sequence[str],
                                             tensors_list: Sequence[Any], parallelisms: Any = None,
                                             config: ReplicateConfig | None = None,
                                             writer_partitions: Any = None) -> list[int]:
        return self._write_parallel(list(keys), list(tensors_list), parallelisms, config,
                                    writer_partitions, True)

    def _from_buffers(self, ptrs: Sequence[int], sizes: Sequence[int]) -> list[Any]:
        return [self._tensor_at(p, n) for p, n in zip(ptrs, sizes)]  # type: ignore[attr-defined]  # mixin

    def _write_parallel_from(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int],
                             parallelisms: Any, config: Any, partitions: Any,
                             upsert: bool) -> list[int]:
        if self._c is None or not len(keys) == len(ptrs) == len(sizes):
            return [INVALID_PARAMS] * len(keys)
        tensors = self._from_buffers(ptrs, sizes)
        out = [INVALID_PARAMS] * len(keys)
        idx = [i for i, t in enumerate(tensors) if t is not None]
        pars = list(parallelisms) if parallelisms is not None else [None] * len(keys)
        parts = list(partitions) if partitions is not None else [None] * len(keys)
        if idx and len(pars) == len(parts) == len(keys):
            codes = self._write_parallel([keys[i] for i in idx], [tensors[i] for i in idx],
                                         [pars[i] for i in idx], config, [parts[i] for i in idx],
                                         upsert)
            for i, rc in zip(idx, codes):
                out[i] = rc
        return out

    def put_tensor_with_parallelism_from(self, key: str, buffer_ptr: int, size: int,
                                         parallelism: Any = None,
                                         config: ReplicateConfig | None = None,
                                         writer_partition: Any = None) -> int:
        return self._write_parallel_from([key], [buffer_ptr], [size], [parallelism], config,
                                         [writer_partition], False)[0]

    def upsert_tensor_with_parallelism_from(self, key: str, buffer_ptr: int, size: int,
                                            parallelism: Any = None,
                                            config: ReplicateConfig | None = None,
                                            writer_partition: Any = None) -> int:
        return self._write_parallel_from([key], [buffer_ptr], [size], [parallelism], config,
                                         [writer_partition], True)[0]

    def batch_put_tensor_with_parallelism_from(self, keys: Sequence[str],
                                               buffer_ptrs: Sequence[int], sizes: Sequence[int],
                                               parallelisms: Any = None,
                                               config: ReplicateConfig | None = None,
                                               writer_partitions: Any = None) -> list[int]:
        return self._write_parallel_from(keys, buffer_ptrs, sizes, parallelisms, config,
                                         writer_partitions, False)

    def batch_upsert_tensor_with_parallelism_from(self, keys: Sequence[str],
                                                  buffer_ptrs: Sequence[int],
                                                  sizes: Sequence[int], parallelisms: Any = None,
                                                  config: ReplicateConfig | None = None,
                                                  writer_partitions: Any = None) -> list[int]:
        return self._write_parallel_from(keys, buffer_ptrs, sizes, parallelisms, config,
                                         writer_partitions, True)

    # -- reads -----------------------------------------------------------------------------------------
    def _fetch(self, keys: list[str]) -> list[tuple[fmt.Header, Any] | None]:
        """Per key (header, tensor) of the stored object, or None."""
        out: list[tuple[fmt.Header, Any] | None] = []
        for data in self.get_batch(keys):  # type: ignore[attr-defined]  # mixin: the store class has it
            head = fmt.unpack(data) if data else None
            tensor = self._decode(data) if head is not None else None  # type: ignore[attr-defined]  # mixin
            out.append((head, tensor) if tensor is not None else None)  # type: ignore[arg-type]  # tensor is not None here
        return out

    def _full(self, group: str) -> Any:
        """A group's full tensor: its TP shards concatenated, or the group object itself."""
        first = self._fetch([f"{group}_tp_0"])[0]
        if first is None:
            whole = self._fetch([group])[0]
            return whole[1] if whole is not None else None
        head, t0 = first
        if head.tp_size <= 1:
            return t0
        rest = self._fetch([f"{group}_tp_{r}" for r in range(1, head.tp_size)])
        if any(r is None for r in rest):
            return None
        return fmt.torch().cat([t0, *(r[1] for r in rest)], dim=head.split_dim)  # type: ignore[index]  # rest holds found pairs

    def _read_one(self, key: str, target: Any) -> Any:
        mode = "as_stored" if target is None else getattr(target, "mode", "as_stored")
        par = None if target is None else getattr(target, "parallelism", None)
        axes = list(par.axes) if par is not None else []
        if axes and fmt.check_axes(axes):
            return None
        tp = tp_axis(axes)
        group = group_key(key, axes)
        if mode == "full":
            return self._full(group)
        if mode == "as_stored":
            if par is None:
                return self.get_tensor(key)  # type: ignore[attr-defined]  # mixin: the store class has it
            return self.get_tensor(f"{group}_tp_{tp.rank}" if tp is not None else group)  # type: ignore[attr-defined]  # mixin: the store class has it
        if mode != "shard" or par is None:
            return None
        if tp is None:
            return self.get_tensor(group)  # type: ignore[attr-defined]  # mixin: the store class has it
        direct = self._fetch([f"{group}_tp_{tp.rank}"])[0]
        if direct is not None and direct[0].tp_size == tp.size and direct[0].split_dim == tp.split_dim:
            return direct[1]
        full = self._full(group)
        if full is None:
            return None
        chunks = full.chunk(tp.size, tp.split_dim)
        return chunks[tp.rank].contiguous() if len(chunks) == tp.size else None

    def get_tensor_with_parallelism(self, key: str, target: Any = None) -> Any:
        """The tensor a ReadTarget asks for (see the module docstring), or None."""
        fmt.torch()
        if self._c is None:
            return None
        return self._read_one(key, target)

    def batch_get_tensor_with_parallelism(self, keys: Sequence[str], targets: Any = None) -> list[Any]:
        tgts = list(targets) if targets is not None else [None] * len(keys)
        if len(tgts) != len(keys):
            return [None] * len(keys)
        return [self.get_tensor_with_parallelism(k, t) for k, t in zip(keys, tgts)]

    def _into(self, tensor: Any, ptr: int, size: int) -> Any:
        """``tensor`` written into registered memory as ``[header][data]``; the view on it."""
        if tensor is None:
            return None
        data = fmt.tensor_bytes(tensor)
        total = fmt.HEADER_SIZE + len(data)
        if total > int(size):
            return None
        try:
            self._view(ptr, total)  # type: ignore[attr-defined]  # mixin: the store class has it
        except Exception:
            return None
        view = view_at(int(ptr), total)
        view[:fmt.HEADER_SIZE] = fmt.pack(fmt.header_for(tensor))
        view[fmt.HEADER_SIZE:] = data
        head = fmt.header_for(tensor)
        return fmt.tensor_from(head, view_at(int(ptr) + fmt.HEADER_SIZE, max(head.nbytes, 1)))

    def get_tensor_with_parallelism_into(self, key: str, buffer_ptr: int, size: int,
                                         target: Any = None) -> Any:
        """As ``get_tensor_with_parallelism``, the result placed in registered memory."""
        return self._into(self.get_tensor_with_parallelism(key, target), buffer_ptr, size)

    def batch_get_tensor_with_parallelism_into(self, keys: Sequence[str],
                                               buffer_ptrs: Sequence[int], sizes: Sequence[int],
                                               targets: Any = None) -> list[Any]:
        tgts = list(targets) if targets is not None else [None] * len(keys)
        if not len(keys) == len(buffer_ptrs) == len(sizes) == len(tgts):
            return [None] * len(keys)
        return [self.get_tensor_with_parallelism_into(k, p, n, t)
                for k, p, n, t in zip(keys, buffer_ptrs, sizes, tgts)]
