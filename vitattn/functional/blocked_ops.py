"""The CPU row-blocked attention paths (:mod:`.blocked`, :mod:`.blocked_entmax`) as ``torch.library``
custom ops, for ``torch.compile``.

Traced by dynamo, those functions would be inlined into the graph, and their
per-thread block buffers do not belong in a graph; without these ops a compiled model took the
dense-bias path instead (compiled LocAtViT-Tiny at 448 px: inference 1.82-1.84x compiled timm
ViT-Tiny, against 1.06-1.08x with the op; a training step 1.22-1.23x against 1.11-1.12x; see
docs/benchmarks.md). As opaque ops the compiled graph calls the same eager row-blocked code.
Inference is one op for both normalizers (Gaussian-biased softmax; entmax-1.5 with or without the
bias); LocAt training is a forward op with a backward op registered as its autograd formula (the
factors' own gradient to σ and α stays in the traced graph). Compiled entmax-1.5 training keeps the
traced materialized path.
"""

from __future__ import annotations

from typing import Any

import torch

from .blocked import _blocked_backward, _blocked_forward, _prepare, gaussian_softmax_attention
from .blocked_entmax import entmax15_attention
from .gaussian import GaussianBias

__all__ = [
    "blocked_attention_cpu",
    "blocked_attention_op",
    "gaussian_attention_cpu_train",
    "gaussian_attention_cpu_train_bwd",
    "gaussian_attention_train_op",
]


def _layout(grid_h: int, grid_w: int, num_prefix_tokens: int, like: torch.Tensor) -> GaussianBias:
    """A bias describing only the token layout (zero σ, α of one batch entry and head), which is all
    the block views of :mod:`.blocked` read; the training ops get the factors instead of σ and α, so
    that their gradient to σ and α stays in the traced graph."""
    np_ = grid_h * grid_w
    zeros = like.new_zeros(1, 1, np_, 3)
    return GaussianBias(zeros[..., :2], zeros[..., 2:], (grid_h, grid_w), num_prefix_tokens)


def _bhn_view(b: int, h: int, n: int, d: int, like: torch.Tensor) -> torch.Tensor:
    """An empty ``(B, H, N, d)`` view of a ``(H, B, N, d)`` tensor, the backward's memory order."""
    return like.new_empty(h, b, n, d).transpose(0, 1)


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
    rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The row-blocked forward for training, from :func:`~vitattn.functional.blocked._prepare`'s operands
    (q, k, v with a unit last stride; the keys-first factors ``ra_t: (B, H, gh, Np)``,
    ``c_t: (B, H, gw, Np)`` in log2 units; ``rows`` per block): ``(out: (B, H, N, Dv), row sums:
    (H, B, N), whether the maxima were subtracted: a 0-d bool)``."""
    bias = _layout(grid_h, grid_w, num_prefix_tokens, q)
    out, sums, shift = _blocked_forward(q, k, v, (ra_t, c_t), scale, bias, rows)
    return out, sums, torch.tensor(shift)


@gaussian_attention_cpu_train.register_fake
def _train_fake(q, k, v, ra_t, c_t, scale, grid_h, grid_w, num_prefix_tokens, rows):  # fmt: skip
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
    rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, d ra_t, d c_t)`` of :func:`gaussian_attention_cpu_train` (the blocked backward)."""
    bias = _layout(grid_h, grid_w, num_prefix_tokens, q)
    return _blocked_backward(grad_out, q, k, v, (ra_t, c_t), out, sums, scale, bias, rows, bool(shift))


@gaussian_attention_cpu_train_bwd.register_fake
def _train_bwd_fake(grad_out, q, k, v, ra_t, c_t, out, sums, shift, scale, grid_h, grid_w, num_prefix_tokens,
                    rows):  # fmt: skip
    b, h, n, d = q.shape
    dv = _bhn_view(b, h, n, v.shape[-1], v)
    return (
        _bhn_view(b, h, n, d, q),
        _bhn_view(b, h, n, d, k),
        dv,
        ra_t.new_empty(ra_t.shape),
        c_t.new_empty(c_t.shape),
    )


def _train_setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    q, k, v, ra_t, c_t, scale, grid_h, grid_w, num_prefix_tokens, rows = inputs
    out, sums, shift = output
    ctx.save_for_backward(q, k, v, ra_t, c_t, out, sums, shift)
    ctx.scalars = (scale, grid_h, grid_w, num_prefix_tokens, rows)
    ctx.mark_non_differentiable(sums, shift)


def _train_backward(ctx: Any, grad_out: torch.Tensor, _sums: Any, _shift: Any) -> tuple[Any, ...]:
    q, k, v, ra_t, c_t, out, sums, shift = ctx.saved_tensors
    grads = gaussian_attention_cpu_train_bwd(grad_out, q, k, v, ra_t, c_t, out, sums, shift, *ctx.scalars)
    return *grads, None, None, None, None, None


gaussian_attention_cpu_train.register_autograd(_train_backward, setup_context=_train_setup_context)


def gaussian_attention_train_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, bias: GaussianBias
) -> torch.Tensor:
    """:func:`~vitattn.functional.blocked.gaussian_softmax_attention_train` through the custom ops:
    differentiable in q, k, v and (through the factors, traced) σ and α."""
    q, k, v, ra_t, c_t, rows = _prepare(q, k, v, bias, None)
    gh, gw = bias.grid_size
    return gaussian_attention_cpu_train(
        q, k, v, ra_t, c_t, float(scale), gh, gw, bias.num_prefix_tokens, rows
    )[0]


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
    (:func:`~vitattn.functional.blocked.gaussian_softmax_attention`, which needs the bias) or, with
    ``entmax``, entmax-1.5 (:func:`~vitattn.functional.blocked_entmax.entmax15_attention`, bias
    optional). ``S`` is the Gaussian bias of ``sigma: (B|1, H|1, Np, 2)`` and ``alpha: (B|1, H|1, Np,
    1)`` (both given or both ``None``) on a ``(grid_h, grid_w)`` grid after ``num_prefix_tokens``
    tokens (:class:`~vitattn.functional.GaussianBias`). ``q: (B, H, Nq, D)``, ``k: (B, H, Nk, D)``,
    ``v: (B, H, Nk, Dv)``, one dtype, float32 or float64. Returns ``(B, H, Nq, Dv)``: contiguous for
    entmax-1.5, a view of a ``(B, N, H, Dv)`` tensor for softmax."""
    bias = None
    if sigma is not None and alpha is not None:
        grids = (grid_h, grid_w), (initial_grid_h, initial_grid_w)
        bias = GaussianBias(sigma, alpha, grids[0], num_prefix_tokens, grids[1])
    if entmax:
        return entmax15_attention(q, k, v, scale, bias)
    if bias is None:
        raise ValueError("vitattn::blocked_attention_cpu: softmax needs sigma and alpha (a Gaussian bias)")
    return gaussian_softmax_attention(q, k, v, scale, bias)


@blocked_attention_cpu.register_fake
def _blocked_attention_cpu_fake(
    q, k, v, sigma, alpha, scale, grid_h, grid_w, num_prefix_tokens, initial_grid_h, initial_grid_w, entmax
):  # fmt: skip
    b, h, n, _ = q.shape
    if entmax:
        return q.new_empty(b, h, n, v.shape[-1], dtype=v.dtype)
    return q.new_empty(b, n, h, v.shape[-1], dtype=v.dtype).transpose(1, 2)


def blocked_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, bias: GaussianBias | None, entmax: bool
) -> torch.Tensor:
    """:func:`blocked_attention_cpu` called with the fields of ``bias`` (or none)."""
    if bias is None:
        return blocked_attention_cpu(q, k, v, None, None, float(scale), 0, 0, 0, 0, 0, entmax)
    (gh, gw), (ih, iw) = bias.grid_size, bias.initial_grid_size  # type: ignore[misc]
    p = bias.num_prefix_tokens
    return blocked_attention_cpu(q, k, v, bias.sigma, bias.alpha, float(scale), gh, gw, p, ih, iw, entmax)
