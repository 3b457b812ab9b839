"""``vitattn.patch``: swap the attention of a timm ViT, Eva (RoPE ViT) or Swin in place, weights kept.

One adapter per timm attention family (see :data:`_ADAPTERS`): each says which modules it takes, how
to convert one and which vitattn layer each ``attention=`` name becomes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

import torch
from timm.models.vision_transformer import global_pool_nlc
from torch import nn

from .functional.normalize import Normalizer, resolve_normalizer
from .layers import PRR, Attention, EntmaxAttention, LocAtAttention, convert_attention, convertible_attention
from .layers.convert import _timm_attention_classes
from .layers.locat_rope import (
    LocAtRopeAttention,
    RopeAttention,
    convert_rope_attention,
    convertible_rope_attention,
    rope_attention_classes,
)
from .layers.locat_window import (
    LocAtWindowAttention,
    WindowAttention,
    convert_window_attention,
    convertible_window_attention,
)
from .models._grid import attach_grid_sync
from .models.blocks import block_indices
from .models.locatrope import LocAtRoPEViT
from .models.locatswin import LocAtSwin, prr_nhwc
from .models.locatvit import LocAtViT

__all__ = ["patch"]

_LAYERS: dict[str, type[Attention]] = {
    "softmax": Attention,
    "entmax15": EntmaxAttention,
    "locat": LocAtAttention,
}
_DEFAULT_NORMALIZER = {"softmax": "softmax", "entmax15": "entmax15", "locat": "softmax"}


@dataclass(frozen=True)
class _Adapter:
    """How ``patch`` converts one family's attention: which modules, how, into which layer per name."""

    family: str
    accepts: Callable[[nn.Module], bool]
    convert: Callable[..., nn.Module]
    layers: dict[str, type[nn.Module]]
    known: Callable[[], tuple[type, ...]]  # the classes it takes, for the error message


def _vit_classes() -> tuple[type, ...]:
    return (*_timm_attention_classes(), EntmaxAttention, LocAtAttention)


def _window_classes() -> tuple[type, ...]:
    from timm.models.swin_transformer import WindowAttention as TimmWindowAttention

    return (TimmWindowAttention, WindowAttention, LocAtWindowAttention)


# The rotary adapter comes first: vitattn's rotary layers are Attention subclasses too.
_ADAPTERS = (
    _Adapter(
        "Eva / RoPE ViT",
        convertible_rope_attention,
        convert_rope_attention,
        {"softmax": RopeAttention, "entmax15": RopeAttention, "locat": LocAtRopeAttention},
        lambda: (*rope_attention_classes(), LocAtRopeAttention),
    ),
    _Adapter("ViT", convertible_attention, convert_attention, dict(_LAYERS), _vit_classes),
)
_SWIN_ADAPTER = _Adapter(
    "Swin",
    convertible_window_attention,
    convert_window_attention,
    {"softmax": WindowAttention, "entmax15": WindowAttention, "locat": LocAtWindowAttention},
    _window_classes,
)


class PRRPoolNHWC(nn.Module):
    """PRR over all positions of an NHWC map, then the head's own pooling (a Swin head's ``global_pool``)."""

    def __init__(self, prr: PRR, pool: nn.Module) -> None:
        super().__init__()
        self.prr = prr
        self.pool = pool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x: (B, H, W, C)`` -> the pool's output on PRR-refined positions."""
        return self.pool(prr_nhwc(self.prr, x))


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


def _attention_slots(model: object) -> tuple[list[tuple[str, nn.Module]], bool]:
    """``(label, block)`` of every block with an attention, and whether the model is a Swin.

    A ViT / Eva has ``patch_embed`` + ``blocks``; a Swin has ``patch_embed`` + ``layers[i].blocks``
    (its blocks are numbered stage by stage).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a timm VisionTransformer (an nn.Module), got {type(model).__name__}")
    if isinstance(getattr(model, "patch_embed", None), nn.Module):
        blocks = getattr(model, "blocks", None)
        if isinstance(blocks, nn.Module):
            return [(f"blocks[{i}]", b) for i, b in enumerate(blocks)], False  # type: ignore[arg-type]
        layers = getattr(model, "layers", None)
        if isinstance(layers, nn.Module) and all(
            isinstance(getattr(s, "blocks", None), nn.Module) for s in layers
        ):
            return [
                (f"layers[{s}].blocks[{j}]", b)
                for s, stage in enumerate(layers)
                for j, b in enumerate(stage.blocks)
            ], True
    raise TypeError(
        f"model must be a timm VisionTransformer or Eva (patch_embed + blocks) or SwinTransformer "
        f"(patch_embed + layers[i].blocks), got {type(model).__name__}"
    )


def _adapter(attn: object, swin: bool) -> _Adapter | None:
    """The adapter taking ``attn`` (None when no adapter knows its class)."""
    if not isinstance(attn, nn.Module):
        return None
    candidates = (_SWIN_ADAPTER,) if swin else _ADAPTERS
    return next((a for a in candidates if a.accepts(attn)), None)


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


def _unsupported_attention(label: str, attn: object) -> TypeError:
    kind = type(attn)
    families = "; ".join(
        f"{a.family}: " + ", ".join(f"{c.__module__}.{c.__qualname__}" for c in dict.fromkeys(a.known()))
        for a in (*sorted(_ADAPTERS, key=lambda a: a.family != "ViT"), _SWIN_ADAPTER)
    )
    return TypeError(
        f"{label}.attn is {kind.__name__} ({kind.__module__}.{kind.__qualname__}); vitattn.patch "
        f"supports multi-head self-attention with qkv + proj linears of these classes: {families}"
    )


def _block_indices(blocks: int | Iterable[int] | None, depth: int) -> list[int]:
    if blocks is None:
        return list(range(depth))
    items = [blocks] if isinstance(blocks, int) else list(blocks)
    return list(block_indices(items, depth, name="blocks")) if items else []


def _add_prr(model: nn.Module) -> None:
    heads = next((b.attn.num_heads for b in model.blocks if hasattr(b, "attn")), None)  # type: ignore[union-attr]
    layer = PRR(int(model.embed_dim), int(heads or 1))  # type: ignore[arg-type]
    if isinstance(model, (LocAtViT, LocAtRoPEViT)):
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


def _add_prr_swin(model: nn.Module, slots: list[tuple[str, nn.Module]]) -> None:
    """PRR over the last stage's NHWC output, before the head's pooling (``head.global_pool``)."""
    heads = next((int(b.attn.num_heads) for _, b in reversed(slots) if hasattr(b, "attn")), 1)
    layer = PRR(int(model.num_features), heads)  # type: ignore[arg-type]
    if isinstance(model, LocAtSwin):
        if model.prr is None:
            model.prr = layer
        return
    head = getattr(model, "head", None)
    pool = getattr(head, "global_pool", None)
    if isinstance(pool, PRRPoolNHWC):
        return
    if not isinstance(pool, nn.Module):
        raise ValueError(
            f"prr=True needs a Swin whose head pools with head.global_pool, got {type(head).__name__}"
        )
    head.global_pool = PRRPoolNHWC(layer, pool)  # type: ignore[union-attr]


def patch(
    model: nn.Module,
    attention: Literal["softmax", "entmax15", "locat"] | type[Attention] = "softmax",
    prr: bool = False,
    blocks: int | Iterable[int] | None = None,
    normalizer: Normalizer | None = None,
) -> nn.Module:
    """Swap the attention of a timm ``VisionTransformer``, ``Eva`` or ``SwinTransformer`` in place; return it.

    Args:
        model: a timm ViT whose ``blocks[i].attn`` are timm ``Attention``; an ``Eva`` (EVA-02, the
            RoPE ViTs) whose ``blocks[i].attn`` are ``AttentionRope`` / ``EvaAttention``; or a Swin
            whose ``layers[s].blocks[j].attn`` are ``WindowAttention`` (or vitattn layers of those).
        attention: ``"softmax"`` (vitattn :class:`Attention`, :class:`RopeAttention` or
            :class:`WindowAttention`: same outputs), ``"entmax15"`` or ``"locat"`` (GAug; new
            ``gaug`` heads initialised as in a fresh LocAt model). In an Eva, GAug reads q before the
            rotary embedding and biases the scores of the rotated q, k; in a Swin, the bias is per
            window (grid = window, no prefix tokens), added to the relative-position bias and shift mask.
        prr: also refine the final tokens with PRR before the model's pooling and head (in a Swin:
            all positions of the last stage's NHWC output, before the head's pooling).
        blocks: indices of the blocks to patch (negative ones count from the end); all by default.
            A Swin's blocks are numbered stage by stage (``layers[0].blocks[0]`` is 0).
        normalizer: the attention normalizer of the patched blocks (``"softmax"``, ``"entmax15"``,
            ``"sparsemax"`` or a float alpha > 1). ``None`` (default) keeps each attention's own:
            softmax for ``"softmax"`` and ``"locat"``, entmax-1.5 for ``"entmax15"``. So
            ``attention="locat", normalizer="entmax15"`` is GAug-biased entmax-1.5 attention, as in
            ``LocAtViT(normalizer="entmax15")``, and ``attention="softmax", normalizer=1.25`` is
            unbiased 1.25-entmax.

    qkv / proj / norm weights (and a Swin's relative-position tables) are kept: the same parameters
    move into the new layers. Class and register tokens and ``dynamic_img_size`` are handled: the
    patch grid is read from each input.

    Raises:
        TypeError: ``model`` is not a ViT, a block's attention is of an unsupported class (the
            message names it and the supported ones), or a block index is not an int.
        ValueError: unknown ``attention`` name or class, an unknown ``normalizer`` (or one other
            than entmax-1.5 with ``attention="entmax15"``), a block index out of range, patch
            dropout with ``"locat"``, or ``prr=True`` on a model pooling with its own attention pool.
    """
    slots, swin = _attention_slots(model)
    attention = _attention_name(attention)  # type: ignore[assignment]
    layer_normalizer = _layer_normalizer(attention, normalizer)
    all_blocks = [block for _, block in slots]
    indices = _block_indices(blocks, len(all_blocks))
    adapters = {}
    for i in indices:
        adapter = _adapter(getattr(all_blocks[i], "attn", None), swin)
        if adapter is None:
            raise _unsupported_attention(slots[i][0], getattr(all_blocks[i], "attn", None))
        adapters[i] = adapter
    extra: dict[str, object] = {"normalizer": layer_normalizer}
    if attention == "locat" and not swin:  # a Swin's GAug grid is each layer's window
        patch_drop = getattr(model, "patch_drop", None)
        if getattr(patch_drop, "prob", 0.0):
            raise ValueError("attention='locat' needs every patch token: this model uses patch dropout")
        grid = tuple(int(g) for g in model.patch_embed.grid_size)  # type: ignore[union-attr]
        extra.update(grid_size=grid, num_prefix_tokens=int(getattr(model, "num_prefix_tokens", 0)))
    for i in indices:
        old = all_blocks[i].attn
        new = adapters[i].convert(old, adapters[i].layers[attention], **extra)
        if attention == "locat" and isinstance(old, LocAtAttention) and old.initial_grid_size is not None:
            new.set_grid(extra["grid_size"], initial_grid_size=old.initial_grid_size)  # type: ignore[operator]
        all_blocks[i].attn = new
    if attention == "locat" and not swin:
        attach_grid_sync(model)
    if prr:
        _add_prr_swin(model, slots) if swin else _add_prr(model)
    return model
