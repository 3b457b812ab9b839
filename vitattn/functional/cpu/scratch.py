"""One pool of reusable buffers for the CPU row-blocked paths, per thread, device and dtype, with named slots.

A block of scores is a few MiB; allocated afresh for every block (or every call), such buffers go back to
the operating system and are faulted in again each time. The paths take them from here instead: a slot
is one buffer, grown when a larger one is asked for and kept for later calls on the same thread. Two
buffers that a path needs at the same time come from two different slots.
"""

from __future__ import annotations

import enum
import threading

import torch

__all__ = ["Slot", "release", "scratch"]


class Slot(enum.Enum):
    """The buffers a row-blocked path may hold at one time (each names what it holds)."""

    SCORES = "scores"  # a block of scores, unnormalized probabilities or their gradient dP
    GRADS = "grads"  # a block of score gradients dS (the softmax backward)
    PROBS = "probs"  # a block of probabilities p or of sqrt(p) (entmax-1.5)
    OUTPUTS = "outputs"  # a block of outputs (B, rows, Dv) before they are normalized
    SHIFTED = "shifted"  # entmax-1.5's shifted, clamped scores of a block
    WORK = "work"  # entmax-1.5's threshold-search scratch
    PRODUCTS = "products"  # the products behind the bias factors' gradients


_local = threading.local()


def _pool() -> dict[tuple[Slot, torch.device, torch.dtype], torch.Tensor]:
    pool = getattr(_local, "pool", None)
    if pool is None:
        pool = _local.pool = {}
    return pool


def scratch(slot: Slot, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A flat buffer of ``numel`` elements from ``slot``, reused by later calls on this thread.

    Always a normal tensor, even when first asked for under ``torch.inference_mode`` (an inference
    tensor could not be written in place by a later training call). Its contents are undefined.
    """
    if not isinstance(slot, Slot):
        raise TypeError(f"slot must be a Slot, got {slot!r}")
    pool = _pool()
    key = (slot, torch.device(device), dtype)
    buf = pool.get(key)
    if buf is None or buf.numel() < numel:
        with torch.inference_mode(False):
            buf = torch.empty(numel, dtype=dtype, device=device)
        pool[key] = buf
    return buf[:numel]


def release() -> None:
    """Drop this thread's buffers (the next call allocates them afresh)."""
    _pool().clear()
