"""What AttentionCopy and AttentionDistill share: the checked teacher/student pair, the frozen teacher
kept out of the module registry, the choice of layers, and the teacher's recorded scores.

Both models are read through their layouts (:func:`vitattn.adapter.layout_of`): the chosen blocks'
attention computes through a *rule* ``rule(block_index, attn, q, k, v) -> (B, H, N, Dv)`` (record the
scores, copy the teacher's probabilities, ...) for the length of one forward
(:meth:`~vitattn.adapter.ModelLayout.intercept`); the modules, their parameters and state dicts are
untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from ..adapter import ModelLayout, layout_of
from ..functional import attention
from ..functional.normalize import AttentionNormalizer
from ..models.blocks import block_indices
from .scores import ScoreInputs

__all__ = [
    "AttentionTransfer",
    "TeacherLayer",
    "TransferOutput",
    "layer_scores",
    "plain_rule",
    "select_layers",
    "transfer_layout",
]


class TransferOutput(NamedTuple):
    """``logits``: the student's ``(B, num_classes)`` output. ``attn_loss``: the weighted attention
    distillation loss (0-d) while an :class:`AttentionDistill` trains, else ``None``."""

    logits: torch.Tensor
    attn_loss: torch.Tensor | None


@dataclass(frozen=True)
class TeacherLayer:
    """One teacher layer as recorded on an input: its score pieces (detached) and its normalizer."""

    scores: ScoreInputs
    normalizer: AttentionNormalizer


def select_layers(layers: int | Iterable[int] | None, depth: int, default: Iterable[int]) -> tuple[int, ...]:
    """Sorted block indices from ``layers``: ``None`` (``default``), a negative int ``-n`` (all blocks
    but the last ``n``), or an iterable of indices (negative ones count from the end)."""
    if layers is None:
        return tuple(default)
    if isinstance(layers, bool) or isinstance(layers, (str, bytes)):
        raise TypeError(f"layers must be an iterable of block indices or a negative int, got {layers!r}")
    if isinstance(layers, int):
        if layers >= 0:
            raise ValueError(
                f"layers={layers}: an int must be negative, -n meaning all blocks but the last n; "
                f"pass [{layers}] for block {layers} alone"
            )
        if -layers >= depth:
            raise ValueError(
                f"layers={layers} (all blocks but the last {-layers}) leaves no block of a model "
                f"with {depth} blocks"
            )
        return tuple(range(depth + layers))
    try:
        items = list(layers)
    except TypeError:
        raise TypeError(
            f"layers must be an iterable of block indices or a negative int, got {type(layers).__name__}"
        ) from None
    return block_indices(items, depth)


def transfer_layout(model: nn.Module, name: str) -> ModelLayout:
    """``model``'s layout for attention transfer (``name``: ``"teacher"`` or ``"student"``, in errors):
    a ViT with blocks attending over all tokens, or a TypeError."""
    layout = layout_of(model, name, windowed=False)
    _ = layout.blocks  # a TypeError naming `name` when the model has none
    return layout


def layer_scores(layout: ModelLayout, index: int, q: torch.Tensor, k: torch.Tensor) -> ScoreInputs:
    """Block ``index``'s scores ``q kᵀ · scale + bias`` as :class:`ScoreInputs`; the bias is the layer's
    own (GAug's Gaussian bias for a LocAt layer or a LocAt-patched transformers module, none for
    timm's and plain layers)."""
    return ScoreInputs(q, k, layout.scale(index), layout.bias(index, q))


def plain_rule(layout: ModelLayout, index: int, scores: ScoreInputs, v: torch.Tensor) -> torch.Tensor:
    """What block ``index``'s attention itself computes from its scores: ``normalize(scores) v`` (with
    its dropout); ``v: (B, H, N, Dv)`` -> ``(B, H, N, Dv)``."""
    return attention(
        scores.q,
        scores.k,
        v,
        normalizer=layout.normalizer(index),
        scale=scores.scale,
        bias=scores.bias,
        dropout_p=layout.dropout(index),
    )


def _token_count(layout: ModelLayout) -> tuple[int, str] | None:
    """``(N, description)`` of the tokens the model is built for, or ``None`` if unknown."""
    grid = layout.grid()
    if grid is None:
        return None
    prefix, patches = layout.num_prefix_tokens or 0, grid[0] * grid[1]
    return prefix + patches, f"{prefix} prefix + {patches} patches, image size {layout.image_size}"


def _check_pair(teacher: ModelLayout, student: ModelLayout, layers: Iterable[int]) -> None:
    if teacher.depth != student.depth:
        raise ValueError(
            f"teacher and student must have the same depth: teacher has {teacher.depth} blocks, "
            f"student has {student.depth}"
        )
    for i in range(teacher.depth):
        th, sh = teacher.num_heads(i), student.num_heads(i)
        if th != sh:
            raise ValueError(
                f"teacher and student must have the same number of heads: blocks[{i}].attn has {th} heads "
                f"in the teacher and {sh} in the student"
            )
    t_tokens, s_tokens = _token_count(teacher), _token_count(student)
    if t_tokens and s_tokens and t_tokens[0] != s_tokens[0]:
        raise ValueError(
            f"teacher and student must see the same number of tokens: teacher has N = {t_tokens[0]} "
            f"({t_tokens[1]}), student has N = {s_tokens[0]} ({s_tokens[1]})"
        )
    for i in layers:
        teacher.check_intercept(i)
        student.check_intercept(i)


class _TeacherDone(Exception):
    """Raised after the teacher's last needed layer: the rest of its forward is not needed."""


class AttentionTransfer(nn.Module):
    """Base of the transfer wrappers: a trainable ``student`` and a frozen ``teacher``.

    The student is the one registered submodule, so ``parameters()``, ``state_dict()`` (keys
    ``student.*``), ``apply()`` and ``requires_grad_()`` see only it. The teacher is kept outside the
    module registry: set to ``requires_grad_(False)`` and eval mode once, kept in eval by
    :meth:`train`, and moved along by ``.to()`` / ``.cuda()`` / ``.double()``.

    Either model may be a transformers vision model (:mod:`vitattn.hf`) of the same depth, heads and
    token count: it runs on the pixel values with every patch a token, and a transformers student's
    output is reduced to its prediction tensor (``logits``, else ``image_embeds``, ``pooler_output``,
    ``last_hidden_state``).
    """

    student: nn.Module

    def __init__(
        self,
        teacher: nn.Module,
        student: nn.Module,
        layers: int | Iterable[int] | None,
        default: Callable[[int], Iterable[int]],
    ) -> None:
        super().__init__()
        student_layout = transfer_layout(student, "student")
        chosen = select_layers(layers, student_layout.depth, default(student_layout.depth))
        if teacher is student:
            raise ValueError("teacher and student must be two different models, got the same module twice")
        _check_pair(transfer_layout(teacher, "teacher"), student_layout, chosen)
        self.layers = chosen
        self.add_module("student", student)
        object.__setattr__(self, "_teacher", teacher)  # not a submodule: no parameters, no state dict
        teacher.requires_grad_(False)
        teacher.eval()

    @property
    def teacher(self) -> nn.Module:
        """The frozen teacher (not part of this module's parameters or state dict)."""
        return self.__dict__["_teacher"]

    def train(self, mode: bool = True) -> AttentionTransfer:
        """Set the student's mode; the teacher stays in eval mode."""
        super().train(mode)
        self.teacher.eval()
        return self

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> AttentionTransfer:
        super()._apply(fn, recurse)
        self.teacher._apply(fn, recurse)  # .to() / .cuda() / .half() move the teacher too
        return self

    def extra_repr(self) -> str:
        return f"teacher={type(self.teacher).__name__}, layers={list(self.layers)}"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with layout_of(self.student, "student").image_calls():
            return super().__call__(*args, **kwargs)

    def check_student(self) -> None:
        """Refuse gradient checkpointing in the student: its blocks would be recomputed in backward
        without the transfer (after this forward's overrides are gone), giving wrong gradients."""
        if getattr(self.student, "grad_checkpointing", False) or getattr(
            self.student, "is_gradient_checkpointing", False
        ):
            raise RuntimeError(
                "attention transfer does not support gradient checkpointing in the student: call "
                "student.set_grad_checkpointing(False) (a transformers student: "
                "student.gradient_checkpointing_disable())"
            )

    def teacher_layers(self, x: torch.Tensor) -> dict[int, TeacherLayer]:
        """Run the teacher on ``x`` (no grad, eval) up to its last chosen layer; record those layers."""
        records: dict[int, TeacherLayer] = {}
        last = self.layers[-1]
        teacher = layout_of(self.teacher, "teacher")

        def rule(i: int, attn: nn.Module, q: Any, k: Any, v: torch.Tensor) -> torch.Tensor:
            scores = layer_scores(teacher, i, q, k)
            records[i] = TeacherLayer(scores.detach(), teacher.normalizer(i))
            if i == last:
                raise _TeacherDone
            return plain_rule(teacher, i, scores, v)

        with torch.no_grad(), teacher.intercept(self.layers, rule):
            try:
                teacher.forward(x)
            except _TeacherDone:
                pass
        missing = [i for i in self.layers if i not in records]
        if missing:
            raise RuntimeError(
                f"teacher blocks {missing} did not run their attention in the teacher's forward"
            )
        return records


def check_tokens(index: int, student_q: torch.Tensor, teacher: ScoreInputs) -> None:
    """Raise a ``ValueError`` unless both models have the same (B, H, N) at ``blocks[index]``."""
    if tuple(student_q.shape[:3]) != tuple(teacher.q.shape[:3]):
        raise ValueError(
            f"at blocks[{index}] the student has (B, H, N) = {tuple(student_q.shape[:3])} and the teacher "
            f"{tuple(teacher.q.shape[:3])}: both must see the same input and token count"
        )
