"""Exact sparsemax (Newton from the left, no sort) and general alpha-entmax (safeguarded Newton).

Both map scores ``x`` to probabilities along ``dim``:

* ``sparsemax(x)``: ``p = [x - tau]_+`` with ``sum(p) = 1`` (alpha = 2);
* ``entmax(x, alpha)``: ``p = [(alpha - 1) x - tau]_+ ** (1 / (alpha - 1))`` with ``sum(p) = 1``, alpha > 1.

Rows that are entirely ``-inf`` map to zeros with a zero gradient. Half-precision inputs are
normalized in float32 and returned in their own dtype.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

from ._checks import check_broadcastable, check_floating, check_tensor, normalize_dim, shape_str
from ._entmax_common import compute_dtype, support_vjp

__all__ = ["entmax", "sparsemax"]

# Iteration caps. Eager mode stops as soon as every row has converged; under torch.compile the
# loops run a fixed number of times (no data-dependent control flow).
_SPARSEMAX_COMPILE_ITERS = 32  # Newton from the left: realistic rows converge in < 10 steps
_ENTMAX_MAX_ITERS = 60
_ENTMAX_COMPILE_ITERS = {torch.float32: 30, torch.float64: 60}


def _shifted(x: Tensor, dim: int) -> Tensor:
    """``x - max(x)`` along ``dim``; rows that are entirely ``-inf`` stay ``-inf`` (shift 0)."""
    x_max = x.amax(dim, keepdim=True)
    x_max = torch.where(torch.isneginf(x_max), torch.zeros_like(x_max), x_max)
    return x - x_max


# --------------------------------------------------------------------------------------------
# sparsemax
# --------------------------------------------------------------------------------------------


def _sparsemax_forward(x: Tensor, dim: int, compiling: bool) -> Tensor:
    """Sparsemax of ``x`` (already in its compute dtype) along ``dim``; ``compiling``: a fixed iteration
    count (no data-dependent exit)."""
    n = x.shape[dim]
    z = _shifted(x, dim)  # max 0, or all -inf
    # Lower bound on tau: f(z_max - 1) >= 0 and f(mean - 1/n) >= 0.
    tau = (z.mean(dim, keepdim=True) - 1.0 / n).clamp_min(-1.0)
    n_iter = _SPARSEMAX_COMPILE_ITERS if compiling else n + 2
    size_prev = None
    for _ in range(n_iter):
        support = z > tau
        size = support.sum(dim, keepdim=True)
        if not compiling and size_prev is not None and torch.equal(size, size_prev):
            break  # support unchanged: tau is the closed form on it, i.e. exact
        # Newton step on f(tau) = sum (z - tau)_+ - 1 == closed form on the current support.
        z_sum = torch.where(support, z, torch.zeros_like(z)).sum(dim, keepdim=True)
        tau = (z_sum - 1.0) / size.clamp_min(1).to(z.dtype)
        size_prev = size
    return (z - tau).clamp_min(0.0)


class _SparsemaxFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, dim: int, compiling: bool) -> Tensor:
        out = _sparsemax_forward(x.to(compute_dtype(x.dtype)), dim, compiling).to(x.dtype)
        ctx.dim = dim
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor | None, None, None]:
        (out,) = ctx.saved_tensors
        cdtype = compute_dtype(out.dtype)
        g = (out > 0).to(cdtype)
        grad_x = support_vjp(grad_out.to(cdtype), g, ctx.dim).to(grad_out.dtype)
        return grad_x, None, None


def _check_x(x: Tensor, dim: int) -> int:
    check_tensor("x", x)
    check_floating("x", x)
    return normalize_dim("x", x, dim)


def sparsemax(x: Tensor, dim: int = -1) -> Tensor:
    """Exact sparsemax along ``dim``: the Euclidean projection of ``x`` onto the simplex.

    Args:
        x: floating-point scores of any shape ``(..., n, ...)``; ``-inf`` entries get probability 0.
        dim: the dimension to normalize.

    Returns:
        Probabilities of the shape and dtype of ``x``, summing to 1 along ``dim`` (0 for rows
        that are entirely ``-inf``).
    """
    dim = _check_x(x, dim)
    compiling = torch.compiler.is_compiling()  # decided once: a fixed iteration count when traced
    if x.dim() == 0:
        return _SparsemaxFunction.apply(x.reshape(1), 0, compiling).reshape(())
    if x.numel() == 0:
        return x.clone()
    return _SparsemaxFunction.apply(x, dim, compiling)


# --------------------------------------------------------------------------------------------
# general alpha-entmax
# --------------------------------------------------------------------------------------------


def _entmax_forward(x: Tensor, am1: float | Tensor, dim: int, compiling: bool) -> tuple[Tensor, int]:
    """alpha-entmax of ``x`` (in its compute dtype) along ``dim``; ``am1 = alpha - 1``; ``compiling``: a
    fixed iteration count (no data-dependent exit).

    ``am1`` is a float or a tensor broadcastable to ``x`` with size 1 along ``dim``. Returns the
    probabilities and the number of iterations run.

    Solves ``f(tau) = sum_i [z_i - tau]_+^(1/am1) - 1 = 0`` with ``z = am1 * (x - max x)`` by Newton
    steps inside the bracket ``[-1, -n^(-am1)]`` (``f >= 0`` at the left end, ``f <= 0`` at the right),
    falling back to bisection when a step leaves the bracket or does not shrink fast enough.
    """
    n = x.shape[dim]
    z = _shifted(x, dim) * am1
    beta = 1.0 / am1
    red_shape = list(x.shape)
    red_shape[dim] = 1
    lo = torch.full(red_shape, -1.0, dtype=x.dtype, device=x.device)
    if isinstance(am1, Tensor):
        hi = torch.exp(-am1 * math.log(n)).neg().expand(red_shape)
    else:
        hi = torch.full(red_shape, -(n ** (-am1)), dtype=x.dtype, device=x.device)
    eps = torch.finfo(x.dtype).eps
    tau = lo
    # rtsafe's "dxold": a Newton step must at least halve the step taken two iterations before.
    step_old = torch.full(red_shape, math.inf, dtype=x.dtype, device=x.device)
    step_last = step_old
    done = torch.isneginf(z).all(dim, keepdim=True)  # fully masked rows: nothing to solve
    n_iter = _ENTMAX_COMPILE_ITERS.get(x.dtype, _ENTMAX_MAX_ITERS) if compiling else _ENTMAX_MAX_ITERS
    p = z
    iters = 0
    converged = False
    for _ in range(n_iter):
        iters += 1
        u = (z - tau).clamp_min(0.0)
        p = u**beta
        f = p.sum(dim, keepdim=True) - 1.0
        # -f'(tau) = beta * sum_{u > 0} u^(beta - 1) = beta * sum p / u
        slope = torch.where(u > 0, p / torch.where(u > 0, u, 1.0), 0.0).sum(dim, keepdim=True) * beta
        right = f < 0
        lo = torch.where(right, lo, tau)
        hi = torch.where(right, tau, hi)
        newton = f / slope
        tau_newton = tau + newton
        # NaN-safe: a NaN step fails every comparison and falls back to bisection.
        use_newton = (tau_newton >= lo) & (tau_newton <= hi) & (2.0 * newton.abs() <= step_old.abs())
        step = torch.where(use_newton, newton, 0.5 * (hi - lo) + lo - tau)
        # Converged: the step no longer moves tau beyond a couple of ulps (or f is exactly 0).
        small = ~(step.abs() > 2.0 * eps * tau.abs()) | (f == 0)
        done = done | small
        tau = torch.where(done, tau, tau + step)
        step_old, step_last = step_last, step
        if not compiling and bool(done.all()):
            converged = True
            break
    if not converged:
        p = (z - tau).clamp_min(0.0) ** beta
    p = p / p.sum(dim, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)
    return p, iters


class _EntmaxFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, alpha: float | Tensor, dim: int, compiling: bool) -> Tensor:
        cdtype = compute_dtype(x.dtype)
        alpha_c = alpha.to(cdtype) if isinstance(alpha, Tensor) else alpha
        out, _ = _entmax_forward(x.to(cdtype), alpha_c - 1.0, dim, compiling)
        out = out.to(x.dtype)
        ctx.dim = dim
        ctx.alpha_is_tensor = isinstance(alpha, Tensor)
        if ctx.alpha_is_tensor:
            ctx.save_for_backward(out, alpha)
        else:
            ctx.alpha = alpha
            ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor | None, Tensor | None, None, None]:
        if ctx.alpha_is_tensor:
            out, alpha = ctx.saved_tensors
        else:
            (out,) = ctx.saved_tensors
            alpha = ctx.alpha
        dim = ctx.dim
        cdtype = compute_dtype(out.dtype)
        p = out.to(cdtype)
        dy = grad_out.to(cdtype)
        a = alpha.to(cdtype) if isinstance(alpha, Tensor) else alpha
        support = p > 0
        p_safe = torch.where(support, p, 1.0)
        g = torch.where(support, p_safe ** (2.0 - a), 0.0)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = support_vjp(dy, g, dim).to(grad_out.dtype)
        grad_alpha = None
        if ctx.alpha_is_tensor and ctx.needs_input_grad[1]:
            # dp_i/dalpha = beta (-p_i log p_i + g_i (x_i - tau')), tau' = (sum g x - sum p log p) / sum g,
            # beta = 1/(alpha-1). With x_i = (p_i^(alpha-1) + tau) / (alpha-1) on the support and
            # sum g_i p_i^(alpha-1) = sum p = 1 this is, free of x and tau:
            #   dp/dalpha = beta^2 (p - q) - beta (p log p - q H),  q = g / sum g,  H = sum p log p.
            beta = 1.0 / (a - 1.0)
            plogp = torch.where(support, p_safe * torch.log(p_safe), 0.0)
            h = plogp.sum(dim, keepdim=True)
            q = g / g.sum(dim, keepdim=True).clamp_min(torch.finfo(cdtype).tiny)
            dp_dalpha = beta * beta * (p - q) - beta * (plogp - q * h)
            grad_alpha = (dy * dp_dalpha).sum(dim, keepdim=True)
            grad_alpha = grad_alpha.sum_to_size(alpha.shape).to(alpha.dtype)
        return grad_x, grad_alpha, None, None


def _check_alpha(alpha: object, x: Tensor, dim: int, compiling: bool) -> float | Tensor:
    """Validate ``alpha``; returns it as a python float or a tensor. Its values are checked only when
    not ``compiling`` (a data-dependent check)."""
    if isinstance(alpha, Tensor):
        check_broadcastable("alpha", alpha, tuple(x.shape), "x")
        pos = alpha.dim() - x.dim() + dim  # dim of x, counted in alpha (broadcasting aligns the right)
        if 0 <= pos < alpha.dim() and alpha.shape[pos] != 1:
            red_shape = list(x.shape)
            red_shape[dim] = 1
            raise ValueError(
                f"alpha of shape {shape_str(alpha)} must have size 1 along dim={dim} of x "
                f"(shape {shape_str(x)}), i.e. broadcast to ({', '.join(map(str, red_shape))})"
            )
        if alpha.dtype == torch.bool or alpha.is_complex():
            raise TypeError(f"alpha must be a real-valued tensor, got dtype {alpha.dtype}")
        if not compiling:
            bad = ~((alpha > 1) & torch.isfinite(alpha))
            if bool(bad.any()):
                raise ValueError(
                    f"alpha must be finite and > 1 everywhere; alpha of shape {shape_str(alpha)} "
                    f"has {int(bad.sum())} entries that are not, e.g. {alpha[bad].flatten()[0].item()}"
                )
        return alpha
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real):
        raise TypeError(f"alpha must be a float or a torch.Tensor, got {type(alpha).__name__}")
    alpha = float(alpha)
    if not 1.0 < alpha < math.inf:
        raise ValueError(f"alpha must be finite and > 1, got alpha={alpha}")
    return alpha


def entmax(x: Tensor, alpha: float | Tensor, dim: int = -1) -> Tensor:
    """alpha-entmax along ``dim``: ``p = [(alpha - 1) x - tau]_+ ** (1 / (alpha - 1))``, ``sum(p) = 1``.

    ``alpha = 2`` (a python number) is exact :func:`sparsemax`, ``alpha = 1.5`` is
    ``vitattn.functional.entmax15.entmax15``; any other alpha > 1 uses a safeguarded Newton solve
    of the threshold ``tau`` at the precision of the compute dtype.

    For alpha > 2 the map has an infinite slope at the edge of the support: an entry within
    rounding (eps) of the threshold gets ``p ~ eps^(1/(alpha-1))`` or 0, so probabilities are only
    accurate to about that (1.5e-8 in float64, 3e-4 in float32 at alpha = 3; worse for larger alpha).

    Args:
        x: floating-point scores of any shape ``(..., n, ...)``; ``-inf`` entries get probability 0.
        alpha: a python float > 1, or a tensor of values > 1 that broadcasts to ``x`` and has
            size 1 along ``dim`` (e.g. shape ``()`` or ``(B, H, N, 1)`` for ``x`` of shape
            ``(B, H, N, N)``). A tensor alpha may require grad.
        dim: the dimension to normalize.

    Returns:
        Probabilities of the shape and dtype of ``x``, summing to 1 along ``dim`` (0 for rows
        that are entirely ``-inf``).
    """
    dim = _check_x(x, dim)
    compiling = torch.compiler.is_compiling()  # decided once: fixed iterations, no value checks, when traced
    alpha = _check_alpha(alpha, x, dim, compiling)
    if isinstance(alpha, float):
        if alpha == 2.0:
            return sparsemax(x, dim)
        if alpha == 1.5:
            from .entmax15 import entmax15

            return entmax15(x, dim=dim)
    if x.dim() == 0:
        return _EntmaxFunction.apply(x.reshape(1), alpha, 0, compiling).reshape(())
    if x.numel() == 0:
        return x.clone()
    return _EntmaxFunction.apply(x, alpha, dim, compiling)
