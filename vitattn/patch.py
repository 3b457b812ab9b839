"""``vitattn.patch``: swap the attention of a timm ViT, Eva (RoPE ViT) or Swin, or of a transformers
vision model, in place, weights kept.

The model is read through its layout (:func:`vitattn.adapter.layout_of`). Patching is the one step
where the two kinds of layout differ in kind, not in where things are: a timm-style model's attention
modules are swapped for vitattn layers, one :class:`~vitattn.models._locat_common.Family` per timm
attention family (the ones the LocAt models convert with: which modules it takes, how to convert one
and which vitattn layer each ``attention=`` name becomes); a transformers model keeps its modules and
computes through vitattn's attention implementation (:func:`vitattn.hf.patching.patch_layout`,
imported only for it).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from torch import nn

from .adapter import ModelLayout, TimmLayout, layout_of
from .functional import grid_pair
from .layers import (
    PRR,
    Attention,
    EntmaxAttention,
    GridAttention,
    LocAtAttention,
    LocAtWindowAttention,
    NeighborhoodAttention,
)
from .layers._args import check_flag
from .layers.adaptive import LayerNormalizer, patch_normalizer
from .layers.kinds import ATTENTION_KINDS
from .layers.locat import GaugInit, check_gaug_init
from .layers.prr import PRRPool, PRRPoolNHWC
from .models._grid import attach_grid_sync
from .models._locat_common import EVA, SWIN, VIT, Family, prr_heads
from .models.blocks import chosen_blocks
from .models.locatrope import LocAtRoPEViT
from .models.locatswin import LocAtSwin
from .models.locatvit import LocAtViT

__all__ = ["patch"]

_LAYERS: dict[str, type[Attention]] = {
    "softmax": Attention,
    "entmax15": EntmaxAttention,
    "locat": LocAtAttention,
    "window": NeighborhoodAttention,
}
_DEFAULT_WINDOW = 7
# The rotary family comes first: vitattn's rotary layers are Attention subclasses too.
_FAMILIES = (EVA, VIT)


def _family(attn: object, swin: bool) -> Family | None:
    """The attention family taking ``attn`` (None when no family knows its class)."""
    if not isinstance(attn, nn.Module):
        return None
    candidates = (SWIN,) if swin else _FAMILIES
    return next((f for f in candidates if f.accepts(attn)), None)


def _attention_name(attention: object) -> str | None:
    """``attention`` as a key of ``_LAYERS`` (a name, or one of the vitattn layer classes), or None."""
    if attention is None:
        return None
    if isinstance(attention, type):
        for name, cls in _LAYERS.items():
            if attention is cls:
                return name
        raise ValueError(
            f"attention={attention.__module__}.{attention.__qualname__} is not a layer vitattn.patch "
            f"knows; give one of {sorted(_LAYERS)} (or the classes "
            f"{', '.join(layer.__name__ for layer in _LAYERS.values())}), or None to keep each block's"
        )
    if not isinstance(attention, str) or attention not in _LAYERS:
        raise ValueError(f"attention must be one of {sorted(_LAYERS)} or None (keep), got {attention!r}")
    return attention


def _unsupported_attention(label: str, attn: object) -> TypeError:
    kind = type(attn)
    families = "; ".join(
        f"{f.name}: " + ", ".join(f"{k.__module__}.{k.__qualname__}" for k in dict.fromkeys(f.known()))
        for f in (VIT, EVA, SWIN)
    )
    return TypeError(
        f"{label}.attn is {kind.__name__} ({kind.__module__}.{kind.__qualname__}); vitattn.patch "
        f"supports multi-head self-attention with qkv + proj linears of these classes: {families}"
    )


def _check_blocks(blocks: object) -> None:
    """``blocks`` is None, an int or an iterable of them (a ``TypeError`` naming it otherwise)."""
    if not (blocks is None or isinstance(blocks, int) or isinstance(blocks, Iterable)) or isinstance(
        blocks, (str, bytes)
    ):
        raise TypeError(
            f"blocks must be a block index (int), block indices or None (every block), got {blocks!r} "
            f"({type(blocks).__name__})"
        )


def _prr_refusal(model: nn.Module, swin: bool) -> str | None:
    """Why ``prr=True`` cannot go on ``model`` (None: it can), known before anything is patched."""
    if isinstance(model, (LocAtViT, LocAtRoPEViT, LocAtSwin)):
        return None
    if swin:
        head = getattr(model, "head", None)
        if isinstance(getattr(head, "global_pool", None), nn.Module):
            return None
        return f"prr=True needs a Swin whose head pools with head.global_pool, got {type(head).__name__}"
    attn_pool = getattr(model, "attn_pool", None)
    if attn_pool is None or isinstance(attn_pool, PRRPool) or type(attn_pool).__name__ == "AttentionPoolPrr":
        return None
    return f"prr=True needs a token- or average-pooled ViT, not one pooling with {type(attn_pool).__name__}"


def _add_prr(layout: TimmLayout) -> None:
    """PRR before the model's pooling: a LocAt model's own ``prr``; else around a ViT's token pooling
    (:class:`PRRPool` as ``attn_pool``), or around a Swin's ``head.global_pool`` (over the last stage's
    NHWC output, :class:`PRRPoolNHWC`)."""
    model, swin = layout.model, layout.windowed
    blocks = layout.blocks if swin else model.get_submodule("blocks")
    width = model.num_features if swin else model.embed_dim
    layer = PRR(int(width), prr_heads(blocks))  # type: ignore[arg-type]
    if isinstance(model, (LocAtViT, LocAtRoPEViT, LocAtSwin)):
        if model.prr is None:
            model.prr = layer
        return
    if swin:
        head = getattr(model, "head", None)
        pool = getattr(head, "global_pool", None)
        if not isinstance(pool, PRRPoolNHWC):
            assert isinstance(pool, nn.Module)  # _prr_refusal
            head.global_pool = PRRPoolNHWC(layer, pool)  # type: ignore[union-attr]
        return
    attn_pool = getattr(model, "attn_pool", None)
    if isinstance(attn_pool, PRRPool) or type(attn_pool).__name__ == "AttentionPoolPrr":
        return
    include_prefix = bool(getattr(model, "pool_include_prefix", False))
    prefix = int(getattr(model, "num_prefix_tokens", 0))
    model.attn_pool = PRRPool(layer, str(model.global_pool), prefix, include_prefix)
    # timm >= 1.0.2x strips prefix tokens before attn_pool unless this is set
    model.pool_include_prefix = True  # type: ignore[assignment]  # nn.Module types only tensors, modules


@dataclass(frozen=True)
class _Layer:
    """What a block's attention is, in the terms of ``patch``'s arguments: its bias / mask kind
    (``"none"``, ``"locat"``: GAug, ``"window"``: a neighbourhood window without GAug), its window
    and dilation (a LocAt layer may have one too), its normalizer, and whether it is entmax-1.5 by
    class (``EntmaxAttention``)."""

    kind: str
    window: tuple[int, int] | None
    dilation: tuple[int, int]
    normalizer: str | float
    entmax_class: bool


def _current(attn: nn.Module) -> _Layer:
    """The state of an attention module (a timm layer: no bias, softmax)."""
    kind = "none"
    if isinstance(attn, (LocAtAttention, LocAtWindowAttention)):
        kind = "locat"
    elif isinstance(attn, NeighborhoodAttention):
        kind = "window"
    window = getattr(attn, "window", None) if isinstance(attn, GridAttention) else None
    dilation = getattr(attn, "dilation", (1, 1)) if isinstance(attn, GridAttention) else (1, 1)
    normalizer = getattr(attn, "normalizer", "softmax")  # timm's layers have none: softmax
    return _Layer(kind, window, dilation, normalizer, isinstance(attn, EntmaxAttention))


def _target(
    label: str,
    old: _Layer,
    name: str | None,
    normalizer: str | float | None,
    window: object,
    dilation: object,
    swin: bool,
) -> tuple[str, str, dict[str, object]]:
    """``(family layer name, kind, layer kwargs)`` of one block: what the call names, the rest kept.

    ``"softmax"`` / ``"entmax15"`` name an attention without bias or window; ``"locat"`` adds (or
    keeps) GAug, ``"window"`` adds (or keeps) a neighbourhood window; ``None`` keeps the kind. A block's
    window (LocAt's or a neighbourhood layer's) and normalizer stay unless the call names them.
    """
    kind = old.kind if name is None else ATTENTION_KINDS[name].bias
    if name == "window" and old.kind == "locat":
        kind = "locat"  # GAug kept: LocAt inside the window
    if name is None and window is not None and kind == "none":
        kind = "window"  # window= alone adds a neighbourhood window
    keep_window = name is None or (name in ("locat", "window") and old.kind in ("locat", "window"))
    win = window if window is not None else (old.window if keep_window else None)
    dil = dilation if dilation is not None else (old.dilation if keep_window else 1)
    if name == "window" and win is None:
        win = _DEFAULT_WINDOW
    if win is not None and (kind == "none" or swin):
        where = "a Swin (its attention is already windowed)" if swin else f"attention={name!r}"
        raise ValueError(f"window={window!r} is for attention='window' or 'locat' (ViT, Eva), not {where}")
    if win is None and dil not in (1, (1, 1)):
        raise ValueError(f"dilation={dilation!r} needs a window (attention='window', or window=...)")
    kwargs: dict[str, object] = {"normalizer": old.normalizer if normalizer is None else normalizer}
    if win is not None:
        kwargs.update(window=win, dilation=dil)
    by_class = name == "entmax15" or (name is None and old.entmax_class)
    entmax = kwargs["normalizer"] == "entmax15" and by_class
    layer = {"none": "entmax15" if entmax else "softmax"}.get(kind, kind)
    if swin and kwargs["normalizer"] == "adaptive":
        raise ValueError(f"normalizer='adaptive' is not available for a Swin's window attention ({label})")
    return layer, kind, kwargs


def patch(
    model: nn.Module,
    attention: Literal["softmax", "entmax15", "locat", "window"] | type[Attention] | None = None,
    prr: bool = False,
    blocks: int | Iterable[int] | None = None,
    normalizer: LayerNormalizer | None = None,
    gaug_init: GaugInit = "paper",
    *,
    window: int | Sequence[int] | None = None,
    dilation: int | Sequence[int] | None = None,
) -> nn.Module:
    """Swap the attention of a timm ``VisionTransformer``, ``Eva`` or ``SwinTransformer``, or of a
    transformers vision model, in place; return it.

    Calls compose: each changes only what it names, and every block keeps what it is not told to
    change (its GAug heads, neighbourhood window, normalizer and learned alphas), so
    ``patch(model, "locat")`` then ``patch(model, normalizer="adaptive")`` is GAug-biased attention
    with learnable alphas.

    Args:
        model: a timm ViT whose ``blocks[i].attn`` are timm ``Attention``; an ``Eva`` (EVA-02, the
            RoPE ViTs) whose ``blocks[i].attn`` are ``AttentionRope`` / ``EvaAttention``; a Swin
            whose ``layers[s].blocks[j].attn`` are ``WindowAttention`` (or vitattn layers of those);
            or a transformers ViT, DeiT, DINOv2 (with or without registers), ViT-MAE, CLIP vision or
            SigLIP vision model (or one holding such a tower, e.g. ``CLIPModel``): see
            :func:`vitattn.hf.patch_transformers` and docs/huggingface.md.
        attention: ``None`` (default): each block keeps its kind (a timm layer becomes the vitattn
            layer computing the same). ``"softmax"`` (vitattn :class:`Attention`,
            :class:`RopeAttention` or :class:`WindowAttention`: same outputs) or ``"entmax15"``:
            attention without a bias or window (this removes GAug heads and windows the blocks had),
            with softmax / entmax-1.5 unless ``normalizer`` says otherwise. ``"locat"``: GAug added
            (new ``gaug`` heads started as ``gaug_init`` says) or kept, the block's window and
            normalizer kept. In an Eva, GAug reads q before the rotary embedding and biases the
            scores of the rotated q, k; in a Swin, the bias is per window (grid = window, no prefix
            tokens), added to the relative-position bias and shift mask. ``"window"``: neighbourhood
            attention (ViT only): each patch query sees a ``window x window`` neighbourhood of patches,
            class / register tokens stay global (:class:`NeighborhoodAttention`; a LocAt block keeps
            GAug inside the window).
        prr: also refine the final tokens with PRR before the model's pooling and head (in a Swin:
            all positions of the last stage's NHWC output, before the head's pooling).
        blocks: indices of the blocks to patch (negative ones count from the end); all by default.
            A Swin's blocks are numbered stage by stage (``layers[0].blocks[0]`` is 0).
        normalizer: the attention normalizer of the patched blocks (``"softmax"``, ``"entmax15"``,
            ``"sparsemax"``, a float alpha > 1, or ``"adaptive"``: one learnable alpha per head, from
            1.5; not for a Swin). ``None`` (default) keeps each block's own (``"softmax"`` and
            ``"entmax15"`` as ``attention`` set theirs). So ``attention="locat",
            normalizer="entmax15"`` is GAug-biased entmax-1.5 attention, as in
            ``LocAtViT(normalizer="entmax15")``, and ``attention="softmax", normalizer=1.25`` is
            unbiased 1.25-entmax.
        gaug_init: how new GAug heads start: ``"paper"`` (default; LocAtViT's init, α ≈ ln 2, which
            changes a pretrained model's function at once) or ``"identity"`` (the paper's heads behind
            a per-head gate started at 0: the patched model computes exactly what it did, and the gate
            learns at the learning rate; see :class:`~vitattn.layers.GaussianAugment`). Heads kept
            from a LocAt layer are left as they are.
        window: the neighbourhood in patches (int or (rows, columns)) of ``attention="window"``
            (default 7), or a hard window around LocAt's Gaussian bias (timm ViT / Eva only); with
            ``attention=None`` it windows every chosen block (a plain one becomes neighbourhood
            attention). ``None``: each block keeps its window.
        dilation: the window's dilation (int or (rows, columns)); ``None`` keeps the block's (1 for a
            new window).

    qkv / proj / norm weights (a Swin's relative-position tables too) move into the new layers; class and
    register tokens and ``dynamic_img_size`` are handled (the patch grid is read from each input).

    Raises:
        TypeError: ``model`` is not a ViT, a block's attention is of an unsupported class (the
            message names it and the supported ones), or a block index is not an int.
        ValueError: unknown ``attention`` name or class, an unknown ``normalizer`` (or one other
            than entmax-1.5 with ``attention="entmax15"``, or ``"adaptive"`` on a Swin), a block
            index out of range, patch dropout with ``"locat"``, ``prr=True`` on a model pooling with
            its own attention pool, a window where none can go, or an unknown ``gaug_init``.
    """
    # every argument is checked before anything changes (a refused call leaves the model as it was)
    options = _checked_options(attention, prr, blocks, normalizer, gaug_init, window, dilation)
    layout = layout_of(model)
    _check_layout(layout, options)
    _patch_layout(layout, options, chosen_blocks(blocks, layout.depth))
    return model


def _patch_layout(layout: ModelLayout, options: _Options, indices: Sequence[int]) -> None:
    """Patch the checked ``options`` into blocks ``indices`` of a timm or a transformers layout."""
    if isinstance(layout, TimmLayout):
        _patch_timm(layout, options, indices)
        return
    # transformers: the modules stay, and compute through vitattn's attention implementation
    from .hf.layout import HFLayout
    from .hf.patching import patch_layout

    assert isinstance(layout, HFLayout)  # layout_of gives a transformers model no other layout
    patch_layout(layout, options.attention, options.prr, indices, options.normalizer, options.gaug_init)


@dataclass(frozen=True)
class _Options:
    """What a :func:`patch` call asks for, its names checked (``attention`` a key of ``_LAYERS``;
    ``normalizer`` resolved, or the one ``attention`` implies, or None: each block keeps its own)."""

    attention: str | None
    prr: bool
    normalizer: str | float | None
    gaug_init: GaugInit
    window: int | Sequence[int] | None
    dilation: int | Sequence[int] | None


def _checked_options(
    attention: object,
    prr: object,
    blocks: object,
    normalizer: LayerNormalizer | None,
    gaug_init: object,
    window: int | Sequence[int] | None,
    dilation: int | Sequence[int] | None,
) -> _Options:
    """:func:`patch`'s arguments checked (``TypeError`` / ``ValueError`` naming the one refused)."""
    init = check_gaug_init(gaug_init)
    name = _attention_name(attention)
    check_flag("prr", prr)
    _check_blocks(blocks)
    layer_normalizer = patch_normalizer(name, normalizer)  # a ValueError naming an unknown one
    if window is not None:
        grid_pair("window", window)
    if dilation is not None:
        grid_pair("dilation", dilation)
    return _Options(name, bool(prr), layer_normalizer, init, window, dilation)


def _check_layout(layout: ModelLayout, options: _Options) -> None:
    """What ``options`` ask of this kind of model, checked before any block changes: a timm ViT, Eva
    or Swin (``TypeError`` for another model; PRR only where it can go), or a transformers model (no
    window, no ``"adaptive"`` normalizer)."""
    if not isinstance(layout, TimmLayout):  # layout_of gives a transformers model an HFLayout
        if options.window is not None or options.dilation is not None or options.attention == "window":
            raise ValueError("window= / attention='window' is for timm ViTs, not transformers models")
        if options.normalizer == "adaptive":
            raise ValueError("normalizer='adaptive' is for timm models, not transformers models")
        return
    if layout.depth == 0 or layout.grid() is None:
        raise TypeError(
            f"model must be a timm VisionTransformer or Eva (patch_embed + blocks) or SwinTransformer "
            f"(patch_embed + layers[i].blocks), or a transformers ViT / DeiT / DINOv2 / ViT-MAE / CLIP "
            f"vision / SigLIP vision model, got {type(layout.model).__name__}"
        )
    refusal = _prr_refusal(layout.model, layout.windowed) if options.prr else None
    if refusal is not None:
        raise ValueError(refusal)


_Plan = tuple[Family, str, str, dict[str, object]]  # (family, its layer name, kind, layer kwargs)


def _patch_timm(layout: TimmLayout, options: _Options, indices: Sequence[int]) -> None:
    """Swap the attention modules of blocks ``indices`` for the vitattn layers ``options`` name."""
    plans = {i: _plan(layout, i, options) for i in indices}
    grid = _grid_options(layout, plans)
    for i, (family, layer, kind, kwargs) in plans.items():
        block = layout.blocks[i]
        old = block.attn
        extra = {**kwargs, "gaug_init": options.gaug_init, **(grid if kind != "none" else {})}
        new = family.convert(old, family.layers[layer], **extra)
        if isinstance(new, LocAtAttention) and isinstance(old, GridAttention) and old.initial_grid_size:
            new.set_grid(grid["grid_size"], initial_grid_size=old.initial_grid_size)  # type: ignore[arg-type]
        block.attn = new
    if options.prr:
        _add_prr(layout)
    if grid:
        attach_grid_sync(layout.model)


def _plan(layout: TimmLayout, index: int, options: _Options) -> _Plan:
    """What block ``index`` becomes: its family, the family's layer name, the kind and the layer kwargs."""
    label, old = layout.block_names[index], layout.attentions[index]
    family = _family(old, layout.windowed)
    if family is None:
        raise _unsupported_attention(label, old)
    assert old is not None
    layer, kind, kwargs = _target(
        label,
        _current(old),
        options.attention,
        options.normalizer,
        options.window,
        options.dilation,
        layout.windowed,
    )
    if layer not in family.layers:
        raise ValueError(f"attention={layer!r} is not available for {family.name} ({label})")
    return family, layer, kind, kwargs


def _grid_options(layout: TimmLayout, plans: dict[int, _Plan]) -> dict[str, object]:
    """The token layout a grid-aware layer (LocAt, neighbourhood) is built with; none when no plan
    makes one, or on a Swin (its GAug grid is each layer's window)."""
    kinds = sorted({kind for _, _, kind, _ in plans.values() if kind != "none"})
    if layout.windowed or not kinds:
        return {}
    if getattr(getattr(layout.model, "patch_drop", None), "prob", 0.0):
        raise ValueError(f"attention={kinds[0]!r} needs every patch token: this model uses patch dropout")
    return {"grid_size": layout.grid(), "num_prefix_tokens": layout.num_prefix_tokens or 0}
