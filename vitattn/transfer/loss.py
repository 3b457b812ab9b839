"""The attention-distillation loss of one layer, computed without keeping its N x N maps for backward.

For student scores ``S`` and teacher scores ``T`` (both ``(B, H, N, N)``), ``loss="ce"`` (the paper's)::

    loss = mean over (b, h, i) of  −Σ_j softmax(T)_ij · log_softmax(S)_ij
    ∂loss/∂S = (softmax(S) · Σ_j softmax(T)_ij − softmax(T)) / (B·H·N)

and ``loss="fy"``, the Fenchel–Young loss of the student's normalizer ``ŷ`` against the teacher's
probabilities ``P = ŷ_T(T)`` (:func:`vitattn.functional.fy_loss`; softmax: the same gradient as "ce")::

    loss = mean over (b, h, i) of  FY_ŷ(S_i; P_i)
    ∂loss/∂S = (ŷ(S) − P) / (B·H·N)

``recompute=True`` (the default) saves only what the scores are made of (q, k and GAug's σ, α: O(N·d)
per layer) and rebuilds the scores in backward, a slice of batch and heads at a time, so that at most
a few ``chunk_elements``-sized maps exist at once. ``recompute=False`` is the plain autograd graph,
which keeps ``softmax(T)`` and ``log_softmax(S)`` of every layer until backward; the two agree to
rounding (see ``tests/test_transfer.py``). The teacher is a target: no gradient reaches it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch
from torch.autograd.function import once_differentiable

from ..functional.fy_loss import fy_grad, fy_loss_formula
from ..functional.normalize import Normalizer, normalize, resolve_normalizer
from .scores import ScoreInputs, cross_entropy_sum

__all__ = ["CHUNK_ELEMENTS", "LOSSES", "DistillObjective", "attention_distill_loss", "chunks"]

CHUNK_ELEMENTS = 1 << 22  # score elements per chunk: 16 MiB of float32
LOSSES = ("ce", "fy")
DistillLoss = Literal["ce", "fy"]


@dataclass(frozen=True)
class DistillObjective:
    """What one layer's loss compares: ``"ce"`` (softmax cross-entropy of the scores, the paper's) or
    ``"fy"`` (the Fenchel–Young loss of the student's ``normalizer`` against the teacher's
    probabilities under ``target_normalizer``). Sums over rows; the caller divides."""

    loss: DistillLoss = "ce"
    normalizer: Normalizer = "softmax"
    target_normalizer: Normalizer = "softmax"

    def target(self, teacher_scores: torch.Tensor) -> torch.Tensor:
        """The teacher's probabilities ``(B, H, N, N)`` (no grad)."""
        with torch.no_grad():
            kind = "softmax" if self.loss == "ce" else self.target_normalizer
            return normalize(teacher_scores, kind, -1, masked=False)

    def value_sum(self, student_scores: torch.Tensor, teacher_scores: torch.Tensor) -> torch.Tensor:
        """The loss summed over every row; differentiable in ``student_scores`` by plain autograd."""
        if self.loss == "ce":
            return cross_entropy_sum(student_scores, teacher_scores.detach())
        return fy_loss_formula(student_scores, self.target(teacher_scores), self.normalizer, -1).sum()

    def grad(self, student_scores: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """``∂ value_sum / ∂ student_scores`` in closed form from the teacher's probabilities ``target``
        (:meth:`target`), no grad; a fresh tensor, made with one map beside the student's."""
        with torch.no_grad():
            if self.loss == "ce":
                return torch.softmax(student_scores, -1).mul_(target.sum(-1, keepdim=True)).sub_(target)
            return fy_grad(student_scores, target, self.normalizer, -1)


def chunks(shape: tuple[int, int, int, int], chunk_elements: int) -> Iterator[tuple[slice, slice]]:
    """Slices ``(batch, heads)`` covering ``(B, H, Nq, Nk)`` scores, each about ``chunk_elements`` big.

    Whole heads are grouped first (several batch items per chunk when all heads fit), then single
    ``(batch item, head)`` maps; a chunk is never smaller than one ``Nq x Nk`` map.
    """
    b, h, nq, nk = shape
    maps = max(1, int(chunk_elements) // max(1, nq * nk))  # (batch, head) maps per chunk
    if maps >= h:
        step = maps // h
        for b0 in range(0, b, step):
            yield slice(b0, min(b0 + step, b)), slice(None)
    else:
        for b0 in range(b):
            for h0 in range(0, h, maps):
                yield slice(b0, b0 + 1), slice(h0, min(h0 + maps, h))


class _RecomputedLoss(torch.autograd.Function):
    """Mean loss between teacher and student score rows, O(N·d) saved for backward."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        objective: DistillObjective,
        student: ScoreInputs,
        teacher: ScoreInputs,
        chunk_elements: int,
        *tensors: torch.Tensor,
    ) -> torch.Tensor:
        n_student = len(student.tensors())
        student = student.with_tensors(tensors[:n_student])
        teacher = teacher.with_tensors(tensors[n_student:])
        b, h, nq, _ = student.shape
        total = None
        for bs, hs in chunks(student.shape, chunk_elements):
            part = objective.value_sum(student.select(bs, hs).scores(), teacher.select(bs, hs).scores())
            total = part if total is None else total + part
        assert total is not None
        ctx.save_for_backward(*tensors)
        ctx.templates = (objective, student.skeleton(), teacher.skeleton(), n_student, chunk_elements)  # type: ignore[attr-defined]
        return total / (b * h * nq)

    @staticmethod
    @once_differentiable
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        # the ignores: FunctionCtx's stub has neither ctx.templates (set in forward, torch's pattern for
        # non-tensor state) nor the backward ctx's runtime saved_tensors / needs_input_grad
        objective, student, teacher, n_student, chunk_elements = ctx.templates  # type: ignore[attr-defined]
        tensors = ctx.saved_tensors  # type: ignore[attr-defined]
        student = student.with_tensors(tensors[:n_student])
        teacher = teacher.with_tensors(tensors[n_student:])
        needs = ctx.needs_input_grad[4 : 4 + n_student]  # type: ignore[attr-defined]
        grads = [
            torch.zeros_like(t) if need else None for t, need in zip(student.tensors(), needs, strict=True)
        ]
        if any(needs):
            b, h, nq, _ = student.shape
            g = grad / (b * h * nq)
            for bs, hs in chunks(student.shape, chunk_elements):
                part = student.select(bs, hs)
                leaves = [
                    t.detach().requires_grad_(need) for t, need in zip(part.tensors(), needs, strict=True)
                ]
                p_t = objective.target(teacher.select(bs, hs).scores())  # the teacher's scores freed here
                with torch.enable_grad():
                    s = part.with_tensors(tuple(leaves)).scores()
                d_s = objective.grad(s.detach(), p_t).mul_(g)
                del p_t
                wanted = [leaf for leaf in leaves if leaf.requires_grad]
                chunk_grads = iter(torch.autograd.grad(s, wanted, d_s))
                for grad_i in grads:  # a gradient slot exactly where its leaf requires grad
                    if grad_i is not None:
                        _add_slice(grad_i, next(chunk_grads), bs, hs)
        return (None, None, None, None, *grads, *([None] * (len(tensors) - n_student)))


def _add_slice(grad: torch.Tensor, part: torch.Tensor, batch: slice, heads: slice) -> None:
    """``grad[batch, heads] += part``; a size-1 (broadcast) B or H dim of ``grad`` takes every chunk."""
    view = grad if grad.dim() == 4 else grad.reshape((1,) * (4 - grad.dim()) + tuple(grad.shape))
    view[batch if view.shape[0] > 1 else slice(None), heads if view.shape[1] > 1 else slice(None)] += part


def _check_pair(student: ScoreInputs, teacher: ScoreInputs) -> None:
    for name, value in (("student", student), ("teacher", teacher)):
        if not isinstance(value, ScoreInputs):
            raise TypeError(f"{name} must be ScoreInputs, got {type(value).__name__}")
    if student.shape != teacher.shape:
        raise ValueError(
            "student and teacher scores must have the same (B, H, Nq, Nk): student has "
            f"{student.shape} (q {tuple(student.q.shape)}), teacher has {teacher.shape} "
            f"(q {tuple(teacher.q.shape)})"
        )


def resolve_loss(loss: object) -> DistillLoss:
    """``"ce"`` or ``"fy"``, else a ``ValueError`` naming the argument."""
    if loss == "ce":
        return "ce"
    if loss == "fy":
        return "fy"
    raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")


def attention_distill_loss(
    student: ScoreInputs,
    teacher: ScoreInputs,
    *,
    loss: DistillLoss = "ce",
    normalizer: Normalizer = "softmax",
    target_normalizer: Normalizer = "softmax",
    recompute: bool = True,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> torch.Tensor:
    """Mean over (batch, heads, queries) of the per-row loss between student and teacher scores; 0-d.

    Args:
        student: the student layer's score pieces; gradients flow to its tensors.
        teacher: the teacher layer's score pieces, same ``(B, H, N, N)`` scores (head dims may
            differ); treated as a constant target.
        loss: ``"ce"``: ``−Σ_j softmax(T)_ij · log_softmax(S)_ij`` (the normalizers are not used);
            ``"fy"``: the Fenchel–Young loss of ``normalizer`` (the student layer's) against
            ``normalize(T, target_normalizer)`` (the teacher layer's probabilities).
        normalizer, target_normalizer: with ``loss="fy"``: ``"softmax"``, ``"entmax15"``,
            ``"sparsemax"`` or a float α > 1.
        recompute: save O(N·d) and rebuild the scores in backward (default), or keep the maps
            (plain autograd through the formula, the reference).
        chunk_elements: with ``recompute``, score elements made at once (a multiple of one map).
    """
    _check_pair(student, teacher)
    if int(chunk_elements) < 1:
        raise ValueError(f"chunk_elements must be a positive int, got {chunk_elements}")
    kind = resolve_loss(loss)
    objective = DistillObjective(
        kind,
        resolve_normalizer(normalizer) if kind == "fy" else "softmax",
        resolve_normalizer(target_normalizer) if kind == "fy" else "softmax",
    )
    if not recompute:
        b, h, nq, _ = student.shape
        return objective.value_sum(student.scores(), teacher.scores().detach()) / (b * h * nq)
    teacher = teacher.detach()
    tensors = (*student.tensors(), *teacher.tensors())
    return _RecomputedLoss.apply(
        objective, student.skeleton(), teacher.skeleton(), int(chunk_elements), *tensors
    )
