"""What the kernels need of a :class:`~vitattn.functional.WindowMask` (no triton import here): the key tiles
of each query tile (from the window rule's own :meth:`~vitattn.functional.WindowMask.key_span`) and, per
token, the bounds of its window and its own window coordinates (:func:`window_table`). The rule itself
lives in ``functional/window.py`` (:func:`~vitattn.functional.window.window_starts`); nothing here
restates it.

Window coordinates fold a dilation into the grid position: along an axis of dilation ``d``, position ``a``
has the coordinate ``(a mod d) * STRIDE + a // d`` (``STRIDE`` a power of two above every ``a // d``). A
query's window along the axis is ``first, first + d, ..., first + (count - 1) d``, all of the sub-grid
``first mod d``, so a key lies in it exactly when its coordinate lies in ``[c(first), c(first) + count - 1]``:
one range test per axis, dilated or not (with ``d = 1`` the coordinate is the position itself). The
kernels take that range as its centre and half-width plus 1/2: ``|coordinate - centre| - (half + 1/2)`` is
at most -1/2 inside and at least 1/2 outside, a sign the scores take without a compare
(:func:`~vitattn.kernels._tiles.window_penalty`).
"""

from __future__ import annotations

import functools

import torch

from ..functional.window import WindowMask, window_starts

__all__ = ["compact", "window_coordinate", "window_table", "window_tiles"]


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


def window_coordinate(position: torch.Tensor, dilation: int, stride: int) -> torch.Tensor:
    """The window coordinate (module docstring) of grid positions ``position`` (int64) along an axis of
    ``dilation``: ``(position mod dilation) * stride + position // dilation``."""
    return (position % dilation) * stride + position // dilation


def _stride(window: WindowMask) -> int:
    """A power of two above every ``position // dilation`` of the grid; with the dilation times it below
    ``2^24`` the coordinates are exact in float32."""
    stride = 1 << max(window.grid_size).bit_length()
    if max(window.dilation) * stride >= 1 << 24:
        raise ValueError(f"window: grid {window.grid_size} with dilation {window.dilation} is too large")
    return stride


def _axis_table(size: int, kernel: int, dilation: int, stride: int) -> torch.Tensor:
    """float32 ``(3, size)`` along one axis: per position the centre and the half-width plus 1/2 of its
    window's range of window coordinates, and its own coordinate."""
    starts = window_starts(size, kernel, dilation)
    first = window_coordinate(torch.tensor([f for f, _ in starts]), dilation, stride).double()
    count = torch.tensor([c for _, c in starts], dtype=torch.float64)
    own = window_coordinate(torch.arange(size), dilation, stride).double()
    return torch.stack([first + (count - 1) / 2, count / 2, own]).to(torch.float32)


@functools.lru_cache(maxsize=64)
def _table_cpu(window: WindowMask) -> torch.Tensor:
    (gh, gw), (kh, kw), (dh, dw) = window.grid_size, window.window, window.dilation
    stride = _stride(window)
    rows, cols = _axis_table(gh, kh, dh, stride), _axis_table(gw, kw, dw, stride)
    ctr_r, half_r, own_r = rows.repeat_interleave(gw, dim=1)
    ctr_c, half_c, own_c = cols.repeat(1, gh)
    patch = torch.stack([ctr_r, half_r, ctr_c, half_c, own_r, own_c])
    inf, nan = float("inf"), float("nan")
    prefix = torch.tensor([[0.0], [inf], [0.0], [inf], [nan], [nan]]).expand(6, window.num_prefix_tokens)
    return torch.cat([prefix, patch], dim=1).contiguous()


_ON_DEVICE: dict[tuple[WindowMask, torch.device], torch.Tensor] = {}


def window_table(window: WindowMask, device: torch.device) -> torch.Tensor:
    """float32 ``(6, N)`` on ``device``, per token: rows 0-3 the centre and the half-width plus 1/2 of its
    window's range of window coordinates (module docstring) along the rows, then along the columns, rows
    4-5 its own row and column coordinate. Query ``i`` keeps key ``j`` when ``|row 4 of j - row 0 of i| <
    row 1 of i`` and ``|row 5 of j - row 2 of i| < row 3 of i`` (no sub-grid test: the coordinates hold
    it). A prefix query's half-widths are ``inf`` (it keeps everything) and a prefix key's coordinates
    NaN, which the kernels' penalty keeps (:func:`~vitattn.kernels._tiles.window_penalty`). Cached per
    device (no host copy after the first call)."""
    key = (window, device)
    found = _ON_DEVICE.get(key)
    if found is None:
        found = _ON_DEVICE[key] = _table_cpu(window).to(device)
    return found


def compact(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(LIST, CNT)`` of a tile map ``tiles`` bool ``(X, programs, inner tiles)``: per program its marked
    inner tiles first, in order, int32 ``(X, programs, inner tiles)``, and their count, int32
    ``(X, programs)``."""
    order = torch.argsort((~tiles).to(torch.uint8), dim=-1, stable=True)
    return order.to(torch.int32).contiguous(), tiles.sum(-1, dtype=torch.int32).contiguous()
