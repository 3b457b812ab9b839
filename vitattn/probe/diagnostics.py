"""Diagnostics of patch features: alignment with the class token, and PCA images."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["patch_cls_alignment", "pca_images"]


def _tokens(patch_tokens: torch.Tensor, name: str = "patch_tokens") -> torch.Tensor:
    """``(B, C, gh, gw)`` or ``(B, Np, C)`` -> ``(B, Np, C)``."""
    if patch_tokens.ndim == 4:
        return patch_tokens.flatten(2).transpose(1, 2)
    if patch_tokens.ndim == 3:
        return patch_tokens
    raise ValueError(f"{name} must be (B, C, gh, gw) or (B, Np, C), got shape {tuple(patch_tokens.shape)}")


def alignment_sum(patch_tokens: torch.Tensor, cls_token: torch.Tensor) -> tuple[float, int]:
    """Sum of the cosines of :func:`patch_cls_alignment` and their count (for running means)."""
    tokens = _tokens(patch_tokens).float()
    if cls_token.ndim != 2 or cls_token.shape[0] != tokens.shape[0] or cls_token.shape[1] != tokens.shape[2]:
        raise ValueError(
            f"cls_token must be (B, C) = ({tokens.shape[0]}, {tokens.shape[2]}) to match patch_tokens, "
            f"got shape {tuple(cls_token.shape)}"
        )
    cos = F.cosine_similarity(tokens, cls_token.float()[:, None, :].to(tokens.device), dim=-1)
    return float(cos.sum()), cos.numel()


def patch_cls_alignment(patch_tokens: torch.Tensor, cls_token: torch.Tensor) -> float:
    """Mean cosine similarity of every patch token to its own image's class token.

    ``patch_tokens``: ``(B, C, gh, gw)`` or ``(B, Np, C)``; ``cls_token``: ``(B, C)``. The mean is over
    all ``B * Np`` patches. Near 1 when patches have collapsed onto the class token (lost locality,
    the LocAt diagnosis), near 0 for unrelated directions.
    """
    total, count = alignment_sum(patch_tokens, cls_token)
    return total / count


def pca_images(features: torch.Tensor, *, fit_on: torch.Tensor | None = None) -> torch.Tensor:
    """The first three principal components of features as RGB: ``(B, C, gh, gw) -> (B, 3, gh, gw)``.

    The PCA (mean and components) is fit jointly on all patches of ``fit_on`` (same layout, any
    batch size; default ``features``) with an SVD of the centred ``(patches, C)`` matrix. Each
    component's sign is fixed so that its loading of largest magnitude is positive (deterministic,
    whatever sign the SVD returns). Each projected component is then min-max scaled to [0, 1] over all
    patches of ``features`` (a constant component becomes 0). Components beyond the rank are 0.
    """
    if features.ndim != 4:
        raise ValueError(f"features must be (B, C, gh, gw), got shape {tuple(features.shape)}")
    fit = features if fit_on is None else fit_on
    if fit.ndim != 4 or fit.shape[1] != features.shape[1]:
        raise ValueError(
            f"fit_on must be (M, C={features.shape[1]}, gh, gw) like features, got shape {tuple(fit.shape)}"
        )
    b, c, gh, gw = features.shape
    x = features.detach().float().permute(0, 2, 3, 1).reshape(-1, c).cpu()
    xf = fit.detach().float().permute(0, 2, 3, 1).reshape(-1, c).cpu()
    mean = xf.mean(0)
    _, _, vh = torch.linalg.svd(xf - mean, full_matrices=False)
    comps = vh[:3]
    pivot = comps.abs().argmax(1)
    sign = torch.sign(comps.gather(1, pivot[:, None]))
    sign[sign == 0] = 1
    comps = comps * sign
    proj = (x - mean) @ comps.T  # (patches, <=3)
    lo, hi = proj.min(0).values, proj.max(0).values
    span = hi - lo
    scaled = torch.where(
        span > 1e-12 * (1 + hi.abs()), (proj - lo) / span.clamp_min(1e-30), torch.zeros_like(proj)
    )
    if scaled.shape[1] < 3:
        scaled = torch.cat([scaled, scaled.new_zeros(scaled.shape[0], 3 - scaled.shape[1])], 1)
    return scaled.clamp(0, 1).reshape(b, gh, gw, 3).permute(0, 3, 1, 2).contiguous()
