"""The CPU row-blocked paths as ``torch.library`` custom ops, for ``torch.compile``.

Traced by dynamo, the eager functions would be inlined into the graph, and their reused per-thread
block buffers do not belong in a graph. As opaque ops the compiled graph calls the same eager
row-blocked code. Inference is one op for both normalizers (Gaussian-biased softmax; entmax-1.5 with
or without the bias). Training is a forward op with a backward op registered as its autograd formula,
one pair per normalizer; the bias factors are computed outside the ops, in the traced graph, so that
their own gradient to σ and α stays there.
"""

from __future__ import annotations

from typing import Any

import torch

from ..gaussian import GaussianBias
from . import entmax as _entmax
from . import softmax as _softmax

__all__ = ["entmax15_train_op", "gaussian_softmax_train_op", "inference_op"]


def _layout(grid_h: int, grid_w: int, num_prefix_tokens: int, like: torch.Tensor) -> GaussianBias:
    """A bias describing only the token layout (zero σ, α of one batch entry and head), which is all
    the block writers and the factor gradients read; the training ops get the factors themselves."""
    zeros = like.new_zeros(1, 1, grid_h * grid_w, 3)
    return GaussianBias(zeros[..., :2], zeros[..., 2:], (grid_h, grid_w), num_prefix_tokens)


def _bhn_view(b: int, h: int, n: int, d: int, like: torch.Tensor) -> torch.Tensor:
    """An empty ``(B, H, N, d)`` view of a ``(H, B, N, d)`` tensor, the softmax backward's memory order."""
    return like.new_empty(h, b, n, d).transpose(0, 1)


# ---- inference: both normalizers --------------------------------------------------------------------


@torch.library.custom_op("vitattn::blocked_attention_cpu", mutates_args=(), device_types="cpu")
def blocked_attention_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sigma: torch.Tensor | None,
    alpha: torch.Tensor | None,
    scale: float,
    grid_h: int,
    grid_w: int,
    num_prefix_tokens: int,
    initial_grid_h: int,
    initial_grid_w: int,
    entmax: bool,
) -> torch.Tensor:
    """The row-blocked inference path: ``normalize(q kᵀ · scale + S) v`` with softmax
    (:func:`~.softmax.gaussian_softmax_attention`, which needs the bias) or, with ``entmax``,
    entmax-1.5 (:func:`~.entmax.entmax15_attention`, bias optional). ``S`` is the Gaussian bias of
    ``sigma: (B|1, H|1, Np, 2)`` and ``alpha: (B|1, H|1, Np, 1)`` (both given or both ``None``) on a
    ``(grid_h, grid_w)`` grid after ``num_prefix_tokens`` tokens. ``q: (B, H, Nq, D)``, ``k: (B, H,
    Nk, D)``, ``v: (B, H, Nk, Dv)``, one dtype, float32 or float64. Returns ``(B, H, Nq, Dv)``:
    contiguous for entmax-1.5, a view of a ``(B, N, H, Dv)`` tensor for softmax."""
    bias = None
    if sigma is not None and alpha is not None:
        grids = (grid_h, grid_w), (initial_grid_h, initial_grid_w)
        bias = GaussianBias(sigma, alpha, grids[0], num_prefix_tokens, grids[1])
    if entmax:
        return _entmax.entmax15_attention(q, k, v, scale, bias)
    if bias is None:
        raise ValueError("vitattn::blocked_attention_cpu: softmax needs sigma and alpha (a Gaussian bias)")
    return _softmax.gaussian_softmax_attention(q, k, v, scale, bias)


@blocked_attention_cpu.register_fake
def _blocked_attention_cpu_fake(
    q, k, v, sigma, alpha, scale, grid_h, grid_w, num_prefix_tokens, initial_grid_h, initial_grid_w, entmax
):  # fmt: skip
    b, h, n, _ = q.shape
    if entmax:
        return q.new_empty(b, h, n, v.shape[-1], dtype=v.dtype)
    return q.new_empty(b, n, h, v.shape[-1], dtype=v.dtype).transpose(1, 2)


def inference_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, bias: GaussianBias | None, entmax: bool
) -> torch.Tensor:
    """:func:`blocked_attention_cpu` called with the fields of ``bias`` (or none)."""
    if bias is None:
        return blocked_attention_cpu(q, k, v, None, None, float(scale), 0, 0, 0, 0, 0, entmax)
    (gh, gw), (ih, iw) = bias.grid_size, bias.initial_grid_size  # type: ignore[misc]
    p = bias.num_prefix_tokens
    return blocked_attention_cpu(q, k, v, bias.sigma, bias.alpha, float(scale), gh, gw, p, ih, iw, entmax)


# ---- training: Gaussian-biased softmax ----------------------------------------------------------------


@torch.library.custom_op("vitattn::gaussian_attention_cpu_train", mutates_args=(), device_types="cpu")
def gaussian_attention_cpu_train(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ra_t: torch.Tensor,
    c_t: torch.Tensor,
    scale: float,
    grid_h: int,
    grid_w: int,
    num_prefix_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The softmax path's forward for training, from :func:`~.softmax.prepare`'s operands (q, k, v with a
    unit last stride; the keys-first factors ``ra_t: (B, H, gh, Np)``, ``c_t: (B, H, gw, Np)`` in log2
    units): ``(out: (B, H, N, Dv), row sums: (H, B, N), whether the maxima were subtracted: a 0-d
    bool)``."""
    bias = _layout(grid_h, grid_w, num_prefix_tokens, q)
    out, sums, shift = _softmax.blocked_forward(q, k, v, (ra_t, c_t), scale, bias)
    return out, sums, torch.tensor(shift)


@gaussian_attention_cpu_train.register_fake
def _train_fake(q, k, v, ra_t, c_t, scale, grid_h, grid_w, num_prefix_tokens):  # fmt: skip
    b, h, n, _ = q.shape
    out = q.new_empty(b, n, h, v.shape[-1], dtype=v.dtype).transpose(1, 2)
    return out, q.new_empty(h, b, n), torch.empty((), dtype=torch.bool)


@torch.library.custom_op("vitattn::gaussian_attention_cpu_train_bwd", mutates_args=(), device_types="cpu")
def gaussian_attention_cpu_train_bwd(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ra_t: torch.Tensor,
    c_t: torch.Tensor,
    out: torch.Tensor,
    sums: torch.Tensor,
    shift: torch.Tensor,
    scale: float,
    grid_h: int,
    grid_w: int,
    num_prefix_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, d ra_t, d c_t)`` of :func:`gaussian_attention_cpu_train` (the blocked backward)."""
    bias = _layout(grid_h, grid_w, num_prefix_tokens, q)
    return _softmax.blocked_backward(grad_out, q, k, v, (ra_t, c_t), out, sums, scale, bias, bool(shift))


@gaussian_attention_cpu_train_bwd.register_fake
def _train_bwd_fake(grad_out, q, k, v, ra_t, c_t, out, sums, shift, scale, grid_h, grid_w,
                    num_prefix_tokens):  # fmt: skip
    b, h, n, d = q.shape
    dv = _bhn_view(b, h, n, v.shape[-1], v)
    dq, dk = _bhn_view(b, h, n, d, q), _bhn_view(b, h, n, d, k)
    return dq, dk, dv, ra_t.new_empty(ra_t.shape), c_t.new_empty(c_t.shape)


def _softmax_setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    q, k, v, ra_t, c_t, scale, grid_h, grid_w, num_prefix_tokens = inputs
    out, sums, shift = output
    ctx.save_for_backward(q, k, v, ra_t, c_t, out, sums, shift)
    ctx.scalars = (scale, grid_h, grid_w, num_prefix_tokens)
    ctx.mark_non_differentiable(sums, shift)


def _softmax_backward(ctx: Any, grad_out: torch.Tensor, _sums: Any, _shift: Any) -> tuple[Any, ...]:
    q, k, v, ra_t, c_t, out, sums, shift = ctx.saved_tensors
    grads = gaussian_attention_cpu_train_bwd(grad_out, q, k, v, ra_t, c_t, out, sums, shift, *ctx.scalars)
    return *grads, None, None, None, None


gaussian_attention_cpu_train.register_autograd(_softmax_backward, setup_context=_softmax_setup_context)


def gaussian_softmax_train_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, bias: GaussianBias
) -> torch.Tensor:
    """:func:`~.softmax.gaussian_softmax_attention_train` through the custom ops: differentiable in
    q, k, v and (through the factors, traced) σ and α."""
    q, k, v, ra_t, c_t = _softmax.prepare(q, k, v, bias, eager=False)
    gh, gw = bias.grid_size
    return gaussian_attention_cpu_train(q, k, v, ra_t, c_t, float(scale), gh, gw, bias.num_prefix_tokens)[0]


# ---- training: entmax-1.5 (plain or Gaussian-biased) --------------------------------------------------


@torch.library.custom_op("vitattn::entmax15_attention_cpu_train", mutates_args=(), device_types="cpu")
def entmax15_attention_cpu_train(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ra: torch.Tensor | None,
    c: torch.Tensor | None,
    scale: float,
    grid_h: int,
    grid_w: int,
    num_prefix_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The entmax-1.5 path's forward for training: ``(out: (B, H, Nq, Dv), sqrt(p): (B*H, Nq, Nk))``, from
    q, k, v and, with a Gaussian bias, its :func:`~.entmax.flat_factors` ``ra: (B*H, Np, gh)``,
    ``c: (B*H, Np, gw)`` (both ``None`` without)."""
    q3, k3, v3 = (t.reshape(-1, *t.shape[2:]) for t in (q, k, v))
    sqrt_p = q3.new_empty(q3.shape[0], q3.shape[1], k3.shape[1])
    bias = None
    if ra is not None and c is not None:
        bias = (_layout(grid_h, grid_w, num_prefix_tokens, q), (ra, c))
    out = _entmax.blocked_forward(q3, k3, v3, scale, sqrt_p, bias)
    return out.view(*q.shape[:3], v.shape[-1]), sqrt_p


@entmax15_attention_cpu_train.register_fake
def _entmax_train_fake(q, k, v, ra, c, scale, grid_h, grid_w, num_prefix_tokens):  # fmt: skip
    b, h, nq, _ = q.shape
    return q.new_empty(b, h, nq, v.shape[-1]), q.new_empty(b * h, nq, k.shape[2])


@torch.library.custom_op("vitattn::entmax15_attention_cpu_train_bwd", mutates_args=(), device_types="cpu")
def entmax15_attention_cpu_train_bwd(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sqrt_p: torch.Tensor,
    ra: torch.Tensor | None,
    c: torch.Tensor | None,
    scale: float,
    grid_h: int,
    grid_w: int,
    num_prefix_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, d ra, d c)`` of :func:`entmax15_attention_cpu_train` (the blocked backward); the
    factor gradients are empty ``(0,)`` tensors without a bias."""
    q3, k3, v3 = (t.reshape(-1, *t.shape[2:]) for t in (q, k, v))
    go3 = grad_out.to(q3.dtype).reshape(-1, *grad_out.shape[2:])
    factors = None if ra is None or c is None else (ra, c)
    bias = None if factors is None else _layout(grid_h, grid_w, num_prefix_tokens, q)
    dq, dk, dv, dra, dc = _entmax.blocked_backward(go3, q3, k3, v3, sqrt_p, scale, bias, factors)
    return (
        dq.view(q.shape), dk.view(k.shape), dv.view(v.shape),
        q.new_empty(0) if dra is None else dra, q.new_empty(0) if dc is None else dc,
    )  # fmt: skip


@entmax15_attention_cpu_train_bwd.register_fake
def _entmax_train_bwd_fake(grad_out, q, k, v, sqrt_p, ra, c, scale, grid_h, grid_w,
                           num_prefix_tokens):  # fmt: skip
    def keys_first(t):  # the factor gradients are transposed views, as the backward writes them
        return t.new_empty(t.shape[0], t.shape[2], t.shape[1]).transpose(1, 2)

    return (
        q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
        q.new_empty(0) if ra is None else keys_first(ra), q.new_empty(0) if c is None else keys_first(c),
    )  # fmt: skip


def _entmax_setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    q, k, v, ra, c, scale, grid_h, grid_w, num_prefix_tokens = inputs
    _, sqrt_p = output
    ctx.save_for_backward(q, k, v, sqrt_p, ra, c)
    ctx.scalars = (scale, grid_h, grid_w, num_prefix_tokens)
    ctx.mark_non_differentiable(sqrt_p)


def _entmax_backward(ctx: Any, grad_out: torch.Tensor, _sqrt_p: Any) -> tuple[Any, ...]:
    q, k, v, sqrt_p, ra, c = ctx.saved_tensors
    dq, dk, dv, dra, dc = entmax15_attention_cpu_train_bwd(grad_out, q, k, v, sqrt_p, ra, c, *ctx.scalars)
    return dq, dk, dv, None if ra is None else dra, None if c is None else dc, None, None, None, None


entmax15_attention_cpu_train.register_autograd(_entmax_backward, setup_context=_entmax_setup_context)


def entmax15_train_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, bias: GaussianBias | None
) -> torch.Tensor:
    """:func:`~.entmax.entmax15_attention` with autograd through the custom ops: differentiable in q, k,
    v and (through the factors, traced) σ and α."""
    if bias is None:
        return entmax15_attention_cpu_train(q, k, v, None, None, float(scale), 0, 0, 0)[0]
    ra, c = _entmax.flat_factors(bias, q.shape[0], q.shape[1], q.dtype, eager=False)
    gh, gw = bias.grid_size
    return entmax15_attention_cpu_train(q, k, v, ra, c, float(scale), gh, gw, bias.num_prefix_tokens)[0]
