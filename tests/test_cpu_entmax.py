"""The row-blocked entmax-1.5 attention (CPU path): the `entmax` package's materialized attention in
float64 and float32 on drawn shapes and blocks, gradcheck, what it keeps for the backward, its blocks
and its dispatch."""

from __future__ import annotations

import entmax as entmax_pkg
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import vitattn.functional.cpu.entmax as cpu_entmax
from vitattn.functional import GaussianBias, attention
from vitattn.functional.cpu.entmax import entmax15_attention

from .helpers import count_calls
from .reference_formulas import naive_gaug_bias


def _reference(q, k, v, scale):
    """entmax15(scale q kᵀ) v through the `entmax` package, materialized, in float64."""
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale
    return entmax_pkg.entmax15(scores, dim=-1) @ v.double()


def _leaves(b, h, nq, nk, d, dv, dtype, seed=0, mag=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, nq, d, generator=g, dtype=torch.float64) * mag
    k = torch.randn(b, h, nk, d, generator=g, dtype=torch.float64) * mag
    v = torch.randn(b, h, nk, dv, generator=g, dtype=torch.float64)
    return [t.to(dtype).requires_grad_() for t in (q, k, v)]


@st.composite
def cases(draw):
    b, h = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    nq, nk = draw(st.integers(1, 19)), draw(st.integers(1, 19))
    d, dv = draw(st.sampled_from([1, 4, 16])), draw(st.sampled_from([1, 5]))
    # None: the default (one block here); small limits force head groups and ragged row blocks
    limit = draw(st.sampled_from([None, 1, 7, 40, 2 * nq * nk, 3 * nq * nk + 1]))
    return b, h, nq, nk, d, dv, limit, draw(st.sampled_from([0.1, 0.5, 2.0])), draw(st.integers(0, 2**16))


@settings(max_examples=60, deadline=None)
@given(cases())
def test_matches_the_materialized_package_float64(case):
    b, h, nq, nk, d, dv, limit, scale, seed = case
    q, k, v = _leaves(b, h, nq, nk, d, dv, torch.float64, seed)
    out = entmax15_attention(q, k, v, scale, block_elements=limit)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out) + out.detach())
    with torch.no_grad():
        inference = entmax15_attention(q, k, v, scale, block_elements=limit)
    ref = _reference(q, k, v, scale)
    ref_grads = torch.autograd.grad(ref, (q, k, v), torch.ones_like(ref) + out.detach())
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
    torch.testing.assert_close(inference, out.detach(), atol=0, rtol=0)
    for ours, theirs in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-9, rtol=0)


@pytest.mark.parametrize("limit", [None, 30, 5])  # one block; head groups; one head's row blocks
def test_gradcheck_float64(limit):
    q, k, v = _leaves(2, 2, 5, 4, 3, 2, torch.float64, seed=3)
    fn = lambda q, k, v: entmax15_attention(q, k, v, 0.7, block_elements=limit)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v))


@pytest.mark.parametrize("shape", [(2, 3, 197, 64), (1, 2, 785, 32)])
def test_float32_at_model_sizes(shape):
    b, h, n, d = shape
    q, k, v = _leaves(b, h, n, n, d, d, torch.float32, seed=1)
    out = entmax15_attention(q, k, v, d**-0.5)
    ref = _reference(q, k, v, d**-0.5)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)
    g = torch.randn_like(out)
    ours = torch.autograd.grad(out, (q, k, v), g)
    theirs = torch.autograd.grad(ref, (q, k, v), g.double())
    for a, r in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, r, atol=1e-4, rtol=1e-4)


def test_keeps_sqrt_p_as_the_only_scores_sized_tensor():
    b, h, nq, nk = 2, 3, 11, 13
    q, k, v = _leaves(b, h, nq, nk, 8, 8, torch.float64)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = entmax15_attention(q, k, v, 0.5)
    big = [t for t in saved if t.numel() >= b * h * nq * nk]
    assert len(big) == 1 and tuple(big[0].shape) == (b * h, nq, nk)
    p = entmax_pkg.entmax15((q @ k.transpose(-1, -2)) * 0.5, dim=-1)
    torch.testing.assert_close(big[0].square().view(b, h, nq, nk), p, atol=1e-12, rtol=0)
    out.sum().backward()  # the saved tensors are enough


def test_attention_dispatches_here_for_plain_entmax_on_the_cpu(monkeypatch):
    calls = count_calls(monkeypatch, cpu_entmax, "entmax15_attention")
    q, k, v = _leaves(2, 2, 9, 9, 4, 4, torch.float32)
    out = attention(q, k, v, normalizer="entmax15")
    out.sum().backward()
    with torch.no_grad():
        attention(q, k, v, normalizer="entmax15")
    assert len(calls) == 2
    ref = _reference(q, k, v, 0.5)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)
    # weights returned, a mask, a bias or another normalizer: the materialized path
    keep = torch.rand(9, 9) > 0.3
    keep[:, 0] = True
    masked = attention(q, k, v, normalizer="entmax15", mask=keep)
    weighted, weights = attention(q, k, v, normalizer="entmax15", return_weights=True)
    attention(q, k, v, normalizer="entmax15", bias=torch.zeros(9, 9))
    attention(q, k, v, normalizer="sparsemax")
    assert len(calls) == 2
    torch.testing.assert_close(weighted, out, atol=1e-6, rtol=0)
    scores = (q.double() @ k.double().transpose(-1, -2)) * 0.5
    ref_masked = entmax_pkg.entmax15(scores.masked_fill(~keep, float("-inf")), dim=-1) @ v.double()
    torch.testing.assert_close(masked.double(), ref_masked, atol=1e-5, rtol=0)


@st.composite
def gaussian_cases(draw):
    gh, gw = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    prefix = draw(st.sampled_from([0, 1, 2]))
    b, h, d = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.sampled_from([1, 4, 16]))
    broadcast = draw(st.sampled_from([None, "batch", "heads"]))
    initial = draw(st.sampled_from([None, (2, 2), (6, 5)]))
    n = prefix + gh * gw
    limit = draw(st.sampled_from([None, 1, 9, 2 * n * n + 3]))
    return gh, gw, prefix, b, h, d, broadcast, initial, limit, draw(st.integers(0, 2**16))


@settings(max_examples=50, deadline=None)
@given(gaussian_cases())
def test_gaussian_bias_matches_the_dense_bias(case):
    """Values and gradients (q, k, v, σ, α) against the dense bias from its definition."""
    gh, gw, prefix, b, h, d, broadcast, initial, limit, seed = case
    g = torch.Generator().manual_seed(seed)
    n = prefix + gh * gw
    q, k, v = (torch.randn(b, h, n, d, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3))
    sb, sh = (1 if broadcast == "batch" else b), (1 if broadcast == "heads" else h)
    sigma = torch.exp(torch.randn(sb, sh, gh * gw, 2, generator=g, dtype=torch.float64)).requires_grad_()
    alpha = (torch.rand(sb, sh, gh * gw, 1, generator=g, dtype=torch.float64) * 3).requires_grad_()
    leaves = (q, k, v, sigma, alpha)
    bias = GaussianBias(sigma, alpha, (gh, gw), prefix, initial_grid_size=initial)
    out = entmax15_attention(q, k, v, 0.6, bias, block_elements=limit)
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out) + out.detach())
    with torch.no_grad():
        inference = entmax15_attention(q, k, v, 0.6, bias, block_elements=limit)
    dense = naive_gaug_bias(sigma, alpha, (gh, gw), prefix, initial or (gh, gw))
    ref = entmax_pkg.entmax15((q @ k.transpose(-1, -2)) * 0.6 + dense, dim=-1) @ v
    ref_grads = torch.autograd.grad(ref, leaves, torch.ones_like(ref) + out.detach())
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
    torch.testing.assert_close(inference, out.detach(), atol=0, rtol=0)
    for ours, theirs in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-9, rtol=0)


@pytest.mark.parametrize("limit", [None, 60, 21, 5])  # one block; a head per block; row blocks
def test_gradcheck_with_gaussian_bias_float64(limit):
    q, k, v = _leaves(1, 2, 7, 7, 3, 2, torch.float64, seed=5)
    g = torch.Generator().manual_seed(6)
    sigma = torch.exp(torch.randn(1, 2, 6, 2, generator=g, dtype=torch.float64)).requires_grad_()
    alpha = (torch.rand(1, 2, 6, 1, generator=g, dtype=torch.float64) * 3).requires_grad_()

    def fn(q, k, v, sigma, alpha):
        return entmax15_attention(q, k, v, 0.7, GaussianBias(sigma, alpha, (3, 2), 1), block_elements=limit)

    assert torch.autograd.gradcheck(fn, (q, k, v, sigma, alpha))


def test_gaussian_bias_must_fit_the_tokens():
    sigma, alpha = torch.ones(1, 2, 4, 2, dtype=torch.float64), torch.ones(1, 2, 4, 1, dtype=torch.float64)
    bias = GaussianBias(sigma, alpha, (2, 2), 1)
    q, k, v = (torch.randn(1, 2, 6, 4, dtype=torch.float64) for _ in range(3))
    with pytest.raises(ValueError, match=r"N = 5 tokens, but q is \(1, 2, 6, 4\)"):
        entmax15_attention(q, k, v, 0.5, bias)


def test_bad_operands_are_named():
    q = torch.randn(1, 2, 5, 4)
    with pytest.raises(ValueError, match=r"q must be 4-D \(B, H, N, D\), got shape \(2, 5, 4\)"):
        entmax15_attention(q[0], q, q, 0.5)
    with pytest.raises(TypeError, match="one dtype, float32 or float64; got torch.float32, torch.float64"):
        entmax15_attention(q, q.double(), q, 0.5)
    with pytest.raises(TypeError, match="got torch.float16"):
        entmax15_attention(q.half(), q.half(), q.half(), 0.5)
    with pytest.raises(ValueError, match=r"v \(1, 2, 6, 4\) must be"):
        entmax15_attention(q, q, torch.randn(1, 2, 6, 4), 0.5)
    with pytest.raises(ValueError, match=r"k \(1, 2, 5, 3\)"):
        entmax15_attention(q, torch.randn(1, 2, 5, 3), q, 0.5)


def test_locat_entmax_layer_takes_it_and_matches_the_materialized_path(monkeypatch):
    from vitattn import LocAtAttention

    torch.manual_seed(0)
    layer = LocAtAttention(32, num_heads=2, grid_size=(3, 4), num_prefix_tokens=1, normalizer="entmax15")
    for lin in (layer.gaug.log_var, layer.gaug.log_alpha):  # a bias that matters
        torch.nn.init.normal_(lin.weight, std=0.5)
    x = torch.randn(2, 13, 32, dtype=torch.float64)
    layer = layer.double()

    def step():
        layer.zero_grad()
        out = layer(x)
        out.square().sum().backward()
        return out.detach(), [p.grad.clone() for p in layer.parameters()]

    calls = count_calls(monkeypatch, cpu_entmax, "entmax15_attention")
    ours, ours_grads = step()
    with torch.no_grad():
        inferred = layer(x)
    assert len(calls) == 2
    layer.backend = "reference"
    ref, ref_grads = step()
    assert len(calls) == 2
    torch.testing.assert_close(ours, ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(inferred, ref, atol=1e-12, rtol=0)
    for a, r in zip(ours_grads, ref_grads, strict=True):
        torch.testing.assert_close(a, r, atol=1e-10, rtol=0)
