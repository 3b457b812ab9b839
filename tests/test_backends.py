"""Every pure-PyTorch backend against the ``reference`` backend, and the reference against the plain formula
with the `entmax` package's normalizers: drawn shapes, masks, biases and normalizers in float64, values
and gradients; then edge inputs: empty batch, heads or sequence, NaN / inf in some rows, non-contiguous
and expanded (stride-0) operands, broadcast σ / α.

(The Triton backend is tested against the reference in tests/test_kernels*.py, in the interpreter.)
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vitattn.functional import GaussianBias, attention, explain

from .reference_formulas import naive_gaug_bias, plain_attention

TORCH_BACKENDS = ("cpu_blocked", "sdpa", "reference")
NORMALIZERS = ("softmax", "entmax15", "sparsemax", 1.3)


def _leaves(call: dict) -> list[torch.Tensor]:
    """The tensors of a call that can take a gradient, in a fixed order."""
    out = [call["q"], call["k"], call["v"]]
    bias = call.get("bias")
    if isinstance(bias, GaussianBias):
        out += [bias.sigma, bias.alpha]
    elif bias is not None:
        out.append(bias)
    if call.get("mask") is not None and call["mask"].is_floating_point():
        out.append(call["mask"])
    return out


def _fresh(call: dict) -> dict:
    """A copy of ``call`` whose leaf tensors are new leaves requiring a gradient (same values)."""

    def leaf(t: torch.Tensor) -> torch.Tensor:
        return t.detach().clone().requires_grad_(t.is_floating_point())

    out = dict(call)
    out["q"], out["k"], out["v"] = leaf(call["q"]), leaf(call["k"]), leaf(call["v"])
    bias = call.get("bias")
    if isinstance(bias, GaussianBias):
        out["bias"] = GaussianBias(
            leaf(bias.sigma), leaf(bias.alpha), bias.grid_size, bias.num_prefix_tokens, bias.initial_grid_size
        )
    elif bias is not None:
        out["bias"] = leaf(bias)
    if call.get("mask") is not None:
        out["mask"] = leaf(call["mask"]) if call["mask"].is_floating_point() else call["mask"]
    return out


def _run(call: dict, backend: str, grad_seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """(out, gradients of every leaf) of ``attention(**call, backend=backend)`` on fresh leaves."""
    fresh = _fresh(call)
    out = attention(**fresh, backend=backend)
    leaves = _leaves(fresh)
    if out.numel() == 0:
        out.sum().backward()
        return out.detach(), [t.grad for t in leaves]
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed), dtype=out.dtype)
    grads = torch.autograd.grad(out, leaves, g, allow_unused=True)
    return out.detach(), list(grads)


@st.composite
def calls(draw, normalizers=NORMALIZERS):
    """A drawn float64 attention call: shapes (with Nq != Nk where no Gaussian bias), a normalizer, no
    mask / a bool keep-mask / an additive mask (broadcast shapes, never a fully masked row), no bias /
    a dense bias / a Gaussian bias (σ, α broadcast over B or H, a resolution change)."""
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    b, h = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    d, dv = draw(st.sampled_from([1, 4, 8])), draw(st.sampled_from([1, 5]))
    bias_kind = draw(st.sampled_from(["none", "dense", "gaussian"]))
    if bias_kind == "gaussian":
        gh, gw, prefix = draw(st.integers(1, 4)), draw(st.integers(1, 4)), draw(st.sampled_from([0, 1, 3]))
        nq = nk = prefix + gh * gw
    else:
        nq, nk = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    mag = draw(st.sampled_from([0.5, 2.0]))
    q, k = (torch.randn(b, h, n, d, generator=g, dtype=torch.float64) * mag for n in (nq, nk))
    v = torch.randn(b, h, nk, dv, generator=g, dtype=torch.float64)
    call: dict = {"q": q, "k": k, "v": v, "normalizer": draw(st.sampled_from(normalizers))}
    call["scale"] = draw(st.sampled_from([None, 0.3]))
    if bias_kind == "dense":
        shape = draw(st.sampled_from([(b, h, nq, nk), (1, 1, nq, nk), (h, 1, nk), (nq, nk)]))
        call["bias"] = torch.randn(shape, generator=g, dtype=torch.float64)
    elif bias_kind == "gaussian":
        sb, sh = draw(st.sampled_from([(b, h), (1, h), (b, 1), (1, 1)]))
        sigma = torch.exp(torch.randn(sb, sh, gh * gw, 2, generator=g, dtype=torch.float64) * 1.5)
        alpha = torch.rand(sb, sh, gh * gw, 1, generator=g, dtype=torch.float64) * 3
        initial = draw(st.sampled_from([(gh, gw), (gh + 2, gw + 1)]))
        call["bias"] = GaussianBias(sigma, alpha, (gh, gw), prefix, initial)
    mask_kind = draw(st.sampled_from(["none", "none", "bool", "float"]))
    if mask_kind != "none":
        shape = draw(st.sampled_from([(b, h, nq, nk), (b, 1, 1, nk), (nq, nk)]))
        keep = torch.rand(shape, generator=g) > 0.4
        keep[..., 0] = True  # no fully masked row here (tests below cover those)
        if mask_kind == "bool":
            call["mask"] = keep
        else:
            call["mask"] = torch.where(keep, torch.randn(shape, generator=g, dtype=torch.float64), -torch.inf)
    return call


def _formula(call: dict) -> torch.Tensor:
    """The plain formula with the `entmax` package's normalizers and the GAug bias from its definition."""
    bias = call.get("bias")
    if isinstance(bias, GaussianBias):
        bias = naive_gaug_bias(
            bias.sigma, bias.alpha, bias.grid_size, bias.num_prefix_tokens, bias.initial_grid_size
        )
    out, _ = plain_attention(
        call["q"], call["k"], call["v"], call["normalizer"], call.get("scale"), call.get("mask"), bias
    )
    return out


@settings(max_examples=60, deadline=None)
@given(calls())
def test_reference_is_the_plain_formula(call):
    got = attention(**call, backend="reference")
    want = _formula(call)
    atol = 2e-7 if call["normalizer"] == 1.3 else 1e-10  # the package bisects alpha-entmax to ~1e-8
    torch.testing.assert_close(got, want, atol=atol, rtol=0)


@settings(max_examples=80, deadline=None)
@given(calls(), st.sampled_from(TORCH_BACKENDS + ("torch", "auto")))
def test_every_backend_that_takes_a_call_matches_the_reference(call, backend):
    """Values and the gradients of q, k, v, the bias (dense, or σ and α) and an additive mask."""
    if backend in TORCH_BACKENDS:
        reason = explain(**_fresh(call), backend=backend)[backend]
        if reason is not None:
            with pytest.raises(ValueError, match=f"backend='{backend}' cannot run this call"):
                attention(**call, backend=backend)
            return
    out, grads = _run(call, backend)
    ref, ref_grads = _run(call, "reference")
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
    for got, want in zip(grads, ref_grads, strict=True):
        assert (got is None) == (want is None)
        if want is not None:
            torch.testing.assert_close(got, want, atol=1e-9, rtol=0)


def test_each_backend_takes_the_calls_it_is_for():
    """Not vacuous: the drawn calls above reach every backend (checked on calls of each kind)."""
    q = torch.randn(2, 3, 17, 8, dtype=torch.float64)
    gb = GaussianBias(torch.rand(2, 3, 16, 2, dtype=torch.float64) + 0.5, torch.rand(2, 3, 16, 1), (4, 4), 1)
    assert explain(q, q, q, bias=gb).chosen == "cpu_blocked"
    assert explain(q, q, q, normalizer="entmax15").chosen == "cpu_blocked"
    assert explain(q, q, q).chosen == "sdpa"
    assert explain(q, q, q, bias=gb, mask=torch.ones(17, 17, dtype=torch.bool)).chosen == "sdpa"
    assert explain(q, q, q, normalizer="sparsemax").chosen == "reference"


# ---- edge inputs --------------------------------------------------------------------------------------


EMPTY_SHAPES = [(0, 2, 5, 5), (2, 0, 5, 5), (2, 3, 0, 5), (2, 3, 5, 0)]  # (B, H, Nq, Nk)


@pytest.mark.parametrize("shape", EMPTY_SHAPES)
@pytest.mark.parametrize("normalizer", NORMALIZERS)
def test_empty_batch_heads_or_sequence_give_empty_outputs_and_gradients(shape, normalizer):
    b, h, nq, nk = shape
    q, k, v = (torch.randn(b, h, n, 4, requires_grad=True) for n in (nq, nk, nk))
    for backend in ("auto", "reference"):
        out = attention(q, k, v, normalizer=normalizer, backend=backend)
        assert out.shape == (b, h, nq, 4)
        out.sum().backward()
        assert q.grad is not None and q.grad.shape == q.shape and k.grad.shape == k.shape
        assert v.grad is not None and v.grad.shape == v.shape
        q.grad = k.grad = v.grad = None
    if nq and nk:  # fully masked rows of a non-empty call: zeros
        out = attention(q, k, v, normalizer=normalizer, mask=torch.zeros(nq, nk, dtype=torch.bool))
        assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("shape", [(0, 2), (2, 0)])
@pytest.mark.parametrize("normalizer", ["softmax", "entmax15"])
def test_empty_batch_or_heads_with_a_gaussian_bias(shape, normalizer):
    """Tried as a new user would: entmax-1.5 on the CPU raised ZeroDivisionError here before."""
    b, h = shape
    q, k, v = (torch.randn(b, h, 10, 4, requires_grad=True) for _ in range(3))
    sigma = torch.ones(b, h, 9, 2, requires_grad=True)
    alpha = torch.ones(b, h, 9, 1, requires_grad=True)
    out = attention(q, k, v, normalizer=normalizer, bias=GaussianBias(sigma, alpha, (3, 3), 1))
    assert out.shape == (b, h, 10, 4)
    out.sum().backward()
    assert sigma.grad is not None and sigma.grad.shape == sigma.shape and alpha.grad.shape == alpha.shape


@pytest.mark.parametrize("normalizer", ["softmax", "entmax15", "sparsemax"])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_and_inf_reach_only_the_rows_they_touch(normalizer, with_bias, bad):
    """A non-finite value in one query changes that query's row only, on every backend; the other rows
    equal a call without it."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 10, 4, generator=g) for _ in range(3))
    bias = None
    if with_bias:
        sigma, alpha = torch.rand(2, 2, 9, 2, generator=g) + 0.5, torch.rand(2, 2, 9, 1, generator=g)
        bias = GaussianBias(sigma, alpha, 3, 1)
    clean = attention(q, k, v, normalizer=normalizer, bias=bias, backend="reference")
    q_bad = q.clone()
    q_bad[1, 0, 4, 2] = bad
    touched = torch.zeros(2, 2, 10, dtype=torch.bool)
    touched[1, 0, 4] = True
    for backend in TORCH_BACKENDS:
        if explain(q_bad, k, v, normalizer=normalizer, bias=bias, backend=backend)[backend] is not None:
            continue
        out = attention(q_bad, k, v, normalizer=normalizer, bias=bias, backend=backend)
        torch.testing.assert_close(out[~touched], clean[~touched], atol=1e-5, rtol=1e-5, msg=backend)


@pytest.mark.parametrize("normalizer", ["softmax", "entmax15"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_non_contiguous_and_expanded_operands(normalizer, with_bias):
    """q, k, v as a fused qkv projection gives them (strided), transposed head dims, and k / v
    expanded over the batch (stride 0): the same values and gradients as contiguous copies."""
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(2, 10, 3, 2, 8, generator=g, dtype=torch.float64).permute(2, 0, 3, 1, 4)
    q = qkv[0]  # strided
    k = torch.randn(1, 2, 8, 10, generator=g, dtype=torch.float64).transpose(-1, -2).expand(2, 2, 10, 8)
    v = torch.randn(1, 2, 10, 8, generator=g, dtype=torch.float64).expand(2, 2, 10, 8)  # stride 0 in B
    call = {"q": q, "k": k, "v": v, "normalizer": normalizer}
    if with_bias:
        sigma = torch.rand(1, 2, 9, 2, generator=g, dtype=torch.float64).expand(2, 2, 9, 2) + 0.5
        alpha = torch.rand(2, 1, 9, 1, generator=g, dtype=torch.float64).expand(2, 2, 9, 1)
        call["bias"] = GaussianBias(sigma, alpha, 3, 1)
    assert explain(**call).chosen == ("sdpa" if normalizer == "softmax" and not with_bias else "cpu_blocked")
    contiguous = dict(call, q=q.contiguous(), k=k.contiguous(), v=v.contiguous())
    out, grads = _run(call, "auto")
    ref, ref_grads = _run(contiguous, "reference")
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-11, rtol=0)
