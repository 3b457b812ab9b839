"""The CPU row-blocked Gaussian attention as a ``torch.library`` custom op, for ``torch.compile``.

Traced by dynamo, :func:`~vitattn.functional.blocked.gaussian_softmax_attention` would be inlined
into the graph, and its per-thread block buffers do not belong in a graph; without this op a
compiled model took the dense-bias path instead (compiled LocAtViT-Tiny at 448 px: 1.82-1.84x
compiled timm ViT-Tiny, against 1.06-1.08x with the op; see docs/benchmarks.md). As an opaque op
the compiled graph calls the same eager row-blocked code. Forward only: calls that autograd
records keep their own paths.
"""

from __future__ import annotations

import torch

from .blocked import gaussian_softmax_attention
from .gaussian import GaussianBias

__all__ = ["gaussian_attention_cpu", "gaussian_attention_op"]


@torch.library.custom_op("vitattn::gaussian_attention_cpu", mutates_args=(), device_types="cpu")
def gaussian_attention_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sigma: torch.Tensor,
    alpha: torch.Tensor,
    scale: float,
    grid_h: int,
    grid_w: int,
    num_prefix_tokens: int,
    initial_grid_h: int,
    initial_grid_w: int,
) -> torch.Tensor:
    """``softmax(q kᵀ · scale + S) v`` with ``S`` the Gaussian bias of ``sigma: (B|1, H|1, Np, 2)`` and
    ``alpha: (B|1, H|1, Np, 1)`` on a ``(grid_h, grid_w)`` grid after ``num_prefix_tokens`` tokens
    (:class:`~vitattn.functional.GaussianBias`); ``q, k: (B, H, N, D)``, ``v: (B, H, N, Dv)``, one
    dtype, float32 or float64. Returns ``(B, H, N, Dv)``, a view of a ``(B, N, H, Dv)`` tensor."""
    bias = GaussianBias(sigma, alpha, (grid_h, grid_w), num_prefix_tokens, (initial_grid_h, initial_grid_w))
    return gaussian_softmax_attention(q, k, v, scale, bias)


@gaussian_attention_cpu.register_fake
def _gaussian_attention_cpu_fake(
    q, k, v, sigma, alpha, scale, grid_h, grid_w, num_prefix_tokens, initial_grid_h, initial_grid_w
):  # fmt: skip
    b, h, n, _ = q.shape
    return q.new_empty(b, n, h, v.shape[-1], dtype=v.dtype).transpose(1, 2)


def gaussian_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, bias: GaussianBias
) -> torch.Tensor:
    """:func:`gaussian_attention_cpu` called with the fields of ``bias``."""
    (gh, gw), (ih, iw) = bias.grid_size, bias.initial_grid_size  # type: ignore[misc]
    return gaussian_attention_cpu(
        q, k, v, bias.sigma, bias.alpha, float(scale), gh, gw, bias.num_prefix_tokens, ih, iw
    )
