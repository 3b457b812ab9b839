"""``attention()``: the one functional entry point of the pipeline ``normalize(q kᵀ * scale + bias) v``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, TypedDict, overload

import torch

from ._checks import check_floating, check_rank, check_scale, shape_str
from .capture import active_callbacks
from .cpu.backend import CpuBlockedBackend
from .dispatch import (
    AttentionCall,
    backend_groups,
    backend_reasons,
    check_backend_name,
    register_backend,
    register_group,
    resolve_backend,
    select_backend,
    warn_dense_fallback,
)
from .gaussian import GaussianBias, check_gaussian_values
from .normalize import AttentionNormalizer, alpha_tensor, resolve_normalizer
from .reference import ReferenceBackend
from .scoring import check_mask_and_bias
from .sdpa import SdpaBackend
from .value_checks import value_checks_enabled
from .window import WindowMask

# The pure-PyTorch backends in "auto" order (the Triton backend is registered ahead of them by
# vitattn.kernels), and their group name.
for _backend in (CpuBlockedBackend(), SdpaBackend(), ReferenceBackend()):
    register_backend(_backend)
register_group("torch", ("cpu_blocked", "sdpa", "reference"))

if TYPE_CHECKING:
    from typing_extensions import Unpack


class _ScoreOptions(TypedDict, total=False):
    """The keyword arguments of :func:`attention` but ``return_weights`` and ``backend`` (its overloads)."""

    normalizer: AttentionNormalizer
    scale: float | None
    mask: torch.Tensor | WindowMask | None
    bias: torch.Tensor | GaussianBias | None
    dropout_p: float


class CallOptions(_ScoreOptions, total=False):
    """The keyword arguments of :func:`attention` that describe the call (all but ``backend``)."""

    return_weights: bool


def _validate(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | WindowMask | None,
    bias: torch.Tensor | GaussianBias | None,
    dropout_p: float,
) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_rank(name, t, 4, "(B, H, N, D)")
        check_floating(name, t)  # mixed floating dtypes are fine: AttentionCall.dtype is the one used
    if q.shape[:2] != k.shape[:2] or q.shape[:2] != v.shape[:2]:
        raise ValueError(
            f"q, k, v must share (B, H), got q {shape_str(q)}, k {shape_str(k)}, v {shape_str(v)}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must share the head dim D, got q {shape_str(q)} and k {shape_str(k)}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k and v must share the key count Nk, got k {shape_str(k)} and v {shape_str(v)}")
    check_mask_and_bias(q, k, mask, bias)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")


@overload
def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, return_weights: Literal[False] = ...,
    backend: str = ..., **options: Unpack[_ScoreOptions],
) -> torch.Tensor: ...  # fmt: skip


@overload
def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, return_weights: Literal[True],
    backend: str = ..., **options: Unpack[_ScoreOptions],
) -> tuple[torch.Tensor, torch.Tensor]: ...  # fmt: skip


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    normalizer: AttentionNormalizer = "softmax",
    scale: float | None = None,
    mask: torch.Tensor | WindowMask | None = None,
    bias: torch.Tensor | GaussianBias | None = None,
    return_weights: bool = False,
    dropout_p: float = 0.0,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention ``out = normalize(q kᵀ * scale + bias + mask) v``.

    Args:
        q: ``(B, H, Nq, D)`` queries.
        k: ``(B, H, Nk, D)`` keys.
        v: ``(B, H, Nk, Dv)`` values. q, k, v may have different floating dtypes: every backend casts
            them to one dtype (:func:`~vitattn.functional.dispatch.operand_dtype`): the autocast dtype
            under autocast, else their promoted dtype.
        normalizer: ``"softmax"``, ``"entmax15"``, ``"sparsemax"``, a float alpha > 1 (alpha-entmax),
            or a tensor of alphas > 1 (alpha-entmax per head, differentiable in them): ``()``, ``(H,)``
            or 4-D broadcastable to ``(B, H, Nq, 1)``.
        scale: score scale, a finite number; ``D ** -0.5`` by default (1 when ``D = 0``: no scores
            but the bias).
        mask: boolean keep-mask (``True`` = attend) or additive float mask, broadcastable to
            ``(B, H, Nq, Nk)``, or a :class:`WindowMask` (neighbourhood attention on the patch grid).
            A query whose keys are all masked gets zero weights and a zero output.
        bias: additive float tensor broadcastable to ``(B, H, Nq, Nk)``, or a :class:`GaussianBias`.
        return_weights: also return the ``(B, H, Nq, Nk)`` probabilities (before dropout; float32
            for half-precision inputs).
        dropout_p: dropout on the probabilities (pass 0 in eval).
        backend: ``"auto"``, a backend name (``available_backends()``: ``"triton"``, ``"cpu_blocked"``,
            ``"sdpa"``, ``"reference"``) or ``"torch"``, the group of the pure-PyTorch ones.

    Returns:
        ``out`` of shape ``(B, H, Nq, Dv)`` in that one dtype (``v``'s dtype when q, k, v share it and
        autocast is off), and the probabilities when ``return_weights=True``.

    Raises:
        TypeError naming the argument if q, k or v is not floating-point; ValueError for shapes.
    """
    call = make_call(
        q, k, v, normalizer=normalizer, scale=scale, mask=mask, bias=bias,
        return_weights=return_weights, dropout_p=dropout_p,
    )  # fmt: skip
    callbacks = active_callbacks()
    chosen = select_backend(call, backend)
    warn_dense_fallback(call, chosen, backend)
    out, probs = chosen.run(call)
    if callbacks:
        assert probs is not None
        for callback in callbacks:
            callback(probs.detach())
    if return_weights:
        assert probs is not None
        return out, probs
    return out


def make_call(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: Unpack[CallOptions]
) -> AttentionCall:
    """The validated :class:`AttentionCall` that :func:`attention` hands to a backend for these arguments
    (the keywords of :func:`attention` but ``backend``, with its defaults).

    Inside :func:`capture_attention_weights` the call asks for the weights.
    """
    unknown = set(options) - set(CallOptions.__annotations__)
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) {sorted(unknown)}")
    mask, bias, scale = options.get("mask"), options.get("bias"), options.get("scale")
    dropout_p = float(options.get("dropout_p", 0.0))
    _validate(q, k, v, mask, bias, dropout_p)
    if value_checks_enabled() and isinstance(bias, GaussianBias):
        check_gaussian_values(bias)
    window = mask if isinstance(mask, WindowMask) else None
    tensor_mask = None if isinstance(mask, WindowMask) else mask
    normalizer = options.get("normalizer", "softmax")
    if isinstance(normalizer, torch.Tensor):
        normalizer = alpha_tensor(normalizer, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]))
    else:
        normalizer = resolve_normalizer(normalizer)
    return AttentionCall(
        q=q,
        k=k,
        v=v,
        normalizer=normalizer,
        scale=check_scale(scale, q.shape[-1]),
        mask=tensor_mask,
        bias=bias,
        return_weights=bool(options.get("return_weights", False)) or bool(active_callbacks()),
        dropout_p=dropout_p,
        needs_grad=_needs_grad(q, k, v, tensor_mask, bias, normalizer),
        compiling=torch.compiler.is_compiling(),
        window=window,
    )


def _needs_grad(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    bias: torch.Tensor | GaussianBias | None,
    normalizer: AttentionNormalizer,
) -> bool:
    """Whether autograd records a call: grad mode on and an input (σ, α of a Gaussian bias and a tensor
    normalizer included) that requires a gradient."""
    if not torch.is_grad_enabled():
        return False
    tensors = [q, k, v, mask, normalizer if isinstance(normalizer, torch.Tensor) else None]
    tensors += [bias.sigma, bias.alpha] if isinstance(bias, GaussianBias) else [bias]
    return any(t is not None and t.requires_grad for t in tensors)


def _describe(name: str, t: object) -> str:
    if isinstance(t, GaussianBias):
        return (
            f"{name}: GaussianBias(grid_size={t.grid_size}, num_prefix_tokens={t.num_prefix_tokens}, "
            f"initial_grid_size={t.initial_grid_size}, sigma {shape_str(t.sigma)} {t.sigma.dtype}, "
            f"alpha {shape_str(t.alpha)} {t.alpha.dtype})"
        )
    if isinstance(t, WindowMask):
        return (
            f"{name}: WindowMask(grid_size={t.grid_size}, window={t.window}, "
            f"num_prefix_tokens={t.num_prefix_tokens}, dilation={t.dilation})"
        )
    if isinstance(t, torch.Tensor):
        grad = ", requires_grad" if t.requires_grad else ""
        return f"{name}: {shape_str(t)} {t.dtype} on {t.device}{grad}"
    return f"{name}: None"


class Explanation(dict):
    """``{backend name: None if it can run the call, else why not}`` (in ``"auto"`` order), plus context.

    Attributes:
        backend: the ``backend`` asked for; ``resolved``: what it resolves to after the defaults
            (:func:`~vitattn.functional.get_default_backend`); ``chosen``: the backend that would run
            the call, or None when none can; ``path``: the path that backend takes (e.g. which
            row-blocked variant, eager or custom op); ``error``: why none can; ``inputs``: one line per
            argument (shape, dtype, device) and the call's flags.

    ``str()`` (and ``print``) gives the whole report as text.
    """

    backend: str
    resolved: str
    chosen: str | None
    path: str | None
    error: str | None
    inputs: list[str]

    def __str__(self) -> str:
        lines = ["attention call:"]
        lines += [f"  {line}" for line in self.inputs]
        via = "" if self.resolved == self.backend else f" -> {self.resolved!r} (default backend)"
        group = backend_groups().get(self.resolved)
        members = f" (the group of {', '.join(group)})" if group else ""
        lines.append(f"backend={self.backend!r}{via}{members}")
        for name, reason in self.items():
            lines.append(f"  {name}: {'can run it' if reason is None else 'declines: ' + reason}")
        if self.chosen is not None:
            lines.append(f"runs on: {self.chosen}: {self.path}")
        else:
            lines.append(f"runs on: none ({self.error})")
        return "\n".join(lines)

    __repr__ = __str__


def explain(
    q: torch.Tensor | AttentionCall,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    *,
    backend: str = "auto",
    **kwargs: Any,
) -> Explanation:
    """Why each backend would or would not run ``attention(q, k, v, **same kwargs)``, and the path taken.

    Takes the arguments of :func:`attention` (or an ``AttentionCall`` from :func:`make_call` as ``q``)
    and runs nothing. Returns an :class:`Explanation`: a dict ``{backend: None or the reason it
    declines}`` whose ``str()`` lists the inputs' shapes, dtypes and devices, every backend's answer,
    the backend that would run the call and its path; ``print(explain(q, k, v))`` shows it. For
    ``backend="auto"`` (or a group) the reasons are those ``"auto"`` sees; for a named (or default)
    backend, that backend's answer is the one for a named backend. Invalid arguments raise as
    :func:`attention` would (an unknown keyword a ``TypeError``).
    """
    if isinstance(q, AttentionCall):
        if k is not None or v is not None or kwargs:
            raise TypeError("explain(call) takes the AttentionCall alone")
        call = q
    else:
        if k is None or v is None:
            raise TypeError("explain(q, k, v, ...) needs q, k and v (or one AttentionCall)")
        call = make_call(q, k, v, **kwargs)  # normalizer, scale, mask, bias, return_weights, dropout_p
    check_backend_name(backend)
    resolved = resolve_backend(backend)
    out = Explanation(backend_reasons(call, explicit=False))
    if resolved != "auto" and resolved not in backend_groups():
        out[resolved] = backend_reasons(call, explicit=True)[resolved]  # its answer when named
    out.backend, out.resolved, out.chosen, out.path, out.error = backend, resolved, None, None, None
    try:
        chosen = select_backend(call, backend)
        out.chosen, out.path = chosen.name, chosen.path(call)
    except ValueError as e:
        out.error = str(e)
    out.inputs = [
        _describe("q", call.q),
        _describe("k", call.k),
        _describe("v", call.v),
        _describe("mask", call.mask if call.window is None else call.window),
        _describe("bias", call.bias),
    ]
    normalizer: object = call.normalizer
    if isinstance(normalizer, torch.Tensor):
        out.inputs.append(_describe("normalizer (alpha)", normalizer))
        normalizer = "alpha tensor"
    out.inputs.append(
        f"normalizer={normalizer!r}, scale={call.scale:g}, return_weights={call.return_weights}, "
        f"dropout_p={call.dropout_p:g}, needs_grad={call.needs_grad}, compiling={call.compiling}"
    )
    return out
