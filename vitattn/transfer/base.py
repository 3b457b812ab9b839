"""What AttentionCopy and AttentionDistill share: the checked teacher/student pair, the frozen teacher
kept out of the module registry, the choice of layers, and the teacher's recorded scores."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from ..functional.normalize import Normalizer
from ..models.blocks import block_indices, is_transformers_model
from .intercept import (
    blocks_of,
    layer_attention,
    layer_heads,
    layer_normalizer,
    layer_scores,
    model_forward,
    override_attention,
    plain_rule,
)
from .scores import ScoreInputs

__all__ = ["AttentionTransfer", "TeacherLayer", "TransferOutput", "select_layers"]


class TransferOutput(NamedTuple):
    """``logits``: the student's ``(B, num_classes)`` output. ``attn_loss``: the weighted attention
    distillation loss (0-d) while an :class:`AttentionDistill` trains, else ``None``."""

    logits: torch.Tensor
    attn_loss: torch.Tensor | None


@dataclass(frozen=True)
class TeacherLayer:
    """One teacher layer as recorded on an input: its score pieces (detached) and its normalizer."""

    scores: ScoreInputs
    normalizer: Normalizer


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


def _token_layout(model: nn.Module) -> tuple[int, str] | None:
    """``(N, description)`` of the tokens a timm-style ViT (or transformers vision model) is built for,
    or ``None`` if unknown."""
    if is_transformers_model(model):
        from ..hf.layout import hf_layout

        layout = hf_layout(model)
        gh, gw = layout.grid()
        desc = f"{layout.num_prefix_tokens} prefix + {gh * gw} patches, image_size {layout.image_size}"
        return layout.num_tokens(), desc
    embed = getattr(model, "patch_embed", None)
    patches = getattr(embed, "num_patches", None)
    if patches is None:
        return None
    prefix = int(getattr(model, "num_prefix_tokens", 0))
    img = getattr(embed, "img_size", None)
    return prefix + int(patches), f"{prefix} prefix + {int(patches)} patches, img_size {img}"


def _check_pair(teacher: nn.Module, student: nn.Module, layers: Iterable[int]) -> None:
    if teacher is student:
        raise ValueError("teacher and student must be two different models, got the same module twice")
    t_blocks, s_blocks = blocks_of(teacher, "teacher"), blocks_of(student, "student")
    if len(t_blocks) != len(s_blocks):
        raise ValueError(
            f"teacher and student must have the same depth: teacher has {len(t_blocks)} blocks, "
            f"student has {len(s_blocks)}"
        )
    for i in range(len(t_blocks)):
        th, sh = layer_heads(teacher, i, "teacher"), layer_heads(student, i, "student")
        if th != sh:
            raise ValueError(
                f"teacher and student must have the same number of heads: blocks[{i}].attn has {th} heads "
                f"in the teacher and {sh} in the student"
            )
    t_tokens, s_tokens = _token_layout(teacher), _token_layout(student)
    if t_tokens and s_tokens and t_tokens[0] != s_tokens[0]:
        raise ValueError(
            f"teacher and student must see the same number of tokens: teacher has N = {t_tokens[0]} "
            f"({t_tokens[1]}), student has N = {s_tokens[0]} ({s_tokens[1]})"
        )
    for i in layers:
        layer_attention(teacher, i, "teacher")
        layer_attention(student, i, "student")


class _TeacherDone(Exception):
    """Raised after the teacher's last needed layer: the rest of its forward is not needed."""


def _logits(output: Any) -> Any:
    """A transformers model output's prediction tensor: ``logits``, ``image_embeds``, ``pooler_output``
    or ``last_hidden_state``, the first it has (a tensor stays as it is)."""
    if isinstance(output, torch.Tensor):
        return output
    for name in ("logits", "image_embeds", "pooler_output", "last_hidden_state"):
        value = getattr(output, name, None)
        if isinstance(value, torch.Tensor):
            return value
    return output


@contextmanager
def _images_in_logits_out(model: nn.Module) -> Iterator[None]:
    """Within the block, ``model(x)`` of a transformers model runs on ``pixel_values=x`` with every patch
    a token (the keyword arguments its forward takes) and returns its prediction tensor."""
    from ..hf.layout import all_patch_tokens, backbone_kwargs, hf_layout

    layout = hf_layout(model)

    def pre(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], Any]:
        if not args:
            return args, kwargs
        images = args[0]
        extra = backbone_kwargs(layout, images, callee=module)
        return (), {"pixel_values": images, **extra, **kwargs}

    def post(module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        return _logits(output)

    handles = [
        model.register_forward_pre_hook(pre, with_kwargs=True),
        model.register_forward_hook(post, with_kwargs=True),
    ]
    try:
        with all_patch_tokens(layout):
            yield
    finally:
        for handle in handles:
            handle.remove()


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
        depth = len(blocks_of(student, "student"))
        chosen = select_layers(layers, depth, default(depth))
        _check_pair(teacher, student, chosen)
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
        if not is_transformers_model(self.student):
            return super().__call__(*args, **kwargs)
        with _images_in_logits_out(self.student):
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

        def rule(i: int, attn: nn.Module, q: Any, k: Any, v: torch.Tensor) -> torch.Tensor:
            scores = layer_scores(attn, q, k)
            records[i] = TeacherLayer(scores.detach(), layer_normalizer(attn))
            if i == last:
                raise _TeacherDone
            return plain_rule(attn, scores, v)

        with torch.no_grad(), override_attention(self.teacher, self.layers, rule, name="teacher"):
            try:
                model_forward(self.teacher, x)
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
