"""What the kernels need of a :class:`~vitattn.functional.WindowMask` (no triton import here): the key tiles
of each query tile (from the window rule's own :meth:`~vitattn.functional.WindowMask.key_span`) and, per
query token, the bounds of its window on the grid. The rule itself lives in ``functional/window.py``
(:func:`~vitattn.functional.window.window_starts`); nothing here restates it.
"""

from __future__ import annotations

import functools

import torch

from ..functional.window import WindowMask, window_starts

__all__ = ["compact", "window_bounds", "window_tiles"]


@functools.lru_cache(maxsize=256)
def window_tiles(window: WindowMask, block_m: int, block_n: int) -> torch.Tensor:
    """bool ``(query tiles, key tiles)`` on the CPU: the key tiles of ``block_n`` keys that hold a key some
    query of the query tile of ``block_m`` queries keeps (:meth:`WindowMask.key_span`, plus the prefix keys;
    a tile holding a prefix query keeps every key tile). Tiles outside it hold no kept score."""
    n = window.num_tokens
    p = window.num_prefix_tokens
    t_q, t_k = -(-n // block_m), -(-n // block_n)
    tiles = torch.zeros(t_q, t_k, dtype=torch.bool)
    if p:
        tiles[:, : -(-p // block_n)] = True
    for i in range(t_q):
        start, stop = i * block_m, min((i + 1) * block_m, n)
        if start < p:
            tiles[i] = True
            continue
        lo, hi = window.key_span(start, stop)
        if hi > lo:
            tiles[i, lo // block_n : -(-hi // block_n)] = True
    return tiles


@functools.lru_cache(maxsize=64)
def _bounds_cpu(window: WindowMask) -> torch.Tensor:
    (gh, gw), (kh, kw), (dh, dw) = window.grid_size, window.window, window.dilation
    rows, cols = window_starts(gh, kh, dh), window_starts(gw, kw, dw)
    first_r = torch.tensor([f for f, _ in rows], dtype=torch.float32)
    last_r = first_r + torch.tensor([(c - 1) * dh for _, c in rows], dtype=torch.float32)
    first_c = torch.tensor([f for f, _ in cols], dtype=torch.float32)
    last_c = first_c + torch.tensor([(c - 1) * dw for _, c in cols], dtype=torch.float32)
    patch = torch.stack(
        [first_r.repeat_interleave(gw), last_r.repeat_interleave(gw), first_c.repeat(gh), last_c.repeat(gh)]
    )
    inf = float("inf")
    prefix = torch.tensor([[-inf], [inf], [-inf], [inf]]).expand(4, window.num_prefix_tokens)
    return torch.cat([prefix, patch], dim=1).contiguous()


_ON_DEVICE: dict[tuple[WindowMask, torch.device], torch.Tensor] = {}


def window_bounds(window: WindowMask, device: torch.device) -> torch.Tensor:
    """float32 ``(4, N)`` on ``device``: per query token the first and last grid row and the first and last
    grid column of its window (:func:`window_starts`; a prefix query keeps everything: ``-inf`` / ``inf``).
    A kept key ``(a, b)`` lies in both ranges, on the query's sub-grid (``a - first row`` a multiple of
    the row dilation, the same for columns). Cached per device (no host copy after the first call)."""
    key = (window, device)
    found = _ON_DEVICE.get(key)
    if found is None:
        found = _ON_DEVICE[key] = _bounds_cpu(window).to(device)
    return found


def compact(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(LIST, CNT)`` of a tile map ``tiles`` bool ``(X, programs, inner tiles)``: per program its marked
    inner tiles first, in order, int32 ``(X, programs, inner tiles)``, and their count, int32
    ``(X, programs)``."""
    order = torch.argsort((~tiles).to(torch.uint8), dim=-1, stable=True)
    return order.to(torch.int32).contiguous(), tiles.sum(-1, dtype=torch.int32).contiguous()
