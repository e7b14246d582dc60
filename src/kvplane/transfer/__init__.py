"""The transfer engine: batched moves between registered memory over tcp, shm and file transports."""

from kvplane.transfer.config import EngineConfig
from kvplane.transfer.engine import TransferEngine
from kvplane.transfer.memory import ManagedBuffer
from kvplane.transfer.types import OpCode, RegionDesc, SegmentDesc, TransferRequest, TransferStatus

__all__ = [
    "EngineConfig", "ManagedBuffer", "OpCode", "RegionDesc", "SegmentDesc", "TransferEngine",
    "TransferRequest", "TransferStatus",
]
