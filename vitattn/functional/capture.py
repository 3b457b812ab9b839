"""Observe the attention probabilities of every :func:`attention` call inside a ``with`` block.

Analysis tools use this to read the weights of any vitattn layer, whatever backend would run it:
while a capture is active, calls are made with ``return_weights=True`` (a backend that cannot
return weights is skipped by the dispatcher) and each ``(B, H, Nq, Nk)`` probability tensor is
handed to the callback. Outside a capture nothing changes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

WeightsCallback = Callable[[torch.Tensor], None]

_ACTIVE: ContextVar[tuple[WeightsCallback, ...]] = ContextVar("vitattn_capture", default=())


def active_callbacks() -> tuple[WeightsCallback, ...]:
    """Callbacks of the enclosing captures, outermost first (empty outside any capture)."""
    return _ACTIVE.get()


@contextmanager
def capture_attention_weights(callback: WeightsCallback) -> Iterator[None]:
    """Within the block, call ``callback(probs)`` for every :func:`attention` call (detached probs).

    Captures nest; each receives every call. The callback gets the probabilities before dropout.
    """
    token = _ACTIVE.set(_ACTIVE.get() + (callback,))
    try:
        yield
    finally:
        _ACTIVE.reset(token)
