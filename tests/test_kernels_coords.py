"""The kernels' float grid coordinates of tokens (``_common._coords_start``, ``_tiles.coords_start_small``,
``_tiles.coords_jump``, ``_tiles.small_int_to_float``) against Python's integer ``divmod`` of the token's
patch index, in Triton's interpreter (see ``tests/test_kernels.py`` for how the interpreter flag is set):
token ``i`` is patch ``i - P`` at row ``(i - P) // gw`` and column ``(i - P) % gw`` (prefix tokens: a
negative row). Drawn by hypothesis up to the Triton backend's token limit (``MAX_GAUSSIAN_TOKENS``).
"""

from __future__ import annotations

import os
import sys

if "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vitattn.kernels.backend import MAX_GAUSSIAN_TOKENS

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from vitattn.kernels._common import _coords_start  # noqa: E402
from vitattn.kernels._tiles import coords_jump, coords_start_small, small_int_to_float  # noqa: E402

interpreted = pytest.mark.triton_interpreter
BLOCK = 16


@triton.jit
def _coords_kernel(OUT, start, tile, num_prefix, grid_w, BLOCK: tl.constexpr):
    """``OUT`` float32 ``(7, BLOCK)``: rows, columns of tokens ``start + arange(BLOCK)`` by
    ``_coords_start`` (int64 tokens) and ``coords_start_small`` (int32 tokens); of tile ``tile``'s tokens
    by ``coords_jump`` from tile 0's; and ``small_int_to_float`` of the tokens."""
    offs = tl.arange(0, BLOCK)
    tok = start + offs
    r, c = _coords_start(tok.to(tl.int64), num_prefix, grid_w)
    tl.store(OUT + offs, r)
    tl.store(OUT + BLOCK + offs, c)
    r, c = coords_start_small(tok, num_prefix, grid_w)
    tl.store(OUT + 2 * BLOCK + offs, r)
    tl.store(OUT + 3 * BLOCK + offs, c)
    r0, c0 = _coords_start(offs, num_prefix, grid_w)
    r, c = coords_jump(r0, c0, tile, BLOCK, grid_w * 1.0)
    tl.store(OUT + 4 * BLOCK + offs, r)
    tl.store(OUT + 5 * BLOCK + offs, c)
    tl.store(OUT + 6 * BLOCK + offs, small_int_to_float(tok))


def _expected(tokens: torch.Tensor, prefix: int, grid_w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of ``tokens`` from Python's floor ``divmod`` of the patch index, as float32."""
    pairs = [divmod(int(t) - prefix, grid_w) for t in tokens]
    return torch.tensor([p[0] for p in pairs], dtype=torch.float32), torch.tensor(
        [p[1] for p in pairs], dtype=torch.float32
    )


@interpreted
@settings(max_examples=60, deadline=None)
@given(
    grid_w=st.integers(1, 1500),
    prefix=st.integers(0, 9),
    tile=st.integers(0, MAX_GAUSSIAN_TOKENS // BLOCK - 1),
)
def test_coordinates_match_integer_division(grid_w, prefix, tile):
    start = tile * BLOCK
    out = torch.empty(7, BLOCK, dtype=torch.float32)
    _coords_kernel[(1,)](out, start, tile, prefix, grid_w, BLOCK=BLOCK)
    tokens = torch.arange(start, start + BLOCK)
    row, col = _expected(tokens, prefix, grid_w)
    for r, c in ((out[0], out[1]), (out[2], out[3]), (out[4], out[5])):
        torch.testing.assert_close(r, row, rtol=0, atol=0)
        torch.testing.assert_close(c, col, rtol=0, atol=0)
    torch.testing.assert_close(out[6], tokens.to(torch.float32), rtol=0, atol=0)


@interpreted
def test_coordinates_at_the_token_limit():
    """The last whole tile below ``MAX_GAUSSIAN_TOKENS`` on a 1-wide and a 1447-wide grid (one prefix
    token): every helper still exact."""
    tile = MAX_GAUSSIAN_TOKENS // BLOCK - 1
    tokens = torch.arange(tile * BLOCK, (tile + 1) * BLOCK)
    for grid_w in (1, 1447):
        out = torch.empty(7, BLOCK, dtype=torch.float32)
        _coords_kernel[(1,)](out, tile * BLOCK, tile, 1, grid_w, BLOCK=BLOCK)
        row, col = _expected(tokens, 1, grid_w)
        assert torch.equal(out[2], row) and torch.equal(out[3], col)
        assert torch.equal(out[4], row) and torch.equal(out[5], col)
