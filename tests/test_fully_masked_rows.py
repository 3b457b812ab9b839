"""Rows whose every key is masked, per backend, against ``reference``: forward and gradients.

A row masked by ``-inf`` (or a boolean keep-mask of zeros) gives a zero output and zero gradients; a row
that a *finite* mask fills entirely (``finfo.min``, ``-1e30``) is an ordinary row whose scores are all
about equal, so its weights are uniform — and so are its gradients. Torch's fused CPU SDPA kernel gets
the backward of the second kind wrong (each weight taken as 1), which the ``sdpa`` backend avoids.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import vitattn
from vitattn.functional import GaussianBias, attention, explain

from .test_backends import TORCH_BACKENDS, _fresh, _leaves, _run

FILLS = ("-inf", "finfo.min", "-1e30", "bool")


@st.composite
def masked_calls(draw):
    """A float64 call with at least one fully masked row (by ``-inf``, a finite fill or a keep-mask),
    partly masked rows besides, any normalizer the torch backends take, with or without a Gaussian bias."""
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    b, h, d = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.sampled_from([4, 8]))
    gaussian = draw(st.booleans())
    if gaussian:
        gh, gw, prefix = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.sampled_from([0, 1]))
        nq = nk = prefix + gh * gw
    else:
        nq, nk = draw(st.integers(1, 7)), draw(st.integers(1, 7))
    q, k = (torch.randn(b, h, n, d, generator=g, dtype=torch.float64) for n in (nq, nk))
    v = torch.randn(b, h, nk, d, generator=g, dtype=torch.float64)
    call: dict = {"q": q, "k": k, "v": v, "normalizer": draw(st.sampled_from(["softmax", "entmax15", 1.3]))}
    if gaussian:
        sigma = torch.exp(torch.randn(b, h, gh * gw, 2, generator=g, dtype=torch.float64))
        alpha = torch.rand(b, h, gh * gw, 1, generator=g, dtype=torch.float64) * 2
        call["bias"] = GaussianBias(sigma, alpha, (gh, gw), prefix)
    fill = draw(st.sampled_from(FILLS))
    keep = torch.rand(b, h, nq, nk, generator=g) > 0.3
    dead = draw(st.lists(st.integers(0, nq - 1), min_size=1, max_size=nq, unique=True))
    keep[:, :, dead] = False
    if fill == "bool":
        call["mask"] = keep
    else:
        value = {"-inf": float("-inf"), "finfo.min": torch.finfo(torch.float64).min, "-1e30": -1e30}[fill]
        call["mask"] = torch.zeros(b, h, nq, nk, dtype=torch.float64).masked_fill(~keep, value)
    return call


def _run_masked(call: dict, backend: str, mask_grad: bool) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """``_run`` with the float mask a leaf that requires a gradient or a constant (the usual case; SDPA
    picks another CPU kernel for each)."""
    if mask_grad:
        return _run(call, backend)
    fresh = _fresh(call)
    fresh["mask"] = fresh["mask"].detach()
    out = attention(**fresh, backend=backend)
    leaves = [t for t in _leaves(fresh) if t.requires_grad]
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(0), dtype=out.dtype)
    return out.detach(), list(torch.autograd.grad(out, leaves, grad_out, allow_unused=True))


def _close(a: torch.Tensor | None, b: torch.Tensor | None) -> None:
    if a is None or b is None:
        assert a is None or not a.abs().any(), "a gradient where the reference has none"
        assert b is None or not b.abs().any(), "no gradient where the reference has one"
        return
    assert torch.isfinite(a).all(), "a non-finite value"
    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@settings(max_examples=60, deadline=None)
@given(call=masked_calls(), mask_grad=st.booleans())
@pytest.mark.parametrize("backend", [b for b in TORCH_BACKENDS if b != "reference"] + ["auto"])
def test_fully_masked_rows_match_the_reference(call, mask_grad, backend):
    if backend != "auto" and explain(**_fresh(call), backend=backend)[backend] is not None:
        return  # the backend declines this call (tests/test_backends.py checks the reasons)
    want_out, want_grads = _run_masked(call, "reference", mask_grad)
    out, grads = _run_masked(call, backend, mask_grad)
    _close(out, want_out)
    for got, want in zip(grads, want_grads, strict=True):
        _close(got, want)


@pytest.mark.parametrize("fill", [torch.finfo(torch.float64).min, -1e30, float("-inf")])
def test_the_repro_of_a_row_filled_by_a_finite_mask(fill):
    """The issue's repro: row 2 of an additive mask filled; the gradient to v of that row's output."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 4, 8, generator=gen, dtype=torch.float64).requires_grad_() for _ in range(3))
    mask = torch.zeros(1, 1, 4, 4, dtype=torch.float64)
    mask[..., 2, :] = fill
    select = torch.zeros(1, 1, 4, 8, dtype=torch.float64)
    select[..., 2, :] = 1
    expected = 0.0 if fill == float("-inf") else 0.25
    for backend in ("auto", "sdpa", "reference"):
        (grad_v,) = torch.autograd.grad(attention(q, k, v, mask=mask, backend=backend), v, select)
        torch.testing.assert_close(grad_v[0, 0, :, 0], torch.full((4,), expected, dtype=torch.float64))


def test_layer_attn_mask_with_a_finite_fully_masked_row():
    """The same through ``layers.Attention(attn_mask=...)`` (timm's calling convention)."""
    torch.manual_seed(0)
    layer = vitattn.Attention(dim=16, num_heads=2).double()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    mask = torch.zeros(2, 1, 5, 5, dtype=torch.float64)
    mask[:, :, 3, :] = torch.finfo(torch.float64).min
    grads = []
    for backend in ("auto", "reference"):
        layer.backend = backend
        x_leaf = x.clone().requires_grad_(True)
        out = layer(x_leaf, attn_mask=mask)
        (grad,) = torch.autograd.grad(out.square().sum(), x_leaf)
        grads.append(grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-9, atol=1e-9)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cuda_sdpa_rows_filled_by_a_finite_mask(dtype):
    """The fused CUDA SDPA kernels on rows a finite mask fills (unverified without a GPU: the CPU rule
    above is kept to the CPU until this passes or fails on one)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 33, 64, generator=gen) for _ in range(3))
    mask = torch.zeros(2, 1, 33, 33)
    mask[..., 5, :] = torch.finfo(dtype).min
    mask[..., 7, :] = -1e30 if dtype == torch.float32 else torch.finfo(dtype).min
    grads = {}
    for backend, device, cast in (("sdpa", "cuda", dtype), ("reference", "cpu", torch.float64)):
        leaves = [t.to(device, cast).requires_grad_(True) for t in (q, k, v)]
        out = attention(*leaves, mask=mask.to(device, cast), backend=backend)
        grads[backend] = [g.double().cpu() for g in torch.autograd.grad(out.square().sum(), leaves)]
    for got, want in zip(grads["sdpa"], grads["reference"], strict=True):
        torch.testing.assert_close(got, want, atol=2e-2 if dtype == torch.float16 else 1e-4, rtol=1e-2)
