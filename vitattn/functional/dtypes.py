"""The compute-dtype rule of the library: half-precision inputs are computed in float32."""

from __future__ import annotations

import torch

__all__ = ["compute_dtype"]


def compute_dtype(*tensors: torch.Tensor | torch.dtype) -> torch.dtype:
    """The dtype scores, normalizers and bias factors are computed in for these inputs.

    The promoted dtype of the tensors (or dtypes) given, at least float32: float16 / bfloat16 give
    float32, float32 stays float32, float64 stays float64.
    """
    if not tensors:
        raise TypeError("compute_dtype needs at least one tensor or dtype")
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t if isinstance(t, torch.dtype) else t.dtype)
    return dtype
