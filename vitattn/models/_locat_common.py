"""What the LocAt models (LocAtViT on VisionTransformer, LocAtRoPEViT on Eva, LocAtSwin on
SwinTransformer) share: the attention family each converts (also :func:`vitattn.patch`'s), the
``gaug`` / ``prr`` / ``normalizer`` constructor, PRR before the model's head, the official release's
pretrained cfg and the timm registration of the variants."""

from __future__ import annotations

import sys
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import torch
from timm.models import build_model_with_cfg, register_model, resolve_pretrained_cfg
from torch import nn

from ..layers import (
    PRR,
    Attention,
    EntmaxAttention,
    LocAtAttention,
    NeighborhoodAttention,
    convert_attention,
    convertible_attention,
)
from ..layers.adaptive import LayerNormalizer, resolve_layer_normalizer
from ..layers.convert import _timm_attention_classes
from ..layers.locat import GaugInit, check_gaug_init
from ..layers.locat_rope import (
    LocAtRopeAttention,
    RopeAttention,
    convert_rope_attention,
    convertible_rope_attention,
    rope_attention_classes,
)
from ..layers.locat_window import (
    LocAtWindowAttention,
    WindowAttention,
    convert_window_attention,
    convertible_window_attention,
)
from ._grid import attach_grid_sync

__all__ = [
    "EVA",
    "SWIN",
    "VIT",
    "Family",
    "LocAtModelMixin",
    "PRRHeadMixin",
    "build_variant",
    "keep_fresh_gaug",
    "prr_heads",
    "register_variants",
    "reject_patch_drop",
    "release_cfg",
    "weight_source",
]

M = TypeVar("M", bound=nn.Module)


@dataclass(frozen=True)
class Family:
    """One timm attention family: which modules it takes, how to convert one and which vitattn layer
    each ``attention=`` name (``"softmax"``, ``"entmax15"``, ``"locat"``, ``"window"`` where the family
    has it) becomes."""

    name: str
    accepts: Callable[[nn.Module], bool]
    convert: Callable[..., nn.Module]
    layers: dict[str, type[nn.Module]]
    known: Callable[[], tuple[type, ...]]  # the classes it takes, for error messages


def _window_classes() -> tuple[type, ...]:
    from timm.models.swin_transformer import WindowAttention as TimmWindowAttention

    return (TimmWindowAttention, WindowAttention, LocAtWindowAttention)


VIT = Family(
    "ViT",
    convertible_attention,
    convert_attention,
    {
        "softmax": Attention,
        "entmax15": EntmaxAttention,
        "locat": LocAtAttention,
        "window": NeighborhoodAttention,
    },
    lambda: (*_timm_attention_classes(), EntmaxAttention, LocAtAttention, NeighborhoodAttention),
)
EVA = Family(
    "Eva / RoPE ViT",
    convertible_rope_attention,
    convert_rope_attention,
    {"softmax": RopeAttention, "entmax15": RopeAttention, "locat": LocAtRopeAttention},
    rope_attention_classes,
)
SWIN = Family(
    "Swin",
    convertible_window_attention,
    convert_window_attention,
    {"softmax": WindowAttention, "entmax15": WindowAttention, "locat": LocAtWindowAttention},
    _window_classes,
)


def prr_heads(blocks: Sequence[nn.Module], default: int = 1) -> int:
    """The head count of the last of ``blocks`` with an attention (PRR's heads), else ``default``."""
    for block in reversed(blocks):
        attn = getattr(block, "attn", None)
        if attn is not None:
            return int(attn.num_heads)
    return default


def reject_patch_drop(gaug: bool, kwargs: Mapping[str, Any]) -> None:
    """``ValueError`` when ``patch_drop_rate`` is set with GAug (dropped patches break its grid)."""
    if gaug and kwargs.get("patch_drop_rate", 0.0):
        raise ValueError(
            f"patch_drop_rate={kwargs['patch_drop_rate']} drops patches, which breaks GAug's patch grid; "
            "use patch_drop_rate=0 with gaug=True"
        )


class LocAtModelMixin:
    """The LocAt models' constructor: a timm model (``*args, **kwargs`` go to it unchanged) whose
    attention is converted to the ``family``'s vitattn layers, plus

    Args:
        gaug: GAug (LocAt) attention in every block (``*.attn.gaug.*`` params).
        prr: parameter-free patch representation refinement before the model's pooling and head.
        normalizer: the attention normalizer of every block (``"softmax"``, ``"entmax15"``, ...;
            ``"adaptive"``: one learnable alpha-entmax alpha per head and block, from 1.5).
        gaug_init: how the GAug heads start: ``"paper"`` (the release's init) or ``"identity"``
            (a per-head gate at 0, so a model loaded from a plain, GAug-free checkpoint keeps that
            checkpoint's function; see :class:`~vitattn.layers.GaussianAugment`). A checkpoint with
            GAug weights overwrites them either way (gate 1 where it has none).

    A subclass names its ``family`` and what it ``needs`` at each block (for the ``TypeError``);
    ``patch_grid`` (ViT, Eva) gives GAug the model's patch grid and prefix tokens and keeps them in
    step with each input (:func:`attach_grid_sync`); without it (Swin) each layer's grid is its window.
    """

    family: ClassVar[Family]
    needs: ClassVar[str]
    patch_grid: ClassVar[bool] = True
    use_gaug: bool
    gaug_init: GaugInit
    normalizer: str | float
    prr: PRR | None

    def __init__(
        self,
        *args: Any,
        gaug: bool = True,
        prr: bool = True,
        normalizer: LayerNormalizer = "softmax",
        gaug_init: GaugInit = "paper",
        **kwargs: Any,
    ) -> None:
        checked_init = check_gaug_init(gaug_init)
        if prr and kwargs.get("global_pool") == "prr":
            raise ValueError("global_pool='prr' already applies PRR: pass prr=False with it, or another pool")
        reject_patch_drop(gaug, kwargs)
        resolved = resolve_layer_normalizer(normalizer)
        super().__init__(*args, **kwargs)
        self.use_gaug = bool(gaug)
        self.gaug_init = checked_init
        self.normalizer = resolved
        if self.use_gaug or self.normalizer != "softmax":
            self._convert_blocks()
        self.prr = self._new_prr(kwargs.get("num_heads", 1)) if prr else None

    def _new_prr(self, num_heads: int | Sequence[int]) -> PRR:
        """PRR over the model's output width, with the heads of its last block (``num_heads``, the last
        stage's for a Swin, when it has no blocks)."""
        default = int(num_heads[-1] if isinstance(num_heads, Sequence) else num_heads)
        heads = prr_heads([block for _, block in self.attention_blocks()], default)
        return PRR(int(self.num_features), heads)  # type: ignore[attr-defined]

    def attention_blocks(self) -> list[tuple[str, nn.Module]]:
        """``(label, block)`` of every block: ``("blocks[i]", model.blocks[i])`` for a ViT / Eva."""
        return [(f"blocks[{i}]", block) for i, block in enumerate(self.blocks)]  # type: ignore[attr-defined]

    def _convert_blocks(self) -> None:
        """Every block's attention converted (weights kept); ``TypeError`` for one the family refuses."""
        cls = self.family.layers["locat" if self.use_gaug else "softmax"]
        extra: dict[str, Any] = {}
        if self.use_gaug and self.patch_grid:
            grid = tuple(int(g) for g in self.patch_embed.grid_size)  # type: ignore[attr-defined]
            prefix = int(self.num_prefix_tokens)  # type: ignore[attr-defined]
            extra.update(grid_size=grid, num_prefix_tokens=prefix)
        for label, block in self.attention_blocks():
            attn = getattr(block, "attn", None)
            if not isinstance(attn, nn.Module) or not self.family.accepts(attn):
                raise TypeError(
                    f"{type(self).__name__} needs {self.needs} at {label}.attn, got {type(attn).__name__}"
                )
            block.attn = self.family.convert(
                attn, cls, normalizer=self.normalizer, gaug_init=self.gaug_init, **extra
            )
        if extra:
            attach_grid_sync(self)  # type: ignore[arg-type]


class PRRHeadMixin(LocAtModelMixin):
    """``forward_head`` with PRR (when ``self.prr`` is set) on ``(B, N, C)`` tokens before the base
    model's pooling and head (ViT, Eva).

    With class-token pooling only token 0 of PRR's output is used, so only that row is computed.
    """

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """``x: (B, N, C)`` from ``forward_features`` -> PRR (if on) -> the base model's pooling and head."""
        if self.prr is not None:
            pool = getattr(self, "global_pool", None)
            token_pool = pool == "token" and getattr(self, "attn_pool", None) is None
            x = self.prr(x, rows=1 if token_pool else None)
        return super().forward_head(x, pre_logits=pre_logits)  # type: ignore[misc]


def keep_fresh_gaug(filter_fn: Callable[..., Any]) -> Callable[..., Any]:
    """``filter_fn(state_dict, model)`` of a LocAt variant, extended to plain checkpoints: when the
    filtered checkpoint has no GAug weight at all (a timm ViT / Eva / Swin checkpoint), the model's own
    ``gaug`` tensors (started as its ``gaug_init`` says) fill their keys, so timm's strict load passes
    and the heads keep their start. A checkpoint with GAug weights (the official ones) is taken as it
    is; where it has no gate for a model built with the identity start's gate, the gate is 1 there,
    so the checkpoint's heads act as trained."""

    def filtered(state_dict: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
        out = filter_fn(state_dict, model)
        own = {k: v for k, v in model.state_dict().items() if ".gaug." in k}
        if not any(".gaug." in key for key in out):
            return {**out, **own}
        gates = {k: torch.ones_like(v) for k, v in own.items() if k.endswith(".gaug.gate") and k not in out}
        return {**out, **gates}

    return filtered


def release_cfg(**kwargs: Any) -> dict[str, Any]:
    """The pretrained cfg fields the official release's models share (timm's defaults: ImageNet-1k head,
    224 px, crop 0.9, bicubic, fixed input size; the paper); ``kwargs`` add to or override them."""
    return {
        "url": "",
        "num_classes": 1000,
        "input_size": (3, 224, 224),
        "pool_size": None,
        "crop_pct": 0.9,
        "interpolation": "bicubic",
        "fixed_input_size": True,
        "first_conv": "patch_embed.proj",
        "classifier": "head",
        "paper_ids": "arXiv:2603.04892",
        "paper_name": "Locality-Attending Vision Transformer",
        "origin_url": "https://github.com/sinahmr/LocAtViT",
        **kwargs,
    }


def weight_source(variant: str, pretrained_cfg: Any, overlay: dict[str, Any]) -> bool:
    """Whether the pretrained cfg timm will resolve names any weights (hub id, url, file, state dict)."""
    cfg = resolve_pretrained_cfg(variant, pretrained_cfg=pretrained_cfg, pretrained_cfg_overlay=overlay)
    return bool(cfg.has_weights or cfg.state_dict is not None)


def build_variant(
    cls: type[M],
    variant: str,
    pretrained: bool,
    kwargs: dict[str, Any],
    *,
    arch: Mapping[str, Any],
    filter_fn: Callable[..., Any],
    feature_cfg: Mapping[str, Any],
    published: Collection[str] = (),
) -> M:
    """``cls`` built by timm's ``build_model_with_cfg`` from the variant's ``arch`` arguments under the
    user's ``kwargs``. ``feature_cfg["out_indices"]`` is the default of ``kwargs["out_indices"]``
    (``None``: every stage of ``depths``).

    ``pretrained=True`` needs weights (a hub id, url or a local ``pretrained_cfg_overlay=dict(file=...)``,
    else ``ValueError`` naming the ``published`` variants); a local file is taken to have the head asked
    for (else timm would drop it). The official release's ``store_metrics`` argument is dropped.
    """
    kwargs = dict(arch, **kwargs)
    kwargs.pop("store_metrics", None)  # an official-release argument with no effect here
    overlay = dict(kwargs.pop("pretrained_cfg_overlay", None) or {})
    if pretrained and not weight_source(variant, kwargs.get("pretrained_cfg"), overlay):
        have = (
            f"no published weights (the official release publishes {', '.join(sorted(published))})"
            if published
            else "no weights vitattn knows of"
        )
        raise ValueError(
            f"{variant} has {have}; use pretrained=False, or give a local checkpoint with "
            "pretrained_cfg_overlay=dict(file='path/to/weights.safetensors')"
        )
    if overlay.get("file"):
        overlay.setdefault("num_classes", kwargs.get("num_classes", 1000))
    out_indices = feature_cfg["out_indices"]
    if out_indices is None:
        out_indices = tuple(range(len(kwargs["depths"])))
    features = dict(feature_cfg, out_indices=kwargs.pop("out_indices", out_indices))
    return build_model_with_cfg(
        cls,
        variant,
        pretrained,
        pretrained_cfg_overlay=overlay or None,
        pretrained_filter_fn=keep_fresh_gaug(filter_fn),
        feature_cfg=features,
        **kwargs,
    )


def register_variants(
    module: str,
    cls: type[M],
    archs: Mapping[str, Mapping[str, Any]],
    docs: Mapping[str, str],
    **options: Any,
) -> tuple[Callable[..., M], ...]:
    """One timm entrypoint per variant of ``docs`` (in its order): ``name(pretrained=False, **kwargs)``
    is :func:`build_variant` of ``cls`` with ``archs[name]`` and ``options`` (``filter_fn``,
    ``feature_cfg``, ``published``), has the docstring ``docs[name]`` and is a function of ``module``
    (whose ``default_cfgs`` timm reads), registered with timm's ``register_model``."""
    if module not in sys.modules:
        raise ValueError(f"register_variants needs an imported module, got {module!r}")

    def entrypoint(name: str) -> Callable[..., M]:
        def create(pretrained: bool = False, **kwargs: Any) -> M:
            return build_variant(cls, name, pretrained, kwargs, arch=archs[name], **options)

        create.__name__ = create.__qualname__ = name
        create.__module__, create.__doc__ = module, docs[name]
        return register_model(create)

    return tuple(entrypoint(name) for name in docs)
