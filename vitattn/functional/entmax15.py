"""Exact 1.5-entmax without sorting.

``entmax15(z)_i = (z_i / 2 - tau)_+^2`` with the threshold ``tau`` chosen so the row sums to 1.

How ``tau`` is found (in the shifted scale ``x = max(z - max(z), -2) / 2``, so ``x <= 0``):

1. ``f(tau) = sum_i (x_i - tau)_+^2 - 1`` is convex, decreasing and piecewise quadratic.
   The root lies in ``[-1, hi]`` (the top element alone gives ``f(-1) >= 0``; ``hi = -1/sqrt(n)``
   by Jensen's inequality). Clamping ``x`` at ``-1`` changes nothing for ``tau >= -1``, removes
   ``-inf`` from masked entries, and makes the first step's ``(x + 1)_+`` a plain ``x + 1``.
2. Newton steps on ``h(tau) = ||(x - tau)_+||_2 - 1`` (same root, also convex and decreasing, and
   nearly linear far from the root) from ``-1`` never overshoot, so every iterate stays a lower
   bound; the safeguard keeps it in ``[-1, hi]`` under rounding. They stop once the largest step
   in any row is below ``sqrt(machine eps)``.
3. On the support ``S = {x_i > tau}`` the equation is an exact quadratic; its root (in a
   cancellation-free form) gives ``tau``, so the result is exact once the support is right, not a
   converged approximation.

Rows that are entirely ``-inf`` give zeros. Half-precision inputs are computed in float32.
"""

from __future__ import annotations

import math

import torch

from ._checks import check_floating, check_tensor, normalize_dim
from ._entmax_common import compute_dtype, support_vjp

__all__ = ["entmax15", "entmax15_threshold"]

_MAX_NEWTON_STEPS = 64  # far more than ever needed (typically 2-8); a bound, not a tuning knob
_COMPILED_NEWTON_STEPS = 12  # fixed count under torch.compile (no data-dependent exit)


def shifted_rows(z: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x = max(z - max(z), -2) / 2`` along the last dim (a fresh tensor, or ``out``); all-``-inf`` rows
    become all ``-1``."""
    m = z.amax(-1, keepdim=True)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    # z / 2 - m / 2: halving is exact, so this is (z - m) / 2 in one pass fewer
    x = torch.add(m.mul(-0.5), z, alpha=0.5) if out is None else torch.add(m.mul(-0.5), z, alpha=0.5, out=out)
    return x.clamp_(min=-1.0)


def _newton_threshold(
    x: torch.Tensor,
    work: torch.Tensor,
    tau: torch.Tensor | None = None,
    tol: float | None = None,
    fixed_steps: int | None = None,
) -> torch.Tensor:
    """Lower bound of ``tau`` for rows ``x: (rows, n)`` within ``tol`` (default ``sqrt(eps)``) of the
    root, starting from the lower bound ``tau`` (default ``-1``, where ``x``, clamped at ``-1``, makes
    the first ``(x - tau)_+`` one addition); ``work`` is scratch of ``x``'s shape. ``fixed_steps``: run
    exactly that many steps (no data-dependent exit, for ``torch.compile``)."""
    n = x.shape[-1]
    hi = -1.0 / math.sqrt(n)
    from_minus_one = tau is None
    if tau is None:
        tau = x.new_full((*x.shape[:-1], 1), -1.0)
    tol = math.sqrt(torch.finfo(x.dtype).eps) if tol is None else tol
    for i in range(_MAX_NEWTON_STEPS if fixed_steps is None else fixed_steps):
        if i == 0 and from_minus_one:
            d = torch.add(x, 1.0, out=work)
        else:
            d = torch.sub(x, tau, out=work).clamp_(min=0.0)
        s1 = d.sum(-1, keepdim=True)
        norm = torch.linalg.vector_norm(d, dim=-1, keepdim=True)
        # Newton on h = ||(x - tau)_+|| - 1 (convex and decreasing like f, nearly linear far from the
        # root, so fewer steps): h / -h' = (norm - 1) norm / s1 >= 0 left of the root.
        # Empty rows (s1 = 0) give nan -> 0.
        step = torch.nan_to_num_((norm - 1.0) * norm / s1, nan=0.0).clamp_(min=0.0)
        tau = (tau + step).clamp_(max=hi)
        if fixed_steps is None and not bool((step > tol).any()):
            break
    return tau


def _closed_form_and_count(
    x: torch.Tensor, tau: torch.Tensor, work: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact ``tau`` of rows ``x: (rows, n)`` from the support ``S = {x > tau}`` of a lower bound
    ``tau``, and ``|S|``.

    With ``d = (x - tau)_+``, ``k = |S|``, ``s1 = sum d``, ``s2 = sum d^2``, the shift ``delta``
    solves ``k delta^2 - 2 s1 delta + s2 - 1 = 0``; its smaller root, written without cancellation,
    is ``(s2 - 1) / (s1 + sqrt(s1^2 - k (s2 - 1)))``.
    """
    d = torch.sub(x, tau, out=work).clamp_(min=0.0)
    s1 = d.sum(-1, keepdim=True)
    s2 = torch.linalg.vector_norm(d, dim=-1, keepdim=True).square_()
    k = d.sign_().sum(-1, keepdim=True)
    disc = (s1 * s1 - k * (s2 - 1.0)).clamp_(min=0.0)
    delta = (s2 - 1.0) / (s1 + disc.sqrt())
    return tau + torch.nan_to_num(delta, nan=0.0, posinf=0.0, neginf=0.0), k


def entmax15_threshold(z: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(x, tau)``: the shifted, clamped input ``x = max(z - max z, -2) / 2`` and the exact
    threshold ``tau`` (keepdim along ``dim``), so that ``entmax15(z) = (x - tau)_+^2``."""
    rows = _as_rows(z, dim)
    x = shifted_rows(rows)
    work = torch.empty_like(x)
    tau = _closed_form_and_count(x, _newton_threshold(x, work), work)[0]
    return _from_rows(x, z, dim), _from_rows(tau, z[(slice(None),) * (dim % z.dim()) + (slice(0, 1),)], dim)


# Newton's largest step below which the closed form is tried early (and checked, row by row)
_EARLY_STEP = 0.05


def sqrt_entmax_rows(
    x: torch.Tensor, work: torch.Tensor, out: torch.Tensor, *, fixed_steps: int | None = None
) -> torch.Tensor:
    """Write ``(x - tau)_+ = sqrt(entmax15)`` of shifted rows ``x: (rows, n)`` (:func:`shifted_rows`)
    into ``out``, with the exact ``tau``; ``work`` is scratch like ``x``.

    Newton runs only until its largest step is below ``_EARLY_STEP`` (a loose lower bound ``t``);
    the closed form on ``S = {x > t}`` then gives ``tau_c``, and a row is exact when ``tau_c`` keeps
    that support (``|{x > tau_c}| = |S|``, counted exactly: the quadratic's root is then the root of
    ``f``). The few rows that fail the check continue Newton from ``t`` to the full tolerance and
    take the closed form. With ``fixed_steps`` (``torch.compile``: no data-dependent row selection)
    every row takes that many Newton steps and the closed form.
    """
    if fixed_steps is not None:
        tau = _closed_form_and_count(x, _newton_threshold(x, work, fixed_steps=fixed_steps), work)[0]
        return torch.sub(x, tau, out=out).clamp_(min=0.0)
    loose = _newton_threshold(x, work, tol=_EARLY_STEP)
    tau, k = _closed_form_and_count(x, loose, work)
    torch.sub(x, tau, out=out).clamp_(min=0.0)
    settled = torch.sign(out, out=work).sum(-1, keepdim=True) == k
    if bool(settled.all()):
        return out
    rows = (~settled[:, 0]).nonzero()[:, 0]
    xr = x.index_select(0, rows)
    wr = torch.empty_like(xr)
    tau_r = _closed_form_and_count(xr, _newton_threshold(xr, wr, tau=loose.index_select(0, rows)), wr)[0]
    out[rows] = torch.sub(xr, tau_r, out=wr).clamp_(min=0.0)
    return out


def _as_rows(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``(rows, n)`` view of ``t`` with ``dim`` last (a copy only when ``dim`` is not last/contiguous)."""
    return t.movedim(dim, -1).reshape(-1, t.shape[dim])


def _from_rows(rows: torch.Tensor, like: torch.Tensor, dim: int) -> torch.Tensor:
    shape = list(like.shape)
    shape.append(shape.pop(dim))
    return rows.view(shape).movedim(-1, dim)


class _Entmax15Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z: torch.Tensor, dim: int, fixed_steps: int | None) -> torch.Tensor:
        x = shifted_rows(_as_rows(z.to(compute_dtype(z.dtype)), dim))
        g = torch.empty_like(x)
        g = _from_rows(sqrt_entmax_rows(x, torch.empty_like(x), g, fixed_steps=fixed_steps), z, dim)
        ctx.dim = dim
        if not ctx.needs_input_grad[0]:
            return g.square_().to(z.dtype)
        # The backward needs sqrt(p): kept from here (one more tensor of z's size while training)
        # rather than recomputed by a sqrt of p (docs/benchmarks.md, "entmax-1.5 on the CPU").
        ctx.save_for_backward(g)
        return g.square().to(z.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (g,) = ctx.saved_tensors
        dim = ctx.dim
        # d p_i / d z_j = sqrt(p_i) (delta_ij - sqrt(p_j) / sum sqrt(p)) on the support
        grad = support_vjp(_as_rows(grad_out.to(g.dtype), dim), _as_rows(g, dim), -1)
        return _from_rows(grad, g, dim).to(grad_out.dtype), None, None


def entmax15(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Exact 1.5-entmax of ``x`` along ``dim`` (any shape); rows of all ``-inf`` give zeros.

    float16 / bfloat16 are computed in float32 and returned in the input dtype. Under
    ``torch.compile`` the threshold search takes a fixed number of steps (no data-dependent exit).
    """
    check_tensor("x", x)
    check_floating("x", x)
    d = normalize_dim("x", x, dim)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension, got a 0-d tensor")
    if x.numel() == 0:
        return x.clone()
    fixed_steps = _COMPILED_NEWTON_STEPS if torch.compiler.is_compiling() else None
    return _Entmax15Function.apply(x, d, fixed_steps)
