"""entmax-1.5 attention computed one block of (head, query rows) at a time, saving only ``sqrt(p)``.

The CPU path of ``attention(q, k, v, normalizer="entmax15")`` without mask or dropout (and with a
:class:`~vitattn.functional.GaussianBias` in inference, written block by block by
:meth:`~vitattn.functional.GaussianBias.write_rows` before the scores are added to it). The
materialized path writes the scores, ``sqrt(p)`` and ``p`` as three ``(B, H, Nq, Nk)`` tensors
(and the backward two more); here each block's scores go into a small per-thread buffer (the scale
inside the matrix product), the exact threshold search of :mod:`.entmax15` runs on it while it is
in cache, and ``p = sqrt(p)^2`` overwrites it before the product with ``v``. Only ``sqrt(p)`` is
kept for the backward, which recomputes ``p`` block by block; the gradient of the scores never
exists beyond one block either. Same operations as the materialized path, in the same order within
a row: the outputs and gradients matched it bit for bit wherever compared (float32 and float64).
"""

from __future__ import annotations

import torch

from ._checks import check_rank, shape_str
from ._entmax_common import support_vjp
from .blocked import _scratch_buffer, factor_grads_into
from .entmax15 import _CHUNK_ELEMENTS, _entmax15_sqrt_rows
from .gaussian import GaussianBias

__all__ = ["entmax15_attention", "head_row_blocks"]

Block = tuple[int, int, int, int]  # heads h0:h1, query rows r0:r1
# scores per block: the threshold search's chunk, so that a block is searched in one chunk
_BLOCK_ELEMENTS = _CHUNK_ELEMENTS


def head_row_blocks(heads: int, num_queries: int, num_keys: int, limit: int | None = None) -> list[Block]:
    """Blocks ``(h0, h1, r0, r1)`` of at most ``limit`` scores each (default ``_BLOCK_ELEMENTS``;
    at least one row): whole heads grouped in near-equal counts while a head fits, else one head's
    query rows in near-equal blocks. Each block is then a contiguous slice of a ``(heads, Nq, ·)``
    tensor."""
    limit = _BLOCK_ELEMENTS if limit is None else int(limit)
    per_head = num_queries * num_keys
    if per_head <= limit:
        groups = -(-heads // max(1, limit // max(per_head, 1)))
        size = -(-heads // groups)
        return [(h, min(h + size, heads), 0, num_queries) for h in range(0, heads, size)]
    pieces = -(-num_queries // max(1, limit // num_keys))
    rows = -(-num_queries // pieces)
    starts = range(0, num_queries, rows)
    return [(h, h + 1, r, min(r + rows, num_queries)) for h in range(heads) for r in starts]


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``(B, H, N, D) -> (B*H, N, D)`` (a copy only when the heads are not laid out one after another)."""
    return t.reshape(-1, *t.shape[2:])


def _flat_factors(
    bias: GaussianBias, b: int, h: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The bias' queries-first factors ``alpha R: (B*H, Np, gh)`` and ``C: (B*H, Np, gw)`` in
    ``dtype`` (broadcast σ / α expanded), for :meth:`GaussianBias.write_rows` on blocks of heads."""
    ra, c = (t.expand(b, h, *t.shape[2:]).reshape(b * h, *t.shape[2:]) for t in bias.scaled_factors(dtype))
    return ra, c


def _forward(
    q3: torch.Tensor,
    k3: torch.Tensor,
    v3: torch.Tensor,
    scale: float,
    sqrt_p: torch.Tensor | None,
    bias: tuple[GaussianBias, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> torch.Tensor:
    """``entmax15(scale q kᵀ + bias) v: (BH, Nq, Dv)`` from ``(BH, N, D)`` operands; ``sqrt_p:
    (BH, Nq, Nk)`` receives ``sqrt(p)`` when given (for the backward), else a scratch block does;
    ``bias`` is a Gaussian bias with its :func:`_flat_factors`, written into each block first."""
    bh, nq, _ = q3.shape
    nk = k3.shape[1]
    out = q3.new_empty(bh, nq, v3.shape[-1])
    for h0, h1, r0, r1 in head_row_blocks(bh, nq, nk):
        numel = (h1 - h0) * (r1 - r0) * nk
        z = _scratch_buffer(numel, q3.dtype, q3.device, slot=0).view(h1 - h0, r1 - r0, nk)
        if bias is None:
            z.baddbmm_(q3[h0:h1, r0:r1], k3[h0:h1].transpose(1, 2), beta=0.0, alpha=scale)
        else:
            gaussian, (ra, c) = bias
            gaussian.write_rows(z, r0, (ra[h0:h1], c[h0:h1]))
            z.baddbmm_(q3[h0:h1, r0:r1], k3[h0:h1].transpose(1, 2), alpha=scale)
        if sqrt_p is None:
            g = _scratch_buffer(numel, q3.dtype, q3.device, slot=1).view_as(z)
        else:
            g = sqrt_p[h0:h1, r0:r1]
        _entmax15_sqrt_rows(z.view(-1, nk), out=g.view(-1, nk))
        torch.bmm(torch.mul(g, g, out=z), v3[h0:h1], out=out[h0:h1, r0:r1])
    return out


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
    ) -> torch.Tensor:
        q3, k3, v3 = _flat(q), _flat(k), _flat(v)
        sqrt_p = q3.new_empty(q3.shape[0], q3.shape[1], k3.shape[1])
        written = None if bias is None or ra is None or c is None else (bias, (ra, c))
        out = _forward(q3, k3, v3, scale, sqrt_p, written)
        ctx.save_for_backward(q3, k3, v3, sqrt_p, ra, c)
        ctx.scale, ctx.bias, ctx.shapes = scale, bias, (q.shape, k.shape, v.shape)
        return out.view(*q.shape[:3], v.shape[-1])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q3, k3, v3, sqrt_p, ra, c = ctx.saved_tensors
        bias: GaussianBias | None = ctx.bias
        go3 = _flat(grad_out.to(q3.dtype))
        bh, nq, nk = sqrt_p.shape
        dq, dk, dv = torch.empty_like(q3), torch.empty_like(k3), torch.empty_like(v3)
        with_bias = bias is not None and ra is not None and c is not None
        if with_bias:  # keys first, as factor_grads_into writes them; every patch query once per head
            dra_t = ra.new_empty(bh, ra.shape[2], ra.shape[1])
            dc_t = c.new_empty(bh, c.shape[2], c.shape[1])
            factors_t = (ra.transpose(1, 2), c.transpose(1, 2))
        blocks = head_row_blocks(bh, nq, nk)
        if with_bias:
            largest = max((h1 - h0) * (r1 - r0) for h0, h1, r0, r1 in blocks) * nk
            prod_buf = _scratch_buffer(largest, q3.dtype, q3.device, slot=4)
        for h0, h1, r0, r1 in blocks:
            numel = (h1 - h0) * (r1 - r0) * nk
            g, go = sqrt_p[h0:h1, r0:r1], go3[h0:h1, r0:r1]
            dp = _scratch_buffer(numel, q3.dtype, q3.device, slot=0).view_as(g)
            torch.bmm(go, v3[h0:h1].transpose(1, 2), out=dp)
            p = torch.mul(g, g, out=_scratch_buffer(numel, q3.dtype, q3.device, slot=1).view_as(g))
            beta = 0.0 if r0 == 0 else 1.0  # a head's first row block writes, later ones add
            dv[h0:h1].baddbmm_(p.transpose(1, 2), go, beta=beta)
            ds = support_vjp(dp.view(-1, nk), g.view(-1, nk), -1, out=p.view(-1, nk)).view_as(g)
            dq[h0:h1, r0:r1].baddbmm_(ds, k3[h0:h1], beta=0.0, alpha=ctx.scale)  # the scale in the product
            dk[h0:h1].baddbmm_(ds.transpose(1, 2), q3[h0:h1, r0:r1], beta=beta, alpha=ctx.scale)
            if with_bias:
                assert bias is not None
                _bias_grads_into(ds, bias, r0, factors_t, (dra_t, dc_t), h0, h1, prod_buf)
        q_shape, k_shape, v_shape = ctx.shapes
        dra = dra_t.transpose(1, 2) if with_bias else None
        dc = dc_t.transpose(1, 2) if with_bias else None
        return dq.view(q_shape), dk.view(k_shape), dv.view(v_shape), dra, dc, None, None


def _bias_grads_into(
    ds: torch.Tensor,
    bias: GaussianBias,
    r0: int,
    factors_t: tuple[torch.Tensor, torch.Tensor],
    grads_t: tuple[torch.Tensor, torch.Tensor],
    h0: int,
    h1: int,
    prod_buf: torch.Tensor,
) -> None:
    """The factor gradients of heads ``h0:h1`` from the score gradient ``ds: (heads, rows, N)`` of
    query rows ``r0 ..`` (the bias' gradient is the scores'): its patch-key x patch-query part, keys
    first, through :func:`~vitattn.functional.blocked.factor_grads_into`."""
    p = bias.num_prefix_tokens
    first = max(r0, p)  # first patch query of the block
    stop = r0 + ds.shape[1]
    if first >= stop:
        return
    ds_p = ds[:, first - r0 :, p:].unflatten(-1, bias.grid_size).permute(0, 2, 3, 1)  # (h, gh, gw, rows')
    ra_t, c_t = (t[h0:h1] for t in factors_t)
    dra_t, dc_t = (t[h0:h1] for t in grads_t)
    factor_grads_into(ds_p, (ra_t, c_t), first - p, stop - p, (dra_t, dc_t), prod_buf)


def _check_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """``ValueError`` / ``TypeError`` naming the operand unless q, k, v are ``(B, H, N, D)`` tensors of
    one dtype, float32 or float64, with k, v sharing ``(B, H, Nk)`` and q, k sharing ``(B, H)`` and D."""
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


def entmax15_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, bias: GaussianBias | None = None
) -> torch.Tensor:
    """``entmax15(scale q kᵀ + bias) v`` for ``q: (B, H, Nq, D)``, ``k: (B, H, Nk, D)``,
    ``v: (B, H, Nk, Dv)`` (one floating dtype, float32 or float64 on the CPU): the row-blocked path,
    with autograd when an input requires a gradient (then ``sqrt(p): (B, H, Nq, Nk)`` is the one
    tensor of that size kept), forward only otherwise.

    ``bias``, a :class:`GaussianBias` for ``Nq = Nk = N`` tokens, is written block by block (no
    dense bias); with autograd its gradient reaches σ and α through the separable factors
    (:meth:`GaussianBias.scaled_factors`), from each block's score gradient.
    """
    _check_operands(q, k, v)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    factors = None
    if bias is not None:
        grad = grad or (torch.is_grad_enabled() and (bias.sigma.requires_grad or bias.alpha.requires_grad))
        if q.shape[2] != bias.num_tokens or k.shape[2] != bias.num_tokens:
            raise ValueError(
                f"bias describes N = {bias.num_tokens} tokens, but q is {tuple(q.shape)} and k is "
                f"{tuple(k.shape)}"
            )
        factors = _flat_factors(bias, q.shape[0], q.shape[1], q.dtype)
    if grad:
        ra, c = (None, None) if factors is None else factors
        return _Entmax15Attention.apply(q, k, v, ra, c, float(scale), bias)
    written = None if bias is None or factors is None else (bias, factors)
    out = _forward(_flat(q), _flat(k), _flat(v), float(scale), None, written)
    return out.view(*q.shape[:3], v.shape[-1])
