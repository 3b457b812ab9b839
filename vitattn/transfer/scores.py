"""What one attention layer's scores are made of, kept in O(N·d) memory: ``q kᵀ · scale + bias``.

Attention distillation compares the *scores* of two models layer by layer. Holding the scores
themselves costs ``B·H·N²`` per layer; holding what they are made of costs ``B·H·N·d`` (plus, for a
LocAt layer, GAug's per-query σ and α). :class:`ScoreInputs` is that description; it makes the dense
scores on demand, for all heads or for a slice of batch and heads, with the library's own formula
(:func:`vitattn.functional.scores`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..functional import GaussianBias, scores
from ..functional.scoring import check_qk

__all__ = ["ScoreInputs", "cross_entropy_sum"]


def _slice_bh(t: torch.Tensor, batch: slice, heads: slice) -> torch.Tensor:
    """``t`` broadcastable to ``(B, H, ., .)``, restricted to ``batch`` x ``heads`` (size-1 dims kept)."""
    if t.dim() < 4:
        t = t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))
    return t[batch if t.shape[0] > 1 else slice(None), heads if t.shape[1] > 1 else slice(None)]


@dataclass(frozen=True)
class ScoreInputs:
    """The pieces of one attention layer's scores ``q kᵀ · scale + bias``.

    Args:
        q: ``(B, H, N, d)`` queries after ``q_norm``, unscaled.
        k: ``(B, H, N, d)`` keys after ``k_norm``.
        scale: the layer's score scale (``d ** -0.5`` for a standard layer).
        bias: the layer's additive score bias: ``None``, a :class:`GaussianBias` (LocAt), or a float
            tensor broadcastable to ``(B, H, N, N)``.
    """

    q: torch.Tensor
    k: torch.Tensor
    scale: float
    bias: torch.Tensor | GaussianBias | None = None

    def __post_init__(self) -> None:
        check_qk(self.q, self.k)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(B, H, Nq, Nk)``: the shape of the scores."""
        b, h, nq, _ = self.q.shape
        return int(b), int(h), int(nq), int(self.k.shape[2])

    def scores(self) -> torch.Tensor:
        """Dense ``(B, H, Nq, Nk)`` scores; float32 for half-precision inputs (float64 stays)."""
        return scores(self.q, self.k, scale=float(self.scale), bias=self.bias)

    def select(self, batch: slice, heads: slice) -> ScoreInputs:
        """The same layer restricted to a slice of the batch and of the heads."""
        bias = self.bias
        if isinstance(bias, GaussianBias):
            bias = replace(
                bias, sigma=_slice_bh(bias.sigma, batch, heads), alpha=_slice_bh(bias.alpha, batch, heads)
            )
        elif bias is not None:
            bias = _slice_bh(bias, batch, heads)
        return ScoreInputs(self.q[batch, heads], self.k[batch, heads], self.scale, bias)

    # ---- flattening, for autograd.Function inputs ----------------------------------------------
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """``(q, k, *bias tensors)``: every tensor the scores depend on."""
        if isinstance(self.bias, GaussianBias):
            return self.q, self.k, self.bias.sigma, self.bias.alpha
        if self.bias is not None:
            return self.q, self.k, self.bias
        return self.q, self.k

    def with_tensors(self, tensors: tuple[torch.Tensor, ...]) -> ScoreInputs:
        """A copy whose tensors are ``tensors`` (same order as :meth:`tensors`), other fields kept."""
        q, k, *rest = tensors
        bias = self.bias
        if isinstance(bias, GaussianBias):
            bias = replace(bias, sigma=rest[0], alpha=rest[1])
        elif bias is not None:
            bias = rest[0]
        return ScoreInputs(q, k, self.scale, bias)

    def skeleton(self) -> ScoreInputs:
        """A copy holding shape-only (``meta``) tensors: the static fields without the memory."""
        return self.with_tensors(tuple(torch.empty_like(t, device="meta") for t in self.tensors()))

    def detach(self) -> ScoreInputs:
        """Detached, with ``q`` and ``k`` made contiguous (so a fused ``qkv`` buffer can be freed)."""
        return self.with_tensors(
            tuple(t.detach().contiguous() if i < 2 else t.detach() for i, t in enumerate(self.tensors()))
        )


def cross_entropy_sum(student_scores: torch.Tensor, teacher_scores: torch.Tensor) -> torch.Tensor:
    """``Σ over (b, h, i) of −Σ_j softmax(T)_ij · log_softmax(S)_ij`` for ``(B, H, Nq, Nk)`` scores."""
    return -(torch.softmax(teacher_scores, -1) * torch.log_softmax(student_scores, -1)).sum()
