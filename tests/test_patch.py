"""vitattn.patch: attention swapped in place in timm ViTs, weights kept, errors named."""

from __future__ import annotations

import copy

import pytest
import timm
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from timm.models.vision_transformer import VisionTransformer
from torch import nn

import vitattn
from vitattn.layers import Attention, EntmaxAttention, GaussianAugment, LocAtAttention
from vitattn.models import LocAtViT

from .helpers import stress_gaug

LAYOUTS = {
    "cls": dict(),
    "reg": dict(reg_tokens=3),
    "avg": dict(class_token=False, global_pool="avg"),
    "dynamic": dict(dynamic_img_size=True),
    "qk_norm": dict(qk_norm=True, reg_tokens=1),
}


TINY = dict(img_size=32, patch_size=8, embed_dim=32, depth=3, num_heads=2, num_classes=5)


def tiny_vit(**kw) -> VisionTransformer:
    return VisionTransformer(**{**TINY, **kw}).eval()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_softmax_patch_leaves_outputs_unchanged(layout: str) -> None:
    model = tiny_vit(**LAYOUTS[layout])
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        before = model(x)
        assert vitattn.patch(model, "softmax") is model
        torch.testing.assert_close(model(x), before)
    assert all(type(b.attn) is Attention for b in model.blocks)


@pytest.mark.parametrize("attention", ["entmax15", "locat"])
def test_patch_keeps_weights(attention: str) -> None:
    model = tiny_vit(reg_tokens=2)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    qkv = model.blocks[0].attn.qkv.weight
    vitattn.patch(model, attention)
    new_state = model.state_dict()
    assert all(torch.equal(new_state[k], v) for k, v in state.items())
    extra = set(new_state) - set(state)
    assert all(".attn.gaug." in k for k in extra) and (bool(extra) == (attention == "locat"))
    assert model.blocks[0].attn.qkv.weight is qkv  # the very same parameter: optimizers keep working
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_locat_patch_equals_locatvit(layout: str) -> None:
    """A patched timm ViT computes what a LocAtViT with the same weights computes."""
    torch.manual_seed(0)
    model = tiny_vit(**LAYOUTS[layout])
    vitattn.patch(model, "locat", prr=True)
    stress_gaug(model)
    twin = LocAtViT(**{**TINY, **LAYOUTS[layout]})
    twin.load_state_dict(model.state_dict(), strict=True)
    twin.eval()
    sizes = [(32, 32), (48, 24)] if layout == "dynamic" else [(32, 32)]
    with torch.no_grad():
        for h, w in sizes:
            x = torch.randn(2, 3, h, w)
            torch.testing.assert_close(model(x), twin(x), atol=1e-5, rtol=1e-5)
            assert model.blocks[0].attn.grid_size == (h // 8, w // 8)


def test_fresh_gaug_init_matches_model() -> None:
    model = vitattn.patch(tiny_vit(), "locat")
    for block in model.blocks:
        g = block.attn.gaug
        assert torch.all(g.log_var.bias == 0) and torch.all(g.log_alpha.bias == 0)
        assert 0.005 < g.log_var.weight.std() < 0.05
        assert block.attn.grid_size == (4, 4) and block.attn.num_prefix_tokens == 1


@settings(max_examples=15, deadline=None, derandomize=True)
@given(
    blocks=st.lists(st.integers(-3, 2), min_size=1, max_size=3),
    attention=st.sampled_from(["entmax15", "locat"]),
)
def test_patch_selected_blocks(blocks: list[int], attention: str) -> None:
    model = vitattn.patch(tiny_vit(), attention, blocks=blocks)
    chosen = {i % 3 for i in blocks}
    cls = EntmaxAttention if attention == "entmax15" else LocAtAttention
    for i, block in enumerate(model.blocks):
        assert isinstance(block.attn, cls) == (i in chosen)
        assert isinstance(block.attn, cls) or type(block.attn).__module__.startswith("timm")


def test_patch_twice_keeps_gaug_and_single_hook() -> None:
    model = vitattn.patch(tiny_vit(dynamic_img_size=True), "locat")
    gaug = model.blocks[1].attn.gaug
    vitattn.patch(model, "locat", blocks=[1])
    assert model.blocks[1].attn.gaug is gaug
    assert len(model.patch_embed._forward_pre_hooks) == 1


def test_prr_patch_matches_timm_prr_pool() -> None:
    model = tiny_vit()
    x = torch.randn(2, 3, 32, 32) * 2
    try:
        ref = tiny_vit(global_pool="prr")
    except AssertionError:
        pytest.skip("this timm has no global_pool='prr'")
    ref.load_state_dict(model.state_dict(), strict=True)
    vitattn.patch(model, "softmax", prr=True)
    vitattn.patch(model, "softmax", prr=True)  # idempotent
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), atol=1e-5, rtol=1e-5)


def test_prr_pools_live_next_to_prr() -> None:
    """The pooling modules patch installs are vitattn.layers'; vitattn.patch still exports them."""
    from vitattn.layers import prr as prr_layers
    from vitattn.patch import PRRPool, PRRPoolNHWC

    assert PRRPool is vitattn.layers.PRRPool is prr_layers.PRRPool
    assert PRRPool.__module__ == PRRPoolNHWC.__module__ == "vitattn.layers.prr"
    assert PRRPoolNHWC is vitattn.layers.PRRPoolNHWC is prr_layers.PRRPoolNHWC
    layer, x = vitattn.PRR(8, 2), torch.randn(2, 3, 4, 8)
    want = layer(x.reshape(2, 12, 8)).mean(1)  # PRR over the 12 positions, then the average pool
    torch.testing.assert_close(PRRPoolNHWC(layer, nn.Flatten(1, 2))(x).mean(1), want)


def test_prr_patch_on_locatvit_sets_its_prr() -> None:
    model = LocAtViT(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, prr=False)
    vitattn.patch(model, "locat", prr=True)
    assert model.prr is not None and model.attn_pool is None


def test_patch_errors() -> None:
    with pytest.raises(TypeError, match="VisionTransformer"):
        vitattn.patch(nn.Linear(3, 3), "locat")
    with pytest.raises(TypeError, match="VisionTransformer"):
        vitattn.patch("vit", "locat")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="attention must be one of"):
        vitattn.patch(tiny_vit(), "flash")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="out of range"):
        vitattn.patch(tiny_vit(), "locat", blocks=[3])
    with pytest.raises(TypeError, match="block indices"):
        vitattn.patch(tiny_vit(), "locat", blocks=["0"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="patch dropout"):
        vitattn.patch(tiny_vit(patch_drop_rate=0.3), "locat")
    odd = tiny_vit()
    odd.blocks[0].attn = nn.Identity()
    with pytest.raises(
        TypeError,
        match=r"blocks\[0\]\.attn is Identity \(torch\.nn\.modules\.linear\.Identity\).*"
        r"timm\.layers\.attention\.Attention.*LocAtAttention",
    ):
        vitattn.patch(odd, "entmax15")
    with pytest.raises(
        ValueError, match=r"attention=torch\.nn\.modules\.linear\.Identity is not a layer.*'locat'"
    ):
        vitattn.patch(tiny_vit(), nn.Identity)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="normalizer must be one of"):
        vitattn.patch(tiny_vit(), "locat", normalizer="relu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="contradicts"):
        vitattn.patch(tiny_vit(), "entmax15", normalizer="softmax")
    with pytest.raises(ValueError, match="pool"):
        vitattn.patch(tiny_vit(global_pool="map"), "softmax", prr=True)


# ---- normalizer= ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["cls", "reg", "dynamic"])
def test_locat_entmax_patch_equals_locatvit_entmax(layout: str) -> None:
    """attention="locat", normalizer="entmax15" is what LocAtViT(normalizer="entmax15") computes."""
    torch.manual_seed(0)
    model = vitattn.patch(tiny_vit(**LAYOUTS[layout]), "locat", prr=True, normalizer="entmax15")
    assert all(type(b.attn) is LocAtAttention and b.attn.normalizer == "entmax15" for b in model.blocks)
    stress_gaug(model)
    twin = LocAtViT(**{**TINY, **LAYOUTS[layout]}, normalizer="entmax15")
    twin.load_state_dict(model.state_dict(), strict=True)
    twin.eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(model(x), twin(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("attention", "normalizer", "cls", "expected"),
    [
        ("softmax", None, Attention, "softmax"),
        ("entmax15", None, EntmaxAttention, "entmax15"),
        ("locat", None, LocAtAttention, "softmax"),
        ("softmax", 1.25, Attention, 1.25),
        ("softmax", "sparsemax", Attention, "sparsemax"),
        ("locat", 1.5, LocAtAttention, "entmax15"),
        ("entmax15", "entmax15", EntmaxAttention, "entmax15"),
        (LocAtAttention, "entmax15", LocAtAttention, "entmax15"),
    ],
)
def test_patch_normalizer_choices(attention, normalizer, cls, expected) -> None:
    model = vitattn.patch(tiny_vit(), attention, normalizer=normalizer, blocks=[0, 2])
    for i, block in enumerate(model.blocks):
        if i == 1:
            assert type(block.attn).__module__.startswith("timm")
        else:
            assert type(block.attn) is cls and block.attn.normalizer == expected
    with torch.no_grad():
        assert torch.isfinite(model(torch.randn(1, 3, 32, 32))).all()


def test_repatch_changes_normalizer_keeps_gaug() -> None:
    model = vitattn.patch(tiny_vit(), "locat")
    gaug = model.blocks[0].attn.gaug
    vitattn.patch(model, "locat", normalizer="entmax15")
    assert model.blocks[0].attn.gaug is gaug and model.blocks[0].attn.normalizer == "entmax15"


# ---- the identity start (gaug_init="identity") -------------------------------------------------------------
def _scaled_up(model: nn.Module, seed: int = 0) -> nn.Module:
    """Weights drawn at 1 / sqrt(fan in) (timm's init is far smaller), norms near 1, other vectors
    at 0.1: activations stay near unit scale while attention is far from uniform, so that a small
    change of the scores shows in the outputs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in ([""] + name.split("."))[-2]:  # the module of a norm's weight or bias
                p.copy_(1.0 + 0.1 * noise if name.endswith("weight") else 0.1 * noise)
            elif p.dim() >= 2 and "pos_embed" not in name and "token" not in name:
                p.copy_(noise * p[0].numel() ** -0.5)
            else:
                p.copy_(0.1 * noise if p.dim() == 1 else 0.5 * noise)
    return model.eval()


IDENTITY_CASES = {
    "vit": lambda: tiny_vit(reg_tokens=2),
    "eva": lambda: timm.create_model(
        "vit_small_patch16_rope_mixed_224", img_size=32, patch_size=8, depth=2, num_classes=5
    ),
    "swin": lambda: timm.create_model(
        "swin_tiny_patch4_window7_224",
        img_size=64,
        window_size=4,
        embed_dim=48,
        depths=(2, 2),
        num_heads=(3, 6),
        num_classes=5,
    ),
}


@pytest.mark.parametrize("family", IDENTITY_CASES)
def test_identity_start_keeps_outputs(family: str) -> None:
    """``gaug_init="identity"`` keeps a model's outputs to 1e-4 at patch time; ``"paper"`` moves them."""
    model = _scaled_up(IDENTITY_CASES[family]())
    size = 64 if family == "swin" else 32
    x = torch.randn(2, 3, size, size)
    with torch.no_grad():
        before = model(x)
        identity = vitattn.patch(copy.deepcopy(model), "locat", gaug_init="identity")
        paper = vitattn.patch(copy.deepcopy(model), "locat")
        torch.testing.assert_close(identity(x), before, atol=1e-4, rtol=0)
        assert (paper(x) - before).abs().max() > 5e-4  # the paper's start changes the function
    for m in identity.modules():
        if isinstance(m, GaussianAugment):  # the paper's heads behind a zero gate, one per head
            assert m.gate is not None and torch.equal(m.gate, torch.zeros_like(m.gate))
            assert torch.all(m.log_alpha.bias == 0) and 0 < m.log_alpha.weight.std() < 0.05
    with pytest.raises(ValueError, match="gaug_init must be one of"):
        vitattn.patch(model, "locat", gaug_init="zeros")


def test_identity_start_keeps_existing_heads() -> None:
    model = vitattn.patch(tiny_vit(), "locat")
    heads = [b.attn.gaug for b in model.blocks]
    vitattn.patch(model, "locat", gaug_init="identity", normalizer="entmax15")
    assert [b.attn.gaug for b in model.blocks] == heads


REGISTERED_FROM_PLAIN = {
    "locatvit_tiny": ("vit_tiny_patch16_224", dict(img_size=32, patch_size=8, depth=2, num_classes=5), 32),
    "locatvit_tiny_rope_mixed": (
        "vit_small_patch16_rope_mixed_224",
        dict(img_size=32, patch_size=8, depth=2, embed_dim=192, num_heads=3, num_classes=5),
        32,
    ),
    "locatswin_tiny": (
        "swin_tiny_patch4_window7_224",
        dict(img_size=64, window_size=4, embed_dim=48, depths=(2, 2), num_heads=(3, 6), num_classes=5),
        64,
    ),
}


@pytest.mark.parametrize("name", REGISTERED_FROM_PLAIN)
def test_registered_model_from_a_plain_checkpoint(name: str, tmp_path) -> None:
    """A registered LocAt model loads a plain (GAug-free) timm checkpoint; with ``gaug_init="identity"``
    (and no PRR) it computes what the plain model does, to 1e-4."""
    from safetensors.torch import save_file

    plain_name, kwargs, size = REGISTERED_FROM_PLAIN[name]
    plain = _scaled_up(timm.create_model(plain_name, **kwargs))
    path = tmp_path / "plain.safetensors"
    save_file({k: v.contiguous() for k, v in plain.state_dict().items()}, str(path))
    overlay = dict(file=str(path))
    x = torch.randn(2, 3, size, size)
    model = timm.create_model(
        name, pretrained=True, pretrained_cfg_overlay=overlay, gaug_init="identity", prr=False, **kwargs
    ).eval()
    paper = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=overlay, prr=False, **kwargs)
    paper.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), plain(x), atol=1e-4, rtol=0)
        assert (paper(x) - plain(x)).abs().max() > 5e-4
    assert model.gaug_init == "identity" and paper.gaug_init == "paper"


# ---- composition: a later call changes only what it names ------------------------------------------------
def _gaug_keys(model: nn.Module) -> list[str]:
    return [k for k in model.state_dict() if ".gaug." in k]


COMPOSE_CASES = {
    "vit": (lambda: _scaled_up(tiny_vit(reg_tokens=1)), 32),
    "locatvit_tiny": (
        lambda: _scaled_up(
            timm.create_model("locatvit_tiny", img_size=32, patch_size=8, depth=2, num_classes=5)
        ),
        32,
    ),
    "eva": (IDENTITY_CASES["eva"], 32),
    "swin": (IDENTITY_CASES["swin"], 64),
}


@pytest.mark.parametrize("family", COMPOSE_CASES)
@pytest.mark.parametrize("normalizer", ["entmax15", "adaptive"])
def test_a_normalizer_alone_keeps_gaug(family: str, normalizer: str) -> None:
    """``patch(model, normalizer=...)`` on a LocAt model (patched, or the registered LocAtViT) keeps
    every GAug head (the same modules) and computes what one call naming both computes."""
    if family == "swin" and normalizer == "adaptive":
        pytest.skip("refused on a Swin: test_adaptive_on_a_swin_is_refused")
    make, size = COMPOSE_CASES[family]
    torch.manual_seed(0)
    base = make().eval()
    locat = base if family == "locatvit_tiny" else vitattn.patch(_scaled_up(base), "locat")
    stress_gaug(locat)
    keys, heads = _gaug_keys(locat), [m for m in locat.modules() if isinstance(m, GaussianAugment)]
    assert len(keys) == 4 * len(heads) > 0
    at_once = copy.deepcopy(locat)
    vitattn.patch(locat, normalizer=normalizer)
    assert _gaug_keys(locat) == keys
    assert [m for m in locat.modules() if isinstance(m, GaussianAugment)] == heads
    vitattn.patch(at_once, "locat", normalizer=normalizer)
    x = torch.randn(2, 3, size, size)
    with torch.no_grad():
        torch.testing.assert_close(locat(x), at_once(x))
        plain = copy.deepcopy(base) if family != "locatvit_tiny" else None
    if plain is not None:  # and GAug does act: not what the same normalizer without it computes
        vitattn.patch(plain, "softmax", normalizer=normalizer)
        plain.load_state_dict({k: v for k, v in locat.state_dict().items() if ".gaug." not in k})
        with torch.no_grad():
            assert (plain(x) - locat(x)).abs().max() > 1e-4


def test_a_window_and_learned_alphas_survive_later_calls() -> None:
    """A window-patched ViT keeps its window under ``normalizer=`` (it was lost: attention defaulted to
    softmax), an adaptive one keeps its learned alphas under ``attention="locat"``, and ``window=``
    alone windows a LocAt layer, GAug kept."""
    torch.manual_seed(0)
    model = vitattn.patch(_scaled_up(tiny_vit()), "window", window=3)
    vitattn.patch(model, normalizer="adaptive")
    attn = model.blocks[0].attn
    assert isinstance(attn, vitattn.layers.NeighborhoodAttention) and attn.window == (3, 3)
    assert attn.normalizer == "adaptive"
    twin = vitattn.patch(_scaled_up(tiny_vit()), "window", window=3, normalizer="adaptive")
    twin.load_state_dict(model.state_dict())
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        attn.adaptive_alpha.logit.copy_(torch.tensor([0.8, -1.2]))  # "learned"
        twin.blocks[0].attn.adaptive_alpha.logit.copy_(torch.tensor([0.8, -1.2]))
        torch.testing.assert_close(model(x), twin(x))
    alphas = attn.adaptive_alpha
    vitattn.patch(model, "locat")  # GAug added inside the window, the alphas kept
    attn = model.blocks[0].attn
    assert isinstance(attn, LocAtAttention) and attn.window == (3, 3) and attn.adaptive_alpha is alphas
    heads = attn.gaug
    vitattn.patch(model, window=(3, 5), blocks=[0])
    attn = model.blocks[0].attn
    assert attn.gaug is heads and attn.window == (3, 5) and attn.normalizer == "adaptive"
    assert model.blocks[1].attn.window == (3, 3)
    vitattn.patch(model, "softmax", blocks=[0])  # naming an attention without GAug removes it
    assert type(model.blocks[0].attn) is Attention and model.blocks[0].attn.normalizer == "softmax"
    plain = vitattn.patch(tiny_vit(), window=3)  # window= alone on a plain ViT: neighbourhood attention
    assert isinstance(plain.blocks[0].attn, vitattn.layers.NeighborhoodAttention)


def test_entmax_then_locat_keeps_entmax_and_attention_none_converts() -> None:
    model = vitattn.patch(tiny_vit(), "entmax15")
    vitattn.patch(model, "locat")
    assert all(type(b.attn) is LocAtAttention and b.attn.normalizer == "entmax15" for b in model.blocks)
    model = vitattn.patch(tiny_vit(), "entmax15")
    vitattn.patch(model)  # nothing named: every block stays what it is
    assert all(type(b.attn) is EntmaxAttention for b in model.blocks)
    timm_vit = tiny_vit()
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        before = timm_vit(x)
        vitattn.patch(timm_vit)  # timm's layers become the vitattn layers computing the same
        assert all(type(b.attn) is Attention for b in timm_vit.blocks)
        torch.testing.assert_close(timm_vit(x), before, atol=1e-5, rtol=1e-5)


def test_adaptive_on_a_swin_is_refused() -> None:
    swin = vitattn.patch(IDENTITY_CASES["swin"](), "locat")
    with pytest.raises(ValueError, match=r"normalizer='adaptive' is not available for a Swin.*layers\[0\]"):
        vitattn.patch(swin, normalizer="adaptive")
    assert len(_gaug_keys(swin)) == 4 * 4  # nothing changed
