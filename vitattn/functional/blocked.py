"""Softmax attention with a :class:`GaussianBias`, computed one block of query rows at a time.

The CPU path for LocAt attention. Handing SDPA the bias as a dense ``(B, H, N, N)`` float mask
costs a full write of that tensor plus SDPA's read of it; here, one head at a time, each block of
query rows gets its bias written into a small reused buffer (a few MiB), the scores are added
into the same buffer by ``baddbmm``, exponentiated in place and multiplied by ``v``, and the
``(rows, Dv)`` output is divided by the row sums. Same result as the reference formula, no
``N x N`` tensor. A block is stored keys first, ``(B, N, rows)``: the query index is then the
contiguous one for the bias factors too, so the bias is one vectorized outer product, and the
exponentials are ``exp2`` of log2(e)-scaled scores (torch's ``exp2`` is ~3x its ``exp`` on the CPU).
:func:`gaussian_softmax_attention` is forward only (inference);
:func:`gaussian_softmax_attention_train` is the same forward as an autograd function whose
backward recomputes each row block, for training.

Working per head, batched over B, lets the matmuls read q, k, v as the strided views a fused qkv
projection gives (no copies) and write the output in ``(B, N, H, Dv)`` memory order, so that
merging the heads afterwards is free. The block buffers are kept per thread, device and dtype and
reused across calls, so that no layer allocates (and faults in) fresh pages for them. The
measurements behind these choices are in docs/benchmarks.md.
"""

from __future__ import annotations

import math
import threading

import torch

from .gaussian import ColumnBlock, GaussianBias

__all__ = ["block_rows_for", "gaussian_softmax_attention", "gaussian_softmax_attention_train"]

# ~5 MiB of float32 scores per block (L3-sized; see docs/benchmarks.md for the block-size measurements)
_BLOCK_ELEMENTS = 5 * 2**18
_LOG2E = 1.4426950408889634  # exp(x) = 2 ** (x * log2(e))
_MIN_ROW_SUM = 2.0**-64  # unshifted row sums at least this are exact, see _sums_in_range


_scratch = threading.local()


def _scratch_buffer(numel: int, dtype: torch.dtype, device: torch.device, slot: int = 0) -> torch.Tensor:
    """A flat buffer of at least ``numel`` elements, reused by later calls on this thread.

    ``slot`` tells apart buffers needed at the same time (0 and 5: the forward's block and output
    block; 0, 1 and 4: the backward's; 2 and 3: entmax15's chunks; 0 and 1 also the blocks of
    :mod:`.blocked_entmax`, whose calls never overlap these). Always a normal
    tensor, even when first asked for under ``torch.inference_mode`` (an inference tensor could not
    be written in place by a later training call).
    """
    cache: dict[tuple[torch.device, torch.dtype, int], torch.Tensor] = _scratch.__dict__.setdefault(
        "buffers", {}
    )
    buf = cache.get((device, dtype, slot))
    if buf is None or buf.numel() < numel:
        with torch.inference_mode(False):
            buf = torch.empty(numel, dtype=dtype, device=device)
        cache[(device, dtype, slot)] = buf
    return buf[:numel]


def block_rows_for(batch: int, num_keys: int, num_queries: int) -> int:
    """Query rows per block: blocks of near-equal size with ``batch * rows * num_keys`` at most ~1.3M
    (but at least 16 rows)."""
    limit = max(16, _BLOCK_ELEMENTS // max(1, batch * num_keys))
    blocks = -(-num_queries // limit)
    return -(-num_queries // blocks)


def _prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: GaussianBias,
    block_rows: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """What both row-blocked paths start from: q, k, v with a unit last stride, the bias factors
    keys first, ``log2(e) (alpha R)ᵀ: (B, H, gh, Np)`` and ``Cᵀ: (B, H, gw, Np)`` in q's dtype
    (:meth:`GaussianBias.key_major_factors`), and the rows per block (at most N)."""
    b, h, n, _ = q.shape
    rows = block_rows_for(b, n, n) if block_rows is None else int(block_rows)
    if rows < 1:
        raise ValueError(f"block_rows must be >= 1, got {block_rows}")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    ra_t, c_t = bias.key_major_factors(q.dtype, scale=_LOG2E)
    return q, k, v, ra_t.expand(b, h, *ra_t.shape[2:]), c_t.expand(b, h, *c_t.shape[2:]), min(rows, n)


def _blocks(buf: torch.Tensor, b: int, n: int, rows: int, bias: GaussianBias) -> list[ColumnBlock]:
    """The query-row blocks of one head, each a keys-first ``(B, N, rows)`` view of ``buf`` with
    its bias views made once (every head reuses them)."""
    blocks = []
    for start in range(0, n, rows):
        r = min(n, start + rows) - start
        blocks.append(bias.column_block(buf[: b * n * r].view(b, n, r), start))
    return blocks


def _exp2_step(
    block: ColumnBlock,
    q_t: torch.Tensor,
    k_j: torch.Tensor,
    factors_j: tuple[torch.Tensor, torch.Tensor],
    alpha: float,
    shift: bool,
) -> torch.Tensor:
    """Unnormalized probabilities of one head's query rows ``block.start:block.stop``, keys first:
    ``E[:, t, s] = 2 ** (log2(e) (score + bias)[start + s, t] - m_s)`` written into ``block.out:
    (B, N, rows)`` and returned, with ``m_s`` the row maximum if ``shift``, else 0.

    ``q_t: (B, D, N)`` (q transposed), ``k_j: (B, N, D)``, ``factors_j``: one head of the keys-first
    factors, ``alpha = scale * log2(e)``. Keys first makes the bias write one vectorized outer product
    (:meth:`ColumnBlock.write`); ``exp2`` is several times faster than ``exp`` on the CPU.
    """
    e = block.write(factors_j)
    e.baddbmm_(k_j, q_t if block.all_rows else q_t[..., block.start : block.stop], alpha=alpha)
    if shift:
        e.sub_(e.amax(dim=1, keepdim=True))
    return e.exp2_()


def factor_grads_into(
    ds_p: torch.Tensor,
    factors_t: tuple[torch.Tensor, torch.Tensor],
    lo: int,
    hi: int,
    grads_t: tuple[torch.Tensor, torch.Tensor],
    prod_buf: torch.Tensor,
) -> None:
    """The separable bias' factor gradients from one block's bias gradient, keys first.

    ``ds_p: (..., gh, gw, rows)`` is the gradient of the bias between patch keys and the patch
    queries ``lo:hi``; ``factors_t`` are ``(alpha R)ᵀ: (..., gh, Np)`` and ``Cᵀ: (..., gw, Np)``, the
    bias being ``(alpha R)[q, row_t] * C[q, col_t]``. Writes ``d(alpha R) = sum over columns of dS C``
    and ``dC = sum over rows of dS (alpha R)`` into columns ``lo:hi`` of ``grads_t`` (same shapes as
    ``factors_t``); ``prod_buf`` is flat scratch of at least ``ds_p.numel()`` elements.
    """
    ra_t, c_t = factors_t
    dra_t, dc_t = grads_t
    prod = prod_buf[: ds_p.numel()].view(ds_p.shape)
    torch.mul(ds_p, c_t[..., None, :, lo:hi], out=prod)
    torch.sum(prod, dim=-2, out=dra_t[..., lo:hi])
    torch.mul(ds_p, ra_t[..., :, None, lo:hi], out=prod)
    torch.sum(prod, dim=-3, out=dc_t[..., lo:hi])


def _sums_in_range(sums: torch.Tensor) -> bool:
    """Whether every row sum lies in ``[2^-64, inf)``, where the unshifted exponentials are exact.

    Then nothing overflowed, and the terms ``exp2`` flushed to zero (each below ``2^-126``) add at
    most ``N * 2^-62`` relative to their row. Otherwise (a row whose scores are all below about
    -44, or one near float32's exp range, or a NaN) the rows are recomputed with the maxima
    subtracted, as a softmax does.
    """
    return bool(((sums >= _MIN_ROW_SUM) & (sums < math.inf)).all())


def _blocked_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    factors_t: tuple[torch.Tensor, torch.Tensor],
    scale: float,
    bias: GaussianBias,
    rows: int,
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The row-blocked forward of both entry points, one head and row block at a time:
    ``(output: (B, H, N, Dv), a view of (B, N, H, Dv); row sums: (H, B, N); whether the maxima
    were subtracted)``.

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
    blocks = _blocks(_scratch_buffer(b * rows * n, q.dtype, q.device), b, n, rows, bias)
    out_buf = _scratch_buffer(b * rows * dv, v.dtype, v.device, slot=5)
    out_blocks = [out_buf[: b * blk.rows * dv].view(b, blk.rows, dv) for blk in blocks]
    alpha = scale * _LOG2E
    for shift in (False, True):
        for j in range(h):  # one head at a time, batched over B: q, k, v are read in place
            q_t, k_j, v_j, out_j = q[:, j].transpose(1, 2), k[:, j], v[:, j], out[:, :, j]
            factors_j = (factors_t[0][:, j], factors_t[1][:, j])
            for block, o in zip(blocks, out_blocks, strict=True):
                e = _exp2_step(block, q_t, k_j, factors_j, alpha, shift)
                span = slice(block.start, block.stop)
                sums_b = torch.sum(e, dim=1, out=sums[j, :, span])
                torch.bmm(e.transpose(1, 2), v_j, out=o)
                torch.div(o, sums_b.unsqueeze(-1), out=out_j if block.all_rows else out_j[:, span])
        if shift or _sums_in_range(sums):
            break
    return out.transpose(1, 2), sums, shift


def gaussian_softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    bias: GaussianBias,
    block_rows: int | None = None,
) -> torch.Tensor:
    """``softmax(q kᵀ * scale + bias) v`` without an ``N x N`` tensor; no autograd.

    Args:
        q, k: ``(B, H, N, D)``; v: ``(B, H, N, Dv)``; one floating dtype (float32 or float64); any
            strides with a unit last stride are read in place.
        bias: describes the ``(B, H, N, N)`` Gaussian bias (``sigma``/``alpha`` may broadcast over B, H).
        block_rows: query rows per block (default :func:`block_rows_for`).

    Returns:
        ``(B, H, N, Dv)`` in ``v``'s dtype: a view of a ``(B, N, H, Dv)`` contiguous tensor.
    """
    q, k, v, ra_t, c_t, rows = _prepare(q, k, v, bias, block_rows)
    return _blocked_forward(q, k, v, (ra_t, c_t), scale, bias, rows)[0]


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
        rows: int,
    ) -> torch.Tensor:
        out, sums, shift = _blocked_forward(q, k, v, (ra_t, c_t), scale, bias, rows)
        ctx.save_for_backward(q, k, v, ra_t, c_t, out, sums)
        ctx.scale, ctx.bias, ctx.rows, ctx.shift = scale, bias, rows, shift
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, ra_t, c_t, out, sums = ctx.saved_tensors
        grads = _blocked_backward(
            grad_out, q, k, v, (ra_t, c_t), out, sums, ctx.scale, ctx.bias, ctx.rows, ctx.shift
        )
        return *grads, None, None, None


def _blocked_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    factors_t: tuple[torch.Tensor, torch.Tensor],
    out: torch.Tensor,
    sums: torch.Tensor,
    scale: float,
    bias: GaussianBias,
    rows: int,
    shift: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, d ra_t, d c_t)`` of :func:`_blocked_forward`'s output ``out`` with its row sums
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
    numel = b * rows * n
    prob_blocks = _blocks(_scratch_buffer(numel, q.dtype, q.device, slot=0), b, n, rows, bias)
    grad_blocks = _blocks(_scratch_buffer(numel, q.dtype, q.device, slot=1), b, n, rows, bias)
    prod_buf = _scratch_buffer(numel, q.dtype, q.device, slot=4)
    alpha = scale * _LOG2E
    for j in range(h):
        q_j, k_j, v_j, go_j, delta_j = q[:, j], k[:, j], v[:, j], go_s[:, j], delta_s[:, j]
        q_t, dk_j, dv_j, dq_j = q_j.transpose(1, 2), dk[j], dvv[j], dq[j]
        ra_j, c_j = ra_t[:, j], c_t[:, j]
        for pb, gb in zip(prob_blocks, grad_blocks, strict=True):
            first_block = pb.start == 0
            span = slice(pb.start, pb.stop)
            # Eᵀ of the block, keys first, recomputed exactly as the forward computed it
            e = _exp2_step(pb, q_t, k_j, (ra_j, c_j), alpha, shift)
            go_b = go_j if pb.all_rows else go_j[:, span]  # (B, rows, Dv), divided by the sums
            if first_block:
                torch.bmm(e, go_b, out=dv_j)
            else:
                dv_j.baddbmm_(e, go_b)
            ds = gb.out
            torch.bmm(v_j, go_b.transpose(1, 2), out=ds)  # dPᵀ / sums
            ds.sub_(delta_j if pb.all_rows else delta_j[..., span]).mul_(e)  # dSᵀ: d(scores)ᵀ
            q_b = q_j if pb.all_rows else q_j[:, span]
            # the scale inside the products (beta = 0: the first write reads nothing)
            dq_b = dq_j if pb.all_rows else dq_j[:, span]
            dq_b.baddbmm_(ds.transpose(1, 2), k_j, beta=0.0, alpha=scale)
            dk_j.baddbmm_(ds, q_b, beta=0.0 if first_block else 1.0, alpha=scale)
            if gb.patches is not None:  # dS on patch keys x patch queries: (B, gh, gw, rows')
                grads_j = (dra_t[:, j], dc_t[:, j])
                factor_grads_into(gb.patches, (ra_j, c_j), gb.lo, gb.hi, grads_j, prod_buf)
    # the bias in log2 units is ra_t * c_t = log2(e) * bias, so each factor's gradient is
    # 1 / log2(e) of the sums above
    dra_t.mul_(1.0 / _LOG2E)
    dc_t.mul_(1.0 / _LOG2E)
    return dq.transpose(0, 1), dk.transpose(0, 1), dvv.transpose(0, 1), dra_t, dc_t


def gaussian_softmax_attention_train(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    bias: GaussianBias,
    *,
    block_rows: int | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``softmax(q kᵀ * scale + bias) v`` with autograd to q, k, v, ``bias.sigma`` and ``bias.alpha``,
    never building an ``N x N`` tensor.

    The forward works in row blocks like :func:`gaussian_softmax_attention` and saves its inputs,
    its output and the row sums ``(H, B, N)`` (a block always holds whole rows, so the backward
    recomputes each block's unnormalized probabilities with the forward's own block step, which on
    the CPU is cheaper than ``exp(S - logsumexp)``). The backward gives dq, dk, dv (with the row
    statistic ``rowsum(dO * O)``) and the gradients of the separable factors ``alpha R`` and ``C``
    (:meth:`GaussianBias.key_major_factors`), which autograd carries on to σ and α. Extra memory:
    reused per-thread buffers (three ``(B, N, rows)`` blocks and a ``(B, rows, Dv)`` output block)
    and the ``(H, B, N)`` row sums, never an ``(B, H, N, N)`` tensor.

    Args:
        q, k: ``(B, H, N, D)``; v: ``(B, H, N, Dv)``; float32 or float64, one dtype, same N.
        bias: the Gaussian bias (``sigma``/``alpha`` may broadcast over B, H).
        block_rows: query rows per block (default :func:`block_rows_for`).
        mask: not supported: anything but ``None`` raises (masked calls take the dense path).

    Returns:
        ``(B, H, N, Dv)``: a view of a ``(B, N, H, Dv)`` contiguous tensor.
    """
    if mask is not None:
        raise ValueError(
            "gaussian_softmax_attention_train takes no mask (got one of shape "
            f"{tuple(mask.shape)}): masked Gaussian-biased attention goes through the dense path"
        )
    if q.dtype not in (torch.float32, torch.float64) or not (q.dtype == k.dtype == v.dtype):
        raise ValueError(
            f"q, k, v must share one dtype, float32 or float64; got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    b, h, n, _ = q.shape
    if k.shape[:3] != (b, h, n) or v.shape[:3] != (b, h, n) or n != bias.num_tokens:
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must be (B, H, N, D) with one "
            f"N = bias.num_tokens = {bias.num_tokens}"
        )
    q, k, v, ra_t, c_t, rows = _prepare(q, k, v, bias, block_rows)
    return _GaussianSoftmaxFunction.apply(q, k, v, ra_t, c_t, float(scale), bias, rows)
