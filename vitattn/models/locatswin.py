"""LocAt Swin: timm's ``SwinTransformer`` with GAug in every window and PRR, registered with timm.

The official release's ``LocAtSwin`` (``locatswin_tiny``, ``locatswin_base``): each block's window
attention adds GAug's Gaussian bias (grid = window, no prefix tokens) to the relative-position bias
and the shift mask; PRR refines all positions of the last stage's NHWC output, then the head
average-pools. State-dict keys are the official (and timm's Swin) ones.
"""

from __future__ import annotations

from typing import Any

import torch
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from timm.models.swin_transformer import SwinTransformer, checkpoint_filter_fn

from ..functional.normalize import Normalizer, resolve_normalizer
from ..layers import PRR
from ..layers.locat_window import (
    LocAtWindowAttention,
    WindowAttention,
    convert_window_attention,
    convertible_window_attention,
)
from .locatvit import _weight_source

__all__ = ["LocAtSwin", "locatswin_base", "locatswin_tiny", "prr_nhwc", "swin_blocks"]


def swin_blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(name, block)`` of every Swin block, stage by stage (``"layers.1.blocks.0"``, ...)."""
    out = []
    for s, stage in enumerate(model.layers):  # type: ignore[union-attr]
        for j, block in enumerate(getattr(stage, "blocks", ())):
            out.append((f"layers.{s}.blocks.{j}", block))
    return out


def prr_nhwc(prr: PRR, x: torch.Tensor) -> torch.Tensor:
    """PRR over all positions of an NHWC map ``x: (B, H, W, C)`` (flattened to ``(B, H*W, C)``)."""
    return prr(x.flatten(1, 2)).reshape(x.shape)


class LocAtSwin(SwinTransformer):
    """LocAt on timm's ``SwinTransformer``: every ``SwinTransformer`` argument, plus

    Args:
        gaug: GAug in every window attention (:class:`~vitattn.layers.LocAtWindowAttention`).
        prr: PRR over the last stage's NHWC output (after the final norm), before the head's pooling.
        normalizer: the attention normalizer of every block.

    ``forward_features`` returns ``(B, H, W, C)`` before PRR, as the official release does.
    """

    def __init__(
        self,
        *args: Any,
        gaug: bool = True,
        prr: bool = True,
        normalizer: Normalizer = "softmax",
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.use_gaug = bool(gaug)
        self.normalizer = resolve_normalizer(normalizer)
        if self.use_gaug or self.normalizer != "softmax":
            self._convert_blocks()
        blocks = swin_blocks(self)
        heads = int(blocks[-1][1].attn.num_heads) if blocks else 1
        self.prr = PRR(self.num_features, heads) if prr else None

    def _convert_blocks(self) -> None:
        cls = LocAtWindowAttention if self.use_gaug else WindowAttention
        for name, block in swin_blocks(self):
            attn = getattr(block, "attn", None)
            if attn is None or not convertible_window_attention(attn):
                raise TypeError(
                    f"LocAtSwin needs timm's WindowAttention at {name}.attn, got {type(attn).__name__}"
                )
            block.attn = convert_window_attention(attn, cls, normalizer=self.normalizer)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """``x: (B, H, W, C)`` from ``forward_features`` -> PRR (if on) -> the head's pooling and fc."""
        if self.prr is not None:
            x = prr_nhwc(self.prr, x)
        return super().forward_head(x, pre_logits=pre_logits)


def _cfg(**kwargs: Any) -> dict[str, Any]:
    """Pretrained cfg of the official release: timm's Swin defaults."""
    return {
        "url": "",
        "num_classes": 1000,
        "input_size": (3, 224, 224),
        "pool_size": (7, 7),
        "crop_pct": 0.9,
        "interpolation": "bicubic",
        "fixed_input_size": True,
        "mean": IMAGENET_DEFAULT_MEAN,
        "std": IMAGENET_DEFAULT_STD,
        "first_conv": "patch_embed.proj",
        "classifier": "head.fc",
        "paper_ids": "arXiv:2603.04892",
        "paper_name": "Locality-Attending Vision Transformer",
        "origin_url": "https://github.com/sinahmr/LocAtViT",
        **kwargs,
    }


_ARCHS = {
    "locatswin_tiny": dict(
        patch_size=4, window_size=7, embed_dim=96, depths=(2, 2, 6, 2), num_heads=(3, 6, 12, 24)
    ),
    "locatswin_base": dict(
        patch_size=4, window_size=7, embed_dim=128, depths=(2, 2, 18, 2), num_heads=(4, 8, 16, 32)
    ),
}
default_cfgs = generate_default_cfgs({name: _cfg() for name in _ARCHS})


def _create(variant: str, pretrained: bool, **kwargs: Any) -> LocAtSwin:
    kwargs = dict(_ARCHS[variant], **kwargs)
    kwargs.pop("store_metrics", None)  # an official-release argument with no effect here
    overlay = dict(kwargs.pop("pretrained_cfg_overlay", None) or {})
    if pretrained and not _weight_source(variant, kwargs.get("pretrained_cfg"), overlay):
        raise ValueError(
            f"{variant} has no weights vitattn knows of; use pretrained=False, or give a local checkpoint "
            "with pretrained_cfg_overlay=dict(file='path/to/weights.safetensors')"
        )
    if overlay.get("file"):  # a local file is taken to have the head asked for (else timm would drop it)
        overlay.setdefault("num_classes", kwargs.get("num_classes", 1000))
    out_indices = kwargs.pop("out_indices", tuple(range(len(kwargs["depths"]))))
    return build_model_with_cfg(
        LocAtSwin,
        variant,
        pretrained,
        pretrained_cfg_overlay=overlay or None,
        pretrained_filter_fn=checkpoint_filter_fn,
        feature_cfg=dict(flatten_sequential=True, out_indices=out_indices),
        **kwargs,
    )


@register_model
def locatswin_tiny(pretrained: bool = False, **kwargs: Any) -> LocAtSwin:
    """LocAt Swin-T (patch 4, window 7, dim 96, depths 2-2-6-2) at 224 px with GAug and PRR."""
    return _create("locatswin_tiny", pretrained, **kwargs)


@register_model
def locatswin_base(pretrained: bool = False, **kwargs: Any) -> LocAtSwin:
    """LocAt Swin-B (patch 4, window 7, dim 128, depths 2-2-18-2) at 224 px with GAug and PRR."""
    return _create("locatswin_base", pretrained, **kwargs)
