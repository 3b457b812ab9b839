"""A transformers model's attention implementation (``config._attn_implementation``): read it, switch it
(vitattn's names registered first), and compute through vitattn for the length of a ``with`` block."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from .functions import PATCHED_NAME, is_vitattn_implementation, register

__all__ = ["current_implementation", "set_implementation", "vitattn_implementation"]


def current_implementation(model: nn.Module) -> str | None:
    """The model's ``config._attn_implementation`` (None when it has none)."""
    value = getattr(getattr(model, "config", None), "_attn_implementation", None)
    return value if isinstance(value, str) else None


def set_implementation(model: nn.Module, name: str) -> None:
    """Switch the model's attention implementation to ``name`` (vitattn's names are registered first)."""
    if is_vitattn_implementation(name):
        register(name)
    setter = getattr(model, "set_attn_implementation", None)
    if callable(setter):
        setter(name)
    else:  # pragma: no cover - transformers without set_attn_implementation
        model.config._attn_implementation = name  # type: ignore[union-attr]


@contextmanager
def vitattn_implementation(model: nn.Module) -> Iterator[None]:
    """Within the block the model computes its attention through vitattn (``"vitattn"`` unless it
    already uses one of vitattn's implementations: then nothing changes); restored on exit."""
    before = current_implementation(model)
    if is_vitattn_implementation(before):
        yield
        return
    set_implementation(model, PATCHED_NAME)
    try:
        yield
    finally:
        if before is not None:
            set_implementation(model, before)
