"""``mooncake.mooncake_config`` on kvplane: this name is ``kvplane.compat.mooncake_config``
itself (``MooncakeConfig``, the size and bool readers, its ``logger``)."""

import sys

from kvplane.compat import mooncake_config as _impl

sys.modules[__name__] = _impl
