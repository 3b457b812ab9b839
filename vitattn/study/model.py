"""The study's compact ViT, as a vitattn :class:`~vitattn.models.LocAtViT` with a chosen attention."""

from __future__ import annotations

from typing import TypedDict

import torch

from ..layers.adaptive import LayerNormalizer
from ..models import LocAtViT
from ..patch import patch
from .config import StudyConfig

__all__ = ["STUDY_WINDOW", "build_model", "model_kwargs"]

# the neighbourhood of the "window" attention on the study's 8x8 patch grid: uniform attention over
# 5x5 patches has about the mean attention distance (1.9 patches) of LocAt's most local block-0 heads
STUDY_WINDOW = 5


class ModelKwargs(TypedDict):
    """The keyword arguments :func:`model_kwargs` gives :class:`LocAtViT`."""

    img_size: int
    patch_size: int
    in_chans: int
    num_classes: int
    embed_dim: int
    depth: int
    num_heads: int
    mlp_ratio: float
    drop_rate: float
    attn_drop_rate: float
    drop_path_rate: float
    gaug: bool
    prr: bool
    normalizer: LayerNormalizer


def model_kwargs(config: StudyConfig, attention: str) -> ModelKwargs:
    """Builder arguments of :class:`LocAtViT` (timm ``VisionTransformer`` ones plus ``gaug``, ``prr``,
    ``normalizer``) for ``attention`` in ``softmax``, ``entmax15``, ``locat``, ``adaptive``, ``window``
    (the window itself is patched in by :func:`build_model`)."""
    spec = config.spec
    return ModelKwargs(
        img_size=spec.img_size,
        patch_size=spec.patch_size,
        in_chans=spec.channels,
        num_classes=spec.num_classes,
        embed_dim=config.dim,
        depth=config.depth,
        num_heads=config.heads,
        mlp_ratio=config.mlp_ratio,
        drop_rate=0.0,
        attn_drop_rate=0.0,
        drop_path_rate=0.0,
        gaug=attention == "locat",
        prr=config.prr,
        normalizer=_NORMALIZERS.get(attention, "softmax"),
    )


_NORMALIZERS: dict[str, LayerNormalizer] = {"entmax15": "entmax15", "adaptive": "adaptive"}


def build_model(config: StudyConfig, attention: str) -> LocAtViT:
    """The study model: input ``(B, C, img, img)`` -> logits ``(B, num_classes)``; 8×8 patches + class token.

    ``softmax`` keeps timm's fused attention (the same math as :class:`vitattn.layers.Attention`),
    ``entmax15`` uses :class:`vitattn.layers.EntmaxAttention`-style blocks, ``locat`` GAug attention,
    ``adaptive`` alpha-entmax with one learnable alpha per head (from 1.5), ``window`` softmax
    neighbourhood attention (:class:`vitattn.layers.NeighborhoodAttention`, a
    :data:`STUDY_WINDOW` x :data:`STUDY_WINDOW` window; the class token stays global).
    The position embedding is redrawn with std ``config.pos_embed_std`` when that differs from
    timm's 0.02 (digits). Initialise under a seeded RNG for reproducible weights.
    """
    model = LocAtViT(**model_kwargs(config, attention))
    if attention == "window":
        patch(model, attention="window", window=STUDY_WINDOW)
    std = config.pos_embed_std
    if std is not None and std != 0.02 and model.pos_embed is not None:
        with torch.no_grad():
            model.pos_embed.normal_(0.0, float(std))
    return model
