"""A :class:`~vitattn.functional.WindowMask` applied to one block of scores at a time: ``-inf`` written where
a query's window drops a key, from the window's per-axis tables (no ``N x N`` mask).

For the patch queries of a block, :class:`WindowRows` holds which key rows and key columns each one
drops (``(rows, gh)`` and ``(rows, gw)`` bool, read from the axis tables); a block's patch-key x
patch-query part is filled with ``-inf`` in two broadcast passes, rows of the grid then columns, in
the layout of each path: rows first ``(units, rows, N)`` (entmax-1.5, :meth:`WindowRows.fill_rows`)
or keys first ``(B, N, rows)`` (softmax, :meth:`WindowRows.fill_columns`). Prefix queries and prefix
keys are never touched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..window import WindowMask

__all__ = ["WindowRows", "window_rows"]

_NEG_INF = float("-inf")


@dataclass(frozen=True, eq=False)
class WindowRows:
    """What the window drops for query rows ``start .. stop`` of a block: ``skip`` prefix queries first,
    then, per patch query, ``drop_rows: (rows', gh)`` and ``drop_cols: (rows', gw)`` (``True``: that key
    row / column is outside the query's window). ``None`` tables: the block holds no patch query."""

    window: WindowMask
    skip: int  # prefix queries at the start of the block
    drop_rows: torch.Tensor | None
    drop_cols: torch.Tensor | None

    def fill_rows(self, z: torch.Tensor) -> torch.Tensor:
        """``-inf`` into the dropped scores of a rows-first block ``z: (..., rows, N)``; returns ``z``."""
        if self.drop_rows is None or self.drop_cols is None:
            return z
        p = self.window.num_prefix_tokens
        patches = z[..., self.skip :, p:].unflatten(-1, self.window.grid_size)  # (..., rows', gh, gw)
        patches.masked_fill_(self.drop_rows[:, :, None], _NEG_INF)
        patches.masked_fill_(self.drop_cols[:, None, :], _NEG_INF)
        return z

    def fill_columns(self, e: torch.Tensor) -> torch.Tensor:
        """``-inf`` into the dropped scores of a keys-first block ``e: (..., N, rows)``; returns ``e``."""
        if self.drop_rows is None or self.drop_cols is None:
            return e
        p = self.window.num_prefix_tokens
        patches = e[..., p:, self.skip :].unflatten(-2, self.window.grid_size)  # (..., gh, gw, rows')
        patches.masked_fill_(self.drop_rows.t()[:, None, :], _NEG_INF)
        patches.masked_fill_(self.drop_cols.t()[None, :, :], _NEG_INF)
        return e


def window_rows(window: WindowMask, start: int, stop: int, device: torch.device) -> WindowRows:
    """The :class:`WindowRows` of query rows ``start .. stop`` (made once per block of a call)."""
    p = window.num_prefix_tokens
    gw = window.grid_size[1]
    first = max(start, p)
    if not 0 <= start <= stop <= window.num_tokens:
        raise ValueError(f"window_rows: query rows {start}..{stop} of N = {window.num_tokens} tokens")
    if first >= stop:
        return WindowRows(window, stop - start, None, None)
    keep_rows, keep_cols = window.axis_tables(device)
    s = torch.arange(first - p, stop - p, device=device)
    return WindowRows(window, first - start, ~keep_rows[s // gw], ~keep_cols[s % gw])
