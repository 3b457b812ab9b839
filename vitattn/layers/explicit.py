"""The explicit attention path of the vitattn layers: weights through ``attn_drop``, for timm's tools.

With timm's fused attention switched off (``timm.layers.set_fused_attn(False)`` or
``TIMM_FUSED_ATTN=0`` before the model is built), timm's own layers compute
``attn_drop(softmax(scores)) @ v`` step by step, and ``timm.utils.AttentionExtract`` reads the weights
there: as the ``*attn_drop`` modules' outputs (``method="hook"``) or as the ``*attn.softmax`` graph
nodes (``method="fx"``). The vitattn layers built in that state do the same:

- the weights come from one call of :func:`vitattn.functional.attention` (any normalizer, bias, mask
  and backend; analysis captures still see it), made by a function named after the normalizer, which
  FX records as one node: ``softmax``, ``entmax15``, ``sparsemax`` or ``entmax`` (alpha-entmax);
- they pass through the layer's ``attn_drop`` module, and the output is ``weights @ v``.

So ``AttentionExtract(model, method="fx")`` finds softmax layers (LocAt included) under its default
``*attn.softmax``; for the others pass their names, e.g. ``names=["*attn.entmax15"]`` or
``["*attn.softmax", "*attn.entmax*", "*attn.sparsemax"]`` for any of them. With fused attention on
(timm's default), the layers never come here.
"""

from __future__ import annotations

import torch
from timm.layers import register_notrace_function
from torch import nn

from ..functional import GaussianBias, attention
from ..functional.normalize import Normalizer

__all__ = ["WEIGHT_NODE_NAMES", "explicit_attention", "resolve_attn_mask", "weight_node_name"]

#: The FX node name of the weights, per normalizer (alpha-entmax with any other float alpha: ``entmax``)
WEIGHT_NODE_NAMES = {"softmax": "softmax", "entmax15": "entmax15", "sparsemax": "sparsemax"}


def weight_node_name(normalizer: Normalizer) -> str:
    """The FX node name (the last part of ``blocks.0.attn.<name>``) of a layer's attention weights."""
    return WEIGHT_NODE_NAMES.get(normalizer, "entmax") if isinstance(normalizer, str) else "entmax"


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


def _weights(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    bias: torch.Tensor | GaussianBias | None,
    normalizer: Normalizer,
    scale: float,
    backend: str,
) -> torch.Tensor:
    """``(B, H, Nq, Nk)`` attention weights (before dropout) from one :func:`attention` call; the mask
    with timm's semantics (:func:`resolve_attn_mask`, inside the FX leaf: it branches on the flags).

    On the meta device the result is shape-only, as the layers' fused call.
    """
    if q.device.type == "meta":
        return q.new_empty(*q.shape[:-1], k.shape[-2])
    mask = resolve_attn_mask(q.shape[2], attn_mask, is_causal, q.device)
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
) -> torch.Tensor:
    """Softmax attention weights ``(B, H, Nq, Nk)``."""
    return _weights(q, k, v, attn_mask, is_causal, bias, "softmax", scale, backend)


def entmax15(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    bias: torch.Tensor | GaussianBias | None,
    scale: float,
    backend: str,
) -> torch.Tensor:
    """Entmax-1.5 attention weights ``(B, H, Nq, Nk)``."""
    return _weights(q, k, v, attn_mask, is_causal, bias, "entmax15", scale, backend)


def sparsemax(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    bias: torch.Tensor | GaussianBias | None,
    scale: float,
    backend: str,
) -> torch.Tensor:
    """Sparsemax attention weights ``(B, H, Nq, Nk)``."""
    return _weights(q, k, v, attn_mask, is_causal, bias, "sparsemax", scale, backend)


def entmax(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    bias: torch.Tensor | GaussianBias | None,
    scale: float,
    backend: str,
    alpha: float,
) -> torch.Tensor:
    """Alpha-entmax attention weights ``(B, H, Nq, Nk)``."""
    return _weights(q, k, v, attn_mask, is_causal, bias, float(alpha), scale, backend)


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
    """``attn_drop(weights) @ v: (B, H, Nq, Dv)`` for a vitattn layer ``module`` (its ``normalizer``,
    ``scale``, ``backend`` and ``attn_drop``); ``attn_mask`` and ``is_causal`` as timm's."""
    normalizer: Normalizer = module.normalizer  # type: ignore[assignment]
    scale, backend = float(module.scale), str(module.backend)  # type: ignore[arg-type]
    if normalizer == "softmax":
        weights = softmax(q, k, v, attn_mask, is_causal, bias, scale, backend)
    elif normalizer == "entmax15":
        weights = entmax15(q, k, v, attn_mask, is_causal, bias, scale, backend)
    elif normalizer == "sparsemax":
        weights = sparsemax(q, k, v, attn_mask, is_causal, bias, scale, backend)
    else:
        weights = entmax(q, k, v, attn_mask, is_causal, bias, scale, backend, float(normalizer))
    drop: nn.Module = module.get_submodule("attn_drop")
    return drop(weights).to(v.dtype) @ v
