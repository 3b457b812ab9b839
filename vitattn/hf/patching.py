""":func:`vitattn.patch` on transformers vision models: settings and GAug heads on the attention
modules, the ``vitattn`` attention implementation, PRR before the pooler / head, and a record in the
config so that a saved model can be rebuilt (:func:`vitattn.hf.from_pretrained`).

Nothing is replaced: each chosen attention module gets ``module.vitattn`` (an
:class:`~vitattn.hf.functions.HFAttentionSettings`: normalizer, backend, token layout) and, for LocAt,
``module.gaug`` (a :class:`~vitattn.layers.GaussianAugment`: state-dict keys ``...gaug.log_var.*``,
``...gaug.log_alpha.*``, the official names), and the model's attention implementation becomes
``"vitattn"``, which reads them. A forward pre-hook on the vision tower's embeddings sets the patch
grid of each input. The model's weight init starts the GAug heads
(:mod:`vitattn.hf.weight_init`), and its ``set_attn_implementation`` keeps the patch
(:class:`ImplementationSetter`: a vitattn name changes the normalizer only, another is refused).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from ..functional.normalize import Normalizer, resolve_normalizer
from ..layers import PRR, GaussianAugment
from ..layers.adaptive import patch_normalizer
from ..layers.kinds import HF_PATCH_ATTENTIONS
from ..layers.locat import GaugInit, check_gaug_init
from ..models.blocks import block_indices, chosen_blocks
from .functions import (
    ATTENTION_NAMES,
    PATCHED_NAME,
    SETTINGS_ATTR,
    HFAttentionSettings,
    is_vitattn_implementation,
    normalizer_of_name,
    register,
)
from .implementation import set_implementation
from .layout import HFLayout, attention_head_dim, hf_layout, query_weight
from .weight_init import GAUG_START_ATTR, install_gaug_init

__all__ = [
    "RECORD_KEY",
    "ImplementationSetter",
    "apply_record",
    "patch_layout",
    "patch_transformers",
    "vitattn_names",
]

RECORD_KEY = "vitattn"  # config attribute: what vitattn.patch did, saved with the config
_GRID_HOOK = "_vitattn_grid_hook"
_PRR_HOOK = "_vitattn_prr_hook"
_PRR_MODULE = "vitattn_prr"


class GridHook:
    """Forward pre-hook on the vision tower's embeddings: the patch grid of each ``pixel_values`` input
    goes to every GAug-patched attention module; a ViT-MAE keeping every patch (``mask_ratio`` 0)
    gets ``noise`` in position order, so its tokens stay in grid order. A ``RuntimeError`` when the
    tower's attention implementation is not vitattn's (set on the config directly), which would
    skip the GAug heads."""

    def __init__(self, layout: HFLayout) -> None:
        self.layout = layout

    def __call__(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        pixels = args[0] if args else kwargs.get("pixel_values")
        if not isinstance(pixels, torch.Tensor) or pixels.dim() != 4:
            return None
        grid = self.layout.grid(pixels.shape[-2:])
        gaug = False
        for attn in self.layout.attentions:
            settings: HFAttentionSettings | None = getattr(attn, SETTINGS_ATTR, None)
            if settings is not None and getattr(attn, "gaug", None) is not None:
                settings.grid_size = grid
                gaug = True
        implementation = getattr(self.layout.config, "_attn_implementation", None)
        if gaug and isinstance(implementation, str) and not is_vitattn_implementation(implementation):
            raise RuntimeError(
                f"{type(self.layout.model).__name__} has GAug heads (vitattn.patch attention='locat'), but "
                f"its attention implementation is {implementation!r}, which would skip them: set it back "
                f"with model.set_attn_implementation({PATCHED_NAME!r}) (or remove GAug first: "
                "vitattn.patch(model, 'softmax'))"
            )
        if (
            self.layout.family.model_type == "vit_mae"
            and kwargs.get("noise") is None
            and len(args) < 2
            and float(self.layout.config.mask_ratio) == 0.0
        ):
            n = grid[0] * grid[1]
            noise = torch.arange(n, device=pixels.device, dtype=torch.float32).expand(pixels.shape[0], -1)
            return args, {**kwargs, "noise": noise}
        return None


def _attach_grid_hook(layout: HFLayout) -> None:
    embeddings = layout.backbone.get_submodule("embeddings")
    handle = embeddings.__dict__.get(_GRID_HOOK)
    if handle is not None:
        handle.remove()
    handle = embeddings.register_forward_pre_hook(GridHook(layout), with_kwargs=True)
    embeddings.__dict__[_GRID_HOOK] = handle


class PRRHook:
    """Forward hook refining a module's output tokens with ``prr``: tokens, a tuple led by them, or a
    model output with ``last_hidden_state`` (a class, not a closure, so a patched model pickles)."""

    def __init__(self, prr: PRR) -> None:
        self.prr = prr

    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        if isinstance(output, torch.Tensor):
            return self.prr(output)
        if isinstance(output, tuple):
            return (self.prr(output[0]), *output[1:])
        output.last_hidden_state = self.prr(output.last_hidden_state)
        return output


def _attach_prr(layout: HFLayout) -> None:
    """PRR on the final tokens before the pooler / head: on the output of the final norm over all
    tokens (ViT, DeiT, DINOv2, ViT-MAE, SigLIP), or on the encoder's output for CLIP (whose
    ``post_layernorm`` sees only the pooled class token)."""
    backbone = layout.backbone
    if isinstance(getattr(backbone, _PRR_MODULE, None), PRR):
        return
    heads = layout.num_heads(layout.depth - 1)
    prr = PRR(int(layout.config.hidden_size), heads)
    setattr(backbone, _PRR_MODULE, prr)  # no parameters: nothing in the state dict
    if layout.family.model_type == "clip_vision_model":
        target = backbone.get_submodule("encoder")
    elif layout.final_norm is not None:
        target = layout.final_norm
    else:  # pragma: no cover - every supported family has a final norm
        raise TypeError(f"prr=True needs the final norm {layout.family.final_norm!r} of {layout.family.name}")
    target.__dict__[_PRR_HOOK] = target.register_forward_hook(PRRHook(prr))


def _check_all_patches(layout: HFLayout) -> None:
    if layout.family.model_type == "vit_mae" and float(layout.config.mask_ratio) > 0.0:
        raise ValueError(
            f"attention='locat' needs every patch as a token, but this ViT-MAE masks "
            f"mask_ratio={layout.config.mask_ratio} of them: set model.config.mask_ratio = 0.0 first "
            "(vitattn then keeps the patches in grid order)"
        )


def _patch_layer(
    layout: HFLayout, index: int, normalizer: Normalizer | None, gaug: bool | None, gaug_init: GaugInit
) -> None:
    """One attention module set up: its normalizer (``None``: kept, softmax for a module not patched
    before), and GAug heads kept / created (``gaug=True``) or removed (``False``; ``None``: as they are)."""
    attn = layout.attentions[index]
    settings: HFAttentionSettings = getattr(attn, SETTINGS_ATTR, None) or HFAttentionSettings()
    if normalizer is not None:
        settings.normalizer = normalizer
    if gaug is None:
        gaug = isinstance(getattr(attn, "gaug", None), GaussianAugment)
    if gaug:
        grid = layout.grid()
        settings.num_prefix_tokens = layout.num_prefix_tokens
        settings.initial_grid_size = settings.initial_grid_size or grid
        settings.grid_size = settings.grid_size or grid
        if not isinstance(getattr(attn, "gaug", None), GaussianAugment):
            weight, head_dim, count = query_weight(attn), attention_head_dim(attn), layout.num_heads(index)
            heads = GaussianAugment(head_dim, weight.device, weight.dtype, init=gaug_init, num_heads=count)
            attn.gaug = heads.train(attn.training)
            setattr(attn.gaug, GAUG_START_ATTR, gaug_init)  # the model's weight init starts it so again
    elif isinstance(getattr(attn, "gaug", None), nn.Module):
        del attn.gaug
    setattr(attn, SETTINGS_ATTR, settings)


def _write_record(layout: HFLayout, prr: bool) -> None:
    """``config.vitattn``: each patched layer's normalizer and GAug flag, and PRR (JSON-ready); a layer
    whose GAug heads have the identity start's gate says so (``"gate": true``, record version 2, which
    an older vitattn refuses rather than load without the gate)."""
    layers: dict[str, dict[str, Any]] = {}
    for i, attn in enumerate(layout.attentions):
        settings: HFAttentionSettings | None = getattr(attn, SETTINGS_ATTR, None)
        if settings is not None:
            gaug = getattr(attn, "gaug", None)
            layers[str(i)] = {"normalizer": settings.normalizer, "gaug": gaug is not None}
            if getattr(gaug, "gate", None) is not None:
                layers[str(i)]["gate"] = True
    config = getattr(layout.model, "config", layout.config)
    old = getattr(config, RECORD_KEY, None) or {}
    version = 2 if any(entry.get("gate") for entry in layers.values()) else 1
    keep_prr = bool(prr or old.get("prr", False))
    setattr(config, RECORD_KEY, {"version": version, "layers": layers, "prr": keep_prr})


def patch_transformers(
    model: nn.Module,
    attention: str | None = None,
    prr: bool = False,
    blocks: int | Iterable[int] | None = None,
    normalizer: Normalizer | None = None,
    gaug_init: GaugInit = "paper",
) -> nn.Module:
    """:func:`vitattn.patch` for a transformers vision model (arguments as there); returns ``model``.

    ``attention`` is ``None`` (each module keeps its GAug heads, or none), ``"softmax"``, ``"entmax15"``
    (no GAug: heads a module had are removed) or ``"locat"`` (GAug added or kept); ``normalizer=None``
    keeps each module's normalizer (softmax for one not patched before; ``"softmax"`` and
    ``"entmax15"`` set theirs), so calls compose: each changes only what it names. LocAt's heads read
    the query before scaling; the grid and prefix tokens (class token, DeiT's distillation token,
    DINOv2's registers; none for SigLIP) come from each input, so interpolated position encodings and
    other image sizes work. Raises ``TypeError`` for an unsupported model (naming the supported
    families), ``ValueError`` for bad arguments or a ViT-MAE that masks patches with ``"locat"``.
    """
    if attention is not None and attention not in HF_PATCH_ATTENTIONS:
        raise ValueError(
            f"attention must be one of {sorted(HF_PATCH_ATTENTIONS)} or None (keep), got {attention!r}"
        )
    gaug_init = check_gaug_init(gaug_init)
    layout = hf_layout(model)
    layer_normalizer = patch_normalizer(attention, normalizer, adaptive=False)
    patch_layout(layout, attention, prr, chosen_blocks(blocks, layout.depth), layer_normalizer, gaug_init)
    return model


def patch_layout(
    layout: HFLayout,
    attention: str | None,
    prr: bool,
    indices: Sequence[int],
    normalizer: Normalizer | None,
    gaug_init: GaugInit,
) -> None:
    """:func:`patch_transformers` on a model's layout, its arguments checked (``indices``: the blocks;
    ``normalizer``: resolved, the one ``attention`` implies or None, as
    :func:`~vitattn.layers.adaptive.patch_normalizer` gives it)."""
    gaug = None if attention is None else attention == "locat"
    if gaug:
        _check_all_patches(layout)
    register()
    for i in indices:
        _patch_layer(layout, i, normalizer, gaug, gaug_init)
    _finish(layout, prr)


def _finish(layout: HFLayout, prr: bool) -> None:
    """What a patch sets on the model once its modules are set up: the record in the config, the
    implementation setter, the grid hook (where a module has GAug heads), PRR, the GAug heads' weight
    init, and vitattn's attention implementation."""
    _write_record(layout, prr)
    _install_setter(layout.model)
    gaug = [name for name, a in zip(layout.attention_names, layout.attentions, strict=True) if _has_gaug(a)]
    if gaug:
        _attach_grid_hook(layout)
    if prr:
        _attach_prr(layout)
    if gaug:
        install_gaug_init(layout.model, gaug)
    set_implementation(layout.model, PATCHED_NAME)


def _has_gaug(attn: nn.Module) -> bool:
    return isinstance(getattr(attn, "gaug", None), GaussianAugment)


def _normalizer_layers(layout: HFLayout) -> dict[int, Normalizer]:
    """Layers whose patched normalizer is not softmax (and so what another implementation would drop)."""
    out: dict[int, Normalizer] = {}
    for i, attn in enumerate(layout.attentions):
        settings: HFAttentionSettings | None = getattr(attn, SETTINGS_ATTR, None)
        if settings is not None and settings.normalizer != "softmax":
            out[i] = settings.normalizer
    return out


def _tower_request(layout: HFLayout, requested: Any) -> Any:
    """The implementation ``set_attn_implementation(requested)`` gives the vision tower: a name, or a
    dict keyed by sub-config names (``""``: the config itself), read as transformers reads it (a
    sub-config it does not name keeps its own)."""
    current = getattr(layout.config, "_attn_implementation", None)
    root = getattr(layout.model, "config", None)
    value = requested
    if root is not None and root is not layout.config:
        # the path of sub-config names from the model's config down to the tower's
        queue: list[tuple[Any, list[str]]] = [(root, [])]
        path: list[str] | None = None
        while queue and path is None:
            config, keys = queue.pop(0)
            for key in getattr(config, "sub_configs", {}) or {}:
                sub = getattr(config, key, None)
                if sub is layout.config:
                    path = [*keys, key]
                    break
                if sub is not None:
                    queue.append((sub, [*keys, key]))
        for key in path or []:
            if not isinstance(value, dict):
                break
            value = value.get(key, current)
    if isinstance(value, dict):
        value = value.get("", current)
    return value


def vitattn_names(requested: Any) -> list[str]:
    """The ``vitattn_<normalizer>`` names in an ``attn_implementation`` value (a name or a dict of them)."""
    if isinstance(requested, dict):
        return [n for v in requested.values() for n in vitattn_names(v)]
    return [requested] if is_vitattn_implementation(requested) and requested != PATCHED_NAME else []


class ImplementationSetter:
    """``model.set_attn_implementation`` on a model patched by :func:`vitattn.patch`: the patch stays.

    - a vitattn name (``"vitattn_entmax15"``, ``vitattn.hf.attention_name(1.25)``, ...; registered
      here if needed) changes the normalizer of every layer and nothing else: GAug heads and PRR stay,
      and the record in the config follows, so a saved copy loads as the same model;
    - ``"vitattn"`` uses each layer's patch as it is;
    - any other name (``"eager"``, ``"sdpa"``, ...) computes plain softmax without vitattn: it is
      refused with a ``ValueError`` while a layer has GAug heads or a normalizer other than softmax
      (remove them first with ``vitattn.patch(model, "softmax")``), allowed otherwise.

    A dict of sub-config names (transformers' form) is read for the vision tower the same way.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(self, attn_implementation: Any, *args: Any, **kwargs: Any) -> Any:
        model = self.model
        register(*vitattn_names(attn_implementation))  # unknown vitattn_* names: a clear ValueError
        layout = hf_layout(model)
        name = _tower_request(layout, attn_implementation)
        normalizer = normalizer_of_name(name) if isinstance(name, str) else None
        if not is_vitattn_implementation(name):
            self._refuse_if_patched(layout, name)
        result = type(model).set_attn_implementation(model, attn_implementation, *args, **kwargs)  # type: ignore[attr-defined]
        if normalizer is not None:
            for attn in layout.attentions:
                settings: HFAttentionSettings = getattr(attn, SETTINGS_ATTR, None) or HFAttentionSettings()
                settings.normalizer = normalizer
                setattr(attn, SETTINGS_ATTR, settings)
            _write_record(layout, prr=False)
        return result

    @staticmethod
    def _refuse_if_patched(layout: HFLayout, name: object) -> None:
        gaug = [i for i, a in enumerate(layout.attentions) if _has_gaug(a)]
        normalizers = _normalizer_layers(layout)
        if not gaug and not normalizers:
            return
        what = []
        if gaug:
            what.append(f"GAug heads on layers {gaug}")
        by_normalizer: dict[str, list[int]] = {}
        for i, n in normalizers.items():
            by_normalizer.setdefault(repr(n), []).append(i)
        what.extend(f"normalizer {n} on layers {layers}" for n, layers in by_normalizer.items())
        names = ", ".join(repr(n) for n in (PATCHED_NAME, *ATTENTION_NAMES.values()))
        raise ValueError(
            f"attn_implementation={name!r} would compute plain softmax attention without vitattn's patch "
            f"of {type(layout.model).__name__} ({'; '.join(what)}), and a saved copy would load with the "
            f"patch again. To change the normalizer only, give a vitattn name ({names}, or "
            "vitattn.hf.attention_name(alpha)); to leave vitattn, remove the patch first: "
            "vitattn.patch(model, 'softmax') (no GAug, softmax everywhere)"
        )


def _install_setter(model: nn.Module) -> None:
    if callable(getattr(type(model), "set_attn_implementation", None)) and not isinstance(
        model.__dict__.get("set_attn_implementation"), ImplementationSetter
    ):
        model.__dict__["set_attn_implementation"] = ImplementationSetter(model)


def apply_record(model: nn.Module, record: dict[str, Any], gaug_init: GaugInit = "paper") -> nn.Module:
    """Rebuild what :func:`patch_transformers` did from its ``config.vitattn`` record (fresh GAug
    heads, gated where the record says so: load their weights after). Raises ``ValueError`` for a
    record this version cannot read."""
    if (
        not isinstance(record, dict)
        or record.get("version") not in (1, 2)
        or not isinstance(record.get("layers"), dict)
    ):
        raise ValueError(f"config.{RECORD_KEY} is not a vitattn patch record (version 1 or 2): {record!r}")
    layout = hf_layout(model)
    if any(entry.get("gaug") for entry in record["layers"].values()):
        _check_all_patches(layout)
    register()
    for key, entry in record["layers"].items():
        index = block_indices([int(key)], layout.depth, name="layers")[0]
        start: GaugInit = "identity" if entry.get("gate") else gaug_init
        _patch_layer(layout, index, resolve_normalizer(entry["normalizer"]), bool(entry.get("gaug")), start)
    _finish(layout, bool(record.get("prr", False)))
    return model
