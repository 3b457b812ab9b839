"""What the LocAt ViT-style models (LocAtViT on VisionTransformer, LocAtRoPEViT on Eva) share:
the GAug argument check, converting every block's attention, and PRR before the model's head."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ..layers import PRR
from ._grid import attach_grid_sync

__all__ = ["PRRHeadMixin", "convert_all_blocks", "make_prr", "reject_patch_drop"]


def reject_patch_drop(gaug: bool, kwargs: Mapping[str, Any]) -> None:
    """``ValueError`` when ``patch_drop_rate`` is set with GAug (dropped patches break its grid)."""
    if gaug and kwargs.get("patch_drop_rate", 0.0):
        raise ValueError(
            f"patch_drop_rate={kwargs['patch_drop_rate']} drops patches, which breaks GAug's patch grid; "
            "use patch_drop_rate=0 with gaug=True"
        )


def convert_all_blocks(
    model: nn.Module,
    accepts: Callable[[nn.Module], bool],
    convert: Callable[..., nn.Module],
    cls: type[nn.Module],
    needs: str,
    gaug: bool,
    **kwargs: Any,
) -> None:
    """Replace ``model.blocks[i].attn`` by ``convert(attn, cls, **kwargs)`` for every block (weights
    kept); ``TypeError`` naming ``needs`` for a block whose attention ``accepts`` refuses. With GAug,
    the layers are told each input's patch grid (:func:`attach_grid_sync`)."""
    for i, block in enumerate(model.blocks):  # type: ignore[arg-type]
        attn = getattr(block, "attn", None)
        if attn is None or not accepts(attn):
            raise TypeError(
                f"{type(model).__name__} needs {needs} at blocks[{i}].attn, got {type(attn).__name__}"
            )
        block.attn = convert(attn, cls, **kwargs)
    if gaug:
        attach_grid_sync(model)


def make_prr(model: nn.Module, prr: bool, kwargs: Mapping[str, Any]) -> PRR | None:
    """A :class:`PRR` with the model's width and its blocks' head count, or None when ``prr`` is off."""
    if not prr:
        return None
    blocks = model.blocks  # type: ignore[union-attr]
    heads = blocks[0].attn.num_heads if len(blocks) else int(kwargs.get("num_heads", 12))
    return PRR(int(model.embed_dim), heads)  # type: ignore[arg-type]


class PRRHeadMixin:
    """``forward_head`` with PRR (when ``self.prr`` is set) before the base model's pooling and head.

    With class-token pooling only token 0 of PRR's output is used, so only that row is computed.
    """

    prr: PRR | None
    global_pool: str

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """``x: (B, N, C)`` from ``forward_features`` -> PRR (if on) -> the base model's pooling and head."""
        if self.prr is not None:
            token_pool = self.global_pool == "token" and getattr(self, "attn_pool", None) is None
            x = self.prr(x, rows=1 if token_pool else None)
        return super().forward_head(x, pre_logits=pre_logits)  # type: ignore[misc]
