"""Constructor arguments of the layers in vitattn.layers and the arguments of vitattn.patch: a wrong type
is a TypeError, an out-of-range value a ValueError, each naming the argument and the value, raised before
anything is built or changed (a refused patch leaves the model as it was)."""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np
import pytest
import timm
import torch
from torch import nn

import vitattn
from vitattn.layers import (
    PRR,
    AdaptiveAlpha,
    Attention,
    EntmaxAttention,
    GaussianAugment,
    LocAtAttention,
    LocAtRopeAttention,
    LocAtWindowAttention,
    NeighborhoodAttention,
    RopeAttention,
    WindowAttention,
)

ATTENTIONS = [
    Attention,
    EntmaxAttention,
    LocAtAttention,
    NeighborhoodAttention,
    RopeAttention,
    LocAtRopeAttention,
]
GRID = {"grid_size": (4, 4)}


def _kwargs(cls: type) -> dict[str, Any]:
    return dict(GRID) if cls in (LocAtAttention, NeighborhoodAttention, LocAtRopeAttention) else {}


def _raises(error: type[Exception], *words: object) -> Any:
    """pytest.raises whose message holds every word (the argument's name, the value's repr)."""
    return pytest.raises(error, match="(?s)" + "".join(f"(?=.*{re.escape(str(w))})" for w in words))


@pytest.mark.parametrize("cls", ATTENTIONS, ids=lambda c: c.__name__)
@pytest.mark.parametrize(
    "args,error,words",
    [
        ((0, 4), ValueError, ["dim", "0"]),
        ((-64, 4), ValueError, ["dim", "-64"]),
        ((64.0, 4), TypeError, ["dim", "64.0"]),
        (("64", 4), TypeError, ["dim", "'64'"]),
        ((True, 1), TypeError, ["dim", "True"]),
        ((64, 0), ValueError, ["num_heads", "0"]),
        ((64, -2), ValueError, ["num_heads", "-2"]),
        ((64, 2.5), TypeError, ["num_heads", "2.5"]),
        ((64, None), TypeError, ["num_heads", "None"]),
        ((30, 4), ValueError, ["dim (30)", "num_heads (4)", "divisible"]),
    ],
)
def test_attention_dims(cls: type, args: tuple, error: type[Exception], words: list[str]) -> None:
    with _raises(error, *words):
        cls(*args, **_kwargs(cls))


@pytest.mark.parametrize(
    "kwargs,error,words",
    [
        ({"attn_head_dim": 0}, ValueError, ["attn_head_dim", "0"]),
        ({"attn_head_dim": 8.0}, TypeError, ["attn_head_dim", "8.0"]),
        ({"dim_out": 0}, ValueError, ["dim_out", "0"]),
        ({"dim_out": "32"}, TypeError, ["dim_out", "'32'"]),
        ({"qkv_bias": "False"}, TypeError, ["qkv_bias", "'False'"]),
        ({"qkv_bias": 1}, TypeError, ["qkv_bias", "1"]),
        ({"qk_norm": None}, TypeError, ["qk_norm", "None"]),
        ({"scale_norm": "yes"}, TypeError, ["scale_norm", "'yes'"]),
        ({"proj_bias": 0}, TypeError, ["proj_bias", "0"]),
        ({"gated": []}, TypeError, ["gated", "[]"]),
        ({"attn_drop": 1.5}, ValueError, ["attn_drop", "1.5"]),
        ({"attn_drop": -0.1}, ValueError, ["attn_drop", "-0.1"]),
        ({"attn_drop": math.nan}, ValueError, ["attn_drop", "nan"]),
        ({"attn_drop": "0.1"}, TypeError, ["attn_drop", "'0.1'"]),
        ({"proj_drop": 2}, ValueError, ["proj_drop", "2"]),
        ({"proj_drop": True}, TypeError, ["proj_drop", "True"]),
        ({"normalizer": "entmax"}, ValueError, ["normalizer", "'entmax'"]),
        ({"normalizer": 0.5}, ValueError, ["0.5"]),
        ({"backend": "cuda"}, ValueError, ["backend", "'cuda'"]),
    ],
)
def test_attention_arguments(kwargs: dict, error: type[Exception], words: list[str]) -> None:
    with _raises(error, *words):
        Attention(64, 4, **kwargs)


def test_attention_accepts_what_it_documents() -> None:
    layer = Attention(np.int64(30), np.int32(4), attn_head_dim=8, dim_out=16, attn_drop=1, proj_drop=0)
    assert (layer.num_heads, layer.head_dim, layer.proj.out_features) == (4, 8, 16)
    assert type(layer.num_heads) is int and layer.attn_drop.p == 1.0
    assert Attention(64, 4, qkv_bias=True, qk_norm=True, gated=True).gate is not None


@pytest.mark.parametrize(
    "cls", [LocAtAttention, NeighborhoodAttention, LocAtRopeAttention], ids=lambda c: c.__name__
)
@pytest.mark.parametrize(
    "kwargs,error,words",
    [
        ({"num_prefix_tokens": 1.7}, TypeError, ["num_prefix_tokens", "1.7"]),
        ({"num_prefix_tokens": "1"}, TypeError, ["num_prefix_tokens", "'1'"]),
        ({"num_prefix_tokens": True}, TypeError, ["num_prefix_tokens", "True"]),
        ({"num_prefix_tokens": -1}, ValueError, ["num_prefix_tokens", "-1"]),
        ({"grid_size": (0, 4)}, ValueError, ["grid_size", "(0, 4)"]),
        ({"grid_size": (4, 4.5)}, ValueError, ["grid_size", "(4, 4.5)"]),
        ({"window": 0}, ValueError, ["window", "0"]),
        ({"window": (3,)}, ValueError, ["window", "(3,)"]),
        ({"window": 2.5}, ValueError, ["window", "2.5"]),
        ({"window": 3, "dilation": 0}, ValueError, ["dilation", "0"]),
    ],
)
def test_grid_layouts(cls: type, kwargs: dict, error: type[Exception], words: list[str]) -> None:
    with _raises(error, *words):
        cls(32, 4, **{**GRID, **kwargs})


def test_initial_grid_and_gaug_init() -> None:
    with _raises(ValueError, "initial_grid_size", "-2"):
        LocAtAttention(32, 4, grid_size=4, initial_grid_size=-2)
    with _raises(ValueError, "gaug_init", "'zero'"):
        LocAtAttention(32, 4, grid_size=4, gaug_init="zero")


@pytest.mark.parametrize(
    "kwargs,error,words",
    [
        ({"num_prefix_tokens": 1.7}, TypeError, ["num_prefix_tokens", "1.7"]),
        ({"num_prefix_tokens": -1}, ValueError, ["num_prefix_tokens", "-1"]),
        ({"initial_grid_size": 0}, ValueError, ["initial_grid_size", "0"]),
        ({"grid_size": (2, 0)}, ValueError, ["grid_size", "(2, 0)"]),
    ],
)
def test_set_grid_changes_nothing_when_it_refuses(
    kwargs: dict, error: type[Exception], words: list[str]
) -> None:
    layer = LocAtAttention(32, 4, grid_size=(4, 4), num_prefix_tokens=1, window=3)
    before = (layer.grid_size, layer.num_prefix_tokens, layer.initial_grid_size, layer._window_mask)
    with _raises(error, *words):
        layer.set_grid(**{"grid_size": (2, 8), **kwargs})
    assert (layer.grid_size, layer.num_prefix_tokens, layer.initial_grid_size, layer._window_mask) == before


def test_gaussian_augment_and_adaptive_alpha() -> None:
    with _raises(ValueError, "head_dim", "0"):
        GaussianAugment(0)
    with _raises(TypeError, "head_dim", "8.0"):
        GaussianAugment(8.0)
    with _raises(ValueError, "num_heads", "0"):
        GaussianAugment(8, init="identity", num_heads=0)
    with _raises(ValueError, "num_heads", "0"):
        AdaptiveAlpha(0)
    with _raises(TypeError, "num_heads", "2.5"):
        AdaptiveAlpha(2.5)
    assert AdaptiveAlpha(np.int64(3)).num_heads == 3


@pytest.mark.parametrize(
    "args,kwargs,error,words",
    [
        ((0, 4), {}, ValueError, ["dim", "0"]),
        ((64, 0), {}, ValueError, ["num_heads", "0"]),
        ((64, 1.0), {}, TypeError, ["num_heads", "1.0"]),
        ((30, 4), {}, ValueError, ["dim (30)", "num_heads (4)"]),
        ((64, 4), {"pool": "max"}, ValueError, ["pool", "'max'"]),
        ((64, 4), {"pre_norm": "no"}, TypeError, ["pre_norm", "'no'"]),
        ((64, 4), {"post_norm": 1}, TypeError, ["post_norm", "1"]),
    ],
)
def test_prr(args: tuple, kwargs: dict, error: type[Exception], words: list[str]) -> None:
    with _raises(error, *words):
        PRR(*args, **kwargs)


def test_prr_dim_message_has_no_head_dim_hint() -> None:
    with pytest.raises(ValueError) as err:
        PRR(30, 4)
    assert "head_dim" not in str(err.value)


@pytest.mark.parametrize("cls", [WindowAttention, LocAtWindowAttention], ids=lambda c: c.__name__)
@pytest.mark.parametrize(
    "args,kwargs,error,words",
    [
        ((0, 4), {}, ValueError, ["dim", "0"]),
        ((32, 0), {}, ValueError, ["num_heads", "0"]),
        ((30, 4), {}, ValueError, ["dim (30)", "num_heads (4)", "head_dim"]),
        ((32, 4), {"head_dim": 0}, ValueError, ["head_dim", "0"]),
        ((32, 4), {"window_size": 0}, ValueError, ["window_size", "0"]),
        ((32, 4), {"window_size": (4, -1)}, ValueError, ["window_size", "(4, -1)"]),
        ((32, 4), {"qkv_bias": "True"}, TypeError, ["qkv_bias", "'True'"]),
        ((32, 4), {"attn_drop": 1.1}, ValueError, ["attn_drop", "1.1"]),
        ((32, 4), {"proj_drop": math.inf}, ValueError, ["proj_drop", "inf"]),
        ((32, 4), {"normalizer": "soft"}, ValueError, ["normalizer", "'soft'"]),
    ],
)
def test_swin_window_layers(
    cls: type, args: tuple, kwargs: dict, error: type[Exception], words: list[str]
) -> None:
    with _raises(error, *words):
        cls(*args, **{"window_size": 4, **kwargs})


def test_swin_window_layers_accept_what_they_document() -> None:
    layer = LocAtWindowAttention(30, 3, head_dim=8, window_size=(2, 4))
    assert (layer.head_dim, tuple(layer.window_size), layer.initial_window_size) == (8, (2, 4), (2, 4))
    with _raises(ValueError, "initial_window_size", "0"):
        LocAtWindowAttention(32, 4, window_size=4, initial_window_size=0)
    with _raises(ValueError, "gaug_init", "'zero'"):
        LocAtWindowAttention(32, 4, window_size=4, gaug_init="zero")


@pytest.mark.parametrize(
    "kwargs,error,words",
    [
        ({"num_kv_heads": 0}, ValueError, ["num_kv_heads", "0"]),
        ({"num_kv_heads": 1.5}, TypeError, ["num_kv_heads", "1.5"]),
        ({"num_kv_heads": 3}, ValueError, ["num_heads (4)", "num_kv_heads (3)"]),
        ({"rotate_half": "yes"}, TypeError, ["rotate_half", "'yes'"]),
        ({"qkv_fused": None}, TypeError, ["qkv_fused", "None"]),
        ({"qkv_bias": "no"}, TypeError, ["qkv_bias", "'no'"]),
    ],
)
def test_rotary_layers(kwargs: dict, error: type[Exception], words: list[str]) -> None:
    with _raises(error, *words):
        RopeAttention(32, 4, **kwargs)


# ---------------------------------------------------------------------------------------------- patch


def _vit(**kwargs: Any) -> nn.Module:
    torch.manual_seed(0)
    args = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4, num_classes=3)
    return timm.create_model("vit_tiny_patch16_224", **{**args, **kwargs}).eval()


def _state(model: nn.Module) -> tuple[list[str], dict[str, torch.Tensor]]:
    """The classes of every module and a copy of every tensor: what a refused patch must not change."""
    classes = [f"{name}:{type(m).__name__}" for name, m in model.named_modules()]
    tensors = {k: v.clone() for k, v in model.state_dict().items()}
    return classes, tensors


def _assert_unchanged(model: nn.Module, before: tuple[list[str], dict[str, torch.Tensor]]) -> None:
    classes, tensors = _state(model)
    assert classes == before[0]
    assert tensors.keys() == before[1].keys()
    for k, v in tensors.items():
        assert torch.equal(v, before[1][k]), k


@pytest.mark.parametrize(
    "kwargs,error,words",
    [
        ({"attention": "gaug"}, ValueError, ["attention", "'gaug'"]),
        ({"attention": nn.Linear}, ValueError, ["attention", "Linear"]),
        ({"attention": 3}, ValueError, ["attention", "3"]),
        ({"normalizer": "entmax"}, ValueError, ["normalizer", "'entmax'"]),
        ({"normalizer": 1.0}, ValueError, ["1.0"]),
        ({"normalizer": math.nan}, ValueError, ["nan"]),
        ({"attention": "locat", "normalizer": "bogus"}, ValueError, ["normalizer", "'bogus'"]),
        ({"attention": "locat", "gaug_init": "zero"}, ValueError, ["gaug_init", "'zero'"]),
        ({"attention": "locat", "prr": "yes"}, TypeError, ["prr", "'yes'"]),
        ({"attention": "locat", "prr": 1}, TypeError, ["prr", "1"]),
        ({"attention": "locat", "blocks": 1.5}, TypeError, ["blocks", "1.5"]),
        ({"attention": "locat", "blocks": "01"}, TypeError, ["blocks", "'01'"]),
        ({"attention": "locat", "blocks": [0, "1"]}, TypeError, ["blocks", "'1'"]),
        ({"attention": "locat", "blocks": [0, 5]}, ValueError, ["index 5", "2 blocks"]),
        ({"attention": "window", "window": 0}, ValueError, ["window", "0"]),
        ({"attention": "window", "window": -3}, ValueError, ["window", "-3"]),
        ({"attention": "window", "window": 2.5}, ValueError, ["window", "2.5"]),
        ({"attention": "locat", "window": (3, 3, 3)}, ValueError, ["window", "(3, 3, 3)"]),
        ({"attention": "window", "window": 3, "dilation": 0}, ValueError, ["dilation", "0"]),
        ({"attention": "softmax", "window": 3}, ValueError, ["window=3"]),
    ],
)
def test_patch_refuses_before_changing_anything(
    kwargs: dict, error: type[Exception], words: list[str]
) -> None:
    model = _vit()
    vitattn.patch(model, attention="locat", gaug_init="identity", blocks=[0])  # a model with a history
    before = _state(model)
    with _raises(error, *words):
        vitattn.patch(model, **kwargs)
    _assert_unchanged(model, before)


def test_patch_with_prr_on_an_attention_pooled_vit_changes_nothing() -> None:
    """prr=True on a ViT with its own attention pool was refused only after every block was patched."""
    model = _vit(global_pool="map")
    before = _state(model)
    with _raises(ValueError, "prr=True", "AttentionPool"):
        vitattn.patch(model, attention="locat", prr=True)
    _assert_unchanged(model, before)
    assert type(model.blocks[0].attn).__module__.startswith("timm")


def test_patch_refuses_a_model_that_is_not_one() -> None:
    with _raises(TypeError, "model", "Linear"):
        vitattn.patch(nn.Linear(2, 2), attention="locat")


def test_patch_still_accepts_what_it_documents() -> None:
    model = _vit()
    vitattn.patch(model, attention="locat", blocks=0, window=(3, 3), dilation=1, prr=True)
    vitattn.patch(model, normalizer=1.25, blocks=(1,))
    vitattn.patch(model, normalizer="adaptive", blocks=range(1))
    assert model.blocks[0].attn.window == (3, 3) and model.blocks[1].attn.normalizer == 1.25
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 3)


def test_patch_refuses_bad_arguments_of_a_transformers_model() -> None:
    pytest.importorskip("transformers")
    from .hf_tiny import tiny_model

    model = tiny_model("vit")
    before = _state(model)
    for kwargs, error, words in (
        ({"attention": "locat", "normalizer": "entmax"}, ValueError, ["normalizer", "'entmax'"]),
        ({"attention": "locat", "prr": "yes"}, TypeError, ["prr", "'yes'"]),
        ({"attention": "locat", "blocks": 0.5}, TypeError, ["blocks", "0.5"]),
        ({"attention": "locat", "gaug_init": None}, ValueError, ["gaug_init", "None"]),
        ({"attention": "window"}, ValueError, ["window"]),
    ):
        with _raises(error, *words):
            vitattn.patch(model, **kwargs)
        _assert_unchanged(model, before)
