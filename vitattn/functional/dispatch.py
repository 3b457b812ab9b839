"""Backend registry for :func:`vitattn.functional.attention`.

Each backend states what it supports through :meth:`AttentionBackend.unsupported`, which returns
``None`` when it can run a call and otherwise a short reason. ``explicit`` tells it whether the user
named it (``backend="triton"``) or ``"auto"`` is asking: a backend may accept a call only when
named (the Triton interpreter on CPU tensors, a debugging aid, is never picked by ``"auto"``).

``backend="auto"`` takes the first backend in preference order that supports the call; an explicit
backend that cannot run a call raises a ``ValueError`` carrying its reason. The pure-PyTorch backend
supports everything and is the reference every other backend is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from .gaussian import GaussianBias


@dataclass(frozen=True)
class AttentionCall:
    """A validated attention call. Shapes: q ``(B, H, Nq, D)``, k ``(B, H, Nk, D)``, v ``(B, H, Nk, Dv)``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    normalizer: str | float  # canonical, see resolve_normalizer
    scale: float
    mask: torch.Tensor | None  # bool keep-mask or additive float, broadcastable to (B, H, Nq, Nk)
    bias: torch.Tensor | GaussianBias | None
    return_weights: bool
    dropout_p: float


class AttentionBackend(Protocol):
    name: str

    def unsupported(self, call: AttentionCall, explicit: bool = False) -> str | None:
        """``None`` if this backend can run ``call``, else why not (``explicit``: named by the user)."""

    def run(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return ``(out, probs or None)``."""


_REGISTRY: dict[str, AttentionBackend] = {}
_AUTO_ORDER: list[str] = []


def register_backend(backend: AttentionBackend, *, prefer: bool = False) -> None:
    """Add a backend; ``prefer=True`` puts it before the others for ``backend="auto"``."""
    _REGISTRY[backend.name] = backend
    if backend.name in _AUTO_ORDER:
        _AUTO_ORDER.remove(backend.name)
    if prefer:
        _AUTO_ORDER.insert(0, backend.name)
    else:
        _AUTO_ORDER.append(backend.name)


def available_backends() -> list[str]:
    """Names accepted by ``backend=`` besides ``"auto"``."""
    return list(_REGISTRY)


def explain(call: AttentionCall) -> dict[str, str | None]:
    """For each backend, ``None`` if ``backend="auto"`` could pick it for ``call``, or why not."""
    return {name: _REGISTRY[name].unsupported(call, explicit=False) for name in _AUTO_ORDER}


def select_backend(call: AttentionCall, backend: str) -> AttentionBackend:
    """Resolve ``backend`` ("auto" or a registered name) for ``call``."""
    if backend == "auto":
        for name in _AUTO_ORDER:
            if _REGISTRY[name].unsupported(call, explicit=False) is None:
                return _REGISTRY[name]
        reasons = "; ".join(f"{n}: {r}" for n, r in explain(call).items())
        raise ValueError(f"no attention backend supports this call ({reasons})")
    if backend not in _REGISTRY:
        raise ValueError(f"backend must be 'auto' or one of {available_backends()}, got {backend!r}")
    chosen = _REGISTRY[backend]
    reason = chosen.unsupported(call, explicit=True)
    if reason is not None:
        raise ValueError(f"backend={backend!r} cannot run this call: {reason}")
    return chosen
