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
from .blocked import _scratch_buffer

__all__ = ["entmax15", "entmax15_threshold"]

_MAX_NEWTON_STEPS = 64  # far more than ever needed (typically 2-8); a bound, not a tuning knob
_COMPILED_NEWTON_STEPS = 12  # fixed count under torch.compile (no data-dependent exit)


def _clamped_shifted(z: torch.Tensor, dim: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x = max(z - max(z), -2) / 2`` (a fresh tensor, or ``out``); all-``-inf`` rows become all ``-1``."""
    m = z.amax(dim, keepdim=True)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    # z / 2 - m / 2: halving is exact, so this is (z - m) / 2 in one pass fewer
    x = torch.add(m.mul(-0.5), z, alpha=0.5) if out is None else torch.add(m.mul(-0.5), z, alpha=0.5, out=out)
    return x.clamp_(min=-1.0)


def _newton_threshold(
    x: torch.Tensor,
    dim: int,
    work: torch.Tensor,
    tau: torch.Tensor | None = None,
    tol: float | None = None,
) -> torch.Tensor:
    """Lower bound of ``tau`` within ``tol`` (default ``sqrt(eps)``) of the root, starting from the
    lower bound ``tau`` (default ``-1``, where ``x``, clamped at ``-1``, makes the first
    ``(x - tau)_+`` one addition); ``work`` is scratch of ``x``'s shape."""
    n = x.shape[dim]
    hi = -1.0 / math.sqrt(n)
    from_minus_one = tau is None
    if tau is None:
        shape = list(x.shape)
        shape[dim] = 1
        tau = x.new_full(shape, -1.0)
    tol = math.sqrt(torch.finfo(x.dtype).eps) if tol is None else tol
    steps = _COMPILED_NEWTON_STEPS if torch.compiler.is_compiling() else _MAX_NEWTON_STEPS
    for i in range(steps):
        if i == 0 and from_minus_one:
            d = torch.add(x, 1.0, out=work)
        else:
            d = torch.sub(x, tau, out=work).clamp_(min=0.0)
        s1 = d.sum(dim, keepdim=True)
        norm = torch.linalg.vector_norm(d, dim=dim, keepdim=True)
        # Newton on h = ||(x - tau)_+|| - 1 (convex and decreasing like f, nearly linear far from the
        # root, so fewer steps): h / -h' = (norm - 1) norm / s1 >= 0 left of the root.
        # Empty rows (s1 = 0) give nan -> 0.
        step = torch.nan_to_num_((norm - 1.0) * norm / s1, nan=0.0).clamp_(min=0.0)
        tau = (tau + step).clamp_(max=hi)
        if not torch.compiler.is_compiling() and not bool((step > tol).any()):
            break
    return tau


def _closed_form_and_count(
    x: torch.Tensor, tau: torch.Tensor, dim: int, work: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact ``tau`` from the support ``S = {x > tau}`` of a lower bound ``tau``, and ``|S|``.

    With ``d = (x - tau)_+``, ``k = |S|``, ``s1 = sum d``, ``s2 = sum d^2``, the shift ``delta``
    solves ``k delta^2 - 2 s1 delta + s2 - 1 = 0``; its smaller root, written without cancellation,
    is ``(s2 - 1) / (s1 + sqrt(s1^2 - k (s2 - 1)))``.
    """
    d = torch.sub(x, tau, out=work).clamp_(min=0.0)
    s1 = d.sum(dim, keepdim=True)
    s2 = torch.linalg.vector_norm(d, dim=dim, keepdim=True).square_()
    k = d.sign_().sum(dim, keepdim=True)
    disc = (s1 * s1 - k * (s2 - 1.0)).clamp_(min=0.0)
    delta = (s2 - 1.0) / (s1 + disc.sqrt())
    return tau + torch.nan_to_num(delta, nan=0.0, posinf=0.0, neginf=0.0), k


def _closed_form(x: torch.Tensor, tau: torch.Tensor, dim: int, work: torch.Tensor) -> torch.Tensor:
    """Exact ``tau`` from the support of a lower bound ``tau`` (see :func:`_closed_form_and_count`)."""
    return _closed_form_and_count(x, tau, dim, work)[0]


def entmax15_threshold(z: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(x, tau)``: the shifted, clamped input ``x = max(z - max z, -2) / 2`` and the exact
    threshold ``tau`` (keepdim along ``dim``), so that ``entmax15(z) = (x - tau)_+^2``."""
    x = _clamped_shifted(z, dim)
    work = torch.empty_like(x)
    tau = _newton_threshold(x, dim, work)
    return x, _closed_form(x, tau, dim, work)


# Newton's largest step below which the closed form is tried early (and checked, row by row)
_EARLY_STEP = 0.05


def _sqrt_entmax_rows(x: torch.Tensor, work: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Write ``(x - tau)_+ = sqrt(entmax15)`` of shifted rows ``x: (rows, n)`` (see
    :func:`_clamped_shifted`) into ``out``, with the exact ``tau``; ``work`` is scratch like ``x``.

    Newton runs only until its largest step is below ``_EARLY_STEP`` (a loose lower bound ``t``);
    the closed form on ``S = {x > t}`` then gives ``tau_c``, and a row is exact when ``tau_c`` keeps
    that support (``|{x > tau_c}| = |S|``, counted exactly: the quadratic's root is then the root of
    ``f``). The few rows that fail the check continue Newton from ``t`` to the full tolerance and
    take the closed form, as :func:`entmax15_threshold` does. Under ``torch.compile`` (no
    data-dependent row selection) that fixed-step path is used for every row.
    """
    if torch.compiler.is_compiling():
        tau = _closed_form(x, _newton_threshold(x, -1, work), -1, work)
        return torch.sub(x, tau, out=out).clamp_(min=0.0)
    loose = _newton_threshold(x, -1, work, tol=_EARLY_STEP)
    tau, k = _closed_form_and_count(x, loose, -1, work)
    torch.sub(x, tau, out=out).clamp_(min=0.0)
    settled = torch.sign(out, out=work).sum(-1, keepdim=True) == k
    if bool(settled.all()):
        return out
    rows = (~settled[:, 0]).nonzero()[:, 0]
    xr = x.index_select(0, rows)
    wr = torch.empty_like(xr)
    tau_r = _closed_form(xr, _newton_threshold(xr, -1, wr, tau=loose.index_select(0, rows)), -1, wr)
    out[rows] = torch.sub(xr, tau_r, out=wr).clamp_(min=0.0)
    return out


# Rows are processed in chunks of about this many elements (4 MiB of float32), so that the few
# passes of the threshold search run in cache instead of streaming the whole (B, H, N, N) tensor.
_CHUNK_ELEMENTS = 1 << 20


def _row_chunks(rows: int, row_len: int) -> list[tuple[int, int]]:
    per = max(1, _CHUNK_ELEMENTS // max(row_len, 1))
    return [(s, min(s + per, rows)) for s in range(0, rows, per)]


def _as_rows(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``(rows, n)`` view of ``t`` with ``dim`` last (a copy only when ``dim`` is not last/contiguous)."""
    return t.movedim(dim, -1).reshape(-1, t.shape[dim])


def _from_rows(rows: torch.Tensor, like: torch.Tensor, dim: int) -> torch.Tensor:
    shape = list(like.shape)
    shape.append(shape.pop(dim))
    return rows.view(shape).movedim(-1, dim)


def _entmax15_sqrt_rows(z: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``sqrt(entmax15(z)) = (x - tau)_+`` of each row of a contiguous ``(rows, n)`` tensor, by chunks,
    into ``out`` (a contiguous tensor like ``z``; fresh by default)."""
    out = torch.empty_like(z) if out is None else out
    chunks = _row_chunks(z.shape[0], z.shape[1])
    if torch.compiler.is_compiling():  # no buffers that outlive the call in a graph
        for a, b in chunks:
            x = _clamped_shifted(z[a:b], -1)
            _sqrt_entmax_rows(x, torch.empty_like(x), out[a:b])
        return out
    # The chunk buffers are kept per thread and reused: allocated afresh, 4 MiB blocks go back to the
    # OS and are faulted in again (see docs/benchmarks.md); slots 2, 3 are not used by blocked.py
    numel = (chunks[0][1] - chunks[0][0]) * z.shape[1]
    xbuf = _scratch_buffer(numel, z.dtype, z.device, slot=2)
    wbuf = _scratch_buffer(numel, z.dtype, z.device, slot=3)
    for a, b in chunks:
        shape = (b - a, z.shape[1])
        x = _clamped_shifted(z[a:b], -1, out=xbuf[: shape[0] * shape[1]].view(shape))
        _sqrt_entmax_rows(x, wbuf[: shape[0] * shape[1]].view(shape), out[a:b])
    return out


def _support_vjp_rows(grad: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Backward of 1.5-entmax on ``(rows, n)`` tensors, chunk by chunk, from ``g = sqrt(p)``."""
    out = torch.empty_like(g)
    for a, b in _row_chunks(g.shape[0], g.shape[1]):
        support_vjp(grad[a:b], g[a:b], -1, out=out[a:b])
    return out


class _Entmax15Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z: torch.Tensor, dim: int) -> torch.Tensor:
        work_dtype = compute_dtype(z.dtype)
        g = _from_rows(_entmax15_sqrt_rows(_as_rows(z.to(work_dtype), dim)), z, dim)  # sqrt(p)
        ctx.dim = dim
        if not ctx.needs_input_grad[0]:
            return g.square_().to(z.dtype)
        # The backward needs sqrt(p): kept from here (one more tensor of z's size while training)
        # because torch.sqrt of the zeros off the support is ~5x slower than elsewhere, and ~4x a mul.
        ctx.save_for_backward(g)
        return g.square().to(z.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor, None]:
        (g,) = ctx.saved_tensors
        dim = ctx.dim
        # d p_i / d z_j = sqrt(p_i) (delta_ij - sqrt(p_j) / sum sqrt(p)) on the support
        grad = _support_vjp_rows(_as_rows(grad_out.to(g.dtype), dim), _as_rows(g, dim))
        return _from_rows(grad, g, dim).to(grad_out.dtype), None


def entmax15(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Exact 1.5-entmax of ``x`` along ``dim`` (any shape); rows of all ``-inf`` give zeros.

    float16 / bfloat16 are computed in float32 and returned in the input dtype.
    """
    check_tensor("x", x)
    check_floating("x", x)
    d = normalize_dim("x", x, dim)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension, got a 0-d tensor")
    if x.shape[d] == 0:
        return x.clone()
    return _Entmax15Function.apply(x, d)
