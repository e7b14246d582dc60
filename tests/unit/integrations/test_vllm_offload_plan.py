"""The pure part of kvplane's OffloadingConnector backend: object names, addresses, extents."""

from __future__ import annotations

import pytest

from kvplane.common.errors import InvalidArgument
from kvplane.integrations.vllm.offload_plan import (
    LayerPages,
    ObjectNames,
    block_addresses,
    extents,
    namespace,
)

pytestmark = pytest.mark.timeout(10)


def test_names_are_chunk_major_and_fold_back_per_chunk():
    names = ObjectNames("m/float32/bs32/r0of1/off", 2)
    assert names.of([b"\x01\xff", b"\x02"]) == [
        "m/float32/bs32/r0of1/off/01ff/0", "m/float32/bs32/r0of1/off/01ff/1",
        "m/float32/bs32/r0of1/off/02/0", "m/float32/bs32/r0of1/off/02/1"]
    # a chunk is present only when every layer of it is
    assert names.per_chunk([True, True, True, False]) == [True, False]


def test_namespace_separates_model_dtype_block_size_and_rank():
    a = namespace("llama", "float16", 16, 0, 2)
    assert a == "llama/float16/bs16/r0of2/off"
    assert len({a, namespace("llama", "float32", 16, 0, 2), namespace("llama", "float16", 32, 0, 2),
                namespace("llama", "float16", 16, 1, 2), namespace("qwen", "float16", 16, 0, 2)}) == 5
    with pytest.raises(InvalidArgument):
        namespace("a/b", "float16", 16, 0, 1)
    with pytest.raises(InvalidArgument):
        namespace("m", "float16", 16, 2, 2)


def test_block_addresses_follow_each_layers_base_and_stride():
    layers = [LayerPages(base=1000, stride=100, size=64, blocks=4),
              LayerPages(base=5000, stride=200, size=64, blocks=4)]
    addrs, sizes = block_addresses([3, 0], layers)
    assert addrs == [1300, 5600, 1000, 5000]  # block-major, the order ObjectNames.of uses
    assert sizes == [64, 64, 64, 64]
    with pytest.raises(InvalidArgument):
        block_addresses([4], layers)


def test_extents_merge_views_of_one_allocation():
    # two layers interleaved in one allocation (stride 256, pages of 128 at 0 and 128) and a
    # third layer in memory of its own
    layers = [LayerPages(0x10000, 256, 128, 8), LayerPages(0x10080, 256, 128, 8),
              LayerPages(0x90000, 128, 128, 8)]
    assert extents(layers) == [(0x10000, 8 * 256), (0x90000, 8 * 128)]
    # touching spans merge too; a layer with no blocks spans nothing
    assert extents([LayerPages(0, 64, 64, 2), LayerPages(128, 64, 64, 2),
                    LayerPages(999, 64, 64, 0)]) == [(0, 256)]
