"""Mixed q / k / v dtypes in :func:`vitattn.functional.attention`: one rule
(``vitattn.functional.dispatch.operand_dtype``, ``AttentionCall.dtype``) picks the dtype every backend
casts q, k, v to (the autocast dtype under autocast, else the promoted dtype), scores are computed in
at least float32, and the output is in that dtype. Checked on CPU against the plain float32 formula
(``softmax`` by hand, ``entmax.entmax15`` from the entmax package, the GAug bias by
``reference_formulas.naive_gaug_bias``).
"""

from __future__ import annotations

import entmax
import pytest
import torch

from vitattn.functional import GaussianBias, attention
from vitattn.functional.attention import make_call
from vitattn.functional.dispatch import operand_dtype

from .reference_formulas import naive_gaug_bias

BF16, F16, F32, F64 = torch.bfloat16, torch.float16, torch.float32, torch.float64


def _formula(q, k, v, normalizer, bias=None):
    """``normalize(q kᵀ / √D + bias) v`` in float64 from the given values (the all-float reference)."""
    q, k, v = (t.detach().double() for t in (q, k, v))
    z = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if bias is not None:
        z = z + bias.double()
    p = z.softmax(-1) if normalizer == "softmax" else entmax.entmax15(z, dim=-1)
    return p @ v


def _qkv(dtypes, n=17, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, 3, n, d, generator=g) * 1.5).to(dt).requires_grad_() for dt in dtypes]


def _gaussian(seed=1):
    g = torch.Generator().manual_seed(seed)
    sigma = torch.exp(torch.randn(2, 3, 16, 2, generator=g) * 0.5)
    alpha = torch.rand(2, 3, 16, 1, generator=g) * 2
    return GaussianBias(sigma, alpha, (4, 4), num_prefix_tokens=1)


@pytest.mark.parametrize(
    ("dtypes", "autocast", "want"),
    [
        ((F32, F32, BF16), None, F32),
        ((BF16, BF16, BF16), None, BF16),
        ((F16, BF16, F16), None, F32),
        ((F32, F64, F32), None, F64),
        ((F32, F32, BF16), BF16, BF16),  # timm's qk_norm under autocast
        ((F32, F64, BF16), BF16, F64),  # autocast never narrows float64
    ],
)
def test_operand_dtype_is_one_rule(dtypes, autocast, want):
    assert operand_dtype(dtypes, autocast) == want


@pytest.mark.parametrize("bias", [None, "gaussian"])
@pytest.mark.parametrize("normalizer", ["softmax", "entmax15"])
def test_mixed_dtypes_compute_in_the_promoted_dtype(normalizer, bias):
    q, k, v = _qkv((F32, F32, BF16))
    gb = _gaussian() if bias else None
    out = attention(q, k, v, normalizer=normalizer, bias=gb)
    assert out.dtype == F32  # promoted: float32 q, k with a bfloat16 v
    want = _formula(q, k, v, normalizer, None if gb is None else naive_gaug_bias_of(gb))
    assert ((out.double() - want).abs().max() / want.abs().max()).item() < 1e-5
    grads = torch.autograd.grad(out.sum(), [q, k, v])
    assert [g.dtype for g in grads] == [F32, F32, BF16]  # each gradient in its input's dtype
    assert all(torch.isfinite(g).all() for g in grads)


def naive_gaug_bias_of(gb: GaussianBias) -> torch.Tensor:
    """The dense ``(B, H, N, N)`` GAug bias of ``gb`` by the official formula."""
    initial = gb.initial_grid_size or gb.grid_size
    return naive_gaug_bias(gb.sigma, gb.alpha, gb.grid_size, gb.num_prefix_tokens, initial)


@pytest.mark.parametrize("normalizer", ["softmax", "entmax15"])
def test_cpu_autocast_computes_in_the_autocast_dtype(normalizer):
    q, k, v = _qkv((F32, F32, BF16))
    with torch.autocast("cpu", dtype=BF16):
        assert make_call(q, k, v).dtype == BF16
        out = attention(q, k, v, normalizer=normalizer)
    assert out.dtype == BF16
    rounded = [t.detach().to(BF16) for t in (q, k, v)]  # what the backends compute from
    want = _formula(*rounded, normalizer)
    assert ((out.double() - want).abs().max() / want.abs().max()).item() < 2**-7  # bf16 output rounding
    grads = torch.autograd.grad(out.float().sum(), [q, k, v])
    assert [g.dtype for g in grads] == [F32, F32, BF16]


def test_without_autocast_equal_dtypes_keep_their_dtype():
    q, k, v = _qkv((BF16, BF16, BF16))
    assert attention(q, k, v).dtype == BF16
    q, k, v = _qkv((F64, F64, F64))
    assert attention(q, k, v, normalizer="entmax15").dtype == F64


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_non_floating_inputs_raise_a_type_error_naming_the_argument(name):
    tensors = dict(zip("qkv", _qkv((F32, F32, F32)), strict=True))
    tensors[name] = tensors[name].detach().to(torch.int64)
    with pytest.raises(TypeError, match=f"{name} must be a floating-point tensor, got dtype torch.int64"):
        attention(tensors["q"], tensors["k"], tensors["v"])
