"""Adaptively sparse attention: one learnable alpha-entmax alpha per head (``normalizer="adaptive"``).

``alpha_h = 1 + max(sigmoid(a_h), 0.01)`` with one parameter ``a_h`` per head, initialised at 0
(alpha = 1.5, entmax-1.5). The map covers ``[1.01, 2)``: from nearly softmax to nearly sparsemax. The
floor keeps alpha away from 1, where alpha-entmax turns into softmax and its threshold search loses
precision (``1 + sigmoid(a)`` rounds to exactly 1 in float32 once ``a < -16.6``); below it ``a`` gets
no gradient. The attention is exact alpha-entmax (:func:`vitattn.functional.entmax`), differentiable
in the scores and in alpha.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from ..functional import compute_dtype
from ..functional._checks import check_count
from ..functional.normalize import AttentionNormalizer, Normalizer, normalizer_spec, resolve_normalizer
from .kinds import implied_normalizer

__all__ = [
    "ALPHA_FLOOR",
    "AdaptiveAlpha",
    "LayerNormalizer",
    "normalizer_alphas",
    "patch_normalizer",
    "resolve_layer_normalizer",
]

ALPHA_FLOOR = 1.01  # the smallest alpha a head can learn
LayerNormalizer = Normalizer | Literal["adaptive"]  # what the layers take: a normalizer, or "adaptive"


def resolve_layer_normalizer(normalizer: LayerNormalizer) -> Normalizer | Literal["adaptive"]:
    """``"adaptive"``, or the canonical form of a fixed normalizer (``ValueError`` for unknown names)."""
    if normalizer == "adaptive":
        return "adaptive"
    try:
        return resolve_normalizer(normalizer)
    except ValueError as err:
        raise ValueError(f"{err} (or 'adaptive': one learnable alpha per head)") from None


def patch_normalizer(
    attention: str | None, normalizer: LayerNormalizer | None, *, adaptive: bool = True
) -> Normalizer | Literal["adaptive"] | None:
    """The normalizer a ``vitattn.patch`` call names: ``normalizer`` resolved (by
    :func:`resolve_layer_normalizer`, or with ``adaptive=False`` by
    :func:`~vitattn.functional.normalize.resolve_normalizer`, which refuses ``"adaptive"``), else the
    one ``attention`` implies (``"softmax"`` / ``"entmax15"``), else None (each block keeps its own).
    A ``ValueError`` when ``attention="entmax15"`` meets another normalizer."""
    if normalizer is None:
        return implied_normalizer(attention)
    resolved = resolve_layer_normalizer(normalizer) if adaptive else resolve_normalizer(normalizer)
    if attention == "entmax15" and resolved != "entmax15":
        raise ValueError(
            f"attention='entmax15' is entmax-1.5 attention, so normalizer={normalizer!r} contradicts it; "
            "for another normalizer without a bias use attention='softmax', normalizer=..."
        )
    return resolved


class AdaptiveAlpha(nn.Module):
    """One learnable alpha per head: ``alpha = 1 + max(sigmoid(logit), ALPHA_FLOOR - 1)``.

    ``logit: (H,)`` starts at 0 (alpha = 1.5). ``forward()`` gives ``alpha: (H,)`` in float32 (float64
    stays); :meth:`normalizer` the ``(1, H, 1, 1)`` view that :func:`vitattn.functional.attention`
    and :func:`vitattn.functional.normalize` take as a tensor normalizer.
    """

    def __init__(
        self, num_heads: int, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        num_heads = check_count("num_heads", num_heads, minimum=1)
        self.logit = nn.Parameter(torch.zeros(num_heads, device=device, dtype=dtype))

    @property
    def num_heads(self) -> int:
        return int(self.logit.shape[0])

    def reset_parameters(self) -> None:
        """alpha = 1.5 for every head."""
        with torch.no_grad():
            self.logit.zero_()

    def forward(self) -> torch.Tensor:
        """``(H,)`` alphas in ``[1.01, 2)``, differentiable in ``logit``."""
        logit = self.logit.to(compute_dtype(self.logit))
        return 1.0 + torch.sigmoid(logit).clamp_min(ALPHA_FLOOR - 1.0)

    def normalizer(self) -> torch.Tensor:
        """The alphas as a ``(1, H, 1, 1)`` tensor normalizer (one per head of ``(B, H, Nq, Nk)`` scores)."""
        return self().view(1, -1, 1, 1)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}"


def normalizer_alphas(normalizer: AttentionNormalizer | Literal["adaptive"], num_heads: int) -> list[float]:
    """The alpha of each of ``num_heads`` heads for a fixed normalizer: its registered ``alpha`` (softmax
    1, entmax-1.5 1.5, sparsemax 2), a float alpha itself (a tensor normalizer: its values per head)."""
    if isinstance(normalizer, torch.Tensor):
        values = normalizer.detach().double().reshape(-1)
        return [float(v) for v in values.expand(num_heads)] if values.numel() == 1 else values.tolist()
    if normalizer == "adaptive":
        raise ValueError("an adaptive normalizer's alphas are its layer's: read them from its AdaptiveAlpha")
    return [float(normalizer_spec(normalizer).alpha)] * num_heads
