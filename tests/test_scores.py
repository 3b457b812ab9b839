"""vitattn.functional.scores against a plain float64 formula, and the helpers it shares (mask rule,
compute dtype, grid pairs, q/k projection) against what their callers computed before."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from vitattn.functional import GaussianBias, apply_mask, compute_dtype, grid_pair, scores
from vitattn.layers import Attention

from .reference_formulas import naive_gaug_bias


def plain_scores(q, k, scale=None, bias=None, mask=None):
    """q kᵀ · scale + bias with the mask applied, in float64, straight from the definition."""
    q, k = q.double(), k.double()
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = torch.einsum("bhid,bhjd->bhij", q, k) * scale
    if bias is not None:
        s = s + bias.double()
    if mask is not None:
        if mask.dtype == torch.bool:
            s = torch.where(mask, s, torch.full_like(s, float("-inf")))
        else:
            s = s + mask.double()
    return s


def _mask(kind: str, b: int, h: int, nq: int, nk: int, g: torch.Generator) -> torch.Tensor | None:
    if kind == "none":
        return None
    if kind == "bool":
        return torch.rand(b, h, nq, nk, generator=g) < 0.6
    if kind == "bool_key_padding":  # (B, 1, 1, Nk): broadcasts over heads and queries
        return torch.rand(b, 1, 1, nk, generator=g) < 0.6
    if kind == "float":
        m = torch.randn(1, h, nq, nk, generator=g, dtype=torch.float64)
        m[..., 0] = float("-inf")
        return m
    if kind == "float_2d":  # (Nq, Nk): broadcasts over batch and heads
        return torch.randn(nq, nk, generator=g, dtype=torch.float64)
    raise AssertionError(kind)


MASK_KINDS = ["none", "bool", "bool_key_padding", "float", "float_2d"]


@given(
    b=st.integers(1, 3),
    h=st.integers(1, 3),
    nq=st.integers(1, 9),
    nk=st.integers(1, 9),
    d=st.integers(1, 8),
    mask_kind=st.sampled_from(MASK_KINDS),
    bias_kind=st.sampled_from(["none", "full", "broadcast"]),
    scale=st.one_of(st.none(), st.floats(-3.0, 3.0, allow_nan=False)),
    seed=st.integers(0, 2**16),
)
def test_scores_match_the_formula(b, h, nq, nk, d, mask_kind, bias_kind, scale, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, nq, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, h, nk, d, generator=g, dtype=torch.float64)
    mask = _mask(mask_kind, b, h, nq, nk, g)
    bias = None
    if bias_kind == "full":
        bias = torch.randn(b, h, nq, nk, generator=g, dtype=torch.float64)
    elif bias_kind == "broadcast":
        bias = torch.randn(1, nq, nk, generator=g, dtype=torch.float64)
    out = scores(q, k, scale=scale, bias=bias, mask=mask)
    expected = plain_scores(q, k, scale, bias, mask)
    assert out.shape == (b, h, nq, nk) and out.dtype == torch.float64
    assert torch.equal(torch.isneginf(out), torch.isneginf(expected))  # masked keys exactly -inf
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=1e-12)


def test_default_scale_is_inverse_sqrt_head_dim():
    q, k = torch.randn(2, 2, 5, 16, dtype=torch.float64), torch.randn(2, 2, 7, 16, dtype=torch.float64)
    torch.testing.assert_close(scores(q, k), (q @ k.transpose(-1, -2)) / 4.0, atol=1e-12, rtol=0)
    torch.testing.assert_close(scores(q, k, scale=1.0), q @ k.transpose(-1, -2), atol=1e-12, rtol=0)


@given(
    grid=st.tuples(st.integers(1, 4), st.integers(1, 4)),
    prefix=st.integers(0, 2),
    initial=st.one_of(st.none(), st.tuples(st.integers(1, 6), st.integers(1, 6))),
    mask_kind=st.sampled_from(["none", "bool", "float"]),
    seed=st.integers(0, 2**16),
)
def test_scores_with_a_gaussian_bias(grid, prefix, initial, mask_kind, seed):
    g = torch.Generator().manual_seed(seed)
    b, h, d = 2, 3, 4
    n = prefix + grid[0] * grid[1]
    q, k = (torch.randn(b, h, n, d, generator=g, dtype=torch.float64) for _ in range(2))
    sigma = torch.exp(torch.randn(b, h, n - prefix, 2, generator=g, dtype=torch.float64))
    alpha = torch.rand(b, h, n - prefix, 1, generator=g, dtype=torch.float64)
    bias = GaussianBias(sigma, alpha, grid, prefix, initial)
    dense = naive_gaug_bias(sigma, alpha, grid, prefix, initial or grid)
    mask = _mask(mask_kind, b, h, n, n, g)
    out = scores(q, k, scale=0.7, bias=bias, mask=mask)
    torch.testing.assert_close(out, plain_scores(q, k, 0.7, dense, mask), atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
def test_half_inputs_give_float32_scores(dtype, mask_kind):
    g = torch.Generator().manual_seed(1)
    q, k = (torch.randn(2, 3, 6, 8, generator=g).to(dtype) for _ in range(2))
    bias = torch.randn(2, 1, 6, 6, generator=g).to(dtype)
    mask = _mask(mask_kind, 2, 3, 6, 6, g)
    mask = mask.to(dtype) if mask is not None and mask.is_floating_point() else mask
    out = scores(q, k, bias=bias, mask=mask)
    assert out.dtype == torch.float32
    # the formula on the same (rounded) values, in float64: only float32 rounding apart
    torch.testing.assert_close(out.double(), plain_scores(q, k, None, bias, mask), atol=1e-5, rtol=1e-5)
    assert compute_dtype(q) == torch.float32 and compute_dtype(q, k.double()) == torch.float64


def test_scores_are_differentiable():
    q, k = (torch.randn(1, 2, 4, 3, dtype=torch.float64, requires_grad=True) for _ in range(2))
    bias = torch.randn(1, 2, 4, 4, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda q, k, b: scores(q, k, scale=0.5, bias=b), (q, k, bias))


def test_errors_name_the_argument_and_shapes():
    q = torch.randn(2, 3, 5, 4)
    with pytest.raises(ValueError, match=r"q must be 4-D \(B, H, N, D\), got shape \(3, 5, 4\)"):
        scores(q[0], q)
    with pytest.raises(ValueError, match=r"k must be 4-D \(B, H, N, D\), got shape \(5, 4\)"):
        scores(q, q[0, 0])
    with pytest.raises(TypeError, match="q must be a floating-point tensor, got dtype torch.int64"):
        scores(q.long(), q)
    with pytest.raises(TypeError, match="share a dtype, got q torch.float32 and k torch.float64"):
        scores(q, q.double())
    with pytest.raises(ValueError, match=r"share \(B, H\), got q \(2, 3, 5, 4\) and k \(2, 2, 5, 4\)"):
        scores(q, q[:, :2])
    with pytest.raises(ValueError, match=r"head dim D, got q \(2, 3, 5, 4\) and k \(2, 3, 5, 3\)"):
        scores(q, q[..., :3])
    with pytest.raises(ValueError, match=r"mask of shape \(5, 4\) does not broadcast to .* \(2, 3, 5, 7\)"):
        scores(q, torch.randn(2, 3, 7, 4), mask=torch.ones(5, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="mask must be a boolean keep-mask or an additive .* torch.int64"):
        scores(q, q, mask=torch.ones(5, 5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"bias of shape \(3, 5, 6\) does not broadcast .* \(2, 3, 5, 5\)"):
        scores(q, q, bias=torch.randn(3, 5, 6))
    with pytest.raises(TypeError, match="bias must be a tensor, a GaussianBias or None, got float"):
        scores(q, q, bias=1.0)
    sigma, alpha = torch.ones(2, 3, 6, 2), torch.ones(2, 3, 6, 1)
    with pytest.raises(ValueError, match=r"GaussianBias .* = 7 tokens, but q is \(2, 3, 5, 4\)"):
        scores(q, q, bias=GaussianBias(sigma, alpha, (2, 3), 1))


def test_apply_mask_is_the_one_mask_rule():
    s = torch.zeros(2, 3)
    keep = torch.tensor([[True, False, True], [False, True, True]])
    assert torch.equal(torch.isneginf(apply_mask(s, keep)), ~keep)
    add = torch.tensor([1.0, -2.0, float("-inf")])
    torch.testing.assert_close(apply_mask(s, add), s + add)
    assert apply_mask(s, None) is s and apply_mask(None, None) is None
    folded = apply_mask(None, keep, torch.float64)
    assert folded.dtype == torch.float64 and torch.equal(torch.isneginf(folded), ~keep)
    assert folded[keep].eq(0).all()
    assert apply_mask(None, add, torch.float64).dtype == torch.float64


def test_grid_pair_has_one_home():
    from vitattn.functional import gaussian
    from vitattn.layers import locat

    assert not hasattr(locat, "grid_pair")  # no back-compat re-export: vitattn.functional is its home
    assert not hasattr(gaussian, "_pair")
    assert grid_pair("g", 3) == (3, 3) and grid_pair("g", (2, 5)) == (2, 5)
    assert grid_pair("g", torch.Size([4, 1])) == (4, 1)
    for bad in (0, (2,), (2, 0), (1, 2, 3), 2.0, "ab"):
        with pytest.raises(ValueError, match="g must be two positive ints"):
            grid_pair("g", bad)


def test_project_qkv_serves_timm_and_vitattn_layers():
    from timm.layers import Attention as TimmAttention

    from vitattn.layers.attention import project_qkv

    x = torch.randn(2, 5, 16)
    kw = {"num_heads": 4, "qk_norm": True, "norm_layer": torch.nn.LayerNorm}
    for attn in (TimmAttention(16, **kw), Attention(16, **kw)):
        torch.nn.init.normal_(attn.q_norm.weight)
        q, k, v = project_qkv(attn, x)
        qkv = attn.qkv(x).reshape(2, 5, 3, 4, 4).permute(2, 0, 3, 1, 4)
        torch.testing.assert_close(q, attn.q_norm(qkv[0]))
        torch.testing.assert_close(k, attn.k_norm(qkv[1]))
        torch.testing.assert_close(v, qkv[2])
        none_q, none_k, v_only = project_qkv(attn, x, need_qk=False)
        assert none_q is None and none_k is None
        torch.testing.assert_close(v_only, qkv[2])
