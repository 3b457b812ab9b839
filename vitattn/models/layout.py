"""The token layout of a ViT: patch grid and number of prefix (class / register) tokens."""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch import nn

from ..functional import grid_pair
from ._grid import feat_size

__all__ = ["model_grid_size", "model_num_prefix_tokens", "resolve_layout"]


def model_grid_size(model: nn.Module, image_size: Sequence[int] | None = None) -> tuple[int, int] | None:
    """Patch grid ``(gh, gw)`` a timm-style ViT makes from an ``image_size = (H, W)`` input, or None.

    Uses ``patch_embed.dynamic_feat_size`` when the input size is known (so ``dynamic_img_size``
    models get the grid of each input), else ``patch_embed.grid_size``.
    """
    embed = getattr(model, "patch_embed", None)
    return None if embed is None else feat_size(embed, image_size)


def model_num_prefix_tokens(model: nn.Module) -> int | None:
    """``model.num_prefix_tokens`` (class + register tokens) of a timm-style ViT, or None."""
    p = getattr(model, "num_prefix_tokens", None)
    return None if p is None else int(p)


def resolve_layout(
    num_tokens: int, grid_size: int | Sequence[int] | None, num_prefix_tokens: int | None
) -> tuple[tuple[int, int], int]:
    """Complete ``(grid_size, num_prefix_tokens)`` for maps over ``num_tokens`` tokens.

    A missing prefix count is ``N − gh·gw``; a missing grid is the square grid of ``N − prefix``
    patches (prefix 0 if both are missing). Raises ``ValueError`` naming the numbers when they
    do not fit.
    """
    if grid_size is not None:
        grid = grid_pair("grid_size", grid_size)
        prefix = num_tokens - grid[0] * grid[1] if num_prefix_tokens is None else int(num_prefix_tokens)
        if prefix < 0 or prefix + grid[0] * grid[1] != num_tokens:
            raise ValueError(
                f"attention maps over N = {num_tokens} tokens do not match grid_size {grid} with "
                f"num_prefix_tokens={num_prefix_tokens} (needs N = prefix + {grid[0]}*{grid[1]})"
            )
        return grid, prefix
    prefix = 0 if num_prefix_tokens is None else int(num_prefix_tokens)
    side = math.isqrt(max(num_tokens - prefix, 0))
    if side < 1 or side * side != num_tokens - prefix:
        raise ValueError(
            f"cannot infer a square patch grid from N = {num_tokens} tokens with num_prefix_tokens="
            f"{prefix}: pass grid_size=(rows, columns) (and num_prefix_tokens)"
        )
    return (side, side), prefix
