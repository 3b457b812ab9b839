"""The normalizer registry: a new normalizer is one :class:`NormalizerSpec` (and its function), and then
works everywhere: :func:`normalize`, a layer (fused and explicit paths, its FX node), ``vitattn.patch``
on timm and transformers models, and :func:`fy_loss`. The toy here is softmax at temperature 2,
``softmax(z / 2)``, whose references are plain ones: softmax attention with half the scale, and
``2 KL(y ‖ softmax(z / 2))`` for the loss."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
from timm.models.vision_transformer import VisionTransformer

import vitattn
from vitattn.functional import NormalizerSpec, fy_loss, normalize, register_normalizer, unregister_normalizer
from vitattn.functional.entropies import shannon_entropy
from vitattn.functional.normalize import normalizer_names, normalizer_spec, resolve_normalizer
from vitattn.layers import Attention, attention_extract_names, use_explicit_attention

pytestmark = pytest.mark.usefixtures("one_thread")

NAME = "toy_temp2"


def _temp2(scores: torch.Tensor, dim: int, masked: bool) -> torch.Tensor:
    return normalize(scores / 2, "softmax", dim, masked=masked)


def _temp2_entropy(p: torch.Tensor, dim: int) -> torch.Tensor:
    return 2 * shannon_entropy(p, dim)  # softmax(z / T) = argmax <z, p> + T H(p)


@pytest.fixture
def toy() -> Iterator[NormalizerSpec]:
    spec = register_normalizer(NormalizerSpec(NAME, 1.0, _temp2, _temp2_entropy))
    try:
        yield spec
    finally:
        unregister_normalizer(NAME)
    assert NAME not in normalizer_names()


def test_spec_defaults_and_lookup(toy: NormalizerSpec) -> None:
    assert toy.hf_name == f"vitattn_{NAME}" and toy.fx_name == NAME
    assert normalizer_spec(NAME) is toy and resolve_normalizer(NAME) == NAME
    assert normalizer_names()[:3] == ("softmax", "entmax15", "sparsemax") and NAME in normalizer_names()
    scores = torch.randn(3, 7)
    torch.testing.assert_close(normalize(scores, NAME), torch.softmax(scores / 2, -1))
    with pytest.raises(ValueError, match="registered already"):
        register_normalizer(NormalizerSpec(NAME, 1.0, _temp2, _temp2_entropy))


def test_registry_rejects_bad_specs() -> None:
    with pytest.raises(ValueError, match="identifier"):
        register_normalizer(NormalizerSpec("adaptive", 1.0, _temp2, _temp2_entropy))
    with pytest.raises(ValueError, match="hf_name"):
        register_normalizer(NormalizerSpec("x1", 1.0, _temp2, _temp2_entropy, hf_name="vitattn_softmax"))
    with pytest.raises(ValueError, match="fx_name"):
        register_normalizer(NormalizerSpec("x2", 1.0, _temp2, _temp2_entropy, fx_name="entmax"))
    with pytest.raises(ValueError, match="alpha_alias"):
        register_normalizer(NormalizerSpec("x3", 1.5, _temp2, _temp2_entropy, alpha_alias=True))
    with pytest.raises(ValueError, match="built-in"):
        unregister_normalizer("softmax")
    with pytest.raises(ValueError, match="no normalizer"):
        unregister_normalizer(NAME)
    with pytest.raises(ValueError, match="normalizer must be one of"):
        normalize(torch.zeros(2, 3), NAME)
    assert normalizer_names() == ("softmax", "entmax15", "sparsemax")


def _half_scale_reference(layer: Attention) -> Attention:
    """The layer as plain softmax attention with half its scale: softmax(q k^T s / 2)."""
    ref = copy.deepcopy(layer)
    ref.normalizer = "softmax"
    ref.scale = layer.scale / 2
    return ref


@pytest.mark.parametrize("fused", [True, False])
def test_layer(toy: NormalizerSpec, fused: bool) -> None:
    torch.manual_seed(0)
    layer = Attention(16, num_heads=2, normalizer=NAME).eval()
    layer.fused_attn = fused
    assert layer.head_alphas() == [1.0, 1.0]
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), _half_scale_reference(layer)(x))


TINY = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5)


def _timm_half_scale(model: VisionTransformer) -> VisionTransformer:
    ref = copy.deepcopy(model)
    for block in ref.blocks:
        block.attn.fused_attn = False  # timm's explicit path: q * scale, then softmax
        block.attn.scale = block.attn.scale / 2
    return ref


def test_timm_patch_and_fx_node(toy: NormalizerSpec) -> None:
    from timm.utils import AttentionExtract

    torch.manual_seed(0)
    model = VisionTransformer(**TINY).eval()
    ref = _timm_half_scale(model)
    x = torch.randn(2, 3, 32, 32)
    vitattn.patch(model, "softmax", normalizer=NAME)
    assert all(block.attn.normalizer == NAME for block in model.blocks)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x))
    use_explicit_attention(model)
    names = attention_extract_names(model)
    assert names == [f"blocks.{i}.attn.{NAME}" for i in range(2)]
    weights = AttentionExtract(model, names=names, method="fx")(x)
    assert list(weights) == names
    for w in weights.values():
        assert w.shape == (2, 2, 17, 17)
        torch.testing.assert_close(w.sum(-1), torch.ones(2, 2, 17))


def test_transformers_model(toy: NormalizerSpec) -> None:
    pytest.importorskip("transformers")
    import vitattn.hf

    from .hf_tiny import hidden, images, tiny_model

    model = tiny_model("vit")
    ref = copy.deepcopy(model)  # transformers' eager attention with half the scaling
    scaled = [m for m in ref.modules() if isinstance(getattr(m, "scaling", None), float)]
    assert len(scaled) == 2
    for module in scaled:
        module.scaling = module.scaling / 2
    x = images()
    with torch.no_grad():
        expected = hidden(ref, x).last_hidden_state
        patched = vitattn.patch(copy.deepcopy(model), "softmax", normalizer=NAME)
        torch.testing.assert_close(hidden(patched, x).last_hidden_state, expected, atol=1e-5, rtol=1e-5)
        assert vitattn.hf.attention_name(NAME) == f"vitattn_{NAME}"
        assert vitattn.hf.normalizer_of_name(f"vitattn_{NAME}") == NAME
        named = copy.deepcopy(model)
        named.set_attn_implementation(f"vitattn_{NAME}")
        torch.testing.assert_close(hidden(named, x).last_hidden_state, expected, atol=1e-5, rtol=1e-5)


def test_fy_loss(toy: NormalizerSpec) -> None:
    torch.manual_seed(0)
    scores = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    target = torch.softmax(torch.randn(4, 6, dtype=torch.float64), -1)
    loss = fy_loss(scores, target, NAME)
    log_q = torch.log_softmax(scores / 2, -1)  # 2 KL(y ‖ softmax(z / 2))
    expected = 2 * (target * (target.log() - log_q)).sum(-1)
    torch.testing.assert_close(loss, expected)
    (grad,) = torch.autograd.grad(loss.sum(), scores)
    torch.testing.assert_close(grad, torch.softmax(scores / 2, -1) - target)
    torch.testing.assert_close(fy_loss(scores, target, NAME, reduction="mean"), expected.mean())
    at_own = fy_loss(scores, torch.softmax(scores / 2, -1).detach(), NAME)
    torch.testing.assert_close(at_own, torch.zeros(4, dtype=torch.float64))


def test_attention_kinds_stated_once() -> None:
    """The attention kinds (vitattn/layers/kinds.py) are what patch, the study and the CLI take."""
    import argparse

    from vitattn.cli import analyze
    from vitattn.layers.kinds import (
        ATTENTION_KINDS,
        HF_PATCH_ATTENTIONS,
        PATCH_ATTENTIONS,
        implied_normalizer,
    )
    from vitattn.study import ATTENTIONS

    assert ATTENTIONS == tuple(ATTENTION_KINDS) == ("softmax", "entmax15", "locat", "adaptive", "window")
    assert PATCH_ATTENTIONS == ("softmax", "entmax15", "locat", "window")
    assert HF_PATCH_ATTENTIONS == ("softmax", "entmax15", "locat")
    assert [implied_normalizer(k) for k in ATTENTIONS] == ["softmax", "entmax15", None, "adaptive", None]
    parser = argparse.ArgumentParser()
    analyze.add_arguments(parser)
    (action,) = [a for a in parser._actions if a.dest == "attention"]
    assert tuple(action.choices or ()) == PATCH_ATTENTIONS
    model = VisionTransformer(**TINY).eval()
    with pytest.raises(ValueError, match="attention must be one of"):
        vitattn.patch(model, "adaptive")  # type: ignore[arg-type]  # a study kind, a normalizer for patch
