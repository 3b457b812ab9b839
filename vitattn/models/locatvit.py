"""LocAtViT: timm's VisionTransformer with GAug (LocAt) attention and PRR, registered with timm."""

from __future__ import annotations

from typing import Any

from timm.data import IMAGENET_INCEPTION_MEAN, IMAGENET_INCEPTION_STD
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model, resolve_pretrained_cfg
from timm.models.vision_transformer import VisionTransformer, checkpoint_filter_fn

from ..functional.normalize import Normalizer, resolve_normalizer
from ..layers import Attention, LocAtAttention, convert_attention, convertible_attention
from ._locat_common import PRRHeadMixin, convert_all_blocks, make_prr, reject_patch_drop

__all__ = ["HUB_WEIGHTS", "LocAtViT", "locatvit_base", "locatvit_small", "locatvit_tiny"]


class LocAtViT(PRRHeadMixin, VisionTransformer):
    """Locality-Attending ViT: every timm ``VisionTransformer`` argument, plus

    Args:
        gaug: Gaussian-augmented (LocAt) attention in every block (``blocks.N.attn.gaug.*`` params).
        prr: parameter-free patch representation refinement after ``forward_features`` (after the
            final norm), before the model's own pooling and head.
        normalizer: the attention normalizer of every block (``"softmax"``, ``"entmax15"``, ...).

    ``forward_features`` returns ``(B, N, C)`` before PRR, as the official release does. The patch
    grid the model is built for fixes GAug's constants; with ``dynamic_img_size=True`` the grid of
    each input is computed from its size and σ is rescaled by ``min(grid) / min(initial grid)``.
    """

    def __init__(
        self,
        *args: Any,
        gaug: bool = True,
        prr: bool = True,
        normalizer: Normalizer = "softmax",
        **kwargs: Any,
    ) -> None:
        if prr and kwargs.get("global_pool") == "prr":
            raise ValueError("global_pool='prr' already applies PRR: pass prr=False with it, or another pool")
        reject_patch_drop(gaug, kwargs)
        super().__init__(*args, **kwargs)
        self.use_gaug = bool(gaug)
        self.normalizer = resolve_normalizer(normalizer)
        if self.use_gaug or self.normalizer != "softmax":
            self._convert_blocks()
        self.prr = make_prr(self, prr, kwargs)

    def _convert_blocks(self) -> None:
        grid = tuple(int(g) for g in self.patch_embed.grid_size)
        cls = LocAtAttention if self.use_gaug else Attention
        extra = dict(grid_size=grid, num_prefix_tokens=self.num_prefix_tokens) if self.use_gaug else {}
        needs = "timm's Attention (check block_fn / attn_layer)"
        convert_all_blocks(
            self, convertible_attention, convert_attention, cls, needs, self.use_gaug,
            normalizer=self.normalizer, **extra,
        )  # fmt: skip


def _cfg(**kwargs: Any) -> dict[str, Any]:
    """Pretrained cfg of the official release: timm's ViT defaults (ImageNet-1k head, 224 px, crop 0.9,
    bicubic, mean = std = 0.5 per channel), which its ``default_cfgs`` use unchanged."""
    return {
        "url": "",
        "num_classes": 1000,
        "input_size": (3, 224, 224),
        "pool_size": None,
        "crop_pct": 0.9,
        "interpolation": "bicubic",
        "fixed_input_size": True,
        "mean": IMAGENET_INCEPTION_MEAN,
        "std": IMAGENET_INCEPTION_STD,
        "first_conv": "patch_embed.proj",
        "classifier": "head",
        "paper_ids": "arXiv:2603.04892",
        "paper_name": "Locality-Attending Vision Transformer",
        "origin_url": "https://github.com/sinahmr/LocAtViT",
        **kwargs,
    }


_ARCHS = {
    "locatvit_tiny": dict(patch_size=16, embed_dim=192, depth=12, num_heads=3),
    "locatvit_small": dict(patch_size=16, embed_dim=384, depth=12, num_heads=6),
    "locatvit_base": dict(patch_size=16, embed_dim=768, depth=12, num_heads=12),
}
# The official release's ImageNet-1k weights on the Hugging Face Hub (safetensors, official key names)
HUB_WEIGHTS = {
    "locatvit_tiny": "sinahmr/locatvit_tiny",
    "locatvit_base": "sinahmr/locatvit_base",
}
default_cfgs = generate_default_cfgs(
    {name: _cfg(hf_hub_id=HUB_WEIGHTS[name]) if name in HUB_WEIGHTS else _cfg() for name in _ARCHS}
)


def _weight_source(variant: str, pretrained_cfg: Any, overlay: dict[str, Any]) -> bool:
    """Whether the pretrained cfg timm will resolve names any weights (hub id, url, file, state dict)."""
    cfg = resolve_pretrained_cfg(variant, pretrained_cfg=pretrained_cfg, pretrained_cfg_overlay=overlay)
    return bool(cfg.has_weights or cfg.state_dict is not None)


def _create(variant: str, pretrained: bool, **kwargs: Any) -> LocAtViT:
    kwargs = dict(_ARCHS[variant], **kwargs)
    overlay = dict(kwargs.pop("pretrained_cfg_overlay", None) or {})
    if pretrained and not _weight_source(variant, kwargs.get("pretrained_cfg"), overlay):
        raise ValueError(
            f"{variant} has no published weights (the official release publishes "
            f"{', '.join(sorted(HUB_WEIGHTS))}); use pretrained=False, or give a local checkpoint with "
            "pretrained_cfg_overlay=dict(file='path/to/weights.safetensors')"
        )
    if overlay.get("file"):  # a local file is taken to have the head asked for (else timm would drop it)
        overlay.setdefault("num_classes", kwargs.get("num_classes", 1000))
    return build_model_with_cfg(
        LocAtViT,
        variant,
        pretrained,
        pretrained_cfg_overlay=overlay or None,
        pretrained_filter_fn=checkpoint_filter_fn,
        feature_cfg=dict(out_indices=3, feature_cls="getter"),
        **kwargs,
    )


@register_model
def locatvit_tiny(pretrained: bool = False, **kwargs: Any) -> LocAtViT:
    """LocAtViT-Tiny: ViT-Ti/16 (dim 192, depth 12, 3 heads) at 224 px with GAug and PRR.

    ``pretrained=True`` loads the official ImageNet-1k weights from the Hub (``sinahmr/locatvit_tiny``).
    """
    return _create("locatvit_tiny", pretrained, **kwargs)


@register_model
def locatvit_small(pretrained: bool = False, **kwargs: Any) -> LocAtViT:
    """LocAtViT-Small: ViT-S/16 (dim 384, depth 12, 6 heads) at 224 px with GAug and PRR.

    The official release publishes no weights for it: ``pretrained=True`` needs a local file.
    """
    return _create("locatvit_small", pretrained, **kwargs)


@register_model
def locatvit_base(pretrained: bool = False, **kwargs: Any) -> LocAtViT:
    """LocAtViT-Base: ViT-B/16 (dim 768, depth 12, 12 heads) at 224 px with GAug and PRR.

    ``pretrained=True`` loads the official ImageNet-1k weights from the Hub (``sinahmr/locatvit_base``).
    """
    return _create("locatvit_base", pretrained, **kwargs)
