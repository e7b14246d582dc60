"""A ``mooncake`` package backed by kvplane, for engines that import Mooncake's Python API.

Put this directory first on PYTHONPATH (``python -c "import kvplane.integrations.mooncake_shim as
m; print(m.PATH)"``) and ``from mooncake.store import MooncakeDistributedStore`` /
``from mooncake.engine import TransferEngine`` resolve to kvplane's compat facades, so vLLM's own
MooncakeStoreConnector runs unchanged on a kvplane master. Not imported by kvplane itself.
"""

import os

PATH = os.path.dirname(os.path.abspath(__file__))

__all__ = ["PATH"]
