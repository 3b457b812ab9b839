"""The steps every attention converter shares: timm classes by name, a new layer on the meta device
shaped like the old one, and the finish (GAug heads, train / eval mode, no meta leftovers)."""

from __future__ import annotations

from typing import Any, TypeVar

import torch
from torch import nn

from .locat import GaugInit, check_gaug_init

__all__ = ["finish_conversion", "importable_classes", "new_like"]

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
    """The last step of every converter: ``new``'s GAug heads and adaptive alphas (if it has them) kept
    from ``old`` when it has the same kind (and head count), else fresh on ``weight``'s device and dtype
    (GAug heads started as ``gaug_init`` says, :meth:`~vitattn.layers.GaussianAugment.init_weights`;
    alphas at 1.5); ``old``'s train / eval mode, and timm's explicit attention path
    (``fused_attn=False``) when ``old`` took it.

    Raises ``TypeError`` (naming ``converter``) when a parameter or buffer of ``new`` is still a meta
    placeholder while ``weight`` is not on the meta device.
    """
    gaug_init = check_gaug_init(gaug_init)
    gaug: nn.Module | None = getattr(new, "gaug", None)
    if gaug is not None:  # as in a new model: kept from a LocAt layer, else freshly initialised
        old_gaug = getattr(old, "gaug", None)
        if not isinstance(old_gaug, type(gaug)):
            heads = int(new.num_heads)  # type: ignore[arg-type]
            old_gaug = type(gaug)(new.head_dim, weight.device, weight.dtype, init=gaug_init, num_heads=heads)
        new.gaug = old_gaug
    adaptive: nn.Module | None = getattr(new, "adaptive_alpha", None)
    if adaptive is not None:  # alpha = 1.5 per head in a new layer; learned ones carry over
        old_adaptive = getattr(old, "adaptive_alpha", None)
        if not isinstance(old_adaptive, type(adaptive)) or old_adaptive.num_heads != new.num_heads:
            old_adaptive = type(adaptive)(new.num_heads, device=weight.device, dtype=weight.dtype)
        new.adaptive_alpha = old_adaptive
    if weight.device.type != "meta" and any(t.is_meta for t in (*new.parameters(), *new.buffers())):
        raise TypeError(f"{converter} cannot create the extra parameters of {type(new).__name__}")
    if getattr(old, "fused_attn", True) is False:
        new.fused_attn = False  # type: ignore[assignment]  # a plain bool attribute, as timm's
    new.train(old.training)
    return new
