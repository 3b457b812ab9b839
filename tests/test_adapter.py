"""vitattn.adapter: layout_of picks the layout once; TimmLayout reads a timm model as timm builds it, and
a plain rule run through ``intercept`` reproduces the model's own forward (timm's and transformers')."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from timm.models.swin_transformer import SwinTransformer
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from vitattn.adapter import ModelLayout, TimmLayout, layout_of, resolve_layout
from vitattn.transfer.base import layer_scores, plain_rule

TINY = dict(img_size=32, patch_size=8, embed_dim=32, depth=3, num_heads=4, num_classes=5)


def vit(**overrides: Any) -> nn.Module:
    torch.manual_seed(0)
    return VisionTransformer(**{**TINY, **overrides}).eval()


def plain(layout: ModelLayout) -> Any:
    """The rule that computes what each layer computes itself."""

    def rule(i: int, attn: nn.Module, q: Any, k: Any, v: torch.Tensor) -> torch.Tensor:
        return plain_rule(layout, i, layer_scores(layout, i, q, k), v)

    return rule


def test_timm_vit_layout_reads_what_timm_built() -> None:
    model = vit(reg_tokens=2, dynamic_img_size=True)
    layout = layout_of(model)
    assert isinstance(layout, TimmLayout)
    assert layout.model is model and layout.depth == 3 and not layout.windowed
    assert all(a is b for a, b in zip(layout.blocks, model.blocks, strict=True))
    assert all(a is b.attn for a, b in zip(layout.attentions, model.blocks, strict=True))
    assert layout.attention_names == ["blocks[0].attn", "blocks[1].attn", "blocks[2].attn"]
    assert [layout.num_heads(i) for i in range(3)] == [4, 4, 4]
    assert layout.grid() == (4, 4) and layout.grid((48, 32)) == (6, 4)
    assert layout.num_prefix_tokens == model.num_prefix_tokens == 3
    assert layout.num_class_tokens == 1 and layout.has_class_token
    assert layout.patch_size == (8, 8) and layout.image_size == (32, 32)
    assert layout.final_norm is model.norm
    assert layout.normalizer(0) == "softmax"
    assert layout.scale(1) == model.blocks[1].attn.scale == 8**-0.5
    assert layout.bias(0, torch.zeros(1, 4, 19, 8)) is None
    assert layout.dropout(0) == 0.0
    dropping = vit(attn_drop_rate=0.25)
    assert layout_of(dropping).dropout(2) == 0.0  # eval mode
    assert layout_of(dropping.train()).dropout(2) == 0.25


def test_layout_follows_a_swapped_attention() -> None:
    model = vit()
    layout = layout_of(model)
    new = nn.Identity()
    model.blocks[1].attn = new
    assert layout.attentions[1] is new


def test_swin_is_windowed_and_refused_where_maps_must_cover_the_image() -> None:
    swin = SwinTransformer(
        img_size=32, patch_size=4, embed_dim=16, depths=(1, 2), num_heads=(2, 4), window_size=4
    )
    layout = layout_of(swin)
    assert layout.windowed and layout.depth == 3
    assert layout.block_names == ["layers[0].blocks[0]", "layers[1].blocks[0]", "layers[1].blocks[1]"]
    assert [layout.num_heads(i) for i in range(3)] == [2, 4, 4]
    with pytest.raises(TypeError, match=r"teacher \(SwinTransformer\) attends within local windows"):
        layout_of(swin, "teacher", windowed=False)


def test_what_a_model_lacks_reads_as_none_and_blocks_as_a_type_error() -> None:
    layout = layout_of(nn.Linear(2, 2), "student")
    assert layout.depth == 0 and layout.grid() is None and layout.num_prefix_tokens is None
    assert layout.patch_size is None and layout.final_norm is None
    with pytest.raises(TypeError, match="student must be a timm VisionTransformer.*got Linear"):
        _ = layout.blocks
    with pytest.raises(TypeError, match="backbone must be .* got str"):
        layout_of("vit", "backbone")  # type: ignore[arg-type]


def test_plain_rule_through_intercept_is_the_timm_forward() -> None:
    model = vit(reg_tokens=1).double()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    layout = layout_of(model)
    with torch.no_grad():
        ref = model(x)
        with layout.intercept([0, 2], plain(layout)):
            assert "forward" in model.blocks[2].attn.__dict__
            got = model(x)
    torch.testing.assert_close(got, ref)
    assert all("forward" not in block.attn.__dict__ for block in model.blocks)  # removed on exit


def test_intercept_runs_the_rule_and_is_removed_after_an_error() -> None:
    model = vit()
    layout = layout_of(model)
    seen: list[tuple[int, tuple[int, ...] | None]] = []

    def rule(i: int, attn: nn.Module, q: Any, k: Any, v: torch.Tensor) -> torch.Tensor:
        seen.append((i, None if q is None else tuple(q.shape)))
        raise KeyError("stop")

    with pytest.raises(KeyError, match="stop"), layout.intercept([1], rule, need_qk=False):
        layout.forward(torch.randn(1, 3, 32, 32))
    assert seen == [(1, None)]
    assert "forward" not in model.blocks[1].attn.__dict__


def test_resolve_layout_completes_grid_and_prefix() -> None:
    assert resolve_layout(17, None, 1) == ((4, 4), 1)
    assert resolve_layout(27, (5, 5), None) == ((5, 5), 2)
    with pytest.raises(ValueError, match="N = 18"):
        resolve_layout(18, (4, 4), 1)


@pytest.mark.parametrize("family", ["deit", "siglip"])
def test_transformers_model_gets_its_hf_layout(family: str) -> None:
    pytest.importorskip("transformers")
    import vitattn.hf

    from .hf_tiny import hidden, images, prefix_tokens, tiny_model

    model = tiny_model(family)
    layout = layout_of(model)
    assert isinstance(layout, vitattn.hf.HFLayout)
    assert layout.depth == 2 and not layout.windowed and layout.grid() == (4, 4)
    assert layout.num_prefix_tokens == prefix_tokens(family)
    assert layout.num_class_tokens == (family != "siglip")
    x = images()
    with torch.no_grad():
        ref = hidden(model, x).last_hidden_state
        with layout.intercept([0, 1], plain(layout)):
            got = layout.forward(x).last_hidden_state
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
