"""A sequence of blocks: its items in order, and indices into it validated once for every tool that
takes ``layers`` / ``blocks``. Where a model's blocks are is its layout's business
(:func:`vitattn.adapter.layout_of`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

from torch import nn

__all__ = ["block_indices", "chosen_blocks", "module_items"]


def module_items(container: nn.Module) -> list[nn.Module]:
    """``list(container)`` of an iterable container (``nn.Sequential``, ``nn.ModuleList``), in order and
    with repeats kept (``children()`` drops a module that stands twice)."""
    return list(cast("Iterable[nn.Module]", container))


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


def chosen_blocks(blocks: int | Iterable[int] | None, depth: int, name: str = "blocks") -> tuple[int, ...]:
    """``blocks`` as sorted indices into ``depth`` blocks: ``None`` all of them, an int that one, an empty
    iterable none; otherwise :func:`block_indices` (negative ones count from the end; errors name
    ``name``)."""
    if blocks is None:
        return tuple(range(depth))
    items = [blocks] if isinstance(blocks, int) else list(blocks)
    return block_indices(items, depth, name=name) if items else ()
