"""The token layout of attention maps: a patch grid and the prefix tokens before it, completed from the
token count ``N`` of the maps where the model does not say."""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..functional import grid_pair

__all__ = ["resolve_layout"]


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
