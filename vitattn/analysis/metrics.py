"""Locality metrics of attention maps: mean attention distance (MAD) and entropy, per head.

Both take probabilities ``attn`` of shape ``(..., N, N)`` (typically ``(B, H, N, N)``) over
``N = num_prefix_tokens + gh * gw`` tokens and return ``(...)`` (``(B, H)``): the mean over query
patches. Prefix tokens (class / register) are dropped as queries and as keys, and each query row is
renormalized over the patch keys. A query row whose patch mass is 0 (it attends only to prefix
tokens, possible with entmax) has no spatial distribution: it is left out of the mean over queries,
and a head whose every row is left out gets NaN.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..functional import compute_dtype, grid_pair

__all__ = ["attention_entropy", "grid_diagonal", "grid_distances", "mean_attention_distance"]


def grid_diagonal(grid_size: int | Sequence[int]) -> float:
    """``sqrt((gh - 1)² + (gw - 1)²)``: the largest distance between two patches, in patches."""
    gh, gw = grid_pair("grid_size", grid_size)
    return math.hypot(gh - 1, gw - 1)


def grid_distances(
    grid_size: int | Sequence[int],
    patch_size: int | Sequence[int] | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``(gh*gw, gh*gw)`` Euclidean distances between patch centres, row-major patch order.

    In patches, or in pixels when ``patch_size`` (an int or ``(ph, pw)``) is given.
    """
    gh, gw = grid_pair("grid_size", grid_size)
    ph, pw = (1, 1) if patch_size is None else grid_pair("patch_size", patch_size)
    rows = torch.arange(gh, device=device, dtype=dtype).repeat_interleave(gw) * ph
    cols = torch.arange(gw, device=device, dtype=dtype).repeat(gh) * pw
    return torch.hypot(rows[:, None] - rows[None, :], cols[:, None] - cols[None, :])


def _patch_rows(
    attn: torch.Tensor, grid_size: int | Sequence[int], num_prefix_tokens: int, fn: str
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
    """Patch-to-patch block of ``attn``, renormalized per row, and the rows that have patch mass."""
    if not isinstance(attn, torch.Tensor) or not attn.is_floating_point() or attn.dim() < 2:
        got = tuple(attn.shape) if isinstance(attn, torch.Tensor) else type(attn).__name__
        raise ValueError(
            f"{fn}: attn must be a floating tensor of shape (..., N, N) such as (B, H, N, N), got {got}"
        )
    gh, gw = grid_pair("grid_size", grid_size)
    p = int(num_prefix_tokens)
    if p < 0:
        raise ValueError(f"{fn}: num_prefix_tokens must be >= 0, got {num_prefix_tokens}")
    n = p + gh * gw
    if attn.shape[-1] != n or attn.shape[-2] != n:
        raise ValueError(
            f"{fn}: attn of shape {tuple(attn.shape)} does not match grid_size ({gh}, {gw}) with "
            f"num_prefix_tokens={p}, which needs (..., {n}, {n}) = {p} + {gh}*{gw} tokens"
        )
    a = attn[..., p:, p:].to(compute_dtype(attn))
    mass = a.sum(-1, keepdim=True)
    valid = mass.squeeze(-1) > 0
    a = a / torch.where(mass > 0, mass, torch.ones_like(mass))
    return a, valid, (gh, gw)


def _mean_over_valid(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean of ``values (..., Np)`` over the ``valid`` queries; NaN where there are none."""
    count = valid.sum(-1)
    total = torch.where(valid, values, torch.zeros_like(values)).sum(-1)
    return torch.where(count > 0, total / count.clamp_min(1), torch.full_like(total, math.nan))


def mean_attention_distance(
    attn: torch.Tensor,
    grid_size: int | Sequence[int],
    num_prefix_tokens: int = 0,
    normalize: bool = True,
    patch_size: int | Sequence[int] | None = None,
) -> torch.Tensor:
    """Mean attention distance ``mean_i Σ_j A_ij ‖pos_i − pos_j‖`` per head: ``(..., N, N)`` -> ``(...)``.

    Args:
        attn: probabilities over ``N = num_prefix_tokens + gh * gw`` tokens, rows = queries.
        grid_size: the patch grid ``(gh, gw)`` (or an int for a square grid), row-major token order.
        num_prefix_tokens: class / register tokens before the patches (dropped, rows renormalized).
        normalize: divide by the grid diagonal ``sqrt((gh-1)² + (gw-1)²)``, giving a value in
            ``[0, 1]`` (0 on a 1×1 grid). Otherwise the distance is in patches, or in pixels when
            ``patch_size`` is given.
        patch_size: patch height and width in pixels (an int or ``(ph, pw)``); only with
            ``normalize=False``.
    """
    if normalize and patch_size is not None:
        raise ValueError(
            "mean_attention_distance: patch_size gives distances in pixels and only applies with "
            f"normalize=False (got patch_size={patch_size!r}, normalize=True)"
        )
    a, valid, grid = _patch_rows(attn, grid_size, num_prefix_tokens, "mean_attention_distance")
    dist = grid_distances(grid, patch_size, device=a.device, dtype=a.dtype)
    mad = _mean_over_valid((a * dist).sum(-1), valid)
    if normalize:
        diagonal = grid_diagonal(grid)
        mad = mad / diagonal if diagonal > 0 else torch.where(mad.isnan(), mad, 0.0)
    return mad


def attention_entropy(
    attn: torch.Tensor,
    num_prefix_tokens: int = 0,
    normalize: bool = True,
    grid_size: int | Sequence[int] | None = None,
) -> torch.Tensor:
    """Mean entropy ``mean_i −Σ_j A_ij log A_ij`` over query patches: ``(..., N, N)`` -> ``(...)``.

    Prefix rows and columns are dropped and rows renormalized over the ``Np = N − num_prefix_tokens``
    patch keys. ``normalize`` divides by ``log(Np)``, giving a value in ``[0, 1]`` (1 = uniform,
    0 = one key; 0 when ``Np = 1``); otherwise in nats. ``grid_size`` is optional and only checked.
    """
    if isinstance(attn, torch.Tensor) and attn.dim() >= 2 and grid_size is None:
        np_ = attn.shape[-1] - int(num_prefix_tokens)
        if np_ < 1:
            raise ValueError(
                f"attention_entropy: attn of shape {tuple(attn.shape)} has no patch tokens after "
                f"num_prefix_tokens={num_prefix_tokens}"
            )
        grid_size = (1, np_)  # entropy ignores positions: any grid with Np patches will do
    # grid_size is still None only for an attn that _patch_rows rejects before it reads the grid
    grid = (1, 1) if grid_size is None else grid_size
    a, valid, (gh, gw) = _patch_rows(attn, grid, num_prefix_tokens, "attention_entropy")
    ent = _mean_over_valid(-torch.special.xlogy(a, a).sum(-1), valid)
    if normalize:
        np_ = gh * gw
        ent = ent / math.log(np_) if np_ > 1 else torch.where(ent.isnan(), ent, 0.0)
    return ent
