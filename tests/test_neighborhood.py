"""Neighbourhood attention in layers, models, patch and the study: ``NeighborhoodAttention`` against timm's
``Attention`` given the independently built dense mask, ``LocAtAttention(window=)`` against the reference
with that mask, ``vitattn.patch(attention="window")`` (grid kept in step with the input, a window as
large as the grid is global attention), the errors, and the study's attention kinds."""

from __future__ import annotations

import pytest
import timm
import torch
from timm.layers import Attention as TimmAttention

import vitattn
from vitattn.analysis import attention_maps
from vitattn.functional import attention
from vitattn.layers import Attention, LocAtAttention, NeighborhoodAttention, convert_attention
from vitattn.layers.attention import project_qkv
from vitattn.study.config import ATTENTIONS, make_config
from vitattn.study.model import STUDY_WINDOW, build_model

from .reference_formulas import naive_window_keep


def _vit(**kwargs):
    args = dict(img_size=32, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=5)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, **{**args, **kwargs}).eval()


@pytest.mark.parametrize(
    ("grid", "window", "dilation", "prefix"), [((5, 4), 3, 1, 1), ((6, 6), (5, 2), 2, 0)]
)
def test_neighborhood_layer_is_timm_attention_with_the_dense_mask(grid, window, dilation, prefix):
    torch.manual_seed(0)
    timm_attn = TimmAttention(32, num_heads=4, qkv_bias=True).eval()
    layer = convert_attention(
        timm_attn, NeighborhoodAttention, window=window, dilation=dilation, grid_size=grid,
        num_prefix_tokens=prefix,
    )  # fmt: skip
    pair = (window, window) if isinstance(window, int) else window
    keep = naive_window_keep(grid, pair, (dilation, dilation), prefix)
    x = torch.randn(2, prefix + grid[0] * grid[1], 32)
    want = timm_attn(x, attn_mask=keep)  # timm's own math on the same (moved) weights
    torch.testing.assert_close(layer(x), want, atol=1e-5, rtol=1e-5)
    # an attn_mask given to the layer is combined with its window
    pad = torch.ones(2, 1, 1, x.shape[1], dtype=torch.bool)
    pad[1, ..., -3:] = False
    want = timm_attn(x, attn_mask=keep & pad)
    torch.testing.assert_close(layer(x, attn_mask=pad), want, atol=1e-5, rtol=1e-5)
    assert set(layer.state_dict()) == set(timm_attn.state_dict())
    assert "window=" in repr(layer)


def test_locat_with_a_window_is_the_bias_inside_the_dense_mask():
    torch.manual_seed(0)
    layer = LocAtAttention(32, 4, grid_size=(4, 5), num_prefix_tokens=1, window=3, normalizer="entmax15")
    layer = layer.double()
    x = torch.randn(2, 21, 32, dtype=torch.float64)
    q, k, v = project_qkv(layer, x)
    keep = naive_window_keep((4, 5), (3, 3), (1, 1), 1)
    bias = layer.attention_bias(q)
    out = attention(q, k, v, normalizer="entmax15", bias=bias, mask=keep, backend="reference")
    want = layer.project_out(out, None)
    torch.testing.assert_close(layer(x), want, atol=1e-12, rtol=0)


def test_layer_needs_its_grid():
    layer = NeighborhoodAttention(16, 2, window=3)
    with pytest.raises(RuntimeError, match="NeighborhoodAttention has no patch grid"):
        layer(torch.randn(1, 10, 16))
    layer.set_grid((3, 3), 1)
    with pytest.raises(ValueError, match="WindowMask describes N = 1 prefix"):
        layer(torch.randn(1, 11, 16))


def test_patch_window_follows_the_input_grid_and_a_grid_sized_window_is_global():
    torch.manual_seed(0)
    model = _vit(dynamic_img_size=True)
    x = torch.randn(2, 3, 32, 32)
    plain = model(x)
    vitattn.patch(model, attention="window", window=8)  # 8x8 grid: every query sees every patch
    assert isinstance(model.blocks[0].attn, NeighborhoodAttention)
    torch.testing.assert_close(model(x), plain, atol=1e-5, rtol=1e-5)
    small = torch.randn(1, 3, 24, 40)
    model(small)
    assert model.blocks[1].attn.grid_size == (6, 10)
    assert model.blocks[1].attn.attention_window().grid_size == (6, 10)
    vitattn.patch(model, attention="window", window=3)
    maps = attention_maps(model, x, [0])[0]  # zero outside each query's window
    keep = naive_window_keep((8, 8), (3, 3), (1, 1), 1)
    assert torch.equal(maps[0, 0] > 0, keep)
    assert (model(x) - plain).abs().max() > 1e-5


def test_patch_window_options_and_errors():
    model = _vit()
    vitattn.patch(model, attention="locat", window=(3, 5), dilation=2)
    attn = model.blocks[0].attn
    assert isinstance(attn, LocAtAttention) and attn.window == (3, 5) and attn.dilation == (2, 2)
    with pytest.raises(ValueError, match="window=3 is for attention='window' or 'locat'"):
        vitattn.patch(_vit(), attention="softmax", window=3)
    with pytest.raises(ValueError, match="dilation=2 needs a window"):
        vitattn.patch(_vit(), attention="locat", dilation=2)
    swin = timm.create_model(
        "swin_tiny_patch4_window7_224", pretrained=False, embed_dim=24, depths=(2, 2), num_heads=(2, 4)
    )
    with pytest.raises(ValueError, match="a Swin"):
        vitattn.patch(swin, attention="window")
    eva = timm.create_model(
        "vit_medium_patch16_rope_reg1_gap_256", pretrained=False, img_size=32, patch_size=8, embed_dim=32,
        depth=1, num_heads=2,
    )  # fmt: skip
    with pytest.raises(ValueError, match="attention='window' is not available for Eva"):
        vitattn.patch(eva, attention="window")
    patched = vitattn.patch(_vit(), attention=NeighborhoodAttention)
    assert isinstance(patched.blocks[0].attn, NeighborhoodAttention)


def test_study_attention_kinds():
    assert {"adaptive", "window"} <= set(ATTENTIONS)
    config = make_config("quick", depth=2, attentions=["window", "adaptive"])
    window = build_model(config, "window")
    attn = window.blocks[1].attn
    assert isinstance(attn, NeighborhoodAttention) and attn.window == (STUDY_WINDOW, STUDY_WINDOW)
    assert attn.normalizer == "softmax" and window.blocks[0].attn.num_prefix_tokens == 1
    adaptive = build_model(config, "adaptive")
    assert isinstance(adaptive.blocks[0].attn, Attention) and adaptive.blocks[0].attn.normalizer == "adaptive"
    x = torch.randn(2, 3, 32, 32)
    for model in (window, adaptive):
        model(x).sum().backward()


def test_explicit_path_takes_the_window_and_learned_alphas():
    """timm's explicit attention path (``fused_attn=False``, what ``AttentionExtract`` reads) computes
    what the fused call computes, for a window layer (with an attn_mask too) and an adaptive one."""
    torch.manual_seed(0)
    x = torch.randn(2, 17, 16)
    pad = torch.ones(2, 1, 1, 17, dtype=torch.bool)
    pad[0, ..., -2:] = False
    for layer in (
        NeighborhoodAttention(16, 2, window=3, grid_size=(4, 4), num_prefix_tokens=1),
        LocAtAttention(16, 2, grid_size=(4, 4), num_prefix_tokens=1, window=(3, 2), normalizer="adaptive"),
    ):
        if layer.adaptive_alpha is not None:
            with torch.no_grad():
                layer.adaptive_alpha.logit.copy_(torch.tensor([-1.0, 1.0]))
        fused = [layer(x), layer(x, attn_mask=pad)]
        layer.fused_attn = False
        explicit = [layer(x), layer(x, attn_mask=pad)]
        for a, b in zip(explicit, fused, strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_study_runs_adaptive_and_window(tmp_path, capsys):
    """``vitattn study --attention adaptive window`` on the tiny configuration of tests/test_study.py:
    both runs finish, results.json validates, the adaptive run records its learned alphas."""
    import json

    from vitattn.cli import main
    from vitattn.study import validate_results

    tiny = [
        "--depth", "2", "--dim", "32", "--heads", "4", "--epochs", "1", "--batch-size", "32",
        "--limit-train", "64", "--limit-test", "32", "--analysis-images", "16", "--no-progress",
        "--probe-train-images", "32",
    ]  # fmt: skip
    assert main(["study", *tiny, "--attention", "adaptive", "window", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    validate_results(data)
    runs = {r["attention"]: r for r in data["runs"]}
    assert set(runs) == {"adaptive", "window"} and "alpha" not in runs["window"]
    alphas = runs["adaptive"]["alpha"]
    assert len(alphas) == 2 and all(len(row) == 4 and all(1.01 <= a < 2 for a in row) for row in alphas)
    assert alphas != [[1.5] * 4] * 2  # one epoch moved them
    assert runs["window"]["mean_sparsity"] > 0.4  # the window's exact zeros
    assert "| window |" in capsys.readouterr().out
