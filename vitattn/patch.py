"""``vitattn.patch``: swap the attention of an existing timm ViT in place, weights kept."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import torch
from timm.models.vision_transformer import global_pool_nlc
from torch import nn

from .functional.normalize import Normalizer, resolve_normalizer
from .layers import PRR, Attention, EntmaxAttention, LocAtAttention, convert_attention, convertible_attention
from .layers.convert import _timm_attention_classes
from .models._grid import attach_grid_sync
from .models.blocks import block_indices
from .models.locatvit import LocAtViT

__all__ = ["patch"]

_LAYERS: dict[str, type[Attention]] = {
    "softmax": Attention,
    "entmax15": EntmaxAttention,
    "locat": LocAtAttention,
}
_DEFAULT_NORMALIZER = {"softmax": "softmax", "entmax15": "entmax15", "locat": "softmax"}


class PRRPool(nn.Module):
    """PRR over all tokens, then the model's own pooling (installed as a timm ViT's ``attn_pool``)."""

    def __init__(self, prr: PRR, pool_type: str, num_prefix_tokens: int, include_prefix: bool) -> None:
        super().__init__()
        self.prr = prr
        self.pool_type = pool_type
        self.num_prefix_tokens = num_prefix_tokens
        self.include_prefix = include_prefix

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x: (B, N, C)`` -> pooled ``(B, C)`` (or ``(B, N, C)`` with ``pool_type=''``)."""
        return global_pool_nlc(self.prr(x), self.pool_type, self.num_prefix_tokens, self.include_prefix)


def _check_vit(model: object) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a timm VisionTransformer (an nn.Module), got {type(model).__name__}")
    blocks = getattr(model, "blocks", None)
    if not isinstance(getattr(model, "patch_embed", None), nn.Module) or not isinstance(blocks, nn.Module):
        raise TypeError(
            f"model must be a timm VisionTransformer (patch_embed + blocks), got {type(model).__name__}"
        )


def _attention_name(attention: object) -> str:
    """``attention`` as a key of ``_LAYERS``: a name, or one of the vitattn layer classes."""
    if isinstance(attention, type):
        for name, cls in _LAYERS.items():
            if attention is cls:
                return name
        raise ValueError(
            f"attention={attention.__module__}.{attention.__qualname__} is not a layer vitattn.patch "
            f"knows; give one of {sorted(_LAYERS)} (or the classes "
            f"{', '.join(c.__name__ for c in _LAYERS.values())})"
        )
    if not isinstance(attention, str) or attention not in _LAYERS:
        raise ValueError(f"attention must be one of {sorted(_LAYERS)}, got {attention!r}")
    return attention


def _layer_normalizer(attention: str, normalizer: Normalizer | None) -> str | float:
    if normalizer is None:
        return _DEFAULT_NORMALIZER[attention]
    resolved = resolve_normalizer(normalizer)
    if attention == "entmax15" and resolved != "entmax15":
        raise ValueError(
            f"attention='entmax15' is entmax-1.5 attention, so normalizer={normalizer!r} contradicts it; "
            "for another normalizer without a bias use attention='softmax', normalizer=..."
        )
    return resolved


def _unsupported_attention(i: int, attn: object) -> TypeError:
    kind = type(attn)
    known = ", ".join(f"{c.__module__}.{c.__qualname__}" for c in _timm_attention_classes())
    known += f", {EntmaxAttention.__module__}.EntmaxAttention, {LocAtAttention.__module__}.LocAtAttention"
    return TypeError(
        f"blocks[{i}].attn is {kind.__name__} ({kind.__module__}.{kind.__qualname__}); vitattn.patch "
        f"supports plain multi-head self-attention with qkv + proj linears: {known}"
    )


def _block_indices(blocks: int | Iterable[int] | None, depth: int) -> list[int]:
    if blocks is None:
        return list(range(depth))
    items = [blocks] if isinstance(blocks, int) else list(blocks)
    return list(block_indices(items, depth, name="blocks")) if items else []


def _add_prr(model: nn.Module) -> None:
    heads = next((b.attn.num_heads for b in model.blocks if hasattr(b, "attn")), None)  # type: ignore[union-attr]
    layer = PRR(int(model.embed_dim), int(heads or 1))  # type: ignore[arg-type]
    if isinstance(model, LocAtViT):
        if model.prr is None:
            model.prr = layer
        return
    attn_pool = getattr(model, "attn_pool", None)
    if isinstance(attn_pool, PRRPool) or type(attn_pool).__name__ == "AttentionPoolPrr":
        return
    if attn_pool is not None:
        raise ValueError(
            f"prr=True needs a token- or average-pooled ViT, not one pooling with {type(attn_pool).__name__}"
        )
    include_prefix = bool(getattr(model, "pool_include_prefix", False))
    model.attn_pool = PRRPool(layer, str(model.global_pool), int(model.num_prefix_tokens), include_prefix)
    model.pool_include_prefix = True  # timm >= 1.0.2x strips prefix tokens before attn_pool unless set


def patch(
    model: nn.Module,
    attention: Literal["softmax", "entmax15", "locat"] | type[Attention] = "softmax",
    prr: bool = False,
    blocks: int | Iterable[int] | None = None,
    normalizer: Normalizer | None = None,
) -> nn.Module:
    """Swap the attention of a timm ``VisionTransformer`` in place and return it.

    Args:
        model: a timm ViT whose ``blocks[i].attn`` are timm ``Attention`` (or vitattn layers).
        attention: ``"softmax"`` (vitattn :class:`Attention`, same outputs), ``"entmax15"`` or
            ``"locat"`` (GAug; new ``gaug`` heads initialised as in a fresh LocAtViT).
        prr: also refine the final tokens with PRR before the model's pooling and head.
        blocks: indices of the blocks to patch (negative ones count from the end); all by default.
        normalizer: the attention normalizer of the patched blocks (``"softmax"``, ``"entmax15"``,
            ``"sparsemax"`` or a float alpha > 1). ``None`` (default) keeps each attention's own:
            softmax for ``"softmax"`` and ``"locat"``, entmax-1.5 for ``"entmax15"``. So
            ``attention="locat", normalizer="entmax15"`` is GAug-biased entmax-1.5 attention, as in
            ``LocAtViT(normalizer="entmax15")``, and ``attention="softmax", normalizer=1.25`` is
            unbiased 1.25-entmax.

    qkv / proj / norm weights are kept (the same parameters move into the new layers). Class and
    register tokens and ``dynamic_img_size`` are handled: the patch grid is read from each input.

    Raises:
        TypeError: ``model`` is not a ViT, a block's attention is of an unsupported class (the
            message names it and the supported ones), or a block index is not an int.
        ValueError: unknown ``attention`` name or class, an unknown ``normalizer`` (or one other
            than entmax-1.5 with ``attention="entmax15"``), a block index out of range, patch
            dropout with ``"locat"``, or ``prr=True`` on a model pooling with its own attention pool.
    """
    _check_vit(model)
    attention = _attention_name(attention)  # type: ignore[assignment]
    layer_normalizer = _layer_normalizer(attention, normalizer)
    all_blocks = list(model.blocks)  # type: ignore[arg-type]
    indices = _block_indices(blocks, len(all_blocks))
    for i in indices:
        attn = getattr(all_blocks[i], "attn", None)
        if attn is None or not convertible_attention(attn):
            raise _unsupported_attention(i, attn)
    extra: dict[str, object] = {"normalizer": layer_normalizer}
    if attention == "locat":
        patch_drop = getattr(model, "patch_drop", None)
        if getattr(patch_drop, "prob", 0.0):
            raise ValueError("attention='locat' needs every patch token: this model uses patch dropout")
        grid = tuple(int(g) for g in model.patch_embed.grid_size)  # type: ignore[union-attr]
        extra.update(grid_size=grid, num_prefix_tokens=int(getattr(model, "num_prefix_tokens", 0)))
    for i in indices:
        old = all_blocks[i].attn
        new = convert_attention(old, _LAYERS[attention], **extra)  # type: ignore[arg-type]
        if attention == "locat" and isinstance(old, LocAtAttention) and old.initial_grid_size is not None:
            new.set_grid(extra["grid_size"], initial_grid_size=old.initial_grid_size)  # type: ignore[arg-type]
        all_blocks[i].attn = new
    if attention == "locat":
        attach_grid_sync(model)
    if prr:
        _add_prr(model)
    return model
