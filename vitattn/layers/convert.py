"""Turn an existing timm-style attention module into a vitattn layer, weights kept."""

from __future__ import annotations

from typing import Any

from torch import nn

from .attention import Attention

__all__ = ["convertible_attention", "convert_attention"]


def importable_classes(first: type, *names: tuple[str, str]) -> tuple[type, ...]:
    """``first`` and each ``(module, class name)`` that this timm version has, without repeats
    (timm moves and renames its attention classes between releases)."""
    import importlib

    classes: list[type] = [first]
    for module, name in names:
        try:
            classes.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):  # pragma: no cover - depends on the timm version
            pass
    return tuple(dict.fromkeys(classes))


def _timm_attention_classes() -> tuple[type, ...]:
    """vitattn's Attention and timm's (``timm.layers`` since 1.0.16, and the older copy in
    ``vision_transformer``)."""
    return importable_classes(
        Attention, ("timm.layers", "Attention"), ("timm.models.vision_transformer", "Attention")
    )


def convertible_attention(module: nn.Module) -> bool:
    """Whether ``module`` is a plain multi-head self-attention with ``qkv`` / ``proj`` linears
    (not a rotary layer: its q, k are rotated inside ``forward``, which a recompute from ``qkv``
    would miss)."""
    from .locat_rope import RopeAttention

    return (
        not isinstance(module, RopeAttention)
        and isinstance(module, _timm_attention_classes())
        and isinstance(getattr(module, "qkv", None), nn.Linear)
        and isinstance(getattr(module, "proj", None), nn.Linear)
    )


def convert_attention(old: nn.Module, cls: type[Attention], **kwargs: Any) -> Attention:
    """A ``cls`` layer (e.g. :class:`LocAtAttention`) computing with ``old``'s weights.

    ``old`` is a ``timm`` ``Attention`` (either location) or a vitattn :class:`Attention`. Its
    ``qkv``, ``q_norm``, ``k_norm``, ``norm``, ``gate`` and ``proj`` submodules move into the new layer
    (the same parameters, so optimizers and ``requires_grad`` carry over); GAug heads are kept from
    a LocAt layer, otherwise created fresh on the device and dtype of ``old.qkv.weight``. ``kwargs``
    go to ``cls`` (``normalizer``, ``grid_size``, ...). Raises ``TypeError`` for any other module.
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
    attn_drop = getattr(old, "attn_drop", None)
    proj_drop = getattr(old, "proj_drop", None)
    new = cls(
        qkv.in_features,
        num_heads,
        attn_head_dim=head_dim,
        dim_out=proj.out_features,
        attn_drop=attn_drop.p if isinstance(attn_drop, nn.Dropout) else 0.0,
        proj_drop=proj_drop.p if isinstance(proj_drop, nn.Dropout) else 0.0,
        device="meta",  # placeholders, replaced just below
        **kwargs,
    )
    new.qkv, new.proj = qkv, proj
    new.q_norm, new.k_norm = old.q_norm, old.k_norm  # type: ignore[assignment]
    new.norm = getattr(old, "norm", None) or nn.Identity()
    new.gate = getattr(old, "gate", None)  # type: ignore[assignment]
    gaug = getattr(new, "gaug", None)
    if gaug is not None:  # GAug heads: kept from a LocAt layer, else fresh as in a new model
        old_gaug = getattr(old, "gaug", None)
        new.gaug = (
            old_gaug
            if isinstance(old_gaug, type(gaug))
            else type(gaug)(new.head_dim, device=qkv.weight.device, dtype=qkv.weight.dtype)
        )
    if qkv.weight.device.type != "meta" and any(p.is_meta for p in new.parameters()):
        raise TypeError(f"convert_attention cannot create the extra parameters of {cls.__name__}")
    new.train(old.training)
    return new
