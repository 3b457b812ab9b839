"""Backend registry and dispatcher of :func:`vitattn.functional.attention`.

Every execution path is a named backend. Each states what it supports through
:meth:`AttentionBackend.unsupported`, which returns ``None`` when it can run a call and otherwise a
short reason; :meth:`AttentionBackend.path` names the path it would take. ``explicit`` tells it whether
the user named it (``backend="triton"``) or ``"auto"`` is asking: a backend may accept a call only when
named (the Triton interpreter on CPU tensors, a debugging aid, is never picked by ``"auto"``).

The backends, in ``"auto"`` order: ``triton`` (fused kernels, CUDA), ``cpu_blocked`` (the CPU row-blocked
paths), ``sdpa`` (``scaled_dot_product_attention``), ``reference`` (the dense formula, every call; what
every other backend is tested against). ``backend="auto"`` takes the first that supports the call; a
named backend that cannot run a call raises a ``ValueError`` carrying its reason. A *group* name stands
for its members in that order: ``"torch"`` is the pure-PyTorch group (``cpu_blocked``, ``sdpa``,
``reference``): everything but the Triton kernels.

Which backend ``"auto"`` means (first match wins):

1. a layer's or a call's own ``backend=`` other than ``"auto"``;
2. :func:`set_default_backend` (process-wide, ``None`` clears it);
3. the ``VITATTN_BACKEND`` environment variable, read once when vitattn is imported;
4. the automatic choice above.

A default from 2 or 3 is treated like a named backend: a call it cannot run raises, with its reason.

When ``"auto"`` runs a CUDA call on a backend that builds ``(Nq, Nk)`` scores the call did not bring
(a backend's optional ``builds_scores(call)``: ``reference`` always, ``sdpa`` for a Gaussian bias or a
window) because a backend before it declined, :func:`warn_dense_fallback` (called by ``attention``)
issues a :class:`SlowPathWarning` naming the path and the reason, once per backend and reason (not
while compiling, not for ``return_weights=True``, which asks for the dense weights).

Optional call features (:data:`FEATURES`: a tensor of alphas as the normalizer, a
:class:`~vitattn.functional.WindowMask`) reach only the backends that list them in their ``features``
attribute; the dispatcher declines them for every other backend, with the feature's reason, before
asking the backend itself. A backend written before a feature existed thus never sees it.
Whether a call is being compiled (``torch.compile``) and whether autograd records it are decided once,
when the call is made (:attr:`AttentionCall.compiling`, :attr:`AttentionCall.needs_grad`); backends read
those fields instead of asking again.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from .gaussian import GaussianBias
from .normalize import AttentionNormalizer
from .window import WindowMask

__all__ = [
    "ENV_VAR",
    "FEATURES",
    "SlowPathWarning",
    "AttentionBackend",
    "AttentionCall",
    "autocast_dtype",
    "available_backends",
    "backend_reasons",
    "check_backend_name",
    "declines",
    "get_default_backend",
    "operand_dtype",
    "register_backend",
    "register_group",
    "resolve_backend",
    "run_in_call_dtype",
    "select_backend",
    "set_default_backend",
    "warn_dense_fallback",
]


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The autocast dtype if autocast is on for ``device_type`` (cuda / cpu), else ``None``."""
    if device_type in ("cuda", "cpu") and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def operand_dtype(dtypes: Sequence[torch.dtype], autocast: torch.dtype | None = None) -> torch.dtype:
    """The one dtype q, k, v of a call are cast to before any backend computes with them.

    The autocast dtype when autocast is on (timm's ``qk_norm`` hands over float32 q, k next to a
    bfloat16 v under autocast), unless an input is float64 (autocast never narrows float64); else
    the promoted dtype of the inputs (float32 q, k with a bfloat16 v give float32). Scores and
    normalizers then run in :func:`~vitattn.functional.compute_dtype` of it (at least float32), and
    the output is in this dtype.
    """
    if autocast is not None and torch.float64 not in dtypes:
        return autocast
    return functools.reduce(torch.promote_types, dtypes)


@dataclass(frozen=True)
class AttentionCall:
    """A validated attention call. Shapes: q ``(B, H, Nq, D)``, k ``(B, H, Nk, D)``, v ``(B, H, Nk, Dv)``.

    q, k, v may have different floating dtypes; :attr:`dtype` is the one every backend computes with.
    ``needs_grad``: autograd records the call (grad mode on and an input that requires a gradient);
    ``compiling``: the call is being traced by ``torch.compile``. Both are fixed when the call is made.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    normalizer: AttentionNormalizer  # canonical (resolve_normalizer), or a 4-D tensor of alphas
    scale: float
    mask: torch.Tensor | None  # bool keep-mask or additive float, broadcastable to (B, H, Nq, Nk)
    bias: torch.Tensor | GaussianBias | None
    return_weights: bool
    dropout_p: float
    needs_grad: bool = False
    compiling: bool = False
    window: WindowMask | None = None  # a neighbourhood keep-mask besides ``mask``

    @property
    def features(self) -> frozenset[str]:
        """The optional features (:data:`FEATURES`) this call uses."""
        out = set()
        if isinstance(self.normalizer, torch.Tensor):
            out.add("alpha_tensor")
        if self.window is not None:
            out.add("window")
        return frozenset(out)

    @property
    def dtype(self) -> torch.dtype:
        """:func:`operand_dtype` of q, k, v under the current autocast state of q's device."""
        dtypes = (self.q.dtype, self.k.dtype, self.v.dtype)
        return operand_dtype(dtypes, autocast_dtype(self.q.device.type))


_R = TypeVar("_R")


def run_in_call_dtype(call: AttentionCall, fn: Callable[[AttentionCall], _R]) -> _R:
    """``fn(call)`` with q, k, v cast to ``call.dtype`` (differentiable; a no-op where equal) and autocast
    off on q's device, so that scores and normalizers run in
    :func:`~vitattn.functional.compute_dtype` of that dtype whatever autocast would do."""
    dtype = call.dtype
    if any(t.dtype != dtype for t in (call.q, call.k, call.v)):
        call = dataclasses.replace(call, q=call.q.to(dtype), k=call.k.to(dtype), v=call.v.to(dtype))
    device_type = call.q.device.type
    if autocast_dtype(device_type) is None:
        return fn(call)
    with torch.autocast(device_type, enabled=False):
        return fn(call)


# The optional call features, each with the reason a backend that does not list it declines.
FEATURES: dict[str, str] = {
    "alpha_tensor": "a tensor normalizer (alpha-entmax with a tensor of alphas, e.g. one learnable alpha "
    "per head): this backend computes fixed normalizers only (the reference backend runs it)",
    "window": "a WindowMask (neighbourhood attention): this backend does not apply windows",
}


class AttentionBackend(Protocol):
    """A backend. It may also list the optional call features it implements in a ``features``
    attribute (a ``frozenset`` of :data:`FEATURES` keys; none if absent)."""

    name: str

    def unsupported(self, call: AttentionCall, explicit: bool = False) -> str | None:
        """``None`` if this backend can run ``call``, else why not (``explicit``: named by the user)."""

    def path(self, call: AttentionCall) -> str:
        """The path this backend takes for ``call`` (one it supports), in a few words."""

    def run(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return ``(out, probs or None)``."""


_REGISTRY: dict[str, AttentionBackend] = {}
_AUTO_ORDER: list[str] = []
_GROUPS: dict[str, tuple[str, ...]] = {}
ENV_VAR = "VITATTN_BACKEND"
_ENV_BACKEND: str | None = os.environ.get(ENV_VAR, "").strip() or None  # read once, like TIMM_FUSED_ATTN
_DEFAULT_BACKEND: str | None = None  # set_default_backend


def register_backend(backend: AttentionBackend, *, prefer: bool = False) -> None:
    """Add a backend; ``prefer=True`` puts it before the others for ``backend="auto"``."""
    if backend.name in _GROUPS or backend.name == "auto":
        raise ValueError(f"{backend.name!r} is a group name or 'auto', not a backend name")
    _REGISTRY[backend.name] = backend
    if backend.name in _AUTO_ORDER:
        _AUTO_ORDER.remove(backend.name)
    if prefer:
        _AUTO_ORDER.insert(0, backend.name)
    else:
        _AUTO_ORDER.append(backend.name)


def register_group(name: str, members: Sequence[str]) -> None:
    """Let ``backend=name`` stand for the first of ``members`` (registered backends, tried in ``"auto"``
    order) that supports a call."""
    unknown = [m for m in members if m not in _REGISTRY]
    if unknown or name in _REGISTRY or name == "auto":
        raise ValueError(f"group {name!r}: {unknown or name!r} is not a registered backend / a free name")
    _GROUPS[name] = tuple(members)


def available_backends() -> list[str]:
    """Backend names accepted by ``backend=`` besides ``"auto"`` and the group names, in ``"auto"`` order."""
    return list(_AUTO_ORDER)


def backend_groups() -> dict[str, tuple[str, ...]]:
    """The group names accepted by ``backend=``, each with its members."""
    return dict(_GROUPS)


def check_backend_name(backend: object, name: str = "backend") -> str:
    """``backend`` if it is ``"auto"``, a registered name or a group, else a ``ValueError`` naming
    ``name``."""
    if backend == "auto" or (isinstance(backend, str) and (backend in _REGISTRY or backend in _GROUPS)):
        return backend
    raise ValueError(
        f"{name} must be 'auto', one of {available_backends()} or a group {sorted(_GROUPS)}, got {backend!r}"
    )


def set_default_backend(backend: str | None) -> None:
    """Use ``backend`` wherever ``backend="auto"`` is asked for (layers and :func:`attention` calls).

    ``"auto"`` restores the automatic choice; ``None`` clears this setting, so that the
    ``VITATTN_BACKEND`` environment variable (if set) applies again. Precedence: a layer's or call's
    own ``backend`` > this > ``VITATTN_BACKEND`` > automatic.
    """
    global _DEFAULT_BACKEND
    name = "set_default_backend(backend)"
    _DEFAULT_BACKEND = None if backend is None else check_backend_name(backend, name)


def get_default_backend() -> str:
    """What ``"auto"`` resolves to: :func:`set_default_backend`, else ``VITATTN_BACKEND``, else "auto"."""
    if _DEFAULT_BACKEND is not None:
        return _DEFAULT_BACKEND
    if _ENV_BACKEND is not None:
        return check_backend_name(_ENV_BACKEND, f"the environment variable {ENV_VAR}")
    return "auto"


def resolve_backend(backend: str) -> str:
    """``backend`` itself unless it is ``"auto"``; then :func:`get_default_backend`."""
    return get_default_backend() if backend == "auto" else backend


def declines(backend: AttentionBackend, call: AttentionCall, explicit: bool = False) -> str | None:
    """``None`` if ``backend`` can run ``call``, else why not: first the optional features of the call
    the backend does not list (:data:`FEATURES`), then the backend's own ``unsupported``."""
    missing = sorted(call.features - getattr(backend, "features", frozenset()))
    if missing:
        return "; ".join(FEATURES[f] for f in missing)
    return backend.unsupported(call, explicit=explicit)


def backend_reasons(call: AttentionCall, explicit: bool = False) -> dict[str, str | None]:
    """For each backend in ``"auto"`` order, ``None`` if it can run ``call``, or why not."""
    return {name: declines(_REGISTRY[name], call, explicit) for name in _AUTO_ORDER}


class SlowPathWarning(UserWarning):
    """``backend="auto"`` ran a CUDA call on a path that builds ``(Nq, Nk)`` scores (the dense formula,
    or SDPA with a dense bias or window mask) because the backend before it declined the call."""


_WARNED: set[tuple[str, str]] = set()  # (backend, reason) pairs already warned about


def _first_of(names: Sequence[str], call: AttentionCall, label: str) -> AttentionBackend:
    for name in names:
        if declines(_REGISTRY[name], call) is None:
            return _REGISTRY[name]
    reasons = "; ".join(f"{n}: {declines(_REGISTRY[n], call)}" for n in names)
    raise ValueError(f"no attention backend of {label} supports this call ({reasons})")


def select_backend(call: AttentionCall, backend: str) -> AttentionBackend:
    """Resolve ``backend`` ("auto", a group or a registered name; "auto" honours the default) for ``call``."""
    requested = backend
    backend = resolve_backend(backend)
    if backend == "auto":
        return _first_of(_AUTO_ORDER, call, "'auto'")
    check_backend_name(backend)
    if backend in _GROUPS:
        members = _GROUPS[backend]
        return _first_of([n for n in _AUTO_ORDER if n in members], call, f"the group {backend!r}")
    chosen = _REGISTRY[backend]
    reason = declines(chosen, call, explicit=True)
    if reason is not None:
        via = "" if requested == backend else f" (the default backend, see {ENV_VAR} / set_default_backend)"
        raise ValueError(f"backend={backend!r}{via} cannot run this call: {reason}")
    return chosen


def warn_dense_fallback(call: AttentionCall, chosen: AttentionBackend, backend: str) -> None:
    """A :class:`SlowPathWarning`, once per ``(chosen, reason)``, when ``backend`` resolved to ``"auto"``
    and it chose for a CUDA call a backend that builds ``(Nq, Nk)`` scores the call did not bring (its
    ``builds_scores(call)``) because a backend before it declined; none while compiling or for
    ``return_weights=True``. Called by :func:`~vitattn.functional.attention` (the warning points at its
    caller)."""
    if call.q.device.type != "cuda" or call.compiling or call.return_weights:
        return
    builds = getattr(chosen, "builds_scores", None)
    if builds is None or not builds(call) or resolve_backend(backend) != "auto":
        return
    earlier = _AUTO_ORDER[: _AUTO_ORDER.index(chosen.name)] if chosen.name in _AUTO_ORDER else []
    skipped = [(name, declines(_REGISTRY[name], call)) for name in earlier]
    declined = [(name, reason) for name, reason in skipped if reason is not None]
    if not declined or (chosen.name, declined[0][1]) in _WARNED:
        return
    name, reason = declined[0]
    _WARNED.add((chosen.name, reason))
    n_q, n_k = call.q.shape[2], call.k.shape[2]
    warnings.warn(
        f"backend='auto' runs this CUDA call on {chosen.name!r} ({chosen.path(call)}), which builds "
        f"(Nq, Nk) = ({n_q}, {n_k}) scores: {name!r} declined it ({reason}). "
        "vitattn.functional.explain() lists every backend's reason; warned once per backend and reason.",
        SlowPathWarning,
        stacklevel=3,  # attention()'s caller
    )
