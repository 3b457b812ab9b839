"""The Triton kernels on a real GPU (skipped without CUDA): bf16 / fp16 / fp32 at ViT sequence lengths
(197, 785, 1025 = a class token + 14², 28², 32² patches) against the reference backend in float64, plus dispatch,
dead rows and linear memory. ``benchmarks/gpu_check.sh`` runs this file.

Most cases run with ``VITATTN_TRITON_TILES=first`` (one config per kernel, so the suite compiles in
minutes); ``test_autotuned`` runs the full autotune lists. The AOT command and
``benchmarks/memcheck_kernels.py`` cover every config.
Tolerances (max-abs error relative to the reference's max-abs, forward / gradients): float32 (IEEE dots)
1e-5 / 3e-5, float16 3e-3 / 6e-3, bfloat16 2.5e-2 / 5e-2.
"""

from __future__ import annotations

import os

import pytest
import torch

from vitattn.functional import GaussianBias, attention, explain
from vitattn.functional.dispatch import AttentionCall

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(INTERPRET, reason="runs the compiled kernels (TRITON_INTERPRET is set)"),
]
pytest.importorskip("triton")

DEV = "cuda"
TOL = {torch.float32: (1e-5, 3e-5), torch.float16: (3e-3, 6e-3), torch.bfloat16: (2.5e-2, 5e-2)}
GRIDS = {197: (14, 14), 785: (28, 28), 1025: (32, 32)}


@pytest.fixture(autouse=True)
def _one_config(request, monkeypatch):
    from vitattn.kernels import ops

    if "autotuned" not in request.node.name:
        monkeypatch.setenv("VITATTN_TRITON_TILES", "first")
    yield
    ops._TUNED.clear()


def _leaves(normalizer, kind, n, d, dtype, b=2, h=3, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    ours = {
        name: (torch.randn(b, h, n, d, device=DEV, generator=g, dtype=torch.float64) * 1.5).to(dtype)
        for name in "qkv"
    }
    mask = None
    if kind.startswith("gaussian"):
        n_p = n - 1
        ours["sigma"] = torch.exp(torch.randn(b, h, n_p, 2, device=DEV, generator=g) * 0.7) * 4
        ours["alpha"] = torch.rand(b, h, n_p, 1, device=DEV, generator=g) * 3
    if kind == "add":
        ours["add"] = (torch.randn(1, h, n, n, device=DEV, generator=g) * 2).to(dtype)
    if kind in ("keep", "gaussian_keep"):
        mask = torch.rand(b, 1, n, n, device=DEV, generator=g) < 0.7
        mask[..., 0] = True
    if kind == "key_padding":
        mask = torch.ones(b, 1, 1, n, dtype=torch.bool, device=DEV)
        mask[0, ..., -17:] = False
    ours = {k: t.requires_grad_() for k, t in ours.items()}
    ref = {k: t.detach().double().requires_grad_() for k, t in ours.items()}
    return ours, ref, mask


def _kwargs(leaves, normalizer, n, mask):
    kw = dict(normalizer=normalizer, mask=mask)
    if "sigma" in leaves:
        kw["bias"] = GaussianBias(leaves["sigma"], leaves["alpha"], GRIDS[n], num_prefix_tokens=1)
    if "add" in leaves:
        kw["mask"] = leaves["add"]
    return kw


def _check(normalizer, kind, n, d, dtype, backend="triton"):
    ours, ref, mask = _leaves(normalizer, kind, n, d, dtype)
    out = attention(ours["q"], ours["k"], ours["v"], backend=backend, **_kwargs(ours, normalizer, n, mask))
    want = attention(ref["q"], ref["k"], ref["v"], backend="reference", **_kwargs(ref, normalizer, n, mask))
    fwd_tol, grad_tol = TOL[dtype]
    err = ((out.double() - want).abs().max() / want.abs().max()).item()
    assert out.dtype == dtype and err <= fwd_tol, f"out: {err:.2e}"
    grad = torch.randn(want.shape, device=DEV, dtype=torch.float64)
    got = torch.autograd.grad(out, list(ours.values()), grad.to(dtype))
    exp = torch.autograd.grad(want, list(ref.values()), grad)
    for name, a, w in zip(ours, got, exp, strict=True):
        assert torch.isfinite(a).all(), name
        err = ((a.double() - w).abs().max() / w.abs().max().clamp_min(1e-6)).item()
        assert err <= grad_tol, f"d{name}: {err:.2e} > {grad_tol:.0e}"


CASES = [
    ("softmax", "none", 197, 64, torch.bfloat16),
    ("softmax", "gaussian", 197, 64, torch.bfloat16),
    ("softmax", "gaussian_keep", 785, 64, torch.bfloat16),
    ("softmax", "add", 197, 32, torch.bfloat16),
    ("softmax", "key_padding", 1025, 128, torch.bfloat16),
    ("softmax", "gaussian", 1025, 80, torch.float16),
    ("softmax", "keep", 197, 16, torch.float32),
    ("entmax15", "none", 197, 64, torch.bfloat16),
    ("entmax15", "gaussian", 197, 64, torch.bfloat16),
    ("entmax15", "gaussian_keep", 785, 32, torch.bfloat16),
    ("entmax15", "add", 197, 64, torch.float16),
    ("entmax15", "key_padding", 1025, 128, torch.bfloat16),
    ("entmax15", "gaussian", 785, 64, torch.float32),
]


@pytest.mark.parametrize("normalizer, kind, n, d, dtype", CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_matches_reference(normalizer, kind, n, d, dtype):
    _check(normalizer, kind, n, d, dtype)


@pytest.mark.parametrize("normalizer", ["softmax", "entmax15"])
def test_autotuned(normalizer):
    _check(normalizer, "gaussian", 197, 64, torch.bfloat16, backend="auto")


def test_auto_picks_triton_on_cuda():
    q = torch.randn(2, 3, 197, 64, device=DEV, dtype=torch.bfloat16)
    call = AttentionCall(q, q, q, "softmax", 0.125, None, None, False, 0.0)
    assert explain(call)["triton"] is None
    torch.testing.assert_close(attention(q, q, q), attention(q, q, q, backend="triton"), atol=0, rtol=0)
    with pytest.raises(ValueError, match="return_weights=True"):
        attention(q, q, q, backend="triton", return_weights=True)


@pytest.mark.parametrize("normalizer", ["softmax", "entmax15"])
def test_fully_masked_rows(normalizer):
    q, k, v = (
        torch.randn(1, 2, 197, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
    )
    keep = torch.ones(1, 2, 197, 197, dtype=torch.bool, device=DEV)
    keep[0, 1, 7] = False
    keep[0, 0, 150:] = False
    out = attention(q, k, v, normalizer=normalizer, mask=keep, backend="triton")
    assert not out.isnan().any()
    assert (out[0, 1, 7] == 0).all() and (out[0, 0, 150:] == 0).all()
    grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    assert all(torch.isfinite(t).all() for t in grads)
    assert (grads[0][0, 1, 7] == 0).all()


@pytest.mark.parametrize("normalizer", ["softmax", "entmax15"])
def test_memory_is_linear_in_sequence_length(normalizer):
    n, h, d = 4097, 4, 64
    q, k, v = (
        torch.randn(1, h, n, d, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
    )
    sigma = torch.rand(1, h, n - 1, 2, device=DEV, requires_grad=True)
    alpha = torch.rand(1, h, n - 1, 1, device=DEV, requires_grad=True)
    bias = GaussianBias(sigma, alpha, (64, 64), num_prefix_tokens=1)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = attention(q, k, v, normalizer=normalizer, bias=bias, backend="triton")
    out.float().sum().backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    one_score_matrix = h * n * n * 2  # a single bf16 (1, H, N, N) tensor: 134 MB
    assert extra < one_score_matrix / 4, f"{extra / 2**20:.0f} MiB extra"
