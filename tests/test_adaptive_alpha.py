"""Adaptive alpha: alpha-entmax attention with a tensor of alphas (one per head), against the `entmax`
package's ``entmax_bisect`` (values, gradients to the scores' inputs and to alpha) and float64
gradcheck; the dispatcher's reasons; the ``"adaptive"`` layers, models, patch, transfer and the locality
report's alphas."""

from __future__ import annotations

import entmax as entmax_pkg
import pytest
import timm
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import vitattn
from vitattn.adapter.timm import layer_normalizer
from vitattn.analysis import LocalityReport, head_alphas, locality_report, plot_alpha_per_layer
from vitattn.functional import attention, explain, make_call, normalize
from vitattn.layers import AdaptiveAlpha, Attention, LocAtAttention, convert_attention
from vitattn.layers.adaptive import ALPHA_FLOOR
from vitattn.models import LocAtViT


def _bisect_attention(q, k, v, alpha, scale=None):
    """The plain formula ``entmax_bisect(q kᵀ · scale, alpha) v`` with the package, alpha any
    shape broadcastable to ``(B, H, Nq, 1)``, in float64."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    p = entmax_pkg.entmax_bisect(s, alpha=alpha.double(), dim=-1, n_iter=200)
    return p @ v.double()


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 2),
    st.integers(1, 4),
    st.integers(1, 9),
    st.integers(1, 9),
    st.sampled_from(["()", "(H,)", "(1, H, 1, 1)", "(B, H, 1, 1)", "(B, H, Nq, 1)"]),
    st.integers(0, 2**31 - 1),
)
def test_tensor_alpha_matches_entmax_bisect_values_and_gradients(b, h, nq, nk, shape, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, nq, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(b, h, nk, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    sizes = {"()": (), "(H,)": (h,), "(1, H, 1, 1)": (1, h, 1, 1), "(B, H, 1, 1)": (b, h, 1, 1)}
    size = sizes.get(shape, (b, h, nq, 1))
    alpha = (1.05 + 0.9 * torch.rand(size, generator=g, dtype=torch.float64)).requires_grad_()
    out = attention(q, k, v, normalizer=alpha)
    per_head = alpha.view(1, -1, 1, 1) if alpha.dim() == 1 else alpha
    want = _bisect_attention(q, k, v, per_head)
    torch.testing.assert_close(out, want, atol=1e-9, rtol=0)
    grad = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v, alpha), grad)
    ref = torch.autograd.grad(want, (q, k, v, alpha), grad)
    for a, r in zip(got, ref, strict=True):
        torch.testing.assert_close(a, r, atol=1e-7, rtol=1e-7)


def test_gradcheck_in_float64():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64) for _ in range(3))
    alpha = torch.tensor([1.2, 1.5, 1.8], dtype=torch.float64)
    inputs = tuple(t.requires_grad_() for t in (q, k, v, alpha))
    assert torch.autograd.gradcheck(lambda *t: attention(*t[:3], normalizer=t[3]), inputs)
    # with a key-padding mask: rows keep their own support
    mask = torch.rand(2, 1, 1, 5, generator=g) > 0.3
    mask[..., 0] = True
    assert torch.autograd.gradcheck(lambda *t: attention(*t[:3], normalizer=t[3], mask=mask), inputs)


def test_normalize_takes_the_same_tensor():
    s = torch.randn(2, 3, 4, 6, dtype=torch.float64)
    alpha = torch.tensor([1.1, 1.5, 1.9], dtype=torch.float64).view(1, 3, 1, 1)
    want = entmax_pkg.entmax_bisect(s, alpha=alpha, dim=-1, n_iter=200)
    torch.testing.assert_close(normalize(s, alpha), want, atol=1e-12, rtol=0)


def test_bad_tensor_alphas_name_the_argument():
    q = torch.randn(2, 3, 4, 8)
    with pytest.raises(ValueError, match=r"one alpha per head: shape \(3,\) for H = 3, got \(2\)"):
        attention(q, q, q, normalizer=torch.full((2,), 1.5))
    with pytest.raises(ValueError, match=r"0-D, 1-D \(H,\) or 4-D"):
        attention(q, q, q, normalizer=torch.full((3, 1), 1.5))
    with pytest.raises(ValueError, match=r"does not broadcast to \(B, H, Nq, 1\)"):
        attention(q, q, q, normalizer=torch.full((1, 3, 1, 4), 1.5))
    with pytest.raises(TypeError, match="floating-point"):
        attention(q, q, q, normalizer=torch.tensor([1, 2, 2]))
    with pytest.raises(ValueError, match="alpha must be finite and > 1"):
        attention(q, q, q, normalizer=torch.tensor([1.5, 1.0, 1.5]))


def test_every_fast_backend_declines_a_tensor_alpha_with_its_reason():
    q = torch.randn(2, 3, 10, 8)
    alpha = torch.full((3,), 1.5, requires_grad=True)
    report = explain(q, q, q, normalizer=alpha)
    assert report.chosen == "reference"
    assert report.path == "dense formula: (B, H, Nq, Nk) scores, alpha-entmax with a tensor of alphas, @ v"
    for name in ("cpu_blocked", "sdpa"):
        assert "a tensor normalizer (alpha-entmax with a tensor of alphas" in report[name], name
    # the Triton kernels take a tensor of alphas (test_kernels_alpha.py): on CPU only the device declines
    assert "tensor normalizer" not in report["triton"] and "CUDA" in report["triton"]
    assert make_call(q, q, q, normalizer=alpha).needs_grad  # alpha alone asks for a gradient
    with pytest.raises(ValueError, match="backend='cpu_blocked' cannot run this call: a tensor normalizer"):
        attention(q, q, q, normalizer=alpha, backend="cpu_blocked")


# ---- the learnable alphas ---------------------------------------------------------------------------


def test_adaptive_alpha_starts_at_one_and_a_half_and_maps_into_its_range():
    mod = AdaptiveAlpha(4)
    torch.testing.assert_close(mod(), torch.full((4,), 1.5))
    assert mod.normalizer().shape == (1, 4, 1, 1)
    with torch.no_grad():
        mod.logit.copy_(torch.tensor([-30.0, -2.0, 3.0, 40.0]))
    alpha = mod()
    torch.testing.assert_close(alpha[1:3], 1 + torch.sigmoid(torch.tensor([-2.0, 3.0])))
    assert alpha[0].item() == pytest.approx(ALPHA_FLOOR) and 1.99 < alpha[3].item() <= 2.0
    alpha.sum().backward()
    assert mod.logit.grad[0] == 0 and mod.logit.grad[1] > 0  # no gradient below the floor


def test_adaptive_layer_is_entmax_bisect_at_its_alphas_with_the_gradient_to_its_parameter():
    torch.manual_seed(0)
    layer = Attention(16, 4, normalizer="adaptive", qkv_bias=True).double()
    with torch.no_grad():
        layer.adaptive_alpha.logit.copy_(torch.tensor([-1.0, 0.0, 0.7, 2.0]))
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    out = layer(x)
    # by hand: the same projections, entmax_bisect at alpha = 1 + sigmoid(logit)
    logit = layer.adaptive_alpha.logit
    q, k, v = layer.qkv(x).reshape(2, 7, 3, 4, 4).permute(2, 0, 3, 1, 4)
    o = _bisect_attention(q, k, v, (1 + torch.sigmoid(logit)).view(1, 4, 1, 1))
    want = layer.proj(o.transpose(1, 2).reshape(2, 7, 16))
    torch.testing.assert_close(out, want, atol=1e-9, rtol=0)
    (got,) = torch.autograd.grad(out.square().sum(), logit)
    (ref,) = torch.autograd.grad(want.square().sum(), logit)
    torch.testing.assert_close(got, ref, atol=1e-7, rtol=1e-6)
    assert layer.head_alphas() == pytest.approx((1 + torch.sigmoid(logit.detach())).tolist())
    assert "normalizer='adaptive'" in repr(layer)


def test_unknown_layer_normalizer_mentions_adaptive():
    with pytest.raises(ValueError, match="or 'adaptive'"):
        Attention(16, 4, normalizer="adaptve")


def test_conversion_keeps_learned_alphas_and_a_fresh_layer_starts_at_one_and_a_half():
    old = Attention(16, 4, normalizer="adaptive")
    with torch.no_grad():
        old.adaptive_alpha.logit.fill_(1.0)
    new = convert_attention(old, LocAtAttention, normalizer="adaptive", grid_size=(2, 3))
    assert new.adaptive_alpha is old.adaptive_alpha
    fresh = convert_attention(Attention(16, 4), Attention, normalizer="adaptive")
    assert fresh.head_alphas() == [1.5] * 4 and not fresh.adaptive_alpha.logit.is_meta


def test_model_option_patch_option_and_state_dict():
    torch.manual_seed(0)
    model = LocAtViT(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=3,
                     normalizer="adaptive")  # fmt: skip
    keys = [k for k in model.state_dict() if "adaptive_alpha" in k]
    assert keys == ["blocks.0.attn.adaptive_alpha.logit", "blocks.1.attn.adaptive_alpha.logit"]
    x = torch.randn(2, 3, 32, 32)
    model(x).sum().backward()
    assert all(model.get_parameter(k).grad is not None for k in keys)
    other = LocAtViT(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=3,
                     normalizer="adaptive")  # fmt: skip
    other.load_state_dict(model.state_dict(), strict=True)
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
    vitattn.patch(vit, "locat", normalizer="adaptive")
    assert vit.blocks[1].attn.head_alphas() == [1.5] * 3
    assert layer_normalizer(vit.blocks[1].attn).shape == (1, 3, 1, 1)


def test_locality_report_holds_the_alphas_and_plots_them(tmp_path):
    torch.manual_seed(0)
    model = LocAtViT(img_size=32, patch_size=8, embed_dim=32, depth=3, num_heads=2, num_classes=3,
                     normalizer="adaptive", gaug=False)  # fmt: skip
    with torch.no_grad():
        model.blocks[1].attn.adaptive_alpha.logit.copy_(torch.tensor([-1.0, 2.0]))
    x = torch.randn(4, 3, 32, 32)
    report = locality_report(model, x, progress=False)
    assert report.alpha == [model.blocks[i].attn.head_alphas() for i in range(3)]
    assert report.alpha[1] == pytest.approx([1 + torch.sigmoid(torch.tensor(v)).item() for v in (-1.0, 2.0)])
    assert "alpha-entmax alpha per head" in str(report)
    again = LocalityReport.from_json(report.to_json())
    assert again.alpha == report.alpha  # floats round-trip through JSON exactly
    fig = plot_alpha_per_layer(report, tmp_path / "alpha.png")
    assert (tmp_path / "alpha.png").stat().st_size > 0 and fig.axes
    plain = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2)
    plain_report = locality_report(plain, x, progress=False)
    assert plain_report.alpha == [] and head_alphas(plain.blocks[0].attn) == ([1.0] * 3, False)
    with pytest.raises(ValueError, match="no report holds alphas"):
        plot_alpha_per_layer(plain_report)
