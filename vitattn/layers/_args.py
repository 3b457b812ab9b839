"""Argument checks of the layer constructors: a ``TypeError`` / ``ValueError`` naming the argument and
its value, raised before any parameter is made (plain Python values only: nothing here touches a
tensor's values)."""

from __future__ import annotations

import math
import numbers

from ..functional._checks import check_count

__all__ = ["check_flag", "check_heads", "check_rate"]


def check_flag(name: str, value: object) -> bool:
    """``value`` as a bool; a ``TypeError`` naming ``name`` for anything else (``"False"``, 0, None)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    return value


def check_rate(name: str, value: object) -> float:
    """A dropout probability: a real number in [0, 1] (``TypeError`` / ``ValueError`` naming ``name``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float in [0, 1], got {value!r} ({type(value).__name__})")
    if not (math.isfinite(float(value)) and 0.0 <= float(value) <= 1.0):
        raise ValueError(f"{name} must be a float in [0, 1], got {value!r}")
    return float(value)


def check_heads(
    dim: object, num_heads: object, head_dim: object = None, head_dim_name: str | None = "head_dim"
) -> tuple[int, int, int]:
    """``(dim, num_heads, head_dim)`` of a multi-head layer: ints >= 1; without ``head_dim`` (None),
    ``dim`` must be divisible by ``num_heads`` and ``head_dim = dim // num_heads``. ``head_dim_name``
    is the layer's name for the head width (None: the layer takes none)."""
    dim = check_count("dim", dim, minimum=1)
    num_heads = check_count("num_heads", num_heads, minimum=1)
    if head_dim is None:
        if dim % num_heads:
            hint = f", or give {head_dim_name}" if head_dim_name else ""
            raise ValueError(f"dim ({dim}) must be divisible by num_heads ({num_heads}){hint}")
        return dim, num_heads, dim // num_heads
    return dim, num_heads, check_count(head_dim_name or "head_dim", head_dim, minimum=1)
