"""Layers: Attention / EntmaxAttention vs timm, LocAtAttention vs an independent GAug statement, PRR vs timm.

The ``official_*`` helpers re-state the official GAug formula the slow way (an ``(Np, Np, 2)`` distance
tensor, no separable factors, no vitattn code) and are shared with ``test_models.py`` / ``test_patch.py``.
"""

from __future__ import annotations

import inspect

import entmax
import pytest
import timm.layers
import timm.models.vision_transformer
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from vitattn.layers import PRR, Attention, EntmaxAttention, LocAtAttention

from .helpers import official_locat_attention, official_prr, stress_gaug

SETTINGS = settings(max_examples=20, deadline=None, derandomize=True)
# timm's Attention: timm.layers from 1.0.16 on, vision_transformer before (without masks / scale_norm)
TimmAttention = getattr(timm.layers, "Attention", None) or timm.models.vision_transformer.Attention
TIMM_HAS_MASKS = "attn_mask" in inspect.signature(TimmAttention.forward).parameters


# ---- Attention / EntmaxAttention -----------------------------------------------------------------------
@SETTINGS
@given(
    n=st.integers(1, 20),
    heads=st.sampled_from([1, 2, 4]),
    qk_norm=st.booleans(),
    mask_kind=st.sampled_from(["none", "bool", "float", "causal"] if TIMM_HAS_MASKS else ["none"]),
)
def test_attention_matches_timm(n: int, heads: int, qk_norm: bool, mask_kind: str) -> None:
    torch.manual_seed(n)
    kw = dict(num_heads=heads, qkv_bias=True, qk_norm=qk_norm, norm_layer=nn.LayerNorm)
    ref = TimmAttention(32, **kw).eval()
    ours = Attention(32, **kw).eval()
    assert ours.load_state_dict(ref.state_dict(), strict=True)
    x = torch.randn(2, n, 32)
    mask, causal = None, mask_kind == "causal"
    if mask_kind == "bool":
        mask = torch.rand(2, 1, n, n) > 0.3
        mask[..., 0] = True  # timm's fused path has no rule for fully masked rows
    elif mask_kind == "float":
        mask = torch.randn(2, 1, n, n)
    got = ours(x, attn_mask=mask, is_causal=causal)
    want = ref(x, attn_mask=mask, is_causal=causal) if TIMM_HAS_MASKS else ref(x)
    torch.testing.assert_close(got, want)


def test_attention_state_dict_keys_and_options() -> None:
    kw = dict(qkv_bias=True, qk_norm=True, proj_bias=False, norm_layer=nn.LayerNorm)
    if "scale_norm" in inspect.signature(TimmAttention).parameters:
        kw["scale_norm"] = True
    ref = TimmAttention(48, 4, **kw)
    ours = Attention(48, 4, **kw)
    assert set(ours.state_dict()) == set(ref.state_dict())
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(1, 5, 48)
    torch.testing.assert_close(ours.eval()(x), ref.eval()(x))
    with pytest.raises(ValueError, match="divisible"):
        Attention(30, 4)
    with pytest.raises(ValueError, match="normalizer"):
        Attention(32, 4, normalizer="sigmoid")
    with pytest.raises(TypeError, match="unexpected"):
        Attention(32, 4, bogus=1)


def test_entmax_attention_matches_entmax_package() -> None:
    torch.manual_seed(0)
    layer = EntmaxAttention(32, 2, qkv_bias=True).eval()
    x = torch.randn(2, 9, 32) * 3
    q, k, v = layer.qkv(x).reshape(2, 9, 3, 2, 16).permute(2, 0, 3, 1, 4)
    probs = entmax.entmax15((q @ k.transpose(-1, -2)) / 4.0, dim=-1)
    assert (probs == 0).any(), "test input should give sparse attention"
    expected = layer.proj((probs @ v).transpose(1, 2).reshape(2, 9, 32))
    torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)


def test_timm_vit_accepts_layers_as_attn_layer() -> None:
    from timm.models.vision_transformer import VisionTransformer

    try:
        vit = VisionTransformer(
            img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, attn_layer=EntmaxAttention
        )
    except TypeError:
        pytest.skip("this timm has no attn_layer argument")
    assert isinstance(vit.blocks[0].attn, EntmaxAttention)
    assert vit(torch.randn(1, 3, 32, 32)).shape == (1, 1000)


# ---- LocAtAttention --------------------------------------------------------------------------------------
@SETTINGS
@given(
    gh=st.integers(1, 6),
    gw=st.integers(1, 6),
    init=st.sampled_from([None, (4, 4), (7, 3), (2, 5)]),
    prefix=st.integers(0, 3),
    heads=st.sampled_from([1, 2]),
    normalizer=st.sampled_from(["softmax", "entmax15"]),
    gated=st.booleans(),
)
def test_locat_matches_official_formula(gh, gw, init, prefix, heads, normalizer, gated) -> None:
    """Also gated (the identity start's per-head gate, set in [-1.5, 1.5]: negative amplitudes too)."""
    torch.manual_seed(gh * 7 + gw)
    start = "identity" if gated else "paper"
    layer = LocAtAttention(32, heads, qkv_bias=True, normalizer=normalizer, gaug_init=start).eval()
    assert (layer.gaug.gate is not None) == gated
    layer.set_grid((gh, gw), prefix, init)
    stress_gaug(layer, seed=gh + 10 * gw)
    x = torch.randn(2, prefix + gh * gw, 32)
    with torch.no_grad():
        expected = official_locat_attention(layer, x, (gh, gw), prefix, init or (gh, gw), normalizer)
        torch.testing.assert_close(layer(x), expected, atol=2e-5, rtol=1e-4)


def test_locat_gaug_names_init_and_grads() -> None:
    layer = LocAtAttention(64, 4, qkv_bias=True, grid_size=(3, 5), num_prefix_tokens=2)
    keys = set(layer.state_dict())
    assert {f"gaug.{n}.{p}" for n in ("log_var", "log_alpha") for p in ("weight", "bias")} <= keys
    assert layer.gaug.log_var.weight.shape == (2, 16) and layer.gaug.log_alpha.weight.shape == (1, 16)
    assert torch.all(layer.gaug.log_var.bias == 0) and layer.gaug.log_var.weight.std() < 0.05
    x = torch.randn(2, 17, 64, requires_grad=True)
    layer(x).square().sum().backward()
    for p in layer.parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all()
    assert layer.gaug.log_var.weight.grad.abs().sum() > 0 and layer.gaug.log_alpha.weight.grad.abs().sum() > 0


def test_locat_grid_errors() -> None:
    layer = LocAtAttention(32, 2)
    with pytest.raises(RuntimeError, match="set_grid"):
        layer(torch.randn(1, 5, 32))
    layer.set_grid((2, 2), num_prefix_tokens=1)
    with pytest.raises(ValueError, match=r"N = 1 \+ 2\*2 = 5"):
        layer(torch.randn(1, 7, 32))
    with pytest.raises(ValueError, match="grid_size"):
        layer.set_grid((0, 3))
    with pytest.raises(ValueError, match="num_prefix_tokens"):
        layer.set_grid(3, num_prefix_tokens=-1)


def test_locat_initial_grid_stays() -> None:
    layer = LocAtAttention(32, 2, grid_size=4, num_prefix_tokens=0)
    layer.set_grid((6, 8))
    assert layer.initial_grid_size == (4, 4) and layer.grid_size == (6, 8)


def test_locat_autocast_bf16_keeps_gaug_in_float32() -> None:
    torch.manual_seed(0)
    layer = LocAtAttention(32, 2, grid_size=(3, 3), num_prefix_tokens=1).eval()
    seen = {}
    layer.gaug.register_forward_hook(lambda m, i, o: seen.update(sigma=o.sigma.dtype, alpha=o.alpha.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        out = layer(torch.randn(2, 10, 32))
    assert seen == {"sigma": torch.float32, "alpha": torch.float32}
    assert torch.isfinite(out).all()


# ---- PRR -------------------------------------------------------------------------------------------------
@SETTINGS
@given(
    n=st.integers(1, 12),
    heads=st.sampled_from([1, 2, 4]),
    pool=st.sampled_from(["token", "avg"]),
    pre=st.booleans(),
    post=st.booleans(),
)
def test_prr_matches_timm_attention_pool_prr(n, heads, pool, pre, post) -> None:
    timm_prr = getattr(timm.layers, "AttentionPoolPrr", None)
    if timm_prr is None:
        pytest.skip("this timm has no AttentionPoolPrr")
    torch.manual_seed(n)
    ref = timm_prr(32, num_heads=heads, pool_type=pool, pre_norm=pre, post_norm=post)
    ours = PRR(32, heads, pool=pool, pre_norm=pre, post_norm=post)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_()
    ours.load_state_dict(ref.state_dict(), strict=True)
    x = torch.randn(2, n, 32) * 2
    torch.testing.assert_close(ours(x), ref(x), atol=1e-5, rtol=1e-5)


def test_prr_unpooled_and_errors() -> None:
    x = torch.randn(2, 7, 24)
    torch.testing.assert_close(PRR(24, 3)(x), official_prr(x, 3), atol=1e-5, rtol=1e-5)
    assert list(PRR(24, 3).parameters()) == []
    with pytest.raises(ValueError, match="pool"):
        PRR(24, 3, pool="max")
    with pytest.raises(ValueError, match="divisible"):
        PRR(24, 5)
    with pytest.raises(ValueError, match=r"\(B, N, 24\)"):
        PRR(24, 3)(torch.randn(2, 7, 12))
