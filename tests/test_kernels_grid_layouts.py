"""The grid-aligned key tiles of the list forwards (entmax-1.5 and α-entmax with a Gaussian bias, no
window) on grid layouts drawn by hypothesis, in Triton's interpreter (32 x 32 tiles, ``configs.INTERPRET``):
grid widths from 1 to 70 (padded to 16 / 32 / 64 / 128: one to four chunks of grid columns, the last ones
partly or wholly past the grid width), 0 to 34 prefix tokens (no prefix tile, one, two), grid heights that
fill the last tile of grid rows or not. Output and gradients against ``backend="reference"`` in float64
(entmax-1.5's backward: the grid-aligned kernels over the lists of its live tiles).
"""

from __future__ import annotations

import os
import sys

if "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from vitattn.functional import GaussianBias, attention

pytest.importorskip("triton")

interpreted = pytest.mark.triton_interpreter


def _check(normalizer: str, gh: int, gw: int, prefix: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    n, n_p, heads = prefix + gh * gw, gh * gw, 2
    leaves = [torch.randn(1, heads, n, 16, generator=g, dtype=torch.float64) for _ in range(3)]
    sigma = torch.exp(torch.randn(1, heads, n_p, 2, generator=g, dtype=torch.float64) * 0.5)
    amp = torch.rand(1, heads, n_p, 1, generator=g, dtype=torch.float64) * 4
    norm: str | torch.Tensor = normalizer
    if normalizer == "alpha":
        norm = torch.tensor([1.3, 1.7], dtype=torch.float64)
    ours = [t.float().requires_grad_() for t in (*leaves, sigma, amp)]
    ref = [t.detach().requires_grad_() for t in (*leaves, sigma, amp)]

    def run(ts: list[torch.Tensor], backend: str) -> torch.Tensor:
        q, k, v, s, a = ts
        nz = norm.to(q.dtype) if isinstance(norm, torch.Tensor) else norm
        return attention(q, k, v, normalizer=nz, bias=GaussianBias(s, a, (gh, gw), prefix), backend=backend)

    out, want = run(ours, "triton"), run(ref, "reference")
    torch.testing.assert_close(out.double(), want, atol=2e-5 * want.abs().max().item(), rtol=0)
    grad = torch.randn(want.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(out, ours, grad.float())
    exp = torch.autograd.grad(want, ref, grad)
    for name, a, w in zip(("q", "k", "v", "sigma", "amp"), got, exp, strict=True):
        err = ((a.double() - w).abs().max() / w.abs().max().clamp_min(1e-2)).item()  # n = 1: dq is rounding
        assert err <= 1e-4, f"d{name}: relative error {err:.2e} (grid {gh} x {gw}, prefix {prefix})"


@interpreted
@settings(max_examples=8, deadline=None)
@given(
    normalizer=st.sampled_from(["entmax15", "alpha"]),
    gw=st.sampled_from([1, 3, 7, 12, 16, 17, 33, 40, 65, 70]),
    gh=st.integers(1, 4),
    prefix=st.sampled_from([0, 1, 2, 34]),
    seed=st.integers(0, 2**16),
)
# entmax-1.5's backward lists (ops.grid_tile_lists) with a partial last tile of grid rows (dQ's 2-row tiles)
@example(normalizer="entmax15", gw=12, gh=3, prefix=1, seed=0)
def test_grid_layouts_match_reference(normalizer, gw, gh, prefix, seed):
    _check(normalizer, gh, gw, prefix, seed)
