"""The model of a run: the study's compact ViT (a vitattn :class:`~vitattn.models.LocAtViT`) with a
chosen attention, or, for fine-tuning, any timm backbone from its weights, patched."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypedDict, cast

from torch import nn

from ..layers.adaptive import LayerNormalizer
from ..layers.kinds import implied_normalizer
from ..models import LocAtViT
from ..patch import patch
from .backbone import create_timm_model, load_weights
from .config import STUDY_WINDOW, StudyConfig
from .init import init_study_vit

__all__ = [
    "STUDY_WINDOW",
    "build_backbone",
    "build_model",
    "count_parameters",
    "model_kwargs",
    "patch_backbone",
]


class ModelKwargs(TypedDict):
    """The keyword arguments :func:`model_kwargs` gives :class:`LocAtViT`."""

    img_size: int
    patch_size: int
    in_chans: int
    num_classes: int
    embed_dim: int
    depth: int
    num_heads: int
    mlp_ratio: float
    drop_rate: float
    attn_drop_rate: float
    drop_path_rate: float
    gaug: bool
    prr: bool
    normalizer: LayerNormalizer


def model_kwargs(config: StudyConfig, attention: str) -> ModelKwargs:
    """Builder arguments of :class:`LocAtViT` (timm ``VisionTransformer`` ones plus ``gaug``, ``prr``,
    ``normalizer``) for ``attention`` in ``softmax``, ``entmax15``, ``locat``, ``adaptive``, ``window``
    (the window itself is patched in by :func:`build_model`): the study's 8×8 patch grid on the run's
    input size."""
    size = config.input_size
    return ModelKwargs(
        img_size=size,
        patch_size=size // config.spec.grid_size[0],
        in_chans=config.spec.channels,
        num_classes=config.classes,
        embed_dim=config.dim,
        depth=config.depth,
        num_heads=config.heads,
        mlp_ratio=config.mlp_ratio,
        drop_rate=0.0,
        attn_drop_rate=0.0,
        drop_path_rate=float(config.drop_path),
        gaug=attention == "locat",
        prr=config.prr,
        normalizer=cast(LayerNormalizer, implied_normalizer(attention) or "softmax"),
    )


def _study_vit(config: StudyConfig, attention: str) -> LocAtViT:
    """The study's ViT built with ``attention``, initialised as ``config.init`` says; ``window``
    patches in :class:`vitattn.layers.NeighborhoodAttention` (a ``config.window_size`` square window,
    :data:`STUDY_WINDOW` by default, dilated by ``config.dilation``; the class token stays global)
    before the init."""
    model = LocAtViT(**model_kwargs(config, attention))
    if attention == "window":
        patch(model, attention="window", window=config.window_size, dilation=config.dilation)
    init_study_vit(model, config.init, config.pos_embed_std)
    return model


def patch_backbone(
    model: nn.Module, attention: str, prr: bool, gaug_init: str, window: int = 5, dilation: int = 1
) -> nn.Module:
    """``model`` with ``attention`` swapped in (``softmax`` keeps the backbone's own) and PRR if asked.

    ``adaptive`` is softmax attention with one learnable alpha-entmax alpha per head (from 1.5);
    ``window`` is softmax neighbourhood attention over ``window x window`` patches (every
    ``dilation``-th patch).
    """
    if attention == "softmax" and not prr:
        return model
    options: dict[str, Any] = {"prr": prr}
    if attention == "softmax":
        options["blocks"] = []  # PRR only, attention untouched
    elif attention == "adaptive":
        attention, options["normalizer"] = "softmax", "adaptive"
    elif attention == "window":
        options.update(window=window, dilation=dilation)
    else:
        options["gaug_init"] = gaug_init
    return patch(model, attention, **options)  # type: ignore[arg-type]


def build_model(
    config: StudyConfig, attention: str, seed: int = 0, log: Callable[[str], object] | None = None
) -> nn.Module:
    """The run's model: input ``(B, C, size, size)`` -> logits ``(B, classes)``. Initialise under a
    seeded RNG for reproducible weights.

    - From scratch (no ``config.model``, ``pretrained`` or ``checkpoint``): the study's ViT, 8×8
      patches + class token, built with ``attention`` (``softmax`` keeps timm's fused attention,
      ``entmax15`` entmax-1.5 blocks, ``locat`` GAug blocks with LocAtViT's own init, ``adaptive``
      alpha-entmax with one learnable alpha per head, ``window`` softmax neighbourhood attention).
    - From weights or a timm name: the backbone (``config.model``, or the study's ViT with softmax
      attention) with timm's ``pretrained`` weights or ``config.checkpoint`` (``{seed}`` in its path
      is replaced by ``seed``), then ``attention`` and ``prr`` applied by :func:`vitattn.patch`
      (GAug heads start as ``config.gaug_init`` says; ``softmax`` keeps the backbone's attention).
    """
    model, new_keys = build_backbone(config, attention)
    if config.checkpoint is not None:
        load_weights(model, config.checkpoint_path(seed), new_keys, log)
    return model


def build_backbone(config: StudyConfig, attention: str) -> tuple[nn.Module, set[str]]:
    """The run's model before any weights are loaded (the study's ViT, or the timm backbone with
    ``pretrained`` weights, patched with ``attention`` and ``prr``) and the state-dict keys the patch
    added (a checkpoint of the unpatched backbone lacks them). Works on the meta device."""
    if not config.from_weights and config.model is None:
        return _study_vit(config, attention), set()
    if config.model is None:
        base: nn.Module = _study_vit(config, "softmax")
    else:
        base = create_timm_model(
            config.model,
            num_classes=config.classes,
            img_size=config.input_size,
            in_chans=config.spec.channels,
            drop_path=float(config.drop_path),
            pretrained=config.pretrained,
            model_args=config.model_args,
        )
    before = set(base.state_dict())
    model = patch_backbone(
        base, attention, config.prr, str(config.gaug_init), config.window_size, config.dilation
    )
    return model, set(model.state_dict()) - before


def count_parameters(model: nn.Module) -> int:
    """Number of parameters (trainable or not)."""
    return sum(p.numel() for p in model.parameters())
