"""``ops.grid_tile_lists``: the tile lists of the grid-aligned backward of entmax-1.5 (a Gaussian bias, no
window) from the forward's live map, against a brute-force reading of the same map, on layouts, tiles
and maps drawn by hypothesis. The key tiles are written out here from their description in
``docs/kernels.md`` (the prefix tokens' tiles, then the tiles of ``NR`` grid rows of each chunk of
``TILE_W`` grid columns; dQ chunk by chunk, dK/dV row by row), the map's key axis from ``ops.live_shape``'s
(the prefix tokens, then the grid padded to ``GWP`` columns from the next cell). The list kernel that
builds them in one launch runs in the interpreter (the child run when triton is compiled here).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vitattn.kernels import configs

pytest.importorskip("triton")
from vitattn.kernels import ops  # noqa: E402  (imports triton)


def key_tiles(prefix: int, gw: int, rows: int, tile_w: int, block_n: int, by_rows: bool) -> list[list[int]]:
    """The keys of each grid-aligned key tile, in the kernel's order."""
    nr = block_n // tile_w
    tiles = [list(range(j, min(j + block_n, prefix))) for j in range(0, prefix, block_n)]
    chunks, row_tiles = ops.grid_pad(gw) // tile_w, -(-rows // nr)
    order = [(rt, ch) for rt in range(row_tiles) for ch in range(chunks)]
    if not by_rows:
        order = [(rt, ch) for ch in range(chunks) for rt in range(row_tiles)]
    for rt, ch in order:
        rs = [r for r in range(rt * nr, rt * nr + nr) if r < rows]
        cs = [c for c in range(ch * tile_w, ch * tile_w + tile_w) if c < gw]
        tiles.append([prefix + r * gw + c for r in rs for c in cs])
    return tiles


def key_cell(key: int, prefix: int, gw: int, grain: int) -> int:
    if key < prefix:
        return key // grain
    r, c = divmod(key - prefix, gw)
    return (-(-prefix // grain) * grain + r * ops.grid_pad(gw) + c) // grain


def query_cells(tile: int, block_m: int, n_cells: int, grain: int) -> list[int]:
    first = tile * block_m // grain
    return [c for c in range(first, first + max(block_m // grain, 1)) if c < n_cells]


@pytest.mark.parametrize(
    "builder",
    [
        pytest.param("grid_tile_lists", id="torch"),
        pytest.param("live_grid_lists", id="kernel", marks=pytest.mark.triton_interpreter),
    ],
)
@settings(max_examples=40, deadline=None)
@given(
    prefix=st.sampled_from([0, 1, 2, 5, 33]),
    gw=st.sampled_from([1, 7, 12, 16, 20, 40, 64, 70]),
    rows=st.integers(1, 9),
    n_q=st.integers(1, 200),
    tile=st.sampled_from([(16, 64), (32, 64), (64, 64), (64, 32), (128, 64), (64, 16), (128, 32)]),
    by_keys=st.booleans(),
    density=st.sampled_from([0.0, 0.05, 0.3, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_lists_hold_the_tiles_meeting_a_marked_cell(
    builder, prefix, gw, rows, n_q, tile, by_keys, density, seed
):
    """The torch reference (``ops.grid_tile_lists``) and the list kernel (``ops.live_grid_lists``, one
    launch, run by the interpreter) against the brute-force reading."""
    block_m, block_n = tile
    n_k = prefix + rows * gw
    grain = ops.live_grain()
    b, h = 2, 1
    shape = ops.live_shape(b, h, n_q, n_k, (prefix, gw))
    live = (torch.rand(shape, generator=torch.Generator().manual_seed(seed)) < density).to(torch.uint8)
    kernel = "bwd_dkdv_entmax15" if by_keys else "bwd_dq"
    grid = ops.GridKeys(prefix, gw, kernel)
    order, count = getattr(ops, builder)(live, grid, n_q, n_k, block_m, block_n, by_keys)

    tile_w = configs.grid_tile_w(ops.grid_pad(gw), block_m, block_n, kernel)
    tiles = key_tiles(prefix, gw, rows, tile_w, block_n, by_rows=by_keys)
    n_pre = -(-prefix // block_n)
    chunks = ops.grid_pad(gw) // tile_w
    row_tiles = (len(tiles) - n_pre) // chunks
    q_tiles = -(-n_q // block_m)
    flat = live.reshape(b * h, shape[2], shape[3])
    for bh in range(b * h):
        cells = [{key_cell(k, prefix, gw, grain) for k in keys} for keys in tiles]
        marked = [
            [
                any(flat[bh, qc, kc] for qc in query_cells(qt, block_m, shape[2], grain) for kc in kcs)
                for kcs in cells
            ]
            for qt in range(q_tiles)
        ]
        if by_keys:
            for kt in range(len(tiles)):
                want = [qt for qt in range(q_tiles) if marked[qt][kt]]
                got = order[bh, kt, : count[bh, kt]].tolist()
                assert got == want, (bh, kt)
        else:
            for qt in range(q_tiles):
                sections = [range(n_pre)] + [
                    range(n_pre + ch * row_tiles, n_pre + (ch + 1) * row_tiles) for ch in range(chunks)
                ]
                for s, section in enumerate(sections):
                    want = [i for i, t in enumerate(section) if marked[qt][t]]
                    slot = qt * (chunks + 1) + s
                    got = order[bh, slot, : count[bh, slot]].tolist()
                    assert got == want, (bh, qt, s)
