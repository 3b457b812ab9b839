"""Where things are in a Hugging Face transformers vision model: the vision tower, its encoder layers,
the attention module of each (the one that calls transformers' attention interface), the final norm,
and the token layout (patch grid, prefix tokens); and how its attention runs: :class:`HFLayout`, the
transformers implementation of :class:`vitattn.adapter.ModelLayout`.

Read by duck typing (attribute names and ``config.model_type``), so nothing here imports transformers;
it finds the same things in transformers 4.5x (``encoder.layer[i].attention.attention`` with
``query`` / ``key`` / ``value``) and 5.x (``layers[i].attention`` with ``q_proj`` / ``k_proj`` /
``v_proj``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from ..functional import GaussianBias, grid_pair
from ..functional.normalize import AttentionNormalizer
from ..models.blocks import module_items
from .functions import RULE_ATTR, SETTINGS_ATTR, gaug_bias
from .implementation import vitattn_implementation

__all__ = [
    "FAMILIES",
    "HFFamily",
    "HFLayout",
    "all_patch_tokens",
    "backbone_kwargs",
    "hf_layout",
    "prediction",
    "run_backbone",
    "supported_families",
]


@dataclass(frozen=True)
class HFFamily:
    """One supported family: the vision tower's ``config.model_type``, whether it has a class token,
    the attribute name of its final norm, and its prefix tokens: ``fixed_prefix`` plus the config's
    ``register_attr`` when it has one (DINOv2's registers)."""

    name: str
    model_type: str
    class_token: bool
    final_norm: str
    fixed_prefix: int
    register_attr: str | None = None

    def prefix(self, config: Any) -> int:
        """Prefix tokens (class, distillation and register tokens) of a tower with this config."""
        registers = int(getattr(config, self.register_attr, 0) or 0) if self.register_attr else 0
        return self.fixed_prefix + registers


FAMILIES = (
    HFFamily("ViT", "vit", True, "layernorm", 1),
    HFFamily("DeiT", "deit", True, "layernorm", 2),  # class + distillation token
    HFFamily("DINOv2", "dinov2", True, "layernorm", 1),
    HFFamily("DINOv2 with registers", "dinov2_with_registers", True, "layernorm", 1, "num_register_tokens"),
    HFFamily("ViT-MAE", "vit_mae", True, "layernorm", 1),
    HFFamily("CLIP vision", "clip_vision_model", True, "post_layernorm", 1),
    HFFamily("SigLIP vision", "siglip_vision_model", False, "post_layernorm", 0),
)
_BY_TYPE = {f.model_type: f for f in FAMILIES}
_LAYER_LISTS = ("encoder.layer", "encoder.layers", "layers", "layer")
_PROJECTIONS = (("q_proj", "k_proj", "v_proj"), ("query", "key", "value"))


def supported_families() -> str:
    """The supported families as text, for error messages: ``ViT ('vit'), DeiT ('deit'), ...``."""
    return ", ".join(f"{f.name} (model_type {f.model_type!r})" for f in FAMILIES)


def _layer_list(backbone: nn.Module) -> tuple[str, nn.ModuleList] | None:
    for path in _LAYER_LISTS:
        try:
            layers = backbone.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(layers, nn.ModuleList) and len(layers) > 0:
            return path, layers
    return None


def _attention_of(layer: nn.Module) -> tuple[str, nn.Module] | None:
    """The submodule of an encoder layer holding the q, k, v projections (it calls the interface)."""
    for name, module in layer.named_modules():
        if any(all(isinstance(getattr(module, a, None), nn.Linear) for a in names) for names in _PROJECTIONS):
            return name, module
    return None


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


@dataclass
class HFLayout:
    """The parts of a transformers vision model that vitattn uses.

    ``backbone`` is the vision tower (``model`` itself, ``model.vit``, ``model.vision_model``, ...),
    ``blocks[i]`` its encoder layers, ``attentions[i]`` the module of layer ``i`` that transformers'
    attention interface receives, ``final_norm`` the norm after the last layer (CLIP's
    ``post_layernorm`` normalizes only the pooled class token in the model itself).
    ``*_names`` are qualified names in ``model``. The methods are :class:`~vitattn.adapter.ModelLayout`'s.
    """

    family: HFFamily
    model: nn.Module
    backbone: nn.Module
    backbone_name: str
    blocks: list[nn.Module]
    block_names: list[str]
    attentions: list[nn.Module]
    attention_names: list[str]
    final_norm: nn.Module | None

    @property
    def config(self) -> Any:
        """The vision tower's config."""
        return self.backbone.config

    @property
    def depth(self) -> int:
        return len(self.blocks)

    @property
    def windowed(self) -> bool:
        return False  # every supported family attends over all tokens

    @property
    def num_prefix_tokens(self) -> int:
        """Tokens before the patches: class token, DeiT's distillation token, DINOv2's registers."""
        return int(self.family.prefix(self.config))

    @property
    def has_class_token(self) -> bool:
        return self.family.class_token

    @property
    def num_class_tokens(self) -> int:
        return int(self.family.class_token)  # token 0 (DeiT's distillation token is not one)

    @property
    def patch_size(self) -> tuple[int, int]:
        return grid_pair("patch_size", _pair(self.config.patch_size))

    @property
    def image_size(self) -> tuple[int, int]:
        """The input size the model was built for (``config.image_size``)."""
        return grid_pair("image_size", _pair(self.config.image_size))

    def grid(self, image_size: Sequence[int] | None = None) -> tuple[int, int]:
        """Patch grid ``(gh, gw)`` of an ``image_size = (H, W)`` input (default: the built size)."""
        h, w = self.image_size if image_size is None else (int(image_size[0]), int(image_size[1]))
        ph, pw = self.patch_size
        return h // ph, w // pw

    def num_tokens(self, image_size: Sequence[int] | None = None) -> int:
        gh, gw = self.grid(image_size)
        return self.num_prefix_tokens + gh * gw

    def num_heads(self, index: int) -> int:
        return attention_heads(self.attentions[index])

    def in_channels(self) -> int:
        return int(getattr(self.config, "num_channels", 3))

    def forward(self, images: torch.Tensor) -> Any:
        """The vision tower on ``images`` (:func:`run_backbone`)."""
        return run_backbone(self, images)

    def image_calls(self) -> AbstractContextManager[None]:
        """Within the block ``model(images)`` runs on ``pixel_values=images`` with every patch a token
        (the keyword arguments its forward takes) and returns its prediction tensor (:func:`prediction`)."""
        return _image_calls(self)

    def reading_maps(self) -> AbstractContextManager[None]:
        return vitattn_implementation(self.model)

    def normalizer(self, index: int) -> AttentionNormalizer:
        """The one :func:`vitattn.patch` set, else softmax."""
        return getattr(getattr(self.attentions[index], SETTINGS_ATTR, None), "normalizer", "softmax")

    def scale(self, index: int) -> float:
        attn = self.attentions[index]
        for name in ("scaling", "scale"):
            value = getattr(attn, name, None)
            if isinstance(value, (int, float)):
                return float(value)
        return float(attention_head_dim(attn) ** -0.5)

    def bias(self, index: int, q: torch.Tensor) -> torch.Tensor | GaussianBias | None:
        """GAug's bias of a LocAt-patched module (:func:`vitattn.hf.functions.gaug_bias`), else None."""
        return gaug_bias(self.attentions[index], q)

    def dropout(self, index: int) -> float:
        """The module's ``attention_dropout`` / ``dropout_prob`` / ``dropout`` rate while training."""
        attn = self.attentions[index]
        if attn.training:
            for name in ("attention_dropout", "dropout_prob", "dropout"):
                value = getattr(attn, name, None)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    return float(value)
        return 0.0

    def check_intercept(self, index: int) -> None:
        """Nothing to refuse: every supported module hands q, k, v to the attention interface."""

    @contextmanager
    def intercept(
        self, indices: Sequence[int], rule: Callable[..., torch.Tensor], *, need_qk: bool = True
    ) -> Iterator[None]:
        """The rule (an :data:`~vitattn.adapter.AttentionRule`) rides on each chosen module, which
        vitattn's ``"vitattn"`` implementation (in force for the block) calls in place of the
        attention; q, k there are always computed (``need_qk`` has no effect)."""
        chosen = [(i, self.attentions[i]) for i in indices]
        try:
            for i, attn in chosen:

                def hf_rule(
                    module: nn.Module,
                    q: torch.Tensor,
                    k: torch.Tensor,
                    v: torch.Tensor,
                    scaling: Any,
                    _i: int = i,
                ) -> torch.Tensor:
                    return rule(_i, module, q, k, v)

                attn.__dict__[RULE_ATTR] = hf_rule
            with vitattn_implementation(self.model):
                yield
        finally:
            for _, attn in chosen:
                attn.__dict__.pop(RULE_ATTR, None)


def _pair(value: Any) -> tuple[int, int]:
    if isinstance(value, (tuple, list)):
        return int(value[0]), int(value[-1])
    return int(value), int(value)


def attention_heads(attn: nn.Module) -> int:
    """Heads of a transformers attention module (``num_attention_heads`` or ``num_heads``)."""
    for name in ("num_attention_heads", "num_heads"):
        value = getattr(attn, name, None)
        if isinstance(value, int):
            return value
    raise TypeError(f"{type(attn).__name__} has neither num_attention_heads nor num_heads")


def query_weight(attn: nn.Module) -> torch.Tensor:
    """The weight of an attention module's query projection (``q_proj`` or ``query``)."""
    for name in ("q_proj", "query"):
        layer = getattr(attn, name, None)
        if isinstance(layer, nn.Linear):
            return layer.weight
    raise TypeError(f"{type(attn).__name__} has no q_proj / query linear")  # pragma: no cover


def attention_head_dim(attn: nn.Module) -> int:
    """Head dim of a transformers attention module (``head_dim`` or ``attention_head_size``)."""
    for name in ("head_dim", "attention_head_size"):
        value = getattr(attn, name, None)
        if isinstance(value, int):
            return value
    raise TypeError(f"{type(attn).__name__} has neither head_dim nor attention_head_size")


def hf_layout(model: nn.Module) -> HFLayout:
    """The :class:`HFLayout` of a transformers vision model (or a model holding one, e.g. CLIP).

    Raises ``TypeError`` naming the model's class and the supported families when no vision tower of
    a supported family is found, or when its layers have no attention with q, k, v projections.
    """
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        family = _BY_TYPE.get(getattr(config, "model_type", None))  # type: ignore[arg-type]
        if family is None or not isinstance(getattr(module, "embeddings", None), nn.Module):
            continue
        found = _layer_list(module)
        if found is None:
            continue
        path, layer_list = found
        layers = module_items(layer_list)
        attentions, attention_names = [], []
        for i, layer in enumerate(layers):
            attn = _attention_of(layer)
            if attn is None:
                raise TypeError(
                    f"{type(model).__name__}: layer {i} ({type(layer).__name__}) has no attention module "
                    "with q / k / v projections (q_proj, k_proj, v_proj or query, key, value)"
                )
            attention_names.append(_join(name, path, str(i), attn[0]))
            attentions.append(attn[1])
        norm = getattr(module, family.final_norm, None)
        return HFLayout(
            family=family,
            model=model,
            backbone=module,
            backbone_name=name,
            blocks=layers,
            block_names=[_join(name, path, str(i)) for i in range(len(layers))],
            attentions=attentions,
            attention_names=attention_names,
            final_norm=norm if isinstance(norm, nn.Module) else None,
        )
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    raise TypeError(
        f"{type(model).__name__} (model_type {kind!r}) is not a transformers vision model vitattn supports; "
        f"supported vision towers: {supported_families()}"
    )


def backbone_kwargs(
    layout: HFLayout, images: torch.Tensor, callee: nn.Module | None = None
) -> dict[str, Any]:
    """Keyword arguments for the vision tower (or ``callee``, a model holding it) on ``images (B, C, H,
    W)``, so every patch is a token in grid order: ``interpolate_pos_encoding=True`` when the size
    differs from the built one (where the forward takes it; DINOv2 always interpolates), ViT-MAE's
    ``noise`` in position order (with :func:`all_patch_tokens`, which keeps every patch, its shuffle is
    then the identity). Only arguments the forward takes."""
    forward = (layout.backbone if callee is None else callee).forward
    params = inspect.signature(forward).parameters
    kwargs: dict[str, Any] = {}
    if "interpolate_pos_encoding" in params and tuple(images.shape[-2:]) != layout.image_size:
        kwargs["interpolate_pos_encoding"] = True
    if layout.family.model_type == "vit_mae" and "noise" in params:
        gh, gw = layout.grid(images.shape[-2:])
        kwargs["noise"] = torch.arange(gh * gw, device=images.device, dtype=torch.float32).expand(
            images.shape[0], -1
        )
    return kwargs


@contextmanager
def all_patch_tokens(layout: HFLayout) -> Iterator[None]:
    """Within the block, a ViT-MAE keeps every patch (``config.mask_ratio = 0``); others are as they are."""
    if layout.family.model_type != "vit_mae":
        yield
        return
    config = layout.config
    before = config.mask_ratio
    config.mask_ratio = 0.0
    try:
        yield
    finally:
        config.mask_ratio = before


def run_backbone(layout: HFLayout, images: torch.Tensor, **kwargs: Any) -> Any:
    """The vision tower's output on ``images (B, C, H, W)``, every patch a token in grid order
    (:func:`backbone_kwargs`, :func:`all_patch_tokens`); ``kwargs`` go to the tower too."""
    with all_patch_tokens(layout):
        call = cast(Callable[..., Any], layout.backbone)
        return call(pixel_values=images, **backbone_kwargs(layout, images), **kwargs)


def prediction(output: Any) -> Any:
    """A transformers model output's prediction tensor: ``logits``, ``image_embeds``, ``pooler_output``
    or ``last_hidden_state``, the first it has (a tensor stays as it is)."""
    if isinstance(output, torch.Tensor):
        return output
    for name in ("logits", "image_embeds", "pooler_output", "last_hidden_state"):
        value = getattr(output, name, None)
        if isinstance(value, torch.Tensor):
            return value
    return output


@contextmanager
def _image_calls(layout: HFLayout) -> Iterator[None]:
    """:meth:`HFLayout.image_calls`: a forward pre-hook and a forward hook on the model."""

    def pre(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], Any]:
        if not args:
            return args, kwargs
        images = args[0]
        extra = backbone_kwargs(layout, images, callee=module)
        return (), {"pixel_values": images, **extra, **kwargs}

    def post(module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        return prediction(output)

    model = layout.model
    handles = [
        model.register_forward_pre_hook(pre, with_kwargs=True),
        model.register_forward_hook(post, with_kwargs=True),
    ]
    try:
        with all_patch_tokens(layout):
            yield
    finally:
        for handle in handles:
            handle.remove()
