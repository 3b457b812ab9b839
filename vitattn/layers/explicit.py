"""The explicit attention path of the vitattn layers: weights through ``attn_drop``, for timm's tools.

With timm's fused attention switched off (``timm.layers.set_fused_attn(False)`` or
``TIMM_FUSED_ATTN=0`` before the model is built), timm's own layers compute
``attn_drop(softmax(scores)) @ v`` step by step, and ``timm.utils.AttentionExtract`` reads the weights
there: as the ``*attn_drop`` modules' outputs (``method="hook"``) or as the ``*attn.softmax`` graph
nodes (``method="fx"``). The vitattn layers built in that state do the same:

- the weights come from one call of :func:`vitattn.functional.attention` (any normalizer, bias, mask,
  window and backend; analysis captures still see it), made by a function named after the normalizer,
  which FX records as one node: ``softmax``, ``entmax15``, ``sparsemax`` or ``entmax`` (alpha-entmax,
  a learned tensor of alphas included);
- they pass through the layer's ``attn_drop`` module, and the output is ``weights @ v``.

So ``AttentionExtract(model, method="fx")`` finds softmax layers (LocAt included) under its default
``*attn.softmax``; for the others pass their names, e.g. ``names=["*attn.entmax15"]`` or
``["*attn.softmax", "*attn.entmax*", "*attn.sparsemax"]`` for any of them:
:func:`attention_extract_names` gives the exact list for a model. With fused attention on (timm's
default), the layers never come here: :func:`use_explicit_attention` switches a built model over.
"""

from __future__ import annotations

import torch
from timm.layers import register_notrace_function
from torch import nn

from ..functional import GaussianBias, WindowMask, attention
from ..functional.normalize import AttentionNormalizer, Normalizer

__all__ = [
    "WEIGHT_NODE_NAMES",
    "attention_extract_names",
    "explicit_attention",
    "layer_call_options",
    "layer_mask",
    "resolve_attn_mask",
    "use_explicit_attention",
    "weight_node_name",
]

#: The FX node name of the weights, per normalizer (alpha-entmax with any other float alpha: ``entmax``)
WEIGHT_NODE_NAMES = {"softmax": "softmax", "entmax15": "entmax15", "sparsemax": "sparsemax"}


def weight_node_name(normalizer: Normalizer | str) -> str:
    """The FX node name (the last part of ``blocks.0.attn.<name>``) of a layer's attention weights."""
    return WEIGHT_NODE_NAMES.get(normalizer, "entmax") if isinstance(normalizer, str) else "entmax"


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


def resolve_attn_mask(
    n: int, attn_mask: torch.Tensor | None, is_causal: bool, device: torch.device
) -> torch.Tensor | None:
    """The mask handed to :func:`vitattn.functional.attention`, with timm's semantics.

    ``attn_mask`` is a boolean keep-mask (``True`` = attend) or an additive float mask broadcastable
    to ``(B, H, N, N)``; ``is_causal=True`` takes precedence and gives a lower-triangular keep-mask.
    """
    if is_causal:
        return torch.ones(n, n, dtype=torch.bool, device=device).tril()
    return attn_mask


def layer_call_options(module: nn.Module) -> tuple[AttentionNormalizer, WindowMask | None]:
    """A vitattn layer's normalizer (its ``attention_normalizer()``: learned alphas included, else its
    ``normalizer``) and neighbourhood window (its ``attention_window()``, else none)."""
    read_normalizer = getattr(module, "attention_normalizer", None)
    normalizer = read_normalizer() if callable(read_normalizer) else module.normalizer
    read_window = getattr(module, "attention_window", None)
    return normalizer, (read_window() if callable(read_window) else None)  # type: ignore[return-value]


def layer_mask(
    n: int,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    device: torch.device,
    window: WindowMask | None = None,
) -> torch.Tensor | WindowMask | None:
    """:func:`resolve_attn_mask` and a layer's neighbourhood ``window`` as the one mask of the call: the
    window itself when there is no other mask, else both folded into one dense mask of the other's kind
    (a bool keep-mask ``&`` the window's, or an additive mask with ``-inf`` outside the window)."""
    dense = resolve_attn_mask(n, attn_mask, is_causal, device)
    if window is None:
        return dense
    if dense is None:
        return window
    keep = window.dense(device)
    if dense.dtype == torch.bool:
        return dense & keep
    return dense.masked_fill(~keep, float("-inf"))


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


# One function per normalizer, each an FX leaf whose node is named after it (FX names a call by the
# function's __name__). timm's tracer knows them from its registry, plain tracers from torch.fx.wrap.
def softmax(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    bias: torch.Tensor | GaussianBias | None,
    scale: float,
    backend: str,
    window: WindowMask | None = None,
) -> torch.Tensor:
    """Softmax attention weights ``(B, H, Nq, Nk)``."""
    return _weights(q, k, v, attn_mask, is_causal, bias, "softmax", scale, backend, window)


def entmax15(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    bias: torch.Tensor | GaussianBias | None,
    scale: float,
    backend: str,
    window: WindowMask | None = None,
) -> torch.Tensor:
    """Entmax-1.5 attention weights ``(B, H, Nq, Nk)``."""
    return _weights(q, k, v, attn_mask, is_causal, bias, "entmax15", scale, backend, window)


def sparsemax(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    bias: torch.Tensor | GaussianBias | None,
    scale: float,
    backend: str,
    window: WindowMask | None = None,
) -> torch.Tensor:
    """Sparsemax attention weights ``(B, H, Nq, Nk)``."""
    return _weights(q, k, v, attn_mask, is_causal, bias, "sparsemax", scale, backend, window)


def entmax(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    bias: torch.Tensor | GaussianBias | None,
    scale: float,
    backend: str,
    alpha: float | torch.Tensor,
    window: WindowMask | None = None,
) -> torch.Tensor:
    """Alpha-entmax attention weights ``(B, H, Nq, Nk)`` (``alpha``: a float, or a tensor of them)."""
    alpha = alpha if isinstance(alpha, torch.Tensor) else float(alpha)
    return _weights(q, k, v, attn_mask, is_causal, bias, alpha, scale, backend, window)


for _leaf in (softmax, entmax15, sparsemax, entmax):
    register_notrace_function(_leaf)
torch.fx.wrap("softmax")
torch.fx.wrap("entmax15")
torch.fx.wrap("sparsemax")
torch.fx.wrap("entmax")


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
    kind = getattr(module, "normalizer", normalizer)
    args = (q, k, v, attn_mask, is_causal, bias, scale, backend)
    if kind == "adaptive" or isinstance(kind, torch.Tensor):  # learned alphas: alpha-entmax
        weights = entmax(*args, normalizer, window)  # type: ignore[arg-type]  # the alphas tensor
    elif kind == "softmax":
        weights = softmax(*args, window)
    elif kind == "entmax15":
        weights = entmax15(*args, window)
    elif kind == "sparsemax":
        weights = sparsemax(*args, window)
    else:
        weights = entmax(*args, float(kind), window)
    drop: nn.Module = module.get_submodule("attn_drop")
    return drop(weights).to(v.dtype) @ v
