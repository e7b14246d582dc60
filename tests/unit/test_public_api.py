"""The public surface is deliberate: pin each package's __all__ (change it on purpose only)."""

import importlib

import pytest

PINNED = {
    "kvplane": ["__version__"],
    "kvplane.transfer": ["EngineConfig", "ManagedBuffer", "OpCode", "RegionDesc", "SegmentDesc",
                         "TransferEngine", "TransferRequest", "TransferStatus"],
    "kvplane.store": ["AsyncStoreClient", "MasterConfig", "MasterServer", "ReplicateConfig",
                      "StoreClient", "StoreConfig"],
    "kvplane.kvevents": ["AllBlocksCleared", "BlockRemoved", "BlockStored", "Event", "EventBatch",
                         "Tier", "cleared", "decode_batch", "decode_seq", "encode_batch",
                         "extra_keys_of", "removed", "stored", "tier_of", "to_event_hash",
                         "tokens_of"],
    "kvplane.conductor.gateway": ["BackendSpec", "GatewayConfig"],
    "kvplane.p2p": ["Chunk", "GetResult", "Item", "Manifest", "MooncakeP2PStore", "P2PConfig",
                    "P2PNode", "TrackerClient"],
    "kvplane.compat.mooncake": ["BufferHandle", "BufferPool", "Descriptor", "DiskDescriptor",
                                "MemoryDescriptor", "MooncakeDistributedStore",
                                "MooncakeHostMemAllocator", "ObjectDataType", "ParallelAxis",
                                "QueryTaskResponse", "ReadTarget", "ReplicaDescriptor",
                                "ReplicaStatus", "ReplicateConfig", "SoftPinAction",
                                "TaskStatus", "TaskType", "TensorParallelism", "TransferEngine",
                                "TransferNotify", "TransferOpcode", "bind_to_numa_node",
                                "te_code"],
}


@pytest.mark.parametrize("module", sorted(PINNED))
def test_exported_members(module):
    mod = importlib.import_module(module)
    assert sorted(mod.__all__) == sorted(PINNED[module])
    for name in mod.__all__:
        assert hasattr(mod, name), name


def test_transport_seam_is_complete():
    """Every registered transport implements the whole Transport interface."""
    import inspect

    from kvplane.transfer.transports import TRANSPORTS, Transport

    for name in TRANSPORTS.names():
        cls = TRANSPORTS.load(name)
        assert issubclass(cls, Transport) and cls.name == name
        for meth in ("can_reach", "run", "close"):
            assert inspect.signature(getattr(cls, meth)).parameters.keys() == \
                inspect.signature(getattr(Transport, meth)).parameters.keys()
