"""``vitattn.patch``: swap the attention of a timm ViT, Eva (RoPE ViT) or Swin, or of a transformers
vision model, in place, weights kept.

One :class:`~vitattn.models._locat_common.Family` per timm attention family (the ones the LocAt
models convert with): each says which modules it takes, how to convert one and which vitattn layer
each ``attention=`` name becomes. transformers models go to :func:`vitattn.hf.patch_transformers`
(imported only for them).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from torch import nn

from .functional.normalize import Normalizer, resolve_normalizer
from .layers import PRR, Attention, EntmaxAttention, LocAtAttention
from .layers.locat import GaugInit, check_gaug_init
from .layers.prr import PRRPool, PRRPoolNHWC  # re-exported: their home was here
from .models._grid import attach_grid_sync
from .models._locat_common import EVA, SWIN, VIT, Family, prr_heads
from .models.blocks import block_indices, is_transformers_model, module_items
from .models.locatrope import LocAtRoPEViT
from .models.locatswin import LocAtSwin
from .models.locatvit import LocAtViT

__all__ = ["patch"]

_LAYERS: dict[str, type[Attention]] = {
    "softmax": Attention,
    "entmax15": EntmaxAttention,
    "locat": LocAtAttention,
}
_DEFAULT_NORMALIZER = {"softmax": "softmax", "entmax15": "entmax15", "locat": "softmax"}
# The rotary family comes first: vitattn's rotary layers are Attention subclasses too.
_FAMILIES = (EVA, VIT)


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
            return [(f"blocks[{i}]", b) for i, b in enumerate(module_items(blocks))], False
        layers = getattr(model, "layers", None)
        if isinstance(layers, nn.Module) and all(
            isinstance(getattr(s, "blocks", None), nn.Module) for s in module_items(layers)
        ):
            return [
                (f"layers[{s}].blocks[{j}]", b)
                for s, stage in enumerate(module_items(layers))
                for j, b in enumerate(module_items(stage.get_submodule("blocks")))
            ], True
    raise TypeError(
        f"model must be a timm VisionTransformer or Eva (patch_embed + blocks) or SwinTransformer "
        f"(patch_embed + layers[i].blocks), or a transformers ViT / DeiT / DINOv2 / ViT-MAE / CLIP vision / "
        f"SigLIP vision model, got {type(model).__name__}"
    )


def _family(attn: object, swin: bool) -> Family | None:
    """The attention family taking ``attn`` (None when no family knows its class)."""
    if not isinstance(attn, nn.Module):
        return None
    candidates = (SWIN,) if swin else _FAMILIES
    return next((f for f in candidates if f.accepts(attn)), None)


def _attention_name(attention: object) -> str:
    """``attention`` as a key of ``_LAYERS``: a name, or one of the vitattn layer classes."""
    if isinstance(attention, type):
        for name, cls in _LAYERS.items():
            if attention is cls:
                return name
        raise ValueError(
            f"attention={attention.__module__}.{attention.__qualname__} is not a layer vitattn.patch "
            f"knows; give one of {sorted(_LAYERS)} (or the classes "
            f"{', '.join(layer.__name__ for layer in _LAYERS.values())})"
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
        f"{f.name}: " + ", ".join(f"{k.__module__}.{k.__qualname__}" for k in dict.fromkeys(f.known()))
        for f in (VIT, EVA, SWIN)
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
    layer = PRR(int(model.embed_dim), prr_heads(model.get_submodule("blocks")))  # type: ignore[arg-type]
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
    prefix = int(getattr(model, "num_prefix_tokens", 0))
    model.attn_pool = PRRPool(layer, str(model.global_pool), prefix, include_prefix)
    # timm >= 1.0.2x strips prefix tokens before attn_pool unless this is set
    model.pool_include_prefix = True  # type: ignore[assignment]  # nn.Module types only tensors, modules


def _add_prr_swin(model: nn.Module, slots: list[tuple[str, nn.Module]]) -> None:
    """PRR over the last stage's NHWC output, before the head's pooling (``head.global_pool``)."""
    layer = PRR(int(model.num_features), prr_heads([block for _, block in slots]))  # type: ignore[arg-type]
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
    gaug_init: GaugInit = "paper",
) -> nn.Module:
    """Swap the attention of a timm ``VisionTransformer``, ``Eva`` or ``SwinTransformer``, or of a
    transformers vision model, in place; return it.

    Args:
        model: a timm ViT whose ``blocks[i].attn`` are timm ``Attention``; an ``Eva`` (EVA-02, the
            RoPE ViTs) whose ``blocks[i].attn`` are ``AttentionRope`` / ``EvaAttention``; a Swin
            whose ``layers[s].blocks[j].attn`` are ``WindowAttention`` (or vitattn layers of those);
            or a transformers ViT, DeiT, DINOv2 (with or without registers), ViT-MAE, CLIP vision or
            SigLIP vision model (or one holding such a tower, e.g. ``CLIPModel``): see
            :func:`vitattn.hf.patch_transformers` and docs/huggingface.md.
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
        gaug_init: how new GAug heads start (``"locat"``): ``"paper"`` (default; LocAtViT's init,
            α ≈ ln 2, which changes a pretrained model's function at once) or ``"identity"`` (α =
            :data:`vitattn.layers.locat.IDENTITY_ALPHA` for every query: the patched model's outputs
            match the unpatched ones to about 1e-4 and GAug's heads still get a gradient). Heads kept
            from a LocAt layer are left as they are.

    qkv / proj / norm weights (and a Swin's relative-position tables) are kept: the same parameters
    move into the new layers. Class and register tokens and ``dynamic_img_size`` are handled: the
    patch grid is read from each input.

    Raises:
        TypeError: ``model`` is not a ViT, a block's attention is of an unsupported class (the
            message names it and the supported ones), or a block index is not an int.
        ValueError: unknown ``attention`` name or class, an unknown ``normalizer`` (or one other
            than entmax-1.5 with ``attention="entmax15"``), a block index out of range, patch
            dropout with ``"locat"``, ``prr=True`` on a model pooling with its own attention pool, or an
            unknown ``gaug_init``.
    """
    gaug_init = check_gaug_init(gaug_init)
    if is_transformers_model(model):
        from .hf.patching import patch_transformers

        return patch_transformers(
            model,
            _attention_name(attention),
            prr=prr,
            blocks=blocks,
            normalizer=normalizer,
            gaug_init=gaug_init,
        )
    slots, swin = _attention_slots(model)
    name = _attention_name(attention)
    layer_normalizer = _layer_normalizer(name, normalizer)
    all_blocks = [block for _, block in slots]
    indices = _block_indices(blocks, len(all_blocks))
    families = {}
    for i in indices:
        family = _family(getattr(all_blocks[i], "attn", None), swin)
        if family is None:
            raise _unsupported_attention(slots[i][0], getattr(all_blocks[i], "attn", None))
        families[i] = family
    extra: dict[str, object] = {"normalizer": layer_normalizer, "gaug_init": gaug_init}
    if name == "locat" and not swin:  # a Swin's GAug grid is each layer's window
        patch_drop = getattr(model, "patch_drop", None)
        if getattr(patch_drop, "prob", 0.0):
            raise ValueError("attention='locat' needs every patch token: this model uses patch dropout")
        grid = tuple(int(g) for g in model.patch_embed.grid_size)  # type: ignore[union-attr]
        extra.update(grid_size=grid, num_prefix_tokens=int(getattr(model, "num_prefix_tokens", 0)))
    for i in indices:
        old = all_blocks[i].attn
        new = families[i].convert(old, families[i].layers[name], **extra)
        if name == "locat" and isinstance(old, LocAtAttention) and old.initial_grid_size is not None:
            new.set_grid(extra["grid_size"], initial_grid_size=old.initial_grid_size)  # type: ignore[operator]
        all_blocks[i].attn = new
    if name == "locat" and not swin:
        attach_grid_sync(model)
    if prr:
        _add_prr_swin(model, slots) if swin else _add_prr(model)
    return model
