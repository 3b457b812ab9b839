"""Independent, unoptimized statements of the library's formulas, for tests only."""

from __future__ import annotations

import entmax as entmax_pkg
import torch


def naive_gaug_bias(sigma, alpha, grid, prefix, initial):
    """Straight from the definition: an (N, N, 2) tensor of squared offsets, no separability."""
    gh, gw = grid
    eps = 0.1
    while 0.5 * (max(initial) - 1) ** 2 / eps**2 > 65000 / 2:
        eps *= 2
    clamp = max(-0.5 * (max(initial) - 1) ** 2, -6550.0)
    coords = torch.tensor([(i, j) for i in range(gh) for j in range(gw)], dtype=torch.float64)
    d = -0.5 * (coords[:, None, :] - coords[None, :, :]) ** 2  # (Np, Np, 2)
    d = torch.where(d < clamp, torch.full_like(d, clamp), d)
    var = sigma.double() * (min(grid) / min(initial))
    expo = (d[None, None] / (var[:, :, :, None, :] + eps)).sum(-1)  # (B, H, Np, Np)
    s = alpha.double() * torch.exp(expo)
    n = prefix + gh * gw
    out = torch.zeros(*s.shape[:2], n, n, dtype=torch.float64)
    out[:, :, prefix:, prefix:] = s
    return out


def plain_attention(q, k, v, normalizer, scale=None, mask=None, bias=None):
    """normalize(q kᵀ * scale + bias + mask) v with the `entmax` package's normalizers, in float64."""
    q, k, v = q.double(), k.double(), v.double()
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias.double()
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.double()
    if normalizer == "softmax":
        p = torch.softmax(s, -1)
    elif normalizer == "entmax15":
        p = entmax_pkg.entmax15(s, dim=-1)
    elif normalizer == "sparsemax":
        p = entmax_pkg.sparsemax(s, dim=-1)
    else:
        p = entmax_pkg.entmax_bisect(s, alpha=float(normalizer), dim=-1, n_iter=200)
    return p @ v, p
