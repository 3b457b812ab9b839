"""Tiny random transformers vision models, one per family vitattn supports, built from their configs
(no network): hidden size 32, 2 layers, 4 heads, 32 px images at patch 8 (a 4 x 4 grid)."""

from __future__ import annotations

from typing import Any

import torch
import transformers
from torch import nn

SIZE = 32
PATCH = 8
COMMON: dict[str, Any] = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    image_size=SIZE,
    patch_size=PATCH,
)

#: family -> (config class, model class, extra config arguments, prefix tokens)
FAMILIES: dict[str, tuple[str, str, dict[str, Any], int]] = {
    "vit": ("ViTConfig", "ViTModel", {}, 1),
    "deit": ("DeiTConfig", "DeiTModel", {}, 2),
    "dinov2": ("Dinov2Config", "Dinov2Model", {}, 1),
    "dinov2_reg": ("Dinov2WithRegistersConfig", "Dinov2WithRegistersModel", {"num_register_tokens": 2}, 3),
    "vit_mae": (
        "ViTMAEConfig",
        "ViTMAEModel",
        {
            "mask_ratio": 0.0,
            "decoder_hidden_size": 32,
            "decoder_num_hidden_layers": 1,
            "decoder_num_attention_heads": 4,
            "decoder_intermediate_size": 64,
        },
        1,
    ),
    "clip": ("CLIPVisionConfig", "CLIPVisionModel", {}, 1),
    "siglip": ("SiglipVisionConfig", "SiglipVisionModel", {}, 0),
}
NAMES = tuple(FAMILIES)


#: family -> a model class with a head on the family's tower (what `architectures` then names)
HEADS: dict[str, str] = {
    "vit": "ViTForImageClassification",
    "deit": "DeiTForImageClassificationWithTeacher",
    "dinov2": "Dinov2ForImageClassification",
    "dinov2_reg": "Dinov2WithRegistersForImageClassification",
    "vit_mae": "ViTMAEForPreTraining",
    "clip": "CLIPVisionModelWithProjection",  # in no Auto mapping: found by its name, as pipelines do
    "siglip": "SiglipForImageClassification",  # built from a SiglipConfig (vision and text)
}
TEXT: dict[str, Any] = dict(
    hidden_size=32,
    num_hidden_layers=1,
    num_attention_heads=4,
    intermediate_size=64,
    vocab_size=99,
    max_position_embeddings=16,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=1,
)


def tiny_config(family: str, **overrides: Any) -> Any:
    config_cls, _, extra, _ = FAMILIES[family]
    return getattr(transformers, config_cls)(**{**COMMON, **extra, **overrides})


def randomize(model: nn.Module) -> nn.Module:
    """Random, not near-zero, values everywhere (a fresh model's init hides bugs in biases and norms),
    drawn from torch's generator as it stands; eval mode."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.split(".")[-2]:  # LayerNorm weights near 1
                p.add_(0.1 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    return model.eval()


def tiny_model(family: str, attn: str = "eager", seed: int = 0, **overrides: Any) -> nn.Module:
    """The family's tiny model in eval mode, its attention implementation ``attn``."""
    _, model_cls, _, _ = FAMILIES[family]
    config = tiny_config(family, **overrides)
    config._attn_implementation = attn
    torch.manual_seed(seed)
    return randomize(getattr(transformers, model_cls)(config))


def tiny_head_model(family: str, seed: int = 0) -> nn.Module:
    """The family's tiny tower inside the model class :data:`HEADS` names (3 labels, or a 16-d
    projection for CLIP), random weights, eval mode; transformers' default attention implementation,
    as a loaded copy gets (ViT-MAE's decoder keeps the one it was built with)."""
    if family == "siglip":
        config = transformers.SiglipConfig(vision_config=dict(COMMON), text_config=dict(TEXT), num_labels=3)
    else:
        config = tiny_config(family, num_labels=3, projection_dim=16)
    torch.manual_seed(seed)
    return randomize(getattr(transformers, HEADS[family])(config))


def head_output(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What a model of :data:`HEADS` computes on ``x``: its logits, else its image embeddings."""
    with torch.no_grad():
        out = hidden(model, x)
    for name in ("logits", "image_embeds", "last_hidden_state"):
        value = getattr(out, name, None)
        if isinstance(value, torch.Tensor):
            return value
    raise AssertionError(f"no output tensor in {type(out).__name__}")


def prefix_tokens(family: str) -> int:
    return FAMILIES[family][3]


def images(batch: int = 2, size: int = SIZE, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(seed))


def hidden(model: nn.Module, x: torch.Tensor, **kwargs: Any) -> Any:
    """The model's output on ``x`` with every patch a token (ViT-MAE: patches in order)."""
    if type(model).__name__.startswith("ViTMAE"):
        n = (x.shape[-2] // PATCH) * (x.shape[-1] // PATCH)
        kwargs.setdefault("noise", torch.arange(n, dtype=torch.float32).expand(x.shape[0], -1))
    return model(pixel_values=x, **kwargs)
