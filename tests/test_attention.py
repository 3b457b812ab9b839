"""attention() against plain formulas for every normalizer x mask x bias, plus dead rows and errors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from vitattn.functional import GaussianBias, attention, available_backends, backend_groups, explain
from vitattn.functional.dispatch import AttentionCall

from .reference_formulas import naive_gaug_bias, plain_attention

NORMALIZERS = ["softmax", "entmax15", "sparsemax", 1.3, 1.75]
MASKS = ["none", "bool", "float", "key_padding"]
BIASES = ["none", "tensor", "gaussian"]


def make_case(normalizer, mask_kind, bias_kind, seed=0, b=2, h=3, grid=(3, 4), prefix=1, d=8, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    n = prefix + grid[0] * grid[1]
    q, k, v = (torch.randn(b, h, n, d, generator=g, dtype=torch.float64) * scale for _ in range(3))
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(b, h, n, n, generator=g) < 0.7
        mask[..., 0] = True  # every query keeps a key (the package cannot do empty rows)
    elif mask_kind == "float":
        mask = torch.randn(1, h, n, n, generator=g, dtype=torch.float64)
        mask[..., 1:, 2] = float("-inf")
    elif mask_kind == "key_padding":
        mask = torch.ones(b, 1, 1, n, dtype=torch.bool)
        mask[0, ..., -3:] = False
    bias, dense = None, None
    if bias_kind == "tensor":
        bias = dense = torch.randn(b, 1, n, n, generator=g, dtype=torch.float64)
    elif bias_kind == "gaussian":
        sigma = torch.exp(torch.randn(b, h, n - prefix, 2, generator=g, dtype=torch.float64))
        alpha = torch.rand(b, h, n - prefix, 1, generator=g, dtype=torch.float64) * 3
        bias = GaussianBias(sigma, alpha, grid, num_prefix_tokens=prefix)
        dense = naive_gaug_bias(sigma, alpha, grid, prefix, grid)
    return q, k, v, mask, bias, dense


@pytest.mark.parametrize("normalizer", NORMALIZERS)
@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("bias_kind", BIASES)
def test_matches_plain_formula(normalizer, mask_kind, bias_kind):
    q, k, v, mask, bias, dense = make_case(normalizer, mask_kind, bias_kind)
    ref_out, ref_p = plain_attention(q, k, v, normalizer, mask=mask, bias=dense)
    out = attention(q, k, v, normalizer=normalizer, mask=mask, bias=bias)
    out_w, p = attention(q, k, v, normalizer=normalizer, mask=mask, bias=bias, return_weights=True)
    tol = 1e-9 if normalizer in ("softmax", "entmax15", "sparsemax") else 1e-7
    torch.testing.assert_close(out, ref_out, atol=tol, rtol=0)
    torch.testing.assert_close(out_w, ref_out, atol=tol, rtol=0)
    torch.testing.assert_close(p, ref_p, atol=tol, rtol=0)


@pytest.mark.parametrize("normalizer", ["softmax", "entmax15", "sparsemax"])
@pytest.mark.parametrize("bias_kind", ["none", "gaussian"])
def test_gradients_match_plain_formula(normalizer, bias_kind):
    q, k, v, mask, bias, _ = make_case(normalizer, "bool", bias_kind)
    leaves = [q, k, v] + ([bias.sigma, bias.alpha] if bias_kind == "gaussian" else [])
    for t in leaves:
        t.requires_grad_()
    grad_out = torch.randn_like(q)
    ours = torch.autograd.grad(
        attention(q, k, v, normalizer=normalizer, mask=mask, bias=bias), leaves, grad_out
    )
    dense = bias.dense() if bias_kind == "gaussian" else None
    ref_out, _ = plain_attention(q, k, v, normalizer, mask=mask, bias=dense)
    refs = torch.autograd.grad(ref_out, leaves, grad_out)
    for a, r in zip(ours, refs, strict=True):
        torch.testing.assert_close(a, r, atol=1e-9, rtol=0)


def test_gradcheck_entmax15_with_gaussian_bias_and_mask():
    q, k, v, _, bias, _ = make_case("entmax15", "none", "gaussian", b=1, h=2, grid=(2, 3), d=4, scale=1.0)
    mask = torch.ones(1, 1, 7, 7, dtype=torch.bool)
    mask[..., 3] = False
    sigma, alpha = bias.sigma.requires_grad_(), bias.alpha.requires_grad_()

    def fn(q, k, v, sigma, alpha):
        gb = GaussianBias(sigma, alpha, (2, 3), num_prefix_tokens=1)
        return attention(q, k, v, normalizer="entmax15", mask=mask, bias=gb)

    assert torch.autograd.gradcheck(
        fn, (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), sigma, alpha)
    )


@given(
    st.sampled_from(NORMALIZERS),
    st.integers(1, 3),
    st.integers(1, 9),
    st.integers(1, 9),
    st.sampled_from([4, 8, 16]),
    st.integers(0, 2**31 - 1),
)
def test_shapes_and_cross_attention(normalizer, h, nq, nk, d, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, h, nq, d, generator=g, dtype=torch.float64)
    k = torch.randn(2, h, nk, d, generator=g, dtype=torch.float64)
    v = torch.randn(2, h, nk, 5, generator=g, dtype=torch.float64)
    out, p = attention(q, k, v, normalizer=normalizer, scale=0.7, return_weights=True)
    ref_out, ref_p = plain_attention(q, k, v, normalizer, scale=0.7)
    assert out.shape == (2, h, nq, 5) and p.shape == (2, h, nq, nk)
    torch.testing.assert_close(out, ref_out, atol=1e-7, rtol=0)
    torch.testing.assert_close(p, ref_p, atol=1e-7, rtol=0)


@pytest.mark.parametrize("normalizer", NORMALIZERS)
@pytest.mark.parametrize("return_weights", [False, True])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
def test_fully_masked_queries_give_zeros(normalizer, return_weights, mask_dtype):
    q, k, v = (torch.randn(1, 2, 5, 4, requires_grad=True) for _ in range(3))
    keep = torch.ones(1, 2, 5, 5, dtype=torch.bool)
    keep[0, 1, 2] = False
    mask = keep if mask_dtype == torch.bool else torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    res = attention(q, k, v, normalizer=normalizer, mask=mask, return_weights=return_weights)
    out = res[0] if return_weights else res
    assert torch.equal(out[0, 1, 2], torch.zeros(4))
    assert not out.isnan().any()
    if return_weights:
        assert torch.equal(res[1][0, 1, 2], torch.zeros(5))
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[0, 1, 2], torch.zeros(4))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("normalizer", ["softmax", "entmax15"])
def test_half_precision_inputs(dtype, normalizer):
    q, k, v = (torch.randn(2, 2, 10, 8) for _ in range(3))
    out, p = attention(q.to(dtype), k.to(dtype), v.to(dtype), normalizer=normalizer, return_weights=True)
    ref_out, ref_p = plain_attention(q.to(dtype), k.to(dtype), v.to(dtype), normalizer)
    assert out.dtype == dtype and p.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_out, atol=3e-2, rtol=0)
    torch.testing.assert_close(p.double(), ref_p, atol=1e-2, rtol=0)


def test_dropout_applies_to_probabilities_only_in_the_output():
    q, k, v = (torch.randn(1, 1, 6, 4) for _ in range(3))
    torch.manual_seed(1)
    out, p = attention(q, k, v, normalizer="entmax15", dropout_p=0.5, return_weights=True)
    ref_out, ref_p = plain_attention(q, k, v, "entmax15")
    torch.testing.assert_close(p.double(), ref_p, atol=1e-6, rtol=0)  # weights are before dropout
    assert not torch.allclose(out.double(), ref_out, atol=1e-3)
    torch.manual_seed(1)
    dropped = torch.nn.functional.dropout(p, 0.5)
    torch.testing.assert_close(out, dropped @ v)


def softmax_formula(q, k, v, scale):
    """softmax(q kᵀ * scale) v, written out in float64 (no library code, no `entmax` package)."""
    q, k, v = q.double(), k.double(), v.double()
    return torch.softmax((q @ k.transpose(-1, -2)) * scale, dim=-1) @ v


def test_default_scale_is_inverse_sqrt_head_dim():
    q, k, v = (torch.randn(1, 2, 7, 16, dtype=torch.float64) * 2 for _ in range(3))
    expected = softmax_formula(q, k, v, 1 / math.sqrt(16))
    torch.testing.assert_close(attention(q, k, v), expected, atol=1e-12, rtol=0)
    torch.testing.assert_close(attention(q, k, v, scale=0.25), expected, atol=1e-12, rtol=0)
    # the scale is not a no-op: another one gives another answer, and it is the formula's
    other = attention(q, k, v, scale=1.0)
    torch.testing.assert_close(other, softmax_formula(q, k, v, 1.0), atol=1e-12, rtol=0)
    assert (other - expected).abs().max() > 1e-2


def test_backend_registry_and_explanations():
    names = available_backends()
    assert names == ["triton", "cpu_blocked", "sdpa", "reference"], names  # vitattn registers all four
    assert backend_groups() == {"torch": ("cpu_blocked", "sdpa", "reference")}
    q, k, v = (torch.randn(1, 2, 5, 8, dtype=torch.float32) * 2 for _ in range(3))
    call = AttentionCall(q, k, v, "softmax", 0.5, None, None, False, 0.0)
    reasons = explain(call)
    assert list(reasons) == names
    assert reasons["reference"] is None and reasons["sdpa"] is None  # both take a plain softmax call
    assert reasons.chosen == "sdpa"
    triton_reason = reasons["triton"]  # on CPU "auto" never picks the kernels, and says why
    assert isinstance(triton_reason, str), reasons
    assert "q is on cpu" in triton_reason or triton_reason == "triton is not installed", triton_reason
    expected = softmax_formula(q, k, v, 0.5)
    for backend in ("reference", "sdpa", "torch", "auto"):
        out = attention(q, k, v, scale=0.5, backend=backend)
        assert out.dtype == torch.float32 and out.shape == (1, 2, 5, 8)
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)
    # a float64 call: the reference is exact, and the Triton backend declines it by name
    qd, kd, vd = q.double(), k.double(), v.double()
    call64 = AttentionCall(qd, kd, vd, "softmax", 0.5, None, None, False, 0.0)
    assert explain(call64)["reference"] is None and isinstance(explain(call64)["triton"], str)
    torch.testing.assert_close(
        attention(qd, kd, vd, scale=0.5, backend="reference"), softmax_formula(q, k, v, 0.5), atol=1e-12,
        rtol=0,
    )  # fmt: skip


def test_errors():
    q = torch.randn(1, 2, 5, 4)
    with pytest.raises(ValueError, match=r"q must be 4-D \(B, H, N, D\), got shape \(2, 5, 4\)"):
        attention(q[0], q, q)
    with pytest.raises(
        ValueError, match=r"q and k must share the head dim D, got q \(1, 2, 5, 4\) and k \(1, 2, 5, 3\)"
    ):
        attention(q, q[..., :3], q)
    with pytest.raises(ValueError, match=r"k and v must share the key count"):
        attention(q, q, q[:, :, :4])
    with pytest.raises(ValueError, match=r"share \(B, H\)"):
        attention(q, q[:, :1], q[:, :1])
    with pytest.raises(ValueError, match="alpha must be > 1"):
        attention(q, q, q, normalizer=1.0)
    with pytest.raises(ValueError, match="alpha must be > 1"):
        attention(q, q, q, normalizer=0.5)
    with pytest.raises(ValueError, match="normalizer must be one of"):
        attention(q, q, q, normalizer="entmax")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="backend must be 'auto', one of"):
        attention(q, q, q, backend="cuda-magic")
    with pytest.raises(ValueError, match=r"mask of shape \(3, 5\) does not broadcast to \(B, H, Nq, Nk\)"):
        attention(q, q, q, mask=torch.ones(3, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match="boolean keep-mask or an additive float mask"):
        attention(q, q, q, mask=torch.ones(5, 5, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"bias of shape \(1, 2, 5, 4\) does not broadcast"):
        attention(q, q, q, bias=q)
    gb = GaussianBias(torch.rand(1, 2, 4, 2), torch.rand(1, 2, 4, 1), (2, 2))
    with pytest.raises(ValueError, match=r"GaussianBias describes N = 0 prefix \+ 2x2 patches = 4 tokens"):
        attention(q, q, q, bias=gb)
    with pytest.raises(ValueError, match="dropout_p must be in"):
        attention(q, q, q, dropout_p=1.5)
    with pytest.raises(TypeError, match="k must be a floating-point tensor"):
        attention(q, q.long(), q)


def test_capture_sees_the_weights_of_every_call_and_changes_nothing():
    from vitattn.functional import capture_attention_weights

    q, k, v, mask, bias, _ = make_case("entmax15", "bool", "gaussian")
    plain_out = attention(q, k, v, normalizer="softmax", mask=mask, bias=bias)
    seen, outer = [], []
    with capture_attention_weights(outer.append):
        with capture_attention_weights(seen.append):
            out = attention(q, k, v, normalizer="softmax", mask=mask, bias=bias)
            attention(q, k, v, normalizer="entmax15")
        attention(q, k, v)
    assert len(seen) == 2 and len(outer) == 3
    torch.testing.assert_close(out, plain_out, atol=1e-12, rtol=0)
    _, ref_p = plain_attention(q, k, v, "softmax", mask=mask, bias=bias.dense())
    torch.testing.assert_close(seen[0], ref_p, atol=1e-12, rtol=0)
    assert not seen[0].requires_grad
    attention(q, k, v)
    assert len(seen) == 2  # nothing after the block
