"""entmax-1.5 attention computed one block of (head, query rows) at a time, saving only ``sqrt(p)``.

The materialized path writes the scores, ``sqrt(p)`` and ``p`` as three ``(B, H, Nq, Nk)`` tensors (and
the backward two more); here each block's scores go into a reused buffer (the scale inside the matrix
product, a Gaussian bias written first by :func:`~.bias_blocks.write_rows`), the exact threshold search
of :mod:`vitattn.functional.entmax15` runs on it while it is in cache, and ``p = sqrt(p)^2`` overwrites
it before the product with ``v``. Only ``sqrt(p)`` is kept for the backward, which recomputes ``p``
block by block; the gradient of the scores never exists beyond one block either. Same operations as
the materialized path, in the same order within a row.
"""

from __future__ import annotations

import torch

from .._checks import check_rank, shape_str
from .._entmax_common import support_vjp
from ..entmax15 import shifted_rows, sqrt_entmax_rows
from ..gaussian import GaussianBias
from .bias_blocks import numerator_table, write_rows
from .grads import accumulate_qkv_grads, factor_grads_into
from .plan import Block, plan_blocks
from .scratch import Slot, scratch

__all__ = ["entmax15_attention", "flat_factors"]

Factors = tuple[torch.Tensor, torch.Tensor]


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``(B, H, N, D) -> (B*H, N, D)`` (a copy only when the heads are not laid out one after another)."""
    return t.reshape(-1, *t.shape[2:])


def flat_factors(bias: GaussianBias, b: int, h: int, dtype: torch.dtype, *, eager: bool = True) -> Factors:
    """The bias' queries-first factors ``alpha R: (B*H, Np, gh)`` and ``C: (B*H, Np, gw)`` in ``dtype``
    (broadcast σ / α expanded), for :func:`~.bias_blocks.write_rows` on blocks of heads. ``eager``: the
    cached numerator table and the factors' hand-written backward (outside ``torch.compile``)."""
    table = numerator_table(bias) if eager else None
    ra_t, c_t = bias.key_major_factors(dtype, table=table, hand_backward=eager)
    ra, c = (t.transpose(-1, -2) for t in (ra_t, c_t))
    return tuple(t.expand(b, h, *t.shape[2:]).reshape(b * h, *t.shape[2:]) for t in (ra, c))  # type: ignore[return-value]


def _blocks(bh: int, nq: int, nk: int, limit: int | None) -> list[Block]:
    return plan_blocks(bh, nq, nk, group_units=True, limit=limit)


def _numel(blocks: list[Block], nk: int) -> int:
    return max(blk.units * blk.rows for blk in blocks) * nk


def blocked_forward(
    q3: torch.Tensor,
    k3: torch.Tensor,
    v3: torch.Tensor,
    scale: float,
    sqrt_p: torch.Tensor | None,
    bias: tuple[GaussianBias, Factors] | None = None,
    limit: int | None = None,
) -> torch.Tensor:
    """``entmax15(scale q kᵀ + bias) v: (BH, Nq, Dv)`` from ``(BH, N, D)`` operands; ``sqrt_p:
    (BH, Nq, Nk)`` receives ``sqrt(p)`` when given (for the backward), else a scratch block does;
    ``bias`` is a Gaussian bias with its :func:`flat_factors`, written into each block first."""
    bh, nq, _ = q3.shape
    nk = k3.shape[1]
    out = q3.new_empty(bh, nq, v3.shape[-1])
    blocks = _blocks(bh, nq, nk, limit)
    numel = _numel(blocks, nk) if blocks else 0
    slots = (Slot.SCORES, Slot.SHIFTED, Slot.WORK)
    bufs = {slot: scratch(slot, numel, q3.dtype, q3.device) for slot in slots}
    for h0, h1, r0, r1 in blocks:
        shape = (h1 - h0, r1 - r0, nk)
        n = shape[0] * shape[1] * nk
        z = bufs[Slot.SCORES][:n].view(shape)
        if bias is None:
            z.baddbmm_(q3[h0:h1, r0:r1], k3[h0:h1].transpose(1, 2), beta=0.0, alpha=scale)
        else:
            gaussian, (ra, c) = bias
            write_rows(gaussian, z, r0, (ra[h0:h1], c[h0:h1]))
            z.baddbmm_(q3[h0:h1, r0:r1], k3[h0:h1].transpose(1, 2), alpha=scale)
        if sqrt_p is None:
            g = scratch(Slot.PROBS, numel, q3.dtype, q3.device)[:n].view(shape)
        else:
            g = sqrt_p[h0:h1, r0:r1]
        x = shifted_rows(z.view(-1, nk), out=bufs[Slot.SHIFTED][:n].view(-1, nk))
        sqrt_entmax_rows(x, bufs[Slot.WORK][:n].view(-1, nk), g.view(-1, nk))
        torch.bmm(torch.mul(g, g, out=z), v3[h0:h1], out=out[h0:h1, r0:r1])
    return out


def blocked_backward(
    go3: torch.Tensor,
    q3: torch.Tensor,
    k3: torch.Tensor,
    v3: torch.Tensor,
    sqrt_p: torch.Tensor,
    scale: float,
    bias: GaussianBias | None,
    factors: Factors | None,
    limit: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(dq, dk, dv, d(alpha R), dC)`` (``(BH, ·, ·)``; the factor gradients ``None`` without a bias)
    of :func:`blocked_forward` from ``go3: (BH, Nq, Dv)`` and the saved ``sqrt_p: (BH, Nq, Nk)``."""
    bh, nq, nk = sqrt_p.shape
    dq, dk, dv = torch.empty_like(q3), torch.empty_like(k3), torch.empty_like(v3)
    with_bias = bias is not None and factors is not None
    grads_t = factors_t = None
    if with_bias:  # keys first, as factor_grads_into writes them; every patch query once per head
        assert factors is not None
        ra, c = factors
        grads_t = (ra.new_empty(bh, ra.shape[2], ra.shape[1]), c.new_empty(bh, c.shape[2], c.shape[1]))
        factors_t = (ra.transpose(1, 2), c.transpose(1, 2))
    blocks = _blocks(bh, nq, nk, limit)
    numel = _numel(blocks, nk) if blocks else 0
    slots = (Slot.SCORES, Slot.PROBS, Slot.GRADS)
    bufs = {slot: scratch(slot, numel, q3.dtype, q3.device) for slot in slots}
    prod_buf = scratch(Slot.PRODUCTS, numel, q3.dtype, q3.device) if with_bias else None
    for h0, h1, r0, r1 in blocks:
        shape = (h1 - h0, r1 - r0, nk)
        n = shape[0] * shape[1] * nk
        g, go = sqrt_p[h0:h1, r0:r1], go3[h0:h1, r0:r1]
        dp = torch.bmm(go, v3[h0:h1].transpose(1, 2), out=bufs[Slot.SCORES][:n].view(shape))
        p = torch.mul(g, g, out=bufs[Slot.PROBS][:n].view(shape))
        ds = support_vjp(dp.view(-1, nk), g.view(-1, nk), -1, out=bufs[Slot.GRADS][:n].view(-1, nk))
        ds = ds.view(shape)
        accumulate_qkv_grads(
            ds, p, q3[h0:h1, r0:r1], k3[h0:h1], go, dq[h0:h1, r0:r1], dk[h0:h1], dv[h0:h1], scale,
            first=r0 == 0,
        )  # fmt: skip
        if with_bias:
            assert bias is not None and factors_t is not None and grads_t is not None and prod_buf is not None
            _bias_grads_into(ds, bias, r0, factors_t, grads_t, h0, h1, prod_buf)
    if grads_t is None:
        return dq, dk, dv, None, None
    return dq, dk, dv, grads_t[0].transpose(1, 2), grads_t[1].transpose(1, 2)


def _bias_grads_into(
    ds: torch.Tensor,
    bias: GaussianBias,
    r0: int,
    factors_t: Factors,
    grads_t: Factors,
    h0: int,
    h1: int,
    prod_buf: torch.Tensor,
) -> None:
    """The factor gradients of heads ``h0:h1`` from the score gradient ``ds: (heads, rows, N)`` of
    query rows ``r0 ..`` (the bias' gradient is the scores'): its patch-key x patch-query part, keys
    first, through :func:`~.grads.factor_grads_into`."""
    p = bias.num_prefix_tokens
    first = max(r0, p)  # first patch query of the block
    stop = r0 + ds.shape[1]
    if first >= stop:
        return
    ds_p = ds[:, first - r0 :, p:].unflatten(-1, bias.grid_size).permute(0, 2, 3, 1)  # (h, gh, gw, rows')
    ra_t, c_t = (t[h0:h1] for t in factors_t)
    dra_t, dc_t = (t[h0:h1] for t in grads_t)
    factor_grads_into(ds_p, (ra_t, c_t), first - p, stop - p, (dra_t, dc_t), prod_buf)


class _Entmax15Attention(torch.autograd.Function):
    """Row-blocked entmax-1.5 attention; saves q, k, v (flattened), ``sqrt(p)`` and, with a Gaussian
    bias, its flattened factors (their gradients go back through autograd to σ and α)."""

    @staticmethod
    def forward(
        ctx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ra: torch.Tensor | None,
        c: torch.Tensor | None,
        scale: float,
        bias: GaussianBias | None,
        limit: int | None,
    ) -> torch.Tensor:
        q3, k3, v3 = _flat(q), _flat(k), _flat(v)
        sqrt_p = q3.new_empty(q3.shape[0], q3.shape[1], k3.shape[1])
        written = None if bias is None or ra is None or c is None else (bias, (ra, c))
        out = blocked_forward(q3, k3, v3, scale, sqrt_p, written, limit)
        ctx.save_for_backward(q3, k3, v3, sqrt_p, ra, c)
        ctx.scale, ctx.bias, ctx.limit, ctx.shapes = scale, bias, limit, (q.shape, k.shape, v.shape)
        return out.view(*q.shape[:3], v.shape[-1])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q3, k3, v3, sqrt_p, ra, c = ctx.saved_tensors
        factors = None if ra is None or c is None else (ra, c)
        go3 = _flat(grad_out.to(q3.dtype))
        grads = blocked_backward(go3, q3, k3, v3, sqrt_p, ctx.scale, ctx.bias, factors, ctx.limit)
        dq, dk, dv, dra, dc = grads
        q_shape, k_shape, v_shape = ctx.shapes
        return dq.view(q_shape), dk.view(k_shape), dv.view(v_shape), dra, dc, None, None, None


def check_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: GaussianBias | None) -> None:
    """``TypeError`` / ``ValueError`` naming the operands unless q, k, v are ``(B, H, N, D)`` tensors of
    one dtype, float32 or float64, with k, v sharing ``(B, H, Nk)``, q, k sharing ``(B, H)`` and D, and
    ``Nq = Nk`` = the bias' token count when there is a bias."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_rank(name, t, 4, "(B, H, N, D)")
    if q.dtype not in (torch.float32, torch.float64) or not q.dtype == k.dtype == v.dtype:
        raise TypeError(
            f"q, k, v must share one dtype, float32 or float64; got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1] or k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"q {shape_str(q)}, k {shape_str(k)}, v {shape_str(v)} must be (B, H, Nq, D), (B, H, Nk, D) "
            "and (B, H, Nk, Dv)"
        )
    if bias is not None and (q.shape[2] != bias.num_tokens or k.shape[2] != bias.num_tokens):
        raise ValueError(
            f"bias describes N = {bias.num_tokens} tokens, but q is {shape_str(q)} and k is {shape_str(k)}"
        )


def entmax15_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    bias: GaussianBias | None = None,
    *,
    block_elements: int | None = None,
) -> torch.Tensor:
    """``entmax15(scale q kᵀ + bias) v`` for ``q: (B, H, Nq, D)``, ``k: (B, H, Nk, D)``,
    ``v: (B, H, Nk, Dv)`` (one floating dtype, float32 or float64 on the CPU): the row-blocked path,
    with autograd when an input requires a gradient (then ``sqrt(p): (B, H, Nq, Nk)`` is the one
    tensor of that size kept), forward only otherwise.

    ``bias``, a :class:`GaussianBias` for ``Nq = Nk = N`` tokens, is written block by block (no
    dense bias); with autograd its gradient reaches σ and α through the separable factors, from each
    block's score gradient. ``block_elements``: scores per block (default :data:`~.plan.BLOCK_ELEMENTS`).
    """
    check_operands(q, k, v, bias)
    tensors = [q, k, v] + ([] if bias is None else [bias.sigma, bias.alpha])
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    factors = None if bias is None else flat_factors(bias, q.shape[0], q.shape[1], q.dtype)
    if grad:
        ra, c = (None, None) if factors is None else factors
        return _Entmax15Attention.apply(q, k, v, ra, c, float(scale), bias, block_elements)
    written = None if bias is None or factors is None else (bias, factors)
    out = blocked_forward(_flat(q), _flat(k), _flat(v), float(scale), None, written, block_elements)
    return out.view(*q.shape[:3], v.shape[-1])
