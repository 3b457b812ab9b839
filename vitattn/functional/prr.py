"""PRR: parameter-free multi-head self-attention with q = k = v = x."""

from __future__ import annotations

import torch

from ._checks import check_rank, shape_str
from .attention import attention


def prr(x: torch.Tensor, num_heads: int, *, rows: int | None = None, backend: str = "auto") -> torch.Tensor:
    """Patch representation refinement on ``x`` of shape ``(B, N, C)``; returns ``(B, N, C)``.

    Each head ``h`` takes its channel slice ``x_h`` of width ``C / num_heads`` and returns
    ``softmax(x_h x_hᵀ / sqrt(C / num_heads)) x_h`` over all tokens (prefix tokens included),
    with no parameters and no residual. ``rows=R`` computes only the first ``R`` output tokens
    (every token is still a key): ``(B, R, C)``, what a head that pools the class token needs.
    """
    check_rank("x", x, 3, "(B, N, C)")
    if not isinstance(num_heads, int) or num_heads < 1 or x.shape[-1] % num_heads:
        raise ValueError(f"num_heads must be a positive divisor of C, got {num_heads} for x {shape_str(x)}")
    b, n, channels = x.shape
    if rows is not None and not (isinstance(rows, int) and 1 <= rows <= n):
        raise ValueError(f"rows must be an int in [1, N={n}] or None, got {rows!r} for x {shape_str(x)}")
    xh = x.reshape(b, n, num_heads, channels // num_heads).transpose(1, 2)  # (B, H, N, C/H)
    queries = xh if rows is None else xh[:, :, :rows]
    out = attention(queries, xh, xh, normalizer="softmax", backend=backend)
    return out.transpose(1, 2).reshape(b, queries.shape[2], channels)
