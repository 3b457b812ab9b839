"""AttentionCopy: the student attends with the teacher's probabilities (attention copy, Li et al. 2024)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..adapter import layout_of
from ..functional import attention
from .base import AttentionTransfer, TransferOutput, check_tokens

__all__ = ["AttentionCopy"]


class AttentionCopy(AttentionTransfer):
    """Student ViT whose chosen layers use a frozen teacher's attention probabilities.

    In each chosen block the student's attention output is ``proj(P_teacher · v_student)``, where
    ``P_teacher`` are the teacher's probabilities on the same input (all heads, class token
    included; for a LocAt or entmax teacher, its biased / sparse probabilities). The student's q
    and k projections are not computed there and get no gradient; its ``v``, ``proj`` and all other
    weights train as usual (its attention dropout, if any, applies to the copied probabilities).
    The teacher runs at inference too.

    Args:
        teacher: a trained timm ViT or vitattn model; frozen by this wrapper.
        student: a model of the same depth, heads per block and token count (head dim may differ).
        layers: block indices, or a negative int ``-n`` for all blocks but the last ``n``; all blocks
            by default.

    ``forward(x: (B, C, H, W))`` returns ``TransferOutput(logits, None)``.
    """

    def __init__(
        self, teacher: nn.Module, student: nn.Module, layers: int | Iterable[int] | None = None
    ) -> None:
        super().__init__(teacher, student, layers, default=lambda depth: range(depth))

    def forward(self, x: torch.Tensor) -> TransferOutput:
        """``x: (B, C, H, W)`` -> ``TransferOutput(logits (B, num_classes), None)``."""
        self.check_student()
        teacher = self.teacher_layers(x)
        student = layout_of(self.student, "student")

        def rule(i: int, attn: nn.Module, q: Any, k: Any, v: torch.Tensor) -> torch.Tensor:
            t = teacher.pop(i)
            check_tokens(i, v, t.scores)
            return attention(
                t.scores.q.to(v.dtype),
                t.scores.k.to(v.dtype),
                v,
                normalizer=t.normalizer,
                scale=t.scores.scale,
                bias=t.scores.bias,
                dropout_p=student.dropout(i),
            )

        with student.intercept(self.layers, rule, need_qk=False):
            logits = self.student(x)
        return TransferOutput(logits, None)
