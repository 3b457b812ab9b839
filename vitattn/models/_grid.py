"""Keep the LocAt layers of a timm ViT told the current patch grid, whatever the input size."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..functional import grid_pair
from ..layers.grid import GridAttention
from .blocks import module_items

__all__ = ["GridSync", "attach_grid_sync", "feat_size"]

_ATTR = "_vitattn_grid_sync"


def feat_size(patch_embed: nn.Module, img_size: Sequence[int] | None = None) -> tuple[int, int] | None:
    """Patch grid ``(gh, gw)`` that ``patch_embed`` makes from an ``img_size = (H, W)`` input, or None.

    ``patch_embed.dynamic_feat_size(img_size)`` when the input size is known and the embed has it
    (so ``dynamic_img_size`` models get the grid of each input), else ``patch_embed.grid_size``
    (None when the embed has neither).
    """
    dynamic = getattr(patch_embed, "dynamic_feat_size", None)
    if img_size is not None and callable(dynamic):
        gh, gw = dynamic((int(img_size[0]), int(img_size[1])))
        return int(gh), int(gw)
    grid = getattr(patch_embed, "grid_size", None)
    return None if grid is None else grid_pair("patch_embed.grid_size", tuple(int(g) for g in grid))


class GridSync:
    """Forward pre-hook on ``patch_embed``: sets the grid of every grid-aware layer in ``blocks`` (LocAt,
    neighbourhood: :class:`~vitattn.layers.grid.GridAttention`).

    Computed from the static input shape, so the same compiled graph serves one resolution and a
    new resolution (``dynamic_img_size=True``) gets its own grid before any block runs.
    """

    def __init__(self, blocks: nn.Module) -> None:
        self.blocks = blocks

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        x = args[0]
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            return
        grid = feat_size(module, (int(x.shape[-2]), int(x.shape[-1])))
        if grid is None:
            raise TypeError(f"{type(module).__name__} has neither dynamic_feat_size nor grid_size")
        for block in module_items(self.blocks):
            attn = getattr(block, "attn", None)
            if isinstance(attn, GridAttention) and attn.grid_size != grid:
                attn.set_grid(grid)


def attach_grid_sync(model: nn.Module) -> None:
    """Register :class:`GridSync` on ``model.patch_embed`` once (idempotent)."""
    if getattr(model, _ATTR, False):
        return
    sync = GridSync(model.get_submodule("blocks"))
    model.get_submodule("patch_embed").register_forward_pre_hook(sync)
    setattr(model, _ATTR, True)
