"""Fenchel–Young losses of the attention normalizers (Blondel, Martins & Niculae, 2020).

Each normalizer ``ŷ(z) = argmax_{p ∈ simplex} ⟨z, p⟩ + H(p)`` has the loss, per row::

    L(z; y) = ⟨z, ŷ(z) − y⟩ + H(ŷ(z)) − H(y)          ∂L/∂z = ŷ(z) − y

for a target distribution ``y``: ``L ≥ 0``, and ``L = 0`` exactly when ``ŷ(z) = y``. ``H`` is the
normalizer's entropy: Shannon's ``−Σ p log p`` for softmax (then ``L = logsumexp(z) − ⟨z, y⟩ − H(y)``,
the cross-entropy minus the target's entropy, i.e. ``KL(y ‖ softmax(z))``), Tsallis'
``Σ (p − p^α) / (α (α − 1))`` for α-entmax (α = 1.5: entmax-1.5, α = 2: sparsemax). ``ŷ`` is
:func:`vitattn.functional.normalize` and ``H`` each normalizer's ``entropy``
(:class:`~vitattn.functional.normalize.NormalizerSpec`); nothing here restates a normalizer.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

import torch
from torch.autograd.function import once_differentiable

from ._checks import check_floating, check_tensor, normalize_dim, shape_str
from .dtypes import compute_dtype
from .normalize import Normalizer, NormalizerSpec, normalize, normalizer_spec, resolve_normalizer
from .value_checks import check_at_least, value_checks_enabled

__all__ = ["Reduction", "fy_grad", "fy_loss", "fy_loss_formula", "normalizer_entropy"]

#: How :func:`fy_loss` reduces the rows' losses, as torch's losses do.
Reduction = Literal["none", "mean", "sum"]


def normalizer_entropy(p: torch.Tensor, normalizer: Normalizer, dim: int = -1) -> torch.Tensor:
    """The entropy ``H`` that ``normalizer`` regularizes with, of each row of ``p`` (``dim`` reduced).

    Softmax: Shannon's ``−Σ p log p`` (``0 log 0 = 0``). α-entmax (``"entmax15"``: α = 1.5,
    ``"sparsemax"``: α = 2, a float α): Tsallis' ``Σ (p − p^α) / (α (α − 1))``, which is 0 for a
    zero row. A registered normalizer: its spec's ``entropy``.
    """
    return normalizer_spec(normalizer).entropy(p, dim)


def _check_target_values(target: torch.Tensor, dim: int) -> None:
    """With value checks on: the target's entries non-negative and its rows summing to 1 (1e-3)."""
    check_at_least("target", target, 0.0, "a distribution along dim")
    sums = target.detach().double().sum(dim)
    off = (sums - 1.0).abs() > 1e-3
    if bool(off.any()):
        raise ValueError(
            f"target's rows must sum to 1 along dim={dim}, got a row summing to {sums[off][0]:.6g}"
        )


def _checked(scores: object, target: object, dim: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    scores = check_tensor("scores", scores)
    target = check_tensor("target", target)
    check_floating("scores", scores)
    check_floating("target", target)
    if scores.dim() == 0:
        raise ValueError(
            "scores must have at least one dimension (the rows' entries along dim), got a 0-d tensor"
        )
    if target.shape != scores.shape:
        raise ValueError(
            f"target must have the shape of scores: scores has shape {shape_str(scores)}, "
            f"target has shape {shape_str(target)}"
        )
    return scores, target, normalize_dim("scores", scores, dim)


def _row_loss(
    z: torch.Tensor, y: torch.Tensor, p: torch.Tensor, spec: NormalizerSpec, dim: int
) -> torch.Tensor:
    """The loss of each row from scores ``z``, target ``y`` and ``p = normalize(z)`` (not read when the
    normalizer has a closed form).

    Both forms work on shifted scores, so that large scores (float32 near 30) lose no precision: the
    normalizer's closed form (softmax's ``KL(y ‖ p)``, the log-probabilities shifted by the row max inside
    ``log_softmax``), else ``⟨p − y, z − max z⟩ + H(p) − H(y)``, which the shift does not change on rows
    of ``y`` that sum to 1.
    """
    masked = torch.isneginf(z)
    dead = masked.all(dim, keepdim=True)
    unreachable = (masked & (y > 0)).any(dim)
    negative = (y < 0).any(dim)  # no distribution: the loss is undefined (NaN for every normalizer)
    live = z.masked_fill(dead, 0.0)
    if spec.fy_loss is not None:
        loss = spec.fy_loss(live, y, masked, dim)
    else:
        shifted = (live - live.amax(dim, keepdim=True)).masked_fill(masked, 0.0)
        loss = ((p - y) * shifted).sum(dim) + spec.entropy(p, dim) - spec.entropy(y, dim)
    loss = loss.masked_fill(unreachable, float("inf")).masked_fill(negative, float("nan"))
    return loss.masked_fill(dead.squeeze(dim), 0.0)


def fy_loss_formula(
    scores: torch.Tensor, target: torch.Tensor, normalizer: Normalizer, dim: int
) -> torch.Tensor:
    """The loss of each row in plain differentiable torch ops (autograd goes through the normalizer):
    the reference path, which keeps the normalizer's and the formula's maps for backward.

    ``-inf`` scores: an entry where the target is 0 adds nothing, one where the target is positive
    makes the loss ``+inf``; a row whose scores are all ``-inf`` has loss 0.
    """
    spec = normalizer_spec(normalizer)
    p = scores if spec.fy_loss is not None else normalize(scores, normalizer, dim)
    return _row_loss(scores, target, p, spec, dim)


def fy_grad(scores: torch.Tensor, target: torch.Tensor, normalizer: Normalizer, dim: int) -> torch.Tensor:
    """``∂L/∂scores = normalize(scores) − target`` (no grad); zero on rows whose scores are all ``-inf``."""
    with torch.no_grad():
        return _grad(scores, target, normalize(scores, normalizer, dim), dim)


def _grad(z: torch.Tensor, y: torch.Tensor, p: torch.Tensor, dim: int) -> torch.Tensor:
    """``p − y`` written into ``p`` (a fresh normalizer output, no grad), zero on dead rows."""
    return p.sub_(y).masked_fill_(torch.isneginf(z).all(dim, keepdim=True), 0.0)


class _FYLoss(torch.autograd.Function):
    """The loss per row with the closed-form gradient; saves one ``scores``-shaped tensor."""

    @staticmethod
    def forward(
        ctx: Any, scores: torch.Tensor, target: torch.Tensor, normalizer: Normalizer, dim: int
    ) -> torch.Tensor:
        work = compute_dtype(scores, target)
        z, y = scores.to(work), target.to(work)
        p = normalize(z, normalizer, dim)
        loss = _row_loss(z, y, p, normalizer_spec(normalizer), dim)
        ctx.save_for_backward(_grad(z, y, p, dim))
        ctx.dim, ctx.dtype = dim, scores.dtype
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (grad,) = ctx.saved_tensors
        return (grad * grad_out.unsqueeze(ctx.dim)).to(ctx.dtype), None, None, None


def fy_loss(
    scores: torch.Tensor,
    target: torch.Tensor,
    normalizer: Normalizer = "entmax15",
    dim: int = -1,
    reduction: Reduction = "none",
) -> torch.Tensor:
    """Fenchel–Young loss of ``normalizer`` for each row of ``scores`` against a target distribution.

    ``L(z; y) = ⟨z, ŷ − y⟩ + H(ŷ) − H(y)`` with ``ŷ = normalize(z)`` and ``H`` the normalizer's
    entropy (:func:`normalizer_entropy`); ``∂L/∂z = ŷ − y``. Softmax gives
    ``KL(y ‖ softmax(z))`` (the cross-entropy minus ``H(y)``); with one-hot targets the loss is the
    ``entmax`` package's ``Entmax15Loss`` / ``SparsemaxLoss`` / ``EntmaxBisectLoss`` (``reduction="none"``).

    Args:
        scores: floating scores of any shape ``(..., n, ...)``; ``-inf`` entries are masked.
        target: a distribution along ``dim``, the shape of ``scores``: entries ``>= 0``, each row summing
            to 1. Not read back (that would sync the device): a row with a negative entry has a NaN
            loss, whatever the normalizer; with ``VITATTN_CHECK_VALUES=1`` (or
            :func:`~vitattn.functional.value_checks.set_value_checks`) both rules raise a
            ``ValueError`` instead. A constant: no gradient flows to it.
        normalizer: ``"softmax"``, ``"entmax15"``, ``"sparsemax"`` (or another registered name,
            :func:`~vitattn.functional.normalize.register_normalizer`) or a float α > 1.
        dim: the dimension the rows run along.
        reduction: ``"none"`` (the default: one loss per row), ``"mean"`` over the rows or ``"sum"``.

    Returns:
        The loss of each row: ``scores``' shape without ``dim``, float32 at least (a 0-d tensor when
        reduced). A row whose scores are all ``-inf`` has loss 0 and gradient 0; a positive target on
        a ``-inf`` score gives ``+inf``.

    Example::

        scores = torch.randn(4, 10)                  # 4 rows of 10 scores
        target = torch.softmax(torch.randn(4, 10), -1)
        loss = fy_loss(scores, target, "entmax15", reduction="mean")
    """
    scores, target, dim = _checked(scores, target, dim)
    if reduction not in get_args(Reduction):
        raise ValueError(f"reduction must be one of {list(get_args(Reduction))}, got {reduction!r}")
    kind = resolve_normalizer(normalizer)
    if value_checks_enabled():
        _check_target_values(target, dim)
    loss = _FYLoss.apply(scores, target.detach(), kind, dim)
    if reduction == "mean":
        return loss.mean()
    return loss.sum() if reduction == "sum" else loss
