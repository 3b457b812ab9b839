"""Softmax attention with a :class:`GaussianBias`, computed one block of query rows at a time.

The CPU path for LocAt attention. Handing SDPA the bias as a dense ``(B, H, N, N)`` float mask
costs a full write of that tensor plus SDPA's read of it; here, one head at a time, each block of
query rows gets its bias rows written into a small reused buffer (a few MiB), the scores are added
into the same buffer by ``baddbmm``, normalized in place and multiplied by ``v``. Same result as
the reference formula, no ``N x N`` tensor. :func:`gaussian_softmax_attention` is forward only
(inference); :func:`gaussian_softmax_attention_train` is the same forward as an autograd function
whose backward recomputes each row block, for training.

Working per head, batched over B, lets the matmuls read q, k, v as the strided views a fused qkv
projection gives (no copies) and write the output in ``(B, N, H, Dv)`` memory order, so that
merging the heads afterwards is free. The block buffers are kept per thread, device and dtype and
reused across calls, so that no layer allocates (and faults in) fresh pages for them. The
measurements behind these choices are in docs/benchmarks.md.
"""

from __future__ import annotations

import threading

import torch

from .gaussian import GaussianBias

__all__ = ["block_rows_for", "gaussian_softmax_attention", "gaussian_softmax_attention_train"]

# ~5 MiB of float32 scores per block (L3-sized; see docs/benchmarks.md for the block-size measurements)
_BLOCK_ELEMENTS = 5 * 2**18


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
    max_rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """What both row-blocked paths start from: q, k, v with a unit last stride, the bias factors
    ``alpha R: (B, H, Np, gh)`` and ``C: (B, H, Np, gw)`` in q's dtype, and the rows per block
    (at most ``max_rows``)."""
    b, h, n, _ = q.shape
    rows = block_rows_for(b, n, n) if block_rows is None else int(block_rows)
    if rows < 1:
        raise ValueError(f"block_rows must be >= 1, got {block_rows}")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    ra, c = bias.scaled_factors(q.dtype)
    return q, k, v, ra.expand(b, h, *ra.shape[2:]), c.expand(b, h, *c.shape[2:]), min(rows, max_rows)


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
    b, h, n, _ = q.shape
    dv = v.shape[-1]
    q, k, v, ra, c, rows = _prepare(q, k, v, bias, block_rows, n)
    scratch = _scratch_buffer(b * rows * n, q.dtype, q.device)
    out = torch.empty(b, n, h, dv, dtype=v.dtype, device=v.device)
    for j in range(h):  # one head at a time, batched over B: q, k, v are read in place
        q_j, kt_j, v_j = q[:, j], k[:, j].transpose(1, 2), v[:, j]  # (B, N, D), (B, D, N), (B, N, Dv)
        factors = (ra[:, j : j + 1], c[:, j : j + 1])
        for start in range(0, n, rows):
            stop = min(n, start + rows)
            scores = scratch[: b * (stop - start) * n].view(b, 1, stop - start, n)
            bias.write_rows(scores, start, factors)
            scores3 = scores[:, 0]
            scores3.baddbmm_(q_j[:, start:stop], kt_j, alpha=scale)
            torch.softmax(scores3, dim=-1, out=scores3)  # row by row, so in place is safe (and tested)
            torch.bmm(scores3, v_j, out=out[:, start:stop, j])
    return out.transpose(1, 2)


def _row_blocks(n: int, prefix: int, rows: int) -> list[tuple[int, int]]:
    """``(start, stop)`` query-row blocks: the prefix rows on their own, then patch rows ``rows`` at a time.

    A block never mixes prefix and patch rows, so a block's patch columns ``[:, :, prefix:]`` of a
    ``(B, rows, N)`` buffer fold to ``(B * rows, gh, gw)`` without a copy.
    """
    blocks = [(0, prefix)] if prefix else []
    return blocks + [(s, min(n, s + rows)) for s in range(prefix, n, rows)]


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
        b, h, n, _ = q.shape
        dv = v.shape[-1]
        blocks = _row_blocks(n, bias.num_prefix_tokens, rows)
        scratch = _scratch_buffer(b * max(rows, bias.num_prefix_tokens) * n, q.dtype, q.device)
        out = torch.empty(b, n, h, dv, dtype=v.dtype, device=v.device)
        for j in range(h):
            q_j, kt_j, v_j = q[:, j], k[:, j].transpose(1, 2), v[:, j]
            factors = (ra[:, j : j + 1], c[:, j : j + 1])
            for start, stop in blocks:
                scores = scratch[: b * (stop - start) * n].view(b, 1, stop - start, n)
                bias.write_rows(scores, start, factors)
                scores3 = scores[:, 0]
                scores3.baddbmm_(q_j[:, start:stop], kt_j, alpha=scale)
                torch.softmax(scores3, dim=-1, out=scores3)
                torch.bmm(scores3, v_j, out=out[:, start:stop, j])
        out = out.transpose(1, 2)
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
        delta = (go * out).sum(-1, keepdim=True)  # (B, H, N, 1): rowsum(dO * O)
        # (H, B, N, D) memory order: each head's (B, N, D) slice is contiguous, which baddbmm_ needs
        # to accumulate in one batched call (on a strided slice it falls back to an addmm_ per entry)
        dq = torch.empty(h, b, n, d, dtype=q.dtype, device=q.device)
        dk = torch.zeros(h, b, n, d, dtype=k.dtype, device=k.device)
        dvv = torch.zeros(h, b, n, v.shape[-1], dtype=v.dtype, device=v.device)
        dra = torch.zeros_like(ra, memory_format=torch.contiguous_format)
        dc = torch.zeros_like(c, memory_format=torch.contiguous_format)
        numel = b * max(rows, p) * n
        probs_buf = _scratch_buffer(numel, q.dtype, q.device, slot=0)
        grad_buf = _scratch_buffer(numel, q.dtype, q.device, slot=1)
        for j in range(h):
            q_j, k_j, v_j, go_j = q[:, j], k[:, j], v[:, j], go[:, j]
            dk_j, dv_j = dk[j], dvv[j]
            factors = (ra[:, j : j + 1], c[:, j : j + 1])
            for start, stop in _row_blocks(n, p, rows):
                r = stop - start
                probs4 = probs_buf[: b * r * n].view(b, 1, r, n)
                bias.write_rows(probs4, start, factors)
                probs = probs4[:, 0]
                probs.baddbmm_(q_j[:, start:stop], k_j.transpose(1, 2), alpha=scale)
                # P of the forward, bit for bit: a block holds whole rows, so the softmax needs no saved
                # logsumexp (and is faster than exp(S - lse) here: torch's exp_ is the slower kernel)
                torch.softmax(probs, dim=-1, out=probs)
                dv_j.baddbmm_(probs.transpose(1, 2), go_j[:, start:stop])
                ds = grad_buf[: b * r * n].view(b, r, n)
                torch.bmm(go_j[:, start:stop], v_j.transpose(1, 2), out=ds)  # dP
                ds.sub_(delta[:, j, start:stop]).mul_(probs)  # dS = P * (dP - delta): d(scores)
                torch.bmm(ds, k_j, out=dq[j, :, start:stop])
                dk_j.baddbmm_(ds.transpose(1, 2), q_j[:, start:stop])
                if start >= p:  # d bias = dS on patch rows x patch columns; S = (alpha R)[row] * C[col]
                    ds_p = ds[:, :, p:].reshape(b * r, gh, gw)  # a view: the block holds patch rows only
                    lo, hi = start - p, stop - p
                    c_blk = c[:, j, lo:hi].reshape(b * r, 1, gw)
                    ra_blk = ra[:, j, lo:hi].reshape(b * r, 1, gh)
                    # d(alpha R) = dS C as a row vector times dSᵀ: ~2.5x faster than the matrix-vector bmm
                    dra[:, j, lo:hi] = torch.bmm(c_blk, ds_p.transpose(1, 2)).view(b, r, gh)
                    dc[:, j, lo:hi] = torch.bmm(ra_blk, ds_p).view(b, r, gw)
        dq.mul_(scale)
        dk.mul_(scale)
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
    recomputes each block's probabilities with the same softmax, bit for bit, which on the CPU is
    cheaper than ``exp(S - logsumexp)``). The backward gives dq, dk, dv (with the row statistic
    ``rowsum(dO * O)``) and the gradients of the separable factors ``alpha R`` and ``C``
    (:meth:`GaussianBias.scaled_factors`), which autograd carries on to σ and α. Extra memory: two
    reused ``(B, rows, N)`` block buffers, never an ``(B, H, N, N)`` tensor.

    Args:
        q, k: ``(B, H, N, D)``; v: ``(B, H, N, Dv)``; float32 or float64, one dtype, same N.
        bias: the Gaussian bias (``sigma``/``alpha`` may broadcast over B, H).
        block_rows: patch rows per block (default :func:`block_rows_for`); prefix rows form their own block.
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
    q, k, v, ra, c, rows = _prepare(q, k, v, bias, block_rows, max(1, n - bias.num_prefix_tokens))
    return _GaussianSoftmaxFunction.apply(q, k, v, ra, c, float(scale), bias, rows)
