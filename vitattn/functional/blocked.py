"""Softmax attention with a :class:`GaussianBias`, computed one block of query rows at a time.

The CPU path for LocAt inference. Handing SDPA the bias as a dense ``(B, H, N, N)`` float mask
costs a full write of that tensor plus SDPA's read of it; here, one head at a time, each block of
query rows gets its bias rows written into a small reused buffer (a few MiB, so it stays in
cache), the scores are added into the same buffer by ``baddbmm``, normalized in place and
multiplied by ``v``. Same result as the reference formula, no ``N x N`` tensor. Forward only: the
autograd path goes through SDPA.

Working per head, batched over B, lets the matmuls read q, k, v as the strided views a fused qkv
projection gives (no copies) and write the output in ``(B, N, H, Dv)`` memory order, so that
merging the heads afterwards is free. (Per batch entry, batched over H, reads in place too but
splits 3 heads unevenly over 2 threads; copying to ``(B*H, N, D)`` costs four copies a layer:
both measured slower.) The block buffer is kept per thread, device and dtype and reused across
calls: allocating it afresh makes the C allocator hand memory back to the OS and fault it in
again on every layer.
"""

from __future__ import annotations

import threading

import torch

from .gaussian import GaussianBias

__all__ = ["block_rows_for", "gaussian_softmax_attention"]

# ~5 MiB of float32 scores per block (an L3-sized block): on the 2-core EPYC measured, LocAtViT-Tiny
# at 448 px ran 1-2 % faster than with half this (two blocks per head) and 3 % faster than a quarter
_BLOCK_ELEMENTS = 5 * 2**18


_scratch = threading.local()


def _scratch_buffer(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A flat buffer of at least ``numel`` elements, reused by later calls on this thread."""
    cache: dict[tuple[torch.device, torch.dtype], torch.Tensor] = _scratch.__dict__.setdefault("buffers", {})
    buf = cache.get((device, dtype))
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype, device=device)
        cache[(device, dtype)] = buf
    return buf[:numel]


def block_rows_for(batch: int, num_keys: int, num_queries: int) -> int:
    """Query rows per block: blocks of near-equal size with ``batch * rows * num_keys`` at most ~1.3M
    (but at least 16 rows)."""
    limit = max(16, _BLOCK_ELEMENTS // max(1, batch * num_keys))
    blocks = -(-num_queries // limit)
    return -(-num_queries // blocks)


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
    rows = block_rows_for(b, n, n) if block_rows is None else int(block_rows)
    if rows < 1:
        raise ValueError(f"block_rows must be >= 1, got {block_rows}")
    rows = min(rows, n)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    ra, c = bias.scaled_factors(q.dtype)
    ra, c = ra.expand(b, h, *ra.shape[2:]), c.expand(b, h, *c.shape[2:])
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
