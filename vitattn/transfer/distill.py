"""AttentionDistill: the student learns to match a frozen teacher's attention scores (Li et al. 2024)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..adapter import layout_of
from .base import AttentionTransfer, TransferOutput, check_tokens, layer_scores, plain_rule
from .loss import CHUNK_ELEMENTS, DistillLoss, attention_distill_loss, resolve_loss

__all__ = ["AttentionDistill", "DEFAULT_SKIP_LAST"]

DEFAULT_SKIP_LAST = 6  # the released recipe distills all blocks but the last 6


def _default_layers(depth: int) -> range:
    return range(depth - DEFAULT_SKIP_LAST) if depth > DEFAULT_SKIP_LAST else range(depth)


class AttentionDistill(AttentionTransfer):
    """Student ViT trained with an attention-distillation loss against a frozen teacher.

    While training, ``forward(x)`` runs the teacher (no grad, up to its last chosen block) and the
    student on ``x`` and returns ``TransferOutput(logits, attn_loss)`` with::

        attn_loss = weight · Σ_layers mean over (batch, heads, queries) of
                    −Σ_j softmax(T)_ij · log_softmax(S)_ij

    where ``S`` and ``T`` are the student's and teacher's scores ``q kᵀ · scale + bias`` (q, k after
    ``q_norm`` / ``k_norm``; the bias is the layer's own, i.e. GAug's Gaussian bias for a LocAt
    layer and none for plain layers). With ``loss="fy"`` each row's term is instead the
    Fenchel–Young loss of the student layer's own normalizer ``ŷ`` against the teacher layer's
    probabilities ``P`` (its own normalizer of ``T``), whose gradient is exactly ``ŷ(S) − P``: for
    an entmax student the loss of its real attention; for softmax layers the gradient of ``"ce"``
    (the value is the KL divergence: ``"ce"`` minus the teacher's entropy). Add ``attn_loss`` to the
    task loss. In eval mode only the student runs and ``attn_loss`` is ``None``.

    Args:
        teacher: a trained timm ViT or vitattn model; frozen by this wrapper.
        student: a model of the same depth, heads per block and token count (head dim may differ).
        layers: block indices, or a negative int ``-n`` for all blocks but the last ``n``; by
            default all blocks but the last 6 (all blocks when depth <= 6).
        weight: factor on the summed per-layer losses (3.0 in the released recipe).
        loss: ``"ce"`` (softmax cross-entropy of the scores, the paper's) or ``"fy"`` (the
            Fenchel–Young loss of each student layer's normalizer).
        recompute: compute each layer's loss without keeping its N x N maps for backward (default);
            ``False`` keeps them (plain autograd), for reference.
        chunk_elements: with ``recompute``, score elements rebuilt at once in backward.
    """

    def __init__(
        self,
        teacher: nn.Module,
        student: nn.Module,
        layers: int | Iterable[int] | None = None,
        weight: float = 3.0,
        *,
        loss: DistillLoss = "ce",
        recompute: bool = True,
        chunk_elements: int = CHUNK_ELEMENTS,
    ) -> None:
        if (
            isinstance(weight, bool)
            or not isinstance(weight, (int, float))
            or not math.isfinite(weight)
            or weight < 0
        ):
            raise ValueError(f"weight must be a finite number >= 0, got {weight!r}")
        if isinstance(chunk_elements, bool) or not isinstance(chunk_elements, int) or chunk_elements < 1:
            raise ValueError(f"chunk_elements must be a positive int, got {chunk_elements!r}")
        kind = resolve_loss(loss)
        super().__init__(teacher, student, layers, default=_default_layers)
        self.weight = float(weight)
        self.loss = kind
        self.recompute = bool(recompute)
        self.chunk_elements = int(chunk_elements)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, weight={self.weight}, loss={self.loss!r}, recompute={self.recompute}"

    def forward(self, x: torch.Tensor) -> TransferOutput:
        """``x: (B, C, H, W)`` -> ``TransferOutput(logits (B, num_classes), attn_loss (0-d) or None)``."""
        if not self.training:
            return TransferOutput(self.student(x), None)
        self.check_student()
        teacher = self.teacher_layers(x)
        student = layout_of(self.student, "student")
        losses: list[torch.Tensor] = []

        def rule(i: int, attn: nn.Module, q: Any, k: Any, v: torch.Tensor) -> torch.Tensor:
            normalizer = student.normalizer(i)
            target = teacher.pop(i)
            if isinstance(normalizer, torch.Tensor) or isinstance(target.normalizer, torch.Tensor):
                raise TypeError(
                    f"blocks[{i}]: attention distillation takes fixed normalizers; a layer with learned "
                    "alphas (normalizer='adaptive') is not supported as its student or teacher"
                )
            if normalizer != "softmax":
                # the entmax paths keep contiguous copies of q, k, v for backward, not the views into
                # the fused qkv buffer that the loss would keep alive: one copy each, shared by the
                # attention and the loss, lets that buffer go (the softmax paths keep the views)
                q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
            scores = layer_scores(student, i, q, k)
            check_tokens(i, q, target.scores)
            losses.append(
                attention_distill_loss(
                    scores,
                    target.scores,
                    loss=self.loss,
                    normalizer=normalizer,
                    target_normalizer=target.normalizer,
                    recompute=self.recompute,
                    chunk_elements=self.chunk_elements,
                )
            )
            return plain_rule(student, i, scores, v)

        with student.intercept(self.layers, rule):
            logits = self.student(x)
        if len(losses) != len(self.layers):
            raise RuntimeError(
                f"the student ran {len(losses)} of its {len(self.layers)} distilled attention layers "
                "in one forward"
            )
        return TransferOutput(logits, torch.stack(losses).sum() * self.weight)
