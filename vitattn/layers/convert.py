"""Turn an existing timm-style attention module into a vitattn layer, weights kept."""

from __future__ import annotations

from typing import Any, TypeVar

import torch
from torch import nn

from .attention import Attention
from .locat import GaugInit, check_gaug_init

__all__ = ["convertible_attention", "convert_attention", "finish_conversion", "new_like"]

M = TypeVar("M", bound=nn.Module)


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
    from .locat_rope import rope_attention_classes

    return (
        not isinstance(module, rope_attention_classes())
        and isinstance(module, _timm_attention_classes())
        and isinstance(getattr(module, "qkv", None), nn.Linear)
        and isinstance(getattr(module, "proj", None), nn.Linear)
    )


def new_like(old: nn.Module, cls: type[M], dim: int, **kwargs: Any) -> M:
    """``cls(dim, old.num_heads, **kwargs)`` on the meta device, for a converter to fill with ``old``'s
    submodules. ``old``'s dropout rates (``attn_drop`` / ``proj_drop``) and a vitattn layer's
    ``backend`` carry over unless ``kwargs`` sets them (timm's layers have no ``backend``: "auto")."""
    for name in ("attn_drop", "proj_drop"):
        drop = getattr(old, name, None)
        kwargs.setdefault(name, drop.p if isinstance(drop, nn.Dropout) else 0.0)
    kwargs.setdefault("backend", getattr(old, "backend", "auto"))
    return cls(dim, int(old.num_heads), device="meta", **kwargs)  # type: ignore[arg-type]


def finish_conversion(
    new: M, old: nn.Module, weight: torch.Tensor, converter: str, gaug_init: GaugInit = "paper"
) -> M:
    """The last step of every converter: ``new``'s GAug heads (if it has them) kept from ``old`` when it
    has the same kind, else fresh on ``weight``'s device and dtype, started as ``gaug_init`` says
    (:meth:`~vitattn.layers.GaussianAugment.init_weights`); ``old``'s train / eval mode, and timm's
    explicit attention path (``fused_attn=False``) when ``old`` took it.

    Raises ``TypeError`` (naming ``converter``) when a parameter or buffer of ``new`` is still a meta
    placeholder while ``weight`` is not on the meta device.
    """
    gaug_init = check_gaug_init(gaug_init)
    gaug: nn.Module | None = getattr(new, "gaug", None)
    if gaug is not None:  # as in a new model: kept from a LocAt layer, else freshly initialised
        old_gaug = getattr(old, "gaug", None)
        if not isinstance(old_gaug, type(gaug)):
            old_gaug = type(gaug)(new.head_dim, device=weight.device, dtype=weight.dtype, init=gaug_init)
        new.gaug = old_gaug
    if weight.device.type != "meta" and any(t.is_meta for t in (*new.parameters(), *new.buffers())):
        raise TypeError(f"{converter} cannot create the extra parameters of {type(new).__name__}")
    if getattr(old, "fused_attn", True) is False:
        new.fused_attn = False  # type: ignore[assignment]  # a plain bool attribute, as timm's
    new.train(old.training)
    return new


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
