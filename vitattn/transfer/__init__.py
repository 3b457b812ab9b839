"""Attention transfer (Li et al., NeurIPS 2024): a student ViT learns from a frozen teacher's attention.

- :class:`AttentionCopy`: in the chosen blocks the student attends with the teacher's probabilities
  (its own q, k unused there); the teacher runs at inference too.
- :class:`AttentionDistill`: the student is trained with ``weight · Σ_layers CE(softmax(T), S)``
  between teacher and student scores (``loss="fy"``: the Fenchel–Young loss of the student's own
  normalizer against the teacher's probabilities); only the student runs at inference.

Both wrap a timm ViT or vitattn model pair and return :class:`TransferOutput` ``(logits, attn_loss)``.
The distillation loss (:func:`attention_distill_loss`) keeps O(N·d) per layer for backward, not the
N x N maps.
"""

from .base import AttentionTransfer, TeacherLayer, TransferOutput, select_layers
from .copying import AttentionCopy
from .distill import DEFAULT_SKIP_LAST, AttentionDistill
from .loss import CHUNK_ELEMENTS, attention_distill_loss
from .scores import ScoreInputs

__all__ = [
    "CHUNK_ELEMENTS",
    "DEFAULT_SKIP_LAST",
    "AttentionCopy",
    "AttentionDistill",
    "AttentionTransfer",
    "ScoreInputs",
    "TeacherLayer",
    "TransferOutput",
    "attention_distill_loss",
    "select_layers",
]
