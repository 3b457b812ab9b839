"""Neighbourhood attention as a mask: each patch query sees a ``kh x kw`` window of patch keys.

The window of one axis (rows, or columns), stated once for every path (:func:`window_starts`): on an
axis of ``size`` positions with window ``k`` and dilation ``d``, the positions fall into ``d``
interleaved sub-grids (those with the same ``position mod d``). A query at ``i`` lies in the sub-grid
``r = i mod d`` of ``m = ceil((size - r) / d)`` positions, at index ``i // d``; its window is the ``k``
consecutive sub-grid positions starting at index ``clamp(i // d - k // 2, 0, m - k)``, i.e. centred on
the query where it can be and shifted inward at the borders, so that every query sees exactly
``min(k, m)`` keys along the axis (for an odd ``k``, the rule of NATTEN's neighbourhood attention, dilation
included; when ``k > m`` the window is the whole sub-grid, where NATTEN refuses the call).
For an even ``k`` the window holds ``k // 2`` positions before the query and ``k // 2 - 1`` after it.

A patch query ``(i, j)`` keeps the patch key ``(a, b)`` when ``a`` is in the row window of ``i`` and
``b`` in the column window of ``j``: the keep-mask is separable, ``keep = K_row[i, a] & K_col[j, b]``,
so no path needs an ``N x N`` mask (the reference materializes one). Prefix tokens (class, register
tokens) are global: they attend to every key and every query attends to them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._checks import check_count, grid_pair

__all__ = ["WindowMask", "window_starts"]


def window_starts(size: int, window: int, dilation: int = 1) -> list[tuple[int, int]]:
    """``(first key, key count)`` of the window of every query position ``0 .. size - 1`` along one axis.

    The keys of query ``i`` are ``first, first + dilation, ..., first + (count - 1) * dilation``: the
    one statement of the window rule (see the module docstring), which every path derives from.
    """
    out = []
    for i in range(size):
        r, sub = i % dilation, i // dilation
        m = (size - r + dilation - 1) // dilation  # positions of the sub-grid of i
        count = min(window, m)
        start = min(max(sub - window // 2, 0), m - count)
        out.append((r + start * dilation, count))
    return out


def _axis_keep(size: int, window: int, dilation: int, device: torch.device) -> torch.Tensor:
    """``(size, size)`` bool: ``[i, a]`` whether key position ``a`` is in the window of query ``i``
    (:func:`window_starts`, then one vectorized comparison; plain constants under ``torch.compile``)."""
    starts = window_starts(size, window, dilation)
    first = torch.tensor([f for f, _ in starts], device=device)[:, None]
    last = first + torch.tensor([(c - 1) * dilation for _, c in starts], device=device)[:, None]
    keys = torch.arange(size, device=device)[None, :]
    return (keys >= first) & (keys <= last) & ((keys - first) % dilation == 0)


@dataclass(frozen=True)
class WindowMask:
    """A neighbourhood (sliding-window) keep-mask for one attention call, described, not materialized.

    Args:
        grid_size: patch grid ``(gh, gw)`` (or one int for a square grid).
        window: window size ``(kh, kw)`` in patches (or one int); each patch query sees
            ``min(kh, .) x min(kw, .)`` patch keys (fewer only where the grid, or its dilated
            sub-grid, is smaller than the window).
        num_prefix_tokens: class / register tokens before the patches; they attend to and are
            attended by every token.
        dilation: ``(dh, dw)`` (or one int): the window takes every ``d``-th position of the query's
            own sub-grid (see :func:`window_starts`).

    ``N = num_prefix_tokens + gh * gw`` tokens; queries and keys share the layout. Frozen and
    hashable: a constant of a compiled graph.
    """

    grid_size: tuple[int, int]
    window: tuple[int, int]
    num_prefix_tokens: int = 0
    dilation: tuple[int, int] = (1, 1)

    def __post_init__(self) -> None:
        object.__setattr__(self, "grid_size", grid_pair("grid_size", self.grid_size))
        object.__setattr__(self, "window", grid_pair("window", self.window))
        object.__setattr__(self, "dilation", grid_pair("dilation", self.dilation))
        prefix = check_count("num_prefix_tokens", self.num_prefix_tokens)
        object.__setattr__(self, "num_prefix_tokens", prefix)

    @property
    def num_tokens(self) -> int:
        """N = prefix tokens + patches."""
        return self.num_prefix_tokens + self.grid_size[0] * self.grid_size[1]

    def axis_tables(self, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``K_row: (gh, gh)`` and ``K_col: (gw, gw)`` bool, ``[query position, key position]``: the
        separable keep-mask of the patches, ``keep[(i, j), (a, b)] = K_row[i, a] & K_col[j, b]``
        (small: made on each call)."""
        dev = torch.device("cpu" if device is None else device)
        (gh, gw), (kh, kw), (dh, dw) = self.grid_size, self.window, self.dilation
        return _axis_keep(gh, kh, dh, dev), _axis_keep(gw, kw, dw, dev)

    def patch_keep(self, device: torch.device | str | None = None) -> torch.Tensor:
        """``(Np, Np)`` bool keep-mask between patches (row-major patch order)."""
        rows, cols = self.axis_tables(device)
        gh, gw = self.grid_size
        return (rows[:, None, :, None] & cols[None, :, None, :]).reshape(gh * gw, gh * gw)

    def dense(self, device: torch.device | str | None = None) -> torch.Tensor:
        """``(N, N)`` bool keep-mask (``True`` = attend): the window between patches, ``True`` in every
        row and column of a prefix token. Broadcasts against ``(B, H, N, N)`` scores."""
        p, n = self.num_prefix_tokens, self.num_tokens
        keep = self.patch_keep(device)
        if p == 0:
            return keep
        out = torch.ones(n, n, dtype=torch.bool, device=keep.device)
        out[p:, p:] = keep
        return out

    def key_span(self, start: int, stop: int) -> tuple[int, int]:
        """The flat key range ``[lo, hi)`` holding every *patch* key that a query in ``[start, stop)``
        keeps (``(0, 0)`` when the range holds no patch query). Prefix keys ``[0, num_prefix_tokens)``
        are kept by every query besides; a prefix query keeps every key.

        For a query tile this is the key-tile skip rule of a fused kernel: a key tile that lies outside
        ``[lo, hi)`` and holds no prefix key has no kept score in the tile.
        """
        p = self.num_prefix_tokens
        gh, gw = self.grid_size
        (kh, _), (dh, _) = self.window, self.dilation
        first, last = max(start, p) - p, min(stop, self.num_tokens) - p  # patch queries [first, last)
        if first >= last:
            return 0, 0
        rows = window_starts(gh, kh, dh)[first // gw : (last - 1) // gw + 1]
        lo = min(r0 for r0, _ in rows)
        hi = max(r0 + (count - 1) * dh for r0, count in rows) + 1
        return p + lo * gw, p + hi * gw

    def to_ints(self) -> list[int]:
        """``[gh, gw, num_prefix_tokens, kh, kw, dh, dw]``: the window as plain ints (custom-op operands);
        :meth:`from_ints` inverts it."""
        return [*self.grid_size, self.num_prefix_tokens, *self.window, *self.dilation]

    @classmethod
    def from_ints(cls, values: list[int] | tuple[int, ...]) -> WindowMask:
        """Inverse of :meth:`to_ints`."""
        gh, gw, p, kh, kw, dh, dw = (int(v) for v in values)
        return cls((gh, gw), (kh, kw), p, (dh, dw))
