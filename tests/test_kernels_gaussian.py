"""The Gaussian-bias helpers of the Triton kernels (``vitattn/kernels/_common.py``) in the interpreter,
against the library's one statement of the exponent, :func:`vitattn.functional.gaussian.gaussian_exponent`
(the per-axis exponent ``max(max(-offset^2 / 2, clamp) / den, -40)``, floor included), and the float
grid coordinates the key loops carry from tile to tile, against integer division.
"""

from __future__ import annotations

import math
import os
import sys

if "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from vitattn.functional.gaussian import EXPONENT_FLOOR, LOG2E, gaussian_clamp, gaussian_exponent

triton = pytest.importorskip("triton")
tl = triton.language

from vitattn.kernels import _common  # noqa: E402  (imports triton)

interpreted = pytest.mark.triton_interpreter


@triton.jit
def _exponent_kernel(OFF, DEN, OUT, clamp, n, BLOCK: tl.constexpr):
    """``OUT = axis_exponent(OFF, *axis_coefs(DEN, clamp))`` (log2 units) on ``n`` values."""
    i = tl.arange(0, BLOCK)
    ok = i < n
    offset = tl.load(OFF + i, mask=ok, other=0.0)
    den = tl.load(DEN + i, mask=ok, other=1.0)
    coef, floor = _common.axis_coefs(den, clamp)
    tl.store(OUT + i, _common.axis_exponent(offset, coef, floor), mask=ok)


@triton.jit
def _coords_kernel(ROW, COL, n, num_prefix, grid_w, BLOCK: tl.constexpr):
    """The coordinates of tokens ``0 .. n`` as the key loops see them: started once, advanced per tile."""
    row, col = _common._coords_start(tl.arange(0, BLOCK), num_prefix, grid_w)
    step_r, step_c, gw = _common._coords_step(BLOCK, grid_w)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(ROW + offs, row, mask=offs < n)
        tl.store(COL + offs, col, mask=offs < n)
        row, col = _common._coords_advance(row, col, step_r, step_c, gw)


@interpreted
@pytest.mark.parametrize("initial_grid", [(6, 6), (14, 14), (128, 128)], ids=["grid6", "grid14", "grid128"])
def test_axis_exponent_is_gaussian_exponent(initial_grid):
    """Offsets 0..150 (either sign) against denominators from 0.05 to 200, with the clamp of small and
    large initial grids: where the clamp binds, where the -40 floor binds, and where neither does."""
    clamp = gaussian_clamp(initial_grid)
    g = torch.Generator().manual_seed(0)
    offset = torch.arange(-150, 151, dtype=torch.float32)
    den = torch.exp(torch.empty(offset.numel()).uniform_(math.log(0.05), math.log(200.0), generator=g))
    offset = offset.repeat(5)
    den = torch.cat([den, den.flip(0), den * 0 + 0.1, den * 0 + 50.0, den * 0 + 200.0])
    out = torch.empty_like(offset)
    block = triton.next_power_of_2(offset.numel())
    _exponent_kernel[(1,)](offset, den, out, clamp, offset.numel(), BLOCK=block)
    want = gaussian_exponent(offset.double(), den.double(), clamp)
    floored = want == EXPONENT_FLOOR
    clamped = (-0.5 * offset.double() ** 2) < clamp
    assert floored.any() and (~floored).any() and (clamped & ~floored).any()  # every case is there
    torch.testing.assert_close(out.double() / LOG2E, want, rtol=1e-6, atol=1e-6)
    assert (out[floored].double() / LOG2E - EXPONENT_FLOOR).abs().max() < 1e-5  # the floor itself


@interpreted
@pytest.mark.parametrize(
    ("prefix", "grid_w", "block"), [(0, 64, 64), (1, 6, 32), (2, 16, 32), (5, 3, 16), (1, 7, 128)]
)
def test_carried_coordinates_are_the_grid_position(prefix, grid_w, block):
    """Token ``i >= P`` is patch ``i - P`` at ``((i - P) // gw, (i - P) % gw)``; prefix tokens have a
    negative row. Advanced tile by tile in float, past several grid rows per tile and none."""
    n = prefix + grid_w * 9 + 5
    row, col = torch.empty(n), torch.empty(n)
    _coords_kernel[(1,)](row, col, n, prefix, grid_w, BLOCK=block)
    patch = torch.arange(n) - prefix
    assert torch.equal(row[prefix:], (patch[prefix:] // grid_w).float())
    assert torch.equal(col[prefix:], (patch[prefix:] % grid_w).float())
    assert (row[:prefix] < 0).all()


@triton.jit
def _outer_kernel(QR, QC, DEN, OUT, clamp, a0, b0, BM: tl.constexpr, NR: tl.constexpr, TW: tl.constexpr,
                  TRANS: tl.constexpr):  # fmt: skip
    """The bias ``R ⊗ C`` of one grid-aligned tile as the kernels add it: row factors of grid rows
    ``a0 .. a0 + NR - 1``, column factors of columns ``b0 .. b0 + TW - 1``, for ``BM`` queries."""
    i = tl.arange(0, BM)
    qr = tl.load(QR + i)
    qc = tl.load(QC + i)
    cr, fr = _common.axis_coefs(tl.load(DEN + 2 * i), clamp)
    cc, fc = _common.axis_coefs(tl.load(DEN + 2 * i + 1), clamp)
    r, _tr = _common.row_factors(qr - a0, cr, fr, NR)
    slot = tl.arange(0, NR * TW)
    if TRANS:
        c, _tc = _common.col_factors(qc, cc, fc, b0, TW, True)
        tile = _common.add_outer(tl.zeros([NR * TW, BM], tl.float32), tl.trans(r), c, BM, NR, TW, True)
        tl.store(OUT + slot[:, None] * BM + i[None, :], tile)
    else:
        c, _tc = _common.col_factors(qc, cc, fc, b0, TW, False)
        tile = _common.add_outer(tl.zeros([BM, NR * TW], tl.float32), r, c, BM, NR, TW, False)
        tl.store(OUT + i[:, None] * (NR * TW) + slot[None, :], tile)


@interpreted
@pytest.mark.parametrize("trans", [False, True], ids=["queries-rows", "keys-rows"])
@pytest.mark.parametrize(("rows", "width"), [(1, 32), (2, 16), (4, 16)])
def test_tile_factors_are_the_gaussian_bias(rows, width, trans):
    """``add_outer`` of ``row_factors`` and ``col_factors`` is ``exp(E_row + E_col)`` of every slot of a
    tile, slot ``(j, b)`` at grid row ``a0 + j`` and column ``b0 + b`` (the library's exponent, clamp and
    -40 floor included), in both orientations of the kernels' tiles."""
    g = torch.Generator().manual_seed(rows * width)
    bm, clamp, a0, b0 = 16, gaussian_clamp((14, 14)), 3.0, 16.0
    qr = torch.randint(0, 20, (bm,), generator=g).float()
    qc = torch.randint(0, 40, (bm,), generator=g).float()
    den = torch.exp(torch.empty(bm, 2).uniform_(math.log(0.05), math.log(60.0), generator=g))
    out = torch.empty(bm * rows * width)
    _outer_kernel[(1,)](qr, qc, den, out, clamp, a0, b0, BM=bm, NR=rows, TW=width, TRANS=trans)
    a = a0 + torch.arange(rows, dtype=torch.float64)
    b = b0 + torch.arange(width, dtype=torch.float64)
    e_row = gaussian_exponent(qr.double()[:, None] - a[None, :], den.double()[:, :1], clamp)  # (bm, rows)
    e_col = gaussian_exponent(qc.double()[:, None] - b[None, :], den.double()[:, 1:], clamp)  # (bm, width)
    want = torch.exp(e_row[:, :, None] + e_col[:, None, :]).reshape(bm, rows * width)
    got = out.double().reshape(rows * width, bm).T if trans else out.double().reshape(bm, rows * width)
    # float32: the exponents reach ~60 in log2 units, so a few ulps of them are ~4e-6 of the factor
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    assert want.min() < 1e-8 < want.max()  # far and near slots both present


@triton.jit
def _row_parts_kernel(X, SUMS, MINS, BM: tl.constexpr, BN: tl.constexpr, PARTS: tl.constexpr):
    """``row_partial_sums`` / ``row_partial_mins`` of one ``(BM, BN)`` tile, stored ``(BM, PARTS)``."""
    i = tl.arange(0, BM)
    j = tl.arange(0, BN)
    x = tl.load(X + i[:, None] * BN + j[None, :])
    p = tl.arange(0, PARTS)
    tl.store(SUMS + i[:, None] * PARTS + p[None, :], _common.row_partial_sums(x, BM, BN, PARTS))
    tl.store(MINS + i[:, None] * PARTS + p[None, :], _common.row_partial_mins(x, BM, BN, PARTS))


@interpreted
@pytest.mark.parametrize(("bn", "parts"), [(16, 8), (64, 8), (32, 1)])
def test_row_partial_sums_are_sums_per_column_residue(bn, parts):
    """Column ``c`` of a row goes to part ``c mod parts``; the parts add up to the row sum."""
    x = torch.randn(16, bn, generator=torch.Generator().manual_seed(bn + parts))
    sums, mins = torch.empty(16, parts), torch.empty(16, parts)
    _row_parts_kernel[(1,)](x, sums, mins, BM=16, BN=bn, PARTS=parts)
    residues = x.reshape(16, bn // parts, parts)  # [m, g, r] = column g * parts + r
    torch.testing.assert_close(sums, residues.sum(1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(mins, residues.amin(1))
    torch.testing.assert_close(sums.sum(1), x.sum(1), rtol=1e-5, atol=1e-5)
