"""One launch builds the backward's tile lists from entmax-1.5's live-tile map.

The forward marks, per ``(b, h)``, the cells of ``live_grain`` queries x ``live_grain`` keys that hold a
non-zero weight (uint8 ``(B, H, query cells, key cells)``). Each backward pass iterates, per program (a
query tile in dQ, a key tile in dK/dV), the inner tiles that touch a marked cell. This kernel reads the map
once per program and writes that list: ``LIST[bh, program, :CNT[bh, program]]``, the live inner tiles in
increasing order (entries past the count are left as they are: no kernel reads them).

The geometry comes in as two tables of cells (int32, -1 where a tile covers fewer): ``OUTER[t, :]`` the
cells of the program's tile ``t`` along its own axis and ``INNER[t, :]`` those of inner tile ``t``, so
token tiles (a tile finer than a cell takes the cell it lies in) and grid-aligned key tiles (a tile of
grid rows, whose keys are not contiguous on the map's key axis) take the same kernel. ``SECTIONS``
(int32 ``(S, 2)``: first inner tile and count) splits each program's inner tiles into ``S`` lists of
their own, indices counted from the section's first tile (the grid-aligned dQ: its prefix tiles, then per
chunk of grid columns its tiles of grid rows); program ``g`` of the launch is tile ``g // S``, section
``g % S``. Built and tested against the torch reference in ``ops`` (``ops.tile_lists``,
``ops.grid_tile_lists``).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tile_lists_kernel(
    LIVE,
    OUTER,
    INNER,
    SECTIONS,
    LIST,
    CNT,
    s_lb,
    s_lq,
    s_lk,
    n_sections,
    n_list_cols,
    OUTER_KEYS: tl.constexpr,
    OUTER_CELLS: tl.constexpr,
    INNER_CELLS: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Program ``(g, bh)``: the list of outer tile ``g // n_sections``, section ``g % n_sections``.
    ``OUTER_KEYS``: the outer tiles are key tiles (dK/dV: the map's second cell axis is theirs)."""
    g = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    slot = bh * tl.num_programs(0) + g
    tile = g // n_sections
    section = g % n_sections
    first = tl.load(SECTIONS + 2 * section)
    count = tl.load(SECTIONS + 2 * section + 1)
    outer = tl.load(OUTER + tile * OUTER_CELLS + tl.arange(0, OUTER_CELLS))  # (OUTER_CELLS,)
    if OUTER_KEYS:
        outer_off = outer.to(tl.int64) * s_lk
    else:
        outer_off = outer.to(tl.int64) * s_lq
    base = LIVE + bh * s_lb
    row = LIST + slot * n_list_cols
    offs_c = tl.arange(0, INNER_CELLS)
    n_live = 0
    for start in range(0, count, BLOCK_T):
        t = start + tl.arange(0, BLOCK_T)
        ok_t = t < count
        inner_ptrs = INNER + (first + t)[:, None] * INNER_CELLS + offs_c[None, :]
        inner = tl.load(inner_ptrs, mask=ok_t[:, None], other=-1)  # (BLOCK_T, INNER_CELLS)
        if OUTER_KEYS:
            inner_off = inner.to(tl.int64) * s_lq
        else:
            inner_off = inner.to(tl.int64) * s_lk
        ptrs = base + outer_off[:, None, None] + inner_off[None, :, :]
        ok = (outer >= 0)[:, None, None] & (inner >= 0)[None, :, :]
        cells = tl.load(ptrs, mask=ok, other=0)  # (OUTER_CELLS, BLOCK_T, INNER_CELLS)
        marked = tl.max(tl.max(cells, 2), 0) != 0  # (BLOCK_T,)
        marks = marked.to(tl.int32)
        tl.store(row + n_live + tl.cumsum(marks, 0) - 1, t, mask=marked)
        n_live += tl.sum(marks, 0)
    tl.store(CNT + slot, n_live)
