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

from .gaussian import GaussianBias

__all__ = ["block_rows_for", "gaussian_softmax_attention", "gaussian_softmax_attention_train"]

# ~5 MiB of float32 scores per block (L3-sized; see docs/benchmarks.md for the block-size measurements)
_BLOCK_ELEMENTS = 5 * 2**18
# inference only: keys-first blocks of ~400 query rows ran ~2.5 % faster than one 785-row block at
# 448 px, batch 2 (6 fresh processes; 262 and 128 rows were slower; training was the same either way)
_INFERENCE_MAX_ROWS = 512
_LOG2E = 1.4426950408889634  # exp(x) = 2 ** (x * log2(e))
_MIN_ROW_SUM = 2.0**-64  # unshifted row sums at least this are exact, see _exp2_block


_scratch = threading.local()


def _scratch_buffer(numel: int, dtype: torch.dtype, device: torch.device, slot: int = 0) -> torch.Tensor:
    """A flat buffer of at least ``numel`` elements, reused by later calls on this thread.

    ``slot`` tells apart buffers needed at the same time (the backward uses two). Always a normal
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


def block_rows_for(batch: int, num_keys: int, num_queries: int, max_rows: int | None = None) -> int:
    """Query rows per block: blocks of near-equal size with ``batch * rows * num_keys`` at most ~1.3M
    and at most ``max_rows`` rows (but at least 16 rows)."""
    limit = _BLOCK_ELEMENTS // max(1, batch * num_keys)
    limit = max(16, limit if max_rows is None else min(max_rows, limit))
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
    ``alpha R: (B, H, Np, gh)`` and ``C: (B, H, Np, gw)`` in q's dtype, and the rows per block
    (at most N)."""
    b, h, n, _ = q.shape
    rows = block_rows_for(b, n, n) if block_rows is None else int(block_rows)
    if rows < 1:
        raise ValueError(f"block_rows must be >= 1, got {block_rows}")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    ra, c = bias.scaled_factors(q.dtype)
    return q, k, v, ra.expand(b, h, *ra.shape[2:]), c.expand(b, h, *c.shape[2:]), min(rows, n)


def _key_major_factors(ra: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``log2(e) * (alpha R)ᵀ: (B, H, gh, Np)`` and ``Cᵀ: (B, H, gw, Np)``, contiguous: the bias
    factors with the query index last, as :func:`_exp2_block` reads them."""
    ra_t = torch.empty(*ra.shape[:2], ra.shape[-1], ra.shape[-2], dtype=ra.dtype, device=ra.device)
    torch.mul(ra.transpose(-1, -2), _LOG2E, out=ra_t)
    return ra_t, c.transpose(-1, -2).contiguous()


def _exp2_block_once(
    buf: torch.Tensor,
    q_j: torch.Tensor,
    k_j: torch.Tensor,
    factors_t: tuple[torch.Tensor, torch.Tensor],
    start: int,
    stop: int,
    scale: float,
    bias: GaussianBias,
    shift: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One try of :func:`_exp2_block`.

    Writes ``E[:, t, s] = 2 ** (log2(e) * (score + bias)[start + s, t] - m_s)`` into ``buf``
    viewed as ``(B, N, rows)``, with ``m_s`` the row maximum if ``shift``, else 0, and returns
    ``(E, row sums: (B, rows))``. Keys first makes the bias write one vectorized outer product
    (:meth:`GaussianBias.write_columns`), and ``exp2`` is several times faster than ``exp`` on the
    CPU (measurements in docs/benchmarks.md).

    ``q_j, k_j: (B, N, D)``; ``factors_t``: one head of :func:`_key_major_factors`, ``(B, gh, Np)``
    and ``(B, gw, Np)``.
    """
    b, n, _ = k_j.shape
    rows = stop - start
    e = buf[: b * n * rows].view(b, n, rows)
    ra_t, c_t = factors_t
    bias.write_columns(e.unsqueeze(1), start, (ra_t.unsqueeze(1), c_t.unsqueeze(1)))
    e.baddbmm_(k_j, q_j[:, start:stop].transpose(1, 2), alpha=scale * _LOG2E)
    if shift:
        e.sub_(e.amax(dim=1, keepdim=True))
    sums = e.exp2_().sum(dim=1)
    return e, sums


def _exp2_block(
    buf: torch.Tensor,
    q_j: torch.Tensor,
    k_j: torch.Tensor,
    factors_t: tuple[torch.Tensor, torch.Tensor],
    start: int,
    stop: int,
    scale: float,
    bias: GaussianBias,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unnormalized probabilities of query rows ``start:stop`` of one head, keys first:
    ``(E: (B, N, rows), row sums: (B, rows))`` with ``softmax = E / sums``.

    First without subtracting the row maxima (two passes fewer). That is exact whenever every row
    sum lies in ``[2^-64, inf)``: nothing overflowed, and the terms ``exp2`` flushed to zero (each
    below ``2^-126``) add at most ``N * 2^-62`` relative to their row. Otherwise (a row whose scores
    are all below about -44, or one near float32's exp range) the block is recomputed with the
    maxima subtracted, as a softmax does.
    """
    args = (buf, q_j, k_j, factors_t, start, stop, scale, bias)
    e, sums = _exp2_block_once(*args, shift=False)
    if bool(((sums >= _MIN_ROW_SUM) & (sums < math.inf)).all()):
        return e, sums
    return _exp2_block_once(*args, shift=True)


def _blocked_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ra: torch.Tensor,
    c: torch.Tensor,
    scale: float,
    bias: GaussianBias,
    rows: int,
) -> torch.Tensor:
    """The row-blocked forward of both entry points: ``(B, H, N, Dv)``, a view of ``(B, N, H, Dv)``."""
    b, h, n, _ = q.shape
    dv = v.shape[-1]
    factors_t = _key_major_factors(ra, c)
    scratch = _scratch_buffer(b * rows * n, q.dtype, q.device)
    out = torch.empty(b, n, h, dv, dtype=v.dtype, device=v.device)
    for j in range(h):  # one head at a time, batched over B: q, k, v are read in place
        q_j, k_j, v_j = q[:, j], k[:, j], v[:, j]  # (B, N, D), (B, N, D), (B, N, Dv)
        head_factors = (factors_t[0][:, j], factors_t[1][:, j])
        for start in range(0, n, rows):
            stop = min(n, start + rows)
            e, sums = _exp2_block(scratch, q_j, k_j, head_factors, start, stop, scale, bias)
            o = out[:, start:stop, j]
            torch.bmm(e.transpose(1, 2), v_j, out=o)
            o.div_(sums.unsqueeze(-1))  # normalize the (rows, Dv) output, not the (N, rows) block
    return out.transpose(1, 2)


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
        block_rows: query rows per block (default :func:`block_rows_for`, at most 512 rows).

    Returns:
        ``(B, H, N, Dv)`` in ``v``'s dtype: a view of a ``(B, N, H, Dv)`` contiguous tensor.
    """
    b, _, n, _ = q.shape
    if block_rows is None:
        block_rows = block_rows_for(b, n, n, max_rows=_INFERENCE_MAX_ROWS)
    q, k, v, ra, c, rows = _prepare(q, k, v, bias, block_rows)
    return _blocked_forward(q, k, v, ra, c, scale, bias, rows)


class _GaussianSoftmaxFunction(torch.autograd.Function):
    """Gaussian-biased softmax attention with a row-blocked backward (see
    :func:`gaussian_softmax_attention_train`); inputs are already expanded to ``(B, H, ...)``."""

    @staticmethod
    def forward(
        ctx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ra: torch.Tensor,
        c: torch.Tensor,
        scale: float,
        bias: GaussianBias,
        rows: int,
    ) -> torch.Tensor:
        out = _blocked_forward(q, k, v, ra, c, scale, bias, rows)
        ctx.save_for_backward(q, k, v, ra, c, out)
        ctx.scale, ctx.bias, ctx.rows = scale, bias, rows
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, ra, c, out = ctx.saved_tensors
        scale, bias, rows = ctx.scale, ctx.bias, ctx.rows
        p = bias.num_prefix_tokens
        gh, gw = bias.grid_size
        b, h, n, d = q.shape
        go = grad_out.to(v.dtype)
        delta = (go * out).sum(-1).unsqueeze(2)  # (B, H, 1, N): rowsum(dO * O), keys-first broadcast
        # (H, B, N, D) memory order: each head's (B, N, D) slice is contiguous, which baddbmm_ needs
        # to accumulate in one batched call (on a strided slice it falls back to an addmm_ per entry)
        dq = torch.empty(h, b, n, d, dtype=q.dtype, device=q.device)
        dk = torch.empty(h, b, n, d, dtype=k.dtype, device=k.device)  # the first block writes, others add
        dvv = torch.empty(h, b, n, v.shape[-1], dtype=v.dtype, device=v.device)
        n_p = gh * gw
        # keys-first like the factors; every patch query's column is written by exactly one block
        dra_t = torch.empty(b, h, gh, n_p, dtype=ra.dtype, device=ra.device)
        dc_t = torch.empty(b, h, gw, n_p, dtype=c.dtype, device=c.device)
        factors_t = _key_major_factors(ra, c)
        numel = b * rows * n
        probs_buf = _scratch_buffer(numel, q.dtype, q.device, slot=0)
        grad_buf = _scratch_buffer(numel, q.dtype, q.device, slot=1)
        prod_buf = _scratch_buffer(numel, q.dtype, q.device, slot=4)  # slots 2, 3 are entmax15's
        for j in range(h):
            q_j, k_j, v_j, go_j = q[:, j], k[:, j], v[:, j], go[:, j]
            dk_j, dv_j = dk[j], dvv[j]
            ra_t, c_t = factors_t[0][:, j], factors_t[1][:, j]
            for start in range(0, n, rows):
                stop = min(n, start + rows)
                r = stop - start
                # Eᵀ of the block, keys first, recomputed as the forward computed it; P = E / sums is
                # never formed: dO and delta are divided by the sums instead (rows x Dv, not N x rows),
                # so dSᵀ = Eᵀ * (v (dO / sums)ᵀ - delta / sums) = Pᵀ * (dPᵀ - delta) exactly
                e, sums = _exp2_block(probs_buf, q_j, k_j, (ra_t, c_t), start, stop, scale, bias)
                go_s = go_j[:, start:stop] / sums.unsqueeze(-1)
                if start == 0:
                    torch.bmm(e, go_s, out=dv_j)
                else:
                    dv_j.baddbmm_(e, go_s)
                ds = grad_buf[: b * n * r].view(b, n, r)
                torch.bmm(v_j, go_s.transpose(1, 2), out=ds)  # dPᵀ / sums
                ds.sub_(delta[:, j, :, start:stop] / sums.unsqueeze(1)).mul_(e)  # dSᵀ: d(scores)ᵀ
                torch.bmm(ds.transpose(1, 2), k_j, out=dq[j, :, start:stop])
                if start == 0:
                    torch.bmm(ds, q_j[:, start:stop], out=dk_j)
                else:
                    dk_j.baddbmm_(ds, q_j[:, start:stop])
                first = max(start, p)
                if first < stop:  # d bias = dS on patch queries x patch keys; S = (alpha R)[row] * C[col]
                    lo, hi = first - p, stop - p
                    ds_p = ds[:, p:, first - start :].unflatten(1, (gh, gw))  # (B, gh, gw, rows')
                    prod = prod_buf[: ds_p.numel()].view(ds_p.shape)
                    torch.mul(ds_p, c_t[:, None, :, lo:hi], out=prod)
                    torch.sum(prod, dim=2, out=dra_t[:, j, :, lo:hi])  # d(alpha R) = sum_col dS C
                    torch.mul(ds_p, ra_t[:, :, None, lo:hi], out=prod)
                    torch.sum(prod, dim=1, out=dc_t[:, j, :, lo:hi])  # dC = sum_row dS (alpha R)
        dq.mul_(scale)
        dk.mul_(scale)
        dc_t.mul_(1.0 / _LOG2E)  # the keys-first alpha R carries the factor log2(e)
        # back to (B, H, Np, g) memory order: autograd's next step concatenates the two (a split's
        # backward), which is ~2x slower on transposed inputs than this copy
        dra, dc = dra_t.transpose(-1, -2).contiguous(), dc_t.transpose(-1, -2).contiguous()
        return dq.transpose(0, 1), dk.transpose(0, 1), dvv.transpose(0, 1), dra, dc, None, None, None


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

    The forward works in row blocks like :func:`gaussian_softmax_attention` and saves only its
    inputs and output (no row statistics: a block always holds whole rows, so the backward
    recomputes each block's probabilities with the forward's own block step, which on the CPU is
    cheaper than ``exp(S - logsumexp)``). The backward gives dq, dk, dv (with the row statistic
    ``rowsum(dO * O)``) and the gradients of the separable factors ``alpha R`` and ``C``
    (:meth:`GaussianBias.scaled_factors`), which autograd carries on to σ and α. Extra memory: three
    reused ``(B, N, rows)`` block buffers, never an ``(B, H, N, N)`` tensor.

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
    q, k, v, ra, c, rows = _prepare(q, k, v, bias, block_rows)
    return _GaussianSoftmaxFunction.apply(q, k, v, ra, c, float(scale), bias, rows)
