"""LocAt beyond the plain ViT: the RoPE ViT on timm's Eva and Swin; official outputs, official semantics
on other layouts (against plain restatements), and ``vitattn.patch`` on timm's Eva and Swin models."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import entmax
import pytest
import timm
import torch
import torch.nn.functional as F
from safetensors import safe_open
from timm.models.vision_transformer import global_pool_nlc
from torch import nn

import vitattn
from vitattn.functional import dispatch
from vitattn.functional.dispatch import AttentionCall
from vitattn.functional.reference import ReferenceBackend
from vitattn.layers import (
    GaussianAugment,
    LocAtRopeAttention,
    LocAtWindowAttention,
    RopeAttention,
    WindowAttention,
)
from vitattn.models import LocAtRoPEViT, LocAtSwin

from .helpers import official_prr, stress_gaug
from .reference_formulas import naive_gaug_bias, naive_gaug_params, naive_rotary

# The official outputs ship with the tests in tests/data/reference (override with VITATTN_REFERENCE_DIR).
_DEFAULT_REFERENCE = Path(__file__).resolve().parent / "data" / "reference"
REFERENCE = Path(os.environ.get("VITATTN_REFERENCE_DIR", _DEFAULT_REFERENCE))
ROPE_FILES = sorted(REFERENCE.glob("locatrope_*.safetensors"))
SWIN_FILES = sorted(REFERENCE.glob("locatswin_*.safetensors"))


def test_reference_files_present() -> None:
    assert ROPE_FILES and SWIN_FILES, (
        f"official reference files for the RoPE and Swin families missing in {REFERENCE}"
    )


def load_reference(path: Path) -> tuple[str, dict, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    sd = {k[3:]: v for k, v in tensors.items() if k.startswith("sd.")}
    return meta["model"], json.loads(meta["config"]), sd, tensors


def reference_model(path: Path) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    name, cfg, sd, t = load_reference(path)
    model = timm.create_model(name, **cfg).eval()
    model.load_state_dict(sd, strict=True)
    return model, t


# ---- the official semantics, re-stated in plain PyTorch ---------------------------------------------------
def _norm64(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A LayerNorm (or Identity) applied in float64, the module left as it is."""
    if isinstance(m, nn.Identity):
        return x
    assert isinstance(m, nn.LayerNorm), type(m)
    w = None if m.weight is None else m.weight.double()
    b = None if m.bias is None else m.bias.double()
    return F.layer_norm(x, m.normalized_shape, w, b, m.eps)


def _normalize(scores: torch.Tensor, normalizer: str) -> torch.Tensor:
    return scores.softmax(-1) if normalizer == "softmax" else entmax.entmax15(scores, dim=-1)


def official_rope_attention(
    attn: nn.Module,
    x: torch.Tensor,
    rope: torch.Tensor | None,
    grid: tuple[int, int] | None,
    init_grid: tuple[int, int] | None,
    normalizer: str = "softmax",
) -> torch.Tensor:
    """What the official RoPE attention computes (eval, no mask), in float64: σ, α from q after q_norm
    and before the rotation, the Gaussian bias added to the scores of the rotated q, k.

    ``grid=None``: no GAug (timm's rotary attention with ``normalizer``).
    """
    b, n, _ = x.shape
    h, d, p = attn.num_heads, attn.head_dim, attn.num_prefix_tokens
    xd = x.double()
    if attn.qkv is not None:
        w = attn.qkv.weight.double()
        if attn.q_bias is not None:
            bias = torch.cat([attn.q_bias, attn.k_bias, attn.v_bias]).double()
        else:
            bias = None if attn.qkv.bias is None else attn.qkv.bias.double()
        qkv = xd @ w.T + (0 if bias is None else bias)
        q, k, v = qkv.reshape(b, n, 3, h, d).permute(2, 0, 3, 1, 4)
    else:
        hk = attn.num_kv_heads

        def lin(m: nn.Linear, heads: int) -> torch.Tensor:
            y = xd @ m.weight.double().T + (0 if m.bias is None else m.bias.double())
            return y.reshape(b, n, heads, d).transpose(1, 2)

        q, k, v = lin(attn.q_proj, h), lin(attn.k_proj, hk), lin(attn.v_proj, hk)
    q, k = _norm64(attn.q_norm, q), _norm64(attn.k_norm, k)
    scores_bias = 0.0
    if grid is not None:
        sigma, alpha = naive_gaug_params(q[:, :, p:], attn.gaug.log_var, attn.gaug.log_alpha, init_grid)
        scores_bias = naive_gaug_bias(sigma, alpha, grid, p, init_grid)
    if rope is not None:
        half = attn.rotate_half
        q = torch.cat([q[:, :, :p], naive_rotary(q[:, :, p:], rope, half)], dim=2)
        k = torch.cat([k[:, :, :p], naive_rotary(k[:, :, p:], rope, half)], dim=2)
    groups = h // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    probs = _normalize((q @ k.transpose(-1, -2)) * d**-0.5 + scores_bias, normalizer)
    out = (probs @ v).transpose(1, 2).reshape(b, n, h * d)
    out = _norm64(attn.norm, out)
    if attn.gate is not None:
        out = out * torch.sigmoid(xd @ attn.gate.weight.double().T + attn.gate.bias.double())
    return (out @ attn.proj.weight.double().T + attn.proj.bias.double()).to(x.dtype)


def official_window_attention(
    attn: nn.Module, x: torch.Tensor, mask: torch.Tensor | None, gaug: bool, normalizer: str = "softmax"
) -> torch.Tensor:
    """What the official window attention computes (eval), in float64: scores + relative-position bias
    (+ shift mask) + the Gaussian bias of the window (grid = window, no prefix tokens)."""
    b, n, _ = x.shape
    h = attn.num_heads
    qkv = x.double() @ attn.qkv.weight.double().T + attn.qkv.bias.double()
    q, k, v = qkv.reshape(b, n, 3, h, -1).permute(2, 0, 3, 1, 4)
    table = attn.relative_position_bias_table.double()
    rel = table[attn.relative_position_index.reshape(-1)].reshape(n, n, h).permute(2, 0, 1)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5 + rel
    if mask is not None:
        nw = mask.shape[0]
        scores = (scores.reshape(-1, nw, h, n, n) + mask.double()[None, :, None]).reshape(b, h, n, n)
    if gaug:
        win = tuple(attn.window_size)
        sigma, alpha = naive_gaug_params(q, attn.gaug.log_var, attn.gaug.log_alpha, win)
        scores = scores + naive_gaug_bias(sigma, alpha, win, 0, win)
    out = (_normalize(scores, normalizer) @ v).transpose(1, 2).reshape(b, n, -1)
    return (out @ attn.proj.weight.double().T + attn.proj.bias.double()).to(x.dtype)


@contextmanager
def replaced(modules: list[nn.Module], fn: Callable[..., torch.Tensor]) -> Iterator[None]:
    """Inside, each module's output is ``fn(module, args, kwargs)``."""
    handles = [m.register_forward_hook(lambda m, a, kw, out: fn(m, a, kw), with_kwargs=True) for m in modules]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def eva_grid(model: nn.Module, image: torch.Tensor) -> tuple[int, int]:
    ph, pw = model.patch_embed.patch_size
    return image.shape[-2] // ph, image.shape[-1] // pw


def eva_official(
    model: nn.Module, image: torch.Tensor, gaug: bool, normalizer: str, prr: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Features and logits of an Eva model with every attention replaced by the restatement."""
    grid = eva_grid(model, image) if gaug else None
    init = tuple(model.patch_embed.grid_size) if gaug else None

    def fn(m, args, kwargs):
        return official_rope_attention(m, args[0], kwargs.get("rope"), grid, init, normalizer)

    with torch.no_grad(), replaced([b.attn for b in model.blocks], fn):
        feats = model.forward_features(image)
    x = official_prr(feats, model.blocks[0].attn.num_heads) if prr else feats
    x = global_pool_nlc(x, model.global_pool, model.num_prefix_tokens)
    return feats, model.head(model.fc_norm(x))


def swin_attns(model: nn.Module) -> list[nn.Module]:
    return [b.attn for stage in model.layers for b in stage.blocks]


def swin_official(
    model: nn.Module, image: torch.Tensor, gaug: bool, normalizer: str, prr: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    def fn(m, args, kwargs):
        mask = kwargs.get("mask", args[1] if len(args) > 1 else None)
        return official_window_attention(m, args[0], mask, gaug, normalizer)

    with torch.no_grad(), replaced(swin_attns(model), fn):
        feats = model.forward_features(image)
    x = feats
    if prr:
        x = official_prr(feats.flatten(1, 2), swin_attns(model)[-1].num_heads).reshape(feats.shape)
    return feats, model.head.fc(x.mean((1, 2)))


def assert_matches(
    model: nn.Module, image: torch.Tensor, official: tuple[torch.Tensor, torch.Tensor]
) -> None:
    with torch.no_grad():
        feats = model.forward_features(image)
        logits = model(image)
    torch.testing.assert_close(feats, official[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits, official[1], atol=1e-4, rtol=1e-4)


def stress_attention(model: nn.Module, seed: int = 1) -> None:
    """Make every attention term count: layer scale 1, Eva's q / v biases and the relative-position
    tables non-zero, a head that does not squash the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("gamma_1", "gamma_2"):
                p.fill_(1.0)
            elif leaf in ("q_bias", "v_bias", "relative_position_bias_table"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.startswith("head") and name.endswith("weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        for name, m in model.named_modules():
            if name.endswith(("attn.qkv", "attn.q_proj", "attn.k_proj")):
                m.weight.mul_(3.0)  # peaked attention


def stress_heads(model: nn.Module) -> None:
    """``stress_gaug`` on the GAug heads only (``stress_attention`` scales the projections)."""
    stress_gaug(nn.ModuleList([m for m in model.modules() if isinstance(m, GaussianAugment)]))


# ---- the official reference files --------------------------------------------------------------------------
@pytest.mark.parametrize("path", ROPE_FILES + SWIN_FILES, ids=lambda p: p.stem)
def test_reference_outputs(path: Path) -> None:
    model, t = reference_model(path)
    with torch.no_grad():
        feats = model.forward_features(t["x0"])
        logits = model(t["x0"])
        torch.testing.assert_close(model.forward_head(feats), logits)
    torch.testing.assert_close(feats, t["features0"], atol=1e-4, rtol=0)
    torch.testing.assert_close(logits, t["logits0"], atol=1e-4, rtol=0)


@pytest.mark.parametrize("path", ROPE_FILES + SWIN_FILES, ids=lambda p: p.stem)
def test_restatement_reproduces_reference(path: Path) -> None:
    """The restatements reproduce the official outputs, so they can judge the other layouts."""
    model, t = reference_model(path)
    official = swin_official if isinstance(model, LocAtSwin) else eva_official
    feats, logits = official(model, t["x0"], gaug=True, normalizer="softmax", prr=True)
    torch.testing.assert_close(feats, t["features0"], atol=1e-4, rtol=0)
    torch.testing.assert_close(logits, t["logits0"], atol=1e-4, rtol=0)


def test_registered_with_timm() -> None:
    names = set(timm.list_models("locat*"))
    assert {
        "locatvit_tiny_rope_mixed",
        "locatvit_base_rope_mixed",
        "locatswin_tiny",
        "locatswin_base",
    } <= names
    with pytest.raises(ValueError, match="no weights"):
        timm.create_model("locatswin_tiny", pretrained=True)
    for name, module in (("locatvit_base_rope_mixed", "locatrope"), ("locatswin_base", "locatswin")):
        entry = timm.models.model_entrypoint(name)
        assert entry is getattr(vitattn.models, name) and entry.__module__ == f"vitattn.models.{module}"
        assert entry.__name__ == name and "GAug and PRR" in entry.__doc__
    swin = timm.create_model("locatswin_tiny", **SWIN_TINY, img_size=32, window_size=4, features_only=True)
    assert swin.feature_info.out_indices == (0, 1)  # every stage by default
    # the official spelling overrides rope_type (the registered variants' "mixed" and an explicit one)
    cat = timm.create_model("locatvit_tiny_rope_mixed", **ROPE_TINY, rope_mixed_mode=False)
    direct = LocAtRoPEViT(**ROPE_TINY, use_rot_pos_emb=True, rope_type="mixed", rope_mixed_mode=False)
    assert type(cat.rope).__name__ == type(direct.rope).__name__ == "RotaryEmbeddingCat"
    with pytest.raises(ValueError, match="global_pool='prr' already applies PRR"):
        LocAtSwin(**SWIN_TINY, global_pool="prr")


# ---- official semantics on the other layouts ---------------------------------------------------------------
ROPE_TINY = dict(patch_size=8, embed_dim=48, depth=2, num_heads=3, num_classes=7, img_size=64)
ROPE_LAYOUTS = {
    "dynamic_non_square": (dict(dynamic_img_size=True), (48, 80)),
    "reg_tokens": (dict(num_reg_tokens=2), (64, 64)),
    "avg_no_cls": (dict(class_token=False, global_pool="avg"), (64, 64)),
    "rope_cat_qk_norm": (dict(rope_type="cat", qk_norm=True, use_abs_pos_emb=True), (64, 64)),
    "entmax": (dict(normalizer="entmax15"), (64, 64)),
    "non_square_built": (dict(img_size=(40, 72)), (40, 72)),
}


SWIN_TINY = dict(
    patch_size=4, embed_dim=24, depths=(2, 2), num_heads=(2, 4), num_classes=7, drop_path_rate=0.0
)
SWIN_LAYOUTS = {
    "window8": (dict(img_size=64, window_size=8), (64, 64)),
    "non_square": (dict(img_size=(32, 64), window_size=4), (32, 64)),
    "window_clamped": (dict(img_size=32, window_size=8), (32, 32)),  # stage 2 is 4x4: window 4, no shift
    "window_non_square": (dict(img_size=(32, 64), window_size=(4, 8)), (32, 64)),
    "entmax": (dict(img_size=32, window_size=4, normalizer="entmax15"), (32, 32)),
}


# family: (registered model, its small arguments, its layouts, the plain restatement)
FAMILY_LAYOUTS = {
    "rope": ("locatvit_tiny_rope_mixed", ROPE_TINY, ROPE_LAYOUTS, eva_official),
    "swin": ("locatswin_tiny", SWIN_TINY, SWIN_LAYOUTS, swin_official),
}


@pytest.mark.parametrize(
    "family, name", [(family, name) for family, spec in FAMILY_LAYOUTS.items() for name in spec[2]]
)
def test_layout_matches_official_semantics(family: str, name: str) -> None:
    model_name, tiny, layouts, official = FAMILY_LAYOUTS[family]
    cfg, size = layouts[name]
    model = timm.create_model(model_name, **{**tiny, **cfg}).eval()
    stress_attention(model)
    stress_heads(model)
    image = torch.randn(2, 3, *size)
    normalizer = cfg.get("normalizer", "softmax")
    assert_matches(model, image, official(model, image, gaug=True, normalizer=normalizer, prr=True))


# ---- vitattn.patch on timm's Eva / RoPE ViTs -----------------------------------------------------------
SMALL = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5)
EVA_MODELS = {  # name: (timm model, overrides, its attention class)
    "rope_mixed": ("vit_small_patch16_rope_mixed_224", {}, "AttentionRope"),
    "eva_reg_avg": ("vit_medium_patch16_rope_reg1_gap_256", {}, "EvaAttention"),
    "eva02_split_qkv": ("eva02_tiny_patch14_224", dict(qkv_fused=False), "EvaAttention"),
    "rope_gqa_qknorm_dynamic": (
        "vit_small_patch16_rope_mixed_224",
        dict(rope_type="cat", qkv_fused=False, num_kv_heads=1, qk_norm=True, dynamic_img_size=True),
        "AttentionRope",
    ),
}


def timm_eva(name: str) -> nn.Module:
    arch, overrides, cls = EVA_MODELS[name]
    model = timm.create_model(arch, **{**SMALL, **overrides}).eval()
    assert type(model.blocks[0].attn).__name__ == cls
    stress_attention(model)
    return model


def eva_image(name: str) -> torch.Tensor:
    return torch.randn(2, 3, 24, 40) if "dynamic" in name else torch.randn(2, 3, 32, 32)


@pytest.mark.parametrize("name", EVA_MODELS)
def test_patch_eva_softmax_keeps_outputs(name: str) -> None:
    model = timm_eva(name)
    image = eva_image(name)
    with torch.no_grad():
        before = model.forward_features(image), model(image)
    keys = set(model.state_dict())
    assert vitattn.patch(model, "softmax") is model
    assert all(type(b.attn) is RopeAttention for b in model.blocks)
    assert set(model.state_dict()) == keys
    with torch.no_grad():
        torch.testing.assert_close(model.forward_features(image), before[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(model(image), before[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", EVA_MODELS)
@pytest.mark.parametrize("attention", ["entmax15", "locat"])
def test_patch_eva_matches_official_semantics(name: str, attention: str) -> None:
    model = timm_eva(name)
    image = eva_image(name)
    vitattn.patch(model, attention, prr=True)
    layer = LocAtRopeAttention if attention == "locat" else RopeAttention
    assert all(type(b.attn) is layer for b in model.blocks)
    stress_heads(model)
    normalizer = "entmax15" if attention == "entmax15" else "softmax"
    official = eva_official(model, image, gaug=attention == "locat", normalizer=normalizer, prr=True)
    assert_matches(model, image, official)


def test_patched_eva_is_locatropevit() -> None:
    """A timm RoPE-Mixed ViT patched with LocAt + PRR is the official model: same keys, same outputs."""
    model = timm.create_model("vit_small_patch16_rope_mixed_224", **SMALL).eval()
    vitattn.patch(model, "locat", prr=True)
    stress_attention(model)
    stress_heads(model)
    twin = timm.create_model("locatvit_tiny_rope_mixed", **SMALL).eval()
    twin.load_state_dict(model.state_dict(), strict=True)
    image = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(model(image), twin(image), atol=1e-5, rtol=1e-5)


def test_patch_on_locatropevit_keeps_the_rotary_layers() -> None:
    """Patching a model whose layers are already vitattn's rotary LocAt layers keeps them rotary (the
    ViT family's converter would drop the rotation) and keeps their GAug heads."""
    model = timm.create_model("locatvit_tiny_rope_mixed", **SMALL).eval()
    stress_attention(model)
    stress_heads(model)
    image = torch.randn(2, 3, 32, 32)
    heads = [block.attn.gaug for block in model.blocks]
    with torch.no_grad():
        want = model(image)
        vitattn.patch(model, "locat")
        assert all(type(block.attn) is LocAtRopeAttention for block in model.blocks)
        assert [block.attn.gaug for block in model.blocks] == heads
        torch.testing.assert_close(model(image), want)
        vitattn.patch(model, "softmax", normalizer="entmax15")
        assert all(type(block.attn) is RopeAttention for block in model.blocks)


# ---- vitattn.patch on timm's Swin ------------------------------------------------------------------------
def timm_swin(**overrides: object) -> nn.Module:
    cfg = dict(img_size=32, window_size=4, embed_dim=16, depths=(2, 2), num_heads=(2, 4), num_classes=5)
    model = timm.create_model("swin_tiny_patch4_window7_224", **{**cfg, **overrides}).eval()
    stress_attention(model)
    return model


def test_patch_swin_softmax_keeps_outputs() -> None:
    model = timm_swin()
    image = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        before = model.forward_features(image), model(image)
    keys = set(model.state_dict())
    assert vitattn.patch(model, "softmax") is model
    assert all(type(a) is WindowAttention for a in swin_attns(model))
    assert set(model.state_dict()) == keys
    with torch.no_grad():
        torch.testing.assert_close(model.forward_features(image), before[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(model(image), before[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attention", ["entmax15", "locat"])
@pytest.mark.parametrize("size", [(32, 32), (32, 48)], ids=["square", "non_square"])
def test_patch_swin_matches_official_semantics(attention: str, size: tuple[int, int]) -> None:
    model = timm_swin(img_size=size)
    vitattn.patch(model, attention, prr=True)
    layer = LocAtWindowAttention if attention == "locat" else WindowAttention
    assert all(type(a) is layer for a in swin_attns(model))
    stress_heads(model)
    image = torch.randn(2, 3, *size)
    normalizer = "entmax15" if attention == "entmax15" else "softmax"
    assert_matches(model, image, swin_official(model, image, attention == "locat", normalizer, prr=True))


def test_patched_swin_is_locatswin() -> None:
    model = timm_swin()
    vitattn.patch(model, "locat", prr=True)
    vitattn.patch(model, "locat", prr=True)  # again: GAug heads and PRR kept, not doubled
    stress_heads(model)
    twin = timm.create_model(
        "locatswin_tiny",
        img_size=32,
        window_size=4,
        embed_dim=16,
        depths=(2, 2),
        num_heads=(2, 4),
        num_classes=5,
    ).eval()
    twin.load_state_dict(model.state_dict(), strict=True)
    image = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(model(image), twin(image), atol=1e-5, rtol=1e-5)


def test_patch_swin_blocks_counted_stage_by_stage() -> None:
    model = vitattn.patch(timm_swin(), "locat", blocks=[1, -1])
    kinds = [type(a) for a in swin_attns(model)]
    assert kinds[1] is LocAtWindowAttention and kinds[3] is LocAtWindowAttention
    assert type(swin_attns(model)[0]).__name__ == "WindowAttention" and kinds[0] is not WindowAttention


# ---- errors ------------------------------------------------------------------------------------------------
def test_patch_errors_name_the_class() -> None:
    eva = timm_eva("rope_mixed")
    eva.blocks[1].attn = nn.Identity()
    with pytest.raises(
        TypeError,
        match=r"blocks\[1\]\.attn is Identity \(torch\.nn\.modules\.linear\.Identity\).*"
        r"Attention.*AttentionRope.*EvaAttention.*swin_transformer\.WindowAttention",
    ):
        vitattn.patch(eva, "locat")
    swin = timm_swin()
    swin.layers[1].blocks[0].attn = nn.Identity()
    with pytest.raises(TypeError, match=r"layers\[1\]\.blocks\[0\]\.attn is Identity"):
        vitattn.patch(swin, "softmax")
    v2 = timm.create_model(
        "swinv2_tiny_window8_256", img_size=32, window_size=4, embed_dim=16, depths=(2,), num_heads=(2,)
    )
    with pytest.raises(
        TypeError, match=r"WindowAttention \(timm\.models\.swin_transformer_v2\.WindowAttention\)"
    ):
        vitattn.patch(v2, "locat")
    with pytest.raises(ValueError, match="patch dropout"):
        vitattn.patch(
            timm.create_model("vit_small_patch16_rope_mixed_224", patch_drop_rate=0.5, **SMALL), "locat"
        )


def test_layers_have_gaug_heads_with_official_names() -> None:
    model = timm.create_model("locatswin_tiny", **{**SWIN_TINY, "img_size": 32, "window_size": 4})
    assert all(isinstance(a.gaug, GaussianAugment) for a in swin_attns(model))
    assert "layers.0.blocks.0.attn.gaug.log_var.weight" in model.state_dict()
    rope = LocAtRoPEViT(**ROPE_TINY, attn_type="rope", use_rot_pos_emb=True, rope_mixed_mode=True)
    assert rope.rope_mixed and "blocks.1.attn.gaug.log_alpha.bias" in rope.state_dict()


@pytest.mark.parametrize("name", ["locatvit_tiny_rope_mixed", "locatswin_tiny"])
def test_gaug_heads_and_weights_get_gradients(name: str) -> None:
    cfg = ROPE_TINY if "rope" in name else {**SWIN_TINY, "img_size": 32, "window_size": 4}
    model = timm.create_model(name, **cfg).train()
    size = cfg["img_size"]
    model(torch.randn(2, 3, size, size)).square().sum().backward()
    gaug = [m for m in model.modules() if isinstance(m, GaussianAugment)]
    assert gaug and all(
        m.log_var.weight.grad is not None and m.log_alpha.weight.grad.abs().sum() > 0 for m in gaug
    )
    assert all(p.grad is not None for n, p in model.named_parameters() if "qkv" in n)


def test_rope_model_shares_the_locat_model_checks() -> None:
    with pytest.raises(ValueError, match="patch_drop_rate=0.5 drops patches"):
        LocAtRoPEViT(patch_drop_rate=0.5, **ROPE_TINY)
    model = LocAtRoPEViT(prr=True, **ROPE_TINY).eval()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        feats = model.forward_features(x)
        logits = model(x)
        torch.testing.assert_close(logits, model.forward_head(feats))
        prr, model.prr = model.prr, None  # the same model without PRR: another head input
        assert not torch.allclose(model(x), logits)
    assert isinstance(prr, vitattn.PRR) and prr.num_heads == 3


# ---- backend= on every family's layers, and across conversions ----------------------------------------
@pytest.fixture
def counting() -> Iterator[list[AttentionCall]]:
    """A backend named "counting" (the reference backend, recording its calls; last in "auto" order, so
    "auto" never picks it by itself), unregistered and the global default restored afterwards."""
    calls: list[AttentionCall] = []

    class Counting(ReferenceBackend):
        name = "counting"

        def run(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor | None]:
            calls.append(call)
            return super().run(call)

    saved = dict(dispatch._REGISTRY), list(dispatch._AUTO_ORDER), dispatch._DEFAULT_BACKEND
    dispatch.register_backend(Counting())
    try:
        yield calls
    finally:
        dispatch._REGISTRY.clear()
        dispatch._REGISTRY.update(saved[0])
        dispatch._AUTO_ORDER[:] = saved[1]
        dispatch._DEFAULT_BACKEND = saved[2]


WINDOW_KW = dict(dim=16, num_heads=2, window_size=4)


@pytest.mark.parametrize("cls", [WindowAttention, LocAtWindowAttention])
def test_window_layers_take_a_backend(cls: type[WindowAttention], counting: list[AttentionCall]) -> None:
    torch.manual_seed(0)
    x, shift = torch.randn(4, 16, 16), torch.zeros(2, 16, 16).masked_fill(torch.rand(2, 16, 16) > 0.7, -100.0)
    auto = cls(**WINDOW_KW).eval()
    named = cls(**WINDOW_KW, backend="counting").eval()
    named.load_state_dict(auto.state_dict())
    assert auto.backend == "auto" and "backend=" not in repr(auto)
    assert named.backend == "counting" and "backend='counting'" in repr(named)
    with torch.no_grad():
        want = auto(x, shift)
        assert not counting
        torch.testing.assert_close(named(x, shift), want)  # same result, computed by the named backend
    assert len(counting) == 1 and counting[0].q.shape == (4, 2, 16, 8)
    assert (counting[0].bias is not None) == (cls is LocAtWindowAttention)
    vitattn.set_default_backend("counting")  # a layer left at "auto" follows the global default
    with torch.no_grad():
        auto(x, shift)
    assert len(counting) == 2
    with pytest.raises(ValueError, match=r"backend must be 'auto', one of \[.*'torch'.*\], got 'nope'"):
        cls(**WINDOW_KW, backend="nope")


def _timm_layer(family: str) -> nn.Module:
    """A timm attention layer of ``family``, with dropout rates to carry over."""
    drops = dict(attn_drop=0.125, proj_drop=0.25)
    if family == "vit":
        return timm.layers.Attention(16, num_heads=2, qkv_bias=True, **drops)
    if family == "rope":
        return timm.layers.AttentionRope(16, num_heads=2, qkv_bias=True, **drops)
    return timm.models.swin_transformer.WindowAttention(16, 2, window_size=(4, 4), **drops)


_CONVERTERS = {  # family: (converter, its plain layer, its LocAt layer, extra LocAt arguments)
    "vit": (vitattn.layers.convert_attention, vitattn.Attention, vitattn.LocAtAttention, {"grid_size": 4}),
    "rope": (vitattn.layers.convert_rope_attention, RopeAttention, LocAtRopeAttention, {"grid_size": 4}),
    "swin": (vitattn.layers.convert_window_attention, WindowAttention, LocAtWindowAttention, {}),
}


@pytest.mark.parametrize("family", _CONVERTERS)
def test_conversion_carries_backend_and_dropout(family: str, counting: list[AttentionCall]) -> None:
    convert, plain, locat, extra = _CONVERTERS[family]
    timm_layer = _timm_layer(family)
    first = convert(timm_layer, plain)  # timm's layers have no backend: "auto"
    assert first.backend == "auto"
    named = convert(first, locat, backend="counting", **extra)  # the caller's backend wins
    again = convert(named, plain)  # a vitattn layer's backend carries over, into either class
    back = convert(again, locat, **extra)
    assert named.backend == again.backend == back.backend == "counting"
    assert convert(back, plain, backend="auto").backend == "auto"
    for layer in (first, named, again, back):
        assert (layer.attn_drop.p, layer.proj_drop.p) == (0.125, 0.25), type(layer).__name__
    assert back.qkv is timm_layer.qkv and convert(named, locat).gaug is named.gaug  # the same parameters
    x = torch.randn(4 if family == "swin" else 2, 16 if family == "swin" else 17, 16)
    with torch.no_grad():
        back.eval()(x)
    assert len(counting) == 1
