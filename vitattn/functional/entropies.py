"""The entropies the attention normalizers regularize with, and softmax's closed-form Fenchel–Young loss.

A normalizer ``ŷ(z) = argmax_{p ∈ simplex} ⟨z, p⟩ + H(p)`` is stated by its entropy ``H``
(:class:`~vitattn.functional.normalize.NormalizerSpec`); :func:`vitattn.functional.fy_loss` reads it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["shannon_entropy", "softmax_fy_loss", "tsallis_entropy"]


def shannon_entropy(p: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Shannon's ``−Σ p log p`` of each row of ``p`` along ``dim`` (``0 log 0 = 0``): softmax's."""
    return -torch.special.xlogy(p, p).sum(dim)


def tsallis_entropy(alpha: float) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """Tsallis' ``Σ (p − p^α) / (α (α − 1))`` along ``dim`` (α > 1), α-entmax's: 0 for a zero row."""

    def entropy(p: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return (p - p.pow(alpha)).sum(dim) / (alpha * (alpha - 1.0))

    entropy.__name__ = entropy.__qualname__ = f"tsallis_entropy_{alpha!r}"
    return entropy


def softmax_fy_loss(live: torch.Tensor, y: torch.Tensor, masked: torch.Tensor, dim: int) -> torch.Tensor:
    """Softmax's Fenchel–Young loss per row in closed form, ``KL(y ‖ softmax(z)) = Σ y log y − Σ y
    log_softmax(z)``: the log-probabilities are shifted by the row max inside ``log_softmax`` (no log
    of ``p``, whose zeros autograd dislikes). ``live``: the scores with dead rows zeroed; ``masked``:
    their ``-inf`` entries (``0 · (-inf)`` would be NaN, so they contribute 0 here)."""
    log_p = torch.log_softmax(live, dim).masked_fill(masked, 0.0)
    return (torch.special.xlogy(y, y) - y * log_p).sum(dim)
