"""The ViT converter: timm's ``Attention`` (or a vitattn :class:`Attention`) into a vitattn layer, weights
kept. The rotary and window converters live beside their layers (:mod:`.locat_rope`,
:mod:`.locat_window`); the steps all three share are :mod:`.convert_steps`."""

from __future__ import annotations

from typing import Any

from torch import nn

from .attention import Attention
from .convert_steps import finish_conversion, importable_classes, new_like
from .locat import GaugInit
from .locat_rope import rope_attention_classes

__all__ = ["convert_attention", "convertible_attention", "timm_attention_classes"]


def timm_attention_classes() -> tuple[type, ...]:
    """vitattn's Attention and timm's (``timm.layers`` since 1.0.16, and the older copy in
    ``vision_transformer``)."""
    return importable_classes(
        Attention, ("timm.layers", "Attention"), ("timm.models.vision_transformer", "Attention")
    )


def convertible_attention(module: nn.Module) -> bool:
    """Whether ``module`` is a plain multi-head self-attention with ``qkv`` / ``proj`` linears
    (not a rotary layer: its q, k are rotated inside ``forward``, which a recompute from ``qkv``
    would miss)."""
    return (
        not isinstance(module, rope_attention_classes())
        and isinstance(module, timm_attention_classes())
        and isinstance(getattr(module, "qkv", None), nn.Linear)
        and isinstance(getattr(module, "proj", None), nn.Linear)
    )


def convert_attention(
    old: nn.Module, cls: type[Attention], *, gaug_init: GaugInit = "paper", **kwargs: Any
) -> Attention:
    """A ``cls`` layer (e.g. :class:`LocAtAttention`) computing with ``old``'s weights.

    ``old`` is a ``timm`` ``Attention`` (either location) or a vitattn :class:`Attention`. Its
    ``qkv``, ``q_norm``, ``k_norm``, ``norm``, ``gate`` and ``proj`` submodules move into the new layer
    (the same parameters, so optimizers and ``requires_grad`` carry over), as do its dropout rates and
    (a vitattn layer's) ``backend``; GAug heads are kept from a LocAt layer, otherwise created fresh on
    the device and dtype of ``old.qkv.weight`` and started as ``gaug_init`` says (``"paper"`` or
    ``"identity"``, see :class:`~vitattn.layers.GaussianAugment`). ``kwargs`` go to ``cls``
    (``normalizer``, ``grid_size``, ``backend``, ...). Raises ``TypeError`` for any other module.
    """
    if not convertible_attention(old):
        raise TypeError(
            f"cannot convert {type(old).__module__}.{type(old).__name__}: expected timm's Attention "
            "(qkv + proj linears) or a vitattn Attention"
        )
    qkv: nn.Linear = old.qkv  # type: ignore[assignment]
    proj: nn.Linear = old.proj  # type: ignore[assignment]
    num_heads = int(old.num_heads)  # type: ignore[arg-type]
    head_dim = int(getattr(old, "head_dim", qkv.out_features // (3 * num_heads)))
    new = new_like(old, cls, qkv.in_features, attn_head_dim=head_dim, dim_out=proj.out_features, **kwargs)
    new.qkv, new.proj = qkv, proj
    new.q_norm, new.k_norm = old.get_submodule("q_norm"), old.get_submodule("k_norm")
    new.norm = getattr(old, "norm", None) or nn.Identity()
    new.gate = getattr(old, "gate", None)
    return finish_conversion(new, old, qkv.weight, "convert_attention", gaug_init)
