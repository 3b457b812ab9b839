"""Fused Triton kernels of :func:`vitattn.functional.attention` (forward and backward).

Variants: normalizer (softmax, entmax-1.5) x bias (none, in-kernel Gaussian GAug bias, additive float
mask, boolean / key-padding mask, and their combinations) x pass (forward, backward dK/dV, backward
dQ with the bias gradients). See ``docs/kernels.md``.

Nothing here imports triton at import time: :func:`register` adds the ``"triton"`` backend, whose
``unsupported()`` checks the device first, and the kernels are imported on first use.
"""

from __future__ import annotations

__all__ = ["register"]


def register() -> None:
    """Register the ``"triton"`` backend ahead of the others for ``backend="auto"``."""
    from ..functional.dispatch import register_backend
    from .backend import TritonBackend

    register_backend(TritonBackend(), prefer=True)
