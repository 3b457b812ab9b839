"""The explicit attention path of the vitattn layers: weights through ``attn_drop``, for timm's tools.

With timm's fused attention switched off (``timm.layers.set_fused_attn(False)`` or
``TIMM_FUSED_ATTN=0`` before the model is built), timm's own layers compute
``attn_drop(softmax(scores)) @ v`` step by step, and ``timm.utils.AttentionExtract`` reads the weights
there: as the ``*attn_drop`` modules' outputs (``method="hook"``) or as the ``*attn.softmax`` graph
nodes (``method="fx"``). The vitattn layers built in that state do the same:

- the weights come from one call of :func:`vitattn.functional.attention` (any normalizer, bias, mask,
  window and backend; analysis captures still see it), made by a function named after the normalizer's
  FX node name (its :class:`~vitattn.functional.normalize.NormalizerSpec`'s ``fx_name``), which FX
  records as one node: ``softmax``, ``entmax15``, ``sparsemax``, another registered normalizer's name,
  or ``entmax`` (alpha-entmax, a learned tensor of alphas included);
- they pass through the layer's ``attn_drop`` module, and the output is ``weights @ v``.

So ``AttentionExtract(model, method="fx")`` finds softmax layers (LocAt included) under its default
``*attn.softmax``; for the others pass their names, e.g. ``names=["*attn.entmax15"]`` or
``["*attn.softmax", "*attn.entmax*", "*attn.sparsemax"]`` for any of them:
:func:`attention_extract_names` gives the exact list for a model. With fused attention on (timm's
default), the layers never come here: :func:`use_explicit_attention` switches a built model over.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
from torch import nn

from ..functional import GaussianBias, WindowMask, attention
from ..functional.normalize import ALPHA_FX_NAME, AttentionNormalizer, normalizer_table
from .call_options import layer_call_options, layer_mask

__all__ = [
    "WEIGHT_NODE_NAMES",
    "attention_extract_names",
    "explicit_attention",
    "use_explicit_attention",
    "weight_leaf",
    "weight_node_name",
]

#: The FX node name of the weights, per registered normalizer (a live view of the registry's
#: ``fx_name``); alpha-entmax with any other float alpha, or with learned alphas: ``entmax``
WEIGHT_NODE_NAMES: Mapping[str, str] = normalizer_table("fx_name")


def weight_node_name(normalizer: AttentionNormalizer | str) -> str:
    """The FX node name (the last part of ``blocks.0.attn.<name>``) of a layer's attention weights: a
    registered normalizer's ``fx_name``, else (a float alpha, learned alphas, ``"adaptive"``) ``entmax``."""
    if isinstance(normalizer, str) and normalizer in WEIGHT_NODE_NAMES:
        return WEIGHT_NODE_NAMES[normalizer]
    return ALPHA_FX_NAME


def _attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every attention module timm's ``AttentionExtract`` can read: one with a
    ``fused_attn`` flag and an ``attn_drop`` module (timm's attention layers and vitattn's)."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(getattr(m, "fused_attn", None), bool)
        and isinstance(getattr(m, "attn_drop", None), nn.Module)
    ]


def use_explicit_attention(model: nn.Module, explicit: bool = True) -> nn.Module:
    """Switch every attention module of ``model`` (timm's and vitattn's: a ``fused_attn`` flag and an
    ``attn_drop`` module) to the explicit path (``fused_attn = False``), where the weights exist for
    ``timm.utils.AttentionExtract``; ``explicit=False`` switches back to the fused call. Outputs do not
    change. Returns ``model``."""
    for _, module in _attention_modules(model):
        module.fused_attn = not explicit  # type: ignore[assignment]  # a plain bool attribute, as timm's
    return model


def attention_extract_names(model: nn.Module, method: str = "fx") -> list[str]:
    """The ``names=`` of ``timm.utils.AttentionExtract(model, names=..., method=method)`` that select every
    attention module's weights: FX node names (``method="fx"``: ``blocks.0.attn.softmax``, or
    ``.entmax15`` / ``.sparsemax`` / ``.entmax`` after the module's normalizer, :func:`weight_node_name`)
    or module names (``method="hook"``: ``blocks.0.attn.attn_drop``), in module order.

    Raises ``ValueError`` when ``model`` has no attention module with an explicit path, or when some
    compute their attention fused (timm's default): their weights never exist as a node or pass
    through ``attn_drop``; the message names them and the fix (:func:`use_explicit_attention`, or
    ``timm.layers.set_fused_attn(False)`` before the model is built).
    """
    if method not in ("fx", "hook"):
        raise ValueError(f"method must be 'fx' or 'hook' (AttentionExtract's), got {method!r}")
    modules = _attention_modules(model)
    if not modules:
        raise ValueError(
            f"{type(model).__name__} has no attention module that timm's AttentionExtract can read "
            "(one with a fused_attn flag and an attn_drop module, as timm's and vitattn's layers)"
        )
    fused = [name for name, m in modules if m.fused_attn]
    if fused:
        raise ValueError(
            f"{len(fused)} attention module(s) compute their attention fused ({', '.join(fused[:3])}"
            f"{', ...' if len(fused) > 3 else ''}), so their weights are never formed: call "
            "vitattn.layers.use_explicit_attention(model) first (or "
            "timm.layers.set_fused_attn(False) before building / patching the model)"
        )
    if method == "hook":
        return [f"{name}.attn_drop" for name, _ in modules]
    return [f"{name}.{weight_node_name(getattr(m, 'normalizer', 'softmax'))}" for name, m in modules]


def _weights(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    bias: torch.Tensor | GaussianBias | None,
    normalizer: AttentionNormalizer,
    scale: float,
    backend: str,
    window: WindowMask | None,
) -> torch.Tensor:
    """``(B, H, Nq, Nk)`` attention weights (before dropout) from one :func:`attention` call; the mask
    with timm's semantics and the layer's window folded in (:func:`layer_mask`, inside the FX leaf:
    it branches on the flags and the token count).

    On the meta device the result is shape-only, as the layers' fused call.
    """
    if q.device.type == "meta":
        return q.new_empty(*q.shape[:-1], k.shape[-2])
    mask = layer_mask(q.shape[2], attn_mask, is_causal, q.device, window)
    _, weights = attention(
        q, k, v, normalizer=normalizer, scale=scale, mask=mask, bias=bias, return_weights=True,
        backend=backend,
    )  # fmt: skip
    return weights


_LEAVES: dict[str, Callable[..., torch.Tensor]] = {}


def _make_leaf(fx_name: str) -> Callable[..., torch.Tensor]:
    def leaf(*args: Any) -> torch.Tensor:  # _weights' arguments
        return _weights(*args)

    leaf.__name__ = leaf.__qualname__ = fx_name  # FX names a call after its function
    leaf.__doc__ = f"Attention weights ``(B, H, Nq, Nk)`` of a layer; FX names the call ``{fx_name}``."
    return leaf


def weight_leaf(fx_name: str) -> Callable[..., torch.Tensor]:
    """The function computing a layer's weights (:func:`_weights`' arguments) under the name FX gives
    its node: one per FX node name of the normalizer registry, made on first use."""
    leaf = _LEAVES.get(fx_name)
    if leaf is None:
        leaf = _LEAVES[fx_name] = _make_leaf(fx_name)
    return leaf


def _call_leaf(leaf: Callable[..., torch.Tensor], *args: object) -> torch.Tensor:
    """``leaf(*args)``, recorded as one graph node (a leaf: FX does not trace into it) when a tracer runs
    (torch.fx's, torchvision's, timm's; ``q = args[0]`` is then a ``Proxy``): what ``torch.fx.wrap`` does
    for a module-level function, here for leaves made from the registry."""
    q = args[0]
    if isinstance(q, torch.fx.Proxy):
        proxy = q.tracer.create_proxy("call_function", leaf, args, {})
        proxy.node.meta["is_wrapped"] = True
        return cast(torch.Tensor, proxy)
    return leaf(*args)


for _name in (*WEIGHT_NODE_NAMES.values(), ALPHA_FX_NAME):  # the built-in leaves exist before any trace
    weight_leaf(_name)


def explicit_attention(
    module: nn.Module,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    bias: torch.Tensor | GaussianBias | None,
) -> torch.Tensor:
    """``attn_drop(weights) @ v: (B, H, Nq, Dv)`` for a vitattn layer ``module`` (its normalizer and
    window, :func:`layer_call_options`, ``scale``, ``backend`` and ``attn_drop``); ``attn_mask`` and
    ``is_causal`` as timm's.

    Which leaf runs is decided from the layer's own ``normalizer`` attribute (a name or float), never
    from a tensor, so FX can trace the choice: learned alphas (``"adaptive"``) reach the ``entmax``
    leaf as an argument, and the window and mask are folded inside the leaf.
    """
    normalizer, window = layer_call_options(module)
    scale, backend = float(module.scale), str(module.backend)  # type: ignore[arg-type]
    leaf = weight_leaf(weight_node_name(getattr(module, "normalizer", normalizer)))
    weights = _call_leaf(leaf, q, k, v, attn_mask, is_causal, bias, normalizer, scale, backend, window)
    drop: nn.Module = module.get_submodule("attn_drop")
    return drop(weights).to(v.dtype) @ v
