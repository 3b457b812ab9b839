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
    else:  # a float alpha, or a tensor of them broadcastable to (B, H, Nq, 1)
        alpha = normalizer.double() if isinstance(normalizer, torch.Tensor) else float(normalizer)
        p = entmax_pkg.entmax_bisect(s, alpha=alpha, dim=-1, n_iter=200)
    return p @ v, p


def naive_gaug_params(q_sp, log_var, log_alpha, initial):
    """GAug's (σ, α) from spatial queries, straight from the definition: σ = c·sigmoid(z − ln(c − 1)),
    c = max(initial grid)² (no shift when c ≤ 2), α = softplus; ``log_var`` / ``log_alpha`` are the
    ``nn.Linear`` heads. In float64."""
    import math

    c = float(max(initial) ** 2)
    shift = math.log(c - 1) if c > 2 else 0.0
    q = q_sp.double()
    z = q @ log_var.weight.double().T + log_var.bias.double()
    sigma = c / (1.0 + torch.exp(-(z - shift)))
    a = q @ log_alpha.weight.double().T + log_alpha.bias.double()
    alpha = torch.log1p(torch.exp(a))
    return sigma, alpha


def naive_rotary(x, rope, half=False):
    """timm's rotary embedding on ``x: (..., N, d)`` from its ``rope = cat(sin, cos)`` table: pairs
    (x0, x1), (x2, x3), ... rotated (``half=False``), or the halves of d (``half=True``)."""
    sin, cos = rope.double().chunk(2, dim=-1)
    x = x.double()
    if half:
        x1, x2 = x.chunk(2, dim=-1)
        turned = torch.cat([-x2, x1], dim=-1)
    else:
        turned = torch.stack([-x[..., 1::2], x[..., ::2]], dim=-1).reshape(x.shape)
    return x * cos + turned * sin


def naive_window_keep(grid, window, dilation, prefix):
    """The (N, N) bool keep-mask of neighbourhood attention, straight from its definition: per axis, a
    query's window is, among the runs of ``k`` consecutive positions of its own dilated sub-grid (the
    whole sub-grid when it is shorter), the one containing the query whose centre position
    (``start + k // 2``) is nearest to the query. Prefix rows and columns are all True."""

    def axis_window(size, k, d, i):
        sub = list(range(i % d, size, d))  # the query's sub-grid
        runs = [sub[s : s + k] for s in range(max(len(sub) - k, 0) + 1)]
        runs = [run for run in runs if i in run]
        return min(runs, key=lambda run: abs(sub.index(run[0]) + k // 2 - sub.index(i)))

    gh, gw = grid
    n = prefix + gh * gw
    keep = torch.ones(n, n, dtype=torch.bool)
    for qi in range(gh):
        for qj in range(gw):
            rows = axis_window(gh, window[0], dilation[0], qi)
            cols = axis_window(gw, window[1], dilation[1], qj)
            row = torch.zeros(gh, gw, dtype=torch.bool)
            for a in rows:
                for b in cols:
                    row[a, b] = True
            keep[prefix + qi * gw + qj, prefix:] = row.flatten()
    return keep
