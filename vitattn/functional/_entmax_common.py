"""Pieces shared by every entmax normalizer (1.5, general alpha, sparsemax)."""

from __future__ import annotations

import torch

from .dtypes import compute_dtype

__all__ = ["compute_dtype", "support_vjp"]


def support_vjp(
    grad_out: torch.Tensor, g: torch.Tensor, dim: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Vector-Jacobian product of an entmax mapping, restricted to its support.

    For alpha-entmax the Jacobian is ``diag(g) - g gᵀ / Σg`` with ``g = p^(2-alpha)`` on the
    support and 0 elsewhere (``g = sqrt(p)`` for alpha = 1.5, the support indicator for sparsemax).
    Rows whose support is empty (fully masked) get a zero gradient.

    Args:
        grad_out: upstream gradient, same shape as ``g``.
        g: support weights ``p^(2-alpha)`` (zero off the support).
        dim: the normalized dimension.
        out: optional buffer of ``g``'s shape for the result.
    """
    gx = torch.mul(grad_out, g) if out is None else torch.mul(grad_out, g, out=out)
    g_sum = g.sum(dim, keepdim=True)
    coef = gx.sum(dim, keepdim=True) / g_sum.clamp_min(torch.finfo(g.dtype).tiny)
    return gx.addcmul_(coef, g, value=-1.0)
