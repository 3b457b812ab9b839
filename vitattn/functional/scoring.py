"""Attention scores ``q kᵀ · scale + bias (+ mask)``, and the mask rule, stated once for the library.

Every place that forms scores (the reference backend, attention transfer, attention maps of timm
layers) goes through :func:`scores`, and every place that applies a mask goes through
:func:`apply_mask`: a boolean mask is a keep-mask (``True`` = attend, dropped keys at ``-inf``), a
float mask is added.
"""

from __future__ import annotations

import torch

from ._checks import check_broadcastable, check_floating, check_rank, check_scale, shape_str
from .dtypes import compute_dtype
from .gaussian import GaussianBias
from .window import WindowMask

__all__ = ["apply_mask", "check_qk", "check_mask_and_bias", "is_keep_mask", "scores"]


def is_keep_mask(mask: torch.Tensor | None) -> bool:
    """``True`` for a boolean keep-mask (``True`` = attend); ``False`` for an additive float mask or None."""
    return mask is not None and mask.dtype == torch.bool


def apply_mask(
    scores: torch.Tensor | None, mask: torch.Tensor | WindowMask | None, dtype: torch.dtype | None = None
) -> torch.Tensor | None:
    """``scores`` with ``mask`` applied: a bool keep-mask puts dropped keys at ``-inf``, a float one is added.

    With ``scores=None`` the result is the mask as an additive tensor in ``dtype`` (0 / ``-inf`` for a
    bool mask), or None when there is no mask either. The result broadcasts both shapes. A
    :class:`WindowMask` is its dense ``(N, N)`` bool keep-mask (on the scores' device).
    """
    if mask is None:
        return scores
    if isinstance(mask, WindowMask):
        mask = mask.dense(None if scores is None else scores.device)
    if scores is None:
        if dtype is None:
            raise TypeError("apply_mask needs dtype when scores is None")
        if is_keep_mask(mask):
            return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
        return mask.to(dtype)
    if is_keep_mask(mask):
        return scores.masked_fill(~mask, float("-inf"))
    return scores + mask.to(scores.dtype)


def dense_bias(bias: torch.Tensor | GaussianBias | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The additive bias as a tensor in ``dtype`` (a ``GaussianBias`` made dense), or None."""
    if bias is None:
        return None
    if isinstance(bias, GaussianBias):
        return bias.dense(dtype)
    return bias.to(dtype)


def check_qk(q: torch.Tensor, k: torch.Tensor) -> None:
    """q ``(B, H, Nq, D)`` and k ``(B, H, Nk, D)``: 4-D, floating, one dtype, same ``(B, H)`` and ``D``."""
    for name, t in (("q", q), ("k", k)):
        check_rank(name, t, 4, "(B, H, N, D)")
        check_floating(name, t)
    if q.dtype != k.dtype:
        raise TypeError(f"q and k must share a dtype, got q {q.dtype} and k {k.dtype}")
    if q.shape[:2] != k.shape[:2]:
        raise ValueError(f"q and k must share (B, H), got q {shape_str(q)} and k {shape_str(k)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must share the head dim D, got q {shape_str(q)} and k {shape_str(k)}")


def _check_token_layout(layout: WindowMask | GaussianBias, q: torch.Tensor, k: torch.Tensor) -> None:
    """``q`` and ``k`` have the ``N = prefix + rows x columns`` tokens a described mask or bias covers."""
    n, (rows, cols) = layout.num_tokens, layout.grid_size
    if q.shape[2] != n or k.shape[2] != n:
        raise ValueError(
            f"{type(layout).__name__} describes N = {layout.num_prefix_tokens} prefix + {rows}x{cols} "
            f"patches = {n} tokens, but q is {shape_str(q)} and k is {shape_str(k)}"
        )


def _check_same_layout(window: WindowMask, bias: GaussianBias) -> None:
    """A window and a Gaussian bias of one call describe the same grid and prefix tokens."""
    if (window.grid_size, window.num_prefix_tokens) != (bias.grid_size, bias.num_prefix_tokens):
        raise ValueError(
            f"mask (a WindowMask on grid {window.grid_size}, {window.num_prefix_tokens} prefix tokens) and "
            f"bias (a GaussianBias on grid {bias.grid_size}, {bias.num_prefix_tokens} prefix tokens) must "
            "describe the same token layout"
        )


def check_mask_and_bias(
    q: torch.Tensor,
    k: torch.Tensor,
    mask: torch.Tensor | WindowMask | None,
    bias: torch.Tensor | GaussianBias | None,
) -> None:
    """``mask`` and ``bias`` fit the ``(B, H, Nq, Nk)`` scores of ``q`` and ``k`` (errors name the shapes)."""
    target = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    if isinstance(mask, WindowMask):
        _check_token_layout(mask, q, k)
    elif mask is not None:
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"mask must be a tensor or None, got {type(mask).__name__}")
        if mask.dtype != torch.bool and not mask.is_floating_point():
            raise TypeError(
                f"mask must be a boolean keep-mask or an additive float mask, got dtype {mask.dtype}"
            )
        check_broadcastable("mask", mask, target, "(B, H, Nq, Nk)")
    if isinstance(bias, GaussianBias):
        _check_token_layout(bias, q, k)
        if isinstance(mask, WindowMask):
            _check_same_layout(mask, bias)
        check_broadcastable(
            "bias.sigma", bias.sigma[..., :1, :1], (q.shape[0], q.shape[1], 1, 1), "(B, H, ., .)"
        )
    elif bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a tensor, a GaussianBias or None, got {type(bias).__name__}")
        check_floating("bias", bias)
        check_broadcastable("bias", bias, target, "(B, H, Nq, Nk)")


def additive_terms(
    bias: torch.Tensor | GaussianBias | None, mask: torch.Tensor | WindowMask | None, dtype: torch.dtype
) -> torch.Tensor | None:
    """Bias and mask folded into one additive tensor in ``dtype`` (``-inf`` where the mask drops a key)."""
    return apply_mask(dense_bias(bias, dtype), mask, dtype)


def scaled_products(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale * q kᵀ: (B, H, Nq, Nk)`` from ``q: (B, H, Nq, D)``, ``k: (B, H, Nk, D)`` (one dtype), with
    the scale applied inside the matrix product: no second pass over the scores, and none over their
    gradient in the backward."""
    b, h, nq, d = q.shape
    q3, k3 = q.reshape(b * h, nq, d), k.reshape(b * h, k.shape[2], d)
    # beta = 0: the (broadcast) input is ignored, so an empty-sized zero stands in for it
    out = torch.baddbmm(q3.new_zeros(1, 1, 1), q3, k3.transpose(1, 2), beta=0.0, alpha=scale)
    return out.view(b, h, nq, k.shape[2])


def scores_unchecked(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    bias: torch.Tensor | GaussianBias | None = None,
    mask: torch.Tensor | WindowMask | None = None,
    window: WindowMask | None = None,
) -> torch.Tensor:
    """:func:`scores` without the argument checks (for callers that validated already); ``window`` is
    applied after ``mask`` (both keep what both keep)."""
    work = compute_dtype(q, k)
    out = scaled_products(q.to(work), k.to(work), scale)
    if isinstance(mask, WindowMask):
        mask = mask.dense(q.device)
    add = additive_terms(bias, mask, work)
    out = out if add is None else out + add
    return out if window is None else apply_mask(out, window)  # type: ignore[return-value]


def scores(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float | None = None,
    bias: torch.Tensor | GaussianBias | None = None,
    mask: torch.Tensor | WindowMask | None = None,
) -> torch.Tensor:
    """Attention scores ``q kᵀ · scale + bias``, with ``mask`` applied.

    Args:
        q: ``(B, H, Nq, D)`` queries.
        k: ``(B, H, Nk, D)`` keys (same dtype).
        scale: score scale, ``D ** -0.5`` by default.
        bias: additive float tensor broadcastable to ``(B, H, Nq, Nk)``, or a :class:`GaussianBias`
            (then ``Nq = Nk = N`` of its token layout).
        mask: boolean keep-mask (``True`` = attend; dropped keys get ``-inf``) or additive float
            mask, broadcastable to ``(B, H, Nq, Nk)``, or a :class:`WindowMask` (then ``Nq = Nk = N``
            of its token layout).

    Returns:
        ``(B, H, Nq, Nk)`` scores in :func:`~vitattn.functional.compute_dtype` of the inputs: float32
        for float16 / bfloat16 inputs, float32 and float64 stay. Differentiable in q, k and the bias.

    Raises:
        ValueError / TypeError naming the argument and the shapes that do not fit.
    """
    check_qk(q, k)
    check_mask_and_bias(q, k, mask, bias)
    return scores_unchecked(q, k, check_scale(scale, q.shape[-1]), bias, mask)
