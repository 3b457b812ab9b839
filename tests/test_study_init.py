"""The main job's fix: the mimetic attention start of the study ViT, the position embedding's scale,
and version 3 of the scenes (the main digit near the centre); version 2 is unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vitattn.datasets import DigitScenes
from vitattn.datasets.scenes import STATISTICS, VERSIONS, _main_box
from vitattn.layers import Attention
from vitattn.study import DATASETS, make_config
from vitattn.study.init import QK_ALPHA, QK_BETA, VO_ALPHA, VO_BETA, init_study_vit, mimetic_attention_init
from vitattn.study.model import build_model


def _target(dim: int, alpha: float, beta: float, gen: torch.Generator) -> torch.Tensor:
    z = torch.randn(dim, dim, generator=gen, dtype=torch.float64) / dim**0.5
    return alpha * z + beta * torch.eye(dim, dtype=torch.float64)


def test_mimetic_products_are_the_best_low_rank_fits_of_their_targets():
    dim, heads = 48, 4
    hd = dim // heads
    attn = Attention(dim, num_heads=heads)
    mimetic_attention_init(attn, generator=torch.Generator().manual_seed(7))
    gen = torch.Generator().manual_seed(7)  # the same draws, in the same order: one target per head, then V/O
    w = attn.qkv.weight.double()
    for h in range(heads):
        target = _target(dim, QK_ALPHA, QK_BETA, gen)
        product = w[h * hd : (h + 1) * hd].T @ w[dim + h * hd : dim + (h + 1) * hd]  # W_q,hᵀ W_k,h
        sigma = torch.linalg.svdvals(target)
        assert torch.linalg.matrix_rank(product) == hd
        # Eckart–Young: the best rank-hd fit misses exactly the discarded singular values
        miss = torch.linalg.matrix_norm(product - target) ** 2
        assert miss.item() == pytest.approx(float((sigma[hd:] ** 2).sum()), rel=1e-4)
    target = _target(dim, VO_ALPHA, -VO_BETA, gen)
    product = w[2 * dim :].T @ attn.proj.weight.double().T  # W_vᵀ W_projᵀ: x -> x W_vᵀ W_projᵀ
    torch.testing.assert_close(product, target, atol=1e-5, rtol=0)


def test_mimetic_attention_attends_to_similar_tokens_where_timms_init_is_uniform():
    torch.manual_seed(0)
    x = torch.nn.functional.layer_norm(torch.randn(1, 16, 64), (64,))
    spread = {}
    for scheme in ("timm", "mimetic"):
        torch.manual_seed(1)
        attn = Attention(64, num_heads=4)
        torch.nn.init.trunc_normal_(attn.qkv.weight, std=0.02)  # timm's ViT init of the linears
        if scheme == "mimetic":
            mimetic_attention_init(attn)
        q, k, _ = attn.qkv(x).reshape(1, 16, 3, 4, 16).permute(2, 0, 3, 1, 4)
        logits = (q @ k.transpose(-1, -2)) / 4.0
        diagonal = logits.diagonal(dim1=-2, dim2=-1).mean()
        spread[scheme] = (logits.std().item(), (diagonal - logits.mean()).item())
    assert spread["timm"][0] < 0.05  # nearly uniform attention
    assert spread["mimetic"][0] > 10 * spread["timm"][0] and spread["mimetic"][1] > 0.5  # itself first


@pytest.mark.parametrize("attention", ["softmax", "entmax15", "locat"])
def test_the_quick_preset_starts_every_attention_alike(attention):
    config = make_config("quick")
    assert config.init == "mimetic" and config.pos_embed_std == 1.0 and config.scenes_version == 3
    torch.manual_seed(0)
    model = build_model(config, attention)
    assert 0.9 < model.pos_embed.std().item() < 1.1
    w = model.blocks[0].attn.qkv.weight.detach().double()
    hd = config.dim // config.heads
    product = w[:hd].T @ w[config.dim : config.dim + hd]
    # the target's identity part shows as a positive trace (timm's init: about 0)
    assert product.trace().item() > 0.5 * QK_BETA * hd
    timm_model = build_model(make_config("quick", init="timm", pos_embed_std=0.02), attention)
    assert timm_model.blocks[0].attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.1)
    with pytest.raises(ValueError, match="init must be one of timm, mimetic"):
        init_study_vit(timm_model, "xavier", None)


def test_version_3_centres_the_main_digit():
    n = 32
    for version, sides, offsets in ((2, (20, 28), (0, 12)), (3, (24, 28), None)):
        rng = np.random.default_rng(0)
        boxes = [_main_box(rng, n, version) for _ in range(2000)]
        s = np.array([b[0] for b in boxes])
        assert (s.min(), s.max()) == sides
        if version == 3:
            centred = np.array([[(n - side) // 2 for side in s]] * 2).T
            shift = np.array([[b[1], b[2]] for b in boxes]) - centred
            assert shift.min() == -2 and shift.max() == 2  # n // 16: half a 4-px patch
        else:
            assert min(b[1] for b in boxes) == offsets[0] and max(b[1] for b in boxes) == offsets[1]


def test_version_3_scenes_are_another_split_of_the_same_kind(tmp_path):
    v2 = DigitScenes("test", size=64, cache_dir=tmp_path)
    v3 = DigitScenes("test", size=64, cache_dir=tmp_path, version=3)
    assert v2.version == 2 and v3.version == 3 and v3.cache_path != v2.cache_path
    assert not torch.equal(v2.images, v3.images)
    assert repr(v3).endswith("seed=0, version=3)")
    offset = []  # mean distance of the main digit's pixel centroid from the image centre
    for ds in (v2, v3):
        centroids = []
        for mask, label in zip(ds.masks, ds.labels, strict=True):
            yy, xx = torch.nonzero(mask == label + 1, as_tuple=True)
            centroids.append(torch.stack([yy.double().mean(), xx.double().mean()]))
        offset.append((torch.stack(centroids) - 15.5).abs().mean().item())
    assert offset[1] < 2.0 < 2.5 < offset[0]  # 1.5 px against 2.8 px on these 64 test scenes
    again = DigitScenes("test", size=64, cache_dir=tmp_path, version=3)
    assert again.from_cache and torch.equal(again.images, v3.images)
    with pytest.raises(ValueError, match="version must be one of 2, 3"):
        DigitScenes("test", size=4, version=4)
    assert VERSIONS == (2, 3) and DigitScenes.mean == STATISTICS[2][0]


def test_the_study_normalizes_with_version_3s_statistics():
    assert (DATASETS["scenes"].mean, DATASETS["scenes"].std) == STATISTICS[3]


@pytest.mark.slow
def test_version_3_statistics_are_those_of_its_train_split(tmp_path):
    ds = DigitScenes("train", cache_dir=tmp_path, version=3)
    x = ds.images.to(torch.float64) / 255.0
    mean, std = STATISTICS[3]
    np.testing.assert_allclose(x.mean(dim=(0, 2, 3)).numpy(), mean, atol=1e-3)
    np.testing.assert_allclose(x.std(dim=(0, 2, 3), unbiased=False).numpy(), std, atol=1e-3)
