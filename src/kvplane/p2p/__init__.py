"""P2P store: publish weights or files once, fetch them on many nodes, every receiver a source.

Mooncake's P2P store (checkpoint engine) on kvplane's transfer engine: chunked, hashed objects,
a tracker of holders per chunk (routes under ``/p2p`` of ``kvplane metadata``), receivers that
fetch from every holder at once and serve what they hold. See docs/p2p.md. Only ``kvplane.cli``
(and the tests' harness ``tests/support/p2p_proc.py``) import this package.
"""

from kvplane.p2p.client import TrackerClient
from kvplane.p2p.manifest import Chunk, Item, Manifest
from kvplane.p2p.node import GetResult, P2PConfig, P2PNode
from kvplane.p2p.verbs import MooncakeP2PStore

__all__ = [
    "Chunk", "GetResult", "Item", "Manifest", "MooncakeP2PStore", "P2PConfig", "P2PNode",
    "TrackerClient",
]
