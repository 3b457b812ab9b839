"""Softmax attention with a :class:`~vitattn.functional.GaussianBias`, one block of query rows at a time.

One head at a time, batched over B, each block of query rows gets its bias written into a reused
buffer (:class:`~.bias_blocks.ColumnBlock`, keys first), the scaled scores are added into the same
buffer by ``baddbmm``, exponentiated in place (``exp2`` of log2(e)-scaled scores) and multiplied by
``v``, and the ``(rows, Dv)`` output is divided by the row sums: the reference formula's result with no
``N x N`` tensor. Keys first makes the query index the contiguous one of the block and of the bias
factors, so the bias is one vectorized outer product. Working per head lets the matrix products read
q, k, v as the strided views a fused qkv projection gives (no copies) and write the output in
``(B, N, H, Dv)`` memory order, so that merging the heads afterwards is free.

:func:`gaussian_softmax_attention` is forward only (inference); :func:`gaussian_softmax_attention_train`
is the same forward as an autograd function whose backward recomputes each row block.
"""

from __future__ import annotations

import math

import torch

from ..gaussian import LOG2E, GaussianBias
from ..window import WindowMask
from .bias_blocks import ColumnBlock, column_block, numerator_table
from .grads import accumulate_qkv_grads, factor_grads_into
from .plan import plan_blocks
from .scratch import Slot, scratch
from .window_blocks import WindowRows, window_rows

__all__ = ["gaussian_softmax_attention", "gaussian_softmax_attention_train", "prepare"]

_MIN_ROW_SUM = 2.0**-64  # unshifted row sums at least this are exact, see _sums_in_range


def check_operands(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: GaussianBias, window: WindowMask | None = None
) -> None:
    """``TypeError`` / ``ValueError`` naming the operands unless q, k, v are ``(B, H, N, ·)`` tensors of
    one dtype, float32 or float64, with ``N`` the bias' (and the window's) token count."""
    if q.dtype not in (torch.float32, torch.float64) or not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"q, k, v must share one dtype, float32 or float64; got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    b, h, n = q.shape[:3] if q.dim() == 4 else (-1, -1, -1)
    if (
        k.dim() != 4
        or v.dim() != 4
        or k.shape[:3] != (b, h, n)
        or v.shape[:3] != (b, h, n)
        or (n != bias.num_tokens)
    ):
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must be (B, H, N, D) with one "
            f"N = bias.num_tokens = {bias.num_tokens}"
        )
    if window is not None and window.num_tokens != n:
        raise ValueError(f"window describes N = {window.num_tokens} tokens, but q is {tuple(q.shape)}")


def prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: GaussianBias,
    *,
    eager: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What both entry points start from: q, k, v with a unit last stride, and the bias factors keys
    first, ``log2(e) (alpha R)ᵀ: (B, H, gh, Np)`` and ``Cᵀ: (B, H, gw, Np)`` in q's dtype
    (:meth:`GaussianBias.key_major_factors`). ``eager``: the cached numerator table and the factors'
    hand-written backward (outside ``torch.compile``); else plain traced steps."""
    b, h = q.shape[:2]
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    table = numerator_table(bias) if eager else None
    ra_t, c_t = bias.key_major_factors(q.dtype, scale=LOG2E, table=table, hand_backward=eager)
    return q, k, v, ra_t.expand(b, h, *ra_t.shape[2:]), c_t.expand(b, h, *c_t.shape[2:])


def _window_rows(blocks: list[ColumnBlock], window: WindowMask | None) -> list[WindowRows | None]:
    """Each block's rows of ``window`` (or ``None`` per block without one)."""
    if window is None:
        return [None] * len(blocks)
    return [window_rows(window, blk.start, blk.stop, blk.out.device) for blk in blocks]


def _blocks(buf: torch.Tensor, b: int, n: int, bias: GaussianBias, limit: int | None) -> list[ColumnBlock]:
    """The query-row blocks of one head (:func:`~.plan.plan_blocks`), each a keys-first ``(B, N, rows)``
    view of ``buf`` with its bias views made once (every head reuses them)."""
    return [
        column_block(bias, buf[: b * n * blk.rows].view(b, n, blk.rows), blk.r0)
        for blk in plan_blocks(b, n, n, group_units=False, limit=limit)
    ]


def _block_numel(b: int, n: int, limit: int | None) -> int:
    return b * n * max(blk.rows for blk in plan_blocks(b, n, n, group_units=False, limit=limit))


def _exp2_step(
    block: ColumnBlock,
    q_t: torch.Tensor,
    k_j: torch.Tensor,
    factors_j: tuple[torch.Tensor, torch.Tensor],
    alpha: float,
    window: WindowRows | None,
    shift: bool,
) -> torch.Tensor:
    """Unnormalized probabilities of one head's query rows ``block.start:block.stop``, keys first:
    ``E[:, t, s] = 2 ** (log2(e) (score + bias)[start + s, t] - m_s)`` written into ``block.out:
    (B, N, rows)`` and returned, with ``m_s`` the row maximum if ``shift``, else 0; ``E = 0`` where
    ``window`` (the block's rows of a window) drops the key.

    ``q_t: (B, D, N)`` (q transposed), ``k_j: (B, N, D)``, ``factors_j``: one head of the keys-first
    factors, ``alpha = scale * log2(e)``.
    """
    e = block.write(factors_j)
    e.baddbmm_(k_j, q_t if block.all_rows else q_t[..., block.start : block.stop], alpha=alpha)
    if window is not None:
        window.fill_columns(e)
    if shift:
        e.sub_(e.amax(dim=1, keepdim=True))
    return e.exp2_()


def _sums_in_range(sums: torch.Tensor) -> bool:
    """Whether every row sum lies in ``[2^-64, inf)``, where the unshifted exponentials are exact.

    Then nothing overflowed, and the terms ``exp2`` flushed to zero (each below ``2^-126``) add at
    most ``N * 2^-62`` relative to their row. Otherwise (a row whose scores are all below about
    -44, or one near float32's exp range, or a NaN) the rows are recomputed with the maxima
    subtracted, as a softmax does.
    """
    return bool(((sums >= _MIN_ROW_SUM) & (sums < math.inf)).all())


def blocked_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    factors_t: tuple[torch.Tensor, torch.Tensor],
    scale: float,
    bias: GaussianBias,
    limit: int | None = None,
    *,
    window: WindowMask | None = None,
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The row-blocked forward of both entry points, one head and row block at a time:
    ``(output: (B, H, N, Dv), a view of (B, N, H, Dv); row sums: (H, B, N); whether the maxima
    were subtracted)``. ``bias`` gives the token layout; its values come from ``factors_t``;
    ``window`` drops the scores outside each query's window.

    First without subtracting the row maxima (two passes fewer per block), checked once for the
    whole call (:func:`_sums_in_range`); the rare call that fails it is recomputed shifted. Each
    block's ``E v`` goes into a contiguous ``(B, rows, Dv)`` buffer (a strided ``out=`` makes
    ``bmm`` run one matrix product per batch entry) and is divided by its row sums on the way into
    the output: the ``(rows, Dv)`` outputs are normalized, never the ``(N, rows)`` blocks.
    """
    b, h, n, _ = q.shape
    dv = v.shape[-1]
    out = torch.empty(b, n, h, dv, dtype=v.dtype, device=v.device)
    sums = torch.empty(h, b, n, dtype=q.dtype, device=q.device)
    blocks = _blocks(scratch(Slot.SCORES, _block_numel(b, n, limit), q.dtype, q.device), b, n, bias, limit)
    out_buf = scratch(Slot.OUTPUTS, b * max(blk.rows for blk in blocks) * dv, v.dtype, v.device)
    out_blocks = [out_buf[: b * blk.rows * dv].view(b, blk.rows, dv) for blk in blocks]
    windows = _window_rows(blocks, window)
    alpha = scale * LOG2E
    for shift in (False, True):
        for j in range(h):  # one head at a time, batched over B: q, k, v are read in place
            q_t, k_j, v_j, out_j = q[:, j].transpose(1, 2), k[:, j], v[:, j], out[:, :, j]
            factors_j = (factors_t[0][:, j], factors_t[1][:, j])
            for block, o, rows in zip(blocks, out_blocks, windows, strict=True):
                e = _exp2_step(block, q_t, k_j, factors_j, alpha, rows, shift)
                span = slice(block.start, block.stop)
                sums_b = torch.sum(e, dim=1, out=sums[j, :, span])
                torch.bmm(e.transpose(1, 2), v_j, out=o)
                torch.div(o, sums_b.unsqueeze(-1), out=out_j if block.all_rows else out_j[:, span])
        if shift or _sums_in_range(sums):
            break
    return out.transpose(1, 2), sums, shift


def blocked_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    factors_t: tuple[torch.Tensor, torch.Tensor],
    out: torch.Tensor,
    sums: torch.Tensor,
    scale: float,
    bias: GaussianBias,
    shift: bool,
    limit: int | None = None,
    *,
    window: WindowMask | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, d ra_t, d c_t)`` of :func:`blocked_forward`'s output ``out`` with its row sums
    ``sums: (H, B, N)`` and ``shift`` decision, from ``grad_out: (B, H, N, Dv)``; each block's
    probabilities are recomputed by the forward's own step. ``dq, dk, dv`` are ``(B, H, N, ·)`` views of
    ``(H, B, N, ·)`` tensors, the factor gradients have the factors' shapes."""
    ra_t, c_t = factors_t
    b, h, n, d = q.shape
    # P = E / sums is never formed: dO and delta are divided by the sums instead (rows x Dv, not
    # N x rows), so dSᵀ = Eᵀ * (v (dO / sums)ᵀ - delta / sums) = Pᵀ * (dPᵀ - delta) exactly
    sums_bh = sums.transpose(0, 1).unsqueeze(-1)  # (B, H, N, 1)
    go = grad_out.to(v.dtype)
    go_s = go / sums_bh
    delta_s = ((go * out).sum(-1, keepdim=True) / sums_bh).transpose(-1, -2)  # (B, H, 1, N)
    # (H, B, N, D) memory order: each head's (B, N, D) slice is contiguous, which baddbmm_ needs
    # to accumulate in one batched call (on a strided slice it falls back to an addmm_ per entry)
    dq = torch.empty(h, b, n, d, dtype=q.dtype, device=q.device)
    dk = torch.empty(h, b, n, d, dtype=k.dtype, device=k.device)  # the first block writes, others add
    dvv = torch.empty(h, b, n, v.shape[-1], dtype=v.dtype, device=v.device)
    # keys-first like the factors; every patch query's column is written by exactly one block
    dra_t = torch.empty(ra_t.shape, dtype=ra_t.dtype, device=ra_t.device)
    dc_t = torch.empty(c_t.shape, dtype=c_t.dtype, device=c_t.device)
    numel = _block_numel(b, n, limit)
    prob_blocks = _blocks(scratch(Slot.SCORES, numel, q.dtype, q.device), b, n, bias, limit)
    grad_blocks = _blocks(scratch(Slot.GRADS, numel, q.dtype, q.device), b, n, bias, limit)
    prod_buf = scratch(Slot.PRODUCTS, numel, q.dtype, q.device)
    windows = _window_rows(prob_blocks, window)
    alpha = scale * LOG2E
    for j in range(h):
        q_j, k_j, v_j, go_j, delta_j = q[:, j], k[:, j], v[:, j], go_s[:, j], delta_s[:, j]
        q_t, dq_j = q_j.transpose(1, 2), dq[j]
        ra_j, c_j = ra_t[:, j], c_t[:, j]
        for pb, gb, rows in zip(prob_blocks, grad_blocks, windows, strict=True):
            span = slice(pb.start, pb.stop)
            # Eᵀ of the block, keys first, recomputed exactly as the forward computed it
            e = _exp2_step(pb, q_t, k_j, (ra_j, c_j), alpha, rows, shift)
            go_b = go_j if pb.all_rows else go_j[:, span]  # (B, rows, Dv), divided by the sums
            ds = gb.out
            torch.bmm(v_j, go_b.transpose(1, 2), out=ds)  # dPᵀ / sums
            ds.sub_(delta_j if pb.all_rows else delta_j[..., span]).mul_(e)  # dSᵀ: d(scores)ᵀ
            q_b = q_j if pb.all_rows else q_j[:, span]
            dq_b = dq_j if pb.all_rows else dq_j[:, span]
            accumulate_qkv_grads(
                ds.transpose(1, 2), e.transpose(1, 2), q_b, k_j, go_b, dq_b, dk[j], dvv[j], scale,
                first=pb.start == 0,
            )  # fmt: skip
            if gb.patches is not None:  # dS on patch keys x patch queries: (B, gh, gw, rows')
                grads_j = (dra_t[:, j], dc_t[:, j])
                factor_grads_into(gb.patches, (ra_j, c_j), gb.lo, gb.hi, grads_j, prod_buf)
    # the bias in log2 units is ra_t * c_t = log2(e) * bias, so each factor's gradient is
    # 1 / log2(e) of the sums above
    dra_t.mul_(1.0 / LOG2E)
    dc_t.mul_(1.0 / LOG2E)
    return dq.transpose(0, 1), dk.transpose(0, 1), dvv.transpose(0, 1), dra_t, dc_t


def gaussian_softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    bias: GaussianBias,
    *,
    block_elements: int | None = None,
    window: WindowMask | None = None,
) -> torch.Tensor:
    """``softmax(q kᵀ * scale + bias) v`` without an ``N x N`` tensor; no autograd.

    Args:
        q, k: ``(B, H, N, D)``; v: ``(B, H, N, Dv)``; one floating dtype (float32 or float64); any
            strides with a unit last stride are read in place.
        bias: describes the ``(B, H, N, N)`` Gaussian bias (``sigma``/``alpha`` may broadcast over B, H).
        block_elements: scores per block (default :data:`~.plan.BLOCK_ELEMENTS`).
        window: a :class:`WindowMask` on the bias' token layout: scores outside each query's window
            are dropped block by block.

    Returns:
        ``(B, H, N, Dv)`` in ``v``'s dtype: a view of a ``(B, N, H, Dv)`` contiguous tensor.
    """
    check_operands(q, k, v, bias, window)
    with torch.no_grad():
        q, k, v, ra_t, c_t = prepare(q, k, v, bias)
        return blocked_forward(q, k, v, (ra_t, c_t), scale, bias, block_elements, window=window)[0]


class _GaussianSoftmaxFunction(torch.autograd.Function):
    """Gaussian-biased softmax attention with a row-blocked backward (see
    :func:`gaussian_softmax_attention_train`); inputs are already expanded to ``(B, H, ...)``."""

    @staticmethod
    def forward(
        ctx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ra_t: torch.Tensor,
        c_t: torch.Tensor,
        scale: float,
        bias: GaussianBias,
        limit: int | None,
        window: WindowMask | None,
    ) -> torch.Tensor:
        out, sums, shift = blocked_forward(q, k, v, (ra_t, c_t), scale, bias, limit, window=window)
        ctx.save_for_backward(q, k, v, ra_t, c_t, out, sums)
        ctx.scale, ctx.bias, ctx.limit, ctx.shift, ctx.window = scale, bias, limit, shift, window
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, ra_t, c_t, out, sums = ctx.saved_tensors
        grads = blocked_backward(
            grad_out, q, k, v, (ra_t, c_t), out, sums, ctx.scale, ctx.bias, ctx.shift, ctx.limit,
            window=ctx.window,
        )  # fmt: skip
        return *grads, None, None, None, None


def gaussian_softmax_attention_train(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    bias: GaussianBias,
    *,
    block_elements: int | None = None,
    window: WindowMask | None = None,
) -> torch.Tensor:
    """``softmax(q kᵀ * scale + bias) v`` with autograd to q, k, v, ``bias.sigma`` and ``bias.alpha``,
    never building an ``N x N`` tensor (``window``: scores outside each query's window dropped).

    The forward works in row blocks like :func:`gaussian_softmax_attention` and saves its inputs,
    its output and the row sums ``(H, B, N)`` (a block always holds whole rows, so the backward
    recomputes each block's unnormalized probabilities with the forward's own block step, which on
    the CPU is cheaper than ``exp(S - logsumexp)``). The backward gives dq, dk, dv (with the row
    statistic ``rowsum(dO * O)``) and the gradients of the separable factors ``alpha R`` and ``C``
    (:meth:`GaussianBias.key_major_factors`), which autograd carries on to σ and α. Extra memory:
    reused per-thread buffers (three blocks and a ``(B, rows, Dv)`` output block) and the
    ``(H, B, N)`` row sums, never an ``(B, H, N, N)`` tensor.

    Args:
        q, k: ``(B, H, N, D)``; v: ``(B, H, N, Dv)``; float32 or float64, one dtype, same N.
        bias: the Gaussian bias (``sigma``/``alpha`` may broadcast over B, H).
        block_elements: scores per block (default :data:`~.plan.BLOCK_ELEMENTS`).

    Returns:
        ``(B, H, N, Dv)``: a view of a ``(B, N, H, Dv)`` contiguous tensor.
    """
    check_operands(q, k, v, bias, window)
    q, k, v, ra_t, c_t = prepare(q, k, v, bias)
    return _GaussianSoftmaxFunction.apply(q, k, v, ra_t, c_t, float(scale), bias, block_elements, window)
