"""Block indices of a ViT (``model.blocks``), validated once for every tool that takes ``layers``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

from torch import nn

__all__ = ["block_indices", "is_transformers_model", "model_blocks", "module_items"]


def is_transformers_model(obj: object) -> bool:
    """Whether ``obj`` is a module of a class defined in ``transformers`` (or a subclass of one).

    Reads class module names only, so it never imports transformers (``import vitattn`` must not);
    such models go through :mod:`vitattn.hf`.
    """
    return isinstance(obj, nn.Module) and any(
        cls.__module__.split(".", 1)[0] == "transformers" for cls in type(obj).__mro__
    )


def module_items(container: nn.Module) -> list[nn.Module]:
    """``list(container)`` of an iterable container (``nn.Sequential``, ``nn.ModuleList``), in order and
    with repeats kept (``children()`` drops a module that stands twice)."""
    return list(cast("Iterable[nn.Module]", container))


def model_blocks(model: nn.Module, name: str = "model") -> list[nn.Module]:
    """``model.blocks`` as a list, or a ``TypeError`` naming the argument ``name``."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(model, nn.Module) or not isinstance(blocks, nn.Module):
        raise TypeError(
            f"{name} must be a timm VisionTransformer or a vitattn model (a ViT with a `blocks` "
            f"sequence), got {type(model).__name__}"
        )
    return module_items(blocks)


def block_indices(items: Iterable[object], depth: int, name: str = "layers") -> tuple[int, ...]:
    """Sorted, de-duplicated indices into ``depth`` blocks; negative ones count from the end.

    ``name`` is the caller's argument (``"layers"``, ``"blocks"``), used in the errors: ``TypeError``
    for a non-int item, ``ValueError`` for an index out of range or no index.
    """
    out = set()
    for i in items:
        if isinstance(i, bool) or not isinstance(i, int):
            raise TypeError(f"{name} must hold block indices (ints), got {i!r} of type {type(i).__name__}")
        if not -depth <= i < depth:
            blocks = "1 block" if depth == 1 else f"{depth} blocks"
            raise ValueError(f"{name.rstrip('s')} index {i} is out of range for a model with {blocks}")
        out.add(i % depth)
    if not out:
        raise ValueError(f"{name} is empty: give block indices, or None for the default")
    return tuple(sorted(out))
