"""kvplane: a KVCache-centric data plane for LLM inference.

Components live in subpackages (``kvplane.transfer``, ``kvplane.store``, ...). Importing the
top-level package has no side effects.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
