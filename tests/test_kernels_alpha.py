"""alpha-entmax with a tensor of alphas (one per head, per batch entry or per query row) in the Triton
kernels, run in Triton's interpreter against ``backend="reference"`` in float64: the output and every
gradient, the alphas' included (see ``tests/test_kernels.py`` for how the interpreter flag is set).

Tolerances (max-abs error / reference max-abs) as in ``tests/test_kernels.py`` for the output and the
gradients of q, k, v and the bias, and for the alphas' gradient where it is ill-conditioned: it is
``beta^2 (sum dP p - sum dP q) - ...`` with ``beta = 1 / (alpha - 1)`` and ``q = g / sum g``, a
difference of nearly equal sums times ``beta^2``, so its relative error is the input rounding times about
``beta^2`` (float32 at alpha 1.3: ~1e-5; float16 inputs and output gradient: ~5e-3).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

if "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from vitattn.functional import GaussianBias, attention, explain
from vitattn.kernels.backend import TritonBackend

triton = pytest.importorskip("triton")

interpreted = pytest.mark.triton_interpreter

TOL = {  # dtype -> (forward, gradients, alpha's gradient)
    # alpha's gradient in float32: 6.0e-5 on an AMD EPYC host, under 4e-5 on the earlier ones (the
    # interpreter's float32 exp2 / log2 are numpy's, whose SIMD paths differ per CPU)
    torch.float32: (1e-5, 2e-5, 1e-4),
    torch.float16: (3e-3, 4e-3, 2e-2),
    torch.bfloat16: (2.5e-2, 4e-2, 1.5e-1),
}


@dataclass
class Case:
    alphas: tuple[float, ...]  # one per head
    kind: str = "none"  # none | gaussian | keep | add | per_row
    n: int = 37
    d: int = 16
    dtype: torch.dtype = torch.float32
    b: int = 2
    prefix: int = 1
    grid: tuple[int, int] = (6, 6)
    seed: int = 0
    grad_tol: float | None = None  # a looser gradient tolerance (alpha > 2: an infinite slope at the support)
    extra: dict = field(default_factory=dict)


def _inputs(case: Case):
    g = torch.Generator().manual_seed(case.seed)
    h = len(case.alphas)
    base = [torch.randn(case.b, h, case.n, case.d, generator=g, dtype=torch.float64) * 2 for _ in range(3)]
    ours = {name: t.to(case.dtype).requires_grad_() for name, t in zip("qkv", base, strict=True)}
    alpha = torch.tensor(case.alphas, dtype=torch.float32)
    if case.kind == "per_row":  # one alpha per batch entry and query row, broadcast over the heads
        alpha = 1.2 + 0.8 * torch.rand(case.b, 1, case.n, 1, generator=g)
    ours["alpha"] = alpha.requires_grad_()
    mask = None
    if case.kind == "gaussian":
        n_p = case.grid[0] * case.grid[1]
        ours["sigma"] = torch.exp(torch.randn(1, h, n_p, 2, generator=g) * 0.7).requires_grad_()
        ours["amp"] = (torch.rand(1, h, n_p, 1, generator=g) * 3).requires_grad_()
    if case.kind == "add":
        add = (torch.randn(1, h, case.n, case.n, generator=g) * 2).to(case.dtype)
        add[..., 3] = float("-inf")
        ours["add"] = add.requires_grad_()
    if case.kind in ("keep", "per_row"):
        mask = torch.rand(case.b, 1, case.n, case.n, generator=g) < 0.6
        mask[..., 0] = True
    ref = {k: t.detach().double().requires_grad_() for k, t in ours.items()}
    return ours, ref, mask


def _run(leaves, case: Case, mask, backend: str) -> torch.Tensor:
    kw: dict = dict(normalizer=leaves["alpha"], mask=mask)
    if "sigma" in leaves:
        kw["bias"] = GaussianBias(leaves["sigma"], leaves["amp"], case.grid, case.prefix)
    if "add" in leaves:
        kw["mask"] = leaves["add"]
    return attention(leaves["q"], leaves["k"], leaves["v"], backend=backend, **kw)


def check(case: Case) -> None:
    ours, ref, mask = _inputs(case)
    out = _run(ours, case, mask, "triton")
    expect = _run(ref, case, mask, "reference")
    fwd_tol, grad_tol, alpha_tol = TOL[case.dtype]
    grad_tol = case.grad_tol or grad_tol
    err = ((out.double() - expect).abs().max() / expect.abs().max()).item()
    assert out.dtype == case.dtype and err <= fwd_tol, f"out: relative error {err:.2e} > {fwd_tol:.0e}"
    grad = torch.randn(expect.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = torch.autograd.grad(out, list(ours.values()), grad.to(case.dtype))
    want = torch.autograd.grad(expect, list(ref.values()), grad)
    for name, a, w in zip(ours, got, want, strict=True):
        assert a.shape == w.shape and torch.isfinite(a).all(), name
        err = ((a.double() - w).abs().max() / w.abs().max().clamp_min(1e-6)).item()
        tol = alpha_tol if name == "alpha" else grad_tol
        assert err <= tol, f"d{name}: relative error {err:.2e} > {tol:.0e}"


CASES = [
    Case((1.3, 1.8)),
    Case((1.5, 2.0), "gaussian", d=32),
    # the grid-aligned key tiles: whole tiles of grid rows (no prefix), and two chunks of grid columns
    Case((1.4, 1.7), "gaussian", n=64, d=16, b=1, prefix=0, grid=(4, 16)),
    Case((1.3, 1.6), "gaussian", n=122, d=16, b=1, prefix=2, grid=(3, 40)),
    Case((1.25, 1.6), "keep", n=77, b=1),
    Case((1.4, 1.9), "add", d=24),
    Case((1.5,), "per_row", n=37, d=16),
    Case((1.2, 1.7), "none", n=130, d=64, b=1),
    Case((2.5, 3.0), grad_tol=2e-3),  # alpha > 2: bisection steps, an infinite slope at the support
    Case((1.3, 1.8), "gaussian", d=32, dtype=torch.float16),
    Case((1.3, 1.8), "keep", dtype=torch.bfloat16),
]


def _id(case: Case) -> str:
    return f"{case.kind}-{'-'.join(map(str, case.alphas))}-N{case.n}-D{case.d}-{str(case.dtype)[6:]}"


@interpreted
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_alpha_tensor_matches_reference(case):
    check(case)


@interpreted
def test_fully_masked_rows_give_zeros():
    q, k, v = (torch.randn(1, 2, 37, 16, requires_grad=True) for _ in range(3))
    alpha = torch.tensor([1.3, 1.7], requires_grad=True)
    keep = torch.rand(1, 2, 37, 37) < 0.5
    keep[..., 0] = True
    keep[0, 1, 5] = False
    out = attention(q, k, v, normalizer=alpha, mask=keep, backend="triton")
    assert torch.equal(out[0, 1, 5], torch.zeros(16)) and not out.isnan().any()
    grads = torch.autograd.grad(out.sum(), [q, k, v, alpha])
    assert all(torch.isfinite(t).all() for t in grads)
    assert torch.equal(grads[0][0, 1, 5], torch.zeros(16))


@interpreted
def test_alphas_are_checked():
    q = torch.randn(1, 2, 5, 16)
    with pytest.raises(ValueError, match="alpha must be finite and > 1"):
        attention(q, q, q, normalizer=torch.tensor([1.5, 1.0]), backend="triton")


def test_explain_on_cuda_picks_triton_for_a_tensor_of_alphas():
    """The dispatcher no longer declines a tensor normalizer for the Triton backend (fake CUDA tensors)."""
    assert "alpha_tensor" in TritonBackend.features
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(2, 3, 17, 16, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        alpha = torch.full((3,), 1.4, device="cuda", requires_grad=True)
        report = explain(q, q, q, normalizer=alpha)
        assert report.chosen == "triton", str(report)
        path = (
            "fused alpha-entmax kernels (no bias), forward + backward, "
            "vitattn::attention_fwd (the custom op when compiled, its body in eager)"
        )
        assert report.path == path
        report = explain(q, q, q, normalizer=torch.full((3,), 1.4))  # alphas on another device
        assert "normalizer (alpha) is on cpu but q is on cuda" in report["triton"]
