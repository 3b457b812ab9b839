"""What a vitattn layer's attention call takes besides q, k and v: the layer's normalizer and window
(:func:`layer_call_options`), and one mask from timm's ``attn_mask`` / ``is_causal`` and the window
(:func:`resolve_attn_mask`, :func:`layer_mask`). The fused call (:func:`vitattn.layers.attention.attend`)
and the explicit path (:mod:`vitattn.layers.explicit`) both read them here."""

from __future__ import annotations

import torch
from torch import nn

from ..functional import WindowMask
from ..functional.normalize import AttentionNormalizer

__all__ = ["layer_call_options", "layer_mask", "resolve_attn_mask"]


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
