"""AdamW parameter groups of a run: weight decay on weight matrices, and layer-wise lr decay.

Without ``layer_decay`` the study's rule: weight matrices decay; biases, norms, the position
embedding and the class / register tokens do not. With it, timm's ``param_groups_layer_decay``
(BEiT's recipe, as timm's fine-tuning scripts use it): block ``i`` of ``L`` gets the learning rate
times ``layer_decay ** (L + 1 - layer(i))`` (the head 1, the embeddings the smallest), and the
same weight-decay rule (1-D tensors and ``model.no_weight_decay()`` excluded).

``gaug_lr_scale`` multiplies the learning rate of LocAt's GAug heads (parameters named
``*.gaug.*``) on top of either rule: their own groups, same weight decay.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .config import StudyConfig

__all__ = ["param_groups"]


def _no_weight_decay(model: nn.Module) -> set[str]:
    names = getattr(model, "no_weight_decay", None)
    return set(names()) if callable(names) else set()


def param_groups(model: nn.Module, config: StudyConfig) -> list[dict[str, Any]]:
    """AdamW groups for ``model``: each with ``params``, ``weight_decay`` and, with layer decay or a
    GAug lr scale, ``lr`` (``config.lr`` times its ``lr_scale``)."""
    groups = _decay_groups(model, config)
    if config.gaug_lr_scale == 1.0:
        return groups
    return _split_gaug(model, groups, config)


def _split_gaug(model: nn.Module, groups: list[dict[str, Any]], config: StudyConfig) -> list[dict[str, Any]]:
    """Each group split in two: its GAug parameters (lr times ``config.gaug_lr_scale``) and the rest."""
    gaug = {id(p) for name, p in model.named_parameters() if ".gaug." in f".{name}"}
    out: list[dict[str, Any]] = []
    for group in groups:
        scale = float(group.get("lr_scale", 1.0))
        for is_gaug in (False, True):
            params = [p for p in group["params"] if (id(p) in gaug) == is_gaug]
            if params:
                lr_scale = scale * (config.gaug_lr_scale if is_gaug else 1.0)
                out.append({**group, "params": params, "lr_scale": lr_scale, "lr": config.lr * lr_scale})
    return out


def _decay_groups(model: nn.Module, config: StudyConfig) -> list[dict[str, Any]]:
    """The weight-decay (and layer-decay) groups, before any GAug lr scale."""
    if config.layer_decay is None:
        decay: list[nn.Parameter] = []
        no_decay: list[nn.Parameter] = []
        for name, p in model.named_parameters():
            matrix = p.ndim > 1 and "pos_embed" not in name and "token" not in name
            (decay if matrix else no_decay).append(p)
        return [
            {"params": decay, "weight_decay": config.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
    from timm.optim import param_groups_layer_decay

    groups = param_groups_layer_decay(
        model,
        weight_decay=config.weight_decay,
        no_weight_decay_list=_no_weight_decay(model),
        layer_decay=float(config.layer_decay),
    )
    for group in groups:
        group["lr"] = config.lr * float(group["lr_scale"])
    return groups
