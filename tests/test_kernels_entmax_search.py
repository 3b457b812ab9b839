"""The entmax-1.5 threshold search of the Triton forward (``vitattn/kernels/entmax15.py``): how many passes
over the keys it takes, and that it is exact.

At N = 4096 the interpreter is too slow to count passes on many rows, so :func:`search` re-states the
kernel's algorithm in numpy float32, tile by tile and block by block as the kernel runs it (the first
pass, the levels fixed by the first key block's max, the certification, the choice of the next
threshold). ``test_emulation_is_the_kernel`` runs both on the same scores at a small N in the
interpreter and requires the same passes and thresholds; the other tests count passes on drawn
Gaussian-random rows at N = 4096 with the emulation and compare its weights with the ``entmax`` package.
"""

from __future__ import annotations

import os
import sys

if "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

import entmax
import numpy as np
import pytest
import torch

try:  # imported here, under the flag set above (the emulation tests need no triton)
    import triton  # noqa: F401
except ImportError:
    pass

F32 = np.float32
NEWTON_TOL = F32(3.4526698e-04)  # the kernel's constants (entmax15.py, _common.py)
NEAR_STEP = F32(0.05)
SETTLED = F32(2.0**-21)
LEVELS = (F32(-0.25), F32(0.25))
MAX_PASSES = 32


def _newton_step(s1: np.ndarray, s2: np.ndarray) -> np.ndarray:
    norm = np.sqrt(np.maximum(s2, 1)).astype(F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        step = np.where(s1 > 0, (norm - 1) * norm / np.where(s1 > 0, s1, 1), 0)
    return np.maximum(step, 0).astype(F32)


def _closed_form(s0: np.ndarray, s1: np.ndarray, s2: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    disc = (s1 * s1 - s0 * (s2 - 1)).astype(F32)
    denom = (s1 + np.sqrt(np.maximum(disc, 0))).astype(F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        inc = np.where(denom > 0, (s2 - 1) / np.where(denom > 0, denom, 1), 0)
    return inc.astype(F32), disc >= 0


def search(y: np.ndarray, block_n: int, fold: bool = True) -> tuple[np.ndarray, np.ndarray, int]:
    """``(m, tau, passes)`` of one tile of query rows ``y: (rows, n)`` (scores in units of ``z / 2``,
    ``-inf`` where masked): the kernel's search, with the row max ``m``, the threshold ``tau`` in the
    shifted scale (the weights are :func:`_weights`; ``STAT`` is ``m + tau``) and the passes
    between the first pass and the output pass. ``fold``: the kernel without an additive mask, which
    measures the scores against ``m + tau`` (``_common.threshold_excess``); with one (``fold=False``) it
    subtracts ``m`` first."""
    rows, n = y.shape
    m = np.full(rows, -np.inf, F32)
    ref = np.zeros(rows, F32)
    sums = [[np.zeros(rows, F32) for _ in range(3)] for _ in LEVELS]
    count = np.zeros(rows, F32)
    for start in range(0, n, block_n):
        yb = y[:, start : start + block_n]
        m = np.maximum(m, yb.max(1))
        if start == 0:
            ref = np.where(m == -np.inf, 0, m).astype(F32)
        for level, (k, s1, s2) in zip(LEVELS, sums, strict=True):
            a = np.maximum(yb - (ref + level)[:, None], 0).astype(F32)
            k += (a > 0).sum(1)
            s1 += a.sum(1, dtype=F32)
            s2 += (a * a).sum(1, dtype=F32)
        count += (yb > -np.inf).sum(1)
    dead = m == -np.inf
    m = np.where(dead, 0, m).astype(F32)
    hi = (-1 / np.sqrt(np.maximum(count, 1))).astype(F32)
    tau = np.full(rows, -1, F32)
    for level, (k, s1, s2) in zip(LEVELS, sums, strict=True):
        t = (ref + level - m).astype(F32)
        inc, _ = _closed_form(k, s1, s2)
        bound = np.where(s2 >= 1, t + _newton_step(s1, s2), np.where(s1 > 0, t + inc, -1))
        tau = np.maximum(tau, bound).astype(F32)
    tau = np.minimum(tau, hi)
    done, fin, passes = dead.copy(), tau.copy(), 0
    inc = np.zeros(rows, F32)
    while True:
        d = _above_threshold(y, m, tau, fold)
        g = np.maximum(d, 0)
        s0, s1, s2 = (g > 0).sum(1).astype(F32), g.sum(1, dtype=F32), (g * g).sum(1, dtype=F32)
        near = np.abs(d).min(1)
        passes += 1
        live = ~done
        inc, valid = _closed_form(s0, s1, s2)
        step = _newton_step(s1, s2)
        exact = live & (near > np.abs(inc))
        small = live & (((step <= NEWTON_TOL) & (s2 >= 1)) | (np.abs(inc) <= SETTLED))
        fin = np.where(exact | small, tau + inc, fin).astype(F32)
        done = done | exact | small
        closed = (s2 < 1) | (valid & (step < NEAR_STEP))
        nxt = np.minimum(np.maximum(np.where(closed, tau + inc, tau + step), -1), hi)
        tau = np.where(done, tau, nxt).astype(F32)
        if done.all() or passes >= MAX_PASSES:
            break
    fin = np.where(done, fin, tau + inc).astype(F32)
    return m, np.where(dead, np.inf, fin).astype(F32), passes


def _above_threshold(y: np.ndarray, m: np.ndarray, tau: np.ndarray, fold: bool) -> np.ndarray:
    """``y - m - tau`` in float32 as the kernel forms it: ``y - (m + tau)`` with ``fold``, else
    ``(y - m) - tau``."""
    if fold:
        return (y - (m + tau).astype(F32)[:, None]).astype(F32)
    return ((y - m[:, None]).astype(F32) - tau[:, None]).astype(F32)


def _weights(y: np.ndarray, m: np.ndarray, tau: np.ndarray, fold: bool = True) -> np.ndarray:
    """The output pass' weights ``(y - m - tau)_+^2`` (:func:`_above_threshold`)."""
    return np.maximum(_above_threshold(y, m, tau, fold), 0).astype(np.float64) ** 2


def _gaussian_scores(rows: int, n: int, sd: float, seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((rows, n)) * sd).astype(F32)


@pytest.mark.slow
@pytest.mark.parametrize("sd", [1.0, 2.0, 4.0])
@pytest.mark.parametrize("block_m", [64, 128])
def test_at_most_four_passes_on_gaussian_random_rows(block_m, sd):
    """Gaussian-random scores at N = 4096 (sd 1: the scaled scores of unit-variance q and k; sharper
    rows), tiles of 64 or 128 rows, keys in blocks of 64: every tile is done within 4 passes (the former
    search, Newton from a mean bound, took 4-5), and the weights are the ``entmax`` package's. (Flatter
    rows, sd 0.5, take 4-5: docs/kernels.md.)"""
    n = 4096
    for tile in range(3):
        z = _gaussian_scores(block_m, n, sd, seed=1000 * tile + block_m)
        y = z / 2
        m, tau, passes = search(y, block_n=64)
        assert passes <= 4, f"tile {tile}: {passes} passes"
        want = entmax.entmax15(torch.from_numpy(z).double(), dim=-1).numpy()
        np.testing.assert_allclose(_weights(y, m, tau), want, rtol=0, atol=2e-6)


@pytest.mark.slow
@pytest.mark.parametrize("fill", [-1e4, -1e6, float(np.finfo(np.float32).min)])
def test_rows_masked_by_large_finite_values_are_exact(fill):
    """Rows masked partly or entirely by a large finite value: the search runs on max-shifted scores, so
    such a row converges like any other and its weights are the ``entmax`` package's."""
    z = _gaussian_scores(64, 1000, 1.0, seed=7)
    z[3] += fill  # a whole row
    z[5, 100:] += fill  # most of a row
    z[9, ::2] = -np.inf
    y = (z / 2).astype(F32)
    m, tau, passes = search(y, block_n=64, fold=False)  # an additive mask: the kernel does not fold
    assert passes <= 6
    shifted = torch.from_numpy(z).double()
    shifted[3] = torch.from_numpy(z[3] - fill).double()  # shift invariance: the unmasked scores
    if fill == float(np.finfo(np.float32).min):
        shifted[3] = 0.0  # finfo.min swallows the scores: a uniform row, as in float32
    want = entmax.entmax15(shifted, dim=-1).numpy()
    np.testing.assert_allclose(_weights(y, m, tau, fold=False), want, rtol=0, atol=2e-6)


@pytest.mark.slow
@pytest.mark.triton_interpreter
def test_emulation_is_the_kernel(monkeypatch):
    """The kernel in the interpreter and :func:`search` on the same scores (dyadic q and k: exact in
    float32 on both sides), 16 tiles of 32 rows, N = 300 in blocks of 32, sharper and flatter rows:
    the same number of passes and the same threshold per row."""
    pytest.importorskip("triton")
    from vitattn.kernels import configs, ops

    ops.kernels()
    module = sys.modules["vitattn.kernels.entmax15"]
    tile = configs.INTERPRET
    n, d = 300, 16
    for mag in (0.5, 1.0, 2.0, 3.0):
        for seed in range(4):  # 16 tiles: a change of the search's start or rules shows in some count
            g = torch.Generator().manual_seed(seed)
            q = (torch.randint(-4, 5, (1, 1, tile.block_m, d), generator=g) / 4 * mag).float()
            k = (torch.randint(-4, 5, (1, 1, n, d), generator=g) / 4 * mag).float()
            v = torch.randn(1, 1, n, d, generator=g)
            calls: list[int] = []

            def counted(*args, inner=module.listed_scores, calls=calls, **kwargs):
                calls.append(1)
                return inner(*args, **kwargs)

            monkeypatch.setattr(module, "listed_scores", counted)
            scale = 0.125
            _, stat, *_ = torch.ops.vitattn.attention_fwd(
                q, k, v, None, None, None, None, None, scale, 0, 1, 0.0, True, False, False
            )
            monkeypatch.undo()
            blocks = -(-n // tile.block_n)
            kernel_passes = len(calls) // blocks - 2
            y = ((q[0, 0] @ k[0, 0].T) * (scale * 0.5)).numpy().astype(F32)
            m, tau, passes = search(y, tile.block_n)
            assert kernel_passes == passes, (mag, seed, kernel_passes, passes)
            np.testing.assert_allclose(stat[0, 0].numpy(), m + tau, rtol=0, atol=1e-6)
