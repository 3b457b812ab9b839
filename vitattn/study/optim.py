"""AdamW of a run, from timm's ``create_optimizer_v2``: weight decay on weight matrices, layer-wise lr decay.

Learning rates are timm's way: every group starts at ``config.lr`` and carries an ``lr_scale`` (layer
decay, GAug) that timm's scheduler multiplies in (see :func:`vitattn.study.train.warmup_cosine`).

Without ``layer_decay`` the study's rule: weight matrices decay; biases, norms, the position
embedding and the class / register tokens (any name with ``pos_embed`` / ``token``) do not. (timm's
``param_groups_weight_decay`` excludes 1-D tensors and ``model.no_weight_decay()`` instead: the same
on the study's ViT and timm's ViT / DeiT, but it also spares Swin's / BEiT's relative position bias
tables, which the study decays; the study keeps its rule.) With ``layer_decay``, timm's
``param_groups_layer_decay`` (BEiT's recipe): block ``i`` of ``L`` gets ``layer_decay ** (L + 1 -
layer(i))`` (the head 1, the embeddings the smallest), 1-D tensors and ``model.no_weight_decay()``
without weight decay.

``gaug_lr_scale`` multiplies the learning rate of LocAt's GAug heads (parameters named ``*.gaug.*``)
on top of either rule: their own groups, same weight decay.
"""

from __future__ import annotations

from typing import Any

import torch
from timm.optim import create_optimizer_v2, param_groups_layer_decay
from torch import nn

from .config import StudyConfig

__all__ = ["build_optimizer", "param_groups"]


def build_optimizer(model: nn.Module, config: StudyConfig) -> torch.optim.Optimizer:
    """``torch.optim.AdamW`` over :func:`param_groups` at ``config.lr``, built by timm's factory."""
    return create_optimizer_v2(
        model,
        opt="adamw",
        lr=config.lr,
        weight_decay=config.weight_decay,
        param_group_fn=lambda m: param_groups(m, config),
    )


def param_groups(model: nn.Module, config: StudyConfig) -> list[dict[str, Any]]:
    """AdamW groups for ``model``: each with ``params``, ``weight_decay`` and, with layer decay or a
    GAug lr scale, ``lr_scale`` (the factor on ``config.lr``)."""
    groups: list[dict[str, Any]]
    if config.layer_decay is None:
        decay: list[nn.Parameter] = []
        no_decay: list[nn.Parameter] = []
        for name, p in model.named_parameters():
            matrix = p.ndim > 1 and "pos_embed" not in name and "token" not in name
            (decay if matrix else no_decay).append(p)
        groups = [
            {"params": decay, "weight_decay": config.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
    else:
        no_wd = getattr(model, "no_weight_decay", None)
        groups = param_groups_layer_decay(
            model,
            weight_decay=config.weight_decay,
            no_weight_decay_list=set(no_wd()) if callable(no_wd) else set(),
            layer_decay=float(config.layer_decay),
        )
    if config.gaug_lr_scale == 1.0:
        return groups
    gaug = {id(p) for name, p in model.named_parameters() if ".gaug." in f".{name}"}
    out: list[dict[str, Any]] = []
    for group in groups:  # each split in two: the rest, then its GAug parameters
        for is_gaug in (False, True):
            params = [p for p in group["params"] if (id(p) in gaug) == is_gaug]
            if params:
                scale = float(group.get("lr_scale", 1.0)) * (config.gaug_lr_scale if is_gaug else 1.0)
                out.append({**group, "params": params, "lr_scale": scale})
    return out
