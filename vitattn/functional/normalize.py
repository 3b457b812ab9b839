"""Row normalizers of the attention pipeline: softmax, entmax-1.5, sparsemax and alpha-entmax."""

from __future__ import annotations

from typing import Literal

import torch

NormalizerName = Literal["softmax", "entmax15", "sparsemax"]
Normalizer = NormalizerName | float

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


def softmax_zero_dead_rows(scores: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax that returns zeros (and zero gradients) for rows whose scores are all ``-inf``."""
    dead = torch.isneginf(scores).all(dim, keepdim=True)
    probs = torch.softmax(scores.masked_fill(dead, 0.0), dim=dim)
    return probs.masked_fill(dead, 0.0)


def normalize(
    scores: torch.Tensor, normalizer: Normalizer, dim: int = -1, *, masked: bool = True
) -> torch.Tensor:
    """Apply ``normalizer`` along ``dim``; ``masked=False`` promises no row is entirely ``-inf``."""
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
