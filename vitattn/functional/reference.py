"""The ``"reference"`` backend: the dense formula, for every call, and what every other backend is
tested against.

``scores = q kᵀ · scale + bias`` with the mask applied (:func:`~vitattn.functional.scores`), the
normalizer along the keys (:func:`~vitattn.functional.normalize`), dropout, ``probs @ v``: plain tensor
operations in the call's dtype (:func:`~vitattn.functional.compute_dtype` of it for the scores and the
normalizer, so float64 stays float64), autograd through them and through the normalizers' own
backwards, a :class:`~vitattn.functional.GaussianBias` made dense through plain elementwise steps, a
:class:`~vitattn.functional.WindowMask` as its dense ``(N, N)`` keep-mask, a tensor normalizer as
alpha-entmax with those alphas (differentiable in them). Nothing here is optimized; it materializes
``(B, H, Nq, Nk)`` tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .dispatch import AttentionCall, run_in_call_dtype
from .gaussian import GaussianBias, check_gaussian_values
from .normalize import normalize
from .scoring import scores_unchecked

__all__ = ["ReferenceBackend", "reference_attention"]


def reference_attention(call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, probs)`` of a validated call by the dense formula, q, k, v already in one dtype.

    ``probs`` are before dropout, in the scores' compute dtype; ``out`` is in ``v``'s dtype.
    """
    if isinstance(call.bias, GaussianBias) and not call.compiling:  # the slow path: values read back
        check_gaussian_values(call.bias)
    scores = scores_unchecked(call.q, call.k, call.scale, call.bias, call.mask, call.window)
    masked = call.mask is not None or call.window is not None
    probs = normalize(scores, call.normalizer, masked=masked)
    dropped = F.dropout(probs, p=call.dropout_p) if call.dropout_p > 0.0 else probs
    return torch.matmul(dropped.to(call.v.dtype), call.v), probs


class ReferenceBackend:
    """The dense formula in plain PyTorch: supports every call."""

    name = "reference"
    features = frozenset({"alpha_tensor", "window"})

    def unsupported(self, call: AttentionCall, explicit: bool = False) -> str | None:
        return None

    def builds_scores(self, call: AttentionCall) -> bool:
        """Always: the dense formula builds the ``(B, H, Nq, Nk)`` scores and weights."""
        return True

    def path(self, call: AttentionCall) -> str:
        window = ", window keep-mask" if call.window is not None else ""
        tensor_alpha = "alpha_tensor" in call.features
        normalizer = "alpha-entmax with a tensor of alphas" if tensor_alpha else "normalizer"
        return f"dense formula: (B, H, Nq, Nk) scores{window}, {normalizer}, @ v"

    def run(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        out, probs = run_in_call_dtype(call, reference_attention)
        return out, (probs if call.return_weights else None)
