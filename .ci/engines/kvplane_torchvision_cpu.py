"""Lets PyPI's CUDA-built torchvision import next to the CPU torch wheel (engines venv only).

torchvision's compiled ops need libtorch_cuda and do not load on torch+cpu; its Python part then
fails at import because it registers fake kernels for ``torchvision::nms``/``qnms``, whose
schemas only the compiled library defines. Before the first ``import torchvision`` this defines
those two schemas (no kernels: calling them still fails), so the pure-Python transforms that
SGLang imports at module level work. Installed by .ci/setup-30-engines-venv.sh through a .pth.
"""

from __future__ import annotations

import sys

_SCHEMAS = ("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
            "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")


class _Finder:
    """A meta-path finder that only acts once, on ``torchvision``, and never finds anything."""

    done = False
    lib = None

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name != "torchvision" or cls.done:
            return None
        cls.done = True
        import torch

        if not hasattr(torch.ops.torchvision, "nms"):
            cls.lib = torch.library.Library("torchvision", "DEF")
            for schema in _SCHEMAS:
                cls.lib.define(schema)
        return None


def install() -> None:
    if not any(f is _Finder for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder)
