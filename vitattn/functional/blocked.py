"""Softmax attention with a :class:`GaussianBias`, computed one block of query rows at a time.

The CPU path for LocAt inference. Handing SDPA the bias as a dense ``(B, H, N, N)`` float mask
costs a full write of that tensor plus SDPA's read of it; here each block of query rows gets its
bias rows written into a small reused buffer (a few MiB, so it stays in cache), the scores are
added into the same buffer by ``baddbmm``, normalized in place and multiplied by ``v``. Same
result as the reference formula, no ``N x N`` tensor. Forward only: the autograd path goes through
SDPA.

The buffers (q, k, v copied into ``(B*H, N, D)`` order, and one block of scores) are kept per
thread, device and dtype and reused across calls: allocating them afresh makes the C allocator
hand memory back to the OS and fault it in again on every layer, which measured slower than the
dense path this replaces. (Reading q, k, v in place, one batch entry at a time, avoids the copies
but splits the matmuls over H instead of B*H: slower on 2 threads with 3 heads.)
"""

from __future__ import annotations

import threading

import torch

from .gaussian import GaussianBias

__all__ = ["block_rows_for", "gaussian_softmax_attention"]

_BLOCK_ELEMENTS = 5 * 2**17  # ~2.5 MiB of float32 scores per block: fast on the CPUs measured


_scratch = threading.local()


def _scratch_buffer(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A flat buffer of at least ``numel`` elements, reused by later calls on this thread."""
    cache: dict[tuple[torch.device, torch.dtype], torch.Tensor] = _scratch.__dict__.setdefault("buffers", {})
    buf = cache.get((device, dtype))
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype, device=device)
        cache[(device, dtype)] = buf
    return buf[:numel]


def block_rows_for(batch_heads: int, num_keys: int) -> int:
    """Query rows per block: a multiple of 16 that keeps ``batch_heads * rows * num_keys`` near 655k."""
    return max(16, _BLOCK_ELEMENTS // max(1, batch_heads * num_keys) // 16 * 16)


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
        q, k: ``(B, H, N, D)``; v: ``(B, H, N, Dv)``; all one floating dtype (float32 or float64).
        bias: describes the ``(B, H, N, N)`` Gaussian bias (``sigma``/``alpha`` may broadcast over B, H).
        block_rows: query rows per block (default :func:`block_rows_for`).

    Returns:
        ``(B, H, N, Dv)`` contiguous, in ``v``'s dtype.
    """
    b, h, n, d = q.shape
    dv = v.shape[-1]
    bh = b * h
    rows = block_rows_for(bh, n) if block_rows is None else int(block_rows)
    if rows < 1:
        raise ValueError(f"block_rows must be >= 1, got {block_rows}")
    rows = min(rows, n)
    block = bh * rows * n
    qkv_numel = bh * n * (2 * d + dv)
    scratch = _scratch_buffer(qkv_numel + block, q.dtype, q.device)
    # q, k, v (usually strided views of one qkv projection) copied into the reused buffer
    q3 = scratch[: bh * n * d].view(b, h, n, d).copy_(q).view(bh, n, d)
    k3t = scratch[bh * n * d : 2 * bh * n * d].view(b, h, n, d).copy_(k).view(bh, n, d).transpose(1, 2)
    v3 = scratch[2 * bh * n * d : qkv_numel].view(b, h, n, dv).copy_(v).view(bh, n, dv)
    scores_buf = scratch[qkv_numel:]
    ra, c = bias.scaled_factors(q.dtype)
    ra, c = ra.expand(b, h, *ra.shape[2:]), c.expand(b, h, *c.shape[2:])
    out = torch.empty(bh, n, dv, dtype=v.dtype, device=v.device)
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        size = bh * (stop - start) * n
        scores = scores_buf[:size].view(b, h, stop - start, n)
        bias.write_rows(scores, start, (ra, c))
        scores3 = scores.view(bh, stop - start, n)
        scores3.baddbmm_(q3[:, start:stop], k3t, alpha=scale)
        torch.softmax(scores3, dim=-1, out=scores3)  # row by row, so in place is safe (and tested)
        torch.bmm(scores3, v3, out=out[:, start:stop])
    return out.view(b, h, n, dv)
