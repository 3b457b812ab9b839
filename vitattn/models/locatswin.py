"""LocAt Swin: timm's ``SwinTransformer`` with GAug in every window and PRR, registered with timm.

The official release's ``LocAtSwin`` (``locatswin_tiny``, ``locatswin_base``): each block's window
attention adds GAug's Gaussian bias (grid = window, no prefix tokens) to the relative-position bias
and the shift mask; PRR refines all positions of the last stage's NHWC output, then the head
average-pools. State-dict keys are the official (and timm's Swin) ones.
"""

from __future__ import annotations

import torch
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.models import generate_default_cfgs
from timm.models.swin_transformer import SwinTransformer, checkpoint_filter_fn
from torch import nn

from ..layers.prr import prr_nhwc
from ._locat_common import SWIN, LocAtModelMixin, register_variants, release_cfg
from .blocks import module_items

__all__ = ["LocAtSwin", "locatswin_base", "locatswin_tiny", "prr_nhwc", "swin_blocks"]


def swin_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, block)`` of every Swin block, stage by stage (``"layers.1.blocks.0"``, ...)."""
    return [
        (f"layers.{s}.blocks.{j}", block)
        for s, stage in enumerate(module_items(model.get_submodule("layers")))
        for j, block in enumerate(module_items(getattr(stage, "blocks", nn.Sequential())))
    ]


class LocAtSwin(LocAtModelMixin, SwinTransformer):
    """LocAt on timm's ``SwinTransformer``: every ``SwinTransformer`` argument, plus

    Args:
        gaug: GAug in every window attention (:class:`~vitattn.layers.LocAtWindowAttention`).
        prr: PRR over the last stage's NHWC output (after the final norm), before the head's pooling.
        normalizer: the attention normalizer of every block.

    ``forward_features`` returns ``(B, H, W, C)`` before PRR, as the official release does.
    """

    family = SWIN
    needs = "timm's WindowAttention"
    patch_grid = False  # GAug's grid is each layer's window

    def attention_blocks(self) -> list[tuple[str, nn.Module]]:
        """``(label, block)`` of every Swin block, stage by stage (:func:`swin_blocks`)."""
        return swin_blocks(self)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """``x: (B, H, W, C)`` from ``forward_features`` -> PRR (if on) -> the head's pooling and fc."""
        if self.prr is not None:
            x = prr_nhwc(self.prr, x)
        return super().forward_head(x, pre_logits=pre_logits)


_ARCHS = {
    "locatswin_tiny": dict(
        patch_size=4, window_size=7, embed_dim=96, depths=(2, 2, 6, 2), num_heads=(3, 6, 12, 24)
    ),
    "locatswin_base": dict(
        patch_size=4, window_size=7, embed_dim=128, depths=(2, 2, 18, 2), num_heads=(4, 8, 16, 32)
    ),
}
_SWIN_CFG = dict(pool_size=(7, 7), mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD, classifier="head.fc")
default_cfgs = generate_default_cfgs({name: release_cfg(**_SWIN_CFG) for name in _ARCHS})


locatswin_tiny, locatswin_base = register_variants(
    __name__,
    LocAtSwin,
    _ARCHS,
    {
        "locatswin_tiny": "LocAt Swin-T (patch 4, window 7, dim 96, depths 2-2-6-2) at 224 px with GAug "
        "and PRR.",
        "locatswin_base": "LocAt Swin-B (patch 4, window 7, dim 128, depths 2-2-18-2) at 224 px with GAug "
        "and PRR.",
    },
    filter_fn=checkpoint_filter_fn,
    feature_cfg=dict(flatten_sequential=True, out_indices=None),  # None: every stage
)
