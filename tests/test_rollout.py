"""Attention rollout, gradient-weighted rollout and heat maps (``vitattn.analysis.rollout``): a 2-block toy
computed by hand, plain numpy restatements of the rules, maps with exact zeros, gradients against an
explicit-probabilities forward, and timm / vitattn / Jumbo models end to end."""

from __future__ import annotations

import entmax
import numpy as np
import pytest
import timm
import torch
from hypothesis import given
from hypothesis import strategies as st
from timm.models.vision_transformer import VisionTransformer
from torch import nn

import vitattn
from vitattn.analysis import (
    attention_gradients,
    attention_maps,
    attention_rollout,
    gradient_rollout,
    model_heatmap,
    model_rollout,
    plot_rollout,
    rollout_heatmap,
    upsample_heatmap,
)
from vitattn.models import LocAtViT

F64 = torch.float64

# ---- the toy: B = 1, H = 2 heads, N = 3 tokens (1 class token + 2 patches), 2 blocks -----------------
A1 = [
    [[0.5, 0.5, 0.0], [0.0, 1.0, 0.0], [0.25, 0.25, 0.5]],
    [[0.5, 0.0, 0.5], [0.0, 0.5, 0.5], [0.25, 0.25, 0.5]],
]
A2 = [
    [[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.0, 0.0, 1.0]],
    [[0.0, 1.0, 0.0], [0.5, 0.0, 0.5], [0.0, 0.5, 0.5]],
]


def toy_maps() -> list[torch.Tensor]:
    return [torch.tensor([A1], dtype=F64), torch.tensor([A2], dtype=F64)]


def test_toy_rollout_by_hand() -> None:
    # block 1: head mean [[.5,.25,.25],[0,.75,.25],[.25,.25,.5]]; (A + I)/2 (rows already sum to 1):
    m1 = [[0.75, 0.125, 0.125], [0.0, 0.875, 0.125], [0.125, 0.125, 0.75]]
    # block 2: head mean [[.5,.5,0],[.5,.25,.25],[0,.25,.75]]; (A + I)/2:
    m2 = [[0.75, 0.25, 0.0], [0.25, 0.625, 0.125], [0.0, 0.125, 0.875]]
    # rollout = m2 @ m1, row by row:
    #   row 0: .75·m1[0] + .25·m1[1]              = [.5625, .3125, .125]
    #   row 1: .25·m1[0] + .625·m1[1] + .125·m1[2] = [.203125, .59375, .203125]
    #   row 2: .125·m1[1] + .875·m1[2]            = [.109375, .21875, .671875]
    expected = [[0.5625, 0.3125, 0.125], [0.203125, 0.59375, 0.203125], [0.109375, 0.21875, 0.671875]]
    got = attention_rollout(toy_maps())
    torch.testing.assert_close(got, torch.tensor([expected], dtype=F64), rtol=0, atol=1e-15)
    assert np.allclose(np.array(m2) @ np.array(m1), expected)  # the hand product, checked once more
    # the class token's heat map over the 1 x 2 patch grid is row 0's patch columns
    torch.testing.assert_close(
        rollout_heatmap(got, (1, 2), 1), torch.tensor([[[0.3125, 0.125]]], dtype=F64), rtol=0, atol=1e-15
    )
    # a dict keyed by block index (attention_maps' form) is read in key order
    torch.testing.assert_close(attention_rollout({7: toy_maps()[1], 3: toy_maps()[0]}), got)


def test_toy_max_fusion_and_discard_by_hand() -> None:
    # block 1, max over heads: [[.5,.5,.5],[0,1,.5],[.25,.25,.5]]; (A + I)/2 row sums 1.25, 1.25, 1
    # -> [[.6,.2,.2],[0,.8,.2],[.125,.125,.75]]
    got = attention_rollout(toy_maps()[:1], head_fusion="max")
    expected = [[0.6, 0.2, 0.2], [0.0, 0.8, 0.2], [0.125, 0.125, 0.75]]
    torch.testing.assert_close(got, torch.tensor([expected], dtype=F64), rtol=0, atol=1e-15)
    # discard 0.5 of the 2 patch columns = 1 per row, ties drop the lower column; block 1's mean rows
    # [.5,.25,.25] -> [.5,0,.25]; [0,.75,.25] -> [0,.75,0]; [.25,.25,.5] -> [.25,0,.5]; (A + I)/2 and
    # renormalized: [6/7, 0, 1/7], [0, 1, 0], [1/7, 0, 6/7]
    got = attention_rollout(toy_maps()[:1], discard_ratio=0.5)
    expected = [[6 / 7, 0.0, 1 / 7], [0.0, 1.0, 0.0], [1 / 7, 0.0, 6 / 7]]
    torch.testing.assert_close(got, torch.tensor([expected], dtype=F64), rtol=0, atol=1e-15)


def test_discard_never_drops_the_prefix_column() -> None:
    # one head, row 0 = [.1, .5, .4]: the smallest patch weight (.4) goes, not the class token's .1
    a = torch.tensor([[[[0.1, 0.5, 0.4], [0.2, 0.3, 0.5], [0.0, 0.5, 0.5]]]], dtype=F64)
    got = attention_rollout([a], discard_ratio=0.5)
    # rows after the discard: [.1,.5,0], [.2,0,.5], [0,0,.5] (tie: column 1 first); (A + I)/2:
    # [.55,.25,0] (sum .8), [.1,.5,.25] (sum .85), [0,0,.75] (sum .75)
    expected = [[0.55 / 0.8, 0.25 / 0.8, 0.0], [0.1 / 0.85, 0.5 / 0.85, 0.25 / 0.85], [0.0, 0.0, 1.0]]
    torch.testing.assert_close(got, torch.tensor([expected], dtype=F64), rtol=0, atol=1e-15)
    # with no prefix token the class column is a patch like the others and can go
    no_prefix = attention_rollout([a], discard_ratio=0.34, num_prefix_tokens=0)  # 1 of 3 per row
    assert no_prefix[0, 1, 0] == 0 and got[0, 1, 0] > 0  # row 1: [.2, .3, .5] loses its .2


# ---- a plain numpy statement of the rules, for drawn maps ------------------------------------------------
def numpy_rollout(maps: list[np.ndarray], ratio: float, fusion: str, prefix: int) -> np.ndarray:
    b, _, n, _ = maps[0].shape
    out = np.zeros((b, n, n))
    for bi in range(b):
        result = np.eye(n)
        for a in maps:
            fused = {"mean": a[bi].mean(0), "max": a[bi].max(0), "min": a[bi].min(0)}[fusion].copy()
            k = int(ratio * (n - prefix))
            for i in range(n):
                cols = fused[i, prefix:]
                drop = np.argsort(cols, kind="stable")[:k]
                cols[drop] = 0.0
            mixed = (fused + np.eye(n)) / 2
            mixed = mixed / mixed.sum(1, keepdims=True)
            result = mixed @ result
        out[bi] = result
    return out


@st.composite
def drawn_maps(draw: st.DrawFn) -> tuple[list[torch.Tensor], int]:
    b, h = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    prefix, patches = draw(st.integers(0, 2)), draw(st.integers(1, 6))
    blocks = draw(st.integers(1, 3))
    n = prefix + patches
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    kind = draw(st.sampled_from(["softmax", "entmax15", "sparsemax", "dead"]))
    maps = []
    for _ in range(blocks):
        s = torch.randn(b, h, n, n, generator=g, dtype=F64) * draw(st.sampled_from([0.5, 3.0]))
        if kind == "softmax":
            maps.append(s.softmax(-1))
        elif kind == "sparsemax":
            maps.append(entmax.sparsemax(s, dim=-1))
        else:
            p = entmax.entmax15(s, dim=-1)
            if kind == "dead":  # a masked query: an all-zero row, as attention() gives
                p[:, :, -1] = 0.0
            maps.append(p)
    return maps, prefix


@given(
    drawn=drawn_maps(),
    ratio=st.sampled_from([0.0, 0.3, 0.5, 0.9, 1.0]),
    fusion=st.sampled_from(["mean", "max", "min"]),
)
def test_drawn_maps_match_numpy(drawn: tuple[list[torch.Tensor], int], ratio: float, fusion: str) -> None:
    maps, prefix = drawn
    got = attention_rollout(maps, ratio, fusion, prefix)
    want = numpy_rollout([m.numpy() for m in maps], ratio, fusion, prefix)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-14)
    assert torch.isfinite(got).all() and torch.allclose(got.sum(-1), torch.ones_like(got[..., 0]))


def test_exact_zeros_stay_zeros_and_dead_rows_become_identity() -> None:
    """entmax maps: a zero in every head of every block stays a zero of the rollout; a query with no
    attention at all (every key masked) keeps only its residual."""
    g = torch.Generator().manual_seed(3)
    s = torch.randn(1, 2, 5, 5, generator=g, dtype=F64) * 4
    p = entmax.entmax15(s, dim=-1)
    p[:, :, 2] = 0.0  # token 2 attends to nothing
    assert (p == 0).sum() > 10  # sparse
    got = attention_rollout([p])
    torch.testing.assert_close(got[0, 2], torch.eye(5, dtype=F64)[2])
    both_zero = (p == 0).all(1)[0] & ~torch.eye(5, dtype=torch.bool)
    assert (got[0][both_zero] == 0).all()
    torch.testing.assert_close(got.sum(-1), torch.ones(1, 5, dtype=F64))


# ---- gradient-weighted rollout ----------------------------------------------------------------------
def test_toy_gradient_rollout_by_hand() -> None:
    # one head per block, so the head mean is the map itself
    a1 = torch.tensor([[[[0.5, 0.5], [0.0, 1.0]]]], dtype=F64)
    g1 = torch.tensor([[[[2.0, -1.0], [3.0, 1.0]]]], dtype=F64)
    a2 = torch.tensor([[[[0.25, 0.75], [1.0, 0.0]]]], dtype=F64)
    g2 = torch.tensor([[[[4.0, 2.0], [-1.0, 5.0]]]], dtype=F64)
    # Ā1 = (g1·a1)+ = [[1, 0], [0, 1]];  Ā2 = (g2·a2)+ = [[1, 1.5], [0, 0]]
    # R1 = I + Ā1·I = [[2, 0], [0, 2]];   R2 = R1 + Ā2·R1 = [[2, 0], [0, 2]] + [[2, 3], [0, 0]]
    expected = torch.tensor([[[4.0, 3.0], [0.0, 2.0]]], dtype=F64)
    torch.testing.assert_close(gradient_rollout([a1, a2], [g1, g2]), expected, rtol=0, atol=0)


def test_gradient_rollout_mean_of_clipped_heads() -> None:
    a = torch.tensor([[[[0.5, 0.5], [1.0, 0.0]], [[1.0, 0.0], [0.5, 0.5]]]], dtype=F64)
    g = torch.tensor([[[[2.0, -4.0], [1.0, 1.0]], [[-2.0, 6.0], [2.0, -2.0]]]], dtype=F64)
    # head 0: (a·g)+ = [[1, 0], [1, 0]]; head 1: [[0, 0], [1, 0]]; mean [[.5, 0], [1, 0]]
    expected = torch.eye(2, dtype=F64) + torch.tensor([[0.5, 0.0], [1.0, 0.0]], dtype=F64)
    torch.testing.assert_close(gradient_rollout([a], [g])[0], expected)


def tiny_vit(kind: str) -> nn.Module:
    torch.manual_seed(0)
    kw = dict(img_size=8, patch_size=2, in_chans=1, embed_dim=16, depth=2, num_heads=2, num_classes=5)
    if kind == "timm":
        return VisionTransformer(**kw).double().eval()
    return LocAtViT(**kw, gaug=False, prr=False, normalizer="entmax15").double().eval()


def explicit_probability_grads(model: nn.Module, x: torch.Tensor, target: torch.Tensor, normalizer: str):
    """Each block's probabilities as a leaf of the graph (timm's formula with the package's normalizer)
    and the gradient of Σ_b logits[b, target_b] with respect to them."""
    probs: list[torch.Tensor] = []

    def forward(attn: nn.Module, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = attn.qkv(x).reshape(b, n, 3, attn.num_heads, -1).permute(2, 0, 3, 1, 4)
        s = (q @ k.transpose(-1, -2)) * attn.scale
        p = s.softmax(-1) if normalizer == "softmax" else entmax.entmax15(s, dim=-1)
        p.retain_grad()
        probs.append(p)
        return attn.proj((p @ v).transpose(1, 2).reshape(b, n, c))

    for block in model.blocks:
        block.attn.forward = lambda x, attn=block.attn, **kw: forward(attn, x)
    try:
        logits = model(x)
        logits.gather(1, target[:, None]).sum().backward()
    finally:
        for block in model.blocks:
            del block.attn.forward
    return [p.detach() for p in probs], [p.grad for p in probs]


@pytest.mark.parametrize("kind", ["timm", "vitattn_entmax"])
def test_attention_gradients_match_an_explicit_forward(kind: str) -> None:
    model = tiny_vit(kind)
    x = torch.randn(3, 1, 8, 8, dtype=F64)
    target = torch.tensor([0, 4, 2])
    maps, grads = attention_gradients(model, x, target)
    assert all(p.grad is None for p in model.parameters())  # autograd.grad: nothing accumulated
    want_maps, want_grads = explicit_probability_grads(
        model, x, target, "softmax" if kind == "timm" else "e15"
    )
    for i in range(2):
        torch.testing.assert_close(maps[i], want_maps[i], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(grads[i], want_grads[i], rtol=1e-8, atol=1e-10)
    model.zero_grad(set_to_none=True)
    # target=None: each image's top class
    top = model(x).argmax(-1)
    _, by_top = attention_gradients(model, x)
    _, by_index = attention_gradients(model, x, top)
    torch.testing.assert_close(by_top[1], by_index[1])


# ---- models end to end ------------------------------------------------------------------------------
def test_timm_and_patched_vitattn_models_roll_out_alike() -> None:
    model = timm.create_model(
        "vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=3
    ).eval()
    x = torch.randn(2, 3, 32, 32)
    rollout = model_rollout(model, x, discard_ratio=0.5, head_fusion="max")
    assert rollout.shape == (2, 17, 17)
    vitattn.patch(model, "softmax")
    torch.testing.assert_close(model_rollout(model, x, discard_ratio=0.5, head_fusion="max"), rollout)
    maps = attention_maps(model, x)
    torch.testing.assert_close(attention_rollout(maps, 0.5, "max"), rollout)
    heat = model_heatmap(model, x, rollout)
    torch.testing.assert_close(heat, rollout[:, 0, 1:].reshape(2, 4, 4))
    grad = model_rollout(model, x, gradient=True, target=1)
    assert grad.shape == (2, 17, 17) and torch.isfinite(grad).all()


def test_locat_entmax_model_and_jumbo_heatmaps() -> None:
    locat = timm.create_model(
        "locatvit_tiny", img_size=32, patch_size=8, depth=2, num_classes=3, normalizer="entmax15"
    ).eval()
    x = torch.randn(2, 3, 32, 32)
    heat = model_heatmap(locat, x, model_rollout(locat, x))
    assert heat.shape == (2, 4, 4) and torch.isfinite(heat).all()
    jumbo = timm.create_model(
        "locatjumbo_tiny", img_size=32, patch_size=8, depth=2, embed_dim=48, J=3, num_classes=3
    ).eval()
    rollout = model_rollout(jumbo, x)
    assert rollout.shape == (2, 3 + 16, 3 + 16)
    torch.testing.assert_close(model_heatmap(jumbo, x, rollout), rollout[:, :3, 3:].mean(1).reshape(2, 4, 4))
    grad = model_rollout(jumbo, x, gradient=True)
    assert torch.isfinite(grad).all()


def test_heatmap_queries_and_upsampling() -> None:
    r = torch.arange(2 * 6 * 6, dtype=F64).reshape(2, 6, 6)
    torch.testing.assert_close(rollout_heatmap(r, (2, 2), 2, query=1), r[:, 1, 2:].reshape(2, 2, 2))
    torch.testing.assert_close(
        rollout_heatmap(r, (2, 2), 2, query="prefix"), r[:, :2, 2:].mean(1).reshape(2, 2, 2)
    )
    torch.testing.assert_close(rollout_heatmap(r, None, 2, query="all"), r[:, :, 2:].mean(1).reshape(2, 2, 2))
    up = upsample_heatmap(torch.tensor([[[1.0, 2.0], [3.0, 4.0]], [[0.0, 0.0], [0.0, 0.0]]]), (16, 8))
    assert up.shape == (2, 16, 8) and up[0].max() == 1 and up[0].min() >= 0 and (up[1] == 0).all()
    flat = upsample_heatmap(torch.full((1, 3, 3), 0.2), (9, 9))
    torch.testing.assert_close(flat, torch.ones(1, 9, 9))


def test_plot_rollout_writes_a_figure(tmp_path) -> None:
    images = torch.rand(3, 3, 32, 32)
    heat = torch.rand(3, 4, 4)
    fig = plot_rollout(images, heat, tmp_path / "fig" / "rollout.png", labels=["a", "b", "c"])
    assert (tmp_path / "fig" / "rollout.png").stat().st_size > 1000
    assert len([ax for ax in fig.axes if ax.images]) == 6
    with pytest.raises(ValueError, match=r"same B, got \(3, 3, 32, 32\) and \(2, 4, 4\)"):
        plot_rollout(images, heat[:2])


# ---- errors -----------------------------------------------------------------------------------------
def test_errors_name_the_argument_and_shapes() -> None:
    good = toy_maps()
    with pytest.raises(ValueError, match="maps is empty"):
        attention_rollout([])
    with pytest.raises(TypeError, match="list of per-block"):
        attention_rollout(good[0])
    with pytest.raises(ValueError, match=r"maps\[1\] must be \(B, H, N, N\), got shape \(2, 3, 3\)"):
        attention_rollout([good[0], good[1][0]])
    with pytest.raises(ValueError, match=r"maps\[0\] must be \(B, H, N, N\), got shape \(1, 2, 3, 4\)"):
        attention_rollout([torch.zeros(1, 2, 3, 4)])
    with pytest.raises(
        ValueError, match=r"maps\[1\] has shape \(1, 2, 4, 4\) but maps\[0\] has \(1, 2, 3, 3\)"
    ):
        attention_rollout([good[0], torch.zeros(1, 2, 4, 4)])
    with pytest.raises(TypeError, match=r"maps\[0\] must be floating-point"):
        attention_rollout([torch.zeros(1, 1, 2, 2, dtype=torch.long)])
    with pytest.raises(
        ValueError, match=r"head_fusion must be one of \('mean', 'max', 'min'\), got 'median'"
    ):
        attention_rollout(good, head_fusion="median")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"discard_ratio must be in \[0, 1\], got 1.5"):
        attention_rollout(good, discard_ratio=1.5)
    with pytest.raises(ValueError, match=r"num_prefix_tokens must be in \[0, N = 3\], got 4"):
        attention_rollout(good, num_prefix_tokens=4)
    with pytest.raises(ValueError, match="grads has 1 blocks but maps has 2"):
        gradient_rollout(good, good[:1])
    with pytest.raises(
        ValueError, match=r"grads\[0\] has shape \(1, 1, 3, 3\) but maps\[0\] has \(1, 2, 3, 3\)"
    ):
        gradient_rollout(good[:1], [good[0][:, :1]])
    with pytest.raises(ValueError, match=r"rollout must be \(B, N, N\), got \(3, 3\)"):
        rollout_heatmap(torch.zeros(3, 3))
    with pytest.raises(ValueError, match="do not match grid_size"):
        rollout_heatmap(torch.zeros(1, 3, 3), (2, 2), 1)
    with pytest.raises(ValueError, match=r"query must be a token index in \[-3, 3\)"):
        rollout_heatmap(torch.zeros(1, 3, 3), (1, 2), 1, query=5)
    with pytest.raises(ValueError, match="query='prefix' needs prefix tokens"):
        rollout_heatmap(torch.zeros(1, 4, 4), (2, 2), 0, query="prefix")
    with pytest.raises(TypeError, match=r"blocks\[0\]\.attn is Identity"):
        model = tiny_vit("timm")
        model.blocks[0].attn = nn.Identity()
        attention_gradients(model, torch.randn(1, 1, 8, 8, dtype=F64))


# ---- vitattn analyze --rollout ------------------------------------------------------------------------
TINY_ARGS = ["--model-arg", "img_size=32", "--model-arg", "patch_size=8", "--model-arg", "embed_dim=48"]


@pytest.mark.slow
def test_cli_analyze_rollout(tmp_path, capsys) -> None:
    pytest.importorskip("matplotlib")
    pytest.importorskip("sklearn")
    from vitattn.cli import main

    common = ["--max-images", "4", "--batch-size", "4", "--no-progress", "--rollout", "--rollout-images", "3"]
    out = tmp_path / "vit"
    rc = main(
        ["analyze", "vit_tiny_patch16_224", *TINY_ARGS, "--model-arg", "depth=2", *common]
        + ["--discard-ratio", "0.5", "--head-fusion", "max", "--out", str(out)]
    )
    assert rc == 0 and (out / "rollout.png").read_bytes()[:4] == b"\x89PNG"
    assert "rollout.png" in capsys.readouterr().err
    jumbo = tmp_path / "jumbo"
    rc = main(
        ["analyze", "locatjumbo_tiny", *TINY_ARGS, "--model-arg", "depth=2", "--model-arg", "J=2", *common]
        + ["--gradient-rollout", "--attention", "entmax15", "--out", str(jumbo)]
    )
    assert rc == 0 and (jumbo / "rollout.png").stat().st_size > 1000
    rc = main(
        [
            "analyze",
            "vit_tiny_patch16_224",
            *TINY_ARGS,
            "--rollout",
            "--rollout-images",
            "0",
            "--out",
            str(out),
        ]
    )
    assert rc == 2 and "--rollout-images: must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["vit", "dinov2_reg", "siglip"])
def test_transformers_models_roll_out_from_their_own_attentions(family: str) -> None:
    """A transformers model's ``outputs.attentions`` are rollout's input as they are; ``model_rollout``
    reads the same maps through ``attention_maps``, and the heat map takes the class token (token 0),
    or all tokens for SigLIP (no class token)."""
    pytest.importorskip("transformers")
    from .hf_tiny import FAMILIES, tiny_model

    model = tiny_model(family)
    x = torch.randn(2, 3, 32, 32)
    out = model(pixel_values=x, output_attentions=True)
    own = attention_rollout(list(out.attentions), 0.3, "max", num_prefix_tokens=FAMILIES[family][3])
    got = model_rollout(model, x, discard_ratio=0.3, head_fusion="max")
    torch.testing.assert_close(got, own, atol=1e-5, rtol=1e-5)
    prefix = FAMILIES[family][3]
    want = got[:, 0, prefix:] if prefix else got[:, :, prefix:].mean(1)
    torch.testing.assert_close(model_heatmap(model, x, got), want.reshape(2, 4, 4))
    x.requires_grad_(True)
    out = model(pixel_values=x, output_attentions=True)
    grads = torch.autograd.grad(out.last_hidden_state[:, 0].sum(), out.attentions)
    relevance = gradient_rollout([a.detach() for a in out.attentions], grads)
    assert relevance.shape == got.shape and torch.isfinite(relevance).all()
