"""The Gaussian bias as the CPU row-blocked paths write it: one block of query rows at a time, in the
layout each path computes in, from the bias' separable factors (no ``N x N`` tensor).

- Rows first, ``(units, rows, N)`` (:func:`write_rows`): the entmax-1.5 path, whose threshold search
  runs along contiguous rows.
- Keys first, ``(B, N, rows)`` (:class:`ColumnBlock`): the softmax path. The query index is then the
  contiguous one of the block and of the key-major factors, so the bias is one vectorized outer product
  (rows first, the innermost run would be only ``gw`` long).

Also the numerator table these paths reuse across calls (:func:`numerator_table`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._checks import shape_str
from ..gaussian import GaussianBias

__all__ = ["ColumnBlock", "column_block", "numerator_table", "write_rows"]

_TABLE_CACHE_SIZE = 32  # grids x devices x dtypes whose numerator tables are kept
_TABLES: dict[tuple, torch.Tensor] = {}


def numerator_table(bias: GaussianBias) -> torch.Tensor:
    """:meth:`GaussianBias.numerator_table`, kept for later calls with the same grid, clamp, device and
    dtype (made outside autograd and inference mode, so that every later call can use it)."""
    key = (bias.grid_size, bias.clamp, bias.sigma.device, bias.work_dtype())
    table = _TABLES.get(key)
    if table is None:
        with torch.inference_mode(False), torch.no_grad():
            table = bias.numerator_table()
        if len(_TABLES) >= _TABLE_CACHE_SIZE:
            _TABLES.pop(next(iter(_TABLES)))
        _TABLES[key] = table
    return table


def write_rows(
    bias: GaussianBias, out: torch.Tensor, start: int, factors: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """Write rows ``start .. start + out.shape[-2]`` of the dense bias into ``out: (..., rows, N)``.

    ``factors`` are :meth:`GaussianBias.scaled_factors`, ``alpha R: (..., Np, gh)`` and
    ``C: (..., Np, gw)`` in ``out``'s dtype, with leading dims that broadcast against ``out``'s. Not
    differentiable; returns ``out``.
    """
    p = bias.num_prefix_tokens
    gh, gw = bias.grid_size
    rows = out.shape[-2]
    stop = start + rows
    if not 0 <= start <= stop <= bias.num_tokens or out.shape[-1] != bias.num_tokens:
        raise ValueError(
            f"write_rows: rows {start}..{stop} of a (B, H, {bias.num_tokens}, {bias.num_tokens}) bias do "
            f"not fit out of shape {shape_str(out)}"
        )
    ra, c = factors
    first = max(start, p)  # first patch row of the block
    if first < stop:
        patch_rows = out[..., first - start :, p:].unflatten(-1, (gh, gw))
        lo, hi = first - p, stop - p
        torch.mul(ra[..., lo:hi, :, None], c[..., lo:hi, None, :], out=patch_rows)
    # zeros after the product, which touches fresh pages in order (a column first is slow)
    if first > start:
        out[..., : first - start, :].zero_()
    if p:
        out[..., first - start :, :p].zero_()
    return out


@dataclass(frozen=True, eq=False)  # holds tensor views: identity, not elementwise, equality
class ColumnBlock:
    """One keys-first block ``out: (..., N, rows)`` of the transposed bias, ``out[..., t, s] = S[start + s,
    t]``, with the views its writes need made once (:func:`column_block`; every head reuses them)."""

    out: torch.Tensor
    start: int  # first query row of the block
    stop: int
    zeros: tuple[torch.Tensor, ...]  # prefix keys, prefix queries: bias 0
    patches: torch.Tensor | None  # (..., gh, gw, patch queries of the block); None if there are none
    lo: int  # the patch queries' range among all Np patches
    hi: int
    num_patches: int

    @property
    def rows(self) -> int:
        """Query rows in the block."""
        return self.stop - self.start

    @property
    def all_rows(self) -> bool:
        """Whether the block holds every query row (``N`` of them)."""
        return self.start == 0 and self.stop == self.out.shape[-2]

    def write(self, factors_t: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Write the block's bias from :meth:`GaussianBias.key_major_factors` ``(..., gh, Np)``,
        ``(..., gw, Np)`` (leading dims broadcast against ``out``'s); returns ``out``."""
        for view in self.zeros:
            view.zero_()
        if self.patches is not None:
            ra_t, c_t = factors_t
            if self.lo > 0 or self.hi < self.num_patches:
                ra_t, c_t = ra_t[..., self.lo : self.hi], c_t[..., self.lo : self.hi]
            torch.mul(ra_t.unsqueeze(-2), c_t.unsqueeze(-3), out=self.patches)
        return self.out


def column_block(bias: GaussianBias, out: torch.Tensor, start: int) -> ColumnBlock:
    """The :class:`ColumnBlock` of ``out: (..., N, rows)``, the keys-first bias of query rows
    ``start .. start + out.shape[-1]``."""
    p = bias.num_prefix_tokens
    gh, gw = bias.grid_size
    rows = out.shape[-1]
    stop = start + rows
    if not 0 <= start <= stop <= bias.num_tokens or out.dim() < 2 or out.shape[-2] != bias.num_tokens:
        raise ValueError(
            f"column_block: query rows {start}..{stop} of a (B, H, {bias.num_tokens}, "
            f"{bias.num_tokens}) bias, keys first, do not fit out of shape {shape_str(out)}"
        )
    first = max(start, p)  # first patch query of the block
    zeros = []
    if p:
        zeros.append(out[..., :p, :])  # prefix keys
    if first > start:
        zeros.append(out[..., p:, : first - start])  # prefix queries
    patches = out[..., p:, first - start :].unflatten(-2, (gh, gw)) if first < stop else None
    return ColumnBlock(out, start, stop, tuple(zeros), patches, first - p, stop - p, gh * gw)
