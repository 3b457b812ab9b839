"""Mixed precision of a study run: which autocast dtype, the autocast context, the fp16 grad scaler.

``--amp bf16`` / ``fp16`` run the forward and the loss under :func:`torch.autocast` on the run's
device; ``none`` runs float32. The default (``None``, "auto") is ``bf16`` on CUDA, where it makes
vitattn's attention take the fused Triton kernels (they decline float32 unless TF32 is allowed),
and ``none`` on the CPU. ``fp16`` scales the loss with timm's ``NativeScaler`` (a
:class:`torch.amp.GradScaler` that also does the backward pass and the step); under DDP
the gradients are all-reduced before the scaler unscales them, so every rank sees the same inf/NaN
check and skips (or takes) the same step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Literal

import torch
from timm.utils import NativeScaler

__all__ = ["AMP_CHOICES", "AmpMode", "autocast", "grad_scaler", "resolve_amp"]

AmpMode = Literal["bf16", "fp16", "none"]
AMP_CHOICES: tuple[AmpMode, ...] = ("bf16", "fp16", "none")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_amp(amp: str | None, device: torch.device) -> AmpMode:
    """``amp`` checked (``bf16``, ``fp16``, ``none``), or for None the default of ``device``:
    ``bf16`` on CUDA, ``none`` elsewhere."""
    if amp is None:
        return "bf16" if device.type == "cuda" else "none"
    if amp not in AMP_CHOICES:
        raise ValueError(
            f"amp must be one of {', '.join(AMP_CHOICES)} (or None for the device's default), got {amp!r}"
        )
    return amp


@contextlib.contextmanager
def autocast(device: torch.device, amp: AmpMode) -> Iterator[None]:
    """``torch.autocast(device.type, dtype)`` for ``bf16`` / ``fp16``; nothing for ``none``."""
    if amp == "none":
        yield
        return
    with torch.autocast(device.type, dtype=_DTYPES[amp]):
        yield


def grad_scaler(device: torch.device, amp: AmpMode) -> NativeScaler | None:
    """timm's ``NativeScaler`` on ``device`` for ``fp16`` (float16 gradients underflow without one;
    ``scaler(loss, optimizer)`` scales, backpropagates, steps and updates the scale); None for
    ``bf16`` (float32's exponent range) and ``none``."""
    return NativeScaler(device.type) if amp == "fp16" else None
