"""Row normalizers of the attention pipeline: softmax, entmax-1.5, sparsemax and alpha-entmax (a fixed
alpha, or a tensor of them: one per head, learnable)."""

from __future__ import annotations

from typing import Literal

import torch

from ._checks import check_broadcastable, shape_str

NormalizerName = Literal["softmax", "entmax15", "sparsemax"]
Normalizer = NormalizerName | float
# what attention() takes: a fixed normalizer, or alpha-entmax with a tensor of alphas (e.g. one per head)
AttentionNormalizer = Normalizer | torch.Tensor

_NAMES: tuple[NormalizerName, ...] = ("softmax", "entmax15", "sparsemax")


def resolve_normalizer(normalizer: Normalizer) -> Normalizer:
    """Canonical form: ``"softmax"``, ``"entmax15"``, ``"sparsemax"`` or a float alpha not in {1.5, 2}.

    Raises ``ValueError`` for unknown names and for alpha <= 1 (alpha = 1 would be softmax: say so).
    """
    if isinstance(normalizer, str):
        for name in _NAMES:  # returns the Literal, so the canonical form keeps its type
            if normalizer == name:
                return name
        raise ValueError(f"normalizer must be one of {_NAMES} or a float alpha > 1, got {normalizer!r}")
    if isinstance(normalizer, bool) or not isinstance(normalizer, (int, float)):
        raise ValueError(
            f"normalizer must be one of {_NAMES} or a float alpha > 1, got {type(normalizer).__name__}"
        )
    alpha = float(normalizer)
    if not alpha > 1.0:
        raise ValueError(f"normalizer alpha must be > 1 (use normalizer='softmax' for alpha=1), got {alpha}")
    if alpha == 1.5:
        return "entmax15"
    if alpha == 2.0:
        return "sparsemax"
    return alpha


def alpha_tensor(alpha: torch.Tensor, shape: tuple[int, int, int, int]) -> torch.Tensor:
    """A tensor normalizer (alpha-entmax with a tensor of alphas) as a 4-D tensor for ``(B, H, Nq, Nk)``
    scores of ``shape``: ``()`` is one alpha, ``(H,)`` (or ``(1,)``) one per head, read as
    ``(1, H, 1, 1)``; a 4-D tensor must broadcast to ``(B, H, Nq, 1)`` (one alpha per batch entry, head
    or query row). Floating-point; its values (> 1) are checked by :func:`~vitattn.functional.entmax`.
    ``ValueError`` / ``TypeError`` naming ``normalizer`` and the shapes otherwise."""
    if not alpha.is_floating_point():
        raise TypeError(f"a tensor normalizer (alpha) must be floating-point, got dtype {alpha.dtype}")
    b, h, nq, _ = shape
    if alpha.dim() == 0:
        return alpha.view(1, 1, 1, 1)
    if alpha.dim() == 1:
        if alpha.shape[0] not in (1, h):
            raise ValueError(
                f"a 1-D tensor normalizer holds one alpha per head: shape ({h},) for H = {h}, "
                f"got {shape_str(alpha)}"
            )
        return alpha.view(1, -1, 1, 1)
    if alpha.dim() != 4:
        raise ValueError(
            f"a tensor normalizer (alpha) must be 0-D, 1-D (H,) or 4-D broadcastable to (B, H, Nq, 1), "
            f"got shape {shape_str(alpha)}"
        )
    check_broadcastable("normalizer (alpha)", alpha, (b, h, nq, 1), "(B, H, Nq, 1)")
    return alpha


def softmax_zero_dead_rows(scores: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax that returns zeros (and zero gradients) for rows whose scores are all ``-inf``."""
    dead = torch.isneginf(scores).all(dim, keepdim=True)
    probs = torch.softmax(scores.masked_fill(dead, 0.0), dim=dim)
    return probs.masked_fill(dead, 0.0)


def normalize(
    scores: torch.Tensor, normalizer: AttentionNormalizer, dim: int = -1, *, masked: bool = True
) -> torch.Tensor:
    """Apply ``normalizer`` along ``dim``; ``masked=False`` promises no row is entirely ``-inf``.

    A tensor ``normalizer`` is alpha-entmax with those alphas (broadcastable to ``scores`` with size 1
    along ``dim``; differentiable in them): :func:`~vitattn.functional.entmax`.
    """
    if isinstance(normalizer, torch.Tensor):
        from .entmax_alpha import entmax

        return entmax(scores, alpha=normalizer, dim=dim)
    kind = resolve_normalizer(normalizer)
    if kind == "softmax":
        return softmax_zero_dead_rows(scores, dim) if masked else torch.softmax(scores, dim=dim)
    if kind == "entmax15":
        from .entmax15 import entmax15

        return entmax15(scores, dim=dim)
    from .entmax_alpha import entmax, sparsemax

    if kind == "sparsemax":
        return sparsemax(scores, dim=dim)
    return entmax(scores, alpha=float(kind), dim=dim)
