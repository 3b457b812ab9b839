"""Jumbo and LocAt Jumbo (``vitattn.models.jumbo``): the official reference outputs, a plain float64
restatement of the official forward that judges the layouts the file does not cover, the registry,
timm's feature API and the argument checks."""

from __future__ import annotations

import json
import os
from pathlib import Path

import entmax
import pytest
import timm
import torch
import torch.nn.functional as F
from safetensors import safe_open
from timm.layers import resample_abs_pos_embed
from torch import nn

import vitattn
from vitattn.layers import Attention, LocAtAttention
from vitattn.models import Jumbo

from .helpers import official_locat_attention, official_prr, stress_gaug

_DEFAULT_REFERENCE = Path(__file__).resolve().parent / "data" / "reference"
REFERENCE = Path(os.environ.get("VITATTN_REFERENCE_DIR", _DEFAULT_REFERENCE))
JUMBO_FILE = REFERENCE / "locatjumbo_grid8.safetensors"


def load_reference() -> tuple[str, dict, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    with safe_open(str(JUMBO_FILE), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    assert meta["family"] == "jumbo"
    sd = {k[3:]: v for k, v in tensors.items() if k.startswith("sd.")}
    return meta["model"], json.loads(meta["config"]), sd, tensors


def reference_model() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    name, cfg, sd, t = load_reference()
    model = timm.create_model(name, **cfg).eval()
    model.load_state_dict(sd, strict=True)
    return model, t


# ---- the official forward, re-stated in float64 from the parameters -------------------------------------
def _ln(x: torch.Tensor, norm: nn.Module, eps: float) -> torch.Tensor:
    """The official LayerNorm with its stated eps (not the module's), in float64."""
    return F.layer_norm(x, x.shape[-1:], norm.weight.double(), norm.bias.double(), eps)


def _mlp(x: torch.Tensor, mlp: nn.Module) -> torch.Tensor:
    h = F.gelu(F.linear(x, mlp.fc1.weight.double(), mlp.fc1.bias.double()))
    return F.linear(h, mlp.fc2.weight.double(), mlp.fc2.bias.double())


def _plain_attention(attn: nn.Module, x: torch.Tensor, normalizer: str) -> torch.Tensor:
    b, n, c = x.shape
    w, bias = attn.qkv.weight.double(), attn.qkv.bias.double()
    q, k, v = (x @ w.T + bias).reshape(b, n, 3, attn.num_heads, -1).permute(2, 0, 3, 1, 4)
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    p = s.softmax(-1) if normalizer == "softmax" else entmax.entmax15(s, dim=-1)
    out = (p @ v).transpose(1, 2).reshape(b, n, c)
    return F.linear(out, attn.proj.weight.double(), attn.proj.bias.double())


def official_jumbo(
    model: nn.Module,
    image: torch.Tensor,
    gaug: bool,
    prr: bool,
    norm_patches: bool,
    normalizer: str = "softmax",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Features (after the final norms) and logits of the official ``Jumbo`` (eval), from the model's
    parameters: patch embedding, position embedding of the patches only (resampled for another grid as
    timm's ViT does), J class tokens in front, each block as the official ``JumboBlock``, the split
    final norm, PRR over all tokens, the head on the J class tokens flattened."""
    J = model.cls_token.shape[1]
    proj = model.patch_embed.proj
    x = F.conv2d(image.double(), proj.weight.double(), proj.bias.double(), stride=proj.stride)
    b, d, gh, gw = x.shape
    x = x.flatten(2).transpose(1, 2)
    init = tuple(model.patch_embed.grid_size)
    pos = model.pos_embed
    if (gh, gw) != init:
        pos = resample_abs_pos_embed(pos, new_size=(gh, gw), old_size=init, num_prefix_tokens=0)
    x = torch.cat([model.cls_token.double().expand(b, -1, -1), x + pos.double()], dim=1)
    for blk in model.blocks:
        h = _ln(x, blk.norm1, 1e-6)
        if gaug:
            a = official_locat_attention(blk.attn, h.float(), (gh, gw), J, init, normalizer).double()
        else:
            a = _plain_attention(blk.attn, h, normalizer)
        x = x + blk.ls1.gamma.double() * a
        cls = x[:, :J].reshape(b, J * d)
        cls = cls + blk.ls3.gamma.double() * _mlp(_ln(cls, blk.norm3, 1e-5), model.jumbo_mlp)
        patches = x[:, J:]
        patches = patches + blk.ls2.gamma.double() * _mlp(_ln(patches, blk.norm2, 1e-6), blk.mlp)
        x = torch.cat([cls.reshape(b, J, d), patches], dim=1)
    cls = _ln(x[:, :J].reshape(b, J * d), model.norm, 1e-5).reshape(b, J, d)
    patches = _ln(x[:, J:], model.norm_patches, 1e-5) if norm_patches else x[:, J:]
    feats = torch.cat([cls, patches], dim=1)
    out = official_prr(feats, model.blocks[-1].attn.num_heads) if prr else feats
    logits = F.linear(out[:, :J].reshape(b, J * d), model.head.weight.double(), model.head.bias.double())
    return feats.float(), logits.float()


def stress(model: nn.Module, seed: int = 0) -> None:
    """Every term counts: GAug from tiny to huge σ, layer scales ~1, random norms, class tokens and
    position embedding, a random head and a larger shared MLP output (as the reference file does)."""
    stress_gaug(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gamma"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif name in ("cls_token", "pos_embed") or name.startswith("head"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.3 * torch.randn(m.bias.shape, generator=g))
        model.jumbo_mlp.fc2.weight.mul_(4.0)


def assert_matches(
    model: nn.Module, image: torch.Tensor, official: tuple[torch.Tensor, torch.Tensor]
) -> float:
    with torch.no_grad():  # the restatement (from parameters that require grad) is compared detached
        feats = model.forward_features(image)
        logits = model(image)
        torch.testing.assert_close(model.forward_head(feats), logits)
    official = (official[0].detach(), official[1].detach())
    torch.testing.assert_close(feats, official[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits, official[1], atol=1e-4, rtol=1e-4)
    return float((logits - official[1]).abs().max().detach())


# ---- the official reference file --------------------------------------------------------------------------
def test_reference_file_present() -> None:
    assert JUMBO_FILE.is_file(), f"official Jumbo reference file missing: {JUMBO_FILE}"


def test_reference_outputs() -> None:
    model, t = reference_model()
    assert isinstance(model, Jumbo) and model.locat and model.J == 3
    with torch.no_grad():
        feats = model.forward_features(t["x0"])
        logits = model(t["x0"])
    assert feats.shape == (2, 3 + 64, 96) and logits.shape == (2, 100)
    torch.testing.assert_close(feats, t["features0"], atol=1e-4, rtol=0)
    torch.testing.assert_close(logits, t["logits0"], atol=1e-4, rtol=0)


def test_restatement_reproduces_reference() -> None:
    """The test's restatement of the official forward reproduces the file, so it can judge the layouts
    the file does not cover."""
    model, t = reference_model()
    feats, logits = official_jumbo(model, t["x0"], gaug=True, prr=True, norm_patches=True)
    torch.testing.assert_close(feats, t["features0"], atol=1e-4, rtol=0)
    torch.testing.assert_close(logits, t["logits0"], atol=1e-4, rtol=0)


def test_reference_state_dict_layout() -> None:
    """Official keys: the shared MLP under every block and at the top, equal copies; one MLP in memory."""
    _, _, sd, _ = load_reference()
    model, _ = reference_model()
    assert set(model.state_dict()) == set(sd)
    assert all(b.jumbo_mlp is model.jumbo_mlp for b in model.blocks)
    for key in ("fc1.weight", "fc2.bias"):
        assert torch.equal(sd[f"blocks.1.jumbo_mlp.{key}"], sd[f"jumbo_mlp.{key}"])
    names = [n for n, _ in model.named_parameters() if "jumbo_mlp" in n]
    assert sorted(names) == [f"jumbo_mlp.fc{i}.{w}" for i in (1, 2) for w in ("bias", "weight")]  # once
    bad = dict(sd)
    bad["blocks.1.jumbo_mlp.fc1.bias"] = bad["blocks.1.jumbo_mlp.fc1.bias"] + 1
    with pytest.raises(
        RuntimeError, match=r"blocks\.1\.jumbo_mlp\.fc1\.bias differs from jumbo_mlp\.fc1\.bias"
    ):
        model.load_state_dict(bad)
    eps = {name: m.eps for name, m in model.named_modules() if isinstance(m, nn.LayerNorm)}
    assert eps["norm"] == eps["norm_patches"] == eps["blocks.0.norm3"] == 1e-5
    assert eps["blocks.0.norm1"] == eps["blocks.1.norm2"] == 1e-6


# ---- official semantics on other layouts ----------------------------------------------------------------
SMALL = dict(patch_size=8, embed_dim=48, depth=2, num_heads=3, num_classes=7, J=3, jumbo_mlp_ratio=2)
LAYOUTS = {  # name: (model, overrides, input size)
    "locat_square": ("locatjumbo_tiny", dict(img_size=64), (64, 64)),
    "locat_non_square_built": ("locatjumbo_tiny", dict(img_size=(40, 72)), (40, 72)),
    "locat_dynamic_non_square": ("locatjumbo_tiny", dict(img_size=64, dynamic_img_size=True), (48, 80)),
    "locat_J1": ("locatjumbo_tiny", dict(img_size=32, J=1), (32, 32)),
    "locat_J5_ratio4": ("locatjumbo_tiny", dict(img_size=32, J=5, jumbo_mlp_ratio=4), (32, 32)),
    "locat_entmax": ("locatjumbo_tiny", dict(img_size=32, normalizer="entmax15"), (32, 32)),
    "plain": ("jumbo_tiny", dict(img_size=32), (32, 32)),
    "plain_J4_non_square": ("jumbo_tiny", dict(img_size=(32, 48), J=4), (32, 48)),
    "plain_entmax_dynamic": (
        "jumbo_tiny",
        dict(img_size=32, normalizer="entmax15", dynamic_img_size=True),
        (40, 24),
    ),
    "gaug_without_prr": ("locatjumbo_tiny", dict(img_size=32, prr=False), (32, 32)),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_matches_official_semantics(name: str) -> None:
    arch, overrides, size = LAYOUTS[name]
    model = timm.create_model(arch, **{**SMALL, **overrides}).eval()
    stress(model)
    locat = arch.startswith("locat")
    gaug, prr = locat, locat and overrides.get("prr", True)
    normalizer = overrides.get("normalizer", "softmax")
    layer = LocAtAttention if gaug else Attention
    assert all(type(b.attn) is layer for b in model.blocks)
    image = torch.randn(2, 3, *size)
    official = official_jumbo(model, image, gaug=gaug, prr=prr, norm_patches=locat, normalizer=normalizer)
    assert_matches(model, image, official)


def test_jumbo_class_builds_what_the_names_build() -> None:
    direct = Jumbo(img_size=32, locat=True, **SMALL)
    named = timm.create_model("locatjumbo_tiny", img_size=32, **SMALL)
    assert set(direct.state_dict()) == set(named.state_dict())
    plain = Jumbo(img_size=32, **SMALL)  # locat=False: the official default
    assert not any("gaug" in k or "norm_patches" in k for k in plain.state_dict())
    assert plain.prr is None and isinstance(plain.norm_patches, nn.Identity)
    assert set(plain.state_dict()) == set(timm.create_model("jumbo_tiny", img_size=32, **SMALL).state_dict())
    mixed = Jumbo(img_size=32, locat=True, prr=False, **SMALL)
    assert mixed.prr is None and isinstance(mixed.blocks[0].attn, LocAtAttention)
    assert mixed.blocks[0].attn.num_prefix_tokens == 3 and mixed.blocks[0].attn.grid_size == (4, 4)


# ---- registry, init, heads, features ------------------------------------------------------------------
def test_registered_with_timm() -> None:
    names = {"jumbo_tiny", "jumbo_base", "locatjumbo_tiny", "locatjumbo_base"}
    assert names <= set(timm.list_models("*jumbo*"))
    for name in names:
        entry = timm.models.model_entrypoint(name)
        assert entry is getattr(vitattn.models, name) and entry.__module__ == "vitattn.models.jumbo"
        assert entry.__name__ == name and "J = 6" in entry.__doc__
    with pytest.raises(ValueError, match="no weights"):
        timm.create_model("locatjumbo_tiny", pretrained=True)
    with torch.device("meta"):  # the real sizes, shapes only
        base = timm.create_model("locatjumbo_base")
        tiny = timm.create_model("jumbo_tiny")
    assert base.J == 6 and base.jumbo_mlp.fc1.weight.shape == (6 * 768 * 4, 6 * 768)
    assert base.head.weight.shape == (1000, 6 * 768) and base.pos_embed.shape == (1, 196, 768)
    assert tiny.cls_token.shape == (1, 6, 192) and tiny.blocks[0].ls3.gamma.shape == (6 * 192,)


def test_fresh_init_is_the_official_one() -> None:
    model = timm.create_model("locatjumbo_tiny", img_size=32, **{**SMALL, "num_classes": 100})
    assert torch.all(model.head.weight == 0)
    torch.testing.assert_close(model.head.bias, torch.full((100,), -4.60517), atol=1e-5, rtol=0)
    torch.testing.assert_close(model.blocks[0].ls3.gamma, torch.full((144,), 1e-4))
    assert 0.005 < model.cls_token.std() < 0.05
    model.init_weights()  # timm's re-init keeps the Jumbo parts official
    assert torch.all(model.head.weight == 0) and 0.005 < model.cls_token.std() < 0.05
    logits = model.eval()(torch.randn(2, 3, 32, 32))
    torch.testing.assert_close(logits.softmax(-1), torch.full((2, 100), 0.01))  # uniform at init


def test_head_reset_and_pre_logits() -> None:
    model = timm.create_model("locatjumbo_tiny", img_size=32, **SMALL).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        feats = model.forward_features(x)
        pre = model.forward_head(feats, pre_logits=True)
        assert pre.shape == (2, 3 * 48) and model.head_hidden_size == 144 and model.num_features == 48
        torch.testing.assert_close(model.head(pre), model(x))
        model.reset_classifier(11)
        assert model(x).shape == (2, 11)
        model.reset_classifier(0)
        torch.testing.assert_close(model(x), pre)
    with pytest.raises(ValueError, match="global_pool must stay 'token', got 'avg'"):
        model.reset_classifier(3, "avg")


def test_forward_intermediates_and_features_only() -> None:
    model = timm.create_model("locatjumbo_tiny", img_size=(32, 48), **SMALL).eval()
    stress(model)
    x = torch.randn(2, 3, 32, 48)
    outs: list[torch.Tensor] = []
    hooks = [b.register_forward_hook(lambda m, a, o: outs.append(o)) for b in model.blocks]
    with torch.no_grad():
        feats = model.forward_features(x)
        for h in hooks:
            h.remove()
        final, inter = model.forward_intermediates(x)
        torch.testing.assert_close(final, feats)
        assert [t.shape for t in inter] == [(2, 48, 4, 6)] * 2
        torch.testing.assert_close(inter[1], outs[1][:, 3:].reshape(2, 4, 6, 48).permute(0, 3, 1, 2))
        normed = model.forward_intermediates(
            x, indices=[0], norm=True, output_fmt="NLC", intermediates_only=True
        )
        torch.testing.assert_close(normed[0], model.final_norm(outs[0])[:, 3:])
        pairs = model.forward_intermediates(x, indices=1, return_prefix_tokens=True, intermediates_only=True)
        torch.testing.assert_close(pairs[0][1], outs[1][:, :3])
        d = model.forward_intermediates(x, output_dict=True, return_prefix_tokens=True, stop_early=True)
        assert set(d) == {"image_intermediates", "image_intermediates_prefix", "image_features"}
    features = timm.create_model(
        "locatjumbo_tiny", img_size=(32, 48), features_only=True, out_indices=(0, 1), **SMALL
    ).eval()
    with torch.no_grad():
        maps = features(x)
    assert [m.shape for m in maps] == [(2, 48, 4, 6)] * 2
    assert features.feature_info.channels() == [48, 48]
    assert model.prune_intermediate_layers([0], prune_norm=True) == [0]  # both final norms go
    assert len(model.blocks) == 1 and isinstance(model.norm, nn.Identity)
    assert isinstance(model.norm_patches, nn.Identity) and isinstance(model.head, nn.Identity)
    with torch.no_grad():
        torch.testing.assert_close(model.forward_intermediates(x)[0], outs[0])


def test_train_step_reaches_every_part() -> None:
    model = timm.create_model("locatjumbo_tiny", img_size=32, **SMALL).train()
    with torch.no_grad():
        model.head.weight.normal_(std=0.1)  # the official zero head would stop every gradient
    F.cross_entropy(model(torch.randn(2, 3, 32, 32)), torch.tensor([1, 2])).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, missing
    assert model.jumbo_mlp.fc1.weight.grad.abs().sum() > 0 and model.cls_token.grad.abs().sum() > 0
    assert model.blocks[1].attn.gaug.log_var.weight.grad.abs().sum() > 0


def test_grad_checkpointing_matches() -> None:
    model = timm.create_model("locatjumbo_tiny", img_size=32, **SMALL).train()
    stress(model)
    x = torch.randn(2, 3, 32, 32)
    plain = model(x)
    model.set_grad_checkpointing(True)
    torch.testing.assert_close(model(x), plain)
    torch.testing.assert_close(model.forward_intermediates(x)[0], model.forward_features(x))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(J=0), r"J \(the number of Jumbo prefix tokens\) must be an int >= 1, got 0"),
        (dict(reg_tokens=2), "reg_tokens=2 is not supported"),
        (dict(class_token=False), "class_token=False is not supported"),
        (dict(global_pool="avg"), "global_pool='avg' is not supported"),
        (dict(init_values=None), "init_values must be set"),
        (dict(no_embed_class=False), "no_embed_class=False is not supported"),
        (dict(block_fn=nn.Identity), "block_fn=.* is not supported"),
        (dict(patch_drop_rate=0.5), "patch_drop_rate=0.5 drops patches"),
    ],
)
def test_bad_arguments_fail_clearly(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Jumbo(locat=True, img_size=32, **{**SMALL, **overrides})
    if overrides.get("init_values", 0) is not None:  # timm's builder drops None arguments
        with pytest.raises(ValueError, match=message):
            timm.create_model("locatjumbo_tiny", img_size=32, **{**SMALL, **overrides})
