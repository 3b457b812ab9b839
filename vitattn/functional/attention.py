"""``attention()``: the one functional entry point of the pipeline ``normalize(q kᵀ * scale + bias) v``."""

from __future__ import annotations

from typing import Literal, overload

import torch

from . import torch_backend as _torch_backend  # noqa: F401  (registers the reference backend)
from ._checks import check_broadcastable, check_floating, check_rank, shape_str
from .capture import active_callbacks
from .dispatch import AttentionCall, select_backend
from .gaussian import GaussianBias
from .normalize import Normalizer, resolve_normalizer


def _validate(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    bias: torch.Tensor | GaussianBias | None,
    dropout_p: float,
) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_rank(name, t, 4, "(B, H, N, D)")
        check_floating(name, t)
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.shape[:2] != k.shape[:2] or q.shape[:2] != v.shape[:2]:
        raise ValueError(
            f"q, k, v must share (B, H), got q {shape_str(q)}, k {shape_str(k)}, v {shape_str(v)}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must share the head dim D, got q {shape_str(q)} and k {shape_str(k)}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k and v must share the key count Nk, got k {shape_str(k)} and v {shape_str(v)}")
    target = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"mask must be a tensor or None, got {type(mask).__name__}")
        if mask.dtype != torch.bool and not mask.is_floating_point():
            raise TypeError(
                f"mask must be a boolean keep-mask or an additive float mask, got dtype {mask.dtype}"
            )
        check_broadcastable("mask", mask, target, "(B, H, Nq, Nk)")
    if isinstance(bias, GaussianBias):
        n = bias.num_tokens
        if q.shape[2] != n or k.shape[2] != n:
            raise ValueError(
                f"GaussianBias describes N = {bias.num_prefix_tokens} prefix + {bias.grid_size[0]}x"
                f"{bias.grid_size[1]} patches = {n} tokens, but q is {shape_str(q)} and k is {shape_str(k)}"
            )
        check_broadcastable(
            "bias.sigma", bias.sigma[..., :1, :1], (q.shape[0], q.shape[1], 1, 1), "(B, H, ., .)"
        )
    elif bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a tensor, a GaussianBias or None, got {type(bias).__name__}")
        check_floating("bias", bias)
        check_broadcastable("bias", bias, target, "(B, H, Nq, Nk)")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")


@overload
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    normalizer: Normalizer = ...,
    scale: float | None = ...,
    mask: torch.Tensor | None = ...,
    bias: torch.Tensor | GaussianBias | None = ...,
    return_weights: Literal[False] = ...,
    dropout_p: float = ...,
    backend: str = ...,
) -> torch.Tensor: ...


@overload
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    normalizer: Normalizer = ...,
    scale: float | None = ...,
    mask: torch.Tensor | None = ...,
    bias: torch.Tensor | GaussianBias | None = ...,
    return_weights: Literal[True],
    dropout_p: float = ...,
    backend: str = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    normalizer: Normalizer = "softmax",
    scale: float | None = None,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | GaussianBias | None = None,
    return_weights: bool = False,
    dropout_p: float = 0.0,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention ``out = normalize(q kᵀ * scale + bias + mask) v``.

    Args:
        q: ``(B, H, Nq, D)`` queries.
        k: ``(B, H, Nk, D)`` keys.
        v: ``(B, H, Nk, Dv)`` values.
        normalizer: ``"softmax"``, ``"entmax15"``, ``"sparsemax"`` or a float alpha > 1 (alpha-entmax).
        scale: score scale, ``D ** -0.5`` by default.
        mask: boolean keep-mask (``True`` = attend) or additive float mask, broadcastable to
            ``(B, H, Nq, Nk)``. A query whose keys are all masked gets zero weights and a zero output.
        bias: additive float tensor broadcastable to ``(B, H, Nq, Nk)``, or a :class:`GaussianBias`.
        return_weights: also return the ``(B, H, Nq, Nk)`` probabilities (before dropout; float32
            for half-precision inputs).
        dropout_p: dropout on the probabilities (pass 0 in eval).
        backend: ``"auto"`` or a registered backend name (see ``available_backends()``).

    Returns:
        ``out`` of shape ``(B, H, Nq, Dv)`` in the dtype of ``v``, and the probabilities when
        ``return_weights=True``.
    """
    _validate(q, k, v, mask, bias, dropout_p)
    callbacks = active_callbacks()
    call = AttentionCall(
        q=q,
        k=k,
        v=v,
        normalizer=resolve_normalizer(normalizer),
        scale=float(q.shape[-1] ** -0.5 if scale is None else scale),
        mask=mask,
        bias=bias,
        return_weights=bool(return_weights) or bool(callbacks),
        dropout_p=float(dropout_p),
    )
    out, probs = select_backend(call, backend).run(call)
    if callbacks:
        assert probs is not None
        for callback in callbacks:
            callback(probs.detach())
    if return_weights:
        assert probs is not None
        return out, probs
    return out
