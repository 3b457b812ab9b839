"""The Triton backward's dσ, dα (Triton's CPU interpreter) against the row-blocked CPU training path.

Sets ``TRITON_INTERPRET=1`` at import when triton is not imported yet, like tests/test_kernels.py
(see there and tests/helpers.py for why, and for the child run otherwise).
"""

from __future__ import annotations

import os
import sys

if "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from vitattn.functional import GaussianBias, attention
from vitattn.functional.cpu.softmax import gaussian_softmax_attention_train

pytest.importorskip("triton")


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("prefix, grid, b", [(1, (6, 6), 2), (2, (4, 5), 1)])
def test_triton_sigma_alpha_gradients_match_the_blocked_path(prefix, grid, b):
    g = torch.Generator().manual_seed(3)
    h, d = 2, 16
    n_p = grid[0] * grid[1]
    n = prefix + n_p
    base = [torch.randn(b, h, n, d, generator=g, dtype=torch.float64) * 2 for _ in range(3)]
    base += [torch.exp(torch.randn(b, h, n_p, 2, generator=g, dtype=torch.float64) * 0.7)]
    base += [torch.rand(b, h, n_p, 1, generator=g, dtype=torch.float64) * 3]
    tri = [t.float().requires_grad_() for t in base]
    ref = [t.detach().clone().requires_grad_() for t in base]  # float64, the blocked path
    out = attention(*tri[:3], bias=GaussianBias(tri[3], tri[4], grid, prefix), backend="triton")
    expect = gaussian_softmax_attention_train(
        *ref[:3], d**-0.5, GaussianBias(ref[3], ref[4], grid, prefix), block_elements=b * n * 7
    )
    torch.testing.assert_close(out.double(), expect, atol=1e-5, rtol=1e-4)
    grad = torch.randn(expect.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(out, tri[3:], grad.float())
    want = torch.autograd.grad(expect, ref[3:], grad)
    for name, a, w in zip(("sigma", "alpha"), got, want, strict=True):
        err = ((a.double() - w).abs().max() / w.abs().max()).item()
        assert err <= 2e-5, f"d{name}: relative error {err:.2e}"
