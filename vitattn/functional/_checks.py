"""Argument checks shared by the functional API: every message names the argument and its shape."""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Sequence

import torch


def shape_str(t: torch.Tensor) -> str:
    """Format a tensor's shape as ``(a, b, c)``."""
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


def check_tensor(name: str, t: object) -> torch.Tensor:
    """Raise ``TypeError`` unless ``t`` is a tensor."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def check_rank(name: str, t: torch.Tensor, rank: int, layout: str) -> None:
    """Raise ``ValueError`` unless ``t`` has ``rank`` dims; ``layout`` names them, e.g. "(B, H, N, D)"."""
    check_tensor(name, t)
    if t.dim() != rank:
        raise ValueError(f"{name} must be {rank}-D {layout}, got shape {shape_str(t)}")


def check_floating(name: str, t: torch.Tensor) -> None:
    """Raise ``TypeError`` unless ``t`` holds floating-point values."""
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")


def normalize_dim(name: str, t: torch.Tensor, dim: int) -> int:
    """Return ``dim`` as a non-negative index into ``t``, or raise ``ValueError`` naming ``name``."""
    nd = max(t.dim(), 1)
    if not -nd <= dim < nd:
        raise ValueError(f"dim={dim} is out of range for {name} of shape {shape_str(t)}")
    return dim % nd


def check_broadcastable(name: str, t: torch.Tensor, target: tuple[int, ...], target_name: str) -> None:
    """Raise ``ValueError`` unless ``t`` broadcasts to ``target`` without growing it."""
    # plain integers, no torch.broadcast_shapes: this runs on every attention call
    shape = tuple(t.shape)
    fits = len(shape) <= len(target) and all(
        s in (1, n) for s, n in zip(reversed(shape), reversed(target), strict=False)
    )
    if not fits:
        raise ValueError(
            f"{name} of shape {shape_str(t)} does not broadcast to {target_name} "
            f"({', '.join(str(s) for s in target)})"
        )


def grid_pair(name: str, value: int | Sequence[int]) -> tuple[int, int]:
    """``value`` (one int, or two: rows, columns) as ``(rows, columns)``; ``ValueError`` naming ``name``.

    Items must be integers (``operator.index``: ints, integer tensors and numpy ints, not floats).
    """
    try:
        items = value if isinstance(value, Sequence) else (value, value)
        pair = tuple(operator.index(v) for v in items)
    except TypeError:
        pair = ()
    if len(pair) != 2 or min(pair) < 1:
        raise ValueError(
            f"{name} must be two positive ints (rows, columns) or one positive int, got {value!r}"
        )
    return int(pair[0]), int(pair[1])


def check_count(name: str, value: object, minimum: int = 0) -> int:
    """``value`` as an int >= ``minimum`` (``operator.index``: ints, numpy ints, integer 0-d tensors;
    not bools, floats or strings), else a ``TypeError`` / ``ValueError`` naming ``name``."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int >= {minimum}, got {value!r}")
    try:
        count = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            f"{name} must be an int >= {minimum}, got {value!r} ({type(value).__name__})"
        ) from None
    if count < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {count}")
    return int(count)


def check_scale(scale: object, head_dim: int) -> float:
    """The score scale: ``head_dim ** -0.5`` for ``None`` (1 for an empty head dim, whose scores are
    all 0), else ``scale`` as a finite float (a ``TypeError`` / ``ValueError`` naming it otherwise)."""
    if scale is None:
        return float(head_dim**-0.5) if head_dim > 0 else 1.0
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None, got {scale!r} ({type(scale).__name__})")
    if not math.isfinite(float(scale)):
        raise ValueError(f"scale must be finite, got {scale!r}")
    return float(scale)
